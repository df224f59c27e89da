//! keep-checkpoint: Hugging Face model directories in DeepSeek's published layout.
//!
//! What it is: zero-copy (mmap) reading of one or many `*.safetensors` shards with a hostile-input
//! header parser, the `model.safetensors.index.json` index, `config.json` as DeepSeek publishes
//! it, the one place where DeepSeek V4/V4.1 tensor names are understood ([`naming`]), every
//! model family keep reads behind one trait ([`Family`]: DeepSeek V4, Qwen3-MoE, DeepSeek-V3,
//! gpt-oss, each listed once in [`families::FAMILIES`]; a config is read by the family owning
//! its `model_type` and answers through [`DeepSeekConfig::family`]), the one
//! classification of how a weight is stored and the one check of the tensors against the config
//! ([`layout`], shared by inspect, repack, the model's loader and the runtime's budget), and an
//! atomic writer that shards, writes the index and a `SHA256SUMS` file, building the output in a
//! sibling temporary directory and renaming it into place only when complete, and single files
//! written the same way ([`atomic`]; single safetensors files: [`tensor_file`], whose header
//! builder the shard writer shares).
//!
//! What it is not: it never decodes weights (bytes are copied, never interpreted: that is
//! `keep-format`'s job), it never prints, and it never panics on input: every problem is a typed
//! [`CheckpointError`] naming the file and tensor.
//!
//! Depends on: nothing of keep's (not even `keep-format`); `memmap2`, `serde_json`, `sha2`, `half`
//! (f16 tensors of single files).

pub mod atomic;
pub mod checkpoint;
pub mod config;
pub mod deepseek_v4;
pub mod dtype;
pub mod error;
pub mod families;
pub mod family;
pub mod fingerprint;
pub mod fuzzing;
pub mod incoherence;
pub mod index;
pub mod layout;
pub mod naming;
pub mod qwen3;
pub mod safetensors;
pub mod small_file;
pub mod sums;
pub mod tensor_file;
pub mod writer;

pub use checkpoint::{Checkpoint, TensorRef};
pub use config::{DSparkKeys, DeepSeekConfig};
pub use dtype::Dtype;
pub use error::CheckpointError;
pub use family::Family;
pub use safetensors::{ShardFile, TensorInfo};
pub use writer::{CheckpointWriter, TensorMeta, WriterOptions};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, CheckpointError>;
