//! Statements of the docs that a test can hold to the code: the README's API table against the
//! functions the generated header exports, the header's promise that every function states
//! its thread safety and every constructor the function that frees its result, and the README's
//! Rust loop against the crate documentation's, which runs as a doctest.

use std::collections::BTreeSet;

fn read(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every `gradacc_*` function declared in include/gradacc.h (comments stripped).
fn exported() -> BTreeSet<String> {
    let header = read("include/gradacc.h");
    let mut code = String::new();
    let mut rest = header.as_str();
    while let Some(at) = rest.find("/*") {
        code.push_str(&rest[..at]);
        rest = rest[at..].find("*/").map_or("", |end| &rest[at + end + 2..]);
    }
    code.push_str(rest);
    let mut names = BTreeSet::new();
    for (at, _) in code.match_indices("gradacc_") {
        let name: String =
            code[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after = code[at + name.len()..].trim_start();
        let starts_word =
            at == 0 || !code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        if starts_word && after.starts_with('(') {
            names.insert(name);
        }
    }
    names
}

/// The functions the README's "API at a glance" table names; a name that starts with `_` takes
/// its row's prefix.
fn in_readme_table() -> BTreeSet<String> {
    let readme = read("README.md");
    let table = readme.split("## The API at a glance").nth(1).expect("the README has an API table");
    let mut names = BTreeSet::new();
    for row in
        table.lines().skip_while(|l| !l.starts_with("| status")).take_while(|l| l.starts_with('|'))
    {
        let cells: Vec<&str> = row.split('|').collect();
        let prefix = match cells[1].trim() {
            "status" | "conversion" => "gradacc",
            "scaler" => "gradacc_scaler",
            "accumulator" => "gradacc_accumulator",
            "optimizer" => "gradacc_optimizer",
            "communicator" => "gradacc_comm",
            "mesh" => "gradacc_mesh",
            "diagnostics" => "gradacc",
            other => panic!("an API table row for `{other}`"),
        };
        for name in cells[2].split('`').skip(1).step_by(2) {
            names.insert(if name.starts_with('_') {
                format!("{prefix}{name}")
            } else {
                name.to_string()
            });
        }
    }
    names
}

#[test]
fn the_readme_api_table_lists_every_exported_function() {
    let (exported, listed) = (exported(), in_readme_table());
    assert!(
        exported.len() >= 46,
        "the header parse found only {} functions: {exported:?}",
        exported.len()
    );
    let missing: Vec<_> = exported.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&exported).collect();
    assert!(missing.is_empty(), "exported but not in the README's API table: {missing:?}");
    assert!(unknown.is_empty(), "in the README's API table but not exported: {unknown:?}");
}

/// Each exported function with the doc comment just before its declaration.
fn documented_functions() -> Vec<(String, String)> {
    let header = read("include/gradacc.h");
    let mut out = Vec::new();
    let mut rest = header.as_str();
    while let Some(open) = rest.find("/**") {
        let Some(close) = rest[open..].find("*/") else { break };
        let doc = &rest[open + 3..open + close];
        rest = &rest[open + close + 2..];
        // The declaration that follows, up to its parameter list.
        let decl = rest.split(['(', ';', '{']).next().unwrap_or("");
        if decl.contains("/*") || !rest.trim_start().starts_with("GRADACC_API") {
            continue;
        }
        if let Some(name) = decl.split_whitespace().last().map(|n| n.trim_start_matches('*')) {
            if name.starts_with("gradacc_") {
                out.push((name.to_string(), doc.to_string()));
            }
        }
    }
    out
}

#[test]
fn every_function_states_its_thread_safety_and_every_constructor_its_destroy() {
    let functions = documented_functions();
    let names: BTreeSet<String> = functions.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(names, exported(), "a function without a doc comment right before it");
    for (name, doc) in &functions {
        assert!(doc.contains("Thread safety:"), "{name} states no thread safety");
        let creates = ["_create", "_adopt_"].iter().any(|c| name.contains(c))
            && !name.ends_with("_config_default");
        if creates {
            let object = if name.starts_with("gradacc_comm_") {
                "gradacc_comm"
            } else {
                &name[..name.find("_create").unwrap()]
            };
            let destroy = format!("{object}_destroy");
            assert!(
                doc.contains(&destroy),
                "{name} does not name {destroy}, which frees its result"
            );
        }
    }
}

/// The README's Rust examples are the crate documentation's first two examples (whose doctests
/// run them), without their hidden lines.
#[test]
fn the_readme_rust_loop_is_the_tested_crate_example() {
    // The `nth` block that opens with `open`.
    let fence = |text: &str, open: &str, nth: usize| -> String {
        let mut start = 0;
        for _ in 0..=nth {
            let at = text[start..].find(open).unwrap_or_else(|| panic!("no {open:?} block"));
            start += at + open.len();
            start += text[start..].find("```").expect("an unclosed block") + 3;
        }
        let body = &text[..start - 3];
        body[body.rfind(open).expect("the block") + open.len()..].to_string()
    };
    let crate_doc: String = read("src/lib.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let readme = read("README.md");
    let rust = readme.split("### Rust (the crate `gradacc`)").nth(1).expect("a Rust section");
    for nth in 0..2 {
        let tested: String = fence(&crate_doc, "```\n", nth)
            .lines()
            .filter(|l| !l.starts_with("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(fence(rust, "```rust\n", nth), tested, "example {nth}");
    }
}

/// Every environment variable the library reads (the one list, `gradacc::ENVIRONMENT`) has its row
/// on the diagnostics page.
#[test]
fn every_environment_variable_has_a_row_on_the_diagnostics_page() {
    let page = read("docs/diagnostics.md");
    assert!(gradacc::ENVIRONMENT.len() >= 4);
    for (name, _) in gradacc::ENVIRONMENT {
        assert!(
            page.contains(&format!("| `{name}` |")),
            "docs/diagnostics.md has no row for {name}"
        );
    }
}
