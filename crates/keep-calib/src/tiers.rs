//! Scoring precision tiers against a teacher run: a static allocation (`keep eval --alloc`) and
//! the runtime's per-token tier policy simulated deterministically (`keep eval --tiers`).
//!
//! The student is built in memory, no checkpoint written: every expert's views come from the
//! checkpoint that holds its allocated rung — the model itself for `shipped`, a `keep quant`
//! output for an E8P rung (an `e8p2` expert may come from any E8P checkpoint, its residual
//! ignored: keep-model's `ExpertWeights::base`, bit-identical to an E8P2 checkpoint's) — and
//! `pruned` experts are masked out of the router (survivors renormalised, as `keep eval --mask`
//! does). Scored with the same metrics as `keep eval`.
//!
//! # The tier simulation
//! Each expert's base is its allocated rung and its upper stage is decided by the one rule
//! the runtime and the replay use too (keep-residency's
//! [`upper_stage`](keep_residency::tiers::upper_stage)): for `e8p2`, the residual codes a
//! given checkpoint carries (`e8p2+e81`, else `e8p2+e8p2`); for the top quantized rungs
//! `e8p2+e81`/`e8p2+e8p2`, the shipped expert when [`TierOptions::upper_shipped`] is set (keep
//! eval's `--upper-from`); `shipped` and `pruned` have none. Its upper stage costs the bytes
//! the upper rung adds (the residual's; for `shipped`, the whole shipped expert's). Each
//! record is a session (an empty residual cache), computed as the runtime computes a run: its
//! first [`TierOptions::prefill_tokens`] tokens as one forward, then one token at a time
//! (bit-identical logits either way). Every routed slot is answered by keep-residency's
//! [`TierPolicy`] — gate ≥ τ and the stage in memory: upper; else base, and an absent stage is
//! admitted into the LRU residual cache of `cache_bytes` — and a read issued in a forward is
//! usable `k` = `admit_delay` tokens after that forward's last token. No slot ever waits. Each
//! τ is one student; the report gives the serving mix (slots per rung, hits, misses,
//! admissions, evictions) and the residual bytes read per token. The default `k` is
//! [`DEFAULT_ADMIT_DELAY`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use keep_artifacts::alloc::{Alloc, PRUNED, SHIPPED};
use keep_checkpoint::Checkpoint;
use keep_model::{
    CheckpointExperts, ExpertSource, ExpertTiers, ExpertWeights, Logits, Model, ModelConfig,
    ModelError, Rung, UpperChoice,
};
use keep_residency::tiers::{upper_stage, Choice, TierPolicy, UpperStage};
use serde::Serialize;

use crate::eval::load_teacher;
use crate::eval_metrics::{score, EvalSums};
use crate::pack::Pack;
use crate::{CalibError, Result};

/// Tokens between a residual's admission and its first use when no read latency is measured:
/// one — an upper stage of the models keep runs is at most a few MB, read from an NVMe SSD in
/// about a millisecond, less than one decode step of a CPU MoE forward, so a stage queued at
/// token t is in memory for token t + 1.
pub const DEFAULT_ADMIT_DELAY: u64 = 1;

/// The serving mix of one simulated τ.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct TierMix {
    pub tau: f64,
    pub cache_bytes: u64,
    pub admit_delay: u64,
    pub tokens: u64,
    pub slots_base: u64,
    pub slots_upper: u64,
    /// Slots with gate ≥ τ whose stage was usable.
    pub hits: u64,
    /// Slots with gate ≥ τ whose stage was not (absent, still arriving, or too large).
    pub misses: u64,
    pub admissions: u64,
    pub evictions: u64,
    /// Of `misses`: the stage was still being read; not admitted for lack of room.
    pub in_flight: u64,
    pub no_room: u64,
    /// Slots with gate ≥ τ (with or without an upper stage).
    pub above_tau: u64,
    /// Tokens of each record computed as one prefill forward.
    pub prefill_tokens: usize,
    /// Bytes of upper stages admitted (read) over the run.
    pub bytes_read: u64,
    pub bytes_read_per_token: f64,
}

/// One student's score.
#[derive(Debug, Clone, Serialize)]
pub struct TierScore {
    pub label: String,
    /// Bytes of routed experts the allocation stores (its base rungs).
    pub alloc_bytes: u64,
    pub mix: Option<TierMix>,
    pub positions: u64,
    pub mean_kl: f64,
    pub mean_nll: f64,
    pub mean_dnll: f64,
    pub top1: f64,
    /// With [`TierOptions::record`]: every routed slot's rung in the order it was chosen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served: Option<Vec<ServedSlot>>,
}

/// One routed slot of a tier student: record, token position, layer, expert, and whether it
/// was computed at the upper rung.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct ServedSlot {
    pub record: usize,
    pub token: usize,
    pub layer: usize,
    pub expert: usize,
    pub upper: bool,
}

/// What [`eval_tiers`] returns.
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    pub format: &'static str,
    pub version: u32,
    pub model: String,
    pub alloc: String,
    pub teacher: String,
    pub records: usize,
    pub rung_mix: BTreeMap<String, usize>,
    /// Experts per upper stage: residual codes, shipped expert, none.
    pub upper_stages: BTreeMap<String, usize>,
    pub students: Vec<TierScore>,
    /// With [`TierOptions::record`]: each record's token ids (what [`ServedSlot::record`]
    /// indexes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub record_tokens: Option<Vec<Vec<u32>>>,
}

/// The simulation's options: τ values (empty: only the static allocation is scored), cache
/// bytes, admission delay in tokens (≥ 1), whether the shipped experts (the model's own) are
/// the upper stage above the top quantized rung (`--upper-from`), the tokens of each record
/// computed as one prefill forward, and whether to record every slot's rung.
#[derive(Debug, Clone, Default)]
pub struct TierOptions {
    pub taus: Vec<f64>,
    pub cache_bytes: u64,
    pub admit_delay: u64,
    pub upper_shipped: bool,
    pub prefill_tokens: usize,
    pub record: bool,
}

/// The policy of one τ student (an [`ExpertTiers`]), recording each slot's rung when asked.
struct Sim {
    st: Mutex<SimState>,
}

struct SimState {
    pol: TierPolicy,
    record: Option<Vec<ServedSlot>>,
    /// (record, position of this forward's first token).
    at: (usize, usize),
}

impl ExpertTiers for Sim {
    fn choose(&self, layer: usize, token: usize, expert: usize, gate: f32) -> UpperChoice {
        let mut st = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let c = st.pol.choose(layer, expert, gate);
        let upper = c == Choice::Use;
        let (record, start) = st.at;
        if let Some(r) = &mut st.record {
            r.push(ServedSlot {
                record,
                token: start + token,
                layer,
                expert,
                upper,
            });
        }
        match c {
            Choice::Use => UpperChoice::Use,
            Choice::Base => UpperChoice::Base,
            Choice::Miss { .. } => UpperChoice::BaseAndWant,
        }
    }
}

/// Experts at their allocated rungs, with upper views where one exists.
struct AllocExperts<'a> {
    n_experts: usize,
    base: Vec<ExpertWeights<'a>>,
    upper: Vec<Option<ExpertWeights<'a>>>,
    sim: Option<Arc<Sim>>,
}

impl ExpertSource for AllocExperts<'_> {
    fn expert(&self, layer: usize, expert: usize) -> keep_model::Result<ExpertWeights<'_>> {
        self.base
            .get(layer * self.n_experts + expert)
            .copied()
            .filter(|_| expert < self.n_experts)
            .ok_or_else(|| ModelError::Expert {
                layer,
                expert,
                msg: "no such expert".into(),
            })
    }
    fn tiers(&self) -> Option<&dyn ExpertTiers> {
        self.sim.as_deref().map(|s| s as &dyn ExpertTiers)
    }
    fn prefetch(&self, layer: usize, _experts: &[usize]) {
        // The layer's choices are made: its `Use` entries are in use until its next pass.
        if let Some(s) = &self.sim {
            s.st.lock()
                .unwrap_or_else(|e| e.into_inner())
                .pol
                .pass(layer);
        }
    }
    fn experts_at(
        &self,
        layer: usize,
        picks: &[(usize, Rung)],
    ) -> keep_model::Result<Vec<ExpertWeights<'_>>> {
        picks
            .iter()
            .map(|&(j, r)| match r {
                Rung::Base => self.expert(layer, j),
                Rung::Upper => {
                    self.upper[layer * self.n_experts + j].ok_or_else(|| ModelError::Expert {
                        layer,
                        expert: j,
                        msg: "no upper rung".into(),
                    })
                }
            })
            .collect()
    }
}

/// Bytes of the views (codes and scales of all three projections).
fn view_bytes(w: &ExpertWeights) -> u64 {
    (w.w1.nbytes() + w.w2.nbytes() + w.w3.nbytes()) as u64
}

/// Score the allocation `alloc_path` of `model` (rungs from `quant` checkpoints) against the
/// teacher `run` made from `pack`: the static allocation, then one student per τ of `opts`.
pub fn eval_tiers(
    model: &Path,
    alloc_path: &Path,
    quant: &[PathBuf],
    run: &Path,
    pack: &Pack,
    opts: &TierOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<TierReport> {
    let alloc = Alloc::read(alloc_path)?;
    let fp = keep_checkpoint::fingerprint::model_fingerprint(model)?;
    if alloc.model_fingerprint != fp {
        return Err(CalibError::Mismatch(format!(
            "{} is an allocation for another model (fingerprint {}; {} has {fp})",
            alloc_path.display(),
            alloc.model_fingerprint,
            model.display()
        )));
    }
    let ck = Checkpoint::open(model)?;
    let cfg = ModelConfig::from_checkpoint(&ck)?;
    let qcks: Vec<Checkpoint> = quant
        .iter()
        .map(|p| Checkpoint::open(p))
        .collect::<std::result::Result<_, _>>()?;
    let teacher = load_teacher(run, pack)?;
    let shipped = CheckpointExperts::new(&ck, &cfg)?;
    let qsrc: Vec<CheckpointExperts> = qcks
        .iter()
        .map(|c| CheckpointExperts::new(c, &cfg))
        .collect::<keep_model::Result<_>>()?;
    let (nl, ne) = (cfg.n_layers, cfg.n_experts);
    if let Some(l) = (0..nl).find(|&l| cfg.experts_in_layer(l) != ne) {
        return Err(CalibError::Mismatch(format!(
            "layer {l} has {} routed experts and another layer {ne} \
             (n_routed_experts_per_layer): keep eval --tiers scores models with one expert count \
             per layer; allocate on the checkpoint before pruning",
            cfg.experts_in_layer(l)
        )));
    }
    // every rung each expert can be served at: label → views
    let mut base = Vec::with_capacity(nl * ne);
    let mut upper = Vec::with_capacity(nl * ne);
    let mut upper_bytes = Vec::with_capacity(nl * ne);
    let mut masks: Vec<Option<Vec<bool>>> = vec![None; nl];
    let mut stage_mix: BTreeMap<String, usize> = BTreeMap::new();
    for (l, mask) in masks.iter_mut().enumerate() {
        for j in 0..ne {
            let s = shipped.expert(l, j)?;
            let mut have: BTreeMap<&str, ExpertWeights> = BTreeMap::new();
            have.insert(SHIPPED, s);
            for q in &qsrc {
                if let Ok(w) = q.expert(l, j) {
                    let label = w.w2.format_name();
                    if label.starts_with("e8p2") {
                        have.entry("e8p2").or_insert(w.base());
                        if label != "e8p2" {
                            have.entry(label).or_insert(w);
                        }
                    }
                }
            }
            let rung = alloc.rung(l, j).ok_or_else(|| {
                CalibError::Mismatch(format!(
                    "{} has no rung for expert {j} of layer {l}",
                    alloc_path.display()
                ))
            })?;
            if rung == PRUNED {
                mask.get_or_insert_with(|| vec![false; ne])[j] = true;
                base.push(s);
                upper.push(None);
                upper_bytes.push(0);
                continue;
            }
            let b = *have.get(rung).ok_or_else(|| {
                CalibError::Mismatch(format!(
                    "expert {j} of layer {l} is allocated `{rung}`, which none of the given \
                     checkpoints holds: pass the keep quant output with that rung (--quant)"
                ))
            })?;
            let residual = ["e8p2+e81", "e8p2+e8p2"]
                .iter()
                .find_map(|r| have.get(r))
                .copied();
            let stage = upper_stage(rung, residual.is_some(), opts.upper_shipped);
            *stage_mix
                .entry(
                    match stage {
                        UpperStage::None => "none",
                        UpperStage::Residual => "residual",
                        UpperStage::Shipped => "shipped",
                    }
                    .to_string(),
                )
                .or_default() += 1;
            let up: Option<(ExpertWeights, u64)> = match (stage, residual) {
                (UpperStage::Residual, Some(w)) => Some((w, view_bytes(&w) - view_bytes(&b))),
                (UpperStage::Shipped, _) => Some((s, view_bytes(&s))),
                _ => None,
            };
            base.push(b);
            upper.push(up.map(|u| u.0));
            upper_bytes.push(up.map_or(0, |u| u.1));
        }
    }
    let total = (1 + opts.taus.len()) * teacher.len();
    let mut done = 0;
    let mut students = vec![];
    let mut runs: Vec<Option<f64>> = vec![None];
    runs.extend(opts.taus.iter().map(|&t| Some(t)));
    for tau in runs {
        let sim = match tau {
            None => None,
            Some(t) => {
                let ub: Vec<Vec<u64>> =
                    upper_bytes.chunks(ne.max(1)).map(<[u64]>::to_vec).collect();
                let pol = TierPolicy::new(t as f32, opts.cache_bytes, ub, Some(opts.admit_delay))
                    .map_err(|e| CalibError::Mismatch(e.to_string()))?;
                Some(Arc::new(Sim {
                    st: Mutex::new(SimState {
                        pol,
                        record: opts.record.then(Vec::new),
                        at: (0, 0),
                    }),
                }))
            }
        };
        let src = AllocExperts {
            n_experts: ne,
            base: base.clone(),
            upper: upper.clone(),
            sim: sim.clone(),
        };
        let mut m = Model::load_with(&ck, cfg.clone(), Box::new(src))?;
        for (l, mask) in masks.iter().enumerate() {
            m.set_router_mask(l, mask.clone())?;
        }
        let mut sums = EvalSums::default();
        let mut tokens = 0u64;
        for (ri, t) in teacher.iter().enumerate() {
            let logits = match &sim {
                None => {
                    let mut cache = m.new_cache();
                    m.forward(&t.tokens, &mut cache, Logits::All, None)?
                }
                Some(s) => {
                    // A session: an empty residual cache, the prefill as one forward, then one
                    // token per forward.
                    s.st.lock().unwrap_or_else(|e| e.into_inner()).pol.clear();
                    let mut cache = m.new_cache();
                    let mut all = Vec::with_capacity(t.tokens.len() * cfg.vocab);
                    let p = opts.prefill_tokens.min(t.tokens.len());
                    let mut forwards: Vec<std::ops::Range<usize>> = vec![];
                    if p > 0 {
                        forwards.push(0..p);
                    }
                    forwards.extend((p..t.tokens.len()).map(|i| i..i + 1));
                    for f in forwards {
                        s.st.lock().unwrap_or_else(|e| e.into_inner()).at = (ri, f.start);
                        all.extend(m.forward(
                            &t.tokens[f.clone()],
                            &mut cache,
                            Logits::All,
                            None,
                        )?);
                        tokens += f.len() as u64;
                        s.st.lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .pol
                            .advance(f.len() as u64);
                    }
                    all
                }
            };
            let s = score(&logits, cfg.vocab, &t.tokens, &t.ids, &t.lps, &t.next, t.k);
            sums.add(&s);
            done += 1;
            progress(done, total);
        }
        let mut served = None;
        let mix = tau.zip(sim.as_ref()).map(|(t, s)| {
            let mut st = s.st.lock().unwrap_or_else(|e| e.into_inner());
            served = st.record.take();
            let c = st.pol.counts();
            TierMix {
                tau: t,
                cache_bytes: opts.cache_bytes,
                admit_delay: opts.admit_delay,
                tokens,
                slots_base: c.base,
                slots_upper: c.upper,
                hits: c.upper,
                misses: c.upper_misses,
                admissions: c.admissions,
                evictions: c.evictions,
                in_flight: c.in_flight,
                no_room: c.no_room,
                above_tau: c.above_tau,
                prefill_tokens: opts.prefill_tokens,
                bytes_read: c.residual_bytes_read,
                bytes_read_per_token: c.residual_bytes_read as f64 / tokens.max(1) as f64,
            }
        });
        students.push(TierScore {
            label: match tau {
                None => "alloc".into(),
                Some(t) => format!("tiers τ={t}"),
            },
            alloc_bytes: alloc.bytes,
            mix,
            positions: sums.positions,
            mean_kl: sums.mean_kl(),
            mean_nll: sums.mean_nll(),
            mean_dnll: sums.mean_dnll(),
            top1: sums.top1_rate(),
            served,
        });
    }
    Ok(TierReport {
        format: "keep-eval-tiers",
        version: 1,
        model: model.display().to_string(),
        alloc: alloc_path.display().to_string(),
        teacher: run.display().to_string(),
        records: teacher.len(),
        rung_mix: alloc.mix(),
        upper_stages: stage_mix,
        record_tokens: opts
            .record
            .then(|| teacher.iter().map(|t| t.tokens.clone()).collect()),
        students,
    })
}

/// Plot KL against upper-stage bytes read per token, one point per τ, the static allocation at
/// zero bytes (PNG or SVG by extension).
pub fn plot_tiers(report: &TierReport, path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let mut pts: Vec<(f64, f64, String)> = report
        .students
        .iter()
        .map(|s| {
            (
                s.mix.as_ref().map_or(0.0, |m| m.bytes_read_per_token),
                s.mean_kl,
                s.label.clone(),
            )
        })
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let xmax = pts.iter().map(|p| p.0).fold(1.0, f64::max) * 1.1;
    let ymax = pts.iter().map(|p| p.1).fold(1e-6, f64::max) * 1.1;
    fn draw<DB: DrawingBackend>(
        area: &DrawingArea<DB, plotters::coord::Shift>,
        pts: &[(f64, f64, String)],
        xmax: f64,
        ymax: f64,
    ) -> std::result::Result<(), String> {
        area.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut chart = ChartBuilder::on(area)
            .caption(
                "KL(teacher ‖ student) vs upper-stage bytes per token",
                ("sans-serif", 22),
            )
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("upper-stage bytes read per token")
            .y_desc("mean KL (nats/position)")
            .draw()
            .map_err(|e| e.to_string())?;
        let color = Palette99::pick(0).to_rgba();
        chart
            .draw_series(LineSeries::new(
                pts.iter().map(|p| (p.0, p.1)),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(
                pts.iter()
                    .map(|p| Circle::new((p.0, p.1), 4, color.filled())),
            )
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(
                pts.iter()
                    .map(|p| Text::new(p.2.clone(), (p.0, p.1), ("sans-serif", 13).into_font())),
            )
            .map_err(|e| e.to_string())?;
        area.present().map_err(|e| e.to_string())
    }
    let size = (800, 560);
    let r = match ext.as_str() {
        "svg" => draw(
            &SVGBackend::new(path, size).into_drawing_area(),
            &pts,
            xmax,
            ymax,
        ),
        "png" => draw(
            &BitMapBackend::new(path, size).into_drawing_area(),
            &pts,
            xmax,
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
