//! The slot cache: per MoE layer a fixed number of slots, each an aligned buffer that holds one
//! routed expert (its three matrices as stored), an expert→slot map, and a replacement
//! [`Policy`] — one of keep-residency's online policies, told of every use (a pass is one
//! "token" of its stream; its experts in ascending id) and asked for the victim among the
//! slots that are not in use, so `keep residency` replays what this cache does (a one-token
//! pass exactly; a prefill pass reads each of its experts once). Missing experts are read by the [`IoPool`] straight into free or evicted slots;
//! the model sees only [`ExpertWeights`] views of a slot and never where the bytes came from.
//!
//! How a layer's pass goes (the model calls [`SlotCache::prefetch`] once per layer per forward
//! with every expert the batch routes to, then asks for them in chunks, in ascending order):
//!
//! - `prefetch`: every routed expert counts once as a hit (resident) or a miss; hits are pinned
//!   for the pass; misses are queued and read *in parallel* into free slots, then into slots the
//!   policy gives up (never a pinned one). In decode (≤ top-k experts, and at least top-k slots)
//!   every miss is in flight before the first matrix is multiplied.
//! - `prefetch_exact` (hash-routed layers, whose experts follow from the token ids): the same
//!   pass, started by the runtime as soon as the tokens are known, before any layer runs; the
//!   model's own `prefetch` for that layer then finds the pass already started (same experts)
//!   and does nothing, so nothing is counted twice. Their wait is reported on its own
//!   ([`CacheStats::hash_wait_secs`]).
//! - `expert_views_many`: waits for those experts' reads if they are still in flight and hands
//!   out views of their slots, all valid together (the model multiplies a token by all its
//!   top-k experts in one kernel call; it asks for at most as many experts as a layer has
//!   slots). In prefill a chunk can route to more experts than there are slots: the queue is then
//!   drained as slots of experts already served in this pass free up, so each missing expert is
//!   read at most once per layer per chunk (the model serves experts in ascending order, which is
//!   the queue's order: routes sorted by expert).
//!
//! **Validity of views.** A view of layer `L` stays valid until the next call into the cache for
//! layer `L` (the slots handed out last are `held` and never reused before that). keep-model's
//! MoE loop holds a chunk's views only within its loop iteration, which satisfies this; the cache is only
//! reachable through [`crate::BudgetedModel`], whose `forward` takes `&mut self`, so passes never
//! interleave.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use keep_model::{ExpertSource, ExpertTiers, ExpertWeights, ModelError, Rung, UpperChoice};

use crate::aligned::AlignedBuf;
use crate::io::IoPool;
use keep_residency::policy::{SlotPolicy, Start, Stream};
use keep_residency::sim::order_by;
use keep_residency::tiers::{Choice, Entry, TierPolicy};

use crate::policy::Policy;
use crate::store::ExpertStore;
use crate::{Result, RuntimeError};

/// One slot's buffer. Written only by the I/O job that holds the slot in `Loading`; read only
/// through views handed out while it is `Ready`.
struct SlotBuf(UnsafeCell<AlignedBuf>);

// SAFETY: access is synchronised by the layer's state machine (see the module doc and the
// comments at each access): a `Loading` slot has exactly one writer and no readers; a `Ready`
// slot has no writer.
unsafe impl Sync for SlotBuf {}

#[derive(Debug, Clone, PartialEq)]
enum Status {
    Empty,
    Loading,
    Ready,
    Failed(String),
}

struct LayerState {
    slot_expert: Vec<Option<usize>>,
    status: Vec<Status>,
    /// expert → slot.
    map: Vec<Option<usize>>,
    /// Slots of this pass's experts not served yet.
    pinned: Vec<bool>,
    /// Slots whose views were handed out by the last call (not reused before the next call).
    held: Vec<bool>,
    /// Missing experts of this pass without a slot yet, in the order they will be asked for.
    pending: VecDeque<usize>,
    policy: Box<dyn SlotPolicy>,
    /// Passes of this layer so far (a pass is one "token" of the policy's stream).
    tick: u64,
    /// The policy's index of the next use: `(pass − 1) · n_experts + j` for the pass's `j`-th.
    next_access: usize,
    hits: u64,
    misses: u64,
    wait_secs: f64,
    /// Slots filled by a next-layer guess and not used since.
    speculative: Vec<bool>,
    /// The guess made for this layer's coming pass (to score it).
    guess: Vec<usize>,
    guess_stats: GuessStats,
    /// The experts of a pass already started by `prefetch_exact` (hash-routed layers).
    exact: Option<Vec<usize>>,
    /// Passes started by `prefetch_exact`.
    exact_passes: u64,
    /// Whether this layer routes by token id (its waits are reported apart).
    hash: bool,
}

/// How the next-layer guesses did (see [`SlotCache::set_next_guess`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GuessStats {
    /// Passes that had a guess.
    pub passes: u64,
    /// Experts guessed.
    pub guessed: u64,
    /// Experts routed in passes that had a guess.
    pub routed: u64,
    /// Routed experts that were guessed.
    pub right: u64,
    /// Reads issued for guesses.
    pub reads: u64,
    /// Guessed reads that the pass then used (misses turned into hits, read ahead of time).
    pub saved: u64,
}

struct Layer {
    bufs: Vec<SlotBuf>,
    st: Mutex<LayerState>,
    cv: Condvar,
}

#[derive(Default)]
struct IoClock {
    in_flight: usize,
    since: Option<Instant>,
    busy_secs: f64,
}

struct Inner {
    store: ExpertStore,
    slots: usize,
    layers: Vec<Layer>,
    clock: Mutex<IoClock>,
    bytes_read: AtomicU64,
    experts_read: AtomicU64,
    warm_bytes: AtomicU64,
    /// A guess of the next layer's experts, issued after the current layer's own reads.
    next_guess: Mutex<Option<(usize, Vec<usize>)>>,
    /// Precision tiers (`None`: every slot at the store's one rung).
    tiers: Option<Tiers>,
}

/// One residual stage's buffer: written only by its read job while the entry is loading, read
/// only through views handed out while it is ready and held (see [`Tiers`]).
struct UpperBuf(UnsafeCell<AlignedBuf>);

// SAFETY: as for `SlotBuf`: a loading entry has one writer (its read job) and no views; a ready
// one has no writer; an entry is freed only when ready and not held.
unsafe impl Sync for UpperBuf {}
unsafe impl Send for UpperBuf {}

/// Precision tiers: per routed slot, the upper stage if it is in memory, else the base now and
/// the stage read in the background (never waited for) into an LRU residual cache of a fixed
/// number of bytes: keep-residency's [`TierPolicy`], the rule the deterministic evaluation and
/// the replay run too, with its reads completed by the reader threads.
///
/// Keys are `layer · n_experts + expert`. An entry answered [`UpperChoice::Use`] in a layer's
/// pass is *held* until that layer's next pass begins (its views stay valid until the next call
/// for the layer, as slots' do); held and loading entries are never evicted.
struct Tiers {
    tau: f32,
    st: Mutex<TierState>,
}

struct TierState {
    pol: TierPolicy,
    bufs: std::collections::HashMap<u64, Arc<UpperBuf>>,
    /// The runtime's own counters (reads done and failed, aligned bytes read, wait); the
    /// serving counters are the policy's.
    stats: TierStats,
}

/// What the precision tiers did (zero without tiers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierStats {
    /// Routed slots computed at the upper rung (stage in memory).
    pub upper: u64,
    /// Routed slots computed at the base rung.
    pub base: u64,
    /// Of `base`: slots with gate ≥ τ whose expert has an upper stage not in memory.
    pub upper_misses: u64,
    /// Of `upper_misses`: the stage's read was already in flight.
    pub in_flight: u64,
    /// Residual reads issued (admissions).
    pub admissions: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Misses not admitted: every entry that could go was loading or held.
    pub no_room: u64,
    /// Residual reads that failed (the entry is dropped; its slots stay at the base rung).
    pub failed: u64,
    /// Slots with gate ≥ τ.
    pub above_tau: u64,
    /// Residual bytes read (aligned reads).
    pub bytes_read: u64,
    /// Residual reads finished.
    pub reads_done: u64,
    /// Seconds a forward waited for a residual read: none ever does (the rule this cache
    /// implements); kept as a counter so that the report states it.
    pub wait_secs: f64,
    /// Bytes of the residual cache and of the entries in it now.
    pub cache_bytes: u64,
    pub cached_bytes: u64,
    pub tau: f32,
}

impl TierStats {
    /// `upper / (upper + upper_misses)` (1 when no slot wanted its upper stage).
    pub fn upper_hit_rate(&self) -> f64 {
        let n = self.upper + self.upper_misses;
        if n == 0 {
            1.0
        } else {
            self.upper as f64 / n as f64
        }
    }
}

/// Hits and misses of one layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    pub hits: u64,
    pub misses: u64,
}

/// What the cache did so far.
#[derive(Debug, Clone, Default)]
pub struct CacheStats {
    /// Routed experts per layer per forward that were resident.
    pub hits: u64,
    /// Routed experts per layer per forward that had to be read.
    pub misses: u64,
    /// Bytes read from the checkpoint (aligned reads; warm start excluded).
    pub bytes_read: u64,
    /// Expert reads (a miss is read once; more only if a prefill chunk overflows the slots).
    pub experts_read: u64,
    /// Wall seconds with at least one read in flight.
    pub io_busy_secs: f64,
    /// Seconds the forward waited for reads.
    pub wait_secs: f64,
    /// Bytes read to fill slots before the run (warm start).
    pub warm_bytes: u64,
    pub per_layer: Vec<LayerStats>,
    pub slots_per_layer: usize,
    pub slot_bytes: u64,
    pub direct_io: bool,
    pub io_threads: usize,
    /// Next-layer guesses (zero unless prefetch is on).
    pub guess: GuessStats,
    /// Of `wait_secs`, the seconds spent in hash-routed layers (their reads start when the
    /// tokens are known, so this is what is left after the exact prefetch).
    pub hash_wait_secs: f64,
    /// Layer passes whose reads started from the token ids (hash-routed layers).
    pub exact_passes: u64,
    /// Hits and misses of the hash-routed layers (part of `hits` / `misses`).
    pub hash_hits: u64,
    pub hash_misses: u64,
    /// Precision tiers' counters (`None` without tiers).
    pub tiers: Option<TierStats>,
}

impl CacheStats {
    /// `hits / (hits + misses)` (1 when nothing was routed).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            1.0
        } else {
            self.hits as f64 / n as f64
        }
    }

    /// Read bandwidth while reads were in flight, GB/s (10⁹ bytes).
    pub fn read_gbps(&self) -> f64 {
        if self.io_busy_secs > 0.0 {
            self.bytes_read as f64 / self.io_busy_secs / 1e9
        } else {
            0.0
        }
    }
}

/// `policy` started for a layer of `n` experts in `slots` slots, one pass per policy "token";
/// with `order`, the slots start filled with its top (warm start).
fn start_policy(
    mut policy: Box<dyn SlotPolicy>,
    n: usize,
    slots: usize,
    order: Option<&[u16]>,
) -> Box<dyn SlotPolicy> {
    let prefill = order.is_some();
    let identity: Vec<u16>;
    let order = match order {
        Some(o) => o,
        None => {
            identity = (0..n).map(|e| e as u16).collect();
            &identity
        }
    };
    policy.reset(
        &Stream {
            experts: &[],
            top_k: n,
            n_experts: n,
        },
        &Start {
            capacity: slots,
            order,
            prefill,
        },
    );
    policy
}

/// Per-layer slots over an [`ExpertStore`].
pub struct SlotCache {
    inner: Arc<Inner>,
    pool: IoPool,
    /// The residual stages' reader threads (apart from the slots', so that a background
    /// residual read never queues ahead of a read a forward waits for).
    upper_pool: Option<IoPool>,
}

fn poisoned<T>(_: T) -> ModelError {
    ModelError::Cache("the slot cache's lock was poisoned by a panic".into())
}

impl Inner {
    fn io_start(&self) {
        if let Ok(mut c) = self.clock.lock() {
            if c.in_flight == 0 {
                c.since = Some(Instant::now());
            }
            c.in_flight += 1;
        }
    }

    fn io_end(&self, bytes: u64) {
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
        self.experts_read.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut c) = self.clock.lock() {
            c.in_flight = c.in_flight.saturating_sub(1);
            if c.in_flight == 0 {
                if let Some(t) = c.since.take() {
                    c.busy_secs += t.elapsed().as_secs_f64();
                }
            }
        }
    }

    /// A slot for a new read: an empty one, else the policy's victim among ready slots that are
    /// not held by the last call (and not pinned unless `steal`).
    fn find_slot(st: &LayerState, steal: bool) -> Option<usize> {
        let free = (0..st.status.len()).find(|&s| st.status[s] == Status::Empty && !st.held[s]);
        if free.is_some() {
            return free;
        }
        let (mut slots, mut experts) = (vec![], vec![]);
        for s in 0..st.status.len() {
            let ok = st.status[s] == Status::Ready && !st.held[s] && (steal || !st.pinned[s]);
            if let (true, Some(e)) = (ok, st.slot_expert[s]) {
                slots.push(s);
                experts.push(e as u16);
            }
        }
        st.policy.victim(&experts).map(|c| slots[c])
    }

    /// Put expert `e` into slot `s` and queue its read.
    fn assign(self: &Arc<Self>, pool: &IoPool, l: usize, st: &mut LayerState, s: usize, e: usize) {
        if let Some(old) = st.slot_expert[s] {
            st.map[old] = None;
        }
        st.slot_expert[s] = Some(e);
        st.map[e] = Some(s);
        st.status[s] = Status::Loading;
        st.pinned[s] = true;
        st.speculative[s] = false;
        self.io_start();
        let inner = self.clone();
        let job = move || {
            let layer = &inner.layers[l];
            // SAFETY: slot `s` of layer `l` is `Loading`, so this job is its only user: views
            // are made only of `Ready` slots, and a slot becomes `Loading` only when it is
            // neither held nor `Loading` (so no view of it is alive — see the
            // module doc); nothing else touches it until the status below is published.
            let dst = unsafe { (*layer.bufs[s].0.get()).as_mut_slice() };
            let r = inner.store.read_into(l, e, dst);
            inner.io_end(*r.as_ref().unwrap_or(&0));
            if let Ok(mut st) = layer.st.lock() {
                st.status[s] = match r {
                    Ok(_) => Status::Ready,
                    Err(err) => Status::Failed(err.to_string()),
                };
            }
            layer.cv.notify_all();
        };
        if !pool.submit(job) {
            self.io_end(0);
            st.status[s] = Status::Failed("the I/O pool has shut down".into());
        }
    }

    /// Give queued experts slots while there are slots to give.
    fn issue(self: &Arc<Self>, pool: &IoPool, l: usize, st: &mut LayerState) {
        while let Some(&e) = st.pending.front() {
            let Some(s) = Self::find_slot(st, false) else {
                break;
            };
            st.pending.pop_front();
            self.assign(pool, l, st, s, e);
        }
    }
}

impl SlotCache {
    /// `slots` slots per layer over `store`, each [`ExpertStore::slot_bytes`] long, with
    /// `io_threads` reader threads.
    pub fn new(
        store: ExpertStore,
        slots: usize,
        policy: Policy,
        io_threads: usize,
    ) -> Result<SlotCache> {
        Self::with_tiers(store, slots, policy, io_threads, None)
    }

    /// [`Self::new`] with precision tiers: `tiers` = (τ, residual cache bytes, residual reader
    /// threads). The store should be [`ExpertStore::open_tiered`] (experts without a residual
    /// stage there are always at their one rung).
    pub fn with_tiers(
        store: ExpertStore,
        slots: usize,
        policy: Policy,
        io_threads: usize,
        tiers: Option<(f32, u64, usize)>,
    ) -> Result<SlotCache> {
        let (n_layers, n_experts) = (store.n_layers(), store.n_experts());
        if n_experts > u16::MAX as usize + 1 {
            return Err(RuntimeError::Invalid(format!(
                "{n_experts} experts per layer: the cache's policies index at most 65536"
            )));
        }
        let slots = slots.min(n_experts).max(1);
        let sb = store.slot_bytes() as usize;
        let mut layers = Vec::with_capacity(n_layers);
        for l in 0..n_layers {
            // A layer with fewer experts than the others (hash-routed layers a pruned
            // checkpoint kept whole) never needs more slots than it has experts.
            let n_experts = store.experts_in(l).max(1);
            let slots = slots.min(n_experts);
            let bufs = (0..slots)
                .map(|_| {
                    AlignedBuf::new(sb)
                        .map(|b| SlotBuf(UnsafeCell::new(b)))
                        .ok_or_else(|| {
                            RuntimeError::Invalid(format!("cannot allocate a slot of {sb} bytes"))
                        })
                })
                .collect::<Result<Vec<_>>>()?;
            layers.push(Layer {
                bufs,
                st: Mutex::new(LayerState {
                    slot_expert: vec![None; slots],
                    status: vec![Status::Empty; slots],
                    map: vec![None; n_experts],
                    pinned: vec![false; slots],
                    held: vec![false; slots],
                    pending: VecDeque::new(),
                    policy: start_policy(policy.make(), n_experts, slots, None),
                    tick: 0,
                    next_access: 0,
                    hits: 0,
                    misses: 0,
                    wait_secs: 0.0,
                    speculative: vec![false; slots],
                    guess: vec![],
                    guess_stats: GuessStats::default(),
                    exact: None,
                    exact_passes: 0,
                    hash: false,
                }),
                cv: Condvar::new(),
            });
        }
        let pool = IoPool::new(io_threads)
            .map_err(|e| RuntimeError::Invalid(format!("starting the I/O threads: {e}")))?;
        let (tier_state, upper_pool) = match tiers {
            None => (None, None),
            Some((tau, bytes, threads)) => {
                if tau.is_nan() {
                    return Err(RuntimeError::Invalid("τ is not a number".into()));
                }
                let p = IoPool::new(threads).map_err(|e| {
                    RuntimeError::Invalid(format!("starting the residual I/O threads: {e}"))
                })?;
                let upper: Vec<Vec<u64>> = (0..n_layers)
                    .map(|l| {
                        (0..n_experts)
                            .map(|e| store.upper_bytes(l, e).unwrap_or(0))
                            .collect()
                    })
                    .collect();
                let pol = TierPolicy::new(tau, bytes, upper, None)
                    .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
                let st = TierState {
                    pol,
                    bufs: Default::default(),
                    stats: TierStats::default(),
                };
                (
                    Some(Tiers {
                        tau,
                        st: Mutex::new(st),
                    }),
                    Some(p),
                )
            }
        };
        Ok(SlotCache {
            inner: Arc::new(Inner {
                store,
                slots,
                layers,
                clock: Mutex::new(IoClock::default()),
                bytes_read: AtomicU64::new(0),
                experts_read: AtomicU64::new(0),
                warm_bytes: AtomicU64::new(0),
                next_guess: Mutex::new(None),
                tiers: tier_state,
            }),
            pool,
            upper_pool,
        })
    }

    /// The store the slots are filled from.
    pub fn store(&self) -> &ExpertStore {
        &self.inner.store
    }

    /// Slots per layer.
    pub fn slots_per_layer(&self) -> usize {
        self.inner.slots
    }

    /// Seed each layer's policy with warm-start scores (`scores[layer][expert]`; layers past
    /// the end get none) and fill its slots with the best-scored experts, waiting for the reads.
    pub fn warm(&self, scores: &[Vec<f64>]) -> Result<()> {
        for (l, layer) in self.inner.layers.iter().enumerate() {
            let Some(sc) = scores.get(l) else { continue };
            let mut st = layer.st.lock().map_err(poisoned)?;
            let n = st.map.len();
            let clean: Vec<f64> = (0..n)
                .map(|e| sc.get(e).copied().filter(|v| v.is_finite()).unwrap_or(0.0))
                .collect();
            let order = order_by(&clean);
            let policy = std::mem::replace(&mut st.policy, Policy::Lru.make());
            let slots = st.status.len();
            st.policy = start_policy(policy, n, slots, Some(&order));
            for e in order.into_iter().map(usize::from).take(slots) {
                if st.map[e].is_none() {
                    if let Some(s) = Inner::find_slot(&st, true) {
                        self.inner.assign(&self.pool, l, &mut st, s, e);
                    }
                }
            }
            st.pinned.iter_mut().for_each(|p| *p = false);
        }
        for layer in &self.inner.layers {
            let mut st = layer.st.lock().map_err(poisoned)?;
            while st.status.contains(&Status::Loading) {
                st = layer.cv.wait(st).map_err(poisoned)?;
            }
            for s in 0..st.status.len() {
                if let Status::Failed(msg) = st.status[s].clone() {
                    return Err(RuntimeError::Invalid(format!("warm start: {msg}")));
                }
            }
        }
        let b = self.inner.bytes_read.swap(0, Ordering::Relaxed);
        self.inner.warm_bytes.fetch_add(b, Ordering::Relaxed);
        self.inner.experts_read.store(0, Ordering::Relaxed);
        if let Ok(mut c) = self.inner.clock.lock() {
            c.busy_secs = 0.0;
        }
        Ok(())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> CacheStats {
        let mut s = CacheStats {
            bytes_read: self.inner.bytes_read.load(Ordering::Relaxed),
            experts_read: self.inner.experts_read.load(Ordering::Relaxed),
            warm_bytes: self.inner.warm_bytes.load(Ordering::Relaxed),
            slots_per_layer: self.inner.slots,
            slot_bytes: self.inner.store.slot_bytes(),
            direct_io: self.inner.store.direct_io(),
            io_threads: self.pool.threads(),
            ..Default::default()
        };
        if let Ok(c) = self.inner.clock.lock() {
            s.io_busy_secs = c.busy_secs
                + match (c.in_flight, c.since) {
                    (n, Some(t)) if n > 0 => t.elapsed().as_secs_f64(),
                    _ => 0.0,
                };
        }
        for layer in &self.inner.layers {
            if let Ok(st) = layer.st.lock() {
                s.hits += st.hits;
                s.misses += st.misses;
                s.wait_secs += st.wait_secs;
                s.exact_passes += st.exact_passes;
                if st.hash {
                    s.hash_wait_secs += st.wait_secs;
                    s.hash_hits += st.hits;
                    s.hash_misses += st.misses;
                }
                let g = st.guess_stats;
                s.guess.passes += g.passes;
                s.guess.guessed += g.guessed;
                s.guess.routed += g.routed;
                s.guess.right += g.right;
                s.guess.reads += g.reads;
                s.guess.saved += g.saved;
                s.per_layer.push(LayerStats {
                    hits: st.hits,
                    misses: st.misses,
                });
            }
        }
        s.tiers = self.tier_stats();
        s
    }

    /// The precision tiers' counters (`None` without tiers).
    pub fn tier_stats(&self) -> Option<TierStats> {
        let t = self.inner.tiers.as_ref()?;
        let st = t.st.lock().ok()?;
        let c = st.pol.counts();
        Some(TierStats {
            upper: c.upper,
            base: c.base,
            upper_misses: c.upper_misses,
            in_flight: c.in_flight,
            admissions: c.admissions,
            evictions: c.evictions,
            no_room: c.no_room,
            above_tau: c.above_tau,
            cache_bytes: st.pol.lru().capacity(),
            cached_bytes: st.pol.lru().used(),
            tau: t.tau,
            ..st.stats
        })
    }

    /// Zero the counters (the slots keep their experts), e.g. between prefill and decode.
    pub fn reset_stats(&self) {
        if let Some(t) = &self.inner.tiers {
            if let Ok(mut st) = t.st.lock() {
                st.stats = TierStats::default();
                st.pol.reset_counts();
            }
        }
        self.inner.bytes_read.store(0, Ordering::Relaxed);
        self.inner.experts_read.store(0, Ordering::Relaxed);
        if let Ok(mut c) = self.inner.clock.lock() {
            c.busy_secs = 0.0;
            if c.in_flight > 0 {
                c.since = Some(Instant::now());
            }
        }
        for layer in &self.inner.layers {
            if let Ok(mut st) = layer.st.lock() {
                st.hits = 0;
                st.misses = 0;
                st.wait_secs = 0.0;
                st.exact_passes = 0;
                st.guess_stats = GuessStats::default();
            }
        }
    }

    /// Which expert each slot of `layer` holds (ready or loading).
    pub fn resident(&self, layer: usize) -> Vec<Option<usize>> {
        self.inner
            .layers
            .get(layer)
            .and_then(|l| l.st.lock().ok().map(|st| st.slot_expert.clone()))
            .unwrap_or_default()
    }

    fn layer(&self, layer: usize) -> std::result::Result<&Layer, ModelError> {
        self.inner
            .layers
            .get(layer)
            .ok_or_else(|| ModelError::Expert {
                layer,
                expert: 0,
                msg: format!("no such layer ({} layers)", self.inner.layers.len()),
            })
    }

    /// Mark `layers` hash-routed (their waits go to [`CacheStats::hash_wait_secs`]).
    pub(crate) fn set_hash_layers(&self, layers: &[usize]) {
        for &l in layers {
            if let Ok(layer) = self.layer(l) {
                if let Ok(mut st) = layer.st.lock() {
                    st.hash = true;
                }
            }
        }
    }

    /// Start the pass of hash-routed `layer` over `experts` (ascending, as the model will ask)
    /// now, from the token ids; the model's own `prefetch` for that pass is then a no-op.
    pub(crate) fn prefetch_exact(&self, l: usize, experts: &[usize]) {
        self.prefetch_layer(l, experts);
        let Ok(layer) = self.layer(l) else { return };
        if let Ok(mut st) = layer.st.lock() {
            st.exact = Some(experts.to_vec());
            st.exact_passes += 1;
        }
    }

    /// Start a pass of `layer` over `experts` (see the module doc).
    pub(crate) fn prefetch_layer(&self, l: usize, experts: &[usize]) {
        let Ok(layer) = self.layer(l) else { return };
        let Ok(mut st) = layer.st.lock() else { return };
        if let Some(started) = st.exact.take() {
            if started == experts {
                return;
            }
        }
        st.tick += 1;
        st.held.iter_mut().for_each(|h| *h = false);
        st.pinned.iter_mut().for_each(|p| *p = false);
        st.pending.clear();
        let n = st.map.len();
        st.next_access = (st.tick as usize - 1) * n;
        if !st.guess.is_empty() {
            let g = std::mem::take(&mut st.guess);
            st.guess_stats.passes += 1;
            st.guess_stats.guessed += g.len() as u64;
            st.guess_stats.routed += experts.len() as u64;
            st.guess_stats.right += experts.iter().filter(|e| g.contains(e)).count() as u64;
        }
        for &e in experts {
            if e >= n || st.pending.contains(&e) {
                continue;
            }
            let i = st.next_access;
            st.next_access += 1;
            st.policy.touch(i, e as u16);
            match st.map[e] {
                Some(s) => {
                    if !st.pinned[s] {
                        st.hits += 1;
                        if st.speculative[s] {
                            st.guess_stats.saved += 1;
                        }
                    }
                    st.pinned[s] = true;
                }
                None => {
                    st.misses += 1;
                    st.pending.push_back(e);
                }
            }
        }
        st.speculative.iter_mut().for_each(|x| *x = false);
        self.inner.issue(&self.pool, l, &mut st);
        drop(st);
        // This layer's reads are queued: now the guess for the next one, if any.
        let next = self.inner.next_guess.lock().ok().and_then(|mut g| g.take());
        if let Some((nl, guess)) = next {
            if nl == l + 1 {
                self.read_guess(nl, &guess);
            }
        }
    }

    /// Guess that the next pass of `layer` routes to `experts` (prefetch by the next layer's
    /// router applied to the current hidden state): read once the current layer's own reads are
    /// queued, into free slots or slots the policy gives up — never a slot holding a guessed
    /// expert. Scored at that layer's next pass ([`CacheStats::guess`]).
    pub(crate) fn set_next_guess(&self, layer: usize, experts: Vec<usize>) {
        if let Ok(mut g) = self.inner.next_guess.lock() {
            *g = Some((layer, experts));
        }
    }

    fn read_guess(&self, l: usize, guess: &[usize]) {
        let Ok(layer) = self.layer(l) else { return };
        let Ok(mut st) = layer.st.lock() else { return };
        // The layer's previous pass is over: its pins and current slot no longer hold.
        st.held.iter_mut().for_each(|h| *h = false);
        st.pinned.iter_mut().for_each(|p| *p = false);
        st.pending.clear();
        let n = st.map.len();
        let guess: Vec<usize> = guess.iter().copied().filter(|&e| e < n).collect();
        for &e in &guess {
            if let Some(s) = st.map[e] {
                st.pinned[s] = true;
            }
        }
        for &e in &guess {
            if st.map[e].is_some() {
                continue;
            }
            let Some(s) = Inner::find_slot(&st, false) else {
                break;
            };
            self.inner.assign(&self.pool, l, &mut st, s, e);
            st.speculative[s] = true;
            st.guess_stats.reads += 1;
        }
        st.pinned.iter_mut().for_each(|p| *p = false);
        st.guess = guess;
    }

    /// Which of `es` of layer `l` are in a slot and read (their views are handed out without
    /// waiting). A layer whose lock is poisoned answers `true`, so the call that follows
    /// reports the error.
    pub(crate) fn ready(&self, l: usize, es: &[usize]) -> Vec<bool> {
        let Ok(layer) = self.layer(l) else {
            return vec![true; es.len()];
        };
        let Ok(st) = layer.st.lock() else {
            return vec![true; es.len()];
        };
        es.iter()
            .map(|&e| match st.map.get(e).copied().flatten() {
                Some(s) => st.status[s] == Status::Ready,
                None => false,
            })
            .collect()
    }

    /// Views of experts `es` of layer `l`, all valid together until the next call for `l`,
    /// reading each first if needed (see the module doc). At most one per slot.
    pub(crate) fn expert_views_many(
        &self,
        l: usize,
        es: &[usize],
    ) -> std::result::Result<Vec<ExpertWeights<'_>>, ModelError> {
        let picks: Vec<(usize, Rung)> = es.iter().map(|&e| (e, Rung::Base)).collect();
        self.expert_views_at(l, &picks)
    }

    /// Views of `picks` of layer `l` at their rungs (an expert may come twice, once per rung),
    /// all valid together until the next call for `l`. A base view is the slot's; an upper view
    /// is the slot's base with the residual stage of the residual cache, which the tier policy
    /// answered `Use` for in this pass (so it is in memory and held: never waited for).
    pub(crate) fn expert_views_at(
        &self,
        l: usize,
        picks: &[(usize, Rung)],
    ) -> std::result::Result<Vec<ExpertWeights<'_>>, ModelError> {
        let mut es: Vec<usize> = vec![];
        for &(e, _) in picks {
            if !es.contains(&e) {
                es.push(e);
            }
        }
        let layer = self.layer(l)?;
        let mut st = layer.st.lock().map_err(poisoned)?;
        st.held.iter_mut().for_each(|h| *h = false);
        if es.len() > st.held.len() {
            return Err(ModelError::Expert {
                layer: l,
                expert: es[0],
                msg: format!(
                    "{} experts asked for at once, but a layer has {} slots",
                    es.len(),
                    st.held.len()
                ),
            });
        }
        let mut slots = Vec::with_capacity(es.len());
        for &e in &es {
            let (g, s) = self.acquire(layer, l, st, e)?;
            st = g;
            st.held[s] = true;
            slots.push(s);
        }
        // Keep the disk busy: read queued experts into slots already served in this pass.
        self.inner.issue(&self.pool, l, &mut st);
        drop(st);
        let upper: Vec<Option<Arc<UpperBuf>>> = picks
            .iter()
            .map(|&(e, r)| match r {
                Rung::Base => Ok(None),
                Rung::Upper => self.held_upper(l, e).map(Some),
            })
            .collect::<std::result::Result<_, _>>()?;
        picks
            .iter()
            .zip(upper)
            .map(|(&(e, _), up)| {
                let s = slots[es.iter().position(|&x| x == e).unwrap_or(0)];
                // SAFETY: slot `s` is `Ready` (no writer) and `held`: `find_slot` never hands it
                // to a new read before the next call for this layer, by which time the caller
                // has dropped these views (module doc, "Validity of views").
                let bytes = unsafe { (*layer.bufs[s].0.get()).as_slice() };
                let v = match up {
                    None => self.inner.store.views(l, e, bytes),
                    Some(buf) => {
                        // SAFETY: the entry is ready (its read job is done: no writer) and held
                        // for this layer's pass, so it is not evicted (and its buffer, also kept
                        // by the cache's map, not freed) before the next call for this layer.
                        let ub: &[u8] = unsafe { (*buf.0.get()).as_slice() };
                        let ub: &[u8] =
                            unsafe { std::slice::from_raw_parts(ub.as_ptr(), ub.len()) };
                        self.inner.store.views_upper(l, e, bytes, ub)
                    }
                };
                v.map_err(|x| ModelError::Expert {
                    layer: l,
                    expert: e,
                    msg: x.to_string(),
                })
            })
            .collect()
    }

    /// The residual buffer of expert `e` of layer `l`, which this layer's pass chose `Use` for.
    fn held_upper(&self, l: usize, e: usize) -> std::result::Result<Arc<UpperBuf>, ModelError> {
        let err = |msg: &str| ModelError::Expert {
            layer: l,
            expert: e,
            msg: msg.to_string(),
        };
        let t = self
            .inner
            .tiers
            .as_ref()
            .ok_or_else(|| err("the upper rung was asked for, but this cache has no tiers"))?;
        let st = t.st.lock().map_err(poisoned)?;
        let key = st.pol.key(l, e);
        let held = st.pol.in_use(l, key);
        match (held, st.pol.lru().state(key), st.bufs.get(&key)) {
            (true, Entry::Ready, Some(b)) => Ok(b.clone()),
            _ => Err(err(
                "the upper rung was asked for without the tier policy answering Use in this pass",
            )),
        }
    }

    /// A layer's pass begins its view requests: the entries chosen `Use` for it become the held
    /// ones (see [`Tiers`]). Called once per pass, after every slot's choice.
    pub(crate) fn tiers_pass(&self, l: usize) {
        let Some(t) = &self.inner.tiers else { return };
        let Ok(mut st) = t.st.lock() else { return };
        st.pol.pass(l);
    }

    /// The tier policy's answer for one routed slot (see [`Tiers`]): never waits.
    pub(crate) fn choose(&self, l: usize, expert: usize, gate: f32) -> UpperChoice {
        let Some(t) = &self.inner.tiers else {
            return UpperChoice::Base;
        };
        let Ok(mut st) = t.st.lock() else {
            return UpperChoice::Base;
        };
        match st.pol.choose(l, expert, gate) {
            Choice::Use => UpperChoice::Use,
            Choice::Base => UpperChoice::Base,
            Choice::Miss { read: None } => UpperChoice::BaseAndWant,
            Choice::Miss { read: Some(a) } => {
                for v in &a.evicted {
                    st.bufs.remove(v);
                }
                self.read_upper(&mut st, l, expert, a.key, a.bytes);
                UpperChoice::BaseAndWant
            }
        }
    }

    /// Queue the read of an admitted residual stage on the residual reader threads.
    fn read_upper(&self, st: &mut TierState, l: usize, e: usize, key: u64, bytes: u64) {
        let Some(buf) = AlignedBuf::new(bytes as usize) else {
            st.pol.failed(key);
            st.stats.failed += 1;
            return;
        };
        let buf = Arc::new(UpperBuf(UnsafeCell::new(buf)));
        st.bufs.insert(key, buf.clone());
        let inner = self.inner.clone();
        let job = move || {
            // SAFETY: the entry is loading: this job is the buffer's only user (no views are
            // made of a loading entry, and a loading entry is never evicted).
            let dst = unsafe { (*buf.0.get()).as_mut_slice() };
            let r = inner.store.read_upper_into(l, e, dst);
            let Some(t) = &inner.tiers else { return };
            if let Ok(mut st) = t.st.lock() {
                match r {
                    Ok(n) => {
                        st.pol.ready(key);
                        st.stats.bytes_read += n;
                        st.stats.reads_done += 1;
                    }
                    Err(_) => {
                        st.pol.failed(key);
                        st.bufs.remove(&key);
                        st.stats.failed += 1;
                    }
                }
            }
        };
        let submitted = self.upper_pool.as_ref().is_some_and(|p| p.submit(job));
        if !submitted {
            st.pol.failed(key);
            st.bufs.remove(&key);
            st.stats.failed += 1;
        }
    }

    /// The slot of expert `e` of layer `l` once it is `Ready`: assigned and read if it is
    /// missing, waited for if it is in flight. Slots already `held` are never taken for it.
    fn acquire<'g>(
        &self,
        layer: &'g Layer,
        l: usize,
        mut st: std::sync::MutexGuard<'g, LayerState>,
        e: usize,
    ) -> std::result::Result<(std::sync::MutexGuard<'g, LayerState>, usize), ModelError> {
        let err = |msg: String| ModelError::Expert {
            layer: l,
            expert: e,
            msg,
        };
        if e >= st.map.len() {
            return Err(err(format!("no such expert ({} experts)", st.map.len())));
        }
        let s = match st.map[e] {
            Some(s) => s,
            None => {
                if let Some(i) = st.pending.iter().position(|&x| x == e) {
                    st.pending.remove(i);
                } else {
                    // Asked for without a prefetch: a miss of its own.
                    st.misses += 1;
                    let i = st.next_access;
                    st.next_access += 1;
                    st.policy.touch(i, e as u16);
                }
                loop {
                    let found =
                        Inner::find_slot(&st, false).or_else(|| Inner::find_slot(&st, true));
                    if let Some(s) = found {
                        self.inner.assign(&self.pool, l, &mut st, s, e);
                        break s;
                    }
                    // Every slot not held is being read: wait for one (the caller asks for
                    // fewer experts than there are slots, so one is not held).
                    st = layer.cv.wait(st).map_err(poisoned)?;
                }
            }
        };
        let t0 = Instant::now();
        let mut waited = false;
        loop {
            match st.status[s].clone() {
                Status::Ready => break,
                Status::Loading => {
                    waited = true;
                    st = layer.cv.wait(st).map_err(poisoned)?;
                }
                Status::Failed(msg) => {
                    st.status[s] = Status::Empty;
                    st.slot_expert[s] = None;
                    st.map[e] = None;
                    return Err(err(format!("reading from the checkpoint: {msg}")));
                }
                Status::Empty => return Err(err("slot emptied while waiting".into())),
            }
        }
        if waited {
            st.wait_secs += t0.elapsed().as_secs_f64();
        }
        st.pinned[s] = false;
        Ok((st, s))
    }
}

/// The [`ExpertSource`] the model is given: only [`crate::BudgetedModel`] makes one, so the
/// cache is driven by the model's forward alone.
pub(crate) struct CacheSource(pub(crate) Arc<SlotCache>);

impl ExpertSource for CacheSource {
    fn expert(&self, layer: usize, expert: usize) -> keep_model::Result<ExpertWeights<'_>> {
        let mut v = self.0.expert_views_many(layer, &[expert])?;
        v.pop().ok_or(ModelError::Expert {
            layer,
            expert,
            msg: "no view returned".into(),
        })
    }

    fn experts(
        &self,
        layer: usize,
        experts: &[usize],
    ) -> keep_model::Result<Vec<ExpertWeights<'_>>> {
        self.0.expert_views_many(layer, experts)
    }

    fn max_batch(&self) -> usize {
        self.0.slots_per_layer()
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.0.tiers_pass(layer);
        self.0.prefetch_layer(layer, experts)
    }

    fn ready(&self, layer: usize, experts: &[usize]) -> Vec<bool> {
        self.0.ready(layer, experts)
    }

    fn tiers(&self) -> Option<&dyn ExpertTiers> {
        self.0
            .inner
            .tiers
            .as_ref()
            .map(|_| self as &dyn ExpertTiers)
    }

    fn experts_at(
        &self,
        layer: usize,
        picks: &[(usize, Rung)],
    ) -> keep_model::Result<Vec<ExpertWeights<'_>>> {
        self.0.expert_views_at(layer, picks)
    }
}

impl ExpertTiers for CacheSource {
    fn choose(&self, layer: usize, _token: usize, expert: usize, gate: f32) -> UpperChoice {
        self.0.choose(layer, expert, gate)
    }
}
