//! Fingerprints that tie calibration files to the model and pack they came from.
//!
//! - model: SHA-256 over `config.json` and the checkpoint's `SHA256SUMS` (or, when there is
//!   none, `model.safetensors.index.json` and the names and sizes of the `*.safetensors` files);
//!   each part is preceded by its name and length so that no two directories hash alike by
//!   concatenation;
//! - tokenizer: SHA-256 of the `tokenizer.json` bytes;
//! - pack: SHA-256 of the pack's `pack.json` (which records the tokenizer fingerprint and the
//!   SHA-256 of the records file).

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{CalibError, Result};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// SHA-256 of bytes as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// SHA-256 of a file as lowercase hex.
pub fn file_sha256(path: &Path) -> Result<String> {
    let b = std::fs::read(path).map_err(|e| CalibError::io(path, e))?;
    Ok(sha256_hex(&b))
}

/// The model fingerprint of a checkpoint directory (see the module doc;
/// [`keep_checkpoint::fingerprint::model_fingerprint`]).
pub fn model_fingerprint(dir: &Path) -> Result<String> {
    Ok(keep_checkpoint::fingerprint::model_fingerprint(dir)?)
}

/// A short form for messages (first 12 hex digits).
pub fn short(fp: &str) -> &str {
    fp.get(..12).unwrap_or(fp)
}
