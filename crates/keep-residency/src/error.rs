//! Typed errors of the residency simulator: each names the file and, where there is one, the
//! tensor, and says what the user can do next. The library never prints and never panics on
//! input; the CLI turns these into messages and exit codes.

use std::path::PathBuf;

/// Everything that can go wrong reading traces, reading statistics or writing reports.
#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    /// The checkpoint layer could not read or write a file.
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    /// A route trace could not be read or written.
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),
    /// An operating-system error on a file.
    #[error("{path}: {err}")]
    Io {
        path: PathBuf,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: std::io::Error,
    },
    /// A route tensor (or its metadata) is malformed.
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// A trace file or run directory as a whole is unusable.
    #[error("{path}: {msg}")]
    Trace { path: PathBuf, msg: String },
    /// Sessions of one run disagree (layers, expert counts, top-k).
    #[error("{path}: {msg}")]
    Inconsistent { path: PathBuf, msg: String },
    /// REAP statistics for the `reap` warm start are missing or malformed.
    #[error("{path}: {msg}")]
    Stats { path: PathBuf, msg: String },
    /// The model checkpoint does not have the expert tensors the cost model needs.
    #[error("{msg}")]
    Model { msg: String },
    /// The simulation was asked for something meaningless (no hot-set sizes, zero bandwidth).
    #[error("{0}")]
    Config(String),
    /// The plot could not be drawn or written.
    #[error("{path}: plot: {msg}")]
    Plot { path: PathBuf, msg: String },
}

impl ResidencyError {
    /// Wrap an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ResidencyError::Io {
            path: path.into(),
            err: source,
        }
    }
    pub(crate) fn tensor(path: &std::path::Path, tensor: &str, msg: impl Into<String>) -> Self {
        ResidencyError::Tensor {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            msg: msg.into(),
        }
    }
}
