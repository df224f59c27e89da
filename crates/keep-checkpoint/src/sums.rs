//! `SHA256SUMS`: the checksum file every keep output carries, in `sha256sum`'s own format
//! (`<64 hex>  <file name>` per line), so that `sha256sum -c SHA256SUMS` works too.

use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{CheckpointError, Result};

/// The checksum file's name.
pub const SUMS_FILE: &str = "SHA256SUMS";

/// Lowercase hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// SHA-256 of a file, streamed.
pub fn file_sha256(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| CheckpointError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| CheckpointError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Render a sums file from `(name, hex)` pairs, sorted by name.
pub fn render(entries: &[(String, String)]) -> String {
    let mut e = entries.to_vec();
    e.sort();
    e.iter().map(|(n, h)| format!("{h}  {n}\n")).collect()
}

/// Parse a sums file into `(name, hex)` pairs.
pub fn parse(path: &Path, text: &str) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = || CheckpointError::Verify {
            path: path.to_path_buf(),
            msg: format!("line {} is not `<sha256>  <file>`", i + 1),
        };
        let (h, n) = line.split_once(' ').ok_or_else(bad)?;
        let n = n
            .strip_prefix(' ')
            .or_else(|| n.strip_prefix('*'))
            .unwrap_or(n);
        if h.len() != 64 || !h.bytes().all(|b| b.is_ascii_hexdigit()) || n.is_empty() {
            return Err(bad());
        }
        if n.contains("..") || n.starts_with('/') {
            return Err(CheckpointError::Verify {
                path: path.to_path_buf(),
                msg: format!("line {} names `{n}`, outside the directory", i + 1),
            });
        }
        out.push((n.to_string(), h.to_ascii_lowercase()));
    }
    Ok(out)
}

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Files whose hash matched.
    pub ok: Vec<String>,
    /// Files whose hash differs.
    pub mismatched: Vec<String>,
    /// Files listed but absent.
    pub missing: Vec<String>,
    /// Regular files present but not listed (a keep output lists every file it holds, so
    /// each one fails the check).
    pub unlisted: Vec<String>,
}

impl VerifyReport {
    /// True when the sums list at least one file, every listed file is present and matches,
    /// and every file of the directory is listed.
    pub fn passed(&self) -> bool {
        !self.ok.is_empty()
            && self.mismatched.is_empty()
            && self.missing.is_empty()
            && self.unlisted.is_empty()
    }

    /// Why the check failed, in words (`None` when it passed).
    pub fn failure(&self) -> Option<String> {
        if self.passed() {
            return None;
        }
        let mut why = vec![];
        if self.ok.is_empty() && self.mismatched.is_empty() && self.missing.is_empty() {
            why.push(format!("{SUMS_FILE} lists no files"));
        }
        let mut list = |n: usize, what: &str, names: &[String]| {
            if n > 0 {
                let shown: Vec<&str> = names.iter().take(3).map(String::as_str).collect();
                let more = if n > 3 { ", …" } else { "" };
                why.push(format!("{n} {what} ({}{more})", shown.join(", ")));
            }
        };
        list(self.mismatched.len(), "mismatched", &self.mismatched);
        list(self.missing.len(), "missing", &self.missing);
        list(
            self.unlisted.len(),
            &format!("not listed in {SUMS_FILE}"),
            &self.unlisted,
        );
        Some(why.join(", "))
    }
}

/// Check a directory against its `SHA256SUMS`.
pub fn verify_dir(dir: &Path) -> Result<VerifyReport> {
    let sums_path = dir.join(SUMS_FILE);
    let text = crate::small_file::read_text(&sums_path, crate::small_file::MAX_SMALL_FILE)?;
    let entries = parse(&sums_path, &text)?;
    let mut rep = VerifyReport::default();
    let listed: std::collections::HashSet<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    for (name, want) in &entries {
        let p: PathBuf = dir.join(name);
        if !p.is_file() {
            rep.missing.push(name.clone());
            continue;
        }
        if &file_sha256(&p)? == want {
            rep.ok.push(name.clone());
        } else {
            rep.mismatched.push(name.clone());
        }
    }
    let rd = std::fs::read_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if e.path().is_file() && n != SUMS_FILE && !listed.contains(n.as_str()) {
            rep.unlisted.push(n);
        }
    }
    rep.unlisted.sort();
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_detect() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), b"hello").unwrap();
        let h = file_sha256(&d.path().join("a")).unwrap();
        assert_eq!(
            h,
            "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        std::fs::write(d.path().join(SUMS_FILE), render(&[("a".into(), h)])).unwrap();
        assert!(verify_dir(d.path()).unwrap().passed());
        std::fs::write(d.path().join("a"), b"hellO").unwrap();
        let r = verify_dir(d.path()).unwrap();
        assert_eq!(r.mismatched, vec!["a"]);
        std::fs::remove_file(d.path().join("a")).unwrap();
        assert_eq!(verify_dir(d.path()).unwrap().missing, vec!["a"]);
        // An empty or partial SHA256SUMS fails: every file must be listed.
        std::fs::write(d.path().join("a"), b"hello").unwrap();
        std::fs::write(d.path().join(SUMS_FILE), "").unwrap();
        let r = verify_dir(d.path()).unwrap();
        assert!(!r.passed());
        let why = r.failure().unwrap();
        assert!(
            why.contains("lists no files") && why.contains("(a)"),
            "{why}"
        );
        std::fs::write(
            d.path().join(SUMS_FILE),
            render(&[("a".into(), file_sha256(&d.path().join("a")).unwrap())]),
        )
        .unwrap();
        assert!(verify_dir(d.path()).unwrap().passed());
        std::fs::write(d.path().join("b"), b"x").unwrap();
        let r = verify_dir(d.path()).unwrap();
        assert!(!r.passed() && r.unlisted == vec!["b"], "{r:?}");
        assert!(parse(Path::new("S"), "xyz  a\n").is_err());
        assert!(parse(Path::new("S"), &format!("{}  ../etc\n", "0".repeat(64))).is_err());
    }
}
