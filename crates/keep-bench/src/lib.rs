//! keep-bench: benchmarks that measure side by side in one run and write JSON evidence.
//!
//! What it is: the harness pieces every benchmark shares (cold-cache control, machine
//! description, evidence rows, medians of interleaved runs) and the benchmarks themselves.
//! What it is not: a test suite — nothing here asserts a time; verdicts are recorded with the
//! rule that produced them. Depends on keep-checkpoint and keep-convert, and on keep-format and
//! keep-kernels for the decode-kernel kill tests ([`killtests`], [`pressure`], [`summary`]).

pub mod cache;
pub mod evidence;
pub mod killtests;
pub mod matmul;
pub mod peak;
pub mod pressure;
pub mod prune;
pub mod repack;
pub mod report;
pub mod side;
pub mod summary;

/// Errors of the benchmark harness.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{path}: {err}")]
    Io {
        path: std::path::PathBuf,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: std::io::Error,
    },
    #[error(transparent)]
    Convert(#[from] keep_convert::ConvertError),
    #[error(transparent)]
    Checkpoint(#[from] keep_checkpoint::CheckpointError),
    #[error(transparent)]
    Artifact(#[from] keep_artifacts::ArtifactError),
    #[error("{0}")]
    Invalid(String),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, BenchError>;

/// Median of a non-empty slice (mean of the middle two for even lengths).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}
