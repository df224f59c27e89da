//! Typed errors of the calibration layer. Every refusal names the file, session or tensor and
//! says what to do next; nothing here prints or panics on input.

use std::path::PathBuf;

/// What can go wrong building packs, calibrating, finalizing or selecting.
#[derive(Debug, thiserror::Error)]
pub enum CalibError {
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    #[error(transparent)]
    Model(#[from] keep_model::ModelError),
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),
    /// A file could not be read or written.
    #[error("{path}: {err}")]
    Io {
        path: PathBuf,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: std::io::Error,
    },
    /// A file is not what it should be (format, version, shape, JSON).
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    /// Something does not belong together (model vs pack, run vs model, tokenizer vs pack).
    #[error("{0}")]
    Mismatch(String),
    /// Finalize found sessions it cannot sum; each is named.
    #[error("{0}")]
    Sessions(String),
    /// A bad option.
    #[error("{0}")]
    Options(String),
    /// The tokenizer failed.
    #[error("tokenizer {path}: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    /// A task check could not run (python3 missing or failing, a temporary file).
    #[error("{0}")]
    Task(String),
    /// Drawing the plot failed.
    #[error("plot {path}: {msg}")]
    Plot { path: PathBuf, msg: String },
}

impl CalibError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CalibError::Io {
            path: path.into(),
            err: source,
        }
    }
    /// A malformed file.
    pub fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        CalibError::Invalid {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
