//! Build script: embed the bundled model (`models/keep-tiny/`, every regular file) in the
//! binary, so that `keep` finds its default model from any directory after `cargo install`.
//! Generates `$OUT_DIR/bundled_files.rs`: a `&[(&str, &[u8])]` of file names and bytes.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let dir = manifest.join("../../models/keep-tiny");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries = vec![];
    if let Ok(rd) = std::fs::read_dir(&dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_file() {
                println!("cargo:rerun-if-changed={}", p.display());
                entries.push((e.file_name().to_string_lossy().to_string(), p));
            }
        }
    }
    entries.sort();
    let mut code = String::from("/// The bundled model's files, embedded at build time.\npub static FILES: &[(&str, &[u8])] = &[\n");
    for (name, path) in &entries {
        code.push_str(&format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            path.canonicalize().expect("exists").display().to_string()
        ));
    }
    code.push_str("];\n");
    let out =
        PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("bundled_files.rs");
    std::fs::write(out, code).expect("write generated file");
}
