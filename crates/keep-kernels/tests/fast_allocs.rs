//! Heap allocations of a warm decode-sized product on the fast kernels, counted by a counting
//! global allocator: the bf16 kernels round the activations into buffers kept between calls,
//! so a second product of the same shape (bf16, MXFP8, FP8-block; one row) allocates
//! nothing. Where the CPU lacks AVX-512 BF16 these formats run the exact
//! kernels, which allocate nothing either. Only the measuring thread's allocations count: the
//! worker pool may start its threads (and they allocate) while the product runs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use keep_kernels::{matmul_with, BlockScales, Kernels, WeightView};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Whether this thread is the measuring one (no destructor: safe inside the allocator).
    static MEASURING: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    if MEASURING.with(|m| m.get()) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count();
        System.realloc(ptr, layout, new)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn warm_fast_products_allocate_nothing() {
    // Small enough to run on this thread (below the threading threshold).
    let (rows, cols) = (16usize, 256usize);
    let bf: Vec<u8> = (0..rows * cols)
        .flat_map(|i| (0x3F80u16 + (i % 97) as u16).to_le_bytes())
        .collect();
    let q: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 126) as u8).collect();
    let mx = vec![127u8; rows * cols / 32];
    let blk = vec![126u8; rows.div_ceil(128) * cols.div_ceil(128)];
    let views = [
        WeightView::bf16(&bf, rows, cols).unwrap(),
        WeightView::mxfp8(&q, &mx, rows, cols).unwrap(),
        WeightView::fp8_block(&q, BlockScales::E8m0(&blk), rows, cols, 128, 128).unwrap(),
    ];
    let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0f32; rows];
    MEASURING.with(|m| m.set(true));
    for w in &views {
        let one = |out: &mut Vec<f32>| matmul_with(Kernels::Fast, &x, 1, w, out).unwrap();
        one(&mut out);
        let before = ALLOCS.load(Ordering::Relaxed);
        one(&mut out);
        let n = ALLOCS.load(Ordering::Relaxed) - before;
        assert_eq!(
            n,
            0,
            "{}: a warm matmul_with allocated {n} times",
            w.format_name()
        );
    }
}
