//! keep-fit: from "this much memory" to a plan — which checkpoint (experts kept by REAP),
//! which budget, hot-set policy, warm start and kernels — with a predicted speed and a
//! predicted quality, each marked with where it came from, and the plan's application and
//! check.
//!
//! What it is: the probes ([`probe`]: the memory the machine has; one short budgeted decode at
//! the model's own shapes measuring the direct-I/O read bandwidth of its expert bytes, the
//! seconds a miss costs and the compute seconds per token), the search ([`search`]: REAP
//! levels × policies × the hot set the memory leaves, speed from keep-residency's replay of the
//! run's routes, quality from [`quality`]'s measured or interpolated KL), the application of a
//! plan ([`apply`]: the derived checkpoint built or refused with its command, the runtime's
//! options, the persistent route profile folded in after each run) and [`check`] (run the plan,
//! measured against predicted). The files are keep-artifacts' `fit_plan` and `route_profile`.
//!
//! What it is not: no printing or argument parsing (keep-cli), no model arithmetic
//! (keep-model), no replay (keep-residency), no slot cache (keep-runtime).
//!
//! Depends on: keep-artifacts, keep-checkpoint, keep-model, keep-runtime, keep-residency,
//! keep-calib (selection, eval), keep-convert (prune), serde.

pub mod apply;
pub mod check;
pub mod checkset;
pub mod error;
pub mod probe;
pub mod quality;
pub mod search;

pub use error::FitError;
pub use search::{fit, FitOptions, FitOutcome};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, FitError>;
