//! `keep sidecar`: reduced-rank ridge sidecars that win back part of what pruning removes.
//!
//! For every MoE layer a plan prunes, a low-rank linear map from the block's input `x` to what
//! the removed experts contributed: `Y = teacher MoE(x) − pruned MoE(x)`, both evaluated at the
//! same `x`. The pruned model here is the teacher with the plan as a router mask and, on pruned
//! hash-routed layers, the plan's remap of `tid2eid` (what `keep prune` writes, so the pruned
//! checkpoint routes the same way).
//!
//! The fit is sequential: layer ℓ's inputs `x` are those of the pruned model with the sidecars
//! kept before ℓ already applied, so each map is fitted on the inputs it gets at run time
//! (the target is the layer's own MoE error at those inputs). Layer ℓ takes one pass over the calibration records through layers 0..=ℓ,
//! one record at a time; memory is one record's activations plus, per layer, the f64 sums
//! `XᵀX` and `XᵀY` (`hidden × hidden` each, for the fitting and for the validation rows), never
//! every activation.
//!
//! The solver ([`reduced_rank_ridge`]) is reduced-rank ridge regression, in f64 with `faer`:
//! `W = (XᵀX + λ'I)⁻¹ XᵀY` with `λ' = λ · tr(XᵀX) / hidden` (the ridge is relative to the
//! mean input energy, so one `λ` fits any model and token count), then the rank-r truncation
//! in the metric of the fitted values: with `V_r` the top-r eigenvectors of `Wᵀ (XᵀX) W`
//! (the right singular vectors of `X W`), `A = W V_r` (`hidden × r`) and `B = V_rᵀ`, so
//! `X A B` is the best rank-r approximation of `X W` (Eckart–Young). At `r = hidden` it is the
//! ridge solution itself.
//!
//! The fit is scored on rows it did not see: [`calibration_records`] holds a fifth of the
//! calibration split's groups (whole sources) out of the fit as validation records, and samples
//! both parts round-robin over their groups, so a token cap still covers every source. Per
//! layer the validation rows give the share of `Σ‖y‖²` the rank-r map explains there
//! ([`Rrr::explained_on`], from the validation sums `XᵀX`, `XᵀY`, `Σ‖y‖²` alone); `--ridge
//! auto` ([`Ridge::Auto`]) picks, per layer, the ridge of [`AUTO_RIDGES`] that explains the most
//! of them. A layer keeps its sidecar only where it explains part of them (> 0) and, with it,
//! the whole pruned student's mean KL(teacher‖student) on the validation records falls: energy
//! of the MoE output explained is not KL won (on the bundled model a first-layer sidecar that
//! explains over a quarter of its validation energy raises the KL), and the check costs two
//! whole-model passes over the validation records per layer.
//!
//! What it is not: no checkpoint writing (the CLI writes the pruned checkpoint with the
//! sidecars through keep-convert's prune), no model code (keep-model adds the sidecar term in
//! its MoE block, [`keep_model::sidecar`]).

use std::path::Path;

use faer::linalg::matmul::matmul;
use faer::linalg::solvers::Solve;
use faer::{Accum, Mat, Par, Side};
use keep_artifacts::plan::PrunePlan;
use keep_checkpoint::Checkpoint;
use keep_model::family_layer::applies_sidecars;
use keep_model::observer::{LinearInputEvent, RouteObserver};
use keep_model::{CheckpointExperts, ExpertSource, Logits, Model, ModelConfig, Sidecar};
use serde::Serialize;

use crate::{CalibError, Result};

/// The sums one layer's fit needs: `XᵀX`, `XᵀY` (f64, `hidden × hidden`), `Σ‖y‖²` and the row
/// count.
pub struct Gram {
    pub hidden: usize,
    pub rows: u64,
    pub xtx: Mat<f64>,
    pub xty: Mat<f64>,
    pub yy: f64,
}

impl Gram {
    /// Empty sums for `hidden` columns.
    pub fn new(hidden: usize) -> Gram {
        Gram {
            hidden,
            rows: 0,
            xtx: Mat::zeros(hidden, hidden),
            xty: Mat::zeros(hidden, hidden),
            yy: 0.0,
        }
    }

    /// Add `rows` rows of inputs `x` and targets `y` (each `[rows × hidden]`, row-major).
    pub fn add(&mut self, x: &[f32], y: &[f32], rows: usize) -> Result<()> {
        let d = self.hidden;
        if x.len() != rows * d || y.len() != rows * d {
            return Err(CalibError::Options(format!(
                "sidecar sums: {rows} rows of {d} need {} numbers each; got {} and {}",
                rows * d,
                x.len(),
                y.len()
            )));
        }
        let xm = Mat::<f64>::from_fn(rows, d, |i, j| x[i * d + j] as f64);
        let ym = Mat::<f64>::from_fn(rows, d, |i, j| y[i * d + j] as f64);
        matmul(
            self.xtx.as_mut(),
            Accum::Add,
            xm.transpose(),
            xm.as_ref(),
            1.0,
            Par::Seq,
        );
        matmul(
            self.xty.as_mut(),
            Accum::Add,
            xm.transpose(),
            ym.as_ref(),
            1.0,
            Par::Seq,
        );
        self.yy += y.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
        self.rows += rows as u64;
        Ok(())
    }
}

/// A reduced-rank ridge solution: `Ŷ = X A B`.
pub struct Rrr {
    pub hidden: usize,
    pub rank: usize,
    /// `[hidden × rank]`, row-major.
    pub a: Vec<f64>,
    /// `[rank × hidden]`, row-major.
    pub b: Vec<f64>,
    /// The absolute ridge added to the diagonal of `XᵀX`.
    pub ridge_abs: f64,
    /// Fraction of `Σ‖y‖²` the full-rank ridge fit explains on the fitted rows.
    pub explained_full: f64,
    /// Fraction of `Σ‖y‖²` the rank-r fit explains on the fitted rows.
    pub explained: f64,
}

impl Rrr {
    /// The sidecar (f32) of this solution: stored `A` is `Aᵀ` `[rank × hidden]`, stored `B` is
    /// `Bᵀ` `[hidden × rank]` (the `[out, in]` layout of a linear weight).
    pub fn sidecar(&self) -> Result<Sidecar> {
        let (d, r) = (self.hidden, self.rank);
        let at: Vec<f32> = (0..r * d)
            .map(|k| self.a[(k % d) * r + k / d] as f32)
            .collect();
        let bt: Vec<f32> = (0..d * r)
            .map(|k| self.b[(k % r) * d + k / r] as f32)
            .collect();
        Ok(Sidecar::new(d, r, &at, &bt)?)
    }
}

impl Rrr {
    /// Fraction of `Σ‖y‖²` of the rows summed in `g` that `X A B` explains:
    /// `1 − Σ‖y − x A B‖² / Σ‖y‖²` (from the sums: `Σ‖y‖² − 2 tr(Ŵᵀ XᵀY) + tr(Ŵᵀ XᵀX Ŵ)`). On rows
    /// the fit did not see it is a held-out score: ≤ 0 when adding the map to the pruned output
    /// leaves it no closer to the teacher's than leaving it out.
    pub fn explained_on(&self, g: &Gram) -> Result<f64> {
        let (d, r) = (self.hidden, self.rank);
        if g.hidden != d {
            return Err(CalibError::Options(format!(
                "a sidecar over hidden size {d} scored on sums of hidden size {}",
                g.hidden
            )));
        }
        if g.yy <= 0.0 {
            return Ok(0.0);
        }
        let a = Mat::<f64>::from_fn(d, r, |i, k| self.a[i * r + k]);
        let b = Mat::<f64>::from_fn(r, d, |k, j| self.b[k * d + j]);
        let w = &a * &b;
        let gw = &g.xtx * &w;
        let (mut cross, mut quad) = (0.0, 0.0);
        for j in 0..d {
            for i in 0..d {
                cross += w[(i, j)] * g.xty[(i, j)];
                quad += w[(i, j)] * gw[(i, j)];
            }
        }
        Ok(1.0 - (g.yy - 2.0 * cross + quad) / g.yy)
    }
}

/// Reduced-rank ridge regression from the sums of `g` (see the module doc). `rank` is clamped
/// to `hidden`; `ridge` is relative (`λ' = ridge · tr(XᵀX) / hidden`) and must be ≥ 0.
pub fn reduced_rank_ridge(g: &Gram, rank: usize, ridge: f64) -> Result<Rrr> {
    let d = g.hidden;
    if rank == 0 || !(ridge.is_finite() && ridge >= 0.0) {
        return Err(CalibError::Options(format!(
            "reduced-rank ridge needs rank ≥ 1 and a finite ridge ≥ 0 (got rank {rank}, ridge {ridge})"
        )));
    }
    let r = rank.min(d);
    let tr: f64 = (0..d).map(|i| g.xtx[(i, i)]).sum();
    if g.rows == 0 || !(tr > 0.0 && tr.is_finite()) {
        return Err(CalibError::Options(format!(
            "no input energy to fit a sidecar on ({} rows, tr(XᵀX) = {tr})",
            g.rows
        )));
    }
    let ridge_abs = ridge * tr / d as f64;
    let mut gl = g.xtx.clone();
    for i in 0..d {
        gl[(i, i)] += ridge_abs;
    }
    let llt = gl.llt(Side::Lower).map_err(|e| {
        CalibError::Options(format!(
            "XᵀX + λI is not positive definite ({e:?}): raise --ridge above {ridge}"
        ))
    })?;
    let w = llt.solve(&g.xty);
    // M = Wᵀ (XᵀX) W: its eigenvectors are the right singular vectors of X W.
    let gw = &g.xtx * &w;
    let m = w.transpose() * &gw;
    let ms = Mat::<f64>::from_fn(d, d, |i, j| 0.5 * (m[(i, j)] + m[(j, i)]));
    let evd = ms
        .self_adjoint_eigen(Side::Lower)
        .map_err(|e| CalibError::Options(format!("eigendecomposition failed: {e:?}")))?;
    let (u, s) = (evd.U(), evd.S());
    // Eigenvalues ascend: the top r are the last r columns, taken largest first.
    let cols: Vec<usize> = (0..r).map(|k| d - 1 - k).collect();
    let v = Mat::<f64>::from_fn(d, r, |i, k| u[(i, cols[k])]);
    let a = &w * &v;
    // Σ‖y − ŷ‖² = Σ‖y‖² − 2 tr(Ŵᵀ XᵀY) + tr(Ŵᵀ XᵀX Ŵ).
    let resid = |wh: &Mat<f64>, quad: f64| -> f64 {
        let mut cross = 0.0;
        for j in 0..d {
            for i in 0..d {
                cross += wh[(i, j)] * g.xty[(i, j)];
            }
        }
        g.yy - 2.0 * cross + quad
    };
    let quad_full: f64 = (0..d).map(|k| s[k]).sum();
    let quad_r: f64 = cols.iter().map(|&k| s[k]).sum();
    let wr = &a * v.transpose();
    let frac = |e: f64| {
        if g.yy > 0.0 {
            1.0 - e / g.yy
        } else {
            0.0
        }
    };
    let explained_full = frac(resid(&w, quad_full));
    let explained = frac(resid(&wr, quad_r));
    Ok(Rrr {
        hidden: d,
        rank: r,
        a: (0..d * r).map(|k| a[(k / r, k % r)]).collect(),
        b: (0..r * d).map(|k| v[(k % d, k / d)]).collect(),
        ridge_abs,
        explained_full,
        explained,
    })
}

/// The relative ridges `--ridge auto` tries, per layer.
pub const AUTO_RIDGES: [f64; 7] = [1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0];

/// How a layer's ridge is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Ridge {
    /// This relative ridge on every layer (see the module doc).
    Relative(f64),
    /// Per layer, the one of [`AUTO_RIDGES`] whose rank-r fit explains the most of the
    /// validation rows (needs validation records).
    Auto,
}

/// Options of [`fit`].
#[derive(Debug, Clone)]
pub struct SidecarOptions {
    pub rank: usize,
    pub ridge: Ridge,
}

/// One layer's fit.
#[derive(Debug, Clone, Serialize)]
pub struct LayerFit {
    pub layer: usize,
    pub rows: u64,
    /// Rows of the validation records (0: none).
    pub validation_rows: u64,
    pub rank: usize,
    /// The relative ridge used (chosen per layer by `--ridge auto`).
    pub ridge: f64,
    pub ridge_abs: f64,
    /// Mean `‖y‖²` per row: the energy of what the removed experts contributed.
    pub y_energy: f64,
    /// Fraction of `Σ‖y‖²` explained on the calibration rows, full-rank ridge and rank r.
    pub explained_full: f64,
    pub explained: f64,
    /// Fraction of `Σ‖y‖²` the rank-r sidecar explains on the validation rows (held out of
    /// the fit); `None` without validation records.
    pub explained_validation: Option<f64>,
    /// Mean KL(teacher‖student) per position on the validation records, of the whole pruned
    /// student with the sidecars kept before this layer, without and with this layer's (`None`:
    /// not measured: no validation records, or the sidecar explains nothing of them).
    pub validation_kl_without: Option<f64>,
    pub validation_kl_with: Option<f64>,
    /// Whether the sidecar is kept: only where it explains some of the validation rows
    /// (`explained_validation > 0`) and lowers the validation KL (`validation_kl_with <
    /// validation_kl_without`); without validation records, always.
    pub kept: bool,
}

/// What [`fit`] found: a sidecar per decoder layer (`None` where the plan prunes nothing, or
/// where the sidecar did not help on the validation rows).
pub struct SidecarFit {
    pub sidecars: Vec<Option<Sidecar>>,
    /// Every pruned layer's fitted map, kept or not (`None` where the plan prunes nothing).
    pub fitted: Vec<Option<Sidecar>>,
    pub layers: Vec<LayerFit>,
    /// Tokens fitted on, and validated on.
    pub tokens: u64,
    pub validation_tokens: u64,
}

/// Collects the MoE block input of one layer (the router's input rows).
struct MoeInput {
    layer: usize,
    x: Vec<f32>,
}

impl RouteObserver for MoeInput {
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        if ev.layer == self.layer && ev.name == "ffn.gate" && ev.expert.is_none() {
            self.x.extend_from_slice(&ev.x[..ev.rows * ev.cols]);
        }
    }
}

/// The records a fit uses: `fit` to sum the regression over, `validation` (other groups of the
/// same split) to score it on rows it did not see.
#[derive(Debug, Clone, Default)]
pub struct FitRecords {
    pub fit: Vec<Vec<u32>>,
    pub validation: Vec<Vec<u32>>,
}

/// Every calibration group whose index is `VALIDATION_EVERY − 1` modulo this is a validation
/// group (a fifth of the groups), when the split has at least two groups.
pub const VALIDATION_EVERY: usize = 5;

/// Records of `groups` taken round-robin (the first record of every group, then the second …)
/// up to `cap` tokens (whole records; `None`: all): the cap samples every group, not the first
/// few sources of the pack.
fn round_robin(pack: &crate::pack::Pack, groups: &[&str], cap: Option<usize>) -> Vec<Vec<u32>> {
    let per: Vec<Vec<&crate::pack::Record>> = groups
        .iter()
        .map(|g| pack.records_of(g).collect())
        .collect();
    let depth = per.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = vec![];
    let mut total = 0usize;
    for i in 0..depth {
        for recs in &per {
            let Some(r) = recs.get(i) else { continue };
            if cap.is_some_and(|c| total >= c) {
                return out;
            }
            total += r.tokens.len();
            out.push(r.tokens.clone());
        }
    }
    out
}

/// The calibration-split records of `pack` to fit on and to validate on. With at least two
/// calibration groups, every [`VALIDATION_EVERY`]-th group (at least one) is held out of the
/// fit for validation; the fit takes up to `max_tokens` tokens and the validation up to a
/// quarter of that (whole records, round-robin over the groups; `None`: all). `run` (a
/// calibration run directory, either split) must have been made from this pack and from the
/// teacher `model`: it names the data the plan was chosen on, and the fit uses the same pack's
/// calibration split, never its held-out records.
pub fn calibration_records(
    run: &Path,
    pack: &crate::pack::Pack,
    model: &Path,
    max_tokens: Option<usize>,
) -> Result<FitRecords> {
    let m = crate::calibrate::RunManifest::read(run)?;
    if m.pack_fingerprint != pack.fingerprint {
        return Err(CalibError::Mismatch(format!(
            "{} was made from another pack (fingerprint {}) than {} ({}); pass the pack it was made from with --pack",
            run.display(),
            crate::fingerprint::short(&m.pack_fingerprint),
            pack.dir.display(),
            crate::fingerprint::short(&pack.fingerprint)
        )));
    }
    let fp = crate::fingerprint::model_fingerprint(model)?;
    if m.model_fingerprint != fp {
        return Err(CalibError::Mismatch(format!(
            "{} was made with the model of fingerprint {}, but {} has {}: pass the teacher the run was made with",
            run.display(),
            crate::fingerprint::short(&m.model_fingerprint),
            model.display(),
            crate::fingerprint::short(&fp)
        )));
    }
    let groups: Vec<&str> = pack
        .groups(crate::pack::Split::Calibration)
        .into_iter()
        .map(|g| g.id.as_str())
        .collect();
    let held = |i: usize| {
        groups.len() >= 2
            && (i % VALIDATION_EVERY == VALIDATION_EVERY - 1
                || (groups.len() < VALIDATION_EVERY && i == groups.len() - 1))
    };
    let (mut fit_groups, mut val_groups) = (vec![], vec![]);
    for (i, &g) in groups.iter().enumerate() {
        if held(i) {
            val_groups.push(g);
        } else {
            fit_groups.push(g);
        }
    }
    let out = FitRecords {
        fit: round_robin(pack, &fit_groups, max_tokens),
        validation: round_robin(pack, &val_groups, max_tokens.map(|c| (c / 4).max(1))),
    };
    if out.fit.iter().all(|r| r.is_empty()) {
        return Err(CalibError::Mismatch(format!(
            "{} has no calibration-split tokens to fit sidecars on",
            pack.dir.display()
        )));
    }
    Ok(out)
}

/// Check that `plan` fits the model `cfg` of `model` (made for it, every layer it prunes of the
/// plan's expert count).
pub fn check_plan(
    ck: &Checkpoint,
    model: &Path,
    cfg: &ModelConfig,
    plan: &PrunePlan,
) -> Result<()> {
    let n_mtp = ck.require_config()?.num_nextn_predict_layers;
    plan.validate().map_err(CalibError::Mismatch)?;
    plan.check_model(model, cfg.n_layers, n_mtp)?;
    if let Some(l) = (0..cfg.n_layers)
        .find(|&l| plan.survivors(l).is_some() && cfg.experts_in_layer(l) != plan.n_experts)
    {
        return Err(CalibError::Mismatch(format!(
            "the plan prunes layer {l} as a layer of {} experts; {} has {} there",
            plan.n_experts,
            model.display(),
            cfg.experts_in_layer(l)
        )));
    }
    Ok(())
}

/// The sums of one layer `l` of `student` (the pruned model up to `l`) over `records`: the MoE
/// block's input rows `x` and `y = teacher MoE(x) − pruned MoE(x)`, both at the student's `x`.
#[allow(clippy::too_many_arguments)]
fn layer_sums(
    cfg: &ModelConfig,
    student: &Model,
    teacher: &keep_model::layer::LayerWeights,
    experts: &dyn ExpertSource,
    mask: Option<&[bool]>,
    l: usize,
    records: &[Vec<u32>],
    progress: &mut dyn FnMut(usize),
) -> Result<Gram> {
    let d = cfg.dim;
    let mut g = Gram::new(d);
    for r in records {
        if !r.is_empty() {
            let mut obs = MoeInput {
                layer: l,
                x: Vec::with_capacity(r.len() * d),
            };
            let mut cache = student.new_cache();
            student.forward(r, &mut cache, Logits::None, Some(&mut obs))?;
            if obs.x.len() != r.len() * d {
                return Err(CalibError::Mismatch(format!(
                    "layer {l}: the forward reported {} MoE input numbers for {} tokens",
                    obs.x.len(),
                    r.len()
                )));
            }
            let yt = teacher.moe_output(cfg, experts, None, &obs.x, r)?;
            let yp = student.layers[l].moe_output(cfg, experts, mask, &obs.x, r)?;
            let y: Vec<f32> = yt.iter().zip(&yp).map(|(t, p)| t - p).collect();
            g.add(&obs.x, &y, r.len())?;
        }
        progress(1);
    }
    Ok(g)
}

/// Mean KL(teacher‖student) per position over the whole vocabulary, on `records`: the
/// student is `model` with `masks`, `tables` and `sidecars` set, the teacher `model` as it is.
fn validation_kl(
    ck: &Checkpoint,
    masks: &[Option<Vec<bool>>],
    tables: &[Option<keep_model::hash::HashTable>],
    sidecars: &[Option<Sidecar>],
    records: &[Vec<u32>],
) -> Result<f64> {
    let teacher = Model::load(ck)?;
    let mut student = Model::load(ck)?;
    for (k, m) in masks.iter().enumerate() {
        student.set_router_mask(k, m.clone())?;
    }
    for (k, t) in tables.iter().enumerate() {
        if let Some(t) = t {
            student.set_hash_table(k, t.clone())?;
        }
    }
    for (lw, sc) in student.layers.iter_mut().zip(sidecars) {
        lw.sidecar = sc.clone();
    }
    let v = teacher.cfg.vocab;
    let (mut kl, mut n) = (0f64, 0usize);
    for r in records.iter().filter(|r| !r.is_empty()) {
        let lt = teacher.forward(r, &mut teacher.new_cache(), Logits::All, None)?;
        let ls = student.forward(r, &mut student.new_cache(), Logits::All, None)?;
        for (a, b) in lt.chunks_exact(v).zip(ls.chunks_exact(v)) {
            let (p, q) = (
                crate::eval_metrics::log_softmax(a),
                crate::eval_metrics::log_softmax(b),
            );
            kl += p
                .iter()
                .zip(&q)
                .map(|(p, q)| p.exp() * (p - q))
                .sum::<f64>();
            n += 1;
        }
    }
    Ok(kl / n.max(1) as f64)
}

/// Fit the sidecars of `plan` on `model` (the teacher) from `records`, sequentially (see the
/// module doc). `progress(layer, records_done, records_total)` is called per record.
pub fn fit(
    model: &Path,
    plan: &PrunePlan,
    records: &FitRecords,
    opts: &SidecarOptions,
    progress: &mut dyn FnMut(usize, usize, usize),
) -> Result<SidecarFit> {
    let ck = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_checkpoint(&ck)?;
    if !applies_sidecars(cfg.family) {
        return Err(CalibError::Mismatch(format!(
            "{} is a `{}` model, whose layers carry no sidecars: sidecars are fitted and applied on DeepSeek-V4.1 / V4 models",
            model.display(),
            cfg.raw.model_type
        )));
    }
    if let Some(t) = ck.tensors().find(|t| t.name.contains(".ffn.sidecar.")) {
        return Err(CalibError::Mismatch(format!(
            "{} already has sidecars ({}): fit them on the unpruned teacher checkpoint",
            model.display(),
            t.name
        )));
    }
    check_plan(&ck, model, &cfg, plan)?;
    if opts.rank == 0 {
        return Err(CalibError::Options("--rank must be at least 1".into()));
    }
    if let Ridge::Relative(r) = opts.ridge {
        if !(r.is_finite() && r >= 0.0) {
            return Err(CalibError::Options(format!(
                "--ridge must be a finite number ≥ 0 or auto (got {r})"
            )));
        }
    }
    if records.fit.iter().all(|r| r.is_empty()) {
        return Err(CalibError::Options(
            "no calibration tokens to fit sidecars on".into(),
        ));
    }
    if opts.ridge == Ridge::Auto && records.validation.iter().all(|r| r.is_empty()) {
        return Err(CalibError::Options(
            "--ridge auto chooses the ridge on validation records, and there are none (the pack's calibration split needs at least two groups): pass --ridge with a number"
                .into(),
        ));
    }
    let masks: Vec<Option<Vec<bool>>> = (0..cfg.n_layers).map(|l| plan.pruned_mask(l)).collect();
    let tables = crate::eval::remapped_tables(&ck, &cfg, plan)?;
    let experts = CheckpointExperts::new(&ck, &cfg)?;
    let src = &experts as &dyn ExpertSource;
    let mut sidecars: Vec<Option<Sidecar>> = vec![None; cfg.n_layers];
    let mut fitted: Vec<Option<Sidecar>> = vec![None; cfg.n_layers];
    let mut layers = vec![];
    let count = |rs: &[Vec<u32>]| rs.iter().map(|r| r.len() as u64).sum::<u64>();
    let n_records = records.fit.len() + records.validation.len();
    // The student's validation KL with the sidecars kept so far (once measured).
    let mut kl_now: Option<f64> = None;
    for l in (0..cfg.n_layers).filter(|&l| masks[l].is_some()) {
        // The pruned model up to layer l, with the sidecars fitted so far.
        let mut student = Model::load(&ck)?;
        for (k, m) in masks.iter().enumerate() {
            student.set_router_mask(k, m.clone())?;
        }
        for (k, t) in tables.iter().enumerate() {
            if let Some(t) = t {
                student.set_hash_table(k, t.clone())?;
            }
        }
        for (lw, sc) in student.layers.iter_mut().zip(&sidecars) {
            lw.sidecar = sc.clone();
        }
        student.layers.truncate(l + 1);
        let teacher = keep_model::layer::LayerWeights::load(&ck, &cfg, l)?;
        let mut done = 0;
        let mut tick = |n: usize| {
            done += n;
            progress(l, done, n_records);
        };
        let mask = masks[l].as_deref();
        let g = layer_sums(
            &cfg,
            &student,
            &teacher,
            src,
            mask,
            l,
            &records.fit,
            &mut tick,
        )?;
        let gv = layer_sums(
            &cfg,
            &student,
            &teacher,
            src,
            mask,
            l,
            &records.validation,
            &mut tick,
        )?;
        let (ridge, sol) = match opts.ridge {
            Ridge::Relative(r) => (r, reduced_rank_ridge(&g, opts.rank, r)?),
            Ridge::Auto => {
                let mut best: Option<(f64, Rrr, f64)> = None;
                for r in AUTO_RIDGES {
                    // A ridge too small for XᵀX to factor is no candidate.
                    let Ok(sol) = reduced_rank_ridge(&g, opts.rank, r) else {
                        continue;
                    };
                    let e = sol.explained_on(&gv)?;
                    if best.as_ref().is_none_or(|b| e > b.2) {
                        best = Some((r, sol, e));
                    }
                }
                let (r, sol, _) = best.ok_or_else(|| {
                    CalibError::Options(format!(
                        "layer {l}: no ridge of {AUTO_RIDGES:?} gives a positive definite XᵀX + λI"
                    ))
                })?;
                (r, sol)
            }
        };
        let explained_validation = match gv.rows {
            0 => None,
            _ => Some(sol.explained_on(&gv)?),
        };
        // Kept where it explains some of the validation rows and, with it, the whole student's
        // validation KL to the teacher falls.
        let mut kept = explained_validation.is_none_or(|e| e > 0.0);
        let mut kl_with = None;
        if kept && gv.rows > 0 {
            let mut trial = sidecars.clone();
            trial[l] = Some(sol.sidecar()?);
            let before = match kl_now {
                Some(k) => k,
                None => validation_kl(&ck, &masks, &tables, &sidecars, &records.validation)?,
            };
            let after = validation_kl(&ck, &masks, &tables, &trial, &records.validation)?;
            kl_now = Some(before);
            kl_with = Some(after);
            kept = after < before;
        }
        let kl_without = kl_now;
        fitted[l] = Some(sol.sidecar()?);
        if kept {
            sidecars[l] = fitted[l].clone();
            if kl_with.is_some() {
                kl_now = kl_with;
            }
        }
        layers.push(LayerFit {
            layer: l,
            rows: g.rows,
            validation_rows: gv.rows,
            rank: sol.rank,
            ridge,
            ridge_abs: sol.ridge_abs,
            y_energy: g.yy / g.rows.max(1) as f64,
            explained_full: sol.explained_full,
            explained: sol.explained,
            explained_validation,
            validation_kl_without: kl_without,
            validation_kl_with: kl_with,
            kept,
        });
    }
    Ok(SidecarFit {
        sidecars,
        fitted,
        layers,
        tokens: count(&records.fit),
        validation_tokens: count(&records.validation),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
    }

    /// A random problem: X `[n × d]` with uneven column scales, Y = X W₀ + noise with W₀ of
    /// decaying spectrum.
    fn problem(n: usize, d: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng(seed);
        let scale: Vec<f64> = (0..d).map(|j| 1.0 + j as f64 / 2.0).collect();
        let x: Vec<f32> = (0..n * d)
            .map(|k| (rng.f() * scale[k % d]) as f32)
            .collect();
        let u: Vec<f64> = (0..d * d).map(|_| rng.f()).collect();
        let w0: Vec<f64> = (0..d * d)
            .map(|k| u[k] * 0.7f64.powi((k % d) as i32))
            .collect();
        let mut y = vec![0f32; n * d];
        for i in 0..n {
            for j in 0..d {
                let mut s = 0.0;
                for k in 0..d {
                    s += x[i * d + k] as f64 * w0[k * d + j];
                }
                y[i * d + j] = (s + 0.1 * rng.f()) as f32;
            }
        }
        (x, y)
    }

    fn gram(x: &[f32], y: &[f32], n: usize, d: usize) -> Gram {
        let mut g = Gram::new(d);
        // In two parts, as records arrive.
        let h = n / 3;
        g.add(&x[..h * d], &y[..h * d], h).unwrap();
        g.add(&x[h * d..], &y[h * d..], n - h).unwrap();
        g
    }

    /// Ridge regression by Gaussian elimination with partial pivoting on the normal equations,
    /// sums taken straight from the rows: independent of faer.
    fn ridge_direct(x: &[f32], y: &[f32], n: usize, d: usize, lam_rel: f64) -> Vec<f64> {
        let mut a = vec![0f64; d * d];
        let mut c = vec![0f64; d * d];
        for i in 0..n {
            for p in 0..d {
                let xp = x[i * d + p] as f64;
                for q in 0..d {
                    a[p * d + q] += xp * x[i * d + q] as f64;
                    c[p * d + q] += xp * y[i * d + q] as f64;
                }
            }
        }
        let tr: f64 = (0..d).map(|i| a[i * d + i]).sum();
        for i in 0..d {
            a[i * d + i] += lam_rel * tr / d as f64;
        }
        for col in 0..d {
            let piv = (col..d)
                .max_by(|&i, &j| a[i * d + col].abs().total_cmp(&a[j * d + col].abs()))
                .unwrap();
            for k in 0..d {
                a.swap(col * d + k, piv * d + k);
                c.swap(col * d + k, piv * d + k);
            }
            for row in 0..d {
                if row != col {
                    let f = a[row * d + col] / a[col * d + col];
                    for k in 0..d {
                        a[row * d + k] -= f * a[col * d + k];
                        c[row * d + k] -= f * c[col * d + k];
                    }
                }
            }
        }
        (0..d * d).map(|k| c[k] / a[(k / d) * d + k / d]).collect()
    }

    fn product(a: &[f64], b: &[f64], d: usize, r: usize) -> Vec<f64> {
        let mut w = vec![0f64; d * d];
        for i in 0..d {
            for k in 0..r {
                for j in 0..d {
                    w[i * d + j] += a[i * r + k] * b[k * d + j];
                }
            }
        }
        w
    }

    /// ‖X W − X Ŵ‖²_F over the rows.
    fn fit_gap(x: &[f32], n: usize, d: usize, w: &[f64], wh: &[f64]) -> f64 {
        let mut e = 0.0;
        for i in 0..n {
            for j in 0..d {
                let mut s = 0.0;
                for k in 0..d {
                    s += x[i * d + k] as f64 * (w[k * d + j] - wh[k * d + j]);
                }
                e += s * s;
            }
        }
        e
    }

    #[test]
    fn full_rank_is_ridge_regression() {
        let (n, d) = (300, 12);
        let (x, y) = problem(n, d, 7);
        let g = gram(&x, &y, n, d);
        for lam in [0.0, 1e-2, 0.5] {
            let sol = reduced_rank_ridge(&g, d, lam).unwrap();
            let w = product(&sol.a, &sol.b, d, d);
            let want = ridge_direct(&x, &y, n, d, lam);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (a, b) in w.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-8 * scale, "λ {lam}: {a} vs {b}");
            }
            assert!((sol.explained - sol.explained_full).abs() < 1e-9);
        }
        // A rank above hidden is clamped to hidden.
        assert_eq!(reduced_rank_ridge(&g, d + 5, 0.1).unwrap().rank, d);
    }

    #[test]
    fn rank_r_is_the_best_rank_r_fit_of_the_ridge_predictions() {
        let (n, d, lam) = (400, 10, 1e-3);
        let (x, y) = problem(n, d, 11);
        let g = gram(&x, &y, n, d);
        let w = ridge_direct(&x, &y, n, d, lam);
        // Eckart–Young on the fitted values X W themselves (singular values from their own
        // SVD): the rank-r gap is the sum of the trailing squared singular values.
        let xw = Mat::<f64>::from_fn(n, d, |i, j| {
            (0..d).map(|k| x[i * d + k] as f64 * w[k * d + j]).sum()
        });
        let sv = xw.singular_values().unwrap();
        let mut sq: Vec<f64> = sv.iter().map(|s| s * s).collect();
        sq.sort_by(|a, b| b.total_cmp(a));
        for r in [1, 3, 6] {
            let sol = reduced_rank_ridge(&g, r, lam).unwrap();
            let wr = product(&sol.a, &sol.b, d, r);
            let gap = fit_gap(&x, n, d, &w, &wr);
            let bound: f64 = sq[r..].iter().sum();
            assert!(
                (gap - bound).abs() <= 1e-6 * sq[0],
                "rank {r}: gap {gap} vs Eckart–Young {bound}"
            );
            // Truncating W by its own SVD (ignoring the input metric) does worse here.
            let wm = Mat::<f64>::from_fn(d, d, |i, j| w[i * d + j]);
            let svd = wm.svd().unwrap();
            let naive = Mat::<f64>::from_fn(d, d, |i, j| {
                (0..r)
                    .map(|k| svd.U()[(i, k)] * svd.S()[k] * svd.V()[(j, k)])
                    .sum()
            });
            let naive: Vec<f64> = (0..d * d).map(|k| naive[(k / d, k % d)]).collect();
            assert!(fit_gap(&x, n, d, &w, &naive) > gap * (1.0 + 1e-6));
            // And any nearby rank-r pair does no better.
            let mut rng = Rng(r as u64 + 3);
            for _ in 0..5 {
                let a2: Vec<f64> = sol.a.iter().map(|v| v + 1e-3 * rng.f()).collect();
                let b2: Vec<f64> = sol.b.iter().map(|v| v + 1e-3 * rng.f()).collect();
                assert!(fit_gap(&x, n, d, &w, &product(&a2, &b2, d, r)) >= gap);
            }
            // The training fit improves with rank and never passes the full ridge fit.
            assert!(sol.explained <= sol.explained_full + 1e-12);
        }
    }

    #[test]
    fn the_sidecar_applies_x_a_b() {
        let (n, d, r) = (50, 8, 3);
        let (x, y) = problem(n, d, 5);
        let sol = reduced_rank_ridge(&gram(&x, &y, n, d), r, 1e-2).unwrap();
        let sc = sol.sidecar().unwrap();
        let mut out = vec![1f32; n * d];
        sc.add_to(&x, n, &mut out).unwrap();
        let w = product(&sol.a, &sol.b, d, r);
        for i in 0..n {
            for j in 0..d {
                let want: f64 = 1.0
                    + (0..d)
                        .map(|k| x[i * d + k] as f64 * w[k * d + j])
                        .sum::<f64>();
                assert!((out[i * d + j] as f64 - want).abs() < 1e-4 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn explained_on_scores_rows_the_fit_did_not_see() {
        let (n, d, r) = (500, 9, 4);
        let (x, y) = problem(n, d, 13);
        let fit_rows = 300;
        let g = gram(&x[..fit_rows * d], &y[..fit_rows * d], fit_rows, d);
        let sol = reduced_rank_ridge(&g, r, 1e-2).unwrap();
        // On its own rows: what the fit reports.
        assert!((sol.explained_on(&g).unwrap() - sol.explained).abs() < 1e-9);
        // On the other rows: 1 − Σ‖y − x A B‖² / Σ‖y‖², row by row.
        let held = gram(&x[fit_rows * d..], &y[fit_rows * d..], n - fit_rows, d);
        let w = product(&sol.a, &sol.b, d, r);
        let (mut e, mut yy) = (0.0, 0.0);
        for i in fit_rows..n {
            for j in 0..d {
                let p: f64 = (0..d).map(|k| x[i * d + k] as f64 * w[k * d + j]).sum();
                e += (y[i * d + j] as f64 - p).powi(2);
                yy += (y[i * d + j] as f64).powi(2);
            }
        }
        let got = sol.explained_on(&held).unwrap();
        assert!(
            (got - (1.0 - e / yy)).abs() < 1e-9,
            "{got} vs {}",
            1.0 - e / yy
        );
        // Targets the inputs cannot predict: the held-out score is below zero.
        let noise: Vec<f32> = {
            let mut rng = Rng(99);
            (0..n * d).map(|_| rng.f() as f32).collect()
        };
        let g = gram(&x[..fit_rows * d], &noise[..fit_rows * d], fit_rows, d);
        let sol = reduced_rank_ridge(&g, d, 0.0).unwrap();
        assert!(sol.explained > 0.0);
        let held = gram(&x[fit_rows * d..], &noise[fit_rows * d..], n - fit_rows, d);
        assert!(sol.explained_on(&held).unwrap() < 0.0);
        assert!(sol.explained_on(&Gram::new(d + 1)).is_err());
    }

    #[test]
    fn refusals() {
        let g = Gram::new(4);
        assert!(reduced_rank_ridge(&g, 2, 0.1).is_err(), "no rows");
        let (x, y) = problem(20, 4, 1);
        let g = gram(&x, &y, 20, 4);
        assert!(reduced_rank_ridge(&g, 0, 0.1).is_err());
        assert!(reduced_rank_ridge(&g, 2, -1.0).is_err());
        assert!(reduced_rank_ridge(&g, 2, f64::NAN).is_err());
        let mut g2 = Gram::new(4);
        assert!(g2.add(&x[..7], &y[..8], 2).is_err());
    }
}
