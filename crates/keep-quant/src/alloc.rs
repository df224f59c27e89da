//! Precision-tier allocation (`keep alloc`): a rung for every routed expert — pruned, E8P2,
//! E8P2+E81, E8P2+E8P2 or as shipped — that fits a byte budget and minimises the predicted loss
//! Σ saliency(l, j) × relative error(l, j, rung). The relative errors are `keep quant`'s
//! imatrix-weighted reconstruction errors per expert and rung (`quant-report.json`; a pruned
//! expert's is 1, a shipped one's 0); the saliency is REAP's, from a finalized calibration run.
//!
//! # The solver
//! The problem is a multiple-choice knapsack: one item per expert, one choice per rung, each
//! rung's bytes the same for every expert of the model (the experts share their shapes). Two
//! solvers:
//! - [`solve_exact`] — dynamic programming over the budget in units of a *grain* (the greatest
//!   common divisor of the rung sizes, so exact for the bytes as they are, or a multiple of it
//!   when the table of experts × capacity would pass [`MAX_DP_CELLS`]; each rung's size is
//!   rounded **up** to whole grains, so the answer always fits the budget, and is the optimum
//!   of the rounded problem). O(experts × capacity × rungs) time, one byte per cell.
//! - [`solve_greedy`] — greedy by marginal gain on each expert's lower convex hull of (bytes,
//!   loss): start every expert at its cheapest rung, then take upgrades in order of loss saved
//!   per byte while they fit. It is the optimum of the linear relaxation up to the one upgrade
//!   that does not fit, so it is never worse than the optimum by more than one expert's largest
//!   loss step; it runs in O(n log n) for any size.
//!
//! [`Solver::Auto`] (`keep alloc`'s default) takes the exact solver whenever the table fits
//! [`MAX_DP_CELLS`] with the exact grain — every model keep runs today (a 43-layer × 256-expert
//! model at a GCD grain of 512 bytes and a budget of 100 GB is too big for it, so it takes
//! the exact solver at a coarser grain, which is still exact for the rounded sizes) — and the
//! greedy one only when asked. Exactness matters because the rungs are few and far apart in
//! bytes: the greedy's last, unfitting upgrade can be a large share of a small budget.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_artifacts::alloc::{Alloc, LayerAlloc, LossModel, LossPoint, RungBytes, PRUNED, SHIPPED};
use keep_artifacts::reap::ReapStats;
use keep_checkpoint::{layout, Checkpoint};

use crate::checkpoint::{QuantReport, PARTS, REPORT_FILE};
use crate::fit::QuantFormat;
use crate::{QuantError, Result};

/// The most cells (experts × budget units) the exact solver's table may have (one byte each).
pub const MAX_DP_CELLS: u64 = 256 << 20;

/// Which solver [`allocate`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Solver {
    /// Dynamic programming (see the module doc), at the finest grain that fits.
    Auto,
    /// Dynamic programming at a grain of at least this many bytes.
    Exact { grain: u64 },
    /// Greedy by marginal gain on the convex hulls.
    Greedy,
}

/// A solution: the rung index chosen for each item.
#[derive(Debug, Clone, PartialEq)]
pub struct Solution {
    pub choice: Vec<usize>,
    pub bytes: u64,
    pub loss: f64,
    /// The grain the exact solver ran at (1 for the greedy one, which is byte-exact).
    pub grain: u64,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn evaluate(
    costs: &[u64],
    losses: &[Vec<Option<f64>>],
    choice: Vec<usize>,
    grain: u64,
) -> Solution {
    let bytes = choice.iter().map(|&r| costs[r]).sum();
    let loss = choice
        .iter()
        .zip(losses)
        .map(|(&r, l)| l[r].unwrap_or(f64::INFINITY))
        .sum();
    Solution {
        choice,
        bytes,
        loss,
        grain,
    }
}

fn check_problem(costs: &[u64], losses: &[Vec<Option<f64>>]) -> Result<()> {
    for (i, l) in losses.iter().enumerate() {
        if l.len() != costs.len() {
            return Err(QuantError::Input(format!(
                "item {i} has {} choices, the problem {}",
                l.len(),
                costs.len()
            )));
        }
        if l.iter().all(Option::is_none) {
            return Err(QuantError::Input(format!("item {i} has no available rung")));
        }
        if l.iter().flatten().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(QuantError::Input(format!(
                "item {i} has a loss that is not ≥ 0"
            )));
        }
    }
    Ok(())
}

fn over_budget(costs: &[u64], losses: &[Vec<Option<f64>>], budget: u64) -> QuantError {
    let least: u64 = losses
        .iter()
        .map(|l| {
            (0..costs.len())
                .filter(|&r| l[r].is_some())
                .map(|r| costs[r])
                .min()
                .unwrap_or(0)
        })
        .sum();
    QuantError::Input(format!(
        "a budget of {budget} bytes cannot hold the experts: the cheapest rungs allowed take \
         {least} bytes (raise --budget or allow a cheaper rung with --rungs)"
    ))
}

/// The exact multiple-choice knapsack (see the module doc): item `i` at rung `r` costs
/// `costs[r]` bytes and loses `losses[i][r]` (`None`: not available). `grain` 0 picks the
/// finest grain that fits [`MAX_DP_CELLS`].
pub fn solve_exact(
    costs: &[u64],
    losses: &[Vec<Option<f64>>],
    budget: u64,
    grain: u64,
) -> Result<Solution> {
    check_problem(costs, losses)?;
    let n = losses.len() as u64;
    let g0 = costs.iter().fold(0, |a, &c| gcd(a, c)).max(1);
    let mut g = g0.max(grain);
    let need = |g: u64| n.max(1).saturating_mul(budget / g + 1);
    if need(g) > MAX_DP_CELLS {
        // the smallest multiple of the exact grain that fits the table
        let min_g = (n.max(1).saturating_mul(budget))
            .div_ceil(MAX_DP_CELLS - n.max(1))
            .max(1);
        g = min_g.div_ceil(g0) * g0;
        while need(g) > MAX_DP_CELLS {
            g += g0;
        }
    }
    let cap = (budget / g) as usize;
    let w: Vec<usize> = costs.iter().map(|&c| c.div_ceil(g) as usize).collect();
    let nr = costs.len();
    // dp[c]: least loss of the items so far within c units; pick[i][c]: the rung item i took.
    let mut dp = vec![0f64; cap + 1];
    let mut pick = vec![0u8; losses.len() * (cap + 1)];
    for (i, l) in losses.iter().enumerate() {
        let mut next = vec![f64::INFINITY; cap + 1];
        let row = &mut pick[i * (cap + 1)..(i + 1) * (cap + 1)];
        for c in 0..=cap {
            for r in 0..nr {
                let Some(v) = l[r] else { continue };
                if w[r] > c {
                    continue;
                }
                let cand = dp[c - w[r]] + v;
                if cand < next[c] {
                    next[c] = cand;
                    row[c] = r as u8;
                }
            }
        }
        dp = next;
    }
    if !dp[cap].is_finite() {
        return Err(over_budget(costs, losses, budget));
    }
    let mut choice = vec![0usize; losses.len()];
    let mut c = cap;
    for i in (0..losses.len()).rev() {
        let r = pick[i * (cap + 1) + c] as usize;
        choice[i] = r;
        c -= w[r];
    }
    Ok(evaluate(costs, losses, choice, g))
}

/// Greedy by marginal gain on each item's lower convex hull (see the module doc).
pub fn solve_greedy(costs: &[u64], losses: &[Vec<Option<f64>>], budget: u64) -> Result<Solution> {
    check_problem(costs, losses)?;
    // per item: the hull, cheapest first, strictly decreasing loss
    let mut hulls: Vec<Vec<usize>> = Vec::with_capacity(losses.len());
    for l in losses {
        let mut pts: Vec<usize> = (0..costs.len()).filter(|&r| l[r].is_some()).collect();
        pts.sort_by(|&a, &b| {
            costs[a]
                .cmp(&costs[b])
                .then(l[a].unwrap().total_cmp(&l[b].unwrap()))
        });
        let mut hull: Vec<usize> = vec![];
        for r in pts {
            let (c, v) = (costs[r] as f64, l[r].unwrap());
            if let Some(&last) = hull.last() {
                if v >= l[last].unwrap() {
                    continue; // costs at least as much and loses no less
                }
            }
            while hull.len() >= 2 {
                let (a, b) = (hull[hull.len() - 2], hull[hull.len() - 1]);
                let s_ab = (l[a].unwrap() - l[b].unwrap()) / (costs[b] - costs[a]).max(1) as f64;
                let s_br = (l[b].unwrap() - v) / (c - costs[b] as f64).max(1.0);
                if s_br >= s_ab {
                    hull.pop();
                } else {
                    break;
                }
            }
            hull.push(r);
        }
        hulls.push(hull);
    }
    let mut choice: Vec<usize> = hulls.iter().map(|h| h[0]).collect();
    let mut used: u64 = choice.iter().map(|&r| costs[r]).sum();
    if used > budget {
        return Err(over_budget(costs, losses, budget));
    }
    // every upgrade step, by gain per byte (ties: item, then step order)
    let mut steps: Vec<(f64, usize, usize)> = vec![];
    for (i, h) in hulls.iter().enumerate() {
        for s in 1..h.len() {
            let (a, b) = (h[s - 1], h[s]);
            let gain = losses[i][a].unwrap() - losses[i][b].unwrap();
            steps.push((gain / (costs[b] - costs[a]).max(1) as f64, i, s));
        }
    }
    steps.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let mut level = vec![0usize; losses.len()];
    for (_, i, s) in steps {
        if level[i] + 1 != s {
            continue; // an earlier step of this item did not fit
        }
        let (a, b) = (hulls[i][s - 1], hulls[i][s]);
        let extra = costs[b] - costs[a];
        if used + extra <= budget {
            used += extra;
            choice[i] = b;
            level[i] = s;
        }
    }
    Ok(evaluate(costs, losses, choice, 1))
}

/// Where an expert's relative error per rung comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saliency {
    /// REAP's score as `keep select` ranks by: mean of g·‖f‖ over the tokens routed to it.
    Reap,
    /// REAP's mass: Σ g·‖f‖ over the calibration tokens, per token — the expected size of the
    /// expert's contribution to a token, so frequency counts (the default: the loss is summed
    /// over tokens).
    ReapMass,
}

impl Saliency {
    /// The name written into the allocation.
    pub fn label(self) -> &'static str {
        match self {
            Saliency::Reap => "reap",
            Saliency::ReapMass => "reap-mass",
        }
    }
    /// Parse a label.
    pub fn parse(s: &str) -> Option<Saliency> {
        [Saliency::Reap, Saliency::ReapMass]
            .into_iter()
            .find(|x| x.label() == s)
    }
}

/// What [`allocate`] needs.
#[derive(Debug, Clone)]
pub struct AllocOptions {
    /// The model the allocation is for (its checkpoint as shipped).
    pub model: PathBuf,
    /// The finalized calibration run (its `reap-stats.safetensors`).
    pub run: PathBuf,
    /// `quant-report.json` files (or the quantized checkpoints holding them).
    pub reports: Vec<PathBuf>,
    /// Rung labels allowed (keep-artifacts' `alloc::LABELS`).
    pub rungs: Vec<String>,
    pub budget: u64,
    pub solver: Solver,
    pub saliency: Saliency,
    /// A loss model fitted on measured points ([`fit_loss_model`]): each rung's loss is scaled
    /// by its multiplier, so the objective is a predicted KL. `None`: multipliers of 1.
    pub loss_model: Option<LossModel>,
}

/// Bytes of one expert's three projections at `label`, from the checkpoint's shapes (shipped:
/// the stored weight and scale tensors; E8P rungs: u16 codes, per-row f32 scales, the residual
/// stage's codes and scales).
pub fn rung_bytes(ck: &Checkpoint, layer: usize, expert: usize, label: &str) -> Result<u64> {
    let mut total = 0u64;
    for part in PARTS {
        let name = format!("layers.{layer}.ffn.experts.{expert}.{part}.weight");
        let w = ck.tensor(&name)?;
        let cfg = ck.require_config()?;
        let (rows, cols) = if part == "w2" {
            (cfg.hidden_size as u64, cfg.moe_intermediate_size as u64)
        } else {
            (cfg.moe_intermediate_size as u64, cfg.hidden_size as u64)
        };
        total += match label {
            SHIPPED => {
                w.bytes.len() as u64
                    + layout::scale_of(ck, &name).map_or(0, |s| s.bytes.len() as u64)
            }
            PRUNED => 0,
            l => {
                let f = QuantFormat::parse(l)
                    .ok_or_else(|| QuantError::Input(format!("unknown rung `{l}`")))?;
                let groups = rows * cols / 8;
                let base = groups * 2 + rows * 4;
                base + match f.residual() {
                    None => 0,
                    Some(crate::fit::ResidualKind::E81) => groups + rows * 4,
                    Some(crate::fit::ResidualKind::E8p) => groups * 2 + rows * 4,
                }
            }
        };
    }
    Ok(total)
}

/// Read a `quant-report.json` (or the checkpoint directory holding one).
pub fn read_report(path: &Path) -> Result<QuantReport> {
    let p = if path.is_dir() {
        path.join(REPORT_FILE)
    } else {
        path.to_path_buf()
    };
    let text =
        keep_checkpoint::small_file::read_text(&p, keep_checkpoint::small_file::MAX_SMALL_FILE)
            .map_err(|e| QuantError::Input(format!("{}: {e}", p.display())))?;
    let r: QuantReport = serde_json::from_str(&text)
        .map_err(|e| QuantError::Input(format!("{}: not a quant report: {e}", p.display())))?;
    if r.format != crate::checkpoint::QUANT_FORMAT || r.version != crate::checkpoint::QUANT_VERSION
    {
        return Err(QuantError::Input(format!(
            "{}: format `{}` version {} is not keep-quant version 1",
            p.display(),
            r.format,
            r.version
        )));
    }
    Ok(r)
}

/// One routed expert: what its predicted loss at a rung is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertRow {
    pub layer: usize,
    pub expert: usize,
    /// In a hash-routed layer (never pruned).
    pub hash: bool,
    pub saliency: f64,
    /// Relative error per E8P rung label, from the quant reports.
    pub rel_error: BTreeMap<String, f64>,
}

impl ExpertRow {
    /// Saliency × relative error at `label` (pruned: error 1, shipped: 0); `None` where the
    /// rung is not available (no report coded it, or pruning a hash-routed expert).
    pub fn unit_loss(&self, label: &str) -> Option<f64> {
        match label {
            PRUNED => (!self.hash).then_some(self.saliency),
            SHIPPED => Some(0.0),
            q => self.rel_error.get(q).map(|e| self.saliency * e),
        }
    }
}

/// Every routed expert of a model with its saliency and errors, checked against the model.
#[derive(Debug, Clone)]
pub struct ExpertTable {
    pub model_fingerprint: String,
    pub saliency: Saliency,
    pub n_layers: usize,
    pub top_k: usize,
    /// In (layer, expert) order.
    pub experts: Vec<ExpertRow>,
}

/// Read the REAP statistics of `run` (which must be of `model`) and the relative errors of
/// `reports` (the first report that has an expert's rung wins) into an [`ExpertTable`].
pub fn expert_table(
    model: &Path,
    run: &Path,
    reports: &[PathBuf],
    saliency: Saliency,
) -> Result<ExpertTable> {
    let ck = Checkpoint::open(model)?;
    let cfg = ck.require_config()?;
    let reap =
        ReapStats::read(run).map_err(|e| QuantError::Input(format!("{}: {e}", run.display())))?;
    let fp = keep_checkpoint::fingerprint::model_fingerprint(model)?;
    if reap.model_fingerprint != fp {
        return Err(QuantError::Input(format!(
            "{}: the calibration run is of another model (fingerprint {}, {} has {fp})",
            run.display(),
            reap.model_fingerprint,
            model.display()
        )));
    }
    // relative errors: (layer, expert) → label → error, first report that has it
    let mut errs: BTreeMap<(usize, usize), BTreeMap<String, f64>> = BTreeMap::new();
    for p in reports {
        let r = read_report(p)?;
        for e in r.experts {
            let m = errs.entry((e.layer, e.expert)).or_default();
            for (k, v) in e.rel_error {
                m.entry(k).or_insert(v);
            }
        }
    }
    let n_layers = cfg.num_hidden_layers;
    if reap.n_layers != n_layers {
        return Err(QuantError::Input(format!(
            "{}: {} layers of REAP statistics, the model has {n_layers}",
            run.display(),
            reap.n_layers
        )));
    }
    let mut experts = vec![];
    for l in 0..n_layers {
        let ne = cfg.experts_in_layer(l);
        if reap.scores[l].len() < ne {
            return Err(QuantError::Input(format!(
                "{}: layer {l} has REAP scores for {} experts, the model {ne}",
                run.display(),
                reap.scores[l].len()
            )));
        }
        let hash = reap.hash_layers.contains(&l);
        for j in 0..ne {
            let s = match saliency {
                Saliency::Reap => reap.scores[l][j],
                Saliency::ReapMass => reap.layers[l].sum_g_norm[j] / (reap.tokens.max(1) as f64),
            };
            experts.push(ExpertRow {
                layer: l,
                expert: j,
                hash,
                saliency: s,
                rel_error: errs.remove(&(l, j)).unwrap_or_default(),
            });
        }
    }
    Ok(ExpertTable {
        model_fingerprint: fp,
        saliency,
        n_layers,
        top_k: cfg.num_experts_per_tok,
        experts,
    })
}

/// An allocation's loss terms per rung label: Σ saliency × relative error over the experts it
/// puts at that rung (pruned: error 1). What a [`LossModel`] weighs.
pub fn loss_terms(table: &ExpertTable, alloc: &Alloc) -> Result<BTreeMap<String, f64>> {
    if alloc.model_fingerprint != table.model_fingerprint {
        return Err(QuantError::Input(format!(
            "the allocation is of another model (fingerprint {}, the run's {})",
            alloc.model_fingerprint, table.model_fingerprint
        )));
    }
    let mut terms: BTreeMap<String, f64> = BTreeMap::new();
    for e in &table.experts {
        let r = alloc.rung(e.layer, e.expert).ok_or_else(|| {
            QuantError::Input(format!(
                "the allocation has no rung for expert {} of layer {}",
                e.expert, e.layer
            ))
        })?;
        let v = e.unit_loss(r).ok_or_else(|| {
            QuantError::Input(format!(
                "expert {} of layer {} is at `{r}` but no quant report gives its error there",
                e.expert, e.layer
            ))
        })?;
        *terms.entry(r.to_string()).or_default() += v;
    }
    terms.retain(|k, _| k != SHIPPED);
    Ok(terms)
}

/// Solve `m · x = b` (row-major `m`, n × n) by Gaussian elimination with partial pivoting;
/// `None` when singular.
fn solve_linear(mut m: Vec<f64>, mut b: Vec<f64>, n: usize) -> Option<Vec<f64>> {
    for c in 0..n {
        let p = (c..n).max_by(|&i, &j| m[i * n + c].abs().total_cmp(&m[j * n + c].abs()))?;
        let scale = (0..n).map(|k| m[k * n + c].abs()).fold(0.0, f64::max);
        if m[p * n + c].abs() <= SINGULAR * scale.max(f64::MIN_POSITIVE) {
            return None;
        }
        if p != c {
            for k in 0..n {
                m.swap(p * n + k, c * n + k);
            }
            b.swap(p, c);
        }
        for r in 0..n {
            if r == c {
                continue;
            }
            let f = m[r * n + c] / m[c * n + c];
            for k in c..n {
                m[r * n + k] -= f * m[c * n + k];
            }
            b[r] -= f * b[c];
        }
    }
    Some((0..n).map(|i| b[i] / m[i * n + i]).collect())
}

/// A pivot this small against its column is treated as zero (a rung whose terms are a
/// multiple of another's over the points cannot be told apart from it).
const SINGULAR: f64 = 1e-12;

/// The largest KL (nats per token) a point may have: far above any model's (a uniform guess
/// over a million tokens is 14 nats), far below where the fit's squares overflow.
pub const MAX_KL: f64 = 1e3;
/// The largest loss term a point may have (terms are weighted relative errors summed over
/// experts; far larger ones are not measurements, and their squares would overflow the fit).
pub const MAX_TERM: f64 = 1e12;

/// Why a point lies outside the domain the fit works in (`None`: it lies inside).
fn out_of_domain(terms: &BTreeMap<String, f64>, kl: f64) -> Option<String> {
    if !(kl.is_finite() && kl > 0.0 && kl <= MAX_KL) {
        return Some(format!(
            "a measured KL of {kl}: every point needs a KL > 0 and at most {MAX_KL} nats per token"
        ));
    }
    terms
        .iter()
        .find(|(_, v)| !(v.is_finite() && **v >= 0.0 && **v <= MAX_TERM))
        .map(|(r, v)| {
            format!("a loss term of {v} for rung `{r}`: terms lie between 0 and {MAX_TERM}")
        })
}

/// Fit non-negative multipliers `m[r]` so that Σ_r m[r] × terms[r] predicts each point's KL,
/// minimising the squared *relative* error (KL spans orders of magnitude between a pruned and
/// a finely coded model, and the absolute error would fit only the largest). Exact
/// non-negative least squares by trying every subset of rungs (there are at most four with
/// terms). Needs at least as many points as rungs with terms, and every KL > 0.
pub fn fit_multipliers(points: &[(BTreeMap<String, f64>, f64)]) -> Result<BTreeMap<String, f64>> {
    if let Some((i, why)) = points
        .iter()
        .enumerate()
        .find_map(|(i, (t, kl))| out_of_domain(t, *kl).map(|w| (i, w)))
    {
        return Err(QuantError::Input(format!("point {}: {why}", i + 1)));
    }
    let labels: Vec<String> = points
        .iter()
        .flat_map(|(t, _)| t.iter().filter(|(_, &v)| v > 0.0).map(|(k, _)| k.clone()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if labels.is_empty() {
        return Err(QuantError::Input(
            "no point has a loss term: fit on allocations that code or prune experts".into(),
        ));
    }
    if points.len() < labels.len() {
        return Err(QuantError::Input(format!(
            "{} points cannot fit {} rungs ({}): measure at least one point per rung",
            points.len(),
            labels.len(),
            labels.join(", ")
        )));
    }
    // rows of A: terms / kl; b = 1
    let a: Vec<Vec<f64>> = points
        .iter()
        .map(|(t, kl)| {
            labels
                .iter()
                .map(|l| t.get(l).copied().unwrap_or(0.0) / kl)
                .collect()
        })
        .collect();
    let mut best: Option<(f64, Vec<f64>)> = None;
    for mask in 1u32..(1 << labels.len()) {
        let idx: Vec<usize> = (0..labels.len()).filter(|i| mask >> i & 1 == 1).collect();
        let n = idx.len();
        let mut ata = vec![0.0; n * n];
        let mut atb = vec![0.0; n];
        for row in &a {
            for (i, &p) in idx.iter().enumerate() {
                atb[i] += row[p];
                for (j, &q) in idx.iter().enumerate() {
                    ata[i * n + j] += row[p] * row[q];
                }
            }
        }
        let Some(x) = solve_linear(ata, atb, n) else {
            continue;
        };
        if x.iter().any(|&v| v < 0.0 || !v.is_finite()) {
            continue;
        }
        let mut m = vec![0.0; labels.len()];
        for (i, &p) in idx.iter().enumerate() {
            m[p] = x[i];
        }
        let res: f64 = a
            .iter()
            .map(|row| {
                let pred: f64 = row.iter().zip(&m).map(|(r, v)| r * v).sum();
                (pred - 1.0).powi(2)
            })
            .sum();
        if best.as_ref().is_none_or(|(r, _)| res < *r) {
            best = Some((res, m));
        }
    }
    let (_, m) = best.ok_or_else(|| {
        QuantError::Input(
            "the points cannot tell the rungs apart (their terms are proportional): measure \
             points that mix the rungs differently"
                .into(),
        )
    })?;
    Ok(labels.into_iter().zip(m).collect())
}

/// A point's name, its loss terms per rung and its measured KL.
type NamedTerms = (String, BTreeMap<String, f64>, f64);

/// Fit a [`LossModel`] on measured allocations (`fitted`: name, allocation, measured KL) and
/// report its predictions for `held_out` ones it never saw.
pub fn fit_loss_model(
    table: &ExpertTable,
    fitted: &[(String, Alloc, f64)],
    held_out: &[(String, Alloc, f64)],
) -> Result<LossModel> {
    let terms = |pts: &[(String, Alloc, f64)]| -> Result<Vec<NamedTerms>> {
        pts.iter()
            .map(|(n, a, kl)| {
                loss_terms(table, a)
                    .map(|t| (n.clone(), t, *kl))
                    .map_err(|e| QuantError::Input(format!("{n}: {e}")))
            })
            .collect()
    };
    let fit = terms(fitted)?;
    let held = terms(held_out)?;
    for (n, t, kl) in fit.iter().chain(&held) {
        if let Some(why) = out_of_domain(t, *kl) {
            return Err(QuantError::Input(format!("{n}: {why}")));
        }
    }
    let pairs: Vec<(BTreeMap<String, f64>, f64)> =
        fit.iter().map(|(_, t, k)| (t.clone(), *k)).collect();
    let multipliers = fit_multipliers(&pairs)?;
    let mut lm = LossModel {
        format: LossModel::FORMAT.into(),
        version: LossModel::VERSION,
        model_fingerprint: table.model_fingerprint.clone(),
        saliency: table.saliency.label().into(),
        multipliers,
        fitted: vec![],
        held_out: vec![],
        extra: BTreeMap::new(),
    };
    let point = |lm: &LossModel, (n, t, kl): (String, BTreeMap<String, f64>, f64)| {
        lm.predict(&t)
            .map(|predicted| LossPoint {
                alloc: n.clone(),
                terms: t,
                kl,
                predicted,
            })
            .map_err(|e| QuantError::Input(format!("{n}: {e}")))
    };
    lm.fitted = fit
        .into_iter()
        .map(|p| point(&lm, p))
        .collect::<Result<_>>()?;
    lm.held_out = held
        .into_iter()
        .map(|p| point(&lm, p))
        .collect::<Result<_>>()?;
    lm.validate().map_err(QuantError::Input)?;
    Ok(lm)
}

/// Solve the allocation (see the module doc) and return the file `keep alloc` writes.
/// Hash-routed layers never get `pruned` (their `tid2eid` table would need a remap), and a
/// layer must keep at least `top_k` experts. With a loss model, each rung's loss is scaled by
/// its multiplier (the objective, `predicted_loss`, is then a predicted KL).
pub fn allocate(opts: &AllocOptions) -> Result<Alloc> {
    let ck = Checkpoint::open(&opts.model)?;
    if opts.rungs.is_empty() {
        return Err(QuantError::Input("no rungs to choose from".into()));
    }
    for r in &opts.rungs {
        if !keep_artifacts::alloc::LABELS.contains(&r.as_str()) {
            return Err(QuantError::Input(format!(
                "unknown rung `{r}` (known: {})",
                keep_artifacts::alloc::LABELS.join(", ")
            )));
        }
    }
    let table = expert_table(&opts.model, &opts.run, &opts.reports, opts.saliency)?;
    let fp = table.model_fingerprint.clone();
    let mut mult: BTreeMap<&str, f64> = BTreeMap::new();
    if let Some(lm) = &opts.loss_model {
        if lm.model_fingerprint != fp {
            return Err(QuantError::Input(format!(
                "the loss model is of another model (fingerprint {}, the model's {fp})",
                lm.model_fingerprint
            )));
        }
        if lm.saliency != opts.saliency.label() {
            return Err(QuantError::Input(format!(
                "the loss model was fitted with saliency {}, the allocation asks for {}",
                lm.saliency,
                opts.saliency.label()
            )));
        }
        for r in &opts.rungs {
            if r == SHIPPED {
                continue;
            }
            if let Some(m) = lm.multipliers.get(r) {
                mult.insert(r, *m);
            } else if table.experts.iter().any(|e| e.unit_loss(r).is_some()) {
                return Err(QuantError::Input(format!(
                    "the loss model has no multiplier for rung `{r}`: fit it on a point that \
                     uses it, or leave it out of --rungs"
                )));
            }
        }
    }
    // bytes per rung, the same for every expert (checked)
    let mut costs = vec![];
    for r in &opts.rungs {
        costs.push(rung_bytes(&ck, 0, 0, r)?);
    }
    let mut items = vec![]; // (layer, expert)
    let mut losses = vec![];
    for e in &table.experts {
        let (l, j) = (e.layer, e.expert);
        for (r, &c) in opts.rungs.iter().zip(&costs) {
            let b = rung_bytes(&ck, l, j, r)?;
            if b != c {
                return Err(QuantError::Input(format!(
                    "expert {j} of layer {l} takes {b} bytes at {r}, expert 0 of layer 0 {c}: \
                     experts of different shapes are not supported"
                )));
            }
        }
        let row: Vec<Option<f64>> = opts
            .rungs
            .iter()
            .map(|r| {
                e.unit_loss(r)
                    .map(|v| v * mult.get(r.as_str()).copied().unwrap_or(1.0))
            })
            .collect();
        if let Some((r, v)) = opts
            .rungs
            .iter()
            .zip(&row)
            .find_map(|(r, v)| v.filter(|v| !(v.is_finite() && *v >= 0.0)).map(|v| (r, v)))
        {
            return Err(QuantError::Input(format!(
                "expert {j} of layer {l}: its loss at `{r}` is {v}, not a number ≥ 0 (from {}); \
                 give quant reports and REAP statistics of finite errors, or leave `{r}` out of --rungs",
                if r == PRUNED {
                    format!("the REAP statistics of {}", opts.run.display())
                } else {
                    let files: Vec<String> =
                        opts.reports.iter().map(|p| p.display().to_string()).collect();
                    format!("the quant reports {}", files.join(", "))
                }
            )));
        }
        if row.iter().all(Option::is_none) {
            return Err(QuantError::Input(format!(
                "expert {j} of layer {l} has none of the rungs {}: give the quant-report.json \
                 of a `keep quant` run that coded it (--quant-report), or allow `shipped`",
                opts.rungs.join(",")
            )));
        }
        items.push((l, j));
        losses.push(row);
    }
    let n_layers = table.n_layers;
    let (sol, name) = match opts.solver {
        Solver::Auto => (solve_exact(&costs, &losses, opts.budget, 0)?, "exact-mckp"),
        Solver::Exact { grain } => (
            solve_exact(&costs, &losses, opts.budget, grain)?,
            "exact-mckp",
        ),
        Solver::Greedy => (solve_greedy(&costs, &losses, opts.budget)?, "greedy-hull"),
    };
    let mut layers: Vec<LayerAlloc> = (0..n_layers)
        .map(|l| LayerAlloc {
            layer: l,
            rungs: vec![],
        })
        .collect();
    for (&(l, _), &r) in items.iter().zip(&sol.choice) {
        layers[l].rungs.push(opts.rungs[r].clone());
    }
    // The cheapest rung that keeps an expert: a budget with this much left over could have
    // kept one more, so raising it cannot help.
    let cheapest_kept = opts
        .rungs
        .iter()
        .zip(&costs)
        .filter(|(r, _)| *r != PRUNED)
        .map(|(_, &c)| c)
        .min();
    for la in &layers {
        let kept = la.rungs.iter().filter(|r| *r != PRUNED).count();
        if kept < table.top_k.min(la.rungs.len()) {
            let pruned_loss: f64 = items
                .iter()
                .zip(&sol.choice)
                .zip(&losses)
                .filter(|(((l, _), &r), _)| *l == la.layer && opts.rungs[r] == PRUNED)
                .map(|((_, &r), row)| row[r].unwrap_or(0.0))
                .sum();
            let slack = opts.budget.saturating_sub(sol.bytes);
            let budget_helps = pruned_loss > 0.0 && cheapest_kept.is_some_and(|c| slack < c);
            let advice = if budget_helps {
                "raise --budget or leave `pruned` out of --rungs".to_string()
            } else {
                format!(
                    "a larger budget would not keep them ({} bytes are left over, and pruning \
                     them costs {pruned_loss} of predicted loss); leave `pruned` out of --rungs",
                    slack
                )
            };
            return Err(QuantError::Input(format!(
                "the best allocation keeps {kept} experts of layer {}, fewer than top-k = {}: \
                 {advice}",
                la.layer, table.top_k
            )));
        }
    }
    let mut extra = BTreeMap::new();
    if let Some(lm) = &opts.loss_model {
        extra.insert(
            "loss_multipliers".to_string(),
            serde_json::to_value(&lm.multipliers)
                .map_err(|e| QuantError::Input(format!("loss model: {e}")))?,
        );
    }
    let a = Alloc {
        format: Alloc::FORMAT.into(),
        version: Alloc::VERSION,
        model: opts.model.display().to_string(),
        model_fingerprint: fp,
        budget_bytes: opts.budget,
        bytes: sol.bytes,
        rungs: opts
            .rungs
            .iter()
            .zip(&costs)
            .map(|(l, &c)| RungBytes {
                label: l.clone(),
                bytes_per_expert: c,
            })
            .collect(),
        solver: name.into(),
        grain_bytes: sol.grain,
        predicted_loss: sol.loss,
        saliency: opts.saliency.label().into(),
        layers,
        extra,
    };
    a.validate().map_err(QuantError::Input)?;
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Float sums of the same losses in another order: a few ulps.
    const SUM_TOL: f64 = 1e-9;

    fn brute(costs: &[u64], losses: &[Vec<Option<f64>>], budget: u64) -> Option<f64> {
        let nr = costs.len();
        let n = losses.len();
        let mut best: Option<f64> = None;
        for code in 0..nr.pow(n as u32) {
            let (mut c, mut bytes, mut loss) = (code, 0u64, 0f64);
            let mut ok = true;
            for l in losses {
                let r = c % nr;
                c /= nr;
                match l[r] {
                    Some(v) => {
                        bytes += costs[r];
                        loss += v;
                    }
                    None => ok = false,
                }
            }
            if ok && bytes <= budget && best.is_none_or(|b| loss < b) {
                best = Some(loss);
            }
        }
        best
    }

    #[test]
    fn solvers_against_brute_force() {
        let mut rng = keep_rng::rng(7);
        use keep_rng::Draw;
        for case in 0..300 {
            let nr = 2 + rng.below(3);
            let n = 1 + rng.below(6);
            let costs: Vec<u64> = (0..nr).map(|_| rng.below(40) as u64).collect();
            let losses: Vec<Vec<Option<f64>>> = (0..n)
                .map(|_| {
                    let mut row: Vec<Option<f64>> = (0..nr)
                        .map(|_| (rng.unit() > 0.15).then(|| rng.unit() * 10.0))
                        .collect();
                    if row.iter().all(Option::is_none) {
                        row[0] = Some(1.0);
                    }
                    row
                })
                .collect();
            let budget = rng.below(40 * n + 1) as u64;
            let want = brute(&costs, &losses, budget);
            let exact = solve_exact(&costs, &losses, budget, 1);
            let greedy = solve_greedy(&costs, &losses, budget);
            match want {
                None => {
                    assert!(exact.is_err(), "case {case}");
                    assert!(greedy.is_err(), "case {case}");
                }
                Some(w) => {
                    let e = exact.unwrap();
                    assert!(e.bytes <= budget, "case {case}");
                    assert!(
                        (e.loss - w).abs() <= SUM_TOL,
                        "case {case}: {} vs {w}",
                        e.loss
                    );
                    let g = greedy.unwrap();
                    assert!(g.bytes <= budget, "case {case}");
                    assert!(g.loss >= w - SUM_TOL, "case {case}");
                    // never worse than the optimum by more than one item's largest loss step
                    let step = losses
                        .iter()
                        .map(|l| {
                            let v: Vec<f64> = l.iter().flatten().copied().collect();
                            v.iter().cloned().fold(f64::MIN, f64::max)
                                - v.iter().cloned().fold(f64::MAX, f64::min)
                        })
                        .fold(0.0, f64::max);
                    assert!(g.loss <= w + step + SUM_TOL, "case {case}");
                }
            }
        }
    }

    #[test]
    fn a_coarse_grain_still_fits_the_budget() {
        let costs = [0u64, 10, 17, 30];
        let losses: Vec<Vec<Option<f64>>> = (0..20)
            .map(|i| vec![Some(1.0 + i as f64), Some(0.5), Some(0.2), Some(0.0)])
            .collect();
        for grain in [1, 2, 3, 7, 50] {
            let s = solve_exact(&costs, &losses, 300, grain).unwrap();
            assert!(s.bytes <= 300, "grain {grain}: {} bytes", s.bytes);
            assert!(s.grain >= grain);
        }
        let fine = solve_exact(&costs, &losses, 300, 1).unwrap();
        for grain in [2, 3, 7, 50] {
            let s = solve_exact(&costs, &losses, 300, grain).unwrap();
            assert!(s.loss >= fine.loss - SUM_TOL, "grain {grain}");
        }
    }

    fn terms(v: &[(&str, f64)]) -> BTreeMap<String, f64> {
        v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
    }

    /// A fit through points made by known multipliers recovers them to rounding.
    const FIT_TOL: f64 = 1e-9;

    #[test]
    fn multipliers_are_recovered_and_stay_non_negative() {
        let truth = terms(&[(PRUNED, 3.0), ("e8p2", 0.5), ("e8p2+e81", 0.8)]);
        let mut rng = keep_rng::rng(11);
        use keep_rng::Draw;
        let points: Vec<(BTreeMap<String, f64>, f64)> = (0..6)
            .map(|_| {
                let t = terms(&[
                    (PRUNED, rng.unit()),
                    ("e8p2", rng.unit()),
                    ("e8p2+e81", rng.unit()),
                ]);
                let kl = t.iter().map(|(k, v)| truth[k] * v).sum();
                (t, kl)
            })
            .collect();
        let m = fit_multipliers(&points).unwrap();
        for (k, v) in &truth {
            assert!((m[k] - v).abs() <= FIT_TOL * v, "{k}: {} vs {v}", m[k]);
        }
        // a rung whose best unconstrained fit is negative is held at zero
        let points = vec![
            (terms(&[("e8p2", 1.0), (PRUNED, 1.0)]), 1.0),
            (terms(&[("e8p2", 2.0), (PRUNED, 1.0)]), 0.5),
            (terms(&[("e8p2", 3.0), (PRUNED, 1.0)]), 0.4),
        ];
        let m = fit_multipliers(&points).unwrap();
        assert!(m.values().all(|&v| v >= 0.0), "{m:?}");
        assert_eq!(m["e8p2"], 0.0, "{m:?}");
        // too few points, a zero KL and indistinguishable rungs are refused
        assert!(fit_multipliers(&points[..1]).is_err());
        assert!(fit_multipliers(&[(terms(&[("e8p2", 1.0)]), 0.0)]).is_err());
        // points outside the fit's domain are refused, not fitted to a multiplier of 0
        for (t, kl) in [(1.0, 1e308), (1e300, 0.5), (f64::NAN, 0.5)] {
            let e = fit_multipliers(&[(terms(&[("e8p2", t)]), kl)])
                .unwrap_err()
                .to_string();
            assert!(e.contains("point 1"), "{e}");
        }
        let same = vec![
            (terms(&[("e8p2", 1.0), (PRUNED, 2.0)]), 1.0),
            (terms(&[("e8p2", 2.0), (PRUNED, 4.0)]), 2.0),
        ];
        // proportional terms: some subset still fits (one rung carries it all), never a NaN
        let m = fit_multipliers(&same).unwrap();
        assert!(m.values().all(|v| v.is_finite() && *v >= 0.0), "{m:?}");
    }
}
