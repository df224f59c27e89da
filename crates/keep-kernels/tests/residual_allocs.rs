//! A batch of E8P experts with residual stages (E8P and E81) on the fast kernels allocates
//! nothing once warm: the residual stages' output buffers are kept between calls, as the
//! job lists are, so a steady decode through `matmul_many_with` does not touch the allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use keep_kernels::simd::Job;
use keep_kernels::{matmul_many_with, E8pResidual, Kernels, WeightView};

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator, counting calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        System.realloc(p, l, n)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

#[test]
fn residual_stages_allocate_nothing_once_warm() {
    let (rows, cols) = (64usize, 256usize);
    let kc = rows * cols / 8;
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let codes: Vec<u16> = (0..kc).map(|_| next() as u16).collect();
    let rcodes: Vec<u16> = (0..kc).map(|_| next() as u16).collect();
    let e81: Vec<u8> = (0..kc).map(|_| next() as u8).collect();
    let scales: Vec<f32> = (0..rows).map(|i| 0.01 + i as f32 * 1e-3).collect();
    let rscales: Vec<f32> = (0..rows).map(|i| 0.001 + i as f32 * 1e-4).collect();
    let base = WeightView::e8p(bytes(&codes), bytes(&scales), rows, cols).unwrap();
    let weights = [
        base.with_residual(E8pResidual {
            codes: bytes(&rcodes),
            scales: bytes(&rscales),
            e81: false,
        })
        .unwrap(),
        base.with_residual(E8pResidual {
            codes: &e81,
            scales: bytes(&rscales),
            e81: true,
        })
        .unwrap(),
    ];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        for m in [1usize, 8] {
            let x: Vec<f32> = (0..m * cols).map(|i| (i % 7) as f32 - 3.0).collect();
            let mut outs = vec![vec![0f32; m * rows]; weights.len()];
            let run = |outs: &mut Vec<Vec<f32>>| {
                let mut jobs: Vec<Job> = weights
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|(w, o)| Job::view(w, &x, m, o).unwrap())
                    .collect();
                let before = ALLOCS.load(Ordering::Relaxed);
                matmul_many_with(Kernels::Fast, &mut jobs).unwrap();
                let n = ALLOCS.load(Ordering::Relaxed) - before;
                drop(jobs);
                n
            };
            run(&mut outs);
            run(&mut outs);
            let warm = run(&mut outs);
            assert_eq!(warm, 0, "m = {m}: {warm} allocations in a warm call");
            assert!(outs.iter().flatten().all(|v| v.is_finite()));
        }
    });
}
