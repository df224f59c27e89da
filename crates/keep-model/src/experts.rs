//! Where routed experts' bytes come from: the [`ExpertSource`] trait. The MoE layer asks it for
//! the three matrices of each chosen expert and never learns whether the bytes are resident,
//! mmap'd or read from an SSD slot (keep-runtime's slot cache implements this trait).
//! [`CheckpointExperts`] is the default: views of the mmap'd checkpoint, resolved and
//! shape-checked once at load.

use keep_checkpoint::Checkpoint;
use keep_kernels::WeightView;

use crate::config::{Family, ModelConfig};
use crate::weights::weight;
use crate::{ModelError, Result};

/// One routed expert: `w1` (gate) and `w3` (up) are `[inter, hidden]`, `w2` (down) is
/// `[hidden, inter]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub w1: WeightView<'a>,
    pub w2: WeightView<'a>,
    pub w3: WeightView<'a>,
}

/// A provider of routed-expert weights.
pub trait ExpertSource: Send + Sync {
    /// Expert `expert` of `layer`. The returned views must stay valid while `self` is borrowed.
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>>;

    /// A hint that these experts of `layer` are about to be asked for (one call per layer per
    /// forward, with every expert the batch routes to). Default: nothing.
    fn prefetch(&self, _layer: usize, _experts: &[usize]) {}

    /// Experts `experts` of `layer` at once, so that one kernel call can multiply a token by
    /// all of them: every returned view stays valid until the next call into `self` for
    /// `layer`. At most [`ExpertSource::max_batch`] experts are asked for per call. The default
    /// asks [`ExpertSource::expert`] for each, which is right for sources whose views live as
    /// long as the source (a source that recycles buffers must override both methods).
    fn experts(&self, layer: usize, experts: &[usize]) -> Result<Vec<ExpertWeights<'_>>> {
        experts.iter().map(|&e| self.expert(layer, e)).collect()
    }

    /// The most experts of one layer that [`ExpertSource::experts`] can hand out together
    /// (at least 1). Default: no limit.
    fn max_batch(&self) -> usize {
        usize::MAX
    }
}

/// Experts read from the checkpoint mapping (the format decided per tensor).
pub struct CheckpointExperts<'a> {
    n_experts: usize,
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
        let mut experts = Vec::with_capacity(cfg.n_layers * e);
        for l in 0..cfg.n_layers {
            for x in 0..e {
                if !layers.contains(&l) {
                    // Placeholder for layers not resolved: an empty f32 view is never used.
                    experts.push(ExpertWeights {
                        w1: WeightView::f32(&[], 0, 0)?,
                        w2: WeightView::f32(&[], 0, 0)?,
                        w3: WeightView::f32(&[], 0, 0)?,
                    });
                    continue;
                }
                if cfg.family == Family::Qwen3Moe {
                    if !crate::config::family_config(cfg)?.is_moe_layer(l) {
                        // A dense layer has no routed experts.
                        experts.push(ExpertWeights {
                            w1: WeightView::f32(&[], 0, 0)?,
                            w2: WeightView::f32(&[], 0, 0)?,
                            w3: WeightView::f32(&[], 0, 0)?,
                        });
                        continue;
                    }
                    let [g, dn, u] = expert_bases(l, x);
                    experts.push(ExpertWeights {
                        w1: weight(ck, &g, i, d, hint)?,
                        w2: weight(ck, &dn, d, i, hint)?,
                        w3: weight(ck, &u, i, d, hint)?,
                    });
                    continue;
                }
                let p = format!("layers.{l}.ffn.experts.{x}");
                experts.push(ExpertWeights {
                    w1: weight(ck, &format!("{p}.w1"), i, d, hint)?,
                    w2: weight(ck, &format!("{p}.w2"), d, i, hint)?,
                    w3: weight(ck, &format!("{p}.w3"), i, d, hint)?,
                });
            }
        }
        Ok(CheckpointExperts {
            n_experts: e,
            experts,
        })
    }
}

impl ExpertSource for CheckpointExperts<'_> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        let w = self
            .experts
            .get(layer * self.n_experts + expert)
            .filter(|_| expert < self.n_experts)
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
