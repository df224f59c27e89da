//! Precision tiers in the replay: every routed expert's base rung lives where the hot set puts
//! it (the slot replay of [`crate::sim`], unchanged: every slot needs its base), and an expert
//! with an upper stage (the residual codes of a mixed-rung checkpoint) keeps that stage on SSD.
//! A routed slot whose gate weight is at least τ uses the upper stage only if it is already in
//! memory; otherwise it is served at the base rung and the stage is admitted into an LRU
//! residual cache of a fixed number of bytes, usable `admit_delay` tokens after the miss — the
//! runtime never waits for a residual read, so a read issued at token `t` serves from `t + k`.
//!
//! The admission rule is [`ResidualLru`], shared with keep-runtime's residual cache so that a
//! replay predicts what the runtime does: an entry is admitted with its bytes when its read is
//! issued; entries still loading are never evicted (their buffer is being written); to make
//! room the least recently used ready entries not in use go first; an entry that cannot find
//! room is not admitted (counted as `no_room`); a hit moves an entry to the front.
//!
//! Order of a replay: token by token, layer by layer (trace order), each token's slots in
//! ascending expert id (the runtime's order); the cache is emptied at each session boundary.
//! Residual bytes are read from SSD once per admission and from memory at each upper hit.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::cost::TokenCost;
use crate::{ResidencyError, Result};
use keep_artifacts::routes::RouteTrace;

/// The state of an entry of a [`ResidualLru`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Not in the cache.
    Absent,
    /// Admitted, its read not finished: the slot is served at the base rung.
    Loading,
    /// In memory: the slot is served at the upper rung.
    Ready,
}

/// What [`ResidualLru::admit`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Admitted; these keys were evicted to make room.
    Admitted(Vec<u64>),
    /// No room: every entry that could go is loading or in use, or the stage is larger than
    /// the cache.
    NoRoom,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    bytes: u64,
    stamp: u64,
    ready: bool,
}

/// An LRU set of residual stages with a byte capacity (keys are the caller's: the runtime and
/// the replay use `layer · n_experts + expert`).
#[derive(Debug, Clone, Default)]
pub struct ResidualLru {
    capacity: u64,
    used: u64,
    clock: u64,
    entries: HashMap<u64, Slot>,
    /// stamp → key, oldest first.
    order: BTreeMap<u64, u64>,
}

impl ResidualLru {
    /// An empty cache of `capacity` bytes.
    pub fn new(capacity: u64) -> ResidualLru {
        ResidualLru {
            capacity,
            ..ResidualLru::default()
        }
    }

    /// Bytes of the cache.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes of the admitted entries (loading or ready).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Entries admitted (loading or ready).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is admitted.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The state of `key`.
    pub fn state(&self, key: u64) -> Entry {
        match self.entries.get(&key) {
            None => Entry::Absent,
            Some(s) if s.ready => Entry::Ready,
            Some(_) => Entry::Loading,
        }
    }

    fn stamp(&mut self, key: u64) {
        self.clock += 1;
        let c = self.clock;
        if let Some(s) = self.entries.get_mut(&key) {
            self.order.remove(&s.stamp);
            s.stamp = c;
            self.order.insert(c, key);
        }
    }

    /// A use of `key` (an upper hit): it becomes the most recently used.
    pub fn touch(&mut self, key: u64) {
        self.stamp(key);
    }

    /// The read of `key` finished: it serves from now on.
    pub fn mark_ready(&mut self, key: u64) {
        if let Some(s) = self.entries.get_mut(&key) {
            s.ready = true;
        }
    }

    /// Remove `key` (a failed read); its bytes are freed.
    pub fn remove(&mut self, key: u64) {
        if let Some(s) = self.entries.remove(&key) {
            self.order.remove(&s.stamp);
            self.used -= s.bytes;
        }
    }

    /// Admit `key` (absent) with `bytes`, loading: evict the least recently used ready entries
    /// for which `busy` is false until it fits.
    pub fn admit(&mut self, key: u64, bytes: u64, busy: &dyn Fn(u64) -> bool) -> Admit {
        if self.entries.contains_key(&key) || bytes > self.capacity {
            return Admit::NoRoom;
        }
        let need = (self.used + bytes).saturating_sub(self.capacity);
        let mut victims = vec![];
        let mut freed = 0u64;
        if need > 0 {
            for (_, &k) in self.order.iter() {
                let s = self.entries[&k];
                if !s.ready || busy(k) {
                    continue;
                }
                victims.push(k);
                freed += s.bytes;
                if freed >= need {
                    break;
                }
            }
            if freed < need {
                return Admit::NoRoom;
            }
        }
        for &k in &victims {
            self.remove(k);
        }
        self.clock += 1;
        self.entries.insert(
            key,
            Slot {
                bytes,
                stamp: self.clock,
                ready: false,
            },
        );
        self.order.insert(self.clock, key);
        self.used += bytes;
        Admit::Admitted(victims)
    }
}

/// Routed slots by how they were served, and the residual cache's traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TierCounts {
    /// Routed slots replayed.
    pub slots: u64,
    /// Slots served at the upper rung (their stage was in memory).
    pub upper: u64,
    /// Slots served at the base rung (every other slot).
    pub base: u64,
    /// Of `base`: slots with gate ≥ τ whose expert has an upper stage not in memory.
    pub upper_misses: u64,
    /// Of `upper_misses`: the stage was already being read (admitted earlier, not usable yet).
    pub in_flight: u64,
    /// Residual reads issued (admissions).
    pub admissions: u64,
    /// Entries evicted to make room.
    pub evictions: u64,
    /// Misses not admitted for lack of room.
    pub no_room: u64,
    /// Slots with gate ≥ τ (with or without an upper stage).
    pub above_tau: u64,
    /// Residual bytes read from SSD (admissions).
    pub residual_bytes_read: u64,
    /// Residual bytes used from memory (upper slots, once per expert per token).
    pub residual_bytes_used: u64,
    /// Tokens replayed.
    pub tokens: u64,
}

impl TierCounts {
    /// Upper hits / (upper hits + upper misses): how often a slot that wanted its upper stage
    /// got it.
    pub fn upper_hit_rate(&self) -> f64 {
        crate::sim::ratio(self.upper as f64, (self.upper + self.upper_misses) as f64)
    }

    /// Add another replay's counts.
    pub fn add(&mut self, o: &TierCounts) {
        self.slots += o.slots;
        self.upper += o.upper;
        self.base += o.base;
        self.upper_misses += o.upper_misses;
        self.in_flight += o.in_flight;
        self.admissions += o.admissions;
        self.evictions += o.evictions;
        self.no_room += o.no_room;
        self.above_tau += o.above_tau;
        self.residual_bytes_read += o.residual_bytes_read;
        self.residual_bytes_used += o.residual_bytes_used;
        self.tokens += o.tokens;
    }
}

/// What lies above an expert's allocated rung: the stage a routed slot with gate weight ≥ τ
/// is upgraded to when that stage is in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UpperStage {
    /// Nothing: the expert is always served at its allocated rung.
    None,
    /// The residual codes (`.resid.*`) the checkpoint carries beyond an `e8p2` base: the
    /// upper rung is `e8p2+e81` (or `e8p2+e8p2`), the base's codes plus the residual.
    Residual,
    /// The original checkpoint's shipped expert, a whole copy that replaces the base.
    Shipped,
}

/// The allocated rung of an expert whose checkpoint codes carry no allocation: its stored
/// base (`e8p2` for an E8P expert, whose residual is then the upper stage; `shipped` for any
/// other).
pub fn implicit_rung(is_e8p: bool) -> &'static str {
    if is_e8p {
        "e8p2"
    } else {
        keep_artifacts::alloc::SHIPPED
    }
}

/// The precision-tier rule, the one place it is decided (keep eval --tiers, keep run --tiers
/// and keep residency all call it): an expert's base is its allocated `rung`, held where the
/// budget puts it; its upper stage is what lies above that rung and is on hand —
///
/// - `e8p2`: the residual codes the checkpoint carries (`has_residual`), else the shipped
///   expert (`has_shipped`: an original checkpoint was given), else none;
/// - `e8p2+e81`, `e8p2+e8p2` (the top quantized rungs; their residual is part of the base):
///   the shipped expert when given, else none;
/// - `shipped` (already the top) and `pruned`: none.
///
/// An unknown label has none.
pub fn upper_stage(rung: &str, has_residual: bool, has_shipped: bool) -> UpperStage {
    match rung {
        "e8p2" if has_residual => UpperStage::Residual,
        "e8p2" | "e8p2+e81" | "e8p2+e8p2" if has_shipped => UpperStage::Shipped,
        _ => UpperStage::None,
    }
}

/// Whether an expert allocated `rung` keeps its residual codes in its base (read with the
/// base into its slot) rather than as an upper stage.
pub fn residual_in_base(rung: &str) -> bool {
    matches!(rung, "e8p2+e81" | "e8p2+e8p2")
}

/// Each expert's allocated rung for the experts of `layer` a checkpoint holds (`n` of them; a
/// pruned checkpoint's experts are the allocation's survivors in order); without an
/// allocation (or a layer it does not list), [`implicit_rung`] of `is_e8p(e)`.
pub fn rungs_of_layer(
    alloc: Option<&keep_artifacts::alloc::Alloc>,
    layer: usize,
    n: usize,
    is_e8p: &dyn Fn(usize) -> bool,
) -> Result<Vec<String>> {
    let la = alloc.and_then(|a| a.layers.iter().find(|x| x.layer == layer));
    let Some(la) = la else {
        return Ok((0..n)
            .map(|e| implicit_rung(is_e8p(e)).to_string())
            .collect());
    };
    let kept: Vec<String> = la
        .rungs
        .iter()
        .filter(|r| r.as_str() != keep_artifacts::alloc::PRUNED)
        .cloned()
        .collect();
    if kept.len() != n {
        return Err(ResidencyError::Config(format!(
            "the allocation keeps {} experts of layer {layer}, the model has {n}: it is not the \
             allocation this checkpoint was quantized with",
            kept.len()
        )));
    }
    Ok(kept)
}

/// For the `n` experts of `layer` a checkpoint holds, the id of each in the original checkpoint
/// the allocation was made for: a pruned checkpoint holds the allocation's survivors in order
/// (its `pruned` experts dropped, the rest renumbered); without an allocation, or for a layer it
/// does not list, the same ids. Where the shipped upper stage of a checkpoint expert is read from.
pub fn original_ids(
    alloc: Option<&keep_artifacts::alloc::Alloc>,
    layer: usize,
    n: usize,
) -> Vec<usize> {
    match alloc.and_then(|a| a.layers.iter().find(|x| x.layer == layer)) {
        Some(la) => la
            .rungs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.as_str() != keep_artifacts::alloc::PRUNED)
            .map(|(j, _)| j)
            .collect(),
        None => (0..n).collect(),
    }
}

/// One routed slot's answer from a [`TierPolicy`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Computed at the upper rung: the stage is in memory (and held for this layer's pass).
    Use,
    /// Computed at the base rung (gate below τ, or no upper stage).
    Base,
    /// Computed at the base rung; the stage is not in memory. `read`: it was admitted now
    /// (its read must be issued; `evicted` are the keys that made room); `None`: it is still
    /// being read, or there was no room.
    Miss { read: Option<Admitted> },
}

/// An admission: the stage to read and the entries evicted for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    pub key: u64,
    pub bytes: u64,
    pub evicted: Vec<u64>,
}

/// The per-slot tier policy: one owner for the runtime (keep-runtime's residual cache), the
/// deterministic evaluation (keep-calib's `keep eval --tiers`) and the replay
/// ([`replay_tiers`]), so that the three serve the same slots at the same rungs when their
/// reads complete at the same tokens.
///
/// Per routed slot, in the order the MoE layer asks (token by token, slot by slot within a
/// layer's pass, layers in order): gate ≥ τ and an upper stage in memory → [`Choice::Use`];
/// gate ≥ τ and the stage absent → admitted into the [`ResidualLru`] (LRU ready entries not in
/// use evicted) and [`Choice::Miss`]; otherwise the base. Entries chosen `Use` in a layer's
/// pass are *in use* until that layer's next pass ([`TierPolicy::pass`] moves them), and with
/// the ones being chosen now they are never evicted. A read completes with
/// [`TierPolicy::ready`] (the runtime: its reader thread; the simulations: `admit_delay`
/// tokens after the token that issued it, [`TierPolicy::advance`]). Keys are
/// `layer · n_experts + expert`.
#[derive(Debug, Clone)]
pub struct TierPolicy {
    tau: f32,
    n_experts: usize,
    /// Per layer, per expert: bytes of the upper stage (0: none).
    upper_bytes: Vec<Vec<u64>>,
    lru: ResidualLru,
    /// Keys chosen `Use` in each layer's pass being chosen now, and in its previous pass.
    current: Vec<Vec<u64>>,
    held: Vec<Vec<u64>>,
    /// Simulated reads (`None`: reads complete through `ready`): the delay, the keys issued in
    /// the forward being chosen now, and (usable from token, key) of earlier ones.
    delay: Option<u64>,
    issued: Vec<u64>,
    pending: Vec<(u64, u64)>,
    now: u64,
    counts: TierCounts,
}

impl TierPolicy {
    /// A policy for `upper_bytes[layer][expert]` (0: no upper stage; `n_experts` is the key
    /// stride) with a residual cache of `cache_bytes`; `admit_delay`: `Some(k)` for a
    /// simulation (a read issued at token `t` is usable from token `t + k`, `k ≥ 1`), `None`
    /// when the caller reports completed reads.
    pub fn new(
        tau: f32,
        cache_bytes: u64,
        upper_bytes: Vec<Vec<u64>>,
        admit_delay: Option<u64>,
    ) -> Result<TierPolicy> {
        if tau.is_nan() {
            return Err(ResidencyError::Config(format!("τ {tau} is not a number")));
        }
        if admit_delay == Some(0) {
            return Err(ResidencyError::Config(
                "the admission delay is at least 1 token (a read issued now serves from a later \
                 token)"
                    .into(),
            ));
        }
        let n_layers = upper_bytes.len();
        let n_experts = upper_bytes.iter().map(Vec::len).max().unwrap_or(0);
        Ok(TierPolicy {
            tau,
            n_experts,
            upper_bytes,
            lru: ResidualLru::new(cache_bytes),
            current: vec![vec![]; n_layers],
            held: vec![vec![]; n_layers],
            delay: admit_delay,
            issued: vec![],
            pending: vec![],
            now: 0,
            counts: TierCounts::default(),
        })
    }

    /// τ.
    pub fn tau(&self) -> f32 {
        self.tau
    }

    /// The key of expert `expert` of `layer`.
    pub fn key(&self, layer: usize, expert: usize) -> u64 {
        (layer * self.n_experts + expert) as u64
    }

    /// Bytes of the upper stage of expert `expert` of `layer` (0: none).
    pub fn upper_bytes(&self, layer: usize, expert: usize) -> u64 {
        self.upper_bytes
            .get(layer)
            .and_then(|v| v.get(expert))
            .copied()
            .unwrap_or(0)
    }

    /// The residual cache.
    pub fn lru(&self) -> &ResidualLru {
        &self.lru
    }

    /// The counts so far (`tokens` is what [`Self::advance`] counted).
    pub fn counts(&self) -> TierCounts {
        self.counts
    }

    /// Zero the counts (the cache is kept).
    pub fn reset_counts(&mut self) {
        self.counts = TierCounts::default();
    }

    /// Empty the cache and the pending reads (a new session); counts are kept.
    pub fn clear(&mut self) {
        self.lru = ResidualLru::new(self.lru.capacity());
        self.current.iter_mut().for_each(Vec::clear);
        self.held.iter_mut().for_each(Vec::clear);
        self.issued.clear();
        self.pending.clear();
    }

    /// The policy's answer for one routed slot (see the type's doc). Never waits.
    pub fn choose(&mut self, layer: usize, expert: usize, gate: f32) -> Choice {
        self.counts.slots += 1;
        let above = gate >= self.tau;
        if above {
            self.counts.above_tau += 1;
        }
        let ub = self.upper_bytes(layer, expert);
        if ub == 0 || !above {
            self.counts.base += 1;
            return Choice::Base;
        }
        let key = self.key(layer, expert);
        match self.lru.state(key) {
            Entry::Ready => {
                self.counts.upper += 1;
                self.lru.touch(key);
                let in_use = self.current.get(layer).is_some_and(|c| c.contains(&key));
                if !in_use {
                    self.counts.residual_bytes_used += ub;
                    if let Some(c) = self.current.get_mut(layer) {
                        c.push(key);
                    }
                }
                Choice::Use
            }
            Entry::Loading => {
                self.counts.base += 1;
                self.counts.upper_misses += 1;
                self.counts.in_flight += 1;
                Choice::Miss { read: None }
            }
            Entry::Absent => {
                self.counts.base += 1;
                self.counts.upper_misses += 1;
                let busy: Vec<u64> = self
                    .current
                    .iter()
                    .chain(self.held.iter())
                    .flatten()
                    .copied()
                    .collect();
                match self.lru.admit(key, ub, &|k| busy.contains(&k)) {
                    Admit::NoRoom => {
                        self.counts.no_room += 1;
                        Choice::Miss { read: None }
                    }
                    Admit::Admitted(evicted) => {
                        self.counts.admissions += 1;
                        self.counts.evictions += evicted.len() as u64;
                        self.counts.residual_bytes_read += ub;
                        if self.delay.is_some() {
                            self.issued.push(key);
                        }
                        Choice::Miss {
                            read: Some(Admitted {
                                key,
                                bytes: ub,
                                evicted,
                            }),
                        }
                    }
                }
            }
        }
    }

    /// Whether `key` was chosen `Use` in layer `layer`'s last pass (its views are handed out
    /// until the layer's next pass).
    pub fn in_use(&self, layer: usize, key: u64) -> bool {
        self.held.get(layer).is_some_and(|h| h.contains(&key))
    }

    /// Layer `layer`'s pass asks for its views: the entries chosen `Use` in it become the ones
    /// in use until its next pass. Called once per pass, after every slot's choice.
    pub fn pass(&mut self, layer: usize) {
        if layer < self.current.len() {
            self.held[layer] = std::mem::take(&mut self.current[layer]);
        }
    }

    /// The read of `key` completed: it serves from the next choice on.
    pub fn ready(&mut self, key: u64) {
        self.lru.mark_ready(key);
    }

    /// The read of `key` failed: the entry is dropped (its bytes freed).
    pub fn failed(&mut self, key: u64) {
        self.lru.remove(key);
    }

    /// A forward of `tokens` tokens (a prefill is one forward) is done: simulated reads issued
    /// in it become usable `admit_delay` tokens after its last token.
    pub fn advance(&mut self, tokens: u64) {
        self.counts.tokens += tokens;
        if tokens == 0 {
            return;
        }
        let last = self.now + tokens - 1;
        if let Some(k) = self.delay {
            for key in std::mem::take(&mut self.issued) {
                self.pending.push((last + k, key));
            }
        }
        self.now += tokens;
        let now = self.now;
        let lru = &mut self.lru;
        self.pending.retain(|&(at, key)| {
            if at <= now {
                lru.mark_ready(key);
                false
            } else {
                true
            }
        });
    }
}

/// The tier policy to replay.
#[derive(Debug, Clone)]
pub struct TierSpec {
    /// Gate weight from which a slot wants its upper stage.
    pub tau: f32,
    /// Bytes of the residual cache.
    pub cache_bytes: u64,
    /// Tokens after the miss from which an admitted stage serves (≥ 1).
    pub admit_delay: usize,
    /// Bytes of each expert's upper stage per recorded layer (trace order); 0: none.
    pub upper_bytes: Vec<Vec<u64>>,
    /// Tokens at the start of each session run as one prefill forward (the runtime's prompt
    /// pass: every slot of it is chosen before any of its reads completes, and its reads serve
    /// from `admit_delay` tokens after its last token); 0: every token one forward.
    pub prefill_tokens: usize,
}

/// Replay the tier policy over `trace` (see the module doc).
pub fn replay_tiers(trace: &RouteTrace, spec: &TierSpec) -> Result<TierCounts> {
    replay_tiers_with(trace, spec, &mut |_, _, _, _| {})
}

/// [`replay_tiers`], telling `served(session, token, layer index, upper)` the rung of every
/// routed slot in the order it is chosen (token by token, layer by layer, the trace's slot
/// order within a token: the MoE layer's order).
pub fn replay_tiers_with(
    trace: &RouteTrace,
    spec: &TierSpec,
    served: &mut dyn FnMut(usize, usize, usize, bool),
) -> Result<TierCounts> {
    if spec.admit_delay == 0 {
        return Err(ResidencyError::Config(
            "the admission delay is at least 1 token (a read issued now serves from a later token)"
                .into(),
        ));
    }
    let mut total = TierCounts::default();
    for (si, s) in trace.sessions.iter().enumerate() {
        if s.layers.len() != spec.upper_bytes.len() {
            return Err(ResidencyError::Config(format!(
                "the trace records {} layers, the tier sizes cover {}",
                s.layers.len(),
                spec.upper_bytes.len()
            )));
        }
        let mut pol = TierPolicy::new(
            spec.tau,
            spec.cache_bytes,
            spec.upper_bytes.clone(),
            Some(spec.admit_delay as u64),
        )?;
        let tokens = s.layers.iter().map(|l| l.tokens()).min().unwrap_or(0);
        let prefill = spec.prefill_tokens.min(tokens);
        // Forwards: the prefill (if any), then one token each.
        let mut forwards: Vec<std::ops::Range<usize>> = vec![];
        if prefill > 0 {
            forwards.push(0..prefill);
        }
        forwards.extend((prefill..tokens).map(|t| t..t + 1));
        for f in forwards {
            for (li, l) in s.layers.iter().enumerate() {
                let k = l.top_k;
                for t in f.clone() {
                    for (&e, &w) in l.experts[t * k..(t + 1) * k]
                        .iter()
                        .zip(&l.weights[t * k..(t + 1) * k])
                    {
                        let up = pol.choose(li, e as usize, w) == Choice::Use;
                        served(si, t, li, up);
                    }
                }
                pol.pass(li);
            }
            pol.advance(f.len() as u64);
        }
        total.add(&pol.counts());
    }
    Ok(total)
}

/// The tier replay with its cost at one hot-set size and policy.
#[derive(Debug, Clone, Serialize)]
pub struct TierRow {
    pub hot: usize,
    pub policy: String,
    /// Base bytes (the slot replay's) plus residual bytes, per token.
    pub ssd_bytes_per_token: f64,
    pub mem_bytes_per_token: f64,
    pub seconds_per_token: f64,
    pub tokens_per_sec: f64,
}

/// The tier part of a residency report.
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    pub tau: f32,
    pub residual_cache_bytes: u64,
    pub admit_delay_tokens: usize,
    /// Tokens of each session's prefill forward (0: token by token).
    pub prefill_tokens: usize,
    /// Experts with an upper stage / routed experts of the recorded layers.
    pub experts_with_upper: u64,
    pub experts: u64,
    /// Of `experts_with_upper`: residual codes, shipped experts (set by the caller that
    /// decided the stages; 0 when unknown).
    pub experts_upper_residual: u64,
    pub experts_upper_shipped: u64,
    #[serde(flatten)]
    pub counts: TierCounts,
    pub upper_hit_rate: f64,
    /// Residual bytes read from SSD per token.
    pub residual_ssd_bytes_per_token: f64,
    /// Residual bytes read from memory per token.
    pub residual_mem_bytes_per_token: f64,
    /// Every (hot-set size, policy) row's cost with the residual traffic added.
    pub rows: Vec<TierRow>,
}

impl TierReport {
    /// Residual traffic added to a slot replay's `base` cost at `ssd_gbps` / `mem_gbps`.
    pub fn add_cost(
        &mut self,
        hot: usize,
        policy: &str,
        base: &TokenCost,
        ssd_gbps: f64,
        mem_gbps: f64,
    ) {
        let ssd = base.ssd_bytes_per_token + self.residual_ssd_bytes_per_token;
        let mem = base.mem_bytes_per_token + self.residual_mem_bytes_per_token;
        let s = base.seconds_per_token
            + self.residual_ssd_bytes_per_token / (ssd_gbps * 1e9)
            + self.residual_mem_bytes_per_token / (mem_gbps * 1e9);
        self.rows.push(TierRow {
            hot,
            policy: policy.to_string(),
            ssd_bytes_per_token: ssd,
            mem_bytes_per_token: mem,
            seconds_per_token: s,
            tokens_per_sec: if s > 0.0 { 1.0 / s } else { f64::INFINITY },
        });
    }
}

/// Replay `spec` over `trace` and put its counts and per-token residual bytes in a report (no
/// rows yet: [`TierReport::add_cost`] adds them).
pub fn tier_report(trace: &RouteTrace, spec: &TierSpec) -> Result<TierReport> {
    let counts = replay_tiers(trace, spec)?;
    let per = |b: u64| crate::sim::ratio(b as f64, counts.tokens as f64);
    Ok(TierReport {
        tau: spec.tau,
        residual_cache_bytes: spec.cache_bytes,
        admit_delay_tokens: spec.admit_delay,
        prefill_tokens: spec.prefill_tokens,
        experts_upper_residual: 0,
        experts_upper_shipped: 0,
        experts_with_upper: spec
            .upper_bytes
            .iter()
            .flatten()
            .filter(|&&b| b > 0)
            .count() as u64,
        experts: spec.upper_bytes.iter().map(|v| v.len() as u64).sum(),
        upper_hit_rate: counts.upper_hit_rate(),
        residual_ssd_bytes_per_token: per(counts.residual_bytes_read),
        residual_mem_bytes_per_token: per(counts.residual_bytes_used),
        counts,
        rows: vec![],
    })
}

/// Replay `spec` over `trace` and attach it to `report`: a tier row beside every policy row
/// that has a cost (the residual traffic added at the report's bandwidths).
pub fn attach(report: &mut crate::Report, trace: &RouteTrace, spec: &TierSpec) -> Result<()> {
    let mut t = tier_report(trace, spec)?;
    if let Some(c) = &report.inputs.cost {
        let (ssd, mem) = (c.ssd_gbps, c.mem_gbps);
        for s in &report.sizes {
            for r in &s.policies {
                if let Some(cost) = &r.cost {
                    t.add_cost(s.hot, r.policy.name(), cost, ssd, mem);
                }
            }
        }
    }
    report.tiers = Some(t);
    Ok(())
}

/// Bytes of each routed expert's residual codes (its `.resid.weight` and `.resid.scale`
/// tensors over `w1`, `w2`, `w3`; 0 for an expert without any) for every layer of `layers`,
/// from the checkpoint at `dir`.
pub fn residual_bytes(dir: &std::path::Path, layers: &[usize]) -> Result<Vec<Vec<u64>>> {
    expert_bytes(dir, layers, true)
}

/// Bytes of each routed expert (its weight, scale and bias tensors over `w1`, `w2`, `w3`,
/// without residual codes) for every layer of `layers`, from the checkpoint at `dir`: the
/// size of a shipped upper stage read from an original checkpoint.
pub fn shipped_bytes(dir: &std::path::Path, layers: &[usize]) -> Result<Vec<Vec<u64>>> {
    expert_bytes(dir, layers, false)
}

/// [`shipped_bytes`] of an open original checkpoint.
pub fn shipped_bytes_of(
    ck: &keep_checkpoint::Checkpoint,
    layers: &[usize],
) -> Result<Vec<Vec<u64>>> {
    expert_bytes_of(
        ck,
        std::path::Path::new("the original checkpoint"),
        layers,
        false,
    )
}

/// [`residual_bytes`] of an open checkpoint.
pub fn residual_bytes_of(
    ck: &keep_checkpoint::Checkpoint,
    layers: &[usize],
) -> Result<Vec<Vec<u64>>> {
    expert_bytes_of(ck, std::path::Path::new("the checkpoint"), layers, true)
}

fn expert_bytes(dir: &std::path::Path, layers: &[usize], resid: bool) -> Result<Vec<Vec<u64>>> {
    let ck = keep_checkpoint::Checkpoint::open(dir)?;
    expert_bytes_of(&ck, dir, layers, resid)
}

fn expert_bytes_of(
    ck: &keep_checkpoint::Checkpoint,
    dir: &std::path::Path,
    layers: &[usize],
    resid: bool,
) -> Result<Vec<Vec<u64>>> {
    let cfg = ck.require_config()?;
    let mut out = Vec::with_capacity(layers.len());
    for &l in layers {
        let n = cfg.experts_in_layer(l);
        let mut v = vec![0u64; n];
        if !cfg.is_moe_layer(l) {
            out.push(v);
            continue;
        }
        for (e, b) in v.iter_mut().enumerate() {
            // The family's matrices of the expert under the names their codes take.
            for m in cfg.coded_matrices(l, e) {
                let (mat, w) = (m.mat, format!("{}.weight", m.base));
                if resid {
                    if let Some((r, rs)) = keep_checkpoint::layout::residual_of(ck, &w) {
                        *b += r.bytes.len() as u64 + rs.map_or(0, |s| s.bytes.len() as u64);
                    }
                    continue;
                }
                let em = keep_checkpoint::layout::expert_matrix(ck, cfg, l, e, mat)
                    .map_err(|msg| ResidencyError::Config(format!("{}: {msg}", dir.display())))?;
                *b += em.weight.bytes.len() as u64
                    + em.scale.map_or(0, |s| s.bytes.len() as u64)
                    + em.biases.map_or(0, |s| s.bytes.len() as u64);
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// Each expert's upper stage and its bytes, by the one rule ([`upper_stage`]), for the experts
/// of `layers` a checkpoint holds: `residual[i][e]` bytes of the residual codes it carries
/// (0: none), `shipped` (an original checkpoint given) the bytes of each original expert,
/// `alloc` the allocation (`None`: every E8P expert at its `e8p2` base, [`implicit_rung`]).
/// Checks that the checkpoint holds each allocated rung: an expert at `e8p2+e81` or
/// `e8p2+e8p2` carries its residual (it is part of its base); a `shipped` one carries none.
pub fn upper_stages(
    alloc: Option<&keep_artifacts::alloc::Alloc>,
    layers: &[usize],
    residual: &[Vec<u64>],
    shipped: Option<&[Vec<u64>]>,
) -> Result<Vec<Vec<(UpperStage, u64)>>> {
    let mut out = Vec::with_capacity(layers.len());
    for (i, (&l, res)) in layers.iter().zip(residual).enumerate() {
        let rungs = rungs_of_layer(alloc, l, res.len(), &|e| res[e] > 0)?;
        let orig = original_ids(alloc, l, res.len());
        let mut v = Vec::with_capacity(res.len());
        for (e, rung) in rungs.iter().enumerate() {
            let has_res = res[e] > 0;
            if residual_in_base(rung) != has_res && (rung != "e8p2" || !has_res) {
                return Err(ResidencyError::Config(format!(
                    "expert {e} of layer {l} is `{rung}` in the allocation but {} residual codes \
                     in the checkpoint: quantize with `keep quant --alloc` first",
                    if has_res { "has" } else { "has no" }
                )));
            }
            let sb = shipped
                .and_then(|s| s.get(i))
                .and_then(|s| s.get(orig[e]))
                .copied()
                .filter(|&b| b > 0);
            let stage = upper_stage(rung, has_res, sb.is_some());
            let bytes = match stage {
                UpperStage::None => 0,
                UpperStage::Residual => res[e],
                UpperStage::Shipped => sb.unwrap_or(0),
            };
            v.push((stage, bytes));
        }
        out.push(v);
    }
    Ok(out)
}

/// Of [`upper_stages`], the bytes only (what [`TierSpec::upper_bytes`] takes).
pub fn stage_bytes(stages: &[Vec<(UpperStage, u64)>]) -> Vec<Vec<u64>> {
    stages
        .iter()
        .map(|v| v.iter().map(|s| s.1).collect())
        .collect()
}

/// Experts per kind of upper stage: (residual, shipped, none).
pub fn stage_mix(stages: &[Vec<(UpperStage, u64)>]) -> (usize, usize, usize) {
    let mut m = (0, 0, 0);
    for s in stages.iter().flatten() {
        match s.0 {
            UpperStage::Residual => m.0 += 1,
            UpperStage::Shipped => m.1 += 1,
            UpperStage::None => m.2 += 1,
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use keep_artifacts::routes::{LayerRoutes, Session};

    fn trace(experts: Vec<u16>, weights: Vec<f32>, top_k: usize) -> RouteTrace {
        RouteTrace {
            path: "t".into(),
            sessions: vec![Session {
                id: "s".into(),
                model_fingerprint: None,
                layers: vec![LayerRoutes {
                    layer: 0,
                    top_k,
                    n_experts: 4,
                    hash: false,
                    experts,
                    weights,
                }],
                source: None,
            }],
            skipped: vec![],
        }
    }

    #[test]
    fn lru_evicts_ready_unused_entries_only() {
        let mut c = ResidualLru::new(10);
        assert_eq!(c.admit(1, 4, &|_| false), Admit::Admitted(vec![]));
        assert_eq!(c.admit(2, 4, &|_| false), Admit::Admitted(vec![]));
        // Both loading: no room for a third.
        assert_eq!(c.admit(3, 4, &|_| false), Admit::NoRoom);
        c.mark_ready(1);
        c.mark_ready(2);
        c.touch(1);
        // 2 is the least recently used ready entry.
        assert_eq!(c.admit(3, 4, &|_| false), Admit::Admitted(vec![2]));
        // 1 in use: nothing can go.
        c.mark_ready(3);
        assert_eq!(c.admit(4, 4, &|k| k == 1 || k == 3), Admit::NoRoom);
        assert_eq!(c.admit(5, 11, &|_| false), Admit::NoRoom);
        assert_eq!((c.used(), c.len()), (8, 2));
        assert_eq!(c.state(3), Entry::Ready);
        assert_eq!(c.state(2), Entry::Absent);
    }

    #[test]
    fn upper_stage_serves_k_tokens_after_the_miss() {
        // Expert 1 with gate 0.9 on every token; expert 0 light.
        let t = trace(
            vec![0, 1, 0, 1, 0, 1, 0, 1],
            vec![0.1, 0.9, 0.1, 0.9, 0.1, 0.9, 0.1, 0.9],
            2,
        );
        let spec = |k, tau| TierSpec {
            tau,
            cache_bytes: 100,
            admit_delay: k,
            upper_bytes: vec![vec![10, 10, 10, 10]],
            prefill_tokens: 0,
        };
        let c = replay_tiers(&t, &spec(2, 0.5)).unwrap();
        // Token 0: miss (admitted), token 1: in flight, tokens 2, 3: upper.
        assert_eq!(
            (c.upper, c.upper_misses, c.in_flight, c.admissions),
            (2, 2, 1, 1)
        );
        assert_eq!((c.slots, c.base, c.above_tau), (8, 6, 4));
        assert_eq!(c.residual_bytes_read, 10);
        assert_eq!(c.residual_bytes_used, 20);
        // τ above every gate: nothing upper, nothing read.
        let c = replay_tiers(&t, &spec(1, 1.5)).unwrap();
        assert_eq!((c.upper, c.admissions, c.base), (0, 0, 8));
        assert!(replay_tiers(&t, &spec(0, 0.5)).is_err());
    }

    #[test]
    fn a_prefill_admits_in_one_pass_and_serves_after_it() {
        // Expert 1 heavy on every token of 6; the first 4 are one prefill forward.
        let t = trace([0, 1].repeat(6), [0.1, 0.9].repeat(6), 2);
        let spec = |k, prefill| TierSpec {
            tau: 0.5,
            cache_bytes: 100,
            admit_delay: k,
            upper_bytes: vec![vec![10, 10, 10, 10]],
            prefill_tokens: prefill,
        };
        let mut rows = vec![];
        let c = replay_tiers_with(&t, &spec(1, 4), &mut |_, t, _, up| rows.push((t, up))).unwrap();
        // The prefill admits expert 1 at its first token; its other 3 tokens find the read in
        // flight (nothing completes inside a forward); both decode tokens are upper.
        let upper: Vec<usize> = rows.iter().filter(|r| r.1).map(|r| r.0).collect();
        assert_eq!(upper, vec![4, 5]);
        assert_eq!(
            (c.upper, c.upper_misses, c.in_flight, c.admissions, c.tokens),
            (2, 4, 3, 1, 6)
        );
        // Token by token the same trace serves from token 1.
        let c = replay_tiers(&t, &spec(1, 0)).unwrap();
        assert_eq!((c.upper, c.in_flight, c.admissions), (5, 0, 1));
        // A delay of 2 after the prefill: the first decode token still misses.
        let c = replay_tiers(&t, &spec(2, 4)).unwrap();
        assert_eq!((c.upper, c.in_flight), (1, 4));
    }

    #[test]
    fn upper_stages_follow_the_allocated_rungs() {
        use keep_artifacts::alloc::{Alloc, LayerAlloc};
        let alloc = Alloc {
            format: Alloc::FORMAT.into(),
            version: Alloc::VERSION,
            model: "m".into(),
            model_fingerprint: "fp".into(),
            budget_bytes: 100,
            bytes: 0,
            rungs: vec![],
            solver: "exact".into(),
            grain_bytes: 1,
            predicted_loss: 0.0,
            saliency: "reap".into(),
            layers: vec![LayerAlloc {
                layer: 3,
                rungs: vec!["e8p2".into(), "pruned".into(), "e8p2+e81".into()],
            }],
            extra: Default::default(),
        };
        let stages = |r: Vec<u64>, shipped: Option<Vec<u64>>| {
            let sh = shipped.map(|v| vec![v]);
            upper_stages(Some(&alloc), &[3], &[r], sh.as_deref())
        };
        // Survivors in order: expert 0 (`e8p2`) with no residual has no upper stage; expert 1
        // (was 2, `e8p2+e81`) keeps its residual in its base.
        let s = stages(vec![0, 7], None).unwrap();
        assert_eq!(s, vec![vec![(UpperStage::None, 0), (UpperStage::None, 0)]]);
        // An `e8p2` expert whose checkpoint carries residual codes: they are its upper stage.
        let s = stages(vec![5, 7], None).unwrap();
        assert_eq!(s[0][0], (UpperStage::Residual, 5));
        // With the original checkpoint: the top quantized rung upgrades to the shipped expert
        // (original expert 2's bytes), the `e8p2` one to its residual when it has one.
        let s = stages(vec![5, 7], Some(vec![30, 31, 32])).unwrap();
        assert_eq!(
            s[0],
            vec![(UpperStage::Residual, 5), (UpperStage::Shipped, 32)]
        );
        let s = stages(vec![0, 7], Some(vec![30, 31, 32])).unwrap();
        assert_eq!(
            s[0],
            vec![(UpperStage::Shipped, 30), (UpperStage::Shipped, 32)]
        );
        // The top quantized rung without its residual, or a wrong count: not this checkpoint.
        assert!(stages(vec![0, 0], None).is_err());
        assert!(stages(vec![0, 7, 7], None).is_err());
        // A layer the file does not list: every E8P expert at its `e8p2` base.
        let s = upper_stages(Some(&alloc), &[4], &[vec![1, 0]], None).unwrap();
        assert_eq!(s[0], vec![(UpperStage::Residual, 1), (UpperStage::None, 0)]);
    }
}
