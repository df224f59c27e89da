//! The replay loop: one policy, one hot-set size, every (layer, session) stream of a trace,
//! with the fetch threshold; counts per layer, pooled over sessions.
//!
//! Residency (and every policy's state) is reset at each session boundary; counts are summed
//! over sessions. The loop is single-threaded and monomorphised per policy: per access one
//! array lookup for residency and O(1) (LRU, static) or O(log H) (decay, Belady) updates.

use std::borrow::Cow;
use std::time::Instant;

use serde::Serialize;

use crate::policy::{Belady, Decay, Lru, Policy, PolicyKind, Start, StaticSet, Stream};
use keep_artifacts::routes::RouteTrace;

/// Where the warm-start ordering comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmStart {
    /// Empty hot sets (static ranks experts by first use).
    None,
    /// Experts ordered by routed count over the whole trace (pooled over sessions).
    Frequency,
    /// Experts ordered by REAP saliency (`reap-stats.safetensors`).
    Reap,
}

impl WarmStart {
    /// Parse the CLI spelling.
    pub fn parse(s: &str) -> Option<WarmStart> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Some(WarmStart::None),
            "frequency" | "freq" => Some(WarmStart::Frequency),
            "reap" => Some(WarmStart::Reap),
            _ => None,
        }
    }
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            WarmStart::None => "none",
            WarmStart::Frequency => "frequency",
            WarmStart::Reap => "reap",
        }
    }
}

/// Counts of one layer (summed over sessions).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Counts {
    /// Tokens replayed.
    pub tokens: u64,
    /// Routed slots replayed (tokens × top-k).
    pub slots: u64,
    /// Slots whose expert was resident.
    pub hits: u64,
    /// Slots whose expert was read from SSD.
    pub misses: u64,
    /// Of `misses`, the reads of hash-routed layers: their experts follow from the token id, so
    /// the runtime starts these reads before the layer runs (prefetched, not waited for).
    pub prefetched: u64,
    /// Missed slots dropped by the fetch threshold (not read).
    pub dropped: u64,
    /// Gate weight of all slots.
    pub gate_mass: f64,
    /// Gate weight of the dropped slots.
    pub dropped_mass: f64,
    /// Accesses to experts not resident at the session's start and not touched before in it
    /// (the misses no policy can avoid when fetching every miss).
    pub cold_starts: u64,
}

impl Counts {
    /// Add another layer's or session's counts.
    pub fn add(&mut self, o: &Counts) {
        self.tokens += o.tokens;
        self.slots += o.slots;
        self.hits += o.hits;
        self.misses += o.misses;
        self.prefetched += o.prefetched;
        self.dropped += o.dropped;
        self.gate_mass += o.gate_mass;
        self.dropped_mass += o.dropped_mass;
        self.cold_starts += o.cold_starts;
    }
    /// Misses (reads) per routed slot.
    pub fn miss_rate(&self) -> f64 {
        ratio(self.misses as f64, self.slots as f64)
    }
}

pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// One replay's inputs besides the trace.
#[derive(Debug, Clone, Copy)]
pub struct ReplaySpec<'a> {
    pub policy: PolicyKind,
    /// Hot-set size per recorded layer (trace order).
    pub capacity: &'a [usize],
    /// Warm-start ordering per recorded layer (a permutation of `0..n_experts`).
    pub order: &'a [Vec<u16>],
    /// Whether hot sets start filled with the top of `order`.
    pub prefill: bool,
    /// Decay half-life in tokens.
    pub half_life: f64,
    /// A missed slot with gate weight below this is dropped; `0` fetches every miss.
    pub threshold: f32,
}

/// The outcome of one replay.
#[derive(Debug, Clone)]
pub struct Replayed {
    /// Counts per recorded layer (trace order).
    pub layers: Vec<Counts>,
    /// Seconds spent in the policy loop (resets included), single-threaded.
    pub seconds: f64,
}

fn run_stream<P: Policy>(
    p: &mut P,
    stream: &Stream,
    weights: &[f32],
    start: &Start,
    threshold: f32,
    c: &mut Counts,
) {
    p.reset(stream, start);
    let (mut hits, mut misses, mut dropped) = (0u64, 0u64, 0u64);
    let mut dropped_mass = 0f64;
    let k = stream.top_k.max(1);
    for (i, (&e, &w)) in stream.experts.iter().zip(weights).enumerate() {
        if i % k == 0 {
            p.begin_token(i, &stream.experts[i..(i + k).min(stream.experts.len())]);
        }
        let admit = w >= threshold;
        if p.access(i, e, admit) {
            hits += 1;
        } else if admit {
            misses += 1;
        } else {
            dropped += 1;
            dropped_mass += w as f64;
        }
    }
    c.hits += hits;
    c.misses += misses;
    c.dropped += dropped;
    c.dropped_mass += dropped_mass;
}

fn replay_with<P: Policy>(p: &mut P, trace: &RouteTrace, spec: &ReplaySpec) -> Replayed {
    let nl = trace.sessions.first().map_or(0, |s| s.layers.len());
    let mut layers = vec![Counts::default(); nl];
    let mut seconds = 0.0;
    for s in &trace.sessions {
        for (li, l) in s.layers.iter().enumerate() {
            let cap = spec.capacity.get(li).copied().unwrap_or(0).min(l.n_experts);
            let order = spec.order.get(li).map_or(&[][..], |o| &o[..]);
            let start = Start {
                capacity: cap,
                order,
                prefill: spec.prefill,
            };
            let (experts, weights) = by_id_within_tokens(&l.experts, &l.weights, l.top_k);
            let stream = Stream {
                experts: &experts,
                top_k: l.top_k,
                n_experts: l.n_experts,
            };
            let c = &mut layers[li];
            let t0 = Instant::now();
            let before = c.misses;
            run_stream(p, &stream, &weights, &start, spec.threshold, c);
            seconds += t0.elapsed().as_secs_f64();
            if l.hash {
                c.prefetched += c.misses - before;
            }
            c.tokens += l.tokens() as u64;
            c.slots += l.experts.len() as u64;
            c.gate_mass += l.weights.iter().map(|&w| w as f64).sum::<f64>();
            c.cold_starts += cold_starts(&l.experts, l.n_experts, start.initial());
        }
    }
    Replayed { layers, seconds }
}

/// A stream with each token's experts in ascending id (the order in which the runtime serves
/// a pass's experts), weights alongside; borrowed when it already is.
pub fn by_id_within_tokens<'a>(
    experts: &'a [u16],
    weights: &'a [f32],
    top_k: usize,
) -> (Cow<'a, [u16]>, Cow<'a, [f32]>) {
    let k = top_k.max(1);
    if experts.chunks(k).all(|t| t.is_sorted()) {
        return (Cow::Borrowed(experts), Cow::Borrowed(weights));
    }
    let mut es = Vec::with_capacity(experts.len());
    let mut ws = Vec::with_capacity(weights.len());
    let mut tok: Vec<(u16, f32)> = Vec::with_capacity(k);
    for (te, tw) in experts.chunks(k).zip(weights.chunks(k)) {
        tok.clear();
        tok.extend(te.iter().copied().zip(tw.iter().copied()));
        tok.sort_by_key(|p| p.0);
        es.extend(tok.iter().map(|p| p.0));
        ws.extend(tok.iter().map(|p| p.1));
    }
    (Cow::Owned(es), Cow::Owned(ws))
}

/// Distinct experts of a stream that are not in `initial`.
pub fn cold_starts(experts: &[u16], n_experts: usize, initial: &[u16]) -> u64 {
    let mut seen = vec![false; n_experts];
    for &e in initial {
        if let Some(s) = seen.get_mut(e as usize) {
            *s = true;
        }
    }
    let mut n = 0;
    for &e in experts {
        if let Some(s) = seen.get_mut(e as usize) {
            if !*s {
                *s = true;
                n += 1;
            }
        }
    }
    n
}

/// Replay the whole trace through one policy at one hot-set size. Callers must pass a trace
/// whose ids are below each layer's `n_experts` (every trace [`keep_artifacts::routes::read_run`]
/// returns is) and orderings that are permutations of `0..n_experts`.
pub fn replay(trace: &RouteTrace, spec: &ReplaySpec) -> Replayed {
    match spec.policy {
        PolicyKind::Static => replay_with(&mut StaticSet::default(), trace, spec),
        PolicyKind::Lru => replay_with(&mut Lru::default(), trace, spec),
        PolicyKind::Decay => replay_with(&mut Decay::new(spec.half_life), trace, spec),
        PolicyKind::Belady => replay_with(&mut Belady::default(), trace, spec),
    }
}

/// Experts of each recorded layer ordered by routed count over all sessions (ties: lower id
/// first).
pub fn frequency_order(trace: &RouteTrace) -> Vec<Vec<u16>> {
    let Some(first) = trace.sessions.first() else {
        return vec![];
    };
    let mut counts: Vec<Vec<u64>> = first.layers.iter().map(|l| vec![0; l.n_experts]).collect();
    for s in &trace.sessions {
        for (li, l) in s.layers.iter().enumerate() {
            let c = &mut counts[li];
            for &e in &l.experts {
                if let Some(x) = c.get_mut(e as usize) {
                    *x += 1;
                }
            }
        }
    }
    counts
        .iter()
        .map(|c| order_by(&c.iter().map(|&x| x as f64).collect::<Vec<_>>()))
        .collect()
}

/// Indices ordered by descending score (ties: lower index first). Scores must not be NaN.
pub fn order_by(scores: &[f64]) -> Vec<u16> {
    let mut idx: Vec<u16> = (0..scores.len() as u32).map(|i| i as u16).collect();
    idx.sort_by(|&a, &b| {
        scores[b as usize]
            .partial_cmp(&scores[a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::reference;
    use keep_artifacts::routes::{LayerRoutes, Session};
    use proptest::prelude::*;

    /// A random single-layer trace: `sessions` of `tokens` each, `k` distinct experts per token
    /// out of `n`, with weights in (0, 1].
    fn trace_from(n: usize, k: usize, sessions: Vec<Vec<(Vec<u16>, Vec<f32>)>>) -> RouteTrace {
        RouteTrace {
            sessions: sessions
                .into_iter()
                .enumerate()
                .map(|(si, toks)| Session {
                    id: format!("s{si}"),
                    layers: vec![LayerRoutes {
                        layer: 0,
                        top_k: k,
                        n_experts: n,
                        hash: false,
                        experts: toks.iter().flat_map(|t| t.0.clone()).collect(),
                        weights: toks.iter().flat_map(|t| t.1.clone()).collect(),
                    }],
                    ..Session::default()
                })
                .collect(),
            ..RouteTrace::default()
        }
    }

    fn token(n: usize, k: usize) -> impl Strategy<Value = (Vec<u16>, Vec<f32>)> {
        (
            Just(()).prop_perturb(move |_, mut rng| {
                // k distinct experts out of n, with a bias toward low ids (locality).
                let mut v: Vec<u16> = vec![];
                while v.len() < k {
                    let e = (rng.random::<u32>() % n as u32) as u16;
                    let e = if rng.random::<bool>() { e / 2 } else { e };
                    if !v.contains(&e) {
                        v.push(e);
                    }
                }
                v
            }),
            proptest::collection::vec(1u8..=16, k),
        )
            .prop_map(|(e, w)| {
                // In ascending id, as the replay takes a token's experts.
                let mut p: Vec<(u16, f32)> = e
                    .into_iter()
                    .zip(w.into_iter().map(|x| x as f32 / 16.0))
                    .collect();
                p.sort_by_key(|x| x.0);
                p.into_iter().unzip()
            })
    }

    fn traces() -> impl Strategy<Value = RouteTrace> {
        let n = 8;
        let k = 2;
        proptest::collection::vec(proptest::collection::vec(token(n, k), 0..30), 1..4)
            .prop_map(move |s| trace_from(n, k, s))
    }

    const KINDS: [PolicyKind; 4] = PolicyKind::ALL;

    fn spec_of<'a>(
        policy: PolicyKind,
        cap: &'a [usize],
        order: &'a [Vec<u16>],
        prefill: bool,
        threshold: f32,
    ) -> ReplaySpec<'a> {
        ReplaySpec {
            policy,
            capacity: cap,
            order,
            prefill,
            half_life: 3.0,
            threshold,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Every policy's hits, misses and drops equal the brute-force reference's, for every
        /// hot-set size, warm start and a fetch threshold.
        #[test]
        fn policies_match_brute_force(t in traces(), cap in 0usize..=8, prefill in any::<bool>(),
                                      thr in prop_oneof![Just(0.0f32), Just(0.3f32)]) {
            let order = frequency_order(&t);
            for kind in KINDS {
                let caps = [cap];
                let r = replay(&t, &spec_of(kind, &caps, &order, prefill, thr));
                let mut want = Counts::default();
                for s in &t.sessions {
                    let l = &s.layers[0];
                    let admit: Vec<bool> = l.weights.iter().map(|&w| w >= thr).collect();
                    let hits = reference::replay(kind, &l.experts, &admit, 2, 8, cap, &order[0], prefill, 3.0);
                    for (i, &h) in hits.iter().enumerate() {
                        if h { want.hits += 1 } else if admit[i] { want.misses += 1 } else {
                            want.dropped += 1; want.dropped_mass += l.weights[i] as f64;
                        }
                    }
                }
                let got = r.layers[0];
                prop_assert_eq!((got.hits, got.misses, got.dropped), (want.hits, want.misses, want.dropped), "{:?}", kind);
                prop_assert!((got.dropped_mass - want.dropped_mass).abs() < 1e-9);
            }
        }

        /// No policy misses less than Belady, and Belady equals the exhaustive optimum.
        #[test]
        fn nothing_beats_belady(t in traces(), cap in 0usize..=8, prefill in any::<bool>()) {
            let order = frequency_order(&t);
            let caps = [cap];
            let b = replay(&t, &spec_of(PolicyKind::Belady, &caps, &order, prefill, 0.0)).layers[0].misses;
            for kind in KINDS {
                let m = replay(&t, &spec_of(kind, &caps, &order, prefill, 0.0)).layers[0].misses;
                prop_assert!(m >= b, "{:?} missed {} < Belady {}", kind, m, b);
            }
            let init: &[u16] = if prefill { &order[0][..cap] } else { &[] };
            let opt: u64 = t.sessions.iter()
                .map(|s| reference::optimal_misses(&s.layers[0].experts, 8, cap, init) as u64)
                .sum();
            prop_assert_eq!(b, opt);
        }

        /// With a hot set as large as the layer, every policy misses only its cold starts.
        #[test]
        fn full_hot_set_misses_only_cold_starts(t in traces(), prefill in any::<bool>()) {
            let order = frequency_order(&t);
            let caps = [8usize];
            for kind in KINDS {
                let c = replay(&t, &spec_of(kind, &caps, &order, prefill, 0.0)).layers[0];
                prop_assert_eq!(c.misses, c.cold_starts, "{:?}", kind);
                if prefill { prop_assert_eq!(c.misses, 0); }
            }
        }

        /// Gate-mass accounting: dropped + fetched + hit slots cover every slot; the dropped
        /// mass is the weight of exactly the dropped slots, each below the threshold.
        #[test]
        fn threshold_accounting(t in traces(), cap in 0usize..=8, thr in 0.0f32..1.0) {
            let order = frequency_order(&t);
            let caps = [cap];
            for kind in KINDS {
                let c = replay(&t, &spec_of(kind, &caps, &order, false, thr)).layers[0];
                prop_assert_eq!(c.hits + c.misses + c.dropped, c.slots);
                prop_assert!(c.dropped_mass <= c.dropped as f64 * thr as f64 + 1e-9);
                prop_assert!(c.dropped_mass <= c.gate_mass + 1e-9);
                if thr == 0.0 { prop_assert_eq!(c.dropped, 0); }
            }
        }
    }

    #[test]
    fn residency_resets_at_session_boundaries() {
        // Two identical sessions: the second misses exactly as the first (nothing carried).
        let tok = |a: u16, b: u16| (vec![a, b], vec![0.5, 0.5]);
        let one = vec![tok(0, 1), tok(2, 3), tok(0, 1)];
        let t1 = trace_from(4, 2, vec![one.clone()]);
        let t2 = trace_from(4, 2, vec![one.clone(), one]);
        let order = frequency_order(&t1);
        for kind in KINDS {
            let caps = [4];
            let a = replay(&t1, &spec_of(kind, &caps, &order, false, 0.0)).layers[0];
            let b = replay(&t2, &spec_of(kind, &caps, &order, false, 0.0)).layers[0];
            assert_eq!(b.misses, 2 * a.misses, "{kind:?}");
            assert_eq!(a.misses, 4, "{kind:?}: four cold starts");
            assert_eq!(b.cold_starts, 8);
            assert_eq!(b.tokens, 6);
        }
    }

    #[test]
    fn hash_layer_reads_count_as_prefetched() {
        let tok = |e: &[u16]| (e.to_vec(), vec![0.5; e.len()]);
        let mut t = trace_from(8, 2, vec![vec![tok(&[0, 1]), tok(&[2, 3]), tok(&[0, 1])]]);
        let cap = [2usize];
        let order: Vec<Vec<u16>> = vec![(0..8).collect()];
        let spec = |k| ReplaySpec {
            policy: k,
            capacity: &cap,
            order: &order,
            prefill: false,
            half_life: 0.0,
            threshold: 0.0,
        };
        let plain = replay(&t, &spec(PolicyKind::Lru)).layers[0];
        assert_eq!((plain.misses, plain.prefetched), (6, 0));
        t.sessions[0].layers[0].hash = true;
        let hashed = replay(&t, &spec(PolicyKind::Lru)).layers[0];
        assert_eq!((hashed.misses, hashed.prefetched), (6, 6));
    }

    #[test]
    fn threshold_drops_light_misses_only() {
        // Expert 1 is light (0.1) on its first use: dropped, then hit never (not admitted);
        // its second use is heavy: fetched.
        let t = trace_from(
            4,
            2,
            vec![vec![
                (vec![0, 1], vec![0.9, 0.1]),
                (vec![0, 1], vec![0.9, 0.6]),
                (vec![0, 1], vec![0.9, 0.1]),
            ]],
        );
        let order = frequency_order(&t);
        let caps = [4];
        let c = replay(&t, &spec_of(PolicyKind::Lru, &caps, &order, false, 0.2)).layers[0];
        assert_eq!((c.hits, c.misses, c.dropped), (3, 2, 1));
        assert!((c.dropped_mass - 0.1f32 as f64).abs() < 1e-12);
        assert!((c.gate_mass - (2.7f32 as f64 + 0.8f32 as f64)).abs() < 1e-5);
    }

    #[test]
    fn a_tokens_experts_replay_in_ascending_id() {
        // The same tokens with their experts in router order and in ascending id replay alike;
        // the weights travel with their experts.
        let router = [(vec![3, 0], vec![0.1, 0.9]), (vec![2, 1], vec![0.5, 0.5])];
        let sorted = [(vec![0, 3], vec![0.9, 0.1]), (vec![1, 2], vec![0.5, 0.5])];
        let mut toks = vec![];
        for i in 0..12 {
            toks.push(router[i % 2].clone());
        }
        let a = trace_from(4, 2, vec![toks]);
        let l = &a.sessions[0].layers[0];
        let (e, w) = by_id_within_tokens(&l.experts, &l.weights, 2);
        assert_eq!(&e[..4], &[0, 3, 1, 2]);
        assert_eq!(&w[..2], &[0.9, 0.1]);
        let b = trace_from(4, 2, vec![(0..12).map(|i| sorted[i % 2].clone()).collect()]);
        let order = frequency_order(&a);
        for kind in KINDS {
            for cap in 0..=4 {
                let caps = [cap];
                let ra = replay(&a, &spec_of(kind, &caps, &order, false, 0.2)).layers[0];
                let rb = replay(&b, &spec_of(kind, &caps, &order, false, 0.2)).layers[0];
                assert_eq!(
                    (ra.hits, ra.misses, ra.dropped),
                    (rb.hits, rb.misses, rb.dropped)
                );
            }
        }
    }

    #[test]
    fn frequency_order_pools_sessions() {
        let t = trace_from(
            3,
            1,
            vec![
                vec![(vec![2], vec![1.0]), (vec![2], vec![1.0])],
                vec![
                    (vec![1], vec![1.0]),
                    (vec![1], vec![1.0]),
                    (vec![1], vec![1.0]),
                ],
            ],
        );
        assert_eq!(frequency_order(&t), vec![vec![1, 2, 0]]);
    }
}
