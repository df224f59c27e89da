//! `select`: choose a uniform survivor set per layer from a run's REAP statistics and write a
//! [`PrunePlan`], with the REAP-vs-frequency kill test beside it.
//!
//! Saliencies ([`Saliency`]): `reap` (Σ g·‖f‖ / count), `frequency` (route count),
//! `weighted_frequency` (Σ g), `ean_mean` (Σ ‖f‖ / count). `shrink = α` pulls the mean-type
//! saliencies (`reap`, `ean_mean`) of rarely routed experts toward the layer mean:
//! s' = (n·s + α·m) / (n + α), with n the expert's route count and m the mean over routed
//! experts. Every pruned layer keeps the same number of experts (at least `top_k`): the
//! highest-saliency ones, ties broken by the lower id — with `groups` > 1, the same number
//! from each contiguous group of experts (a group-limited router's groups stay whole). Hash-routed layers are left whole and
//! marked, unless a remap policy is given (`hash_remap`): then they are pruned like the others
//! (their saliency uses the hash routing's gate weights, which is what calibration records)
//! and the plan carries each one's replacements for its removed experts
//! ([`keep_artifacts::hashremap`]). Their Jaccard is reported but not part of the kill test.
//!
//! The kill test: per layer, the Jaccard index |A∩B| / |A∪B| of the chosen set A against the
//! frequency-chosen set B; a mean ≥ [`KILL_JACCARD`] means the saliency adds nothing over
//! counts. Super-expert candidates follow REAP's outlier rule (`get_super_expert_indices`) on
//! max |f| per expert (so negative outliers count): over all experts of all non-hash layers,
//! threshold = max(99.5th percentile (linear interpolation), max / 10); candidates exceed it.
//! REAP restricts preservation to the first 75% of layers unless asked for outliers; keep
//! reports and (with `protect_super_experts`) protects candidates in every layer.

use std::collections::BTreeMap;

use keep_artifacts::hashremap::{rank_desc, HashRemap, RemapPolicy, NEAREST_DISTANCE};
use keep_artifacts::plan::{LayerPlan, PrunePlan};
use serde::Serialize;

use crate::finalize::ReapStats;
use crate::stats::LayerReap;
use crate::{CalibError, Result};

/// Mean Jaccard at or above which the saliency adds nothing over frequency.
pub const KILL_JACCARD: f64 = 0.9;
/// REAP's super-expert percentile.
pub const SUPER_PERCENTILE: f64 = 99.5;
/// REAP's super-expert absolute rule: above max / this.
pub const SUPER_MAX_DIVISOR: f64 = 10.0;

/// How experts are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Saliency {
    Reap,
    Frequency,
    WeightedFrequency,
    EanMean,
}

impl Saliency {
    pub fn name(self) -> &'static str {
        match self {
            Saliency::Reap => "reap",
            Saliency::Frequency => "frequency",
            Saliency::WeightedFrequency => "weighted_frequency",
            Saliency::EanMean => "ean_mean",
        }
    }
    pub fn parse(s: &str) -> Option<Saliency> {
        [
            Saliency::Reap,
            Saliency::Frequency,
            Saliency::WeightedFrequency,
            Saliency::EanMean,
        ]
        .into_iter()
        .find(|x| x.name() == s)
    }
}

/// How many experts to keep.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Keep {
    Count(usize),
    Percent(f64),
}

impl Keep {
    /// Parse `N` or `P%`.
    pub fn parse(s: &str) -> Option<Keep> {
        let s = s.trim();
        if let Some(p) = s.strip_suffix('%') {
            p.trim()
                .parse::<f64>()
                .ok()
                .filter(|p| p.is_finite())
                .map(Keep::Percent)
        } else {
            s.parse::<usize>().ok().map(Keep::Count)
        }
    }
    /// The survivor count for `n` experts.
    pub fn resolve(self, n: usize) -> usize {
        match self {
            Keep::Count(k) => k,
            Keep::Percent(p) => (n as f64 * p / 100.0).round().max(0.0) as usize,
        }
    }
}

impl std::fmt::Display for Keep {
    /// As the flag is written: `64` or `50%`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keep::Count(k) => write!(f, "{k}"),
            Keep::Percent(p) => write!(f, "{p}%"),
        }
    }
}

/// Options of [`select`].
#[derive(Debug, Clone)]
pub struct SelectOptions {
    pub keep: Keep,
    pub saliency: Saliency,
    pub shrink: Option<f64>,
    pub protect_super_experts: bool,
    /// Prune hash-routed layers too, remapping their `tid2eid` by this policy (`None`: leave
    /// them whole).
    pub hash_remap: Option<RemapPolicy>,
    /// Keep the same number of experts in each of this many contiguous groups of a layer's
    /// experts (DeepSeek-V3's `n_group`, whose router ranks whole groups); 1: no groups.
    pub groups: usize,
}

/// One layer's selection.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSelection {
    pub layer: usize,
    pub hash_routed: bool,
    /// Chosen survivors, ascending (`None` for a layer left whole).
    pub survivors: Option<Vec<usize>>,
    /// Survivors by frequency, ascending.
    pub frequency_survivors: Option<Vec<usize>>,
    pub jaccard_vs_frequency: Option<f64>,
    /// The saliency per expert (after shrinkage).
    pub saliency: Vec<f64>,
    /// Coefficient of variation (std / mean) of the saliency over the layer's experts.
    pub saliency_spread: f64,
    /// Super-expert candidates in this layer.
    pub super_experts: Vec<usize>,
    /// A pruned hash-routed layer's replacements for its removed experts.
    pub remap: Option<HashRemap>,
}

/// A super-expert candidate.
#[derive(Debug, Clone, Serialize)]
pub struct SuperExpert {
    pub layer: usize,
    pub expert: usize,
    pub max_abs_f: f64,
}

/// The result of [`select`].
#[derive(Debug, Clone, Serialize)]
pub struct Selection {
    pub n_experts: usize,
    pub keep: usize,
    pub saliency: Saliency,
    pub layers: Vec<LayerSelection>,
    pub mean_jaccard: Option<f64>,
    /// `mean_jaccard ≥ KILL_JACCARD`.
    pub killed: Option<bool>,
    pub super_threshold: f64,
    pub super_experts: Vec<SuperExpert>,
}

/// |A∩B| / |A∪B| (1 for two empty sets).
pub fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    let sa: std::collections::BTreeSet<_> = a.iter().collect();
    let sb: std::collections::BTreeSet<_> = b.iter().collect();
    let u = sa.union(&sb).count();
    if u == 0 {
        return 1.0;
    }
    sa.intersection(&sb).count() as f64 / u as f64
}

/// Quantile with linear interpolation (torch.quantile's default); `q` in 0..=1.
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (s.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

/// [`top_ids`] within each of `groups` contiguous groups of `s`: `keep / groups` from each
/// (`forced` first within their group), ascending ids.
pub fn top_ids_in_groups(s: &[f64], keep: usize, forced: &[usize], groups: usize) -> Vec<usize> {
    let per = s.len() / groups.max(1);
    let mut out = vec![];
    for g in 0..groups.max(1) {
        let lo = g * per;
        let local: Vec<usize> = forced
            .iter()
            .filter(|&&e| (lo..lo + per).contains(&e))
            .map(|&e| e - lo)
            .collect();
        let ids = top_ids(&s[lo..lo + per], keep / groups.max(1), &local);
        out.extend(ids.into_iter().map(|e| e + lo));
    }
    out
}

/// The `keep` highest of `s` (ties by lower id), ascending ids; `forced` come first.
pub fn top_ids(s: &[f64], keep: usize, forced: &[usize]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    let mut out: Vec<usize> = vec![];
    let mut forced_sorted: Vec<usize> = forced.to_vec();
    forced_sorted.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    for e in forced_sorted.into_iter().chain(idx) {
        if out.len() >= keep {
            break;
        }
        if !out.contains(&e) {
            out.push(e);
        }
    }
    out.sort_unstable();
    out
}

fn spread(s: &[f64]) -> f64 {
    if s.is_empty() {
        return 0.0;
    }
    let m = s.iter().sum::<f64>() / s.len() as f64;
    if m == 0.0 {
        return 0.0;
    }
    let var = s.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / s.len() as f64;
    var.sqrt() / m.abs()
}

/// The saliency of one layer.
pub fn layer_saliency(
    r: &crate::stats::LayerReap,
    score: &[f64],
    kind: Saliency,
    shrink: Option<f64>,
) -> Vec<f64> {
    let n = r.n_experts;
    let base: Vec<f64> = match kind {
        Saliency::Reap => score.to_vec(),
        Saliency::Frequency => r.count.iter().map(|&c| c as f64).collect(),
        Saliency::WeightedFrequency => r.sum_g.clone(),
        Saliency::EanMean => (0..n)
            .map(|e| {
                if r.count[e] == 0 {
                    0.0
                } else {
                    r.sum_norm[e] / r.count[e] as f64
                }
            })
            .collect(),
    };
    match (shrink, kind) {
        (Some(a), Saliency::Reap | Saliency::EanMean) if a > 0.0 => {
            let routed: Vec<f64> = (0..n)
                .filter(|&e| r.count[e] > 0)
                .map(|e| base[e])
                .collect();
            let m = if routed.is_empty() {
                0.0
            } else {
                routed.iter().sum::<f64>() / routed.len() as f64
            };
            (0..n)
                .map(|e| {
                    let c = r.count[e] as f64;
                    (c * base[e] + a * m) / (c + a)
                })
                .collect()
        }
        _ => base,
    }
}

/// The replacements of hash-routed layer `l`'s removed experts under `policy` (see
/// [`keep_artifacts::hashremap`]): `reap` is the layer's REAP score, `surv` its survivors.
pub fn hash_remap(
    policy: RemapPolicy,
    l: usize,
    r: &LayerReap,
    reap: &[f64],
    surv: &[usize],
) -> Result<HashRemap> {
    let ne = r.n_experts;
    let by_reap = rank_desc(surv, reap);
    Ok(match policy {
        RemapPolicy::ReapNext => HashRemap::uniform(
            policy,
            "REAP score (sum g*||f|| / count, hash-routing gate weights), highest first",
            ne,
            surv,
            &by_reap,
        ),
        RemapPolicy::Frequency => {
            let c: Vec<f64> = r.count.iter().map(|&c| c as f64).collect();
            HashRemap::uniform(
                policy,
                "calibration route count, highest first",
                ne,
                surv,
                &rank_desc(surv, &c),
            )
        }
        RemapPolicy::Nearest => {
            if r.dist.len() != ne * ne {
                return Err(CalibError::Options(format!(
                    "--hash-remap nearest needs the hash-routed layers' output distances, but layer {l} has none: calibrate without --no-hash-distances"
                )));
            }
            let mut candidates = BTreeMap::new();
            for e in (0..ne).filter(|e| surv.binary_search(e).is_err()) {
                let order = match r.mean_dist(e) {
                    Some(d) => {
                        let mut o = surv.to_vec();
                        o.sort_by(|&a, &b| d[a].total_cmp(&d[b]).then(a.cmp(&b)));
                        o
                    }
                    None => by_reap.clone(),
                };
                candidates.insert(e, order);
            }
            HashRemap {
                policy: policy.name().into(),
                ranked_by: Some(format!(
                    "{NEAREST_DISTANCE}, nearest first (experts no calibration token reached: REAP order)"
                )),
                candidates,
            }
        }
    })
}

/// Choose survivors (see the module doc).
pub fn select(stats: &ReapStats, opts: &SelectOptions) -> Result<Selection> {
    let ne = stats.n_experts;
    let keep = opts.keep.resolve(ne);
    if keep < stats.top_k.max(1) || keep > ne {
        return Err(CalibError::Options(format!(
            "--keep {} gives {keep} experts per layer; it must be between num_experts_per_tok = {} and n_experts = {ne}",
            opts.keep, stats.top_k
        )));
    }
    let groups = opts.groups;
    if groups == 0 || !ne.is_multiple_of(groups) || !keep.is_multiple_of(groups) {
        return Err(CalibError::Options(format!(
            "--groups {groups} must divide both the layer's {ne} experts and the {keep} kept \
             (the same number kept in each group)"
        )));
    }
    if let Some(a) = opts.shrink {
        if !(a >= 0.0 && a.is_finite()) {
            return Err(CalibError::Options(format!("--shrink {a} must be ≥ 0")));
        }
        if !matches!(opts.saliency, Saliency::Reap | Saliency::EanMean) {
            return Err(CalibError::Options(format!(
                "--shrink applies to the mean saliencies (reap, ean_mean), not {}",
                opts.saliency.name()
            )));
        }
    }
    // Super-expert candidates over non-hash layers.
    let mut all = vec![];
    let mut per_layer_abs = vec![];
    for (l, r) in stats.layers.iter().enumerate() {
        let a = r.max_abs();
        if !stats.hash_layers.contains(&l) {
            all.extend(a.iter().copied());
        }
        per_layer_abs.push(a);
    }
    let gmax = all.iter().copied().fold(0.0, f64::max);
    let threshold = quantile(&all, SUPER_PERCENTILE / 100.0).max(gmax / SUPER_MAX_DIVISOR);
    let mut supers = vec![];
    let mut layers = vec![];
    let mut jac = vec![];
    for (l, r) in stats.layers.iter().enumerate() {
        let hash = stats.hash_layers.contains(&l);
        let sal = layer_saliency(r, &stats.scores[l], opts.saliency, opts.shrink);
        let sup: Vec<usize> = if hash {
            vec![]
        } else {
            (0..ne)
                .filter(|&e| per_layer_abs[l][e] > threshold)
                .collect()
        };
        for &e in &sup {
            supers.push(SuperExpert {
                layer: l,
                expert: e,
                max_abs_f: per_layer_abs[l][e],
            });
        }
        // A layer no token was routed through (a dense layer of a family that has them, e.g.
        // Qwen3-MoE's `mlp_only_layers`) has nothing to select: it is left whole.
        let unrouted = !hash && r.count.iter().all(|&c| c == 0);
        let (surv, freq, j) = if unrouted {
            (None, None, None)
        } else if hash {
            match opts.hash_remap {
                None => (None, None, None),
                Some(_) => {
                    let s = top_ids(&sal, keep, &[]);
                    let fs: Vec<f64> = r.count.iter().map(|&c| c as f64).collect();
                    let f = top_ids(&fs, keep, &[]);
                    let j = jaccard(&s, &f);
                    (Some(s), Some(f), Some(j))
                }
            }
        } else {
            let forced: &[usize] = if opts.protect_super_experts {
                &sup
            } else {
                &[]
            };
            let s = top_ids_in_groups(&sal, keep, forced, groups);
            let fs: Vec<f64> = r.count.iter().map(|&c| c as f64).collect();
            let f = top_ids_in_groups(&fs, keep, &[], groups);
            let j = jaccard(&s, &f);
            jac.push(j);
            (Some(s), Some(f), Some(j))
        };
        let remap = match (&surv, opts.hash_remap) {
            (Some(s), Some(p)) if hash => Some(hash_remap(p, l, r, &stats.scores[l], s)?),
            _ => None,
        };
        layers.push(LayerSelection {
            layer: l,
            hash_routed: hash,
            remap,
            survivors: surv,
            frequency_survivors: freq,
            jaccard_vs_frequency: j,
            saliency_spread: spread(&sal),
            saliency: sal,
            super_experts: sup,
        });
    }
    let mean_jaccard = (!jac.is_empty()).then(|| jac.iter().sum::<f64>() / jac.len() as f64);
    Ok(Selection {
        n_experts: ne,
        keep,
        saliency: opts.saliency,
        layers,
        mean_jaccard,
        killed: mean_jaccard.map(|m| m >= KILL_JACCARD),
        super_threshold: threshold,
        super_experts: supers,
    })
}

/// The prune plan of a selection (extra fields: fingerprints, Jaccard table, id maps,
/// saliencies, super-expert candidates, the kill test).
pub fn to_plan(sel: &Selection, stats: &ReapStats, opts: &SelectOptions) -> PrunePlan {
    let mut extra = BTreeMap::new();
    let j = |v: serde_json::Value| v;
    extra.insert(
        "model_fingerprint".into(),
        j(stats.model_fingerprint.clone().into()),
    );
    extra.insert(
        "pack_fingerprint".into(),
        j(stats.pack_fingerprint.clone().into()),
    );
    extra.insert("calibration_tokens".into(), j(stats.tokens.into()));
    extra.insert(
        "shrink".into(),
        opts.shrink
            .map(serde_json::Value::from)
            .unwrap_or(serde_json::Value::Null),
    );
    extra.insert(
        "protect_super_experts".into(),
        opts.protect_super_experts.into(),
    );
    extra.insert("groups".into(), opts.groups.into());
    let table: Vec<serde_json::Value> = sel
        .layers
        .iter()
        .map(|l| {
            serde_json::json!({
                "layer": l.layer,
                "jaccard": l.jaccard_vs_frequency,
                "saliency_spread": l.saliency_spread,
                "frequency_survivors": l.frequency_survivors,
                "hash_routed": l.hash_routed,
            })
        })
        .collect();
    extra.insert("jaccard_vs_frequency".into(), table.into());
    extra.insert(
        "kill_test".into(),
        serde_json::json!({
            "rule": format!("mean per-layer Jaccard of the {} set vs the frequency set >= {KILL_JACCARD} means the saliency adds nothing over counts", sel.saliency.name()),
            "mean_jaccard": sel.mean_jaccard,
            "killed": sel.killed,
        }),
    );
    let maps: Vec<serde_json::Value> = sel
        .layers
        .iter()
        .map(|l| {
            let map: Option<Vec<Option<usize>>> = l.survivors.as_ref().map(|s| {
                (0..sel.n_experts)
                    .map(|e| s.iter().position(|&x| x == e))
                    .collect()
            });
            serde_json::json!({"layer": l.layer, "old_to_new": map})
        })
        .collect();
    extra.insert("id_map".into(), maps.into());
    let sal: Vec<serde_json::Value> = sel
        .layers
        .iter()
        .map(|l| serde_json::json!({"layer": l.layer, "values": l.saliency}))
        .collect();
    extra.insert("saliency_values".into(), sal.into());
    extra.insert(
        "super_experts".into(),
        serde_json::json!({
            "rule": "max |f| > max(99.5th percentile over all experts of all non-hash layers, global max / 10) (REAP get_super_expert_indices on max |f|)",
            "threshold": sel.super_threshold,
            "candidates": sel.super_experts,
        }),
    );
    let mut plan = PrunePlan::new(sel.n_experts, sel.keep, sel.saliency.name());
    plan.layers = sel
        .layers
        .iter()
        .map(|l| LayerPlan {
            layer: l.layer,
            survivors: l.survivors.clone(),
            hash_routed: l.hash_routed,
            hash_remap: l.remap.clone(),
        })
        .collect();
    plan.extra = extra;
    plan
}
