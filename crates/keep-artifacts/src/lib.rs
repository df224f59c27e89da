//! keep-artifacts: the files one stage of keep writes for another to read, each defined here
//! once — its tensors and `__metadata__` (with `format` and `version`), one typed reader, one
//! atomic writer and a round-trip test.
//!
//! What it is: route traces ([`routes`], `keep-routes` v1: written by calibration, by the
//! residency simulator's synthetic traces and by `keep run --record-routes`; read by `keep
//! residency` and the runtime's warm start) and prune plans ([`plan`], `keep-prune-plan` v1
//! JSON: written by `keep select`, read by `keep prune`, `keep eval` and `keep bench prune`; with
//! [`hashremap`], how a pruned hash-routed layer's `tid2eid` replaces its removed experts).
//!
//! What it is not: no model, no simulation, no printing; it never panics on input — every
//! problem is a typed [`ArtifactError`] naming the file and tensor.
//!
//! Depends on: keep-checkpoint (safetensors reading and writing, the atomic writer), thiserror,
//! half (f16 gate weights), serde and serde_json (the JSON artifacts).

pub mod error;
pub mod fuzzing;
pub mod hashremap;
pub mod plan;
pub mod routes;
pub mod run_stats;

pub use error::ArtifactError;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ArtifactError>;
