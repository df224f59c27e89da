//! Cold reads: evict a file's pages from the page cache before a timed read.
//!
//! Linux: `fsync` (so dirty pages can be dropped) then `posix_fadvise(POSIX_FADV_DONTNEED)`
//! over the whole file; no root needed. Other systems: a no-op that says so.

use std::path::Path;

use crate::{BenchError, Result};

/// Whether [`evict`] really evicts on this platform.
pub const EVICTS: bool = cfg!(target_os = "linux");

/// Drop `path`'s cached pages.
pub fn evict(path: &Path) -> Result<()> {
    let io = |e| BenchError::Io {
        path: path.to_path_buf(),
        err: e,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    f.sync_all().map_err(io)?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; offset 0 and length 0 mean the whole file.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(io(std::io::Error::from_raw_os_error(rc)));
        }
    }
    Ok(())
}

/// Drop the cached pages of every regular file in a directory.
pub fn evict_dir(dir: &Path) -> Result<()> {
    let rd = std::fs::read_dir(dir).map_err(|e| BenchError::Io {
        path: dir.to_path_buf(),
        err: e,
    })?;
    for e in rd.flatten() {
        if e.path().is_file() {
            evict(&e.path())?;
        }
    }
    Ok(())
}
