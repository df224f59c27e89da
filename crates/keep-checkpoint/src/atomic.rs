//! Outputs written so that no user file is ever lost: single files go to a hidden temporary
//! sibling (`.<name>.tmp-<pid>`), are synced, and are renamed over the target, so a reader (or
//! a rerun after a crash) sees the old file or the whole new one, never a part. An existing
//! target is refused unless `force`, and a target that is not a regular file (a directory, a
//! device, a FIFO, a socket, a symbolic link) is refused always, so that a rename can never
//! replace `/dev/full` or a link with a regular file. [`check_disjoint`] refuses an output that
//! is, contains, or lies inside an input; [`exchange`] swaps two paths atomically where the OS
//! allows it (Linux `renameat2(RENAME_EXCHANGE)`, macOS `renamex_np(RENAME_SWAP)`).
//! Directories of shards use [`crate::CheckpointWriter`], which is built on the same checks.

use std::io::Write;
use std::path::{Component, Path, PathBuf};

use crate::{CheckpointError, Result};

/// The temporary sibling this process writes `path` through.
pub fn tmp_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// What kind of file system object `ft` is, in words ("a directory", "a FIFO", …).
pub fn kind_of(ft: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if ft.is_fifo() {
            return "a FIFO";
        }
        if ft.is_char_device() {
            return "a character device";
        }
        if ft.is_block_device() {
            return "a block device";
        }
        if ft.is_socket() {
            return "a socket";
        }
    }
    if ft.is_symlink() {
        "a symbolic link"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_file() {
        "a regular file"
    } else {
        "not a regular file"
    }
}

/// Check that a single-file output may be written at `path`: it does not exist, or it is a
/// regular file (not a link) and `force` is set.
pub fn check_file_target(path: &Path, force: bool) -> Result<()> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CheckpointError::io(path, e)),
        Ok(m) if !m.file_type().is_file() => Err(CheckpointError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_of(&m.file_type()),
        }),
        Ok(_) if !force => Err(CheckpointError::OutputExists {
            path: path.to_path_buf(),
        }),
        Ok(_) => Ok(()),
    }
}

/// Write `bytes` to `path` through a synced temporary sibling and a rename. An existing `path`
/// is refused unless `force`; a `path` that is not a regular file is refused always. On any
/// error the temporary file is removed and `path` is left as it was.
pub fn write_file(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    check_file_target(path, force)?;
    let tmp = tmp_sibling(path);
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        Ok(())
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(CheckpointError::io(path, e));
    }
    place_file(&tmp, path, force)
}

/// Move the finished, synced temporary file `tmp` to `path`: without `force` the move fails if
/// `path` exists (checked by the rename itself where the OS can); with it, `path` must be a
/// regular file and is replaced in one rename. On error `tmp` is removed and `path` untouched.
pub fn place_file(tmp: &Path, path: &Path, force: bool) -> Result<()> {
    place(tmp, path, force).inspect_err(|_| {
        let _ = std::fs::remove_file(tmp);
    })
}

fn place(tmp: &Path, path: &Path, force: bool) -> Result<()> {
    if force {
        check_file_target(path, true)?;
        return std::fs::rename(tmp, path).map_err(|e| CheckpointError::io(path, e));
    }
    match rename_noreplace(tmp, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            Err(CheckpointError::OutputExists {
                path: path.to_path_buf(),
            })
        }
        Err(e) => Err(CheckpointError::io(path, e)),
    }
}

#[cfg(unix)]
fn cstr(p: &Path) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))
}

/// Rename `from` to `to` unless `to` exists (an `AlreadyExists` error then), atomically where
/// the OS has a no-replace rename, else by a check and a rename.
pub fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let (f, t) = (cstr(from)?, cstr(to)?);
        // SAFETY: two valid NUL-terminated paths; renameat2 reads them and nothing else.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                f.as_ptr(),
                libc::AT_FDCWD,
                t.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
            return Err(e);
        }
    }
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "already exists",
        ));
    }
    std::fs::rename(from, to)
}

/// Swap `a` and `b` atomically. `Ok(false)` where the OS or file system cannot (the caller
/// then falls back to two renames).
pub fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let (x, y) = (cstr(a)?, cstr(b)?);
        // SAFETY: two valid NUL-terminated paths; renameat2 reads them and nothing else.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                x.as_ptr(),
                libc::AT_FDCWD,
                y.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(false),
            _ => Err(e),
        };
    }
    #[cfg(target_os = "macos")]
    {
        let (x, y) = (cstr(a)?, cstr(b)?);
        // SAFETY: two valid NUL-terminated paths; renamex_np reads them and nothing else.
        let r = unsafe { libc::renamex_np(x.as_ptr(), y.as_ptr(), libc::RENAME_SWAP) };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EINVAL | libc::ENOTSUP) => Ok(false),
            _ => Err(e),
        };
    }
    #[allow(unreachable_code)]
    {
        let _ = (a, b);
        Ok(false)
    }
}

/// `p` as an absolute path with every existing prefix resolved (links followed) and `.`/`..`
/// removed, so that two spellings of one place compare equal even when the tail does not
/// exist yet.
pub fn resolve(p: &Path) -> PathBuf {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(p)
    };
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            c => {
                out.push(c.as_os_str());
                if let Ok(real) = std::fs::canonicalize(&out) {
                    out = real;
                }
            }
        }
    }
    out
}

/// Refuse an output `out` that is, contains, or lies inside one of `inputs` (after resolving
/// links, `.` and `..`): writing it would replace or change what is being read.
pub fn check_disjoint(out: &Path, inputs: &[&Path]) -> Result<()> {
    check_outside(out, inputs, "the input")
}

/// [`check_disjoint`] with the protected paths named by `role` in the message ("the input",
/// "keep's cache").
pub fn check_outside(out: &Path, inputs: &[&Path], role: &'static str) -> Result<()> {
    let o = resolve(out);
    for i in inputs {
        let r = resolve(i);
        let how = if o == r {
            "is"
        } else if r.starts_with(&o) {
            "contains"
        } else if o.starts_with(&r) {
            "lies inside"
        } else {
            continue;
        };
        return Err(CheckpointError::OutputOverlapsInput {
            path: out.to_path_buf(),
            how,
            role,
            input: i.to_path_buf(),
        });
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
        write_file(&p, b"first", false).unwrap();
        // An existing file is refused without force and left as it was; force replaces it.
        let e = write_file(&p, b"second", false).unwrap_err().to_string();
        assert!(e.contains("already exists") && e.contains("a.bin"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"first");
        write_file(&p, b"second", true).unwrap();
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
        let e = write_file(&bad, b"z", false).unwrap_err().to_string();
        assert!(e.contains("b.bin"), "{e}");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn non_regular_targets_are_never_replaced() {
        let d = tempfile::tempdir().unwrap();
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink("/dev/null", &link).unwrap();
        for (p, kind) in [(&sub, "a directory"), (&link, "a symbolic link")] {
            let e = write_file(p, b"x", true).unwrap_err().to_string();
            assert!(e.contains(kind), "{e}");
        }
        assert!(sub.is_dir());
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        // /dev/null itself (a character device), even with force.
        let e = write_file(Path::new("/dev/null"), b"x", true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("character device"), "{e}");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
    }

    #[test]
    fn outputs_overlapping_inputs_are_refused_however_spelled() {
        let d = tempfile::tempdir().unwrap();
        let m = d.path().join("x").join("m");
        std::fs::create_dir_all(&m).unwrap();
        let dots = m.join("..").join("m");
        let link = d.path().join("l");
        std::os::unix::fs::symlink(&m, &link).unwrap();
        for (out, how) in [
            (dots.clone(), "is"),
            (link.clone(), "is"),
            (d.path().join("x"), "contains"),
            (link.join("new"), "lies inside"),
            (m.join("a").join("..").join("b"), "lies inside"),
        ] {
            let e = check_disjoint(&out, &[&m]).unwrap_err().to_string();
            assert!(e.contains(&format!(" {how} the input ")), "{out:?}: {e}");
        }
        check_disjoint(&d.path().join("x").join("m2"), &[&m]).unwrap();
    }

    #[test]
    fn exchange_swaps_two_directories() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("f"), b"A").unwrap();
        std::fs::write(b.join("f"), b"B").unwrap();
        if exchange(&a, &b).unwrap() {
            assert_eq!(std::fs::read(a.join("f")).unwrap(), b"B");
            assert_eq!(std::fs::read(b.join("f")).unwrap(), b"A");
        }
        // No-replace rename refuses an existing target.
        let e = rename_noreplace(&a, &b).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
    }
}
