//! [`RuntimeError`]: what can go wrong when running a model inside a memory budget — a budget too
//! small for the residents plus top-k slots per layer (naming the bytes needed), an expert the
//! checkpoint does not lay out as expected, a failed read, a bad warm-start or route file.

use std::path::PathBuf;

use thiserror::Error;

/// Errors of keep-runtime.
#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),

    /// A route file could not be read or written.
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),

    #[error(transparent)]
    Model(#[from] keep_model::ModelError),

    /// The budget cannot hold the resident weights, the context and top-k slots in every layer.
    #[error(
        "--memory-budget {budget} bytes is too small: the resident weights take {residents} bytes{held}, \
         a context of {context} tokens takes {context_bytes} more (decoding cache {cache} + \
         activations {activations} of one {chunk}-token pass), and {layers} MoE layers × top-k \
         {top_k} slots × {slot_bytes} bytes per slot take {slots} more, so at least {needed} bytes \
         ({needed_gib:.2} GiB) are needed; give a budget ≥ {needed} or a shorter context",
        needed_gib = *.needed as f64 / (1u64 << 30) as f64
    )]
    BudgetTooSmall {
        budget: u64,
        residents: u64,
        /// What the residents' share holds besides the weights, in words (`, of which the
        /// Engram row cache (--engram-cache) takes N`), or empty.
        held: Box<str>,
        context: usize,
        context_bytes: u64,
        cache: u64,
        activations: u64,
        chunk: usize,
        layers: usize,
        top_k: usize,
        slot_bytes: u64,
        slots: u64,
        needed: u64,
    },

    /// A routed expert's tensors are missing or not where the model expects them.
    #[error("layer {layer}, expert {expert}: {msg}")]
    Layout {
        layer: usize,
        expert: usize,
        msg: String,
    },

    /// An I/O error on a file.
    #[error("{path}: {err}")]
    Io {
        path: PathBuf,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: std::io::Error,
    },

    /// A warm-start or route file that cannot be used.
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },

    /// A bad option.
    #[error("{0}")]
    Invalid(String),
}

impl RuntimeError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            path: path.into(),
            err: source,
        }
    }
}
