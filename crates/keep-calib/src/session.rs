//! Session files: one safetensors file per calibration group (`{RUN}/{group}.safetensors`).
//! The format — tensors, metadata, the atomic writer and the readers — is keep-artifacts'
//! `session`; these are its names as calibration uses them.

use std::path::Path;

pub use keep_artifacts::session::{
    imatrix_tensors as imatrix_tensors_of, read_records, read_sums, read_teacher, session_path,
    write_session, SessionIdentity, SessionState, SessionSums, IMATRIX_FORMAT, SESSION_FORMAT,
    SESSION_VERSION,
};

use crate::{CalibError, Result};

/// Inspect a session file (keep-artifacts' `session_state`): complete, partial (redo), or
/// [`CalibError::Mismatch`] when it is a complete session of another model or pack (never
/// overwritten).
pub fn session_state(path: &Path, id: &SessionIdentity) -> Result<SessionState> {
    keep_artifacts::session::session_state(path, id).map_err(|e| match e {
        keep_artifacts::ArtifactError::Mismatch(m) => CalibError::Mismatch(m),
        e => e.into(),
    })
}
