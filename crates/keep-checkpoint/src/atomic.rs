//! Single files written atomically: the bytes go to a hidden temporary sibling
//! (`.<name>.tmp-<pid>`), are synced, and the file is renamed over the target, so a reader (or a
//! rerun after a crash) sees the old file or the whole new one, never a part. Directories of
//! shards use [`crate::CheckpointWriter`] instead.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{CheckpointError, Result};

/// The temporary sibling this process writes `path` through.
pub fn tmp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Write `bytes` to `path` through a synced temporary sibling and a rename; on any error the
/// temporary file is removed and `path` is left as it was.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_sibling(path);
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(CheckpointError::io(path, e));
    }
    Ok(())
}

/// Remove the temporary siblings in `dir` left by processes that no longer run (Linux: by
/// `/proc/<pid>`; where that cannot be told, nothing is removed).
pub fn remove_stale_tmp(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if !n.starts_with('.') {
            continue;
        }
        let Some((_, pid)) = n.rsplit_once(".tmp-") else {
            continue;
        };
        let alive = match pid.parse::<u32>() {
            Ok(p) if Path::new("/proc/self").exists() => Path::new(&format!("/proc/{p}")).exists(),
            _ => true,
        };
        if !alive {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_whole_files_and_leaves_nothing_behind() {
        let d = std::env::temp_dir().join(format!("keep-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("a.bin");
        write_file(&p, b"first").unwrap();
        write_file(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        // A stale sibling of a process that cannot exist is removed; ours is not touched.
        let stale = d.join(".a.bin.tmp-4294967295");
        std::fs::write(&stale, b"x").unwrap();
        let ours = tmp_sibling(&p);
        std::fs::write(&ours, b"y").unwrap();
        remove_stale_tmp(&d);
        assert!(!stale.exists());
        assert!(ours.exists());
        std::fs::remove_file(&ours).unwrap();
        // A directory that does not exist is an error naming the path, and nothing is left.
        let bad = d.join("missing").join("b.bin");
        let e = write_file(&bad, b"z").unwrap_err().to_string();
        assert!(e.contains("b.bin"), "{e}");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
