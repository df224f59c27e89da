//! Heap allocations of a warm decode-sized product on the fast kernels, counted by a counting
//! global allocator: the bf16 kernels round the activations into buffers kept between calls,
//! so a second product of the same shape (bf16, MXFP8, FP8-block; one row) allocates
//! nothing. Where the CPU lacks AVX-512 BF16 these formats run the exact
//! kernels, which allocate nothing either. The same holds for a warm batch of products big
//! enough to be threaded (`matmul_many_with` over FP8-block, MXFP4, E8P and f32 jobs, and a
//! threaded single product), called from a pool thread: its bookkeeping is kept per thread.
//! Only the measuring thread's allocations count: the worker pool may start its threads (and
//! they allocate) while the product runs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use keep_kernels::simd::Job;
use keep_kernels::{matmul_many_with, matmul_with, BlockScales, Kernels, WeightView};

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

#[test]
fn warm_threaded_batches_allocate_nothing() {
    // 2 Mi multiply-adds a product at one row: above the threading threshold, so every batch
    // below runs as row tasks over the pool (with two threads or more).
    let (rows, cols) = (2048usize, 1024usize);
    let q: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 126) as u8).collect();
    let blk = vec![126u8; rows.div_ceil(128) * cols.div_ceil(128)];
    let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 53 % 255) as u8).collect();
    let mx4 = vec![125u8; rows * cols / 32];
    let codes: Vec<u8> = (0..rows * cols / 8 * 2)
        .map(|i| (i * 29 % 251) as u8)
        .collect();
    let e8s: Vec<u8> = (0..rows)
        .flat_map(|i| (0.01f32 + i as f32 * 1e-5).to_le_bytes())
        .collect();
    let f: Vec<u8> = (0..rows * cols)
        .flat_map(|i| ((i % 89) as f32 * 0.01 - 0.4).to_le_bytes())
        .collect();
    let views = [
        WeightView::fp8_block(&q, BlockScales::E8m0(&blk), rows, cols, 128, 128).unwrap(),
        WeightView::mxfp4(&packed, &mx4, rows, cols).unwrap(),
        WeightView::e8p(&codes, &e8s, rows, cols).unwrap(),
        WeightView::f32(&f, rows, cols).unwrap(),
    ];
    let xs: Vec<Vec<f32>> = (0..2)
        .map(|k| {
            (0..cols)
                .map(|i| (i as f32 * 0.37 + k as f32).sin())
                .collect()
        })
        .collect();
    let mut outs = vec![vec![0f32; rows]; 2 * views.len()];
    let mut one = vec![0f32; rows];
    // Two products per format, two inputs (each quantized or rounded once), then each format
    // alone (the single-product paths, threaded too). The job list is the caller's.
    let run = |outs: &mut [Vec<f32>], one: &mut [f32], warm: bool| {
        let mut jobs: Vec<Job> = outs
            .iter_mut()
            .enumerate()
            .map(|(k, out)| Job::view(&views[k / 2], &xs[k % 2], 1, out).unwrap())
            .collect();
        let before = ALLOCS.load(Ordering::Relaxed);
        matmul_many_with(Kernels::Fast, &mut jobs).unwrap();
        let n = ALLOCS.load(Ordering::Relaxed) - before;
        assert!(!warm || n == 0, "a warm threaded batch allocated {n} times");
        for w in &views {
            let before = ALLOCS.load(Ordering::Relaxed);
            matmul_with(Kernels::Fast, &xs[0], 1, w, one).unwrap();
            let n = ALLOCS.load(Ordering::Relaxed) - before;
            assert!(
                !warm || n == 0,
                "{}: a warm threaded matmul_with allocated {n} times",
                w.format_name()
            );
        }
    };
    // On a pool thread: a product called from outside the pool hands its job to rayon's
    // global queue, which grows in blocks (about one allocation per few dozen calls, rayon's,
    // not the kernels'); from a pool thread its tasks go to that thread's own deque.
    rayon::scope(|_| {
        MEASURING.with(|m| m.set(true));
        run(&mut outs, &mut one, false);
        for _ in 0..100 {
            run(&mut outs, &mut one, true);
        }
        MEASURING.with(|m| m.set(false));
    });
}
