//! keep-convert: checkpoint transformations that need to look at weights.
//!
//! What it is: `synth` (random-weight checkpoints in DeepSeek's published format, encoded the
//! way DeepSeek ships them), `inspect` (what a checkpoint holds, bytes and bits per weight by role
//! and format, and everything inconsistent), and `repack` (FP8-block residents → MXFP8 byte for
//! byte, or → bf16; everything else copied), and `prune` (byte copy following a keep-artifacts
//! prune plan). It sits between `keep-checkpoint`, which only moves
//! bytes, and `keep-format`, which only codes numbers.
//!
//! What it is not: a model (nothing here runs a forward pass) and not a user interface (nothing
//! prints; reports are returned as data and errors are typed).
//!
//! Depends on: keep-format, keep-checkpoint, keep-artifacts (the prune plan), keep-rng + rand/rand_distr (synth), rayon.

#![recursion_limit = "512"]

pub mod copy;
pub mod error;
pub mod fuzzing;
pub mod inspect;
pub mod presets;
pub mod prune;
pub mod repack;
pub mod resident;
pub mod synth;
pub mod synth_deepseek_v3;
pub mod synth_gpt_oss;
pub mod synth_qwen3;

pub use error::ConvertError;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ConvertError>;
