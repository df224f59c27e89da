//! keep-model: the DeepSeek-V4.1 text model, computed in f32 straight from a published checkpoint.
//!
//! What it is: [`ModelConfig`] (validated from `config.json`; engram layers and V4-Flash's
//! hash-routed layers are refused by key), [`Model`] (weights as zero-copy views of the mmap'd
//! shards in their shipped formats: FP8-block, MXFP8, MXFP4, bf16, f32), [`Cache`] for incremental
//! decoding, [`Model::forward`] (prefill and decode share one code path), a layer-streamed path
//! ([`streamed::forward_streamed`]) that loads one layer at a time and runs every record through
//! it with the same per-layer function (so its logits are bit-identical to the whole-model
//! forward), [`RouteObserver`] hooks for calibration (no cost when none is attached), a router
//! mask hook, and sampling/generation helpers. The specification is mlx-lm 0.32.2's
//! `mlx_lm/models/deepseek_v41.py`; each module names the reference function it follows.
//!
//! What it is not: no tokenizer, no printing, no CLI, no knowledge of where routed-expert bytes
//! come from: the MoE layer asks an [`ExpertSource`] (the default reads the checkpoint mapping;
//! issue 8's SSD slot cache plugs in the same way).
//!
//! Depends on: `keep-checkpoint` (tensors, config), `keep-kernels` (all arithmetic).

pub mod cache;
pub mod config;
pub mod error;
pub mod experts;
pub mod generate;
pub mod layer;
pub mod model;
pub mod observer;
pub mod streamed;
pub mod weights;

pub use cache::{Cache, LayerCache};
pub use config::ModelConfig;
pub use error::ModelError;
pub use experts::{CheckpointExperts, ExpertSource, ExpertWeights};
pub use generate::{Generate, Sampler, SamplerConfig};
pub use model::{Logits, Model};
pub use observer::{ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
