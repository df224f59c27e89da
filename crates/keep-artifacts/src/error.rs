//! Typed errors of the artifact readers and writers: each names the file and, where there is
//! one, the tensor, and says what the user can do next.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing an artifact.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The checkpoint layer could not read or write a file.
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    /// An operating-system error on a file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A tensor (or its metadata) is malformed.
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// A file or run directory as a whole is unusable.
    #[error("{path}: {msg}")]
    Trace { path: PathBuf, msg: String },
    /// Files of one run disagree (layers, expert counts, top-k).
    #[error("{path}: {msg}")]
    Inconsistent { path: PathBuf, msg: String },
    /// A file is not what its format says (JSON, format tag, version, ranges).
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    /// A file does not belong to the model or the other files it is used with.
    #[error("{0}")]
    Mismatch(String),
    /// A writer was asked for something it cannot store.
    #[error("{0}")]
    Config(String),
}

impl ArtifactError {
    /// Wrap an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ArtifactError::Io {
            path: path.into(),
            source,
        }
    }
    /// A malformed file.
    pub fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        ArtifactError::Invalid {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub(crate) fn tensor(path: &std::path::Path, tensor: &str, msg: impl Into<String>) -> Self {
        ArtifactError::Tensor {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            msg: msg.into(),
        }
    }
}
