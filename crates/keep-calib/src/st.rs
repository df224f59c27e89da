//! The safetensors plumbing of calibration files: tensors are keep-checkpoint's [`Tensor`]
//! (written by its one single-file writer, `tensor_file`), typed reads are keep-artifacts'
//! [`StFile`], and the calibration files' layout (data in name order) is keep-artifacts'
//! `st::write`; here only those names and the atomic writes of JSON files.

use std::collections::BTreeMap;
use std::path::Path;

pub use keep_artifacts::st::StFile;
pub use keep_checkpoint::tensor_file::Tensor;

use crate::Result;

/// Write `tensors` with `metadata` to `path` atomically (temporary sibling, sync, rename; an
/// existing `path` only if `force`, a `path` that is not a regular file never), data in name
/// order (keep-artifacts' `st::write`).
pub fn write_atomic(
    path: &Path,
    tensors: Vec<Tensor>,
    metadata: &BTreeMap<String, String>,
    force: bool,
) -> Result<()> {
    Ok(keep_artifacts::st::write(path, tensors, metadata, force)?)
}

/// Write bytes to `path` through a synced temporary sibling and a rename
/// ([`keep_checkpoint::atomic::write_file`]); an existing `path` is refused unless `force`.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    Ok(keep_checkpoint::atomic::write_file(path, bytes, force)?)
}

/// Remove temporary siblings in `dir` left by processes that no longer run.
pub fn remove_stale_tmp(dir: &Path) {
    keep_checkpoint::atomic::remove_stale_tmp(dir)
}
