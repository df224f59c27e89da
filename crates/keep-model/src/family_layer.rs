//! The Hugging Face families' layers behind one type ([`FamilyLayer`]), for the code that runs a
//! layer without caring which family it is (the whole model and the layer-streamed forward), and
//! the one place that maps a config's family to its decoder-layer side ([`layer_family`]). Each
//! family's layer implements [`DecoderLayer`] (one residual stream, its KV in the layer's
//! [`KvRows`]); DeepSeek V4's layers ([`crate::layer::LayerWeights`]) are not one of them. The
//! routed experts come from [`FamilyLayer::experts`], the source the family's layers read them
//! from, and the embedding, final norm and head from [`FamilyLayer::globals`].

#[path = "deepseek_v3.rs"]
pub mod deepseek_v3;
#[path = "gpt_oss.rs"]
pub mod gpt_oss;

use keep_checkpoint::Checkpoint;

use crate::cache::KvRows;
use crate::config::{Family, ModelConfig};
use crate::experts::ExpertSource;
use crate::family::{DecoderLayer, LayerFamily};
use crate::globals::Globals;
use crate::observer::RouteObserver;
use crate::scratch::Scratch;
use crate::Result;

/// Every Hugging Face family the model runs, with its decoder-layer side: a new family is its
/// module declared above and one line here.
static LAYER_FAMILIES: &[(Family, &dyn LayerFamily)] = &[
    (Family::Qwen3Moe, &crate::qwen3::Qwen3Moe),
    (Family::DeepseekV3, &deepseek_v3::DeepseekV3),
    (Family::GptOss, &gpt_oss::GptOss),
];

/// The decoder-layer side of `family`; `None` for DeepSeek V4 / V4.1 (whose layers are
/// [`crate::layer::LayerWeights`]).
pub fn layer_family(family: Family) -> Option<&'static dyn LayerFamily> {
    LAYER_FAMILIES
        .iter()
        .find(|(f, _)| *f == family)
        .map(|&(_, l)| l)
}

/// Whether `family`'s layers fit and apply sidecars: DeepSeek V4's do, a Hugging Face family's
/// say so ([`LayerFamily::applies_sidecars`]).
pub fn applies_sidecars(family: Family) -> bool {
    layer_family(family).is_none_or(|f| f.applies_sidecars())
}

/// A Hugging Face family's decoder layer.
pub struct FamilyLayer<'a>(Box<dyn DecoderLayer + 'a>);

impl<'a> FamilyLayer<'a> {
    /// Decoder layer `layer` of `cfg`'s family; `None` for DeepSeek V4 (whose layers are
    /// [`crate::layer::LayerWeights`]).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Option<Self>> {
        match layer_family(cfg.family) {
            Some(f) => Ok(Some(FamilyLayer(f.load_layer(ck, cfg, layer)?))),
            None => Ok(None),
        }
    }

    /// Every decoder layer of `cfg`'s family, in order; `None` for DeepSeek V4.
    pub fn load_all(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Option<Vec<Self>>> {
        let Some(f) = layer_family(cfg.family) else {
            return Ok(None);
        };
        (0..cfg.n_layers)
            .map(|l| Ok(FamilyLayer(f.load_layer(ck, cfg, l)?)))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// The decoder layer's index.
    pub fn layer(&self) -> usize {
        self.0.layer()
    }

    /// The embedding, final norm and head as the family names them (DeepSeek V4's through
    /// [`Globals::load`]).
    pub fn globals(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Globals<'a>> {
        match layer_family(cfg.family) {
            Some(f) => f.globals(ck, cfg),
            None => Globals::load(ck, cfg),
        }
    }

    /// The routed experts of `layers` as the family's layers read them (DeepSeek V4's from
    /// [`crate::experts::CheckpointExperts`]).
    pub fn experts(
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layers: std::ops::Range<usize>,
    ) -> Result<Box<dyn ExpertSource + 'a>> {
        match layer_family(cfg.family) {
            Some(f) => f.experts(ck, cfg, layers),
            None => Ok(Box::new(crate::experts::CheckpointExperts::for_layers(
                ck, cfg, layers,
            )?)),
        }
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
        self.0
            .forward(cfg, kernels, experts, mask, x, start_pos, kv, obs)
    }

    /// [`FamilyLayer::forward`] with its intermediates in `sc` (on `sc`'s kernels; no
    /// allocation once warm).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_into(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
    ) -> Result<()> {
        self.0
            .forward_into(cfg, experts, mask, x, start_pos, kv, obs, sc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every Hugging Face family keep-checkpoint reads has a decoder-layer side here, listed
    /// once, and shows as its checkpoint family's type.
    #[test]
    fn every_hugging_face_family_has_layers() {
        for &f in keep_checkpoint::families::FAMILIES {
            if f.is_deepseek_v4() {
                continue;
            }
            let family = Family::HuggingFace(f);
            assert!(layer_family(family).is_some(), "{} has no layers", f.name());
            assert_eq!(format!("{family:?}"), format!("{f:?}"));
        }
        for (i, (a, _)) in LAYER_FAMILIES.iter().enumerate() {
            assert!(a.is_hugging_face());
            assert!(
                LAYER_FAMILIES[..i].iter().all(|(b, _)| b != a),
                "{a:?} twice"
            );
        }
        assert!(layer_family(Family::V4).is_none() && layer_family(Family::V41).is_none());
    }
}
