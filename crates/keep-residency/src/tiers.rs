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
use crate::sim::by_id_within_tokens;
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
}

/// Replay the tier policy over `trace` (see the module doc).
pub fn replay_tiers(trace: &RouteTrace, spec: &TierSpec) -> Result<TierCounts> {
    if spec.admit_delay == 0 {
        return Err(ResidencyError::Config(
            "the admission delay is at least 1 token (a read issued now serves from a later token)"
                .into(),
        ));
    }
    if spec.tau.is_nan() {
        return Err(ResidencyError::Config(format!(
            "τ {} is not a number",
            spec.tau
        )));
    }
    let mut total = TierCounts::default();
    for s in &trace.sessions {
        if s.layers.len() != spec.upper_bytes.len() {
            return Err(ResidencyError::Config(format!(
                "the trace records {} layers, the tier sizes cover {}",
                s.layers.len(),
                spec.upper_bytes.len()
            )));
        }
        let n_max = s.layers.iter().map(|l| l.n_experts).max().unwrap_or(0) as u64;
        let sorted: Vec<_> = s
            .layers
            .iter()
            .map(|l| by_id_within_tokens(&l.experts, &l.weights, l.top_k))
            .collect();
        let tokens = s.layers.iter().map(|l| l.tokens()).min().unwrap_or(0);
        let mut lru = ResidualLru::new(spec.cache_bytes);
        // (usable from token, key)
        let mut loading: Vec<(usize, u64)> = vec![];
        let mut c = TierCounts::default();
        for t in 0..tokens {
            loading.retain(|&(at, k)| {
                if at <= t {
                    lru.mark_ready(k);
                    false
                } else {
                    true
                }
            });
            for (li, l) in s.layers.iter().enumerate() {
                let k = l.top_k;
                let (ex, ws) = (
                    &sorted[li].0[t * k..(t + 1) * k],
                    &sorted[li].1[t * k..(t + 1) * k],
                );
                let key_of = |e: u16| li as u64 * n_max + e as u64;
                let in_token: Vec<u64> = ex.iter().map(|&e| key_of(e)).collect();
                let mut used_now: Vec<u16> = vec![];
                for (&e, &w) in ex.iter().zip(ws) {
                    c.slots += 1;
                    let ub = spec.upper_bytes[li].get(e as usize).copied().unwrap_or(0);
                    if w >= spec.tau {
                        c.above_tau += 1;
                    }
                    if ub == 0 || w < spec.tau {
                        c.base += 1;
                        continue;
                    }
                    let key = key_of(e);
                    match lru.state(key) {
                        Entry::Ready => {
                            c.upper += 1;
                            lru.touch(key);
                            if !used_now.contains(&e) {
                                used_now.push(e);
                                c.residual_bytes_used += ub;
                            }
                        }
                        Entry::Loading => {
                            c.base += 1;
                            c.upper_misses += 1;
                            c.in_flight += 1;
                        }
                        Entry::Absent => {
                            c.base += 1;
                            c.upper_misses += 1;
                            match lru.admit(key, ub, &|x| in_token.contains(&x)) {
                                Admit::Admitted(ev) => {
                                    c.admissions += 1;
                                    c.evictions += ev.len() as u64;
                                    c.residual_bytes_read += ub;
                                    loading.push((t + spec.admit_delay, key));
                                }
                                Admit::NoRoom => c.no_room += 1,
                            }
                        }
                    }
                }
            }
        }
        c.tokens = tokens as u64;
        total.add(&c);
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
    /// Experts with an upper stage / routed experts of the recorded layers.
    pub experts_with_upper: u64,
    pub experts: u64,
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

/// Bytes of each routed expert's upper stage (its `.resid.weight` and `.resid.scale` tensors
/// over `w1`, `w2`, `w3`; 0 for an expert without one) for every layer of `layers`, from the
/// checkpoint at `dir`.
pub fn upper_bytes(dir: &std::path::Path, layers: &[usize]) -> Result<Vec<Vec<u64>>> {
    use keep_checkpoint::naming::{self, ExpertMat};
    let ck = keep_checkpoint::Checkpoint::open(dir)?;
    let cfg = ck.require_config()?;
    let qwen3 = cfg.qwen3.clone();
    let mut out = Vec::with_capacity(layers.len());
    for &l in layers {
        let n = cfg.experts_in_layer(l);
        let mut v = vec![0u64; n];
        if qwen3.as_ref().is_some_and(|q| !q.is_moe_layer(l)) {
            out.push(v);
            continue;
        }
        for (e, b) in v.iter_mut().enumerate() {
            for mat in ExpertMat::ALL {
                let w = match &qwen3 {
                    Some(_) => keep_checkpoint::qwen3::expert_tensor(l, e, mat, "weight"),
                    None => naming::expert_tensor(l, e, mat, "weight"),
                };
                if let Some((r, rs)) = keep_checkpoint::layout::residual_of(&ck, &w) {
                    *b += r.bytes.len() as u64 + rs.map_or(0, |s| s.bytes.len() as u64);
                }
            }
        }
        out.push(v);
    }
    Ok(out)
}

/// Check that the upper stages found (`upper[i][e]` > 0: expert `e` of `layers[i]` has one)
/// are the ones `alloc` describes: an expert at `e8p2+e81` or `e8p2+e8p2` has a residual stage,
/// any other rung none. Pruned experts are skipped in each layer's numbering (a pruned
/// checkpoint's experts are the survivors in order).
pub fn check_alloc(
    alloc: &keep_artifacts::alloc::Alloc,
    layers: &[usize],
    upper: &[Vec<u64>],
) -> Result<()> {
    for (&l, up) in layers.iter().zip(upper) {
        let Some(la) = alloc.layers.iter().find(|x| x.layer == l) else {
            continue;
        };
        let kept: Vec<&str> = la
            .rungs
            .iter()
            .map(String::as_str)
            .filter(|r| *r != keep_artifacts::alloc::PRUNED)
            .collect();
        if kept.len() != up.len() {
            return Err(ResidencyError::Config(format!(
                "the allocation keeps {} experts of layer {l}, the model has {}: it is not the \
                 allocation this checkpoint was quantized with",
                kept.len(),
                up.len()
            )));
        }
        for (e, (&rung, &b)) in kept.iter().zip(up).enumerate() {
            let want = matches!(rung, "e8p2+e81" | "e8p2+e8p2");
            if want != (b > 0) {
                return Err(ResidencyError::Config(format!(
                    "expert {e} of layer {l} is `{rung}` in the allocation but {} a residual \
                     stage in the checkpoint: quantize with `keep quant --alloc` first",
                    if b > 0 { "has" } else { "has no" }
                )));
            }
        }
    }
    Ok(())
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
    fn alloc_must_describe_the_upper_stages() {
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
        // Survivors in order: expert 0 base only, expert 1 (was 2) with a residual stage.
        assert!(check_alloc(&alloc, &[3], &[vec![0, 7]]).is_ok());
        assert!(check_alloc(&alloc, &[3], &[vec![5, 7]]).is_err());
        assert!(check_alloc(&alloc, &[3], &[vec![0, 0]]).is_err());
        assert!(check_alloc(&alloc, &[3], &[vec![0, 7, 7]]).is_err());
        // A layer the file does not list is not checked.
        assert!(check_alloc(&alloc, &[4], &[vec![1]]).is_ok());
    }
}
