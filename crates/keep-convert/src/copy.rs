//! Copying a tensor's bytes from a mapped shard into a checkpoint writer, with the next chunk's
//! read already requested from the kernel (`MADV_WILLNEED`), so the disk works while the
//! writer thread hashes and writes. Shared by repack and prune.

use keep_checkpoint::writer::CheckpointWriter;
use keep_checkpoint::{Checkpoint, TensorRef};

use crate::Result;

/// Bytes handed to the writer at a time.
pub const CHUNK: usize = 16 << 20;

/// Copy `bytes` (a sub-slice of tensor `t`'s data starting `start` bytes into it) to the
/// writer as tensor `name`, reading ahead one chunk.
pub fn copy_range(
    ck: &Checkpoint,
    w: &mut CheckpointWriter,
    name: &str,
    t: &TensorRef,
    start: usize,
    len: usize,
) -> Result<()> {
    let shard = &ck.shards()[t.shard];
    let bytes = &t.bytes[start..start + len];
    shard.advise_willneed(t.file_offset + start as u64, CHUNK.min(len));
    for (i, c) in bytes.chunks(CHUNK).enumerate() {
        let next = (i + 1) * CHUNK;
        if next < len {
            shard.advise_willneed(t.file_offset + (start + next) as u64, CHUNK.min(len - next));
        }
        w.write_chunk(name, c)?;
    }
    Ok(())
}

/// Copy a whole tensor under `name`.
pub fn copy_tensor(
    ck: &Checkpoint,
    w: &mut CheckpointWriter,
    name: &str,
    t: &TensorRef,
) -> Result<()> {
    copy_range(ck, w, name, t, 0, t.bytes.len())
}
