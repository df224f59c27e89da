//! The memory a run is planned for is what it allocates: a counting global allocator measures
//! the heap of real forwards on the committed small models of both families (V4.1 with its
//! indexer, V4.1 with Engram layers, V4-Flash) at several chunk sizes and contexts, and checks
//! that the cache [`Cache::for_context`] reserves never reallocates and that the heap's peak
//! above the start stays within `cache_bytes + activation_bytes`. One test function, so no
//! other test's allocations run beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use keep_checkpoint::Checkpoint;
use keep_model::{Cache, Kernels, Logits, Model};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            if new >= l.size() {
                let now = LIVE.fetch_add(new - l.size(), Ordering::Relaxed) + new - l.size();
                // A moving realloc holds both blocks for a moment.
                PEAK.fetch_max(now + l.size(), Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static A: Counting = Counting;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

#[test]
fn planned_memory_bounds_the_heap() {
    for name in ["small", "small-engram", "small-v4flash"] {
        let ck = Checkpoint::open(&data().join(name)).unwrap();
        let mut model = Model::load(&ck).unwrap();
        let vocab = model.cfg.vocab;
        for kernels in [Kernels::Exact, Kernels::Fast] {
            model.opts.kernels = kernels;
            for (context, chunk) in [(40, 1), (150, 16), (150, 150), (700, 64), (700, 5)] {
                model.opts.prefill_chunk = chunk;
                let toks: Vec<u32> = (0..context - 8)
                    .map(|i| ((i * 53 + 7) % vocab) as u32)
                    .collect();
                let base = LIVE.load(Ordering::Relaxed);
                PEAK.store(base, Ordering::Relaxed);
                let mut cache = Cache::for_context(&model.cfg, context, model.opts.chunk());
                let reserved = cache.capacity_bytes();
                let planned_cache = model.cfg.cache_bytes(context, model.opts.chunk());
                assert!(
                    reserved as u64 <= planned_cache,
                    "{name}: reserved {reserved}"
                );
                // The prompt in chunks, then decode to the end of the context.
                let mut last = model
                    .forward(&toks, &mut cache, Logits::Last, None)
                    .unwrap();
                while cache.pos < context {
                    let t = keep_model::generate::argmax(&last);
                    last = model.forward(&[t], &mut cache, Logits::Last, None).unwrap();
                }
                assert_eq!(
                    cache.capacity_bytes(),
                    reserved,
                    "{name} context {context} chunk {chunk}: the cache grew past its reservation"
                );
                drop(last);
                let peak = PEAK.load(Ordering::Relaxed) - base;
                let act = model.cfg.activation_bytes(chunk, context, Logits::Last);
                eprintln!(
                    "{name} {kernels:?} context {context} chunk {chunk}: heap peak {peak} ≤ cache {planned_cache} + activations {act} ({:.0}% used)",
                    100.0 * peak as f64 / (planned_cache + act) as f64
                );
                assert!(
                    peak as u64 <= planned_cache + act,
                    "{name} {kernels:?} context {context} chunk {chunk}: heap peak {peak} > cache {planned_cache} + activations {act}"
                );
                drop(cache);
            }
        }
    }
}
