//! Typed errors of the conversion layer; every refusal names the tensor and what to do.

/// What can go wrong in synth, inspect or repack.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// Reading or writing the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    /// A prune plan is malformed or belongs to another model.
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),
    /// A number-format error (lengths, alignment) on a named tensor.
    #[error("tensor `{tensor}`: {err}")]
    Format {
        tensor: String,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: keep_format::FormatError,
    },
    /// A conversion that would need rounding, refused.
    #[error("refusing tensor `{tensor}`: {reason}")]
    Refused { tensor: String, reason: String },
    /// A bad option or configuration.
    #[error("{0}")]
    Invalid(String),
    /// `--verify` found a difference.
    #[error("verify failed on tensor `{tensor}`: {detail}")]
    VerifyFailed { tensor: String, detail: String },
}
