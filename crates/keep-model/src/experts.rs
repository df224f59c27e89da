//! Where routed experts' bytes come from: the [`ExpertSource`] trait. The MoE layer asks it for
//! the three matrices of each chosen expert and never learns whether the bytes are resident,
//! mmap'd or read from an SSD slot (keep-runtime's slot cache implements this trait).
//! [`CheckpointExperts`] is the default: views of the mmap'd checkpoint, resolved and
//! shape-checked once at load.
//!
//! Precision tiers: a source may serve each expert at two rungs, its *base* (an E8P weight's
//! codes alone) and its *upper* rung (base plus the residual stage, or any higher-precision
//! copy the source holds). A source that does ([`ExpertSource::tiers`] returns an
//! [`ExpertTiers`]) is asked per routed slot which rung to compute it at
//! ([`ExpertTiers::choose`]), and the MoE layer then groups the routes by (expert, rung) and
//! asks for both kinds of views at once ([`ExpertSource::experts_at`]). A source without tiers
//! (the default) is used exactly as before, bit for bit. [`Tiered`] attaches a policy to any
//! source whose views carry the residual (the checkpoint's, for evaluation); the base view of
//! such an expert is [`ExpertWeights::base`], the same bytes with the residual ignored.
//!
//! Incoherence: a matrix a quantized checkpoint stores rotated (`W̃ = V_out·W·V_inᵀ`, keep-checkpoint's
//! `incoherence` marker) carries its two seeded transforms in [`ExpertWeights::rht`]
//! ([`MatRht`]); the MoE layer computes `y = V_outᵀ·(W̃·(V_in·x))` ([`rht_input`],
//! [`rht_output`]) around the same products, in either kernel mode, whatever the source.

use std::borrow::Cow;
use std::collections::BTreeMap;

use keep_checkpoint::incoherence::Incoherence;
use keep_checkpoint::Checkpoint;
use keep_kernels::hadamard::Rht;
use keep_kernels::WeightView;

use crate::config::ModelConfig;
use crate::weights::weight;
use crate::{ModelError, Result};

/// One routed expert: `w1` (gate) and `w3` (up) are `[inter, hidden]`, `w2` (down) is
/// `[hidden, inter]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub w1: WeightView<'a>,
    pub w2: WeightView<'a>,
    pub w3: WeightView<'a>,
    /// The incoherence transforms of the matrices stored rotated (none for a shipped expert).
    pub rht: ExpertRht,
}

/// The two transforms of a matrix stored as `W̃ = V_out·W·V_inᵀ`: `input` (size = columns)
/// and `output` (size = rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatRht {
    pub input: Rht,
    pub output: Rht,
}

/// The transforms of one expert's matrices (`None`: stored as is).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExpertRht {
    pub w1: Option<MatRht>,
    pub w2: Option<MatRht>,
    pub w3: Option<MatRht>,
}

/// The checkpoint's incoherence marker (empty when it has none or no config).
pub fn incoherence_map(ck: &Checkpoint) -> Result<BTreeMap<String, Incoherence>> {
    match ck.config() {
        None => Ok(BTreeMap::new()),
        Some(c) => keep_checkpoint::incoherence::read(c).map_err(|msg| ModelError::Format {
            name: "config.json".into(),
            msg,
        }),
    }
}

/// The transforms of weight `base` (`[rows, cols]`) from the marker, checked against its shape.
pub fn mat_rht(
    map: &BTreeMap<String, Incoherence>,
    base: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<MatRht>> {
    let Some(t) = map.get(base) else {
        return Ok(None);
    };
    let err = |e: keep_kernels::KernelError| ModelError::Format {
        name: base.into(),
        msg: format!("incoherence: {e}"),
    };
    Ok(Some(MatRht {
        input: Rht::new(cols, t.block_in, t.seed_in).map_err(err)?,
        output: Rht::new(rows, t.block_out, t.seed_out).map_err(err)?,
    }))
}

/// The transforms of an expert whose gate, down and up bases are `bases` (`w1`/`w3` are
/// `[inter, dim]`, `w2` is `[dim, inter]`).
pub fn expert_rht(
    map: &BTreeMap<String, Incoherence>,
    bases: [&str; 3],
    dim: usize,
    inter: usize,
) -> Result<ExpertRht> {
    if map.is_empty() {
        return Ok(ExpertRht::default());
    }
    Ok(ExpertRht {
        w1: mat_rht(map, bases[0], inter, dim)?,
        w2: mat_rht(map, bases[1], dim, inter)?,
        w3: mat_rht(map, bases[2], inter, dim)?,
    })
}

/// The transforms of routed expert `expert` of `layer`, the matrices named as the family
/// codes them (keep-checkpoint's `coded_matrices`: DeepSeek V4's, Hugging Face's per-expert
/// names, or the matrices of a family whose gate and up rows are one interleaved matrix).
pub fn coded_rht(
    map: &BTreeMap<String, Incoherence>,
    cfg: &keep_checkpoint::DeepSeekConfig,
    layer: usize,
    expert: usize,
) -> Result<ExpertRht> {
    let mut r = ExpertRht::default();
    if map.is_empty() {
        return Ok(r);
    }
    for m in cfg.coded_matrices(layer, expert) {
        let t = mat_rht(map, &m.base, m.rows, m.cols)?;
        match m.mat {
            keep_checkpoint::naming::ExpertMat::W1 => r.w1 = t,
            keep_checkpoint::naming::ExpertMat::W2 => r.w2 = t,
            keep_checkpoint::naming::ExpertMat::W3 => r.w3 = t,
        }
    }
    Ok(r)
}

/// The activation rows `x` a matrix with transforms `r` multiplies: `V_in·x` row by row (a
/// copy), or `x` itself.
pub fn rht_input(r: Option<MatRht>, x: &[f32]) -> Result<Cow<'_, [f32]>> {
    match r {
        None => Ok(Cow::Borrowed(x)),
        Some(t) => {
            let mut v = x.to_vec();
            t.input.forward(&mut v)?;
            Ok(Cow::Owned(v))
        }
    }
}

/// Undo the output side on the product rows `y` in place: `y ← V_outᵀ·y`.
pub fn rht_output(r: Option<MatRht>, y: &mut [f32]) -> Result<()> {
    if let Some(t) = r {
        t.output.inverse(y)?;
    }
    Ok(())
}

impl ExpertWeights<'_> {
    /// These weights at their base rung: each E8P view without its residual stage (other
    /// formats have one rung and are returned as they are).
    pub fn base(&self) -> Self {
        ExpertWeights {
            w1: base_view(self.w1),
            w2: base_view(self.w2),
            w3: base_view(self.w3),
            rht: self.rht,
        }
    }

    /// Whether any of the three matrices carries an upper stage (an E8P residual).
    pub fn has_upper(&self) -> bool {
        [self.w1, self.w2, self.w3].iter().any(|w| {
            matches!(
                w.kind,
                keep_kernels::weight::WeightKind::E8p { resid: Some(_), .. }
            )
        })
    }
}

/// `w` without an E8P residual stage.
fn base_view(w: WeightView<'_>) -> WeightView<'_> {
    match w.kind {
        keep_kernels::weight::WeightKind::E8p { codes, scales, .. } => WeightView {
            rows: w.rows,
            cols: w.cols,
            kind: keep_kernels::weight::WeightKind::E8p {
                codes,
                scales,
                resid: None,
            },
        },
        _ => w,
    }
}

/// The rung a routed slot is computed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rung {
    /// The expert's base stage (an E8P weight's codes without the residual).
    Base,
    /// The expert's upper stage (base plus residual, or the source's higher-precision copy).
    Upper,
}

/// A tier policy's answer for one routed slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UpperChoice {
    /// Compute this slot at the upper rung: its views are in memory now and the source will
    /// hand them out from [`ExpertSource::experts_at`] for this layer's call.
    Use,
    /// Compute this slot at the base rung.
    Base,
    /// Compute this slot at the base rung now; the policy wants the upper stage (for example
    /// queued for admission into a residual cache). The layer treats it exactly as `Base`.
    BaseAndWant,
}

impl UpperChoice {
    /// The rung the slot is computed at.
    pub fn rung(self) -> Rung {
        match self {
            UpperChoice::Use => Rung::Upper,
            UpperChoice::Base | UpperChoice::BaseAndWant => Rung::Base,
        }
    }
}

/// The per-slot rung policy of a tiered source (runtime: gate ≥ τ and the upper stage cached).
pub trait ExpertTiers: Send + Sync {
    /// The rung for routed slot (`token` row of this call, expert `expert` of `layer`, gate
    /// weight `gate` — the weight the expert's output is multiplied by, after renormalisation
    /// and scaling). The MoE layer calls it once for every slot of a forward's layer, in token
    /// order then slot order, before it asks the source for any view of that layer; it never
    /// waits on anything.
    fn choose(&self, layer: usize, token: usize, expert: usize, gate: f32) -> UpperChoice;
}

/// A provider of routed-expert weights.
pub trait ExpertSource: Send + Sync {
    /// Expert `expert` of `layer`. The returned views must stay valid while `self` is borrowed.
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>>;

    /// A hint that these experts of `layer` are about to be asked for (one call per layer per
    /// forward, with every expert the batch routes to). Default: nothing.
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Which of `experts` of `layer` [`ExpertSource::experts`] would hand out now without
    /// waiting on a read (one flag each, in order). The MoE layer multiplies those first and
    /// the rest as their bytes land. Never blocks. Default: all (a source that never reads).
    fn ready(&self, _layer: usize, experts: &[usize]) -> Vec<bool> {
        vec![true; experts.len()]
    }

    /// Experts `experts` of `layer` at once, so that one kernel call can multiply a token by
    /// all of them: every returned view stays valid until the next call into `self` for
    /// `layer`. At most [`ExpertSource::max_batch`] experts are asked for per call. The default
    /// asks [`ExpertSource::expert`] for each, which is right for sources whose views live as
    /// long as the source (a source that recycles buffers must override both methods).
    fn experts(&self, layer: usize, experts: &[usize]) -> Result<Vec<ExpertWeights<'_>>> {
        experts.iter().map(|&e| self.expert(layer, e)).collect()
    }

    /// [`ExpertSource::experts`] appended to `out` (the MoE layer's kept buffer). Default:
    /// through [`ExpertSource::experts`]; a source whose views need no list of their own
    /// overrides it to allocate nothing.
    fn experts_into<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<ExpertWeights<'s>>,
    ) -> Result<()> {
        out.extend(self.experts(layer, experts)?);
        Ok(())
    }

    /// [`ExpertSource::ready`] into `out` (emptied first). Default: through
    /// [`ExpertSource::ready`]; a source that never reads overrides it to allocate nothing.
    fn ready_into(&self, layer: usize, experts: &[usize], out: &mut Vec<bool>) {
        out.clear();
        out.extend(self.ready(layer, experts));
    }

    /// The most experts of one layer that [`ExpertSource::experts`] can hand out together
    /// (at least 1). Default: no limit.
    fn max_batch(&self) -> usize {
        usize::MAX
    }

    /// The per-slot rung policy, when this source serves two rungs. Default: none (every slot
    /// is computed from [`ExpertSource::experts`], as a source without tiers always was).
    fn tiers(&self) -> Option<&dyn ExpertTiers> {
        None
    }

    /// Experts of `layer` at the given rungs, one view per entry and in the same order (an
    /// expert may appear twice, once per rung; at most [`ExpertSource::max_batch`] entries per
    /// call; views valid until the next call into `self` for `layer`). Asked only of sources
    /// whose [`ExpertSource::tiers`] is `Some`, with `Upper` only for experts the policy
    /// answered [`UpperChoice::Use`] in this layer's pass. The default asks
    /// [`ExpertSource::experts`] for the experts and strips the residual from the `Base`
    /// entries ([`ExpertWeights::base`]): right for sources whose views carry both stages.
    fn experts_at(&self, layer: usize, picks: &[(usize, Rung)]) -> Result<Vec<ExpertWeights<'_>>> {
        let ids: Vec<usize> = picks.iter().map(|p| p.0).collect();
        let full = self.experts(layer, &ids)?;
        Ok(full
            .into_iter()
            .zip(picks)
            .map(|(w, &(_, r))| match r {
                Rung::Upper => w,
                Rung::Base => w.base(),
            })
            .collect())
    }
}

/// A source with a tier policy attached: views from `source` (which carry both stages), rungs
/// from `tiers`. Everything else is delegated.
pub struct Tiered<S, T> {
    pub source: S,
    pub tiers: T,
}

impl<S: ExpertSource, T: ExpertTiers> ExpertSource for Tiered<S, T> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        self.source.expert(layer, expert)
    }
    fn prefetch(&self, layer: usize, experts: &[usize]) {
        self.source.prefetch(layer, experts)
    }
    fn ready(&self, layer: usize, experts: &[usize]) -> Vec<bool> {
        self.source.ready(layer, experts)
    }
    fn experts(&self, layer: usize, experts: &[usize]) -> Result<Vec<ExpertWeights<'_>>> {
        self.source.experts(layer, experts)
    }
    fn experts_into<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<ExpertWeights<'s>>,
    ) -> Result<()> {
        self.source.experts_into(layer, experts, out)
    }
    fn ready_into(&self, layer: usize, experts: &[usize], out: &mut Vec<bool>) {
        self.source.ready_into(layer, experts, out)
    }
    fn max_batch(&self) -> usize {
        self.source.max_batch()
    }
    fn tiers(&self) -> Option<&dyn ExpertTiers> {
        Some(&self.tiers)
    }
    fn experts_at(&self, layer: usize, picks: &[(usize, Rung)]) -> Result<Vec<ExpertWeights<'_>>> {
        self.source.experts_at(layer, picks)
    }
}

/// Experts read from the checkpoint mapping (the format decided per tensor). Layer `l`'s
/// experts are `l · n_experts + 0..experts_in_layer(l)` (`n_experts` the most of any layer).
pub struct CheckpointExperts<'a> {
    n_experts: usize,
    /// Each layer's routed experts.
    per_layer: Vec<usize>,
    experts: Vec<ExpertWeights<'a>>,
}

impl<'a> CheckpointExperts<'a> {
    /// Resolve every routed expert of every layer (views only; nothing is copied).
    pub fn new(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Self> {
        Self::for_layers(ck, cfg, 0..cfg.n_layers)
    }

    /// Resolve the experts of some layers only (others answer with an error).
    pub fn for_layers(
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layers: std::ops::Range<usize>,
    ) -> Result<Self> {
        let hint = cfg.raw.weight_block_size();
        let (d, i, e) = (cfg.dim, cfg.inter, cfg.n_experts);
        let marker = incoherence_map(ck)?;
        let mut experts = Vec::with_capacity(cfg.n_layers * e);
        for l in 0..cfg.n_layers {
            for x in 0..e {
                if !layers.contains(&l) || x >= cfg.experts_in_layer(l) {
                    // Placeholder for layers not resolved, and past a layer's own count in a
                    // model whose layers have different counts: an empty f32 view is never used.
                    experts.push(ExpertWeights {
                        w1: WeightView::f32(&[], 0, 0)?,
                        w2: WeightView::f32(&[], 0, 0)?,
                        w3: WeightView::f32(&[], 0, 0)?,
                        rht: ExpertRht::default(),
                    });
                    continue;
                }
                // A Hugging Face family that names its experts one by one (its own tensors or
                // slices of a stack, by keep-checkpoint's `expert_matrix`); DeepSeek V4's are
                // read by name below (a family whose experts are only stacked reads them
                // through its own source, `LayerFamily::experts`).
                let named = cfg.family.is_hugging_face()
                    && cfg
                        .raw
                        .expert_tensor(l, x, keep_checkpoint::naming::ExpertMat::W1, "weight")
                        .is_some();
                if named {
                    if !cfg.raw.is_moe_layer(l) {
                        // A dense layer has no routed experts.
                        experts.push(ExpertWeights {
                            w1: WeightView::f32(&[], 0, 0)?,
                            w2: WeightView::f32(&[], 0, 0)?,
                            w3: WeightView::f32(&[], 0, 0)?,
                            rht: ExpertRht::default(),
                        });
                        continue;
                    }
                    // One tensor per expert, or a slice of mlx-lm's stacked `switch_mlp`.
                    let m = |mat, rows, cols| -> Result<WeightView<'a>> {
                        let em = keep_checkpoint::layout::expert_matrix(ck, &cfg.raw, l, x, mat)
                            .map_err(|msg| ModelError::Expert {
                                layer: l,
                                expert: x,
                                msg,
                            })?;
                        // A registered format's matrix carries every part its kernels read.
                        let resid = keep_checkpoint::layout::residual_of(ck, em.weight.name);
                        crate::weights::expert_view(&em, resid, rows, cols, hint)
                    };
                    use keep_checkpoint::naming::ExpertMat;
                    // keep quant's incoherence markers name the per-expert base names.
                    let b = ExpertMat::ALL.map(|mat| {
                        cfg.raw
                            .expert_tensor(l, x, mat, "weight")
                            .and_then(|n| n.strip_suffix(".weight").map(str::to_string))
                            .unwrap_or_default()
                    });
                    experts.push(ExpertWeights {
                        w1: m(ExpertMat::W1, i, d)?,
                        w2: m(ExpertMat::W2, d, i)?,
                        w3: m(ExpertMat::W3, i, d)?,
                        rht: expert_rht(&marker, [&b[0], &b[1], &b[2]], d, i)?,
                    });
                    continue;
                }
                let p = format!("layers.{l}.ffn.experts.{x}");
                let b = [format!("{p}.w1"), format!("{p}.w2"), format!("{p}.w3")];
                experts.push(ExpertWeights {
                    w1: weight(ck, &b[0], i, d, hint)?,
                    w2: weight(ck, &b[1], d, i, hint)?,
                    w3: weight(ck, &b[2], i, d, hint)?,
                    rht: expert_rht(&marker, [&b[0], &b[1], &b[2]], d, i)?,
                });
            }
        }
        Ok(CheckpointExperts {
            n_experts: e,
            per_layer: (0..cfg.n_layers).map(|l| cfg.experts_in_layer(l)).collect(),
            experts,
        })
    }
}

impl ExpertSource for CheckpointExperts<'_> {
    fn experts_into<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<ExpertWeights<'s>>,
    ) -> Result<()> {
        for &e in experts {
            out.push(self.expert(layer, e)?);
        }
        Ok(())
    }

    fn ready_into(&self, _layer: usize, experts: &[usize], out: &mut Vec<bool>) {
        out.clear();
        out.resize(experts.len(), true);
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        let w = self
            .experts
            .get(layer * self.n_experts + expert)
            .filter(|_| self.per_layer.get(layer).is_some_and(|&n| expert < n))
            .ok_or_else(|| ModelError::Expert {
                layer,
                expert,
                msg: "no such expert".into(),
            })?;
        if w.w1.rows == 0 {
            return Err(ModelError::Expert {
                layer,
                expert,
                msg: "layer not resolved by this source".into(),
            });
        }
        Ok(*w)
    }
}

/// The checkpoint names of routed expert `expert` of `layer` (gate, down, up bases without
/// `.weight`).
pub fn expert_bases(layer: usize, expert: usize) -> [String; 3] {
    keep_checkpoint::naming::ExpertMat::ALL.map(|m| {
        keep_checkpoint::qwen3::expert_tensor(layer, expert, m, "weight")
            .trim_end_matches(".weight")
            .to_string()
    })
}
