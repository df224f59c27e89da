//! The bundled default model: found next to the sources in a checkout, or unpacked from the
//! binary into a cache directory on first use (see the README, "The bundled model").

use std::path::PathBuf;

/// Directory of the bundled model, or an error that says how to get one.
pub fn default_model_dir() -> anyhow::Result<PathBuf> {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
    if here.join("config.json").is_file() {
        return Ok(here);
    }
    anyhow::bail!("no bundled model found; pass a model directory")
}
