//! keep-runtime: run a DeepSeek-V4.1 Mixture-of-Experts checkpoint whose routed experts do not
//! fit in memory, inside a memory budget the user sets.
//!
//! What it is: the [`ExpertStore`] (each routed expert addressed as (layer, expert) → extents
//! in the checkpoint's own safetensors shards, read with positional `O_DIRECT` reads into
//! aligned buffers by a small [`IoPool`]), the [`SlotCache`] (per layer a fixed number of slots
//! with an expert→slot map and a [`Policy`]: LRU, decay or static, keep-residency's own;
//! optional warm start), the budget split ([`BudgetPlan`]), the route recorder ([`RouteLog`], `keep-routes` v1), and
//! [`BudgetedModel`], which plugs the cache into keep-model as its `ExpertSource` and implements
//! keep-model's `Generate`, and one `keep run` ([`run`]: [`RunModel`], mapped or budgeted, driven
//! by keep-model's one `generate`, measured in a [`RunReport`] that becomes keep-artifacts'
//! `keep-run-stats` file), assembled once from a spec by a [`Session`] (checkpoint, run options,
//! budget, drafting) for `keep run`, `keep serve`, `keep eval --tasks`, `keep fit --check` and
//! `keep logits`. The model never learns where an expert's bytes came from. Engram table rows
//! come from the [`EngramStore`] (an LRU row cache inside the budget, reads queued as soon as a
//! forward's token ids are known).
//!
//! What it is not: no printing, no argument parsing (keep-cli), no kernels (keep-kernels), no
//! model arithmetic (keep-model), no trace replay (keep-residency).
//!
//! Depends on: keep-checkpoint (tensor extents, shards), keep-model (the forward and its
//! `ExpertSource`), keep-kernels (weight views), keep-residency (the replacement policies,
//! shared with the simulator), libc (`pread`, `O_DIRECT`, `posix_fadvise`).

pub mod aligned;
pub mod budget;
pub mod cache;
pub mod engram;
pub mod error;
pub mod io;
pub mod policy;
pub mod probe;
pub mod routes;
pub mod run;
pub mod runtime;
pub mod session;
pub mod store;

pub use budget::{
    check_machine, machine_memory_bytes, resident_bytes, BudgetPlan, EngramShare, SlotNeeds,
    FIXED_OVERHEAD,
};
pub use cache::{CacheStats, GuessStats, LayerStats, SlotCache, TierStats};
pub use engram::{EngramStats, EngramStore};
pub use error::RuntimeError;
pub use io::{IoPool, DEFAULT_IO_THREADS};
/// keep-kernels' forward profiler (`keep run --profile`), re-exported for the CLI.
pub use keep_kernels::cpu::set_threads;
pub use keep_kernels::profile;
pub use policy::Policy;
pub use routes::{warm_scores, RouteLog};
pub use run::{RunInfo, RunModel, RunReport};
pub use runtime::{
    engram_rows_above, engram_rows_from_store, peak_rss_bytes, reset_peak_rss, rss_bytes,
    BudgetedModel, RuntimeOptions, TierOptions, DEFAULT_ENGRAM_CACHE, DEFAULT_RESIDUAL_IO_THREADS,
    ENGRAM_SSD_THRESHOLD,
};
pub use session::{Draft, LoadFor, Session, SessionSpec};
pub use store::{ExpertStore, ReadGate};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, RuntimeError>;
