//! The bundled default model (`keep-tiny`) and its calibration pack: embedded in the
//! binary at build time and unpacked on first use into a cache directory, verified against
//! their SHA256SUMS.
//!
//! Where it goes: `$KEEP_CACHE_DIR`, else `$XDG_CACHE_HOME/keep`, else `~/.cache/keep`, in a
//! folder named after the hash of the embedded SHA256SUMS (`keep-tiny-<12 hex>`), so a newer
//! binary with another model unpacks beside an older one. Unpacking writes a temporary sibling
//! and renames it, so an interrupted first run never leaves a half model behind. Every use
//! checks the cached copy against the SHA-256 of each embedded file, computed when the binary
//! was built (not only against the SHA256SUMS beside it, which whoever changed a file can
//! change too), and that it holds no other file; a copy that fails is refused with a message
//! saying how to clear it.

use std::path::{Path, PathBuf};

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
    unpack("keep-tiny", embedded::FILES, embedded::FILES_SHA256)
}

/// Directory of the bundled calibration pack (made from the model's held-out corpus).
pub fn default_pack_dir() -> anyhow::Result<PathBuf> {
    unpack(
        "keep-tiny-pack",
        embedded::PACK_FILES,
        embedded::PACK_FILES_SHA256,
    )
}

fn unpack(
    name: &str,
    files: &[(&str, &[u8])],
    digests: &[(&str, &str)],
) -> anyhow::Result<PathBuf> {
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
    if let Err(why) = check_built_in(&dir, digests) {
        bail!(
            "the cached bundled {name} at {} is not the one built into this keep binary: {why}; delete that directory and run again",
            dir.display()
        );
    }
    Ok(dir)
}

/// Check that `dir` holds exactly the files of `digests`, each with its built-in SHA-256.
fn check_built_in(dir: &Path, digests: &[(&str, &str)]) -> Result<(), String> {
    for (file, want) in digests {
        let p = dir.join(file);
        match keep_checkpoint::sums::file_sha256(&p) {
            Ok(h) if h == *want => {}
            Ok(_) => return Err(format!("{file} differs")),
            Err(e) => return Err(e.to_string()),
        }
    }
    let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if !digests.iter().any(|(f, _)| *f == n) {
            return Err(format!("it holds {n}, which the binary does not"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The built-in digests are those of the embedded bytes, and agree with the bundled
    /// model's own SHA256SUMS.
    #[test]
    fn built_in_digests_match_the_embedded_files() {
        use sha2::{Digest, Sha256};
        for (files, digests) in [
            (super::embedded::FILES, super::embedded::FILES_SHA256),
            (
                super::embedded::PACK_FILES,
                super::embedded::PACK_FILES_SHA256,
            ),
        ] {
            assert_eq!(files.len(), digests.len());
            let sums = files
                .iter()
                .find(|(n, _)| *n == "SHA256SUMS")
                .map(|(_, b)| String::from_utf8_lossy(b).to_string())
                .unwrap_or_default();
            for ((n, bytes), (dn, hex)) in files.iter().zip(digests) {
                assert_eq!(n, dn);
                let h: String = Sha256::digest(bytes)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                assert_eq!(&h, hex, "{n}");
                if *n != "SHA256SUMS" {
                    assert!(sums.contains(&format!("{h}  {n}")), "{n} not in SHA256SUMS");
                }
            }
        }
    }
}
