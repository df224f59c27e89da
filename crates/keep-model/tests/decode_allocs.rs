//! Heap allocations in steady-state decode, counted by a counting global allocator: the bundled
//! model on `keep run`'s default kernels (fast), its cache reserved for the context
//! (`Cache::for_context`, which also sizes the forward's working buffers), a prompt, a warm-up,
//! then N decoded tokens through `Model::forward_into` (the logits in one buffer kept by the
//! caller) whose allocations are counted: the measuring thread's and the kernels' workers' (the
//! worker pool's threads, each marked by a broadcast), not those of the test harness, which
//! starts and reports other tests while one measures (one measurement runs at a time). There are
//! none (`decode_allocates_nothing_per_token`): every activation lives in the cache's scratch
//! and the kernels keep their bookkeeping per thread. `where_decode_allocates` prints them by
//! profile part (run it with `--nocapture`), checks that the parts account for every
//! allocation of the measuring thread, and that no part allocates. DeepSeek-V4 / V4-Flash
//! decode (`tests/data/small-v4flash`) allocates nothing either
//! (`v4flash_decode_allocates_nothing_per_token`), nor does the decode of the other families on
//! their committed fixtures: Qwen3-MoE (`fixtures/qwen3-tiny-*`: bf16, FP8 and MLX 4-bit, a
//! dense layer beside the MoE ones), DeepSeek-V3 (`fixtures/deepseek-v3`: latent attention, the
//! group-limited router, a dense first layer, shared experts) and gpt-oss (`fixtures/gpt-oss`:
//! sliding and full layers, sinks, MXFP4 experts with biases). `keep run`'s loop, `generate`
//! on the bundled model (its cache reserved for the run, one logits buffer, the sampler's
//! nucleus kept), allocates nothing per sampled token either, greedy or temperature + top-p
//! (`generate_allocates_nothing_per_token`).
//! These models' products are all below the kernels' threading threshold; a threaded product
//! called from outside the pool costs rayon's global queue an allocation every few dozen calls
//! (keep-kernels' `tests/fast_allocs.rs` checks the threaded kernels on a pool thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use keep_checkpoint::Checkpoint;
use keep_kernels::profile::{self, Part, PARTS};
use keep_model::generate::argmax;
use keep_model::{Cache, Logits, Model};

/// The system allocator, counting allocations and reallocations.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// Allocations of the measuring thread by the profile part running (last: none running).
static BY_PART: [AtomicU64; PARTS + 1] = [const { AtomicU64::new(0) }; PARTS + 1];

thread_local! {
    /// Whether this thread is the measuring one (no destructor: safe inside the allocator).
    static MEASURING: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread is one of the kernels' worker pool.
    static WORKER: Cell<bool> = const { Cell::new(false) };
}

fn count() {
    let measuring = MEASURING.with(|m| m.get());
    if !measuring && !WORKER.with(|w| w.get()) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if measuring {
        let p = profile::current().map_or(PARTS, |p| p as usize);
        BY_PART[p].fetch_add(1, Ordering::Relaxed);
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

/// One measurement at a time: the counter is every counted thread's.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The bundled model.
fn keep_tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// Allocations per decoded token on the bundled model after `warm` tokens, over `n` tokens,
/// and the measuring thread's by profile part when `by_part` (`None` when the model is not in
/// the tree).
fn allocs_per_token(warm: usize, n: usize, by_part: bool) -> Option<(f64, [u64; PARTS + 1])> {
    allocs_per_token_of(&keep_tiny(), warm, n, by_part)
}

/// [`allocs_per_token`] on the model in `dir`.
fn allocs_per_token_of(
    dir: &std::path::Path,
    warm: usize,
    n: usize,
    by_part: bool,
) -> Option<(f64, [u64; PARTS + 1])> {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // The kernels' workers (rayon's global pool) count as the measuring thread does.
    rayon::broadcast(|_| WORKER.with(|w| w.set(true)));
    if !dir.join("config.json").is_file() {
        eprintln!("{} is not here: skipped", dir.display());
        return None;
    }
    let ck = Checkpoint::open(dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.kernels = keep_model::Kernels::Fast;
    let vocab = model.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 31 + 7) % vocab).collect();
    let mut cache: Cache =
        Cache::for_context(&model.cfg, prompt.len() + warm + n, model.opts.chunk());
    let l = model
        .forward(&prompt, &mut cache, Logits::Last, None)
        .unwrap();
    let mut tok = argmax(&l);
    // The logits of every step land in one buffer kept here (`Model::forward_into`).
    let mut logits = Vec::new();
    let mut step = |tok: u32| {
        model
            .forward_into(&[tok], &mut cache, Logits::Last, None, &mut logits)
            .unwrap();
        argmax(&logits)
    };
    for _ in 0..warm {
        tok = step(tok);
    }
    if by_part {
        profile::start();
        profile::begin_step(0);
    }
    let parts_before: [u64; PARTS + 1] =
        std::array::from_fn(|p| BY_PART[p].load(Ordering::Relaxed));
    let before = ALLOCS.load(Ordering::Relaxed);
    MEASURING.with(|m| m.set(true));
    for _ in 0..n {
        tok = step(tok);
    }
    MEASURING.with(|m| m.set(false));
    let after = ALLOCS.load(Ordering::Relaxed);
    let parts: [u64; PARTS + 1] =
        std::array::from_fn(|p| BY_PART[p].load(Ordering::Relaxed) - parts_before[p]);
    if by_part {
        profile::take();
    }
    let per = (after - before) as f64 / n as f64;
    eprintln!("steady-state decode: {per:.1} heap allocations per token ({n} tokens after {warm})");
    Some((per, parts))
}

/// Where steady-state decode allocates, by profile part, per token (the measuring thread's;
/// the profiler's own step records fall outside every part): nowhere.
#[test]
fn where_decode_allocates() {
    let n = 16;
    let Some((per, parts)) = allocs_per_token(8, n, true) else {
        return;
    };
    for (i, p) in Part::ALL.iter().enumerate() {
        eprintln!(
            "{:<26} {:>8.1} per token",
            p.name(),
            parts[i] as f64 / n as f64
        );
    }
    let mine: u64 = parts.iter().sum();
    eprintln!(
        "measuring thread {:.1} of {per:.1} per token (the rest: the kernels' worker threads)",
        mine as f64 / n as f64
    );
    assert!(mine as f64 <= per * n as f64);
    // Every op writes into the cache's scratch, the kernels' bookkeeping and the routed
    // experts' quantized activations are kept per thread: no part allocates once warm.
    for (i, p) in Part::ALL.iter().enumerate() {
        assert_eq!(
            parts[i],
            0,
            "{} allocates {:.1} times per token in steady-state decode",
            p.name(),
            parts[i] as f64 / n as f64
        );
    }
}

/// No heap allocation per decoded token, on any thread, over a run long enough to pass the
/// sliding window, grow every compressed cache and reach experts first chosen late.
#[test]
fn decode_allocates_nothing_per_token() {
    if let Some((per, _)) = allocs_per_token(8, 200, false) {
        assert_eq!(per, 0.0, "{per} heap allocations per decoded token");
    }
}

/// DeepSeek-V4 / V4-Flash decode (`tests/data/small-v4flash`: hash-routed layers, CSA and HCA
/// compressors, the indexer): no heap allocation per decoded token either.
#[test]
fn v4flash_decode_allocates_nothing_per_token() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/small-v4flash");
    if let Some((per, _)) = allocs_per_token_of(&dir, 8, 100, false) {
        assert_eq!(per, 0.0, "{per} heap allocations per decoded token");
    }
}

/// DeepSeek-V4.1 decode with Engram layers (`tests/data/small-engram`: the n-gram hash, the
/// rows gathered from the tables, their projection and the gated write into the streams): no
/// heap allocation per decoded token either.
#[test]
fn engram_decode_allocates_nothing_per_token() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/small-engram");
    if let Some((per, _)) = allocs_per_token_of(&dir, 8, 100, false) {
        assert_eq!(per, 0.0, "{per} heap allocations per decoded token");
    }
}

/// The committed fixture `name` (under the workspace's `fixtures/`).
fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// Qwen3-MoE decode (bf16, FP8 and MLX 4-bit fixtures): no heap allocation per decoded token.
#[test]
fn qwen3_decode_allocates_nothing_per_token() {
    for name in ["qwen3-tiny-bf16", "qwen3-tiny-fp8", "qwen3-tiny-mlx4"] {
        if let Some((per, _)) = allocs_per_token_of(&fixture(name), 8, 100, false) {
            assert_eq!(per, 0.0, "{name}: {per} heap allocations per decoded token");
        }
    }
}

/// DeepSeek-V3 decode: no heap allocation per decoded token.
#[test]
fn deepseek_v3_decode_allocates_nothing_per_token() {
    if let Some((per, _)) = allocs_per_token_of(&fixture("deepseek-v3"), 8, 100, false) {
        assert_eq!(per, 0.0, "{per} heap allocations per decoded token");
    }
}

/// gpt-oss decode, past its sliding window: no heap allocation per decoded token.
#[test]
fn gpt_oss_decode_allocates_nothing_per_token() {
    if let Some((per, _)) = allocs_per_token_of(&fixture("gpt-oss"), 8, 100, false) {
        assert_eq!(per, 0.0, "{per} heap allocations per decoded token");
    }
}

/// Allocations per sampled token of [`keep_model::generate::generate`] on the bundled model
/// with `sampling`, counted from the `warm`-th token handed on to the `warm + n`-th (each step:
/// sample, hand on, one decode forward); `None` when the model is not in the tree.
fn generate_allocs_per_token(
    sampling: keep_model::generate::SamplerConfig,
    warm: usize,
    n: usize,
) -> Option<f64> {
    use keep_model::generate::{generate, GenerateOptions, Piece, Prompt};
    use std::ops::ControlFlow;
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let dir = keep_tiny();
    if !dir.join("config.json").is_file() {
        eprintln!("{} is not here: skipped", dir.display());
        return None;
    }
    rayon::broadcast(|_| WORKER.with(|w| w.set(true)));
    let ck = Checkpoint::open(&dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.kernels = keep_model::Kernels::Fast;
    // No end-of-sequence token: every run samples all its tokens.
    model.cfg.eos.clear();
    let opts = GenerateOptions {
        max_tokens: warm + n + 1,
        sampling,
        tokenizer: None,
    };
    let (mut seen, mut before, mut after) = (0, 0, 0);
    generate(&mut model, Prompt::Synthetic(16), &opts, None, |p| {
        if let Piece::Token(_) = p {
            seen += 1;
            if seen == warm {
                before = ALLOCS.load(Ordering::Relaxed);
                MEASURING.with(|m| m.set(true));
            } else if seen == warm + n {
                MEASURING.with(|m| m.set(false));
                after = ALLOCS.load(Ordering::Relaxed);
            }
        }
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(seen, warm + n + 1, "tokens handed on");
    let per = (after - before) as f64 / n as f64;
    eprintln!("generate: {per:.2} heap allocations per sampled token ({n} after {warm})");
    Some(per)
}

/// `keep run`'s generation loop, greedy and temperature + top-p: no heap allocation per
/// sampled token on any thread (sampling, handing the token on, the decode forward).
#[test]
fn generate_allocates_nothing_per_token() {
    use keep_model::generate::SamplerConfig;
    let greedy = SamplerConfig {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };
    let top_p = SamplerConfig {
        temperature: 0.8,
        top_p: 0.9,
        seed: 7,
    };
    for (name, s) in [("greedy", greedy), ("top-p", top_p)] {
        if let Some(per) = generate_allocs_per_token(s, 8, 100) {
            assert_eq!(per, 0.0, "{name}: {per} heap allocations per sampled token");
        }
    }
}
