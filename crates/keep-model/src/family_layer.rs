//! One decoder layer of a Hugging Face family (Qwen3-MoE, DeepSeek-V3, gpt-oss) behind one
//! type, for the code that runs a layer without caring which family it is (the layer-streamed
//! forward). Each family's layer has the same `load` and `forward` (one residual stream, its KV
//! in the layer's [`KvRows`]); DeepSeek V4's layers ([`crate::layer::LayerWeights`]) are not
//! one of them. The routed experts come from [`FamilyLayer::experts`], the source the family's
//! layers read them from, and the embedding, final norm and head from [`FamilyLayer::globals`].

use keep_checkpoint::Checkpoint;

use crate::cache::KvRows;
use crate::config::{Family, ModelConfig};
use crate::experts::{CheckpointExperts, ExpertSource};
use crate::globals::Globals;
use crate::observer::RouteObserver;
use crate::Result;

/// A Hugging Face family's decoder layer (one at a time is held, so the variants' sizes need
/// not match).
#[allow(clippy::large_enum_variant)]
pub enum FamilyLayer<'a> {
    Qwen3(crate::qwen3::Qwen3Layer<'a>),
    DeepseekV3(crate::deepseek_v3::DeepseekV3Layer<'a>),
    GptOss(crate::gpt_oss::GptOssLayer<'a>),
}

impl<'a> FamilyLayer<'a> {
    /// Decoder layer `layer` of `cfg`'s family; `None` for DeepSeek V4 (whose layers are
    /// [`crate::layer::LayerWeights`]).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Option<Self>> {
        Ok(Some(match cfg.family {
            Family::Qwen3Moe => FamilyLayer::Qwen3(crate::qwen3::Qwen3Layer::load(ck, cfg, layer)?),
            Family::DeepseekV3 => {
                FamilyLayer::DeepseekV3(crate::deepseek_v3::DeepseekV3Layer::load(ck, cfg, layer)?)
            }
            Family::GptOss => {
                FamilyLayer::GptOss(crate::gpt_oss::GptOssLayer::load(ck, cfg, layer)?)
            }
            _ => return Ok(None),
        }))
    }

    /// The embedding, final norm and head as the family names them (gpt-oss's own; every
    /// other family's through [`Globals::load`]).
    pub fn globals(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Globals<'a>> {
        match cfg.family {
            Family::GptOss => crate::gpt_oss::globals(ck, cfg),
            _ => Globals::load(ck, cfg),
        }
    }

    /// The routed experts of `layers` as the family's layers read them (gpt-oss's slices of
    /// its MXFP4 stacks, every other family's from [`CheckpointExperts`]).
    pub fn experts(
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layers: std::ops::Range<usize>,
    ) -> Result<Box<dyn ExpertSource + 'a>> {
        Ok(match cfg.family {
            Family::GptOss => Box::new(crate::gpt_oss::GptOssExperts::new(ck, cfg)?),
            _ => Box::new(CheckpointExperts::for_layers(ck, cfg, layers)?),
        })
    }

    /// The layer's forward over the rows `x` (positions from `start_pos`) on `kernels`, its KV
    /// in `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        kernels: crate::Kernels,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        match self {
            FamilyLayer::Qwen3(l) => l.forward(cfg, kernels, experts, mask, x, start_pos, kv, obs),
            FamilyLayer::DeepseekV3(l) => {
                l.forward(cfg, kernels, experts, mask, x, start_pos, kv, obs)
            }
            FamilyLayer::GptOss(l) => l.forward(cfg, kernels, experts, mask, x, start_pos, kv, obs),
        }
    }
}
