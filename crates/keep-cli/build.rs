//! Build script: embed the bundled model (`models/keep-tiny/`) and its calibration pack
//! (`models/keep-tiny-pack/`), every regular file, in the binary, so that `keep` finds its
//! defaults from any directory after `cargo install`. Generates `$OUT_DIR/bundled_files.rs`:
//! `FILES` and `PACK_FILES`, each a `&[(&str, &[u8])]` of file names and bytes, and
//! `FILES_SHA256` and `PACK_FILES_SHA256`, each a `&[(&str, &str)]` of file names and the
//! SHA-256 of their bytes computed here, which the unpacked copy is checked against (so a
//! cached copy rewritten together with its SHA256SUMS is still refused).

use std::path::PathBuf;

use sha2::{Digest, Sha256};

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let mut code = String::new();
    for (name, dir) in [("FILES", "keep-tiny"), ("PACK_FILES", "keep-tiny-pack")] {
        code.push_str(&embed(name, &manifest.join("../../models").join(dir)));
    }
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("bundled_files.rs");
    std::fs::write(out, code).expect("write generated file");
}

fn embed(static_name: &str, dir: &std::path::Path) -> String {
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries = vec![];
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() {
                println!("cargo:rerun-if-changed={}", p.display());
                entries.push((e.file_name().to_string_lossy().to_string(), p));
            }
        }
    }
    entries.sort();
    let mut code = format!("/// Files of `{}`, embedded at build time.\npub static {static_name}: &[(&str, &[u8])] = &[\n", dir.display());
    for (name, path) in &entries {
        code.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            path.canonicalize().expect("exists").display().to_string()
        ));
    }
    code.push_str("];\n");
    code.push_str(&format!(
        "/// SHA-256 of each file of `{static_name}`, computed at build time.\npub static {static_name}_SHA256: &[(&str, &str)] = &[\n"
    ));
    for (name, path) in &entries {
        let bytes = std::fs::read(path).expect("readable");
        let hex: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        code.push_str(&format!("    ({name:?}, {hex:?}),\n"));
    }
    code.push_str("];\n");
    code
}
