//! keep-residency: will a hot set of experts plus SSD reads be fast enough — answered before
//! anyone builds the cache, by replaying a model's real routing.
//!
//! What it is: a replay of the route traces that calibration and `keep run --record-routes`
//! write (the format is keep-artifacts' `routes`) through hot-set policies behind one trait — static, LRU, decayed counts, and Belady's
//! optimum as the ceiling ([`policy`]; the realizable ones are also keep-runtime's slot
//! policies, so a prediction is about what `keep run --memory-budget` does) —, a single-threaded replay loop over flat per-layer
//! arrays ([`sim`]), a bytes and tokens/s cost model ([`cost`]), the report with its verdict
//! per hot-set size ([`report`]), its plot ([`plot`]), and synthetic traces with temporal
//! locality for tests and demos ([`synth`]), and precision tiers (base rungs in the hot set,
//! upper stages in a residual LRU cache admitted without waiting: [`tiers`]).
//!
//! What it is not: it never runs the model or reads weights (only tensor byte sizes, through
//! keep-checkpoint); it never prints; it never panics on input — every problem is a typed
//! [`ResidencyError`] naming the file and tensor.
//!
//! Depends on: keep-artifacts (route traces), keep-checkpoint (safetensors reading, atomic
//! writing, naming), serde/serde_json,
//! thiserror, half (f16 gate weights), plotters (PNG/SVG).

pub mod cost;
pub mod draft;
pub mod error;
pub mod plot;
pub mod policy;
pub mod report;
pub mod sim;
pub mod synth;
pub mod tiers;

pub use error::ResidencyError;
pub use policy::PolicyKind;
pub use report::{simulate, HotSizes, Options, Report};
pub use sim::WarmStart;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ResidencyError>;
