//! keep-artifacts: the files one stage of keep writes for another to read, each defined here
//! once — its tensors and `__metadata__` (with `format` and `version`), one typed reader, one
//! atomic writer and a round-trip test.
//!
//! What it is: route traces ([`routes`], `keep-routes` v1: written by calibration, by the
//! residency simulator's synthetic traces and by `keep run --record-routes`; read by `keep
//! residency` and the runtime's warm start).
//!
//! What it is not: no model, no simulation, no printing; it never panics on input — every
//! problem is a typed [`ArtifactError`] naming the file and tensor.
//!
//! Depends on: keep-checkpoint (safetensors reading and writing), thiserror, half (f16 gate
//! weights).

pub mod error;
pub mod fuzzing;
pub mod routes;

pub use error::ArtifactError;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ArtifactError>;
