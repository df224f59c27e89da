//! Reading the small text files keep trusts to be small (`config.json`, the shard index,
//! `SHA256SUMS`, plans): only regular files, only up to a cap, so that a link to `/dev/zero`
//! or a FIFO is an error naming the file instead of a read that never ends or fills memory
//! (the safetensors header has its own cap in [`crate::safetensors`]).

use std::io::Read;
use std::path::Path;

use crate::{CheckpointError, Result};

/// Largest JSON or text file keep reads whole (a published index of a 1.6T-parameter model is
/// under 10 MiB).
pub const MAX_SMALL_FILE: u64 = 64 << 20;

/// Read `path` (following links) as UTF-8 text, refusing anything that is not a regular file
/// and anything larger than `max` bytes.
pub fn read_text(path: &Path, max: u64) -> Result<String> {
    // Opened without blocking: opening a FIFO for reading would otherwise wait for a writer
    // before the check below could refuse it.
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut opts, libc::O_NONBLOCK);
    let f = opts.open(path).map_err(|e| CheckpointError::io(path, e))?;
    let m = f.metadata().map_err(|e| CheckpointError::io(path, e))?;
    if !m.file_type().is_file() {
        return Err(CheckpointError::NotRegular {
            path: path.to_path_buf(),
            kind: crate::atomic::kind_of(&m.file_type()),
        });
    }
    let mut bytes = Vec::with_capacity(m.len().min(max) as usize);
    f.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| CheckpointError::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(CheckpointError::TooLarge {
            path: path.to_path_buf(),
            max,
        });
    }
    String::from_utf8(bytes).map_err(|_| CheckpointError::Config {
        path: path.to_path_buf(),
        msg: "is not UTF-8 text".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_devices_links_to_them_and_large_files() {
        let d = tempfile::tempdir().unwrap();
        let link = d.path().join("config.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_text(&link, MAX_SMALL_FILE).unwrap_err().to_string();
        assert!(
            e.contains("character device") && e.contains("config.json"),
            "{e}"
        );
        let big = d.path().join("big.json");
        std::fs::write(&big, vec![b' '; 101]).unwrap();
        let e = read_text(&big, 100).unwrap_err().to_string();
        assert!(e.contains("big.json") && e.contains("100"), "{e}");
        assert_eq!(read_text(&big, 101).unwrap().len(), 101);
        let e = read_text(d.path(), 100).unwrap_err().to_string();
        assert!(e.contains("directory"), "{e}");
    }
}
