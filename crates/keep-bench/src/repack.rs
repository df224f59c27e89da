//! `keep bench repack`: repack throughput against a plain copy of the same files, side by
//! side in one run, cold reads for both.
//!
//! The plain copy is `std::fs::copy` of every file (what `cp` does: `copy_file_range` on
//! Linux); neither side fsyncs its output (both leave dirty pages to the kernel alike). Goal:
//! median copy time / repack time ≥ 0.8.

use std::path::Path;

use keep_convert::repack::{repack, RepackOptions, ResidentFormat};

use crate::side::{self, SideBySide, Spec};
use crate::{BenchError, Result};

/// Total bytes of the regular files in a directory.
pub fn dir_bytes(d: &Path) -> Result<u64> {
    let rd = std::fs::read_dir(d).map_err(|e| BenchError::Io {
        path: d.to_path_buf(),
        err: e,
    })?;
    Ok(rd
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum())
}

fn plain_copy(src: &Path, dst: &Path) -> Result<()> {
    let io = |p: &Path, e| BenchError::Io {
        path: p.to_path_buf(),
        err: e,
    };
    std::fs::create_dir_all(dst).map_err(|e| io(dst, e))?;
    for e in std::fs::read_dir(src).map_err(|e| io(src, e))?.flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).map_err(|x| io(&e.path(), x))?;
        }
    }
    Ok(())
}

/// Run `rounds` interleaved rounds on checkpoint `src`, using `scratch` for outputs.
pub fn run(src: &Path, scratch: &Path, rounds: usize) -> Result<SideBySide> {
    let bytes = dir_bytes(src)?;
    let copy_out = scratch.join("bench-copy");
    let repack_out = scratch.join("bench-repack");
    let opts = RepackOptions {
        resident: ResidentFormat::Mxfp8,
        verify: false,
        force: false,
        sync: false,
    };
    side::run(
        src,
        rounds,
        Spec {
            bench: "repack-vs-copy",
            baseline: "copy",
            subject: "repack",
            baseline_bytes: bytes,
            subject_bytes: bytes,
            goal: 0.8,
            run_baseline: &|| plain_copy(src, &copy_out),
            run_subject: &|| {
                repack(src, &repack_out, &opts, &|_, _| {})
                    .map(|_| ())
                    .map_err(Into::into)
            },
            cleanup: &|| {
                let _ = std::fs::remove_dir_all(&copy_out);
                let _ = std::fs::remove_dir_all(&repack_out);
            },
        },
    )
}
