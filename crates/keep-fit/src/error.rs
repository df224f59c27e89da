//! keep-fit's typed errors: each names what failed and, where the user can act, what to do.

use std::path::PathBuf;

/// An error of planning or applying a fit plan.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),
    #[error(transparent)]
    Runtime(#[from] keep_runtime::RuntimeError),
    #[error(transparent)]
    Model(#[from] keep_model::ModelError),
    #[error(transparent)]
    Residency(#[from] keep_residency::ResidencyError),
    #[error(transparent)]
    Calib(#[from] keep_calib::CalibError),
    #[error(transparent)]
    Convert(#[from] keep_convert::ConvertError),
    /// The plan's derived checkpoint is missing: the commands that build it.
    #[error("{dir} does not exist; build it with:\n  {}\n(or pass --build to build it now)", commands.join("\n  "))]
    NotBuilt { dir: PathBuf, commands: Vec<String> },
    /// Nothing fits the memory (or the quality bound).
    #[error("{0}")]
    NoFit(String),
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("{0}")]
    Invalid(String),
}
