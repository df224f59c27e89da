//! The bundled default model (`keep-tiny`) and its calibration pack: embedded in the
//! binary at build time and unpacked on first use into a cache directory, verified against
//! their SHA256SUMS.
//!
//! Where it goes: `$KEEP_CACHE_DIR`, else `$XDG_CACHE_HOME/keep`, else `~/.cache/keep`, in a
//! folder named after the hash of the embedded SHA256SUMS (`keep-tiny-<12 hex>`), so a newer
//! binary with another model unpacks beside an older one. Unpacking writes a temporary sibling
//! and renames it, so an interrupted first run never leaves a half model behind; a cached copy
//! that fails verification is refused with a message saying how to clear it.

use std::path::PathBuf;

use anyhow::{bail, Context};
use sha2::{Digest, Sha256};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/bundled_files.rs"));
}

/// The cache root.
pub fn cache_root() -> anyhow::Result<PathBuf> {
    if let Some(d) = std::env::var_os("KEEP_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("keep"));
    }
    match std::env::var_os("HOME") {
        Some(h) => Ok(PathBuf::from(h).join(".cache/keep")),
        None => bail!("no cache directory: set KEEP_CACHE_DIR (or HOME)"),
    }
}

/// Directory of the bundled model, unpacking it on first use.
pub fn default_model_dir() -> anyhow::Result<PathBuf> {
    unpack("keep-tiny", embedded::FILES)
}

/// Directory of the bundled calibration pack (made from the model's held-out corpus).
pub fn default_pack_dir() -> anyhow::Result<PathBuf> {
    unpack("keep-tiny-pack", embedded::PACK_FILES)
}

fn unpack(name: &str, files: &[(&str, &[u8])]) -> anyhow::Result<PathBuf> {
    let Some((_, sums)) = files.iter().find(|(n, _)| *n == "SHA256SUMS") else {
        bail!("this keep binary was built without its bundled {name} (models/{name} was missing at build time); pass a path instead");
    };
    let tag: String = Sha256::digest(sums)
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = cache_root()?.join("models").join(format!("{name}-{tag}"));
    if !dir.join("SHA256SUMS").is_file() {
        let parent = dir.parent().expect("has a parent");
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let tmp = parent.join(format!(".{name}-{tag}.unpack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        for (file, bytes) in files {
            std::fs::write(tmp.join(file), bytes)
                .with_context(|| format!("writing {}", tmp.join(file).display()))?;
        }
        if let Err(e) = std::fs::rename(&tmp, &dir) {
            let _ = std::fs::remove_dir_all(&tmp);
            // Another process may have unpacked it meanwhile.
            if !dir.join("SHA256SUMS").is_file() {
                return Err(e).with_context(|| format!("moving {name} into {}", dir.display()));
            }
        }
    }
    let r = keep_checkpoint::sums::verify_dir(&dir)?;
    if !r.passed() {
        bail!(
            "the cached bundled {name} at {} does not match its SHA256SUMS ({} mismatched, {} missing); delete that directory and run again",
            dir.display(),
            r.mismatched.len(),
            r.missing.len()
        );
    }
    Ok(dir)
}
