//! [`AlignedBuf`]: a heap buffer whose start and length are multiples of [`ALIGN`] (4096 bytes,
//! a multiple of every logical block size O_DIRECT asks for: 512 or 4096), zero-initialised so
//! that its bytes are always defined. The only `unsafe` allocation code of the crate. And
//! [`read_block`]: the alignment a file's direct reads need (its device's logical block size),
//! which Engram row reads align to.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

/// Alignment of every buffer, offset and length of a direct read.
pub const ALIGN: usize = 4096;

/// Round `v` down to a multiple of [`ALIGN`].
pub fn align_down(v: u64) -> u64 {
    v & !(ALIGN as u64 - 1)
}

/// Round `v` up to a multiple of [`ALIGN`].
pub fn align_up(v: u64) -> u64 {
    v.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// An owned, zeroed, [`ALIGN`]-aligned byte buffer of a fixed length (a multiple of [`ALIGN`]).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is a plain owned allocation (like `Box<[u8]>`); access is governed by the
// usual `&`/`&mut` rules through the methods below.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; `&AlignedBuf` only gives out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of at least `len` bytes (rounded up to [`ALIGN`]; at least one block).
    /// `None` when the allocation fails or the size overflows.
    pub fn new(len: usize) -> Option<AlignedBuf> {
        let len = (len.max(1)).checked_next_multiple_of(ALIGN)?;
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        Some(AlignedBuf {
            ptr: NonNull::new(ptr)?,
            len,
        })
    }

    /// Length in bytes (a multiple of [`ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a buffer holds at least one block).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this size and alignment.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// How a file's read block was found ([`read_block`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSource {
    /// `statx(STATX_DIOALIGN)`: the file's direct-I/O offset alignment, which the filesystem
    /// reports for that file (Linux 6.1 and later, on filesystems that implement it).
    Statx,
    /// `/sys/dev/block/MAJ:MIN/queue/logical_block_size` of the device the file lives on (or of
    /// the disk holding that partition).
    Sysfs,
    /// Neither said: [`ALIGN`], a multiple of every logical block size.
    Default,
}

impl BlockSource {
    /// `statx`, `sysfs` or `default`.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockSource::Statx => "statx",
            BlockSource::Sysfs => "sysfs",
            BlockSource::Default => "default",
        }
    }
}

/// The alignment direct reads of `f` need: its offsets and lengths must be multiples of it.
/// Asked in order of `statx`'s STATX_DIOALIGN (the filesystem's answer for this file; a file
/// it says takes no direct I/O reads through the page cache, by pages: [`ALIGN`]), the
/// device's `queue/logical_block_size` in sysfs, else [`ALIGN`]. A power of two from 512 to
/// [`ALIGN`]; anything else reported is taken as unknown. (BLKSSZGET would need the block
/// device opened, which takes privileges a reader of the file does not have.)
pub fn read_block(f: &std::fs::File) -> (u64, BlockSource) {
    let ok = |b: u64| b.is_power_of_two() && (512..=ALIGN as u64).contains(&b);
    match statx_dio_align(f) {
        Some(Some(b)) if ok(b) => return (b, BlockSource::Statx),
        Some(None) => return (ALIGN as u64, BlockSource::Statx),
        _ => {}
    }
    match sysfs_logical_block(f) {
        Some(b) if ok(b) => (b, BlockSource::Sysfs),
        _ => (ALIGN as u64, BlockSource::Default),
    }
}

/// `Some(Some(align))`: STATX_DIOALIGN's offset alignment; `Some(None)`: the filesystem
/// answered that the file takes no direct I/O; `None`: no answer.
#[cfg(target_os = "linux")]
fn statx_dio_align(f: &std::fs::File) -> Option<Option<u64>> {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a zeroed statx is a valid value for the kernel to fill.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx on a descriptor we own, an empty NUL-terminated path with AT_EMPTY_PATH
    // (the descriptor itself) and a buffer of the right type.
    let r = unsafe {
        libc::statx(
            f.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if r != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    Some((stx.stx_dio_offset_align > 0).then_some(stx.stx_dio_offset_align as u64))
}

#[cfg(not(target_os = "linux"))]
fn statx_dio_align(_f: &std::fs::File) -> Option<Option<u64>> {
    None
}

/// The logical block size sysfs gives the device holding `f` (a partition's is its disk's).
#[cfg(target_os = "linux")]
fn sysfs_logical_block(f: &std::fs::File) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let dev = f.metadata().ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let base = std::path::PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    [
        base.join("queue/logical_block_size"),
        base.join("../queue/logical_block_size"),
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok()?.trim().parse().ok())
}

#[cfg(not(target_os = "linux"))]
fn sysfs_logical_block(_f: &std::fs::File) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_rounded() {
        for n in [0usize, 1, 4095, 4096, 4097, 100_000] {
            let b = AlignedBuf::new(n).unwrap();
            assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
            assert!(b.len() >= n && b.len().is_multiple_of(ALIGN));
            assert!(b.as_slice().iter().all(|&x| x == 0));
        }
        assert_eq!(align_down(4097), 4096);
        assert_eq!(align_up(4097), 8192);
        assert_eq!(align_up(0), 0);
    }

    #[test]
    fn a_files_read_block_is_a_power_of_two_up_to_a_page() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, [0u8; 10]).unwrap();
        let (b, how) = read_block(&std::fs::File::open(&p).unwrap());
        eprintln!("{}: {b} bytes ({})", p.display(), how.as_str());
        assert!(b.is_power_of_two() && (512..=ALIGN as u64).contains(&b));
    }
}
