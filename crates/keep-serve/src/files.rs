//! The model's files as the server opened them ([`FileGuard`]): the identity of every shard
//! (device, inode, size, modification time) recorded at load and compared, one `stat` per
//! shard, before a request is admitted and before every model step. A shard truncated,
//! rewritten or replaced under the running server is then refused with a message naming it
//! (the server answers 503) instead of being read: touching a mapped page past the new end
//! of a truncated file would kill the process (SIGBUS).
//!
//! What it cannot do: a file changed between the check and the read that follows it is read
//! as it is then (the window is one model step); only whole-file changes that move the size,
//! the modification time or the inode are seen.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::{Result, ServeError};

/// What identifies one version of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: i64,
    mtime_nsec: i64,
}

impl Stamp {
    #[cfg(unix)]
    fn of(m: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime: m.mtime(),
            mtime_nsec: m.mtime_nsec(),
        }
    }

    #[cfg(not(unix))]
    fn of(m: &std::fs::Metadata) -> Stamp {
        let t = m
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .unwrap_or_default();
        Stamp {
            dev: 0,
            ino: 0,
            len: m.len(),
            mtime: t.as_secs() as i64,
            mtime_nsec: t.subsec_nanos() as i64,
        }
    }
}

/// A file of the model that is no longer the one the server opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChanged {
    pub path: PathBuf,
    /// What differs.
    pub what: String,
}

impl fmt::Display for FileChanged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the model file {} changed under the running server ({}); it is not read again: restart the server once the model's files are complete",
            self.path.display(),
            self.what
        )
    }
}

/// The shards a model was loaded from, each with the identity it had then.
#[derive(Debug, Clone, Default)]
pub struct FileGuard {
    files: Vec<(PathBuf, Stamp)>,
}

impl FileGuard {
    /// Record the files of `ck` now; each must still have the size it had when `ck` parsed it.
    pub fn of_checkpoint(ck: &keep_checkpoint::Checkpoint) -> Result<FileGuard> {
        let mut files = vec![];
        for s in ck.shards() {
            let stamp = stamp(s.path()).map_err(|e| ServeError::Startup(e.to_string()))?;
            if stamp.len != s.len() {
                return Err(ServeError::Startup(
                    FileChanged {
                        path: s.path().to_path_buf(),
                        what: format!("{} bytes when opened, {} bytes now", s.len(), stamp.len),
                    }
                    .to_string(),
                ));
            }
            files.push((s.path().to_path_buf(), stamp));
        }
        Ok(FileGuard { files })
    }

    /// Record these files now (the model's shards, when they are not a checkpoint's).
    pub fn of_paths(paths: &[PathBuf]) -> Result<FileGuard> {
        let files = paths
            .iter()
            .map(|p| {
                Ok((
                    p.clone(),
                    stamp(p).map_err(|e| ServeError::Startup(e.to_string()))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FileGuard { files })
    }

    /// The files watched.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(p, _)| p.as_path())
    }

    /// `Ok` when every file is the one recorded; else the first that is not.
    pub fn check(&self) -> std::result::Result<(), FileChanged> {
        for (path, was) in &self.files {
            let now = stamp(path)?;
            if now == *was {
                continue;
            }
            let what = if (now.dev, now.ino) != (was.dev, was.ino) {
                "another file is at its path".to_string()
            } else if now.len != was.len {
                format!("{} bytes when opened, {} bytes now", was.len, now.len)
            } else {
                "it was written to after it was opened".to_string()
            };
            return Err(FileChanged {
                path: path.clone(),
                what,
            });
        }
        Ok(())
    }
}

fn stamp(path: &Path) -> std::result::Result<Stamp, FileChanged> {
    std::fs::metadata(path)
        .map(|m| Stamp::of(&m))
        .map_err(|e| FileChanged {
            path: path.to_path_buf(),
            what: format!("it cannot be read: {e}"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_rewritten_or_replaced_file_is_named() {
        let dir = std::env::temp_dir().join(format!("keep-serve-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("model.safetensors");
        std::fs::write(&p, vec![7u8; 4096]).unwrap();
        let g = FileGuard {
            files: vec![(p.clone(), stamp(&p).unwrap())],
        };
        assert_eq!(g.check(), Ok(()));
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(100).unwrap();
        let e = g.check().unwrap_err();
        assert_eq!(e.path, p);
        assert!(
            e.what.contains("4096 bytes when opened, 100 bytes now"),
            "{e}"
        );
        assert!(e.to_string().contains("model.safetensors"), "{e}");
        let tmp = dir.join("new");
        std::fs::write(&tmp, vec![7u8; 4096]).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
        let e = g.check().unwrap_err();
        assert!(e.what.contains("another file"), "{e}");
        std::fs::remove_file(&p).unwrap();
        let e = g.check().unwrap_err();
        assert!(e.what.contains("cannot be read"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
