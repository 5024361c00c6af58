//! The import direction between the core and the backends: the core's scaler, accumulator,
//! optimizer and device reach a backend only where a `Device` becomes one (`backend::check`,
//! `backend::store_for`, `backend::optimizer_store_for`, `backend::scaler_for`), and an
//! accumulator's store reads the scale from what each add hands it, never naming the scaler.

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The lines of `path` that are code: comments and doc comments dropped.
fn code_lines(path: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.split("//").next().unwrap_or("").to_string()))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect()
}

/// Whether `word` stands in `line` as a whole identifier.
fn has_word(line: &str, word: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    line.match_indices(word)
        .any(|(at, _)| !line[..at].ends_with(ident) && !line[at + word.len()..].starts_with(ident))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_core_scaler_accumulator_optimizer_mesh_and_device_name_no_backend_module() {
    let mut files = vec![root().join("src/scaler.rs"), root().join("src/device.rs")];
    rust_files(&root().join("src/accumulator"), &mut files);
    rust_files(&root().join("src/mesh"), &mut files);
    assert!(files.iter().any(|f| f.ends_with("mesh/agreement.rs")), "the mesh is checked");
    rust_files(&root().join("src/optimizer"), &mut files);
    for path in files {
        let file = path.strip_prefix(root()).unwrap().display().to_string();
        for (n, line) in code_lines(&path) {
            assert!(
                !line.contains("backend::cpu") && !line.contains("backend::cuda"),
                "{file}:{n} names a backend module: {line}"
            );
        }
    }
}

/// The optimizer reaches its device's state through the one factory, never naming a backend's
/// item: its store is behind `OptimizerStore`.
#[test]
fn the_optimizer_reaches_a_backend_only_through_its_factory() {
    let mut files = Vec::new();
    rust_files(&root().join("src/optimizer"), &mut files);
    assert!(files.len() > 6, "the optimizer's files were not found: {files:?}");
    let mut calls = 0;
    for path in files {
        let file = path.strip_prefix(root()).unwrap().display().to_string();
        for (n, line) in code_lines(&path) {
            for (at, _) in line.match_indices("backend::") {
                let rest = &line[at + "backend::".len()..];
                assert!(
                    rest.starts_with("optimizer_store_for("),
                    "{file}:{n} names a backend item other than the factory: {line}"
                );
                calls += 1;
            }
            assert!(
                !["HostOptimizer", "DeviceOptimizer", "HostStore", "DeviceStore"]
                    .iter()
                    .any(|w| has_word(&line, w)),
                "{file}:{n} names a backend's store: {line}"
            );
        }
    }
    assert_eq!(calls, 1, "the optimizer makes its store through one factory call");
}

/// The transports name no device: the host transports reach the host's kernels through `simd`
/// (the CPU store is a device like any other), and a device's transport lives with its backend.
#[test]
fn comm_names_no_backend() {
    let mut files = Vec::new();
    rust_files(&root().join("src/comm"), &mut files);
    assert!(files.len() > 5, "the communicators' files were not found: {files:?}");
    for path in files {
        let file = path.strip_prefix(root()).unwrap().display().to_string();
        for (n, line) in code_lines(&path) {
            assert!(!line.contains("backend::"), "{file}:{n} names a backend: {line}");
            assert!(!has_word(&line, "NcclComm"), "{file}:{n} names NCCL: {line}");
        }
    }
}

#[test]
fn no_store_names_the_scaler() {
    let mut files = Vec::new();
    rust_files(&root().join("src/backend"), &mut files);
    // A backend's scaler state and the module that exports it are the scaler's own.
    files.retain(|f| !f.ends_with("scaler.rs") && !f.ends_with("mod.rs"));
    assert!(files.len() > 4, "the backends' files were not found: {files:?}");
    for file in files {
        for (n, line) in code_lines(&file) {
            assert!(
                !line.contains("crate::scaler")
                    && !["Scaler", "CudaScaler", "HostScaler"].iter().any(|w| has_word(&line, w)),
                "{}:{n} names the scaler: {line}",
                file.display()
            );
        }
    }
}

/// A file holds one job: none of the library's sources grows past 1,000 lines.
#[test]
fn no_source_file_is_over_a_thousand_lines() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    rust_files(&root().join("capi/src"), &mut files);
    assert!(files.len() > 50, "the sources were not found: {files:?}");
    for path in files {
        let lines = std::fs::read_to_string(&path).unwrap().lines().count();
        assert!(lines <= 1000, "{} has {lines} lines", path.display());
    }
}
