//! The model fingerprint: SHA-256 over `config.json` and the checkpoint's `SHA256SUMS` (or,
//! when there is none, `model.safetensors.index.json` and the names and sizes of the
//! `*.safetensors` files); each part is preceded by its name and length so that no two
//! directories hash alike by concatenation. Calibration files and pruning plans record it, so
//! that they are never applied to another model.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{CheckpointError, Result};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn part(h: &mut Sha256, name: &str, bytes: &[u8]) {
    h.update((name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// The model fingerprint of a checkpoint directory (see the module doc).
pub fn model_fingerprint(dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    h.update(b"keep-model-fingerprint-v1");
    let cfg = dir.join("config.json");
    let bytes = std::fs::read(&cfg).map_err(|e| CheckpointError::io(&cfg, e))?;
    part(&mut h, "config.json", &bytes);
    let sums = dir.join("SHA256SUMS");
    if sums.is_file() {
        let b = std::fs::read(&sums).map_err(|e| CheckpointError::io(&sums, e))?;
        part(&mut h, "SHA256SUMS", &b);
    } else {
        let idx = dir.join("model.safetensors.index.json");
        if idx.is_file() {
            let b = std::fs::read(&idx).map_err(|e| CheckpointError::io(&idx, e))?;
            part(&mut h, "model.safetensors.index.json", &b);
        }
        let rd = std::fs::read_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
        let mut shards: Vec<(String, u64)> = rd
            .flatten()
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().to_string();
                let len = e.metadata().ok()?.len();
                n.ends_with(".safetensors").then_some((n, len))
            })
            .collect();
        shards.sort();
        for (n, len) in shards {
            part(&mut h, &n, &len.to_le_bytes());
        }
    }
    Ok(hex(&h.finalize()))
}
