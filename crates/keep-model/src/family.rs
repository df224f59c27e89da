//! The decoder-layer side of a Hugging Face model family (each listed in
//! [`crate::family_layer::layer_family`]): [`LayerFamily`] loads a family's decoder layer, its
//! embedding, norm and head, and the source its layers read routed experts from, and sizes the
//! KV its layers keep; [`DecoderLayer`] is one loaded layer's forward over the engine's shared
//! pieces (`WeightView`s, the router, the [`ExpertSource`], the observers).
//!
//! Each family implements both in its own module; [`crate::family_layer::layer_family`] lists
//! them and picks the family of a config. The calls are
//! per layer (one virtual call per layer and forward), never inside a layer's loops, and a
//! warm forward allocates nothing more than the layer's own code does.

use std::ops::Range;

use keep_checkpoint::Checkpoint;

use crate::cache::KvRows;
use crate::config::ModelConfig;
use crate::experts::{CheckpointExperts, ExpertSource};
use crate::globals::Globals;
use crate::observer::RouteObserver;
use crate::scratch::Scratch;
use crate::Result;

/// One decoder layer of a Hugging Face family: one residual stream, its KV in the layer's
/// [`KvRows`].
pub trait DecoderLayer: Send + Sync {
    /// The decoder layer's index.
    fn layer(&self) -> usize;

    /// The layer's forward over the rows `x` (`[t × hidden]`, in place) at positions
    /// `start_pos..start_pos + t`, appending its keys and values to `kv`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        let mut sc = Scratch::on(kernels);
        self.forward_into(cfg, experts, mask, x, start_pos, kv, obs, &mut sc)
    }

    /// [`DecoderLayer::forward`] with its intermediates in `sc` (no allocation once warm).
    #[allow(clippy::too_many_arguments)]
    fn forward_into(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
    ) -> Result<()>;
}

/// The decoder-layer side of one Hugging Face family.
pub trait LayerFamily: Sync {
    /// Decoder layer `layer` of `cfg`, its weights resolved from `ck`.
    fn load_layer<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Box<dyn DecoderLayer + 'a>>;

    /// The embedding, final norm and head as the family names them (by default Hugging Face's
    /// `model.embed_tokens`, `model.norm`, `lm_head` or the tied embedding).
    fn globals<'a>(&self, ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Globals<'a>> {
        Globals::load_hugging_face(ck, cfg)
    }

    /// The routed experts of `layers` as the family's layers read them (by default each
    /// expert's own tensors or slices of a stack, [`CheckpointExperts`]).
    fn experts<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layers: Range<usize>,
    ) -> Result<Box<dyn ExpertSource + 'a>> {
        Ok(Box::new(CheckpointExperts::for_layers(ck, cfg, layers)?))
    }

    /// The floats of keys (and as many of values) that decoder layer `layer`'s [`KvRows`] can
    /// hold in a run of `context` tokens whose forwards are at most `chunk` tokens long: what
    /// [`crate::Cache::for_context`] reserves (`ModelConfig::cache_rows`).
    fn kv_floats(&self, cfg: &ModelConfig, layer: usize, context: usize, chunk: usize) -> usize;

    /// Floats of working space a layer's attention holds in a forward of `chunk` tokens on
    /// `threads` worker threads beyond the shared terms of
    /// [`crate::ModelConfig::activation_bytes`] (a latent attention's per-task decoded
    /// `kv_b_proj` rows and its outputs head by head). None by default.
    fn attention_work_floats(&self, _cfg: &ModelConfig, _chunk: usize, _threads: usize) -> usize {
        0
    }

    /// Whether the family's layers fit and apply sidecars (`keep sidecar`: a low-rank map
    /// beside a pruned layer's experts). By default they do not: only DeepSeek V4's layers
    /// ([`crate::layer::LayerWeights`]) carry one.
    fn applies_sidecars(&self) -> bool {
        false
    }
}
