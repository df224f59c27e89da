//! The candidate search: every combination of experts kept (REAP levels from a calibration
//! run), hot-set policy and the hot-set size the memory leaves, predicted and ranked.
//!
//! Speed: for each candidate the route trace (the run's, or a synthetic one without a run) is
//! replayed through keep-residency's policies at the candidate's slots per layer; seconds per
//! token = the probe's compute seconds + waited misses per token × the probe's seconds per
//! miss. A pruned candidate replays the trace with each removed expert re-routed to the
//! survivor of highest REAP score not already chosen for that token (the mass a pruned router
//! gives the removed expert goes to a survivor; which one is the model's, so the row says
//! `simulated` on re-routed routes). Quality: [`crate::quality`] (measured or interpolated KL
//! from `keep eval` reports). Without `--min-quality` only candidates that keep every expert
//! qualify (no quality is given up that was not asked for). The per-expert precision
//! allocation (`tiers`) plugs in as another axis of [`Level`]: a level is a checkpoint (experts
//! kept, rung) with its slot bytes and its KL points.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_artifacts::fit_plan::{self, Candidate, Derived, FitPlan, Memory, Predicted};
use keep_artifacts::hashremap::RemapPolicy;
use keep_artifacts::plan::PrunePlan;
use keep_artifacts::reap::ReapStats;
use keep_artifacts::route_profile::{self, RouteProfile};
use keep_artifacts::routes::RouteTrace;
use keep_calib::select::{select, to_plan, Keep, Saliency, SelectOptions};
use keep_checkpoint::Checkpoint;
use keep_model::Kernels;
use keep_residency::synth::SynthSpec;
use keep_residency::{HotSizes, Options, PolicyKind, WarmStart};

use crate::probe::{probe, Probe, ProbeOptions};
use crate::quality::{kl_at, read_points, KlPoint};
use crate::{FitError, Result};

/// Fractions of the experts the default levels keep (of those with REAP statistics).
pub const DEFAULT_LEVELS: [f64; 6] = [1.0, 0.875, 0.75, 0.625, 0.5, 0.375];
/// Candidates kept in the plan's table.
pub const TABLE_ROWS: usize = 10;
/// Synthetic trace length (tokens per session, sessions) when there is no run.
const SYNTH_TOKENS: usize = 1024;
const SYNTH_SESSIONS: usize = 2;

/// What to fit.
#[derive(Debug, Clone)]
pub struct FitOptions {
    pub model: PathBuf,
    pub memory: Memory,
    /// A calibration run (after `keep finalize`): its routes and REAP statistics.
    pub run: Option<PathBuf>,
    /// `keep eval --json` reports.
    pub evals: Vec<PathBuf>,
    pub min_quality: Option<f64>,
    pub kernels: Kernels,
    pub probe: ProbeOptions,
    /// The plan file to be written (names the files written beside it).
    pub out: PathBuf,
    /// Where a derived checkpoint goes (default: beside the plan).
    pub derived_dir: Option<PathBuf>,
    pub command: String,
    /// Experts-kept counts to try (empty: [`DEFAULT_LEVELS`]).
    pub levels: Vec<usize>,
    /// Which knobs the search may turn.
    pub knob: Knob,
}

/// The knobs a search may turn: all of them, or one alone (the single-knob baselines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Knob {
    #[default]
    All,
    /// Every expert kept, the rest offloaded to SSD.
    Offload,
    /// Experts pruned until every survivor has a slot (nothing read from SSD).
    Prune,
}

/// A fitted plan and the files that go beside it.
#[derive(Debug, Clone)]
pub struct FitOutcome {
    pub plan: FitPlan,
    /// The prune plan the derived checkpoint is built from, and where it goes.
    pub prune_plan: Option<(PathBuf, PrunePlan)>,
    /// The initial route profile (from the run's trace) and where it goes.
    pub profile: Option<(PathBuf, RouteProfile)>,
    /// Best candidates of one knob only, meeting the same quality: offload with every expert,
    /// and pruning until everything is in memory.
    pub best_offload: Option<Candidate>,
    pub best_prune: Option<Candidate>,
    pub notes: Vec<String>,
}

/// A file beside the plan: `<plan stem>.<suffix>`.
pub fn beside(plan: &Path, suffix: &str) -> PathBuf {
    let stem = plan
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "plan".into());
    plan.with_file_name(format!("{stem}.{suffix}"))
}

/// Remap `trace` through a prune plan: survivors renumbered, each removed expert replaced by
/// the survivor of highest `scores` not already routed for that token.
pub fn reroute(trace: &RouteTrace, plan: &PrunePlan, scores: &[Vec<f64>]) -> RouteTrace {
    let mut out = trace.clone();
    for s in &mut out.sessions {
        for lr in &mut s.layers {
            let Some(surv) = plan.survivors(lr.layer) else {
                continue;
            };
            let new_id: BTreeMap<u16, u16> = surv
                .iter()
                .enumerate()
                .map(|(i, &e)| (e as u16, i as u16))
                .collect();
            let sc = scores.get(lr.layer);
            let mut rank: Vec<u16> = (0..surv.len() as u16).collect();
            rank.sort_by(|&a, &b| {
                let sa = sc
                    .and_then(|v| v.get(surv[a as usize]))
                    .copied()
                    .unwrap_or(0.0);
                let sb = sc
                    .and_then(|v| v.get(surv[b as usize]))
                    .copied()
                    .unwrap_or(0.0);
                sb.total_cmp(&sa).then(a.cmp(&b))
            });
            let k = lr.top_k.max(1);
            for row in lr.experts.chunks_mut(k) {
                let mut taken: Vec<u16> =
                    row.iter().filter_map(|e| new_id.get(e).copied()).collect();
                for e in row.iter_mut() {
                    if let Some(&n) = new_id.get(e) {
                        *e = n;
                        continue;
                    }
                    let n = rank
                        .iter()
                        .copied()
                        .find(|r| !taken.contains(r))
                        .unwrap_or(0);
                    taken.push(n);
                    *e = n;
                }
            }
            lr.n_experts = surv.len();
        }
    }
    out
}

fn kernels_name(k: Kernels) -> &'static str {
    match k {
        Kernels::Exact => "exact",
        Kernels::Fast => "fast",
    }
}

/// One checkpoint the search can run: experts kept (and, with tiers, a rung), its trace and
/// the prune plan that makes it.
struct Level {
    kept: usize,
    /// The run's routes (the route profile's), re-routed when pruned.
    trace: RouteTrace,
    /// The check set's routes (replayed for speed), re-routed when pruned.
    speed: RouteTrace,
    prune: Option<PrunePlan>,
}

fn pct(kept: usize, n: usize) -> String {
    let p = 100.0 * kept as f64 / n as f64;
    if (p - p.round()).abs() < 0.05 {
        format!("{p:.0}%")
    } else {
        format!("{p:.1}%")
    }
}

/// Speed of one candidate.
struct Speed {
    tps: f64,
    hit_rate: f64,
    ssd_bytes_per_token: f64,
}

/// Seconds per token: the probe's compute, plus for the waited misses a latency per decoder
/// layer with a miss and a transfer per miss ([`crate::probe::miss_cost`]); plans probed
/// before those terms existed price a miss at `miss_secs`.
fn speed(p: &Probe, misses_per_token: f64, hit_rate: f64) -> Speed {
    let pr = &p.probes;
    let miss = if pr.layer_latency_secs > 0.0 || pr.miss_transfer_secs > 0.0 {
        crate::probe::layers_with_miss(misses_per_token, p.n_layers, p.top_k)
            * pr.layer_latency_secs
            + misses_per_token * pr.miss_transfer_secs
    } else {
        misses_per_token * pr.miss_secs
    };
    let s = pr.compute_secs_per_token + miss;
    Speed {
        tps: if s > 0.0 { 1.0 / s } else { f64::INFINITY },
        hit_rate,
        ssd_bytes_per_token: misses_per_token * p.slot_bytes as f64,
    }
}

/// Plan `o.model` into `o.memory`.
pub fn fit(o: &FitOptions) -> Result<FitOutcome> {
    let ck = Checkpoint::open(&o.model)?;
    let fingerprint = keep_checkpoint::fingerprint::model_fingerprint(&o.model)?;
    let mut notes = vec![];
    let p = probe(&ck, &o.probe)?;
    let n = p.n_experts;
    let l = p.n_layers;
    let k = p.top_k;
    // The routes replayed for speed: the probe's, recorded on the check set (the sequences
    // `keep fit --check` decodes again). The run's trace, or a synthetic one of the model's
    // shape, seeds the route profile.
    let (trace, provenance, reap) = match &o.run {
        Some(run) => {
            let t = keep_artifacts::routes::read_run(run)?;
            let reap_path = if run.is_dir() {
                run.join(keep_artifacts::reap::FILE)
            } else {
                run.clone()
            };
            let reap = if reap_path.is_file() {
                Some(ReapStats::read(&reap_path)?)
            } else {
                notes.push(format!(
                    "{} has no REAP statistics (run `keep finalize`): no pruning levels",
                    run.display()
                ));
                None
            };
            (t, "simulated", reap)
        }
        None => {
            notes.push(
                "no calibration run: planned from the model's size and the probes alone (offload \
                 only) on the check set's routes; a run (`keep calibrate` + `keep finalize`, then \
                 --run) adds a warm-start profile and pruning levels chosen by REAP, and `keep \
                 eval --json` reports (--eval) add their KL"
                    .into(),
            );
            let spec = SynthSpec {
                layers: l,
                n_experts: n,
                top_k: k,
                tokens: SYNTH_TOKENS,
                sessions: SYNTH_SESSIONS,
                working_set: (n / 4).max(k),
                ..SynthSpec::default()
            };
            (keep_residency::synth::synthetic(&spec), "simulated", None)
        }
    };
    let kname = kernels_name(o.kernels);
    let points: Vec<KlPoint> = read_points(&o.evals, kname)?;
    // Levels of experts kept.
    let mut counts: Vec<usize> = if o.levels.is_empty() {
        DEFAULT_LEVELS
            .iter()
            .map(|f| (f * n as f64).round() as usize)
            .collect()
    } else {
        o.levels.clone()
    };
    counts.retain(|&c| c >= k && c <= n);
    if reap.is_none() {
        counts.retain(|&c| c == n);
    }
    if !counts.contains(&n) {
        counts.push(n);
    }
    counts.sort_unstable_by(|a, b| b.cmp(a));
    counts.dedup();
    let mut levels = vec![];
    for &c in &counts {
        if c == n {
            levels.push(Level {
                kept: n,
                trace: trace.clone(),
                speed: p.trace.clone(),
                prune: None,
            });
            continue;
        }
        let stats = reap.as_ref().expect("levels below n need REAP statistics");
        let sopts = SelectOptions {
            keep: Keep::Count(c),
            saliency: Saliency::Reap,
            shrink: None,
            protect_super_experts: false,
            hash_remap: Some(RemapPolicy::ReapNext),
            groups: 1,
        };
        let sel = select(stats, &sopts)?;
        let mut plan = to_plan(&sel, stats, &sopts);
        plan.bind_to(&o.model)?;
        levels.push(Level {
            kept: c,
            trace: reroute(&trace, &plan, &stats.scores),
            speed: reroute(&p.trace, &plan, &stats.scores),
            prune: Some(plan),
        });
    }
    let policies = [PolicyKind::Lru, PolicyKind::Decay, PolicyKind::Static];
    let warm = if o.run.is_some() {
        WarmStart::Frequency
    } else {
        WarmStart::None
    };
    let budget = o.memory.bytes;
    let mut cands: Vec<(Candidate, usize)> = vec![];
    for (li, lv) in levels.iter().enumerate() {
        // The runtime's own split of the budget (its Engram row cache included, every slot the
        // largest expert's size): the hot set the plan's run will have.
        let split = p.needs.with_experts(lv.kept).plan(budget).ok();
        let slots = split.as_ref().map_or(0, |s| s.slots_per_layer);
        if (o.knob == Knob::Offload && lv.kept != n) || (o.knob == Knob::Prune && slots != lv.kept)
        {
            continue;
        }
        let Some(split) = split else {
            let avail = budget.saturating_sub(p.fixed_bytes) / p.slot_bytes.max(1) / l as u64;
            notes.push(format!(
                "{} experts kept: the memory leaves {avail} slots per layer, fewer than top-k {k}",
                lv.kept
            ));
            continue;
        };
        let kl = if lv.kept == n && o.kernels == Kernels::Exact && points.is_empty() {
            Predicted {
                value: Some(0.0),
                provenance: "definition".into(),
                source: "every expert on the exact kernels is the teacher".into(),
            }
        } else {
            kl_at(&points, lv.kept)
        };
        let meets = match o.min_quality {
            None => lv.kept == n,
            Some(q) => kl.value.is_some_and(|v| v <= q),
        };
        let name = match (lv.kept == n, slots == lv.kept) {
            (true, true) => "in memory".to_string(),
            (true, false) => "offload".to_string(),
            (false, true) => format!("prune {}", pct(lv.kept, n)),
            (false, false) => format!("prune {} + offload", pct(lv.kept, n)),
        };
        let mut rows: Vec<(String, Speed)> = vec![];
        if slots == lv.kept {
            // Every expert has a slot: after the warm start nothing is read.
            rows.push(("lru".into(), speed(&p, 0.0, 1.0)));
        } else {
            let r = keep_residency::simulate(
                &lv.speed,
                &Options {
                    hot: HotSizes::Experts(vec![slots]),
                    policies: policies.to_vec(),
                    half_life: keep_residency::policy::DEFAULT_HALF_LIFE,
                    warm_start: warm,
                    fetch_threshold: None,
                    cost: None,
                    reap_scores: None,
                },
            )?;
            for row in r.sizes.iter().flat_map(|s| &s.policies) {
                let waited = (row.counts.misses - row.counts.prefetched) as f64
                    / row.counts.slots.max(1) as f64;
                rows.push((
                    row.policy.name().to_string(),
                    speed(&p, waited * (k * l) as f64, row.hit_rate),
                ));
            }
        }
        for (policy, s) in rows {
            let mem = split.planned();
            cands.push((
                Candidate {
                    name: name.clone(),
                    experts_kept: lv.kept,
                    experts_total: n,
                    rung: None,
                    budget: Some(budget),
                    policy,
                    hot_set: slots,
                    kernels: kname.into(),
                    draft: "none".into(),
                    hit_rate: s.hit_rate,
                    ssd_bytes_per_token: s.ssd_bytes_per_token,
                    tokens_per_sec: Predicted {
                        value: Some(s.tps),
                        provenance: provenance.into(),
                        source: format!(
                            "{:.3} ms compute ({}) + {:.2} misses per token: {:.2} layers × {:.3} ms latency + {:.3} ms each (routes of the check set{})",
                            1e3 * p.probes.compute_secs_per_token,
                            p.probes.compute_provenance,
                            s.ssd_bytes_per_token / p.slot_bytes.max(1) as f64,
                            crate::probe::layers_with_miss(
                                s.ssd_bytes_per_token / p.slot_bytes.max(1) as f64,
                                l,
                                k
                            ),
                            1e3 * p.probes.layer_latency_secs,
                            1e3 * p.probes.miss_transfer_secs,
                            if lv.kept < n {
                                ", pruned routes re-routed by REAP"
                            } else {
                                ""
                            }
                        ),
                    },
                    kl: kl.clone(),
                    bytes_in_memory: mem,
                    bytes_on_ssd: (lv.kept - slots) as u64 * l as u64 * p.slot_bytes,
                    meets_quality: meets,
                },
                li,
            ));
        }
    }
    if cands.is_empty() && o.knob == Knob::All {
        // Too little memory for any candidate: say the least that runs the model (top-k slots
        // per layer beside the fixed bytes).
        let least = p.fixed_bytes + (k * l) as u64 * p.slot_bytes;
        if budget < least {
            return Err(FitError::NoFit(format!(
                "no candidate fits {budget} bytes: the least memory that runs this model for a context of {} positions is {least} bytes ({:.1} MiB: {} fixed + {k} expert slots per layer × {l} layers of {} bytes); give --memory {least} or more, or a shorter --context",
                o.probe.context,
                least as f64 / (1u64 << 20) as f64,
                p.fixed_bytes,
                p.slot_bytes
            )));
        }
    }
    let tps = |c: &Candidate| c.tokens_per_sec.value.unwrap_or(0.0);
    cands.sort_by(|a, b| tps(&b.0).total_cmp(&tps(&a.0)));
    let Some(chosen) = cands.iter().position(|c| c.0.meets_quality) else {
        return Err(FitError::NoFit(format!(
            "no candidate fits {} bytes{}: {}",
            budget,
            o.min_quality
                .map(|q| format!(" with KL ≤ {q}"))
                .unwrap_or_default(),
            if notes.is_empty() {
                "every candidate misses the quality bound (give --eval reports that measure it)"
                    .into()
            } else {
                notes.join("; ")
            }
        )));
    };
    let (best, li) = cands[chosen].clone();
    let best_offload = cands
        .iter()
        .find(|c| c.0.meets_quality && c.0.experts_kept == n)
        .map(|c| c.0.clone());
    let best_prune = cands
        .iter()
        .find(|c| c.0.meets_quality && c.0.hot_set == c.0.experts_kept)
        .map(|c| c.0.clone());
    let mut table: Vec<Candidate> = vec![best.clone()];
    for c in cands.iter().map(|c| &c.0) {
        if table.len() >= TABLE_ROWS {
            break;
        }
        if c != &best {
            table.push(c.clone());
        }
    }
    for c in [&best_offload, &best_prune].into_iter().flatten() {
        if !table.contains(c) {
            table.push(c.clone());
        }
    }
    let lv = &levels[li];
    let plan_dir = o.out.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = |p: &Path| {
        p.file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default()
    };
    // Absolute, so that the plan names the same model wherever it is run from.
    let model_str = keep_checkpoint::atomic::resolve(&o.model)
        .display()
        .to_string();
    let (derived, prune_plan) = match &lv.prune {
        Some(pp) => {
            // The derived checkpoint's name in the plan: relative to the plan's directory when
            // it lies there (the default), else absolute.
            let default = || {
                plan_dir.join(format!(
                    "{}-keep{}",
                    name(&o.model).trim_end_matches('/'),
                    lv.kept
                ))
            };
            let dir = o.derived_dir.clone().unwrap_or_else(default);
            let abs = keep_checkpoint::atomic::resolve(&dir);
            let pd = keep_checkpoint::atomic::resolve(&plan_dir);
            let recorded = match abs.strip_prefix(&pd) {
                Ok(rel) if !rel.as_os_str().is_empty() => rel.to_path_buf(),
                _ => abs.clone(),
            };
            let pp_path = beside(&o.out, "prune.json");
            let d = Derived {
                dir: recorded.display().to_string(),
                experts_kept: lv.kept,
                experts_total: n,
                rung: None,
                prune_plan: Some(name(&pp_path)),
                commands: vec![format!(
                    "keep prune {model_str} {} --plan {}",
                    dir.display(),
                    pp_path.display()
                )],
            };
            (Some(d), Some((pp_path, pp.clone())))
        }
        None => (None, None),
    };
    let profile_path = beside(&o.out, "profile.json");
    let profile = match &o.run {
        Some(_) => {
            let mut prof = RouteProfile::new(
                match &lv.prune {
                    Some(_) => format!("{fingerprint} keeping {} experts", lv.kept),
                    None => fingerprint.clone(),
                },
                l,
                lv.kept,
                route_profile::DEFAULT_HALF_LIFE,
            );
            for s in &lv.trace.sessions {
                let rows: Vec<(usize, Vec<u32>)> = s
                    .layers
                    .iter()
                    .map(|lr| (lr.layer, lr.experts.iter().map(|&e| e as u32).collect()))
                    .collect();
                prof.fold(rows.iter().map(|(l, e)| (*l, e.as_slice())), k)
                    .map_err(FitError::Invalid)?;
            }
            Some((profile_path.clone(), prof))
        }
        None => None,
    };
    let plan = FitPlan {
        format: fit_plan::FORMAT.into(),
        version: fit_plan::VERSION,
        command: o.command.clone(),
        model: model_str,
        model_fingerprint: fingerprint,
        derived,
        memory: o.memory.clone(),
        budget: best.budget,
        context: o.probe.context,
        policy: best.policy.clone(),
        half_life: keep_residency::policy::DEFAULT_HALF_LIFE,
        hot_set: best.hot_set,
        warm_start: None,
        profile: name(&profile_path),
        kernels: kname.into(),
        draft: "none".into(),
        tiers: None,
        probes: p.probes.clone(),
        prediction: best,
        candidates: table,
        check_set: Some(p.check_set.clone()),
    };
    notes.push(
        "drafting: off (plans do not choose drafting yet: `keep residency --draft-acceptance` \
         predicts it); tiers: none (uniform shipped weights)"
            .into(),
    );
    Ok(FitOutcome {
        plan,
        prune_plan,
        profile,
        best_offload,
        best_prune,
        notes,
    })
}

/// Write the plan, its prune plan and its initial profile (each atomic; existing files
/// refused without `force`).
pub fn write(o: &FitOutcome, out: &Path, force: bool) -> Result<()> {
    if let Some((p, pp)) = &o.prune_plan {
        pp.write(p, force)?;
    }
    if let Some((p, prof)) = &o.profile {
        prof.write(p, force)?;
    }
    o.plan.write(out, force)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use keep_artifacts::plan::LayerPlan;
    use keep_artifacts::routes::{LayerRoutes, Session};

    #[test]
    fn reroute_renumbers_and_sends_removed_experts_to_the_best_free_survivor() {
        let trace = RouteTrace {
            path: PathBuf::from("t"),
            sessions: vec![Session {
                id: "s".into(),
                model_fingerprint: None,
                layers: vec![LayerRoutes {
                    layer: 0,
                    top_k: 2,
                    n_experts: 4,
                    hash: false,
                    experts: vec![0, 1, 2, 3],
                    weights: vec![0.5; 4],
                }],
                source: None,
            }],
            skipped: vec![],
        };
        let mut plan = PrunePlan::new(4, 2, "reap");
        plan.layers = vec![LayerPlan {
            layer: 0,
            survivors: Some(vec![1, 3]),
            hash_routed: false,
            hash_remap: None,
        }];
        // Expert 3 (new id 1) scores highest, then expert 1 (new id 0).
        let scores = vec![vec![9.0, 1.0, 8.0, 2.0]];
        let t = reroute(&trace, &plan, &scores);
        let lr = &t.sessions[0].layers[0];
        assert_eq!(lr.n_experts, 2);
        // Token 0: 1 → 0 stays; removed 0 takes the best survivor not taken (1).
        // Token 1: 3 → 1 stays; removed 2 takes the next free survivor (0).
        assert_eq!(lr.experts, vec![1, 0, 0, 1]);
    }
}
