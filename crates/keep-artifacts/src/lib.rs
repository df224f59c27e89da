//! keep-artifacts: the files one stage of keep writes for another to read, each defined here
//! once — its tensors and `__metadata__` (with `format` and `version`), one typed reader, one
//! atomic writer and a round-trip test.
//!
//! What it is: route traces ([`routes`], `keep-routes` v1: written by calibration, by the
//! residency simulator's synthetic traces and by `keep run --record-routes`; read by `keep
//! residency` and the runtime's warm start); prune plans ([`plan`], `keep-prune-plan` v1
//! JSON: written by `keep select`, read by `keep prune`, `keep eval` and `keep bench prune`; with
//! [`hashremap`], how a pruned hash-routed layer's `tid2eid` replaces its removed experts);
//! REAP statistics ([`reap`], `keep-reap-stats` v1: the per-layer sums calibration sessions
//! carry and `keep finalize` writes; read by `keep select`, `keep residency --warm-start reap`
//! and the runtime's warm start); calibration sessions ([`session`], `keep-calib-session` v1,
//! and the summed `keep-imatrix`: written by `keep calibrate` and `keep finalize`, read by
//! `keep finalize` and `keep eval`); `keep logits`' file ([`logits`], `keep-logits` v1); and
//! `keep run --stats-json` ([`run_stats`], `keep-run-stats` v1); precision-tier allocations
//! ([`alloc`], `keep-alloc` v1 JSON: written by `keep alloc`, read by `keep quant --alloc` and
//! `keep eval --alloc`/`--tiers`); bench evidence rows
//! ([`bench`], `keep-killtest` and `keep-side-by-side`: written by `keep bench kill-tests`,
//! `repack` and `prune`, read by `keep bench summary`); fit plans ([`fit_plan`], `keep-fit-plan`
//! v1 JSON: written by `keep fit`, read by `keep run --plan`, `keep serve --plan` and `keep fit
//! --check`) and route profiles ([`route_profile`], `keep-route-profile` v1: per layer and expert
//! use counts and decayed scores the runtime keeps across runs beside a plan). [`st`] holds the typed reads
//! the safetensors artifacts share; every one of them is written by keep-checkpoint's
//! `tensor_file`.
//!
//! What it is not: no model, no simulation, no printing; it never panics on input — every
//! problem is a typed [`ArtifactError`] naming the file and tensor.
//!
//! Depends on: keep-checkpoint (safetensors reading and writing, the atomic writer), thiserror,
//! half (f16 gate weights), serde and serde_json (the JSON artifacts).

pub mod alloc;
pub mod bench;
pub mod error;
pub mod fit_plan;
pub mod fuzzing;
pub mod hashremap;
mod json;
pub mod logits;
pub mod plan;
pub mod reap;
pub mod route_profile;
pub mod routes;
pub mod run_stats;
pub mod session;
pub mod st;

pub use error::ArtifactError;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ArtifactError>;
