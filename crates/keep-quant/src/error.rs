//! The error type of keep-quant: bad input (shapes, non-finite values, a missing imatrix
//! entry named by tensor), and the checkpoint layer's errors passed through.

use thiserror::Error;

/// What went wrong while quantizing.
#[derive(Debug, Error)]
pub enum QuantError {
    /// The input cannot be quantized as asked (the message names the tensor where it can).
    #[error("{0}")]
    Input(String),
    /// The imatrix has no entry for a tensor that must be quantized.
    #[error("the imatrix has no `{key}` for tensor {tensor}: calibrate this model (keep calibrate, keep finalize) so that every routed expert has an imatrix, or leave it out with --experts")]
    MissingImatrix { tensor: String, key: String },
    /// Reading or writing a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    /// A kernel refused a weight.
    #[error(transparent)]
    Kernel(#[from] keep_kernels::KernelError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

/// Result with [`QuantError`].
pub type Result<T> = std::result::Result<T, QuantError>;
