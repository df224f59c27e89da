//! Drafting in a replay: the tokens/s of a budgeted decode with and without speculative
//! decoding, predicted from a route trace recorded without drafting.
//!
//! Without drafting every token is one forward: each layer reads its `top_k` experts (misses
//! from SSD, hits from memory) and the resident weights once. With K drafts a verify forward
//! feeds K + 1 rows: each layer reads the **union** of the experts its rows route to, the
//! resident weights once, and the drafter ([`Drafter`]): the MTP module once per draft plus
//! once for the pairs it is fed (K + 1 passes), or DSpark's one pass per window (its block of
//! `dspark_block_size` rows through every stage, whatever K); when a draft is rejected the kept
//! rows are replayed (the resident weights again, their experts from memory). The rows of a window are the trace's next K + 1 tokens — exact for accepted
//! drafts, a stand-in for rejected ones (their real routes are of tokens that were never kept).
//! Each window keeps `1 + accepted` tokens, the accepted count drawn with the measured acceptance
//! by draft position (each conditional on the previous being accepted, as `keep run` reports
//! it), from a seeded generator, and the next window starts after the kept tokens.
//!
//! Both sides replay the same LRU slot cache per layer (the runtime's default policy: a
//! forward's experts are taken together in ascending id and none is evicted for another of the
//! same forward), cold at each session, and the same cost model as [`crate::cost`]: seconds =
//! SSD bytes / SSD bandwidth + memory bytes / memory bandwidth, no overlap — a decode bound by
//! reads, which is where drafting can lose.
//!
//! With a [`ComputeCost`] (seconds measured on the model with its weights in memory: a forward
//! of each row count, the replay, the cache snapshot, the drafter's passes) the memory term
//! is replaced by that compute — it already includes reading the weights from memory — and each
//! side costs SSD bytes / SSD bandwidth + its forwards' measured seconds
//! ([`ComputeCost::plain_s`], [`ComputeCost::window_s`]). On a small model the verify window's
//! rows, the MTP passes and the snapshot cost more than the reads drafting saves, which the
//! reads-only model cannot see.

use keep_artifacts::routes::RouteTrace;
use keep_rng::Draw;
use serde::Serialize;

use crate::cost::CostModel;

/// Which drafter proposes the drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Drafter {
    /// DeepSeek-V4's autoregressive MTP module (`mtp.0.*`): one pass per draft, and one that
    /// feeds the kept pairs — K + 1 passes per window of K drafts.
    #[default]
    Mtp,
    /// DeepSeek-V4.1's DSpark (docs/dspark.md): one pass per window drafts its whole block, and
    /// the kept rows' target features are projected once (`main_proj`).
    DSpark,
}

impl Drafter {
    /// The name `--drafter` takes and the JSON writes.
    pub fn name(self) -> &'static str {
        match self {
            Drafter::Mtp => "mtp",
            Drafter::DSpark => "dspark",
        }
    }

    /// Passes of the drafter in a verify window of `rows` rows (the last token and `rows − 1`
    /// drafts): the MTP module once per draft plus once for the fed pairs, DSpark once.
    pub fn passes(self, rows: usize) -> u64 {
        match self {
            Drafter::Mtp => rows as u64,
            Drafter::DSpark => 1,
        }
    }
}

/// What drafting does, for the replay.
#[derive(Debug, Clone, Serialize)]
pub struct DraftSpec {
    /// Drafts per verify forward (for DSpark at most its block size).
    pub k: usize,
    /// Acceptance at each draft position (given the previous ones were accepted); missing
    /// positions are never accepted.
    pub acceptance: Vec<f64>,
    /// The drafter.
    pub drafter: Drafter,
    /// Bytes one pass of the drafter reads from memory: [`mtp_pass_bytes`] (its block's weights
    /// and `top_k` of its experts) or [`dspark_pass_bytes`] (every stage over the block).
    pub pass_bytes: u64,
    /// Seed of the acceptance draws.
    pub seed: u64,
    /// Measured compute of the forwards (`None`: reads only).
    pub compute: Option<ComputeCost>,
}

/// Seconds of the forwards a decode runs, measured with the weights in memory (reading them
/// from memory included): `keep_runtime::probe` measures them on a model.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ComputeCost {
    /// One decode forward of one row (logits of the last row).
    pub plain_s: f64,
    /// A verify forward of `i + 1` rows (logits and last-layer streams of every row).
    pub verify_s: Vec<f64>,
    /// The replay of `i + 1` kept rows after a rejection (no logits).
    pub replay_s: Vec<f64>,
    /// Snapshot of the decoding cache before a verify forward.
    pub snapshot_s: f64,
    /// One MTP module pass of one row with its logits (a draft).
    pub mtp_draft_s: f64,
    /// An MTP module pass of `i + 1` rows without logits (feeding the kept pairs).
    pub mtp_feed_s: Vec<f64>,
    /// Snapshot of the MTP module's cache around the provisional rows (K > 1).
    pub mtp_snapshot_s: f64,
    /// One DSpark pass: its whole block drafted (the stages over the window's projected rows,
    /// the heads and the Markov chain), whatever K.
    pub dspark_draft_s: f64,
    /// The projection (`main_proj`, `main_norm`) of `i + 1` kept rows' target features into
    /// DSpark's context rows.
    pub dspark_project_s: Vec<f64>,
}

/// Entry `n − 1` of per-row-count seconds (0 for `n = 0`); past the last entry, extended
/// linearly from the last two (or proportionally from a single one).
fn by_rows(v: &[f64], n: usize) -> f64 {
    match (n, v.len()) {
        (0, _) | (_, 0) => 0.0,
        (n, len) if n <= len => v[n - 1],
        (n, 1) => v[0] * n as f64,
        (n, len) => v[len - 1] + (v[len - 1] - v[len - 2]) * (n - len) as f64,
    }
}

impl ComputeCost {
    /// Seconds of one token without drafting.
    pub fn plain(&self) -> f64 {
        self.plain_s
    }

    /// Seconds of one verify window of `rows` rows (the last token and `rows − 1` drafts) that
    /// keeps `kept` tokens, as `keep_model`'s `drafter` runs it. MTP: the first draft (one MTP
    /// row with logits), the other `rows − 2` chained on the module's own output (their cache
    /// snapshot around them), the main cache's snapshot, the verify forward of `rows` rows, the
    /// replay of the `kept` rows when a draft was rejected, and the MTP pass that feeds the
    /// `kept − 1` pairs not fed while drafting. DSpark: one pass drafts the block, then the
    /// same snapshot, verify forward and replay, and the projection of the `kept` rows'
    /// features into its context.
    pub fn window_s(&self, drafter: Drafter, rows: usize, kept: usize) -> f64 {
        let drafts = rows.saturating_sub(1);
        let mut s = match drafter {
            Drafter::Mtp => {
                let mut s = self.mtp_draft_s * drafts as f64;
                if drafts > 1 {
                    s += self.mtp_snapshot_s;
                }
                s
            }
            Drafter::DSpark => self.dspark_draft_s,
        };
        s += self.snapshot_s + by_rows(&self.verify_s, rows);
        if kept < rows {
            s += by_rows(&self.replay_s, kept);
        }
        s + match drafter {
            Drafter::Mtp => by_rows(&self.mtp_feed_s, kept.saturating_sub(1)),
            Drafter::DSpark => by_rows(&self.dspark_project_s, kept),
        }
    }
}

/// One side of the prediction.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SideCost {
    /// Forwards replayed (verify forwards with drafting; tokens without).
    pub forwards: u64,
    pub tokens: u64,
    pub ssd_bytes_per_token: f64,
    pub mem_bytes_per_token: f64,
    /// Distinct experts per layer per forward, on average.
    pub experts_per_layer_forward: f64,
    pub seconds_per_token: f64,
    pub tokens_per_sec: f64,
}

/// The prediction at one hot-set size.
#[derive(Debug, Clone, Serialize)]
pub struct DraftPrediction {
    /// Slots per layer (the layer with the most experts).
    pub hot: usize,
    pub plain: SideCost,
    pub drafting: SideCost,
    /// Tokens per verify forward in the replay.
    pub tokens_per_forward: f64,
    /// `drafting.tokens_per_sec / plain.tokens_per_sec`.
    pub speedup: f64,
}

/// One layer's LRU slots: `stamp[e]` is the forward that last used expert `e` (0: not held).
struct Slots {
    cap: usize,
    held: Vec<bool>,
    stamp: Vec<u64>,
    n_held: usize,
}

impl Slots {
    fn new(n: usize, cap: usize) -> Slots {
        Slots {
            cap: cap.max(1),
            held: vec![false; n],
            stamp: vec![0; n],
            n_held: 0,
        }
    }

    /// One forward asks for `experts` (distinct, ascending): (hits, misses). A miss evicts the
    /// least recently used expert not used by this forward; when every slot is in use by it,
    /// the expert is read without being kept.
    fn forward(&mut self, experts: &[u16], now: u64) -> (u64, u64) {
        let (mut hits, mut misses) = (0, 0);
        for &e in experts {
            let e = e as usize;
            if self.held[e] {
                hits += 1;
                self.stamp[e] = now;
                continue;
            }
            misses += 1;
            if self.n_held < self.cap {
                self.held[e] = true;
                self.stamp[e] = now;
                self.n_held += 1;
                continue;
            }
            let victim = (0..self.held.len())
                .filter(|&j| self.held[j] && self.stamp[j] < now)
                .min_by_key(|&j| self.stamp[j]);
            if let Some(v) = victim {
                self.held[v] = false;
                self.held[e] = true;
                self.stamp[e] = now;
            }
        }
        (hits, misses)
    }
}

/// The distinct experts of tokens `a..b` of a layer's `[T × top_k]` stream, ascending.
fn union(experts: &[u16], top_k: usize, a: usize, b: usize, out: &mut Vec<u16>) {
    out.clear();
    out.extend_from_slice(&experts[a * top_k..b * top_k]);
    out.sort_unstable();
    out.dedup();
}

#[derive(Default)]
struct Acc {
    forwards: u64,
    tokens: u64,
    ssd: f64,
    mem: f64,
    experts: u64,
    layer_passes: u64,
    /// Measured compute seconds (with a [`ComputeCost`]).
    compute: f64,
}

impl Acc {
    /// Seconds: SSD reads, plus the memory reads or (`measured`) the measured compute, which
    /// includes them.
    fn side(&self, cost: &CostModel, measured: bool) -> SideCost {
        let t = self.tokens.max(1) as f64;
        let mem = if measured {
            self.compute
        } else {
            self.mem / (cost.mem_gbps * 1e9)
        };
        let s = self.ssd / (cost.ssd_gbps * 1e9) + mem;
        let spt = s / t;
        SideCost {
            forwards: self.forwards,
            tokens: self.tokens,
            ssd_bytes_per_token: self.ssd / t,
            mem_bytes_per_token: self.mem / t,
            experts_per_layer_forward: self.experts as f64 / self.layer_passes.max(1) as f64,
            seconds_per_token: spt,
            tokens_per_sec: if spt > 0.0 { 1.0 / spt } else { f64::INFINITY },
        }
    }
}

/// Replay one session's windows of `rows` tokens advancing by `kept(window)`, into `acc`.
fn replay_session(
    s: &keep_artifacts::routes::Session,
    cap: &[usize],
    cost: &CostModel,
    mut window: impl FnMut(usize) -> (usize, usize),
    extra: impl Fn(usize, usize) -> (f64, f64),
    acc: &mut Acc,
) {
    let t_all = s
        .layers
        .first()
        .map_or(0, |l| l.experts.len() / l.top_k.max(1));
    let mut slots: Vec<Slots> = s
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| {
            Slots::new(
                l.n_experts,
                cap.get(i).copied().unwrap_or(0).min(l.n_experts),
            )
        })
        .collect();
    let mut u = vec![];
    let mut t = 0;
    let mut now = 0u64;
    while t < t_all {
        now += 1;
        let (rows, kept) = window(t_all - t);
        let (rows, kept) = (rows.min(t_all - t).max(1), kept.min(t_all - t).max(1));
        for (li, l) in s.layers.iter().enumerate() {
            let b = cost.expert_bytes.get(li).copied().unwrap_or(0) as f64;
            union(&l.experts, l.top_k, t, t + rows, &mut u);
            let (h, m) = slots[li].forward(&u, now);
            acc.ssd += m as f64 * b;
            acc.mem += h as f64 * b;
            acc.experts += u.len() as u64;
            acc.layer_passes += 1;
            if kept < rows {
                // The replay of the kept rows: their experts are in memory now.
                union(&l.experts, l.top_k, t, t + kept, &mut u);
                acc.mem += u.len() as f64 * b;
            }
        }
        let (mem, compute) = extra(rows, kept);
        acc.mem += mem;
        acc.compute += compute;
        acc.forwards += 1;
        acc.tokens += kept as u64;
        t += kept;
    }
}

/// Predict the tokens/s with and without drafting at each of `hots` slots per layer (see the
/// module doc); `cost` gives the expert and resident bytes and the bandwidths.
pub fn predict(
    trace: &RouteTrace,
    hots: &[usize],
    cost: &CostModel,
    spec: &DraftSpec,
) -> Vec<DraftPrediction> {
    let k = spec.k.max(1);
    let resident = cost.resident_bytes as f64;
    let pass = spec.pass_bytes as f64;
    let compute = spec.compute.as_ref();
    let engram: f64 = cost
        .engram
        .iter()
        .map(crate::cost::EngramBytes::ssd_bytes_per_token)
        .sum();
    hots.iter()
        .map(|&hot| {
            let mut plain = Acc::default();
            let mut draft = Acc::default();
            let mut r = keep_rng::rng(spec.seed);
            for s in &trace.sessions {
                let cap: Vec<usize> = s.layers.iter().map(|l| hot.min(l.n_experts)).collect();
                replay_session(
                    s,
                    &cap,
                    cost,
                    |_| (1, 1),
                    |_, _| (resident, compute.map_or(0.0, ComputeCost::plain)),
                    &mut plain,
                );
                replay_session(
                    s,
                    &cap,
                    cost,
                    |left| {
                        let rows = (k + 1).min(left);
                        let mut acc = 0;
                        while acc < rows - 1 {
                            let a = spec.acceptance.get(acc).copied().unwrap_or(0.0);
                            if r.unit() < a {
                                acc += 1;
                            } else {
                                break;
                            }
                        }
                        (rows, acc + 1)
                    },
                    |rows, kept| {
                        // Resident weights once, again for a replay; the drafter's passes
                        // (MTP: once per draft and once for the pairs fed; DSpark: once).
                        let replay = if kept < rows { resident } else { 0.0 };
                        let secs = compute.map_or(0.0, |c| c.window_s(spec.drafter, rows, kept));
                        let drafter = pass * spec.drafter.passes(rows) as f64;
                        (resident + replay + drafter, secs)
                    },
                    &mut draft,
                );
            }
            // Engram reads are per token on both sides.
            plain.ssd += engram * plain.tokens as f64;
            draft.ssd += engram * draft.tokens as f64;
            let p = plain.side(cost, compute.is_some());
            let d = draft.side(cost, compute.is_some());
            DraftPrediction {
                hot,
                plain: p,
                drafting: d,
                tokens_per_forward: d.tokens as f64 / d.forwards.max(1) as f64,
                speedup: d.tokens_per_sec / p.tokens_per_sec,
            }
        })
        .collect()
}

/// Bytes one pass of MTP module `mtp.0` of the checkpoint at `dir` reads: every `mtp.0.*`
/// tensor except its routed experts, plus `top_k` of them (expert 0's size). 0 without one.
pub fn mtp_pass_bytes(dir: &std::path::Path) -> crate::Result<u64> {
    use keep_checkpoint::naming::{self, Role, Scope};
    let ck = keep_checkpoint::Checkpoint::open(dir)?;
    let top_k = ck.config().map_or(0, |c| c.num_experts_per_tok) as u64;
    let (mut block, mut expert0) = (0u64, 0u64);
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        if n.scope != Scope::Mtp(0) {
            continue;
        }
        match n.role {
            Role::RoutedExpert { expert: 0, .. } => expert0 += t.bytes.len() as u64,
            Role::RoutedExpert { .. } => {}
            _ => block += t.bytes.len() as u64,
        }
    }
    Ok(block + top_k * expert0)
}

/// Bytes one pass of the DSpark drafter of the checkpoint at `dir` reads from memory (0 without
/// one; docs/dspark.md): a pass drafts a block of B = `dspark_block_size` rows through every
/// stage `mtp.k.*` and projects the kept rows' target features once (`main_proj`,
/// `main_norm`). Every `mtp.*` tensor but the routed experts and the Markov head is read once;
/// `markov_head.head` once per row (B matrix–vector products) and B rows of
/// `markov_head.embed`; each stage's routed experts are the union over the block's rows, at
/// most `min(B · dspark_num_experts_per_tok, experts of the stage)` of them (the drafter's
/// routes are not recorded, so every row is taken to route to experts of its own), each at
/// expert 0's size. The target's embedding and head, which DSpark shares, are not counted
/// (as for [`mtp_pass_bytes`]).
pub fn dspark_pass_bytes(dir: &std::path::Path) -> crate::Result<u64> {
    use keep_checkpoint::naming::{self, Role, Scope};
    let ck = keep_checkpoint::Checkpoint::open(dir)?;
    let Some(keys) = ck.config().and_then(|c| c.dspark()) else {
        return Ok(0);
    };
    let b = keys.block_size as u64;
    let vocab = ck.config().map_or(1, |c| c.vocab_size.max(1)) as u64;
    // Per stage: expert 0's bytes, the distinct experts stored, stacked experts' bytes.
    let mut stages: std::collections::BTreeMap<
        usize,
        (u64, std::collections::BTreeSet<usize>, u64),
    > = Default::default();
    let mut once = 0u64;
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        let Scope::Mtp(k) = n.scope else {
            continue;
        };
        let bytes = t.bytes.len() as u64;
        let stage = stages.entry(k).or_default();
        match n.role {
            Role::RoutedExpert { expert, .. } => {
                stage.1.insert(expert);
                if expert == 0 {
                    stage.0 += bytes;
                }
            }
            Role::StackedExperts(_) => stage.2 += bytes,
            _ if t.name.contains(".markov_head.head.") => once += b * bytes,
            _ if t.name.contains(".markov_head.embed.") => once += bytes * b.min(vocab) / vocab,
            _ => once += bytes,
        }
    }
    let per_row = keys.num_experts_per_tok as u64;
    let experts: u64 = stages
        .values()
        .map(|(expert0, ids, stacked)| {
            let (n, each) = if ids.is_empty() {
                let n = keys.n_routed_experts.max(1) as u64;
                (n, stacked / n)
            } else {
                (ids.len() as u64, *expert0)
            };
            (b * per_row).min(n) * each
        })
        .sum();
    Ok(once + experts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keep_artifacts::routes::{LayerRoutes, Session};

    fn trace(experts: Vec<u16>, top_k: usize, n: usize) -> RouteTrace {
        let w = vec![1.0; experts.len()];
        RouteTrace {
            sessions: vec![Session {
                id: "s".into(),
                layers: vec![LayerRoutes {
                    layer: 0,
                    top_k,
                    n_experts: n,
                    hash: false,
                    experts,
                    weights: w,
                }],
                ..Session::default()
            }],
            ..RouteTrace::default()
        }
    }

    fn cost() -> CostModel {
        CostModel {
            expert_bytes: vec![1_000_000],
            resident_bytes: 0,
            engram: vec![],
            ssd_gbps: 1.0,
            mem_gbps: 1000.0,
        }
    }

    #[test]
    fn lru_slots_keep_a_forwards_experts_together() {
        let mut s = Slots::new(8, 2);
        assert_eq!(s.forward(&[0, 1], 1), (0, 2));
        assert_eq!(s.forward(&[1, 2], 2), (1, 1)); // 0 is the least recently used
        assert_eq!(s.forward(&[0], 3), (0, 1)); // 0 was evicted, 1 goes now
        assert_eq!(s.forward(&[2, 0], 4), (2, 0));
        // A forward wider than the slots reads the rest without keeping it.
        assert_eq!(s.forward(&[3, 4, 5], 5), (0, 3));
    }

    #[test]
    fn drafting_pays_when_every_draft_is_accepted_and_routes_repeat() {
        // Every token routes to experts {0, 1}: windows read nothing new, and with every draft
        // accepted a forward keeps K + 1 tokens for one resident read.
        let t = trace([0u16, 1].repeat(64), 2, 8);
        let mut c = cost();
        c.resident_bytes = 1_000_000;
        // Reads from memory only (the two cold misses would otherwise dominate both sides).
        c.ssd_gbps = 1000.0;
        let spec = DraftSpec {
            k: 3,
            acceptance: vec![1.0; 3],
            drafter: Drafter::Mtp,
            pass_bytes: 0,
            seed: 1,
            compute: None,
        };
        let p = &predict(&t, &[2], &c, &spec)[0];
        assert_eq!(p.drafting.tokens, 64);
        assert_eq!(p.tokens_per_forward, 4.0);
        assert!(p.speedup > 3.5, "speedup {}", p.speedup);
    }

    #[test]
    fn drafting_loses_when_drafts_are_rejected_and_windows_read_other_experts() {
        // Each token routes to its own pair of 16 experts and the hot set holds one token's:
        // a window of K + 1 rows reads K + 1 times the experts and keeps one token.
        let e: Vec<u16> = (0..64u16)
            .flat_map(|i| [(2 * i) % 16, (2 * i + 1) % 16])
            .collect();
        let t = trace(e, 2, 16);
        let spec = DraftSpec {
            k: 2,
            acceptance: vec![0.0; 2],
            drafter: Drafter::Mtp,
            pass_bytes: 0,
            seed: 1,
            compute: None,
        };
        let p = &predict(&t, &[2], &cost(), &spec)[0];
        assert_eq!(p.tokens_per_forward, 1.0);
        // Three tokens' distinct pairs per window (the last window of a session is shorter).
        assert!(p.drafting.experts_per_layer_forward > 5.8);
        assert_eq!(p.plain.experts_per_layer_forward, 2.0);
        assert!(p.speedup < 0.5, "speedup {}", p.speedup);
    }

    fn probe() -> ComputeCost {
        ComputeCost {
            plain_s: 1.0,
            verify_s: vec![1.0, 1.5, 2.0],
            replay_s: vec![0.9, 1.3],
            snapshot_s: 0.1,
            mtp_draft_s: 0.2,
            mtp_feed_s: vec![0.15, 0.25],
            mtp_snapshot_s: 0.01,
            dspark_draft_s: 0.3,
            dspark_project_s: vec![0.02, 0.03, 0.04],
        }
    }

    /// Seconds compared to ones summed by hand (float rounding of a few additions).
    const SUM_TOL: f64 = 1e-12;

    #[test]
    fn a_verify_window_costs_its_drafts_forwards_snapshot_replay_and_feed() {
        let c = probe();
        // K = 2, nothing accepted: two drafts (chained: MTP snapshot), the main snapshot, the
        // 3-row verify forward, the replay of the 1 kept row, nothing to feed.
        assert!(
            (c.window_s(Drafter::Mtp, 3, 1) - (0.2 * 2.0 + 0.01 + 0.1 + 2.0 + 0.9)).abs() < SUM_TOL
        );
        // K = 2, everything accepted: no replay; the 2 pairs not fed while drafting are fed.
        assert!((c.window_s(Drafter::Mtp, 3, 3) - (0.4 + 0.01 + 0.1 + 2.0 + 0.25)).abs() < SUM_TOL);
        // K = 1, accepted: one draft, no MTP snapshot; feed one pair.
        assert!((c.window_s(Drafter::Mtp, 2, 2) - (0.2 + 0.1 + 1.5 + 0.15)).abs() < SUM_TOL);
        // Past the measured row counts: extended linearly from the last two.
        assert!((by_rows(&c.verify_s, 5) - 3.0).abs() < SUM_TOL);
        assert!((by_rows(&[0.5], 3) - 1.5).abs() < SUM_TOL);
        assert_eq!(by_rows(&c.verify_s, 0), 0.0);
    }

    #[test]
    fn measured_compute_replaces_the_memory_term() {
        // Every token routes to {0, 1} and the slots hold them: no SSD reads after the two cold
        // misses (made negligible), so each side costs exactly its forwards' compute.
        let t = trace([0u16, 1].repeat(64), 2, 8);
        let mut c = cost();
        c.ssd_gbps = 1e12;
        c.resident_bytes = 1_000_000_000;
        let mut spec = DraftSpec {
            k: 2,
            acceptance: vec![0.0; 2],
            drafter: Drafter::Mtp,
            pass_bytes: 0,
            seed: 1,
            compute: Some(probe()),
        };
        let p = &predict(&t, &[2], &c, &spec)[0];
        // 64 tokens without drafts: 1 s each.
        assert!((p.plain.seconds_per_token - 1.0).abs() < 1e-9);
        // Nothing accepted: 62 windows of 3 rows keeping 1, then 2 rows keeping 1 (0.2 + 0.1 +
        // 1.5 + 0.9) and 1 row keeping 1 (0.1 + 1.0).
        let secs = 62.0 * 3.41 + 2.7 + 1.1;
        assert!((p.drafting.seconds_per_token - secs / 64.0).abs() < 1e-9);
        assert!((p.speedup - 64.0 / secs).abs() < 1e-9);
        // Everything accepted: 21 windows of 3 rows keeping 3 (2.76 s), then 1 row (1.1 s).
        spec.acceptance = vec![1.0; 2];
        let p = &predict(&t, &[2], &c, &spec)[0];
        let secs = 21.0 * 2.76 + 1.1;
        assert!((p.drafting.seconds_per_token - secs / 64.0).abs() < 1e-9);
        // Without the measured compute the same replay is priced by its reads only.
        spec.compute = None;
        let reads = &predict(&t, &[2], &c, &spec)[0];
        // (1e9 resident bytes at 1000 GB/s, plus the two experts' hits: 2e-6 s.)
        assert!((reads.plain.seconds_per_token - 1e-3).abs() < 3e-6);
    }

    #[test]
    fn a_dspark_window_costs_one_pass_and_the_projection_of_the_kept_rows() {
        let c = probe();
        // K = 2, nothing accepted: one DSpark pass (no per-draft passes, no drafter snapshot),
        // the main snapshot, the 3-row verify forward, the replay of the 1 kept row and the
        // projection of that row.
        let ds = c.window_s(Drafter::DSpark, 3, 1);
        assert!((ds - (0.3 + 0.1 + 2.0 + 0.9 + 0.02)).abs() < SUM_TOL);
        // Everything accepted: no replay; the 3 kept rows projected.
        let ds = c.window_s(Drafter::DSpark, 3, 3);
        assert!((ds - (0.3 + 0.1 + 2.0 + 0.04)).abs() < SUM_TOL);
        // The same windows with MTP: two drafts, its snapshot, the feed of the kept pairs.
        let mtp = c.window_s(Drafter::Mtp, 3, 3);
        assert!((mtp - ds - (0.2 * 2.0 + 0.01 + 0.25 - 0.3 - 0.04)).abs() < SUM_TOL);
        assert_eq!(Drafter::DSpark.passes(4), 1);
        assert_eq!(Drafter::Mtp.passes(4), 4);
    }

    #[test]
    fn a_dspark_window_reads_its_pass_once_where_mtp_reads_k_plus_one() {
        // Every token routes to {0, 1}, held by 2 slots; every draft accepted with K = 3: 16
        // windows of 4 rows over 64 tokens. Each window reads the resident weights once and
        // the two experts (from memory after the first window's two misses).
        let t = trace([0u16, 1].repeat(64), 2, 8);
        let mut c = cost();
        c.resident_bytes = 1_000_000;
        c.ssd_gbps = 1000.0;
        let pass = 3_000_000u64;
        let mut spec = DraftSpec {
            k: 3,
            acceptance: vec![1.0; 3],
            drafter: Drafter::DSpark,
            pass_bytes: pass,
            seed: 1,
            compute: None,
        };
        let ds = predict(&t, &[2], &c, &spec)[0].clone();
        assert_eq!(ds.tokens_per_forward, 4.0);
        let hits = 15.0 * 2.0 * 1e6;
        // DSpark: one pass per window.
        let want = (16.0 * (1e6 + pass as f64) + hits) / 64.0;
        assert_eq!(ds.drafting.mem_bytes_per_token, want);
        // MTP: K + 1 = 4 passes per window (three drafts and the feed).
        spec.drafter = Drafter::Mtp;
        let mtp = predict(&t, &[2], &c, &spec)[0].clone();
        let want = (16.0 * (1e6 + 4.0 * pass as f64) + hits) / 64.0;
        assert_eq!(mtp.drafting.mem_bytes_per_token, want);
        // The difference is exactly K passes per window, in bytes and in seconds.
        let diff = mtp.drafting.mem_bytes_per_token - ds.drafting.mem_bytes_per_token;
        assert_eq!(diff, 16.0 * 3.0 * pass as f64 / 64.0);
        let secs = diff / (c.mem_gbps * 1e9);
        let got = mtp.drafting.seconds_per_token - ds.drafting.seconds_per_token;
        assert!((got - secs).abs() < 1e-15, "{got} vs {secs}");
        // Without drafting both are the same.
        assert_eq!(ds.plain.seconds_per_token, mtp.plain.seconds_per_token);

        // With measured compute: 16 windows of 4 rows keeping 4 at DSpark's window seconds.
        let mut p = probe();
        p.verify_s.push(2.5);
        spec.compute = Some(p.clone());
        spec.drafter = Drafter::DSpark;
        let ds = &predict(&t, &[2], &c, &spec)[0];
        let w = 0.3 + 0.1 + 2.5 + by_rows(&p.dspark_project_s, 4);
        assert!((w - p.window_s(Drafter::DSpark, 4, 4)).abs() < SUM_TOL);
        // (The two cold misses at 1000 GB/s: 2e-6 s.)
        let want = (16.0 * w + 2e6 / 1e12) / 64.0;
        assert!((ds.drafting.seconds_per_token - want).abs() < 1e-12);
    }
}
