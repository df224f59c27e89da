//! keep-model: the DeepSeek-V4.1 and DeepSeek-V4 / V4-Flash text models, computed in f32 straight
//! from a published checkpoint.
//!
//! What it is: [`ModelConfig`] (validated from `config.json`; V4-Flash's compressors live in
//! [`v4`], its hash routing in [`hash`]), Engram layers ([`engram`], rows from an [`EngramRows`]
//! source), [`Model`] (weights as zero-copy views of the mmap'd
//! shards in their shipped formats: FP8-block, MXFP8, MXFP4, bf16, f32), [`Cache`] for incremental
//! decoding, [`Model::forward`] (prefill and decode share one code path), a layer-streamed path
//! ([`streamed::forward_streamed`]) that loads one layer at a time and runs every record through
//! it with the same per-layer function (so its logits are bit-identical to the whole-model
//! forward), low-rank [`Sidecar`]s added to a pruned MoE block's output when the checkpoint
//! has them, [`RouteObserver`] hooks for calibration (no cost when none is attached), a router
//! mask hook, and keep's one [`generate()`] (prompt encoding with the model's tokenizer,
//! sampling, end-of-sequence stops, the streaming detokenizer, timings) over the [`Generate`]
//! trait, and `keep logits`' forward ([`logits::logits`], gathered into keep-artifacts'
//! logits file). The specification is mlx-lm 0.32.2's
//! `mlx_lm/models/deepseek_v41.py` for V4.1 and transformers 5.23's `modeling_deepseek_v4.py`
//! for V4 (`docs/v4flash.md` lists every difference); each module names the reference function
//! it follows.
//!
//! What it is not: no printing, no CLI, no knowledge of where routed-expert bytes
//! come from: the MoE layer asks an [`ExpertSource`] (the default reads the checkpoint mapping;
//! keep-runtime's SSD slot cache plugs in the same way).
//!
//! Depends on: `keep-checkpoint` (tensors, config), `keep-kernels` (all arithmetic),
//! `keep-artifacts` (the logits file), `keep-rng` (sampling, synthetic prompts).

pub mod autodraft;
pub mod batch;
pub mod cache;
pub mod config;
pub mod drafting;
pub mod dspark;
mod dspark_drafting;
pub mod engram;
pub mod engram_hash;
pub mod engram_tokens;
pub mod error;
pub mod experts;
pub mod family;
pub mod family_layer;
pub mod fuzzing;
pub mod generate;
pub mod globals;
pub mod hash;
pub mod layer;
pub mod linear;
pub mod logits;
pub mod memory;
pub mod model;
pub mod mtp;
pub mod observer;
pub mod options;
pub mod qwen3;
pub mod scratch;
pub mod sidecar;
pub mod streamed;
pub mod v4;
pub mod weights;

pub use cache::{Cache, LayerCache};
pub use config::ModelConfig;
pub use dspark::{DSpark, DraftBlock};
pub use engram::{Engram, EngramRows, TableRows};
pub use engram_hash::EngramLayout;
pub use error::ModelError;
pub use experts::{
    CheckpointExperts, ExpertRht, ExpertSource, ExpertTiers, ExpertWeights, MatRht, Rung, Tiered,
    UpperChoice,
};
pub use generate::{
    generate, Decoder, GenStats, Generate, GenerateOptions, Piece, Prompt, Sampled, Sampler,
    SamplerConfig, TextStream,
};
pub use keep_kernels::Kernels;
pub use memory::{MemoryEstimate, DEFAULT_PREFILL_CHUNK};
pub use model::{Logits, Model};
pub use mtp::{Mtp, MtpCache};
pub use observer::{
    CandidateOutputEvent, ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver, RungEvent,
};
pub use options::RunOptions;
pub use sidecar::Sidecar;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ModelError>;
