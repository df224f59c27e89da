//! Side-by-side timing: a baseline and a subject run in interleaved rounds on the same source,
//! with the source's pages evicted before every timed step, and the ratio of their times.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use crate::cache::{evict_dir, EVICTS};
use crate::evidence::{command_line, machine, Machine};
use crate::{median, Result};

/// The evidence row of a side-by-side benchmark (baseline time / subject time).
#[derive(Debug, Clone, Serialize)]
pub struct SideBySide {
    pub schema_version: u32,
    pub bench: &'static str,
    pub command: String,
    pub machine: Machine,
    pub keep_version: &'static str,
    pub source: String,
    pub baseline: &'static str,
    pub subject: &'static str,
    /// Bytes the baseline moves (for its GB/s).
    pub baseline_bytes: u64,
    /// Bytes the subject reads (for its GB/s).
    pub subject_bytes: u64,
    pub cold_reads: bool,
    pub rounds: usize,
    pub baseline_seconds: Vec<f64>,
    pub subject_seconds: Vec<f64>,
    pub ratios: Vec<f64>,
    pub median_ratio: f64,
    pub baseline_gbps_median: f64,
    pub subject_gbps_median: f64,
    pub goal: f64,
    pub verdict: &'static str,
    pub rule: String,
}

/// What to compare.
pub struct Spec<'a> {
    pub bench: &'static str,
    pub baseline: &'static str,
    pub subject: &'static str,
    pub baseline_bytes: u64,
    pub subject_bytes: u64,
    pub goal: f64,
    pub run_baseline: &'a dyn Fn() -> Result<()>,
    pub run_subject: &'a dyn Fn() -> Result<()>,
    /// Called after each step to remove its output (untimed).
    pub cleanup: &'a dyn Fn(),
}

/// Run `rounds` interleaved rounds (baseline, subject, baseline, ...) with `src` evicted before
/// each timed step.
pub fn run(src: &Path, rounds: usize, spec: Spec) -> Result<SideBySide> {
    let (mut tb, mut ts) = (vec![], vec![]);
    (spec.cleanup)();
    for _ in 0..rounds.max(1) {
        evict_dir(src)?;
        let t = Instant::now();
        (spec.run_baseline)()?;
        tb.push(t.elapsed().as_secs_f64());
        (spec.cleanup)();
        evict_dir(src)?;
        let t = Instant::now();
        (spec.run_subject)()?;
        ts.push(t.elapsed().as_secs_f64());
        (spec.cleanup)();
    }
    let ratios: Vec<f64> = tb.iter().zip(&ts).map(|(b, s)| b / s).collect();
    let m = median(&ratios);
    Ok(SideBySide {
        schema_version: 1,
        bench: spec.bench,
        command: command_line(),
        machine: machine(),
        keep_version: env!("CARGO_PKG_VERSION"),
        source: src.display().to_string(),
        baseline: spec.baseline,
        subject: spec.subject,
        baseline_bytes: spec.baseline_bytes,
        subject_bytes: spec.subject_bytes,
        cold_reads: EVICTS,
        rounds: rounds.max(1),
        baseline_gbps_median: spec.baseline_bytes as f64 / 1e9 / median(&tb),
        subject_gbps_median: spec.subject_bytes as f64 / 1e9 / median(&ts),
        baseline_seconds: tb,
        subject_seconds: ts,
        ratios,
        median_ratio: m,
        goal: spec.goal,
        verdict: if m >= spec.goal { "PASS" } else { "KILL" },
        rule: format!(
            "PASS if median({} seconds / {} seconds) over interleaved cold rounds >= {}",
            spec.baseline, spec.subject, spec.goal
        ),
    })
}
