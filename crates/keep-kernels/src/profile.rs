//! Where a forward's time goes: one small profiler every family's forward, the kernels'
//! parallel regions and the generation loop report to (`keep run --profile`).
//!
//! A thread that calls [`start`] records *steps* (one forward pass: a prefill chunk, a decoded
//! token, a verify window) until it calls [`take`]. Inside a step the code marks what it is
//! doing with [`span`] guards naming a [`Part`]; spans nest, and time is *exclusive*: a child
//! span's time is taken out of its parent's, so every nanosecond of a step belongs to exactly
//! one part and the parts sum to the step's total ([`Part::Other`] holds whatever no span
//! names: the embedding, cache bookkeeping, checks, the caller's code between forwards). A step
//! runs from [`begin_step`] to the next [`begin_step`] (or [`take`]), so a decoded token's step
//! also holds the sampling of the token after it and the printing of it.
//!
//! Beside the exclusive times, each part counts the bytes it read ([`bytes`]: weights, and for
//! [`Part::AttnScores`] the KV rows) so it reads as GB/s against a bandwidth line, and the time
//! threads waited on each other inside the kernels' parallel regions ([`Region`]: from the
//! dispatch to the first task's start, plus the time between the first and the last worker
//! finishing). Waits are *inside* the part that ran the region, not added to it.
//!
//! Zero cost when off: every entry point first loads one relaxed atomic ([`enabled`]) and
//! returns; no clock is read and nothing is allocated. Profiling changes no result: it only
//! reads the clock around the arithmetic.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// What a span of a forward is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Part {
    /// Attention's linear projections (q, k/v, output; DeepSeek's `wq_a`, `wq_b`, `wkv`,
    /// grouped `wo_a`, `wo_b`) with their RoPE.
    AttnProj,
    /// Attention scores, softmax and the weighted sum over the cached rows.
    AttnScores,
    /// The KV compressor (V4.1 `compressor`, V4 CSA/HCA pooling).
    Compressor,
    /// The indexer (its projections, scores and top-k).
    Indexer,
    /// Hyper-connections: the mix projection, collapse and expand (sinkhorn apart).
    HyperConn,
    /// The hyper-connection comb's sinkhorn iterations (with its softmax).
    Sinkhorn,
    /// RMS norms of the block inputs, q/kv/k heads and the final norm.
    Norm,
    /// The router's projection, scoring and top-k (hash routing included).
    Router,
    /// Routed experts: their matmuls, activation, gather and scatter.
    Experts,
    /// Routed experts: quantizing or rounding their activations for the fast kernels.
    ExpertQuant,
    /// The shared expert (Qwen3's dense MLP layers too).
    SharedExpert,
    /// Engram: the row projection and gated write.
    Engram,
    /// The output head (final collapse and the vocabulary projection).
    Head,
    /// Sampling the next token (and a verify window's probabilities).
    Sample,
    /// Waiting on the expert source and the Engram row source (reads under a budget; a view
    /// of the mapping otherwise).
    IoWait,
    /// Handing each sampled token on: detokenizing it and the caller's use of it (`keep run`
    /// prints it).
    Output,
    /// Everything no span names.
    Other,
}

/// Number of parts.
pub const PARTS: usize = 17;

impl Part {
    /// Every part, in report order.
    pub const ALL: [Part; PARTS] = [
        Part::AttnProj,
        Part::AttnScores,
        Part::Compressor,
        Part::Indexer,
        Part::HyperConn,
        Part::Sinkhorn,
        Part::Norm,
        Part::Router,
        Part::Experts,
        Part::ExpertQuant,
        Part::SharedExpert,
        Part::Engram,
        Part::Head,
        Part::Sample,
        Part::IoWait,
        Part::Output,
        Part::Other,
    ];

    /// The name reports and the stats JSON use.
    pub fn name(self) -> &'static str {
        match self {
            Part::AttnProj => "attn_proj",
            Part::AttnScores => "attn_scores",
            Part::Compressor => "attn_compressor",
            Part::Indexer => "attn_indexer",
            Part::HyperConn => "hyper_connections",
            Part::Sinkhorn => "sinkhorn",
            Part::Norm => "norms",
            Part::Router => "router_topk",
            Part::Experts => "routed_experts",
            Part::ExpertQuant => "routed_experts_act_quant",
            Part::SharedExpert => "shared_expert",
            Part::Engram => "engram",
            Part::Head => "head",
            Part::Sample => "sampling",
            Part::IoWait => "io_wait",
            Part::Output => "output",
            Part::Other => "other",
        }
    }
}

/// Which phase of a generation a step belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Phase {
    /// The prompt's forward passes (one step per chunk).
    #[default]
    Prefill,
    /// Decoding (one step per decoded token or verify window).
    Decode,
}

impl Phase {
    /// `"prefill"` / `"decode"`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

/// One step's profile.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Step {
    pub phase: Phase,
    /// Tokens the step's forward ran.
    pub tokens: usize,
    /// Wall time of the step.
    pub total_ns: u64,
    /// Exclusive time per part ([`Part::ALL`] order); sums to `total_ns`.
    pub ns: [u64; PARTS],
    /// Bytes read per part.
    pub bytes: [u64; PARTS],
    /// Time threads waited on each other in the part's parallel regions (inside `ns`).
    pub wait_ns: [u64; PARTS],
    /// Parallel regions run.
    pub regions: u64,
}

impl Step {
    /// Sum of the parts' exclusive times.
    pub fn parts_ns(&self) -> u64 {
        self.ns.iter().sum()
    }
}

/// Threads recording now (the one atomic the off path loads).
static RECORDING: AtomicUsize = AtomicUsize::new(0);

/// Most nested spans tracked (deeper spans are attributed to the deepest tracked one).
const DEPTH: usize = 16;

struct Recorder {
    active: bool,
    phase: Phase,
    origin: Option<Instant>,
    /// Nanoseconds since `origin` when the current part last took the clock.
    last: u64,
    stack: [Part; DEPTH],
    depth: usize,
    /// Nesting beyond `DEPTH` (those spans are not switched to).
    overflow: usize,
    step: Option<Step>,
    step_start: u64,
    steps: Vec<Step>,
}

impl Recorder {
    const fn new() -> Recorder {
        Recorder {
            active: false,
            phase: Phase::Prefill,
            origin: None,
            last: 0,
            stack: [Part::Other; DEPTH],
            depth: 1,
            overflow: 0,
            step: None,
            step_start: 0,
            steps: Vec::new(),
        }
    }

    fn now(&self) -> u64 {
        self.origin.map_or(0, |o| o.elapsed().as_nanos() as u64)
    }

    /// Give the time since `last` to the current part.
    fn charge(&mut self, now: u64) {
        let cur = self.stack[self.depth - 1] as usize;
        if let Some(s) = self.step.as_mut() {
            s.ns[cur] += now.saturating_sub(self.last);
        }
        self.last = now;
    }

    fn close_step(&mut self, now: u64) {
        self.charge(now);
        if let Some(mut s) = self.step.take() {
            s.total_ns = now - self.step_start;
            self.steps.push(s);
        }
    }
}

thread_local! {
    static REC: RefCell<Recorder> = const { RefCell::new(Recorder::new()) };
}

/// Whether any thread records (one relaxed load; every entry point checks it first).
#[inline(always)]
pub fn enabled() -> bool {
    RECORDING.load(Ordering::Relaxed) != 0
}

/// Run `f` on this thread's recorder when it records.
#[inline]
fn with<R>(f: impl FnOnce(&mut Recorder) -> R) -> Option<R> {
    REC.with(|r| {
        let mut r = r.try_borrow_mut().ok()?;
        if r.active {
            Some(f(&mut r))
        } else {
            None
        }
    })
}

/// Start recording on this thread (steps begin at [`begin_step`]); discards an earlier
/// recording of this thread.
pub fn start() {
    REC.with(|r| {
        let mut r = r.borrow_mut();
        if !r.active {
            RECORDING.fetch_add(1, Ordering::Relaxed);
        }
        *r = Recorder::new();
        r.active = true;
        r.origin = Some(Instant::now());
    });
}

/// Stop recording on this thread and return its steps (the open one closed now); empty when
/// it was not recording.
pub fn take() -> Vec<Step> {
    REC.with(|r| {
        let mut r = r.borrow_mut();
        if !r.active {
            return vec![];
        }
        let now = r.now();
        r.close_step(now);
        r.active = false;
        RECORDING.fetch_sub(1, Ordering::Relaxed);
        std::mem::take(&mut r.steps)
    })
}

/// Set the phase the following steps belong to.
#[inline]
pub fn set_phase(p: Phase) {
    if enabled() {
        with(|r| r.phase = p);
    }
}

/// Close the open step (if any) and open one for a forward of `tokens` tokens.
#[inline]
pub fn begin_step(tokens: usize) {
    if !enabled() {
        return;
    }
    with(|r| {
        let now = r.now();
        r.close_step(now);
        r.step_start = now;
        r.step = Some(Step {
            phase: r.phase,
            tokens,
            ..Step::default()
        });
    });
}

/// A span: time from here to its drop goes to its part (see [`span`]).
#[must_use = "a span measures until it is dropped"]
pub struct Span {
    on: bool,
}

/// Open a span of `part` on this thread (a no-op guard when not recording).
#[inline]
pub fn span(part: Part) -> Span {
    if !enabled() {
        return Span { on: false };
    }
    let on = with(|r| {
        let now = r.now();
        r.charge(now);
        if r.depth < DEPTH {
            r.stack[r.depth] = part;
            r.depth += 1;
        } else {
            r.overflow += 1;
        }
    })
    .is_some();
    Span { on }
}

/// A span for quantizing (or rounding) activations for the fast kernels: its own part
/// ([`Part::ExpertQuant`]) inside the routed experts, else inside whatever part runs it.
#[inline]
pub fn quant_span() -> Span {
    if !enabled() {
        return Span { on: false };
    }
    let inside_experts = with(|r| r.stack[r.depth - 1] == Part::Experts).unwrap_or(false);
    if inside_experts {
        span(Part::ExpertQuant)
    } else {
        Span { on: false }
    }
}

impl Drop for Span {
    #[inline]
    fn drop(&mut self) {
        if self.on {
            with(|r| {
                if r.overflow > 0 {
                    r.overflow -= 1;
                    return;
                }
                let now = r.now();
                r.charge(now);
                if r.depth > 1 {
                    r.depth -= 1;
                }
            });
        }
    }
}

/// The part running now on this thread (`None` when it does not record, or from inside the
/// recorder itself: a counting allocator may ask while the recorder allocates).
#[inline]
pub fn current() -> Option<Part> {
    if !enabled() {
        return None;
    }
    REC.try_with(|r| {
        let r = r.try_borrow().ok()?;
        (r.active && r.step.is_some()).then(|| r.stack[r.depth - 1])
    })
    .ok()
    .flatten()
}

/// Count `n` bytes read by `part` in the open step.
#[inline]
pub fn bytes(part: Part, n: usize) {
    if enabled() {
        with(|r| {
            if let Some(s) = r.step.as_mut() {
                s.bytes[part as usize] += n as u64;
            }
        });
    }
}

/// Count `n` bytes read by the part running now on this thread.
#[inline]
pub fn read(n: usize) {
    if enabled() {
        with(|r| {
            let cur = r.stack[r.depth - 1] as usize;
            if let Some(s) = r.step.as_mut() {
                s.bytes[cur] += n as u64;
            }
        });
    }
}

/// Worker slots a [`Region`] tracks (threads past it share the last slot).
const SLOTS: usize = 64;

/// One parallel region of the kernels, measured when the dispatching thread records: tasks
/// call [`Region::task_start`] and [`Region::task_end`]; [`Region::finish`] charges the wait
/// (dispatch to first task start, plus first to last worker finishing) to the current part.
pub struct Region {
    t0: Instant,
    first_start: AtomicU64,
    fin: [AtomicU64; SLOTS],
}

impl Region {
    /// A region when this thread records, else `None` (no clock read).
    #[inline]
    pub fn begin() -> Option<Region> {
        if !enabled() || with(|_| ()).is_none() {
            return None;
        }
        Some(Region {
            t0: Instant::now(),
            first_start: AtomicU64::new(u64::MAX),
            fin: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    /// A task of the region starts (on any thread).
    #[inline]
    pub fn task_start(&self) {
        let t = self.t0.elapsed().as_nanos() as u64;
        self.first_start.fetch_min(t, Ordering::Relaxed);
    }

    /// A task of the region ends (on any thread).
    #[inline]
    pub fn task_end(&self) {
        let t = self.t0.elapsed().as_nanos() as u64 + 1;
        let slot = rayon::current_thread_index().map_or(SLOTS - 1, |i| i.min(SLOTS - 1));
        self.fin[slot].fetch_max(t, Ordering::Relaxed);
    }

    /// The region is over: charge its waits to the current part of this thread.
    pub fn finish(self) {
        let mut lo = u64::MAX;
        let mut hi = 0;
        for f in &self.fin {
            let v = f.load(Ordering::Relaxed);
            if v > 0 {
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        let start = self.first_start.load(Ordering::Relaxed);
        let wait = if hi == 0 { 0 } else { (hi - lo) + start };
        with(|r| {
            let cur = r.stack[r.depth - 1] as usize;
            if let Some(s) = r.step.as_mut() {
                s.wait_ns[cur] += wait;
                s.regions += 1;
            }
        });
    }
}

/// Run `f` on one task of an optional region (the kernels' parallel loops wrap their task
/// bodies in this).
#[inline(always)]
pub fn task<R>(region: Option<&Region>, f: impl FnOnce() -> R) -> R {
    if let Some(r) = region {
        r.task_start();
        let out = f();
        r.task_end();
        out
    } else {
        f()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_exclusive_and_sum_to_the_total() {
        start();
        begin_step(1);
        {
            let _a = span(Part::AttnProj);
            std::thread::sleep(std::time::Duration::from_millis(2));
            {
                let _n = span(Part::Norm);
                std::thread::sleep(std::time::Duration::from_millis(2));
                bytes(Part::Norm, 10);
            }
        }
        begin_step(2);
        {
            let _h = span(Part::Head);
            let _q = quant_span();
        }
        let steps = take();
        assert_eq!(steps.len(), 2);
        let s = &steps[0];
        assert_eq!(s.parts_ns(), s.total_ns);
        assert!(s.ns[Part::AttnProj as usize] > 0 && s.ns[Part::Norm as usize] > 0);
        assert_eq!(s.bytes[Part::Norm as usize], 10);
        assert_eq!(steps[1].tokens, 2);
        assert_eq!(steps[1].parts_ns(), steps[1].total_ns);
        // Quantization outside the routed experts stays in its part.
        assert_eq!(steps[1].ns[Part::ExpertQuant as usize], 0);
        // Off: nothing is recorded and spans are inert.
        let _x = span(Part::Head);
        assert!(take().is_empty());
    }

    /// A threaded product records its parallel region and a wait inside its part, and gives
    /// the same bits as without the profile.
    #[test]
    fn parallel_regions_are_counted_inside_their_part() {
        let (rows, cols) = (1024, 4096);
        let w: Vec<u8> = (0..rows * cols)
            .flat_map(|i| (((i * 7919) % 1000) as f32 * 1e-3 - 0.5).to_le_bytes())
            .collect();
        let view = crate::WeightView::f32(&w, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 * 0.1).collect();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            let mut plain = vec![0f32; rows];
            crate::matmul(&x, 1, &view, &mut plain).unwrap();
            start();
            begin_step(1);
            let mut out = vec![0f32; rows];
            {
                let _p = span(Part::Head);
                crate::matmul(&x, 1, &view, &mut out).unwrap();
            }
            let steps = take();
            assert_eq!(
                plain.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            let s = &steps[0];
            assert_eq!(s.regions, 1);
            assert!(s.wait_ns[Part::Head as usize] <= s.ns[Part::Head as usize]);
            assert_eq!(s.parts_ns(), s.total_ns);
        });
    }
}
