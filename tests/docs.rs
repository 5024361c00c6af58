//! Statements of the docs that a test can hold to the code: the README's API table against the
//! functions the generated header exports.

use std::collections::BTreeSet;

fn read(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
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
        let name: String = code[at..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after = code[at + name.len()..].trim_start();
        let starts_word = at == 0 || !code[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
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
    for row in table.lines().skip_while(|l| !l.starts_with("| status")).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = row.split('|').collect();
        let prefix = match cells[1].trim() {
            "status" => "gradacc",
            "scaler" => "gradacc_scaler",
            "accumulator" => "gradacc_accumulator",
            "communicator" => "gradacc_comm",
            other => panic!("an API table row for `{other}`"),
        };
        for name in cells[2].split('`').skip(1).step_by(2) {
            names.insert(if name.starts_with('_') { format!("{prefix}{name}") } else { name.to_string() });
        }
    }
    names
}

#[test]
fn the_readme_api_table_lists_every_exported_function() {
    let (exported, listed) = (exported(), in_readme_table());
    assert!(exported.len() >= 46, "the header parse found only {} functions: {exported:?}", exported.len());
    let missing: Vec<_> = exported.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&exported).collect();
    assert!(missing.is_empty(), "exported but not in the README's API table: {missing:?}");
    assert!(unknown.is_empty(), "in the README's API table but not exported: {unknown:?}");
}
