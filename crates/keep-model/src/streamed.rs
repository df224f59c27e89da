//! Layer-streamed forward: load one layer's weights, run every record through it, release it,
//! go on. Each record keeps its own streams, cache and shared state; every layer runs through
//! the same [`LayerWeights::forward`] the whole model uses, so the logits are bit-identical to
//! [`Model::forward`](crate::Model::forward) on the same records. Peak memory is one layer's
//! resolved weights plus the records' activations and caches (weights are views of the
//! checkpoint mapping: file-backed pages the kernel can drop once the layer is released).
//!
//! Routed experts come from an [`ExpertSource`]; by default one resolved per layer.

use keep_checkpoint::Checkpoint;

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::experts::{CheckpointExperts, ExpertSource};
use crate::layer::{LayerWeights, Shared};
use crate::model::{step_of, Globals, Logits};
use crate::observer::RouteObserver;
use crate::Result;

/// Options of a streamed run.
pub struct StreamOptions<'o> {
    pub logits: Logits,
    /// Router masks per layer (`None`: no mask).
    pub masks: Vec<Option<Vec<bool>>>,
    /// Called after each layer with the layer index (progress).
    pub on_layer: Option<&'o mut dyn FnMut(usize)>,
}

/// Run `records` (each a token sequence from position 0) through the model one layer at a time.
/// `obs` sees layer-major order: layer 0 for every record, then layer 1, …
pub fn forward_streamed(
    ck: &Checkpoint,
    records: &[Vec<u32>],
    mut opts: StreamOptions,
    mut obs: Option<&mut dyn RouteObserver>,
) -> Result<Vec<Vec<f32>>> {
    let cfg = ModelConfig::from_deepseek(ck.require_config()?)?;
    let globals = Globals::load(ck, &cfg)?;
    let mut states = Vec::with_capacity(records.len());
    for r in records {
        let cache = Cache::new(cfg.n_layers);
        let s = globals.embed(&cfg, r)?;
        states.push((
            s,
            cache,
            Shared::default(),
            step_of(&cfg, &Cache::new(cfg.n_layers)),
        ));
    }
    for l in 0..cfg.n_layers {
        let lw = LayerWeights::load(ck, &cfg, l)?;
        let experts = CheckpointExperts::for_layers(ck, &cfg, l..l + 1)?;
        let mask = opts.masks.get(l).and_then(|m| m.as_deref());
        for (s, cache, shared, step) in states.iter_mut() {
            if s.t == 0 {
                continue;
            }
            lw.forward(
                &cfg,
                &experts as &dyn ExpertSource,
                mask,
                s,
                *step,
                &mut cache.layers,
                shared,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
            )?;
        }
        drop(experts);
        drop(lw);
        if let Some(f) = opts.on_layer.as_deref_mut() {
            f(l);
        }
    }
    states
        .iter()
        .map(|(s, ..)| {
            if s.t == 0 {
                Ok(vec![])
            } else {
                globals.finish(&cfg, s, opts.logits)
            }
        })
        .collect()
}
