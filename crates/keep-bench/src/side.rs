//! Side-by-side timing: a baseline and a subject run in interleaved rounds on the same source,
//! with the source's pages evicted before every timed step, and the ratio of their times.
//!
//! The rounds run between two readings of the memory-pressure counters, judged by the
//! cold-read gate ([`pressure::cold_read_clean`]: page-ins are the measured reads, swap is not
//! allowed), and the load average is read when they end. The verdict is recomputed from the
//! raw seconds ([`judge_numbers`]) and gated like a kill-test row ([`gated_verdict`]): a row
//! whose gate failed, whose counters could not be read, or that ran with the load average
//! above the core count cannot say PASS. [`recompute`] does the same for a stored row.

use std::path::Path;
use std::time::Instant;

use crate::cache::{evict_dir, EVICTS};
use crate::evidence::{command_line, cores, gated_verdict, load_average, machine};
use crate::pressure;
use crate::{median, BenchError, Result};

/// The row schema (2: rows carry the cold-read quiet gate and the load average).
pub const SCHEMA_VERSION: u32 = keep_artifacts::bench::SIDE_VERSION;

/// The evidence row of a side-by-side benchmark (baseline time / subject time; defined with
/// its reader and writer in `keep_artifacts::bench`).
pub use keep_artifacts::bench::SideBySide;

/// The verdict of the raw seconds alone: PASS if the median of baseline / subject over the
/// rounds reaches the goal, else KILL. Refuses rows whose timings are missing, unequal in
/// number, or not positive and finite.
pub fn judge_numbers(row: &SideBySide) -> Result<&'static str> {
    let (b, s) = (&row.baseline_seconds, &row.subject_seconds);
    if b.is_empty()
        || b.len() != s.len()
        || b.iter().chain(s).any(|t| !t.is_finite() || *t <= 0.0)
        || !row.goal.is_finite()
    {
        return Err(BenchError::Invalid(format!(
            "{} row: its raw seconds ({} baseline, {} subject) cannot be judged",
            row.bench,
            b.len(),
            s.len()
        )));
    }
    let ratios: Vec<f64> = b.iter().zip(s).map(|(b, s)| b / s).collect();
    Ok(if median(&ratios) >= row.goal {
        "PASS"
    } else {
        "KILL"
    })
}

/// A stored row's verdict recomputed: its raw seconds, the cold-read gate replayed from its
/// counters, and its recorded load against its recorded cores (else its machine's cpus).
pub fn recompute(row: &SideBySide) -> Result<(String, Option<String>)> {
    let numbers = judge_numbers(row)?;
    let clean = row.quiet.as_ref().is_some_and(pressure::cold_read_clean);
    let cores = row
        .cores
        .or_else(|| row.machine.get("cpus").and_then(|c| c.as_f64()))
        .unwrap_or(1.0);
    Ok(gated_verdict(numbers, clean, row.load_average_1m, cores))
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
    let before = pressure::read();
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
    let quiet = pressure::judge(before, pressure::read());
    let load = load_average();
    let ratios: Vec<f64> = tb.iter().zip(&ts).map(|(b, s)| b / s).collect();
    let m = median(&ratios);
    let mut row = SideBySide {
        format: keep_artifacts::bench::SIDE_FORMAT.into(),
        schema_version: SCHEMA_VERSION,
        bench: spec.bench.into(),
        command: command_line(),
        machine: serde_json::to_value(machine()).unwrap_or_default(),
        keep_version: env!("CARGO_PKG_VERSION").into(),
        source: src.display().to_string(),
        baseline: spec.baseline.into(),
        subject: spec.subject.into(),
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
        verdict: String::new(),
        rule: format!(
            "PASS if median({} seconds / {} seconds) over interleaved cold rounds >= {}, the quiet gate is clean and the 1-minute load average is at most the core count; else KILL (numbers) or UNQUIET/BUSY (gates)",
            spec.baseline, spec.subject, spec.goal
        ),
        quiet_clean: pressure::cold_read_clean(&quiet),
        quiet: Some(quiet),
        quiet_rule: pressure::COLD_READ_RULE.into(),
        load_average_1m: load,
        cores: Some(cores()),
        notes: vec![],
    };
    let (verdict, note) = recompute(&row)?;
    row.verdict = verdict;
    row.notes.extend(note);
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pressure::parse_vmstat;

    fn row(base: &[f64], subj: &[f64], swapout: u64, load: Option<f64>) -> SideBySide {
        let c = |o: u64| parse_vmstat(&format!("pgmajfault 5\npswpin 0\npswpout {o}\n"));
        let mut after = c(swapout);
        *after.values.get_mut("pgmajfault").unwrap() += 100_000;
        let quiet = pressure::judge(c(0), after);
        SideBySide {
            format: keep_artifacts::bench::SIDE_FORMAT.into(),
            schema_version: SCHEMA_VERSION,
            bench: "repack-vs-copy".into(),
            command: String::new(),
            machine: serde_json::json!({"cpus": 2}),
            keep_version: String::new(),
            source: String::new(),
            baseline: "copy".into(),
            subject: "repack".into(),
            baseline_bytes: 1,
            subject_bytes: 1,
            cold_reads: true,
            rounds: base.len(),
            baseline_seconds: base.to_vec(),
            subject_seconds: subj.to_vec(),
            ratios: vec![],
            median_ratio: 99.0,
            baseline_gbps_median: 0.0,
            subject_gbps_median: 0.0,
            goal: 0.8,
            verdict: "PASS".into(),
            rule: String::new(),
            quiet_clean: true,
            quiet: Some(quiet),
            quiet_rule: String::new(),
            load_average_1m: load,
            cores: Some(2.0),
            notes: vec![],
        }
    }

    #[test]
    fn side_verdicts_come_from_raw_seconds_and_gates() {
        // Median of 1.0, 0.9, 0.5 = 0.9 >= 0.8; page-ins (the cold reads) are not gated.
        let ok = row(&[1.0, 0.9, 0.5], &[1.0, 1.0, 1.0], 0, Some(1.0));
        assert_eq!(recompute(&ok).unwrap().0, "PASS");
        // The stored median_ratio (99) is not read: median 0.5 < 0.8.
        let slow = row(&[0.5, 0.5, 0.9], &[1.0, 1.0, 1.0], 0, Some(1.0));
        assert_eq!(recompute(&slow).unwrap().0, "KILL");
        assert_eq!(
            recompute(&row(&[1.0], &[1.0], 3, Some(1.0))).unwrap().0,
            "UNQUIET"
        );
        assert_eq!(
            recompute(&row(&[1.0], &[1.0], 0, Some(3.0))).unwrap().0,
            "BUSY"
        );
        assert_eq!(recompute(&row(&[1.0], &[1.0], 0, None)).unwrap().0, "BUSY");
        // A schema-1 row (no counters) cannot PASS.
        let mut old = row(&[1.0], &[1.0], 0, Some(1.0));
        old.quiet = None;
        assert_eq!(recompute(&old).unwrap().0, "UNQUIET");
        assert!(recompute(&row(&[1.0, 2.0], &[1.0], 0, Some(1.0))).is_err());
        assert!(recompute(&row(&[], &[], 0, Some(1.0))).is_err());
    }

    #[test]
    fn committed_side_rows_recompute() {
        // The repack/prune rows under dev/evidence (schema 1: no counters) read back, and their
        // raw seconds give the stored verdict's numbers; without counters they cannot PASS.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dev/evidence");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if !(name.starts_with("repack-bench") || name.starts_with("prune-bench")) {
                continue;
            }
            let keep_artifacts::bench::Evidence::SideBySide(r) =
                keep_artifacts::bench::read(&e.path()).unwrap()
            else {
                panic!("{name} is not a side-by-side row");
            };
            assert_eq!(judge_numbers(&r).unwrap(), r.verdict, "{name}");
            if r.quiet.is_none() {
                assert_ne!(recompute(&r).unwrap().0, "PASS", "{name}");
            }
            n += 1;
        }
        assert!(n >= 2, "expected committed repack/prune rows, found {n}");
    }
}
