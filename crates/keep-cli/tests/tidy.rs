//! Tidy checks over the whole workspace: every Rust source file opens with a `//!` paragraph
//! that says what it is (GUIDE §8.3).

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![];
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("fuzz/fuzz_targets"), &mut files);
    assert!(files.len() > 20, "found only {} files", files.len());
    let missing: Vec<_> = files
        .iter()
        .filter(|p| {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            !text.trim_start().starts_with("//!")
        })
        .collect();
    assert!(
        missing.is_empty(),
        "files without a leading //! doc: {missing:?}"
    );
}
