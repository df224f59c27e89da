//! The residency report: every policy at every hot-set size, the cost model, and the verdict
//! per size — the one entry point [`simulate`] that `keep residency` calls.
//!
//! Verdict rule ([`VERDICT_RULE`]): per hot-set size, KILL if the best realizable policy that
//! fetches every miss (static, LRU or decay — Belady needs the future and is the ceiling, not
//! a candidate) still misses more than 5% of routed slots; else PASS. With a fetch threshold,
//! the hybrid rows (light misses dropped) are reported beside, with the gate mass they drop;
//! they do not change the verdict.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::cost::{CostModel, TokenCost};
use crate::policy::PolicyKind;
use crate::sim::{self, ratio, Counts, ReplaySpec, WarmStart};
use crate::{ResidencyError, Result};
use keep_artifacts::routes::RouteTrace;

/// `format` of the JSON report.
pub const REPORT_FORMAT: &str = "keep-residency-report";
/// Its version.
pub const REPORT_VERSION: u32 = 1;
/// Largest miss rate that passes.
pub const KILL_MISS_RATE: f64 = 0.05;
/// The verdict rule, as written into every report.
pub const VERDICT_RULE: &str = "per hot-set size: KILL if the best realizable policy that fetches every miss \
(static, lru or decay; belady is the offline ceiling, not a candidate) misses more than 5% of routed \
slots (misses / (tokens x top_k), pooled over layers and sessions, residency reset per session); else PASS";
/// The REAP statistics file of a run (keep-artifacts' `reap::FILE`).
pub const REAP_FILE: &str = keep_artifacts::reap::FILE;

/// Hot-set sizes: absolute, or fractions of each layer's experts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HotSizes {
    Experts(Vec<usize>),
    Fractions(Vec<f64>),
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Options {
    pub hot: HotSizes,
    pub policies: Vec<PolicyKind>,
    /// Decay half-life in tokens.
    pub half_life: f64,
    pub warm_start: WarmStart,
    /// Gate-weight threshold of the hybrid rows (`None`: no hybrid rows).
    pub fetch_threshold: Option<f32>,
    /// Byte sizes and bandwidths (`None`: miss rates only).
    pub cost: Option<CostModel>,
    /// REAP saliencies per recorded layer, for `WarmStart::Reap` (see [`read_reap`]).
    pub reap_scores: Option<Vec<Vec<f64>>>,
}

/// One policy at one size.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyRow {
    pub policy: PolicyKind,
    /// Misses (SSD reads) per routed slot.
    pub miss_rate: f64,
    pub hit_rate: f64,
    /// Dropped slots per routed slot (hybrid rows only; 0 otherwise).
    pub dropped_rate: f64,
    /// Dropped gate weight / total gate weight.
    pub dropped_gate_mass_frac: f64,
    /// Miss rate of each recorded layer (trace order).
    pub layer_miss_rate: Vec<f64>,
    #[serde(flatten)]
    pub counts: Counts,
    /// Bytes and tokens/s (absent without expert sizes).
    pub cost: Option<TokenCost>,
}

/// Everything at one hot-set size.
#[derive(Debug, Clone, Serialize)]
pub struct SizeReport {
    /// Hot experts per layer (of the layer with the most experts).
    pub hot: usize,
    /// `hot / n_experts`.
    pub hot_frac: f64,
    /// Memory the hot sets take over all recorded layers (with expert sizes).
    pub hot_set_bytes: Option<u64>,
    /// Fetch-every-miss rows.
    pub policies: Vec<PolicyRow>,
    /// Fetch-threshold rows (empty without a threshold).
    pub hybrid: Vec<PolicyRow>,
    /// The verdict's candidate: the realizable fetch-all policy with the fewest misses.
    pub best_policy: Option<PolicyKind>,
    pub best_miss_rate: Option<f64>,
    /// `PASS` or `KILL`.
    pub verdict: String,
}

/// The trace and settings a report was made from.
#[derive(Debug, Clone, Serialize)]
pub struct Inputs {
    pub run: PathBuf,
    pub sessions: Vec<String>,
    pub skipped_files: Vec<PathBuf>,
    pub layers: Vec<usize>,
    pub hash_layers: Vec<usize>,
    pub n_experts: usize,
    pub top_k: usize,
    pub tokens: u64,
    pub routed_slots: u64,
    pub hot: HotSizes,
    pub policies: Vec<PolicyKind>,
    pub half_life_tokens: f64,
    pub warm_start: WarmStart,
    pub fetch_threshold: Option<f32>,
    pub cost: Option<CostModel>,
}

/// Replay speed, measured in this run on one core.
#[derive(Debug, Clone, Serialize)]
pub struct ReplaySpeed {
    /// Slots replayed by every policy at every size and mode together.
    pub slots_replayed: u64,
    pub seconds: f64,
    pub replay_slots_per_sec: f64,
    /// Per policy (all sizes and modes).
    pub by_policy: Vec<PolicySpeed>,
    pub note: String,
}

/// Replay speed of one policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySpeed {
    pub policy: PolicyKind,
    pub slots_per_sec: f64,
}

/// The whole report (`format` = `keep-residency-report`, version 1).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub format: String,
    pub version: u32,
    /// The command line (filled in by the caller).
    pub command: String,
    pub inputs: Inputs,
    pub sizes: Vec<SizeReport>,
    pub verdict_rule: String,
    pub replay: ReplaySpeed,
    pub notes: Vec<String>,
    /// Precision tiers replayed beside the slots ([`crate::tiers::attach`]); absent without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tiers: Option<crate::tiers::TierReport>,
}

/// Read `reap.{layer}.score` (F64 `[n_experts]`) for every recorded layer from
/// `reap-stats.safetensors` in the run directory (or beside a single trace file), through
/// keep-artifacts' [`ReapScores`](keep_artifacts::reap::ReapScores) reader.
pub fn read_reap(run: &Path, trace: &RouteTrace) -> Result<Vec<Vec<f64>>> {
    let dir = if run.is_dir() {
        run.to_path_buf()
    } else {
        run.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let path = dir.join(REAP_FILE);
    if !path.is_file() {
        return Err(ResidencyError::Stats {
            path,
            msg: format!(
                "not found: the reap warm start needs REAP saliencies; run `keep finalize {}` first, \
                 or pass --warm-start frequency",
                run.display()
            ),
        });
    }
    let Some(first) = trace.sessions.first() else {
        return Ok(vec![]);
    };
    let file = keep_artifacts::reap::ReapScores::read(&path)?;
    let mut out = Vec::with_capacity(first.layers.len());
    for l in &first.layers {
        let name = format!("reap.{}.score", l.layer);
        let Some(v) = file.scores.get(l.layer) else {
            return Err(ResidencyError::tensor(
                &path,
                &name,
                format!(
                    "missing: the trace records layer {} but the REAP statistics do not; \
                     re-run `keep finalize` on this run, or pass --warm-start frequency",
                    l.layer
                ),
            ));
        };
        if v.len() != l.n_experts {
            return Err(ResidencyError::tensor(
                &path,
                &name,
                format!("expected F64 [{}], found F64 [{}]", l.n_experts, v.len()),
            ));
        }
        out.push(v.clone());
    }
    Ok(out)
}

/// Hot-set size of a layer with `n` experts.
fn capacity(h: &HotSizes, i: usize, n: usize) -> usize {
    match h {
        HotSizes::Experts(v) => v[i].min(n),
        HotSizes::Fractions(v) => ((v[i] * n as f64).round().max(0.0) as usize).min(n),
    }
}

fn row(policy: PolicyKind, layers: Vec<Counts>, cost: Option<&CostModel>) -> PolicyRow {
    let mut all = Counts::default();
    for c in &layers {
        all.add(c);
    }
    PolicyRow {
        policy,
        miss_rate: all.miss_rate(),
        hit_rate: ratio(all.hits as f64, all.slots as f64),
        dropped_rate: ratio(all.dropped as f64, all.slots as f64),
        dropped_gate_mass_frac: ratio(all.dropped_mass, all.gate_mass),
        layer_miss_rate: layers.iter().map(Counts::miss_rate).collect(),
        counts: all,
        cost: cost.map(|m| m.cost(&layers)),
    }
}

/// Check an in-memory trace before replaying it (traces from [`crate::read_run`] always pass):
/// every session records the same layers, ids are below `n_experts`, shapes are whole tokens.
pub fn validate(trace: &RouteTrace) -> Result<()> {
    keep_artifacts::routes::check_consistent(trace)?;
    for s in &trace.sessions {
        for l in &s.layers {
            let bad = |msg: String| {
                Err(ResidencyError::Config(format!(
                    "session `{}`, layer {}: {msg}",
                    s.id, l.layer
                )))
            };
            if l.top_k == 0 || l.experts.len() % l.top_k != 0 {
                return bad(format!(
                    "{} slots are not whole tokens of top-{}",
                    l.experts.len(),
                    l.top_k
                ));
            }
            if l.weights.len() != l.experts.len() {
                return bad(format!(
                    "{} weights for {} slots",
                    l.weights.len(),
                    l.experts.len()
                ));
            }
            if l.n_experts == 0 || l.n_experts > keep_artifacts::routes::MAX_EXPERTS {
                return bad(format!("n_experts = {} is out of range", l.n_experts));
            }
            if let Some(e) = l.experts.iter().find(|&&e| e as usize >= l.n_experts) {
                return bad(format!("expert id {e} ≥ n_experts = {}", l.n_experts));
            }
            if l.experts.len() >= u32::MAX as usize {
                return bad("more than 2^32 slots in one session".into());
            }
        }
    }
    Ok(())
}

/// Replay `trace` through every policy at every size (and, with a threshold, again as a
/// hybrid), and judge each size.
pub fn simulate(trace: &RouteTrace, opts: &Options) -> Result<Report> {
    let Some(first) = trace.sessions.first() else {
        return Err(ResidencyError::Config("the trace has no sessions".into()));
    };
    if first.layers.is_empty() {
        return Err(ResidencyError::Config("the trace records no layers".into()));
    }
    validate(trace)?;
    if opts.half_life.is_nan() || opts.half_life <= 0.0 {
        return Err(ResidencyError::Config(format!(
            "decay half-life {} is not a positive number of tokens",
            opts.half_life
        )));
    }
    let n_sizes = match &opts.hot {
        HotSizes::Experts(v) => v.len(),
        HotSizes::Fractions(v) => {
            if let Some(f) = v.iter().find(|f| !(0.0..=1.0).contains(*f)) {
                return Err(ResidencyError::Config(format!(
                    "hot-set fraction {f} is not in 0..=1"
                )));
            }
            v.len()
        }
    };
    if n_sizes == 0 {
        return Err(ResidencyError::Config("no hot-set sizes given".into()));
    }
    if opts.policies.is_empty() {
        return Err(ResidencyError::Config("no policies given".into()));
    }
    if let Some(c) = &opts.cost {
        if !(c.ssd_gbps > 0.0 && c.mem_gbps > 0.0) {
            return Err(ResidencyError::Config(
                "bandwidths must be positive GB/s".into(),
            ));
        }
        if c.expert_bytes.len() != first.layers.len() {
            return Err(ResidencyError::Config(format!(
                "expert sizes for {} layers, but the trace records {}",
                c.expert_bytes.len(),
                first.layers.len()
            )));
        }
    }
    if let Some(t) = opts.fetch_threshold {
        if !(t.is_finite() && t >= 0.0) {
            return Err(ResidencyError::Config(format!(
                "fetch threshold {t} is not a non-negative number"
            )));
        }
    }
    let order = match opts.warm_start {
        WarmStart::Reap => {
            let scores = opts.reap_scores.as_ref().ok_or_else(|| {
                ResidencyError::Config("the reap warm start needs REAP scores".into())
            })?;
            if scores.len() != first.layers.len()
                || scores
                    .iter()
                    .zip(&first.layers)
                    .any(|(s, l)| s.len() != l.n_experts)
            {
                return Err(ResidencyError::Config(
                    "REAP scores do not match the trace's layers and expert counts".into(),
                ));
            }
            scores.iter().map(|s| sim::order_by(s)).collect()
        }
        _ => sim::frequency_order(trace),
    };
    let prefill = opts.warm_start != WarmStart::None;
    let n_max = first.layers.iter().map(|l| l.n_experts).max().unwrap_or(0);

    let mut policies = opts.policies.clone();
    policies.sort();
    policies.dedup();
    let mut modes = vec![0.0f32];
    if let Some(t) = opts.fetch_threshold {
        modes.push(t);
    }
    let mut total_slots = 0u64;
    let mut total_secs = 0.0;
    let mut per_policy: Vec<(PolicyKind, u64, f64)> =
        policies.iter().map(|&p| (p, 0, 0.0)).collect();
    let mut sizes = Vec::with_capacity(n_sizes);
    for si in 0..n_sizes {
        let caps: Vec<usize> = first
            .layers
            .iter()
            .map(|l| capacity(&opts.hot, si, l.n_experts))
            .collect();
        let hot = capacity(&opts.hot, si, n_max);
        let mut rows: [Vec<PolicyRow>; 2] = [vec![], vec![]];
        for (mi, &thr) in modes.iter().enumerate() {
            for (pi, &p) in policies.iter().enumerate() {
                let r = sim::replay(
                    trace,
                    &ReplaySpec {
                        policy: p,
                        capacity: &caps,
                        order: &order,
                        prefill,
                        half_life: opts.half_life,
                        threshold: thr,
                    },
                );
                let slots: u64 = r.layers.iter().map(|c| c.slots).sum();
                total_slots += slots;
                total_secs += r.seconds;
                per_policy[pi].1 += slots;
                per_policy[pi].2 += r.seconds;
                rows[mi].push(row(p, r.layers, opts.cost.as_ref()));
            }
        }
        let [fetch_all, hybrid] = rows;
        let candidates: Vec<&PolicyRow> = if fetch_all.iter().any(|r| r.policy.realizable()) {
            fetch_all.iter().filter(|r| r.policy.realizable()).collect()
        } else {
            fetch_all.iter().collect()
        };
        let best = candidates
            .iter()
            .min_by(|a, b| a.miss_rate.total_cmp(&b.miss_rate))
            .copied();
        let verdict = match best {
            Some(b) if b.miss_rate <= KILL_MISS_RATE => "PASS",
            _ => "KILL",
        };
        let hot_set_bytes = opts.cost.as_ref().map(|c| {
            caps.iter()
                .zip(&c.expert_bytes)
                .map(|(&h, &b)| h as u64 * b)
                .sum()
        });
        sizes.push(SizeReport {
            hot,
            hot_frac: ratio(hot as f64, n_max as f64),
            hot_set_bytes,
            best_policy: best.map(|b| b.policy),
            best_miss_rate: best.map(|b| b.miss_rate),
            verdict: verdict.to_string(),
            policies: fetch_all,
            hybrid,
        });
    }

    let mut notes = vec![];
    if !policies.iter().any(|p| p.realizable()) {
        notes.push("only belady was selected: the verdict uses the offline ceiling".into());
    }
    if opts.warm_start == WarmStart::None && policies.contains(&PolicyKind::Static) {
        notes.push(
            "warm start none: static ranks experts by first use (the earliest stay resident)"
                .into(),
        );
    }
    if opts.warm_start == WarmStart::Frequency {
        notes.push(
            "warm start frequency: orderings are counted over the whole trace being replayed \
             (an optimistic, in-sample choice)"
                .into(),
        );
    }
    if opts.cost.is_none() {
        notes.push(
            "no expert sizes: pass --model DIR or --expert-bytes B for bytes and tokens/s".into(),
        );
    }
    let hash_layers: Vec<usize> = first
        .layers
        .iter()
        .filter(|l| l.hash)
        .map(|l| l.layer)
        .collect();
    if !hash_layers.is_empty() {
        notes.push(format!(
            "layers {hash_layers:?} are hash-routed (experts fixed by token id): replayed like the \
             others; their reads are counted as prefetched (`prefetched`, \
             `prefetched_ssd_bytes_per_token`) since the runtime starts them from the token ids"
        ));
    }
    Ok(Report {
        format: REPORT_FORMAT.into(),
        version: REPORT_VERSION,
        command: String::new(),
        inputs: Inputs {
            run: trace.path.clone(),
            sessions: trace.sessions.iter().map(|s| s.id.clone()).collect(),
            skipped_files: trace.skipped.clone(),
            layers: trace.layers(),
            hash_layers,
            n_experts: n_max,
            top_k: first.layers[0].top_k,
            tokens: trace.tokens(),
            routed_slots: trace.slots(),
            hot: opts.hot.clone(),
            policies: policies.clone(),
            half_life_tokens: opts.half_life,
            warm_start: opts.warm_start,
            fetch_threshold: opts.fetch_threshold,
            cost: opts.cost.clone(),
        },
        sizes,
        verdict_rule: VERDICT_RULE.into(),
        replay: ReplaySpeed {
            slots_replayed: total_slots,
            seconds: total_secs,
            replay_slots_per_sec: ratio(total_slots as f64, total_secs),
            by_policy: per_policy
                .iter()
                .map(|&(policy, s, t)| PolicySpeed {
                    policy,
                    slots_per_sec: ratio(s as f64, t),
                })
                .collect(),
            note: "measured in this run: wall time of every replay, single-threaded on one core, \
                   policy loop and per-stream resets (Belady's next-use precompute included), trace \
                   already in memory; other load on the machine lowers it"
                .into(),
        },
        notes,
        tiers: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{synthetic, SynthSpec};

    fn opts(hot: HotSizes) -> Options {
        Options {
            hot,
            policies: PolicyKind::ALL.to_vec(),
            half_life: 16.0,
            warm_start: WarmStart::Frequency,
            fetch_threshold: Some(0.05),
            cost: Some(CostModel {
                expert_bytes: vec![1_000_000; 4],
                resident_bytes: 0,
                engram: vec![],
                ssd_gbps: 5.0,
                mem_gbps: 50.0,
            }),
            reap_scores: None,
        }
    }

    #[test]
    fn verdicts_and_shape() {
        let t = synthetic(&SynthSpec {
            layers: 4,
            n_experts: 32,
            top_k: 4,
            tokens: 300,
            sessions: 2,
            seed: 7,
            ..SynthSpec::default()
        });
        let r = simulate(&t, &opts(HotSizes::Experts(vec![1, 16, 32]))).unwrap();
        assert_eq!(r.sizes.len(), 3);
        assert_eq!(r.sizes[0].verdict, "KILL");
        // Full hot set with a frequency prefill: no misses at all.
        assert_eq!(r.sizes[2].verdict, "PASS");
        assert_eq!(r.sizes[2].best_miss_rate, Some(0.0));
        for s in &r.sizes {
            assert_eq!(s.policies.len(), 4);
            assert_eq!(s.hybrid.len(), 4);
            let b = s
                .policies
                .iter()
                .find(|p| p.policy == PolicyKind::Belady)
                .unwrap();
            for p in &s.policies {
                assert!(p.miss_rate >= b.miss_rate);
                assert_eq!(p.layer_miss_rate.len(), 4);
            }
            assert_ne!(s.best_policy, Some(PolicyKind::Belady));
        }
        assert!(r.replay.slots_replayed > 0);
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["format"], REPORT_FORMAT);
        assert_eq!(j["sizes"][0]["policies"][0]["policy"], "static");
        assert!(j["sizes"][0]["policies"][0]["cost"]["tokens_per_sec"].is_number());
    }

    #[test]
    fn fractions_and_bad_options() {
        let t = synthetic(&SynthSpec {
            layers: 4,
            n_experts: 16,
            top_k: 2,
            tokens: 50,
            sessions: 1,
            seed: 1,
            ..SynthSpec::default()
        });
        let r = simulate(&t, &opts(HotSizes::Fractions(vec![0.25, 1.0]))).unwrap();
        assert_eq!(r.sizes[0].hot, 4);
        assert_eq!(r.sizes[1].hot, 16);
        assert!(simulate(&t, &opts(HotSizes::Fractions(vec![1.5]))).is_err());
        assert!(simulate(&t, &opts(HotSizes::Experts(vec![]))).is_err());
        let mut o = opts(HotSizes::Experts(vec![4]));
        o.warm_start = WarmStart::Reap;
        assert!(simulate(&t, &o).is_err(), "reap without scores");
        let mut o = opts(HotSizes::Experts(vec![4]));
        o.half_life = -1.0;
        assert!(simulate(&t, &o).is_err(), "negative half-life");
        let mut bad = t.clone();
        bad.sessions[0].layers[0].experts[0] = 16;
        let e = simulate(&bad, &opts(HotSizes::Experts(vec![4])))
            .unwrap_err()
            .to_string();
        assert!(e.contains("expert id 16"), "{e}");
        let mut bad = t.clone();
        bad.sessions[0].layers[1].weights.pop();
        assert!(simulate(&bad, &opts(HotSizes::Experts(vec![4]))).is_err());
    }

    /// `reap-stats.safetensors` in `dir` whose layer `l` scores are `scores[l]` (sums made so
    /// that Σ g·‖f‖ / count is the score: one route of weight 1 and norm `score`).
    fn write_reap(dir: &Path, ne: usize, scores: &[Vec<f64>]) {
        use keep_artifacts::reap::{LayerReap, ReapStats};
        let layers: Vec<LayerReap> = scores
            .iter()
            .map(|v| {
                let mut r = LayerReap::new(ne, 1);
                for (e, &x) in v.iter().enumerate() {
                    r.add_outputs(e, &[1.0], &[x as f32]);
                }
                r
            })
            .collect();
        ReapStats {
            n_layers: scores.len(),
            n_experts: ne,
            top_k: 1,
            hidden: 1,
            hash_layers: vec![],
            model_fingerprint: String::new(),
            pack_fingerprint: String::new(),
            split: "calib".into(),
            sessions: 1,
            tokens: 1,
            scores: scores.to_vec(),
            layers,
        }
        .write(&dir.join(REAP_FILE), true)
        .unwrap();
    }

    #[test]
    fn reap_warm_start_orders_the_static_set() {
        use keep_artifacts::routes::{LayerRoutes, Session};
        // One layer, 4 experts, top-1: expert 3 is used most, expert 1 has the top REAP score.
        let experts = vec![3, 3, 3, 1, 0, 3];
        let t = RouteTrace {
            sessions: vec![Session {
                id: "s".into(),
                layers: vec![LayerRoutes {
                    layer: 5,
                    top_k: 1,
                    n_experts: 4,
                    hash: false,
                    weights: vec![1.0; experts.len()],
                    experts,
                }],
                ..Session::default()
            }],
            ..RouteTrace::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let mut scores = vec![vec![0.0; 4]; 6];
        scores[5] = vec![0.1, 0.9, 0.2, 0.3];
        write_reap(dir.path(), 4, &scores);
        let scores = read_reap(dir.path(), &t).unwrap();
        assert_eq!(scores, vec![vec![0.1, 0.9, 0.2, 0.3]]);
        let mut o = opts(HotSizes::Experts(vec![1]));
        o.cost = None;
        o.fetch_threshold = None;
        o.policies = vec![PolicyKind::Static];
        o.warm_start = WarmStart::Reap;
        o.reap_scores = Some(scores);
        // Static prefilled with {1}: the first 3 evicts it, then 3 hits twice; 1, 0 and the
        // last 3 each take the one place in turn.
        let r = simulate(&t, &o).unwrap();
        assert_eq!(r.sizes[0].policies[0].counts.hits, 2);
        // With frequency, prefilled with {3}: three hits before 1 takes its place.
        o.warm_start = WarmStart::Frequency;
        let r = simulate(&t, &o).unwrap();
        assert_eq!(r.sizes[0].policies[0].counts.hits, 3);
    }

    #[test]
    fn reap_file_missing_or_bad() {
        let dir = tempfile::tempdir().unwrap();
        let t = synthetic(&SynthSpec {
            layers: 1,
            n_experts: 4,
            top_k: 2,
            tokens: 5,
            sessions: 1,
            seed: 1,
            ..SynthSpec::default()
        });
        let e = read_reap(dir.path(), &t).unwrap_err().to_string();
        assert!(
            e.contains(REAP_FILE) && e.contains("keep finalize") && e.contains("frequency"),
            "{e}"
        );
        // Right file, wrong shape.
        let layer = t.sessions[0].layers[0].layer;
        let name = format!("reap.{layer}.score");
        write_reap(dir.path(), 3, &vec![vec![0.0; 3]; layer + 1]);
        let e = read_reap(dir.path(), &t).unwrap_err().to_string();
        assert!(e.contains(&name) && e.contains("F64 [4]"), "{e}");
        // Right shape, the trace's layer not in the statistics.
        write_reap(dir.path(), 4, &vec![vec![0.0; 4]; layer]);
        let e = read_reap(dir.path(), &t).unwrap_err().to_string();
        assert!(e.contains(&name) && e.contains("missing"), "{e}");
    }
}
