//! `keep eval`: score a model — and router-masked students of it — against a teacher run.
//!
//! The teacher is an eval-split calibration run (`keep calibrate --split eval`): per record its
//! top-64 log-probs and the log-prob of the true next token (see [`crate::session`]). The
//! records' tokens come from the pack the run was made from (checked by fingerprint). Each
//! student is the model with an optional [`PrunePlan`] applied as a router mask (pruned experts
//! can never be chosen; the survivors' weights are renormalised by the model's own router) and,
//! on pruned hash-routed layers, the plan's remap of `tid2eid` ([`remapped_tables`]) — no
//! checkpoint is written. A pruned checkpoint can be scored too, by passing it as the model.
//! Metrics are in [`crate::eval_metrics`]; a plot draws KL against experts kept.

use std::path::{Path, PathBuf};

use keep_artifacts::hashremap::remap_table;
use keep_artifacts::plan::PrunePlan;
use keep_checkpoint::Checkpoint;
use keep_model::engram::{EngramUse, EngramUseReport};
use keep_model::hash::HashTable;
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::Kernels;
use keep_model::{Logits, ModelConfig};
use serde::Serialize;

use crate::calibrate::RunManifest;
use crate::eval_metrics::{score, EvalSums};
use crate::pack::{Pack, Split};
use crate::st::StFile;
use crate::{CalibError, Result};

/// One student's result.
#[derive(Debug, Clone, Serialize)]
pub struct StudentScore {
    /// `"model"`, `"model --kernels fast"` or the plan's file name.
    pub label: String,
    /// The kernels the student ran on (`"exact"` or `"fast"`).
    pub kernels: &'static str,
    pub plan: Option<PathBuf>,
    /// Experts a token may still be routed to per layer (the model's own count without a plan).
    pub experts_kept: usize,
    pub experts_total: usize,
    pub saliency: String,
    pub positions: u64,
    pub mean_kl: f64,
    pub mean_nll: f64,
    pub mean_dnll: f64,
    pub top1: f64,
    #[serde(skip)]
    pub sums: EvalSums,
}

/// `keep eval --json`.
#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub format: &'static str,
    pub version: u32,
    pub model: String,
    pub teacher: String,
    pub pack: String,
    pub records: usize,
    pub teacher_nll: f64,
    pub students: Vec<StudentScore>,
    pub kl_rule: &'static str,
    /// Engram table use of the scored records (the same for every student; `None` without
    /// Engram layers).
    pub engram: Option<EngramUseReport>,
}

/// One teacher record: tokens and the stored teacher arrays.
pub(crate) struct TeacherRecord {
    pub(crate) tokens: Vec<u32>,
    pub(crate) ids: Vec<i32>,
    pub(crate) lps: Vec<f32>,
    pub(crate) next: Vec<f32>,
    pub(crate) k: usize,
}

pub(crate) fn load_teacher(run: &Path, pack: &Pack) -> Result<Vec<TeacherRecord>> {
    let m = RunManifest::read(run)?;
    if m.split != Split::Eval {
        return Err(CalibError::Mismatch(format!(
            "{} is a `{}` run; the teacher is an eval run: keep calibrate --split eval --out RUN",
            run.display(),
            m.split.name()
        )));
    }
    if m.pack_fingerprint != pack.fingerprint {
        return Err(CalibError::Mismatch(format!(
            "{} was made from another pack (fingerprint {}) than {} ({}); pass the pack it was made from with --pack",
            run.display(),
            crate::fingerprint::short(&m.pack_fingerprint),
            pack.dir.display(),
            crate::fingerprint::short(&pack.fingerprint)
        )));
    }
    let mut out = vec![];
    for s in &m.sessions {
        let path = crate::session::session_path(run, s);
        let f = StFile::open(&path)?;
        if f.metadata().get("complete").map(String::as_str) != Some("true") {
            return Err(CalibError::invalid(
                &path,
                "session is not complete; rerun keep calibrate on this run",
            ));
        }
        let ids = crate::session::read_records(&f)?;
        for (i, rid) in ids.iter().enumerate() {
            let rec = pack.records.iter().find(|r| r.id == *rid).ok_or_else(|| {
                CalibError::invalid(&path, format!("record {rid} is not in the pack"))
            })?;
            let t = crate::session::read_teacher(&f, i)?;
            let (k, topk_ids, lps, next) = (t.k, t.topk_ids, t.topk_logprobs, t.next_logprob);
            if t.tokens != rec.tokens.len() || next.len() + 1 != rec.tokens.len() {
                return Err(CalibError::invalid(
                    &path,
                    format!(
                        "teacher arrays of record {rid} do not match its {} tokens",
                        rec.tokens.len()
                    ),
                ));
            }
            out.push(TeacherRecord {
                tokens: rec.tokens.clone(),
                ids: topk_ids,
                lps,
                next,
                k,
            });
        }
    }
    if out.is_empty() {
        return Err(CalibError::Mismatch(format!(
            "{} holds no teacher records",
            run.display()
        )));
    }
    Ok(out)
}

/// The `tid2eid` tables a plan gives the model's pruned hash-routed layers (its remap applied,
/// in the model's expert ids), per layer: what `keep prune` writes, before the renumbering, so
/// the masked student routes exactly as the pruned checkpoint does.
pub fn remapped_tables(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    plan: &PrunePlan,
) -> Result<Vec<Option<HashTable>>> {
    let mut out = vec![None; cfg.n_layers];
    for (l, slot) in out.iter_mut().enumerate() {
        let Some(surv) = plan.survivors(l) else {
            continue;
        };
        if !cfg.is_hash(l) {
            continue;
        }
        let remap = plan.hash_remap(l).ok_or_else(|| {
            CalibError::Mismatch(format!(
                "the plan prunes hash-routed layer {l} without a hash_remap: make it with `keep select --hash-remap POLICY`"
            ))
        })?;
        let bad = |e: String| CalibError::Mismatch(format!("layer {l}: hash_remap: {e}"));
        let n = cfg.experts_in_layer(l);
        remap.validate(n, surv, cfg.top_k).map_err(bad)?;
        let t = HashTable::load(ck, cfg, l)?;
        let ids = remap_table(&t.ids, t.top_k, surv, remap).map_err(bad)?;
        let raw: Vec<i64> = ids.iter().map(|&j| j as i64).collect();
        *slot = Some(HashTable::new(t.vocab, t.top_k, n, &raw).map_err(bad)?);
    }
    Ok(out)
}

/// Score `model` and each plan (as a router mask) against the teacher `run` made from `pack`.
/// `chunk_tokens` bounds the tokens run through the model at once. With
/// [`Kernels::Fast`] the model is also scored on the fast kernels (student
/// `model --kernels fast`), and the plans run on them; the student `model` stays on the exact
/// kernels.
pub fn eval(
    model: &Path,
    run: &Path,
    pack: &Pack,
    plans: &[PathBuf],
    chunk_tokens: usize,
    kernels: Kernels,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<EvalReport> {
    let ck = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_checkpoint(&ck)?;
    let teacher = load_teacher(run, pack)?;
    let engram = match EngramUse::new(&ck, &cfg)? {
        Some(mut u) => {
            for t in &teacher {
                u.add(&t.tokens)?;
            }
            Some(u.report())
        }
        None => None,
    };
    let mut students: Vec<(String, Option<PathBuf>, Option<PrunePlan>, Kernels)> =
        vec![("model".into(), None, None, Kernels::Exact)];
    if kernels == Kernels::Fast {
        students.push(("model --kernels fast".into(), None, None, Kernels::Fast));
    }
    for p in plans {
        let plan = PrunePlan::read(p)?;
        if plan.n_experts != cfg.n_experts {
            return Err(CalibError::Mismatch(format!(
                "{} is a plan for {} experts per layer; {} has {}",
                p.display(),
                plan.n_experts,
                model.display(),
                cfg.n_experts
            )));
        }
        // A model whose layers have different counts (hash-routed layers a pruned checkpoint
        // kept whole): the plan's masks fit only layers of its count.
        if let Some(l) = (0..cfg.n_layers)
            .find(|&l| plan.survivors(l).is_some() && cfg.experts_in_layer(l) != plan.n_experts)
        {
            return Err(CalibError::Mismatch(format!(
                "{} prunes layer {l} as a layer of {} experts; {} has {} there",
                p.display(),
                plan.n_experts,
                model.display(),
                cfg.experts_in_layer(l)
            )));
        }
        let label = p
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        students.push((label, Some(p.clone()), Some(plan), kernels));
    }
    let teacher_nll: f64 = {
        let (s, n) = teacher.iter().fold((0.0, 0usize), |(s, n), t| {
            (
                s - t.next.iter().map(|&x| x as f64).sum::<f64>(),
                n + t.next.len(),
            )
        });
        s / n.max(1) as f64
    };
    let total = students.len() * teacher.len();
    let mut done = 0;
    let mut out = vec![];
    for (label, path, plan, student_kernels) in students {
        let masks: Vec<Option<Vec<bool>>> = (0..cfg.n_layers)
            .map(|l| plan.as_ref().and_then(|p| p.pruned_mask(l)))
            .collect();
        let hash_tables = match &plan {
            Some(p) => remapped_tables(&ck, &cfg, p)?,
            None => vec![],
        };
        let mut sums = EvalSums::default();
        let mut i = 0;
        while i < teacher.len() {
            let mut j = i;
            let mut size = 0;
            while j < teacher.len() && (j == i || size + teacher[j].tokens.len() <= chunk_tokens) {
                size += teacher[j].tokens.len();
                j += 1;
            }
            let toks: Vec<Vec<u32>> = teacher[i..j].iter().map(|t| t.tokens.clone()).collect();
            let so = StreamOptions {
                logits: Logits::All,
                masks: masks.clone(),
                hash_tables: hash_tables.clone(),
                on_layer: None,
                release_pages: false,
                kernels: student_kernels,
                prefill_chunk: None,
            };
            let logits = forward_streamed(&ck, &toks, so, None)?;
            for (lg, t) in logits.iter().zip(&teacher[i..j]) {
                let s = score(lg, cfg.vocab, &t.tokens, &t.ids, &t.lps, &t.next, t.k);
                sums.add(&s);
                done += 1;
                progress(done, total);
            }
            i = j;
        }
        let kept = plan.as_ref().map_or(cfg.n_experts, |p| p.keep);
        out.push(StudentScore {
            label,
            kernels: student_kernels.name(),
            plan: path,
            experts_kept: kept,
            experts_total: cfg.n_experts,
            saliency: plan.as_ref().map_or(String::new(), |p| p.saliency.clone()),
            positions: sums.positions,
            mean_kl: sums.mean_kl(),
            mean_nll: sums.mean_nll(),
            mean_dnll: sums.mean_dnll(),
            top1: sums.top1_rate(),
            sums,
        });
    }
    Ok(EvalReport {
        format: "keep-eval-report",
        version: 1,
        model: model.display().to_string(),
        teacher: run.display().to_string(),
        pack: pack.dir.display().to_string(),
        records: teacher.len(),
        teacher_nll,
        engram,
        students: out,
        kl_rule: "KL(teacher||student) per position over the teacher's top-64 plus one tail bucket (its mass outside the top-64 against the student's); a lower bound of the full KL, exact when the tail is empty",
    })
}

/// Plot mean KL against experts kept, one line per saliency (PNG or SVG by extension).
pub fn plot_kl(report: &EvalReport, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut series: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
    for s in &report.students {
        if s.plan.is_some() {
            series
                .entry(if s.saliency.is_empty() {
                    s.label.clone()
                } else {
                    s.saliency.clone()
                })
                .or_default()
                .push((
                    s.experts_kept as f64 / s.experts_total as f64 * 100.0,
                    s.mean_kl,
                ));
        }
    }
    let ymax = report
        .students
        .iter()
        .map(|s| s.mean_kl)
        .fold(1e-6, f64::max)
        * 1.1;
    fn draw<DB: DrawingBackend>(
        area: &DrawingArea<DB, plotters::coord::Shift>,
        series: &std::collections::BTreeMap<String, Vec<(f64, f64)>>,
        ymax: f64,
    ) -> std::result::Result<(), String> {
        area.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(area)
            .caption("KL(teacher ‖ student) vs experts kept", ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..100f64, 0f64..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("experts kept per layer (%)")
            .y_desc("mean KL (nats/position)")
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let mut pts = pts.clone();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart
                .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .border_style(BLACK)
            .background_style(WHITE)
            .draw()
            .map_err(|e| e.to_string())?;
        area.present().map_err(|e| e.to_string())
    }
    let size = (800, 560);
    let r = match ext.as_str() {
        "svg" => draw(
            &SVGBackend::new(path, size).into_drawing_area(),
            &series,
            ymax,
        ),
        "png" => draw(
            &BitMapBackend::new(path, size).into_drawing_area(),
            &series,
            ymax,
        ),
        _ => Err(format!(
            "unknown image type `.{ext}`; name the file *.png or *.svg"
        )),
    };
    r.map_err(|msg| CalibError::Plot {
        path: path.to_path_buf(),
        msg,
    })
}
