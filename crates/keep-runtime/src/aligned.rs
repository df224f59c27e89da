//! [`AlignedBuf`]: a heap buffer whose start and length are multiples of [`ALIGN`] (4096 bytes,
//! a multiple of every logical block size O_DIRECT asks for: 512 or 4096), zero-initialised so
//! that its bytes are always defined. The only `unsafe` allocation code of the crate.

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
}
