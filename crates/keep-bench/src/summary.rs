//! `keep bench summary DIR`: the kill-test rows of one directory as a table of verdicts and
//! ratios, and (optionally) an SVG of effective GB/s per kernel against the measured
//! read-bandwidth line.
//!
//! It refuses (an error naming the files) a directory whose rows mix resident formats, row
//! schema versions or quiet-gate versions, or a row whose quiet record declares a laxer inbound
//! gate than the harness's; each row's quiet flag is recomputed from its counters under the
//! rule of its own gate version ([`crate::pressure::replay`]). Verdicts are not taken from the
//! rows: each is recomputed from the row's raw timings ([`crate::killtests::judge_numbers`])
//! and passed through the quiet and load gates with the replayed quiet flag and the recorded
//! load average ([`crate::evidence::gated_verdict`]); a stored verdict that disagrees is shown
//! beside the recomputed one. The plot is hand-written SVG
//! (no font or plotting dependency): one bar per kernel and shape, the bandwidth as a line.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use keep_artifacts::bench::Evidence;

use crate::killtests::Row;
use crate::pressure;
use crate::{BenchError, Result};

/// One row of a summary.
#[derive(Debug, Clone)]
pub struct SummaryRow {
    pub path: PathBuf,
    /// The row as read, except `verdict`, which is the recomputed one (and `notes`, which gain
    /// the gates' note).
    pub row: Row,
    /// The quiet flag replayed from the row's counters.
    pub clean: bool,
    /// The verdict the file stored.
    pub stored_verdict: String,
}

impl SummaryRow {
    /// Whether the file's stored verdict differs from the recomputed one.
    pub fn disagrees(&self) -> bool {
        self.stored_verdict != self.row.verdict
    }
}

/// Recompute a row's verdict: its raw timings under its test's rule, then the quiet gate
/// (`clean`, replayed) and the load gate (the row's recorded 1-minute load average against its
/// recorded cores, else its machine's cpus). Returns the verdict and the gates' note.
pub fn recompute(row: &Row, clean: bool) -> Result<(String, Option<String>)> {
    let numbers = crate::killtests::judge_numbers(row)?;
    let load = row.metrics.get("load_average_1m").copied();
    let cores = row
        .metrics
        .get("cores")
        .copied()
        .or_else(|| row.machine.get("cpus").and_then(|c| c.as_f64()))
        .unwrap_or(1.0);
    Ok(crate::evidence::gated_verdict(&numbers, clean, load, cores))
}

/// The rows of a directory with their replayed quiet flags and recomputed verdicts.
#[derive(Debug)]
pub struct Summary {
    pub rows: Vec<SummaryRow>,
    /// Side-by-side rows (`keep bench repack` / `prune`) in the directory: the file, the row
    /// with its verdict recomputed ([`crate::side::recompute`]), and the verdict it stored.
    pub sides: Vec<(PathBuf, crate::side::SideBySide, String)>,
    /// The bandwidth line (GB/s), from the `memory-bandwidth` row.
    pub bandwidth_gbps: Option<f64>,
}

/// Read every `*.json` row in `dir` (hidden files skipped; each through
/// `keep_artifacts::bench::read`) and check they can be summarised together.
pub fn load(dir: &Path) -> Result<Summary> {
    let io = |p: &Path, e| BenchError::Io {
        path: p.to_path_buf(),
        err: e,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(BenchError::Invalid(format!(
            "{}: no *.json rows (write some with `keep bench kill-tests --out {}`)",
            dir.display(),
            dir.display()
        )));
    }
    let mut rows = vec![];
    let mut sides = vec![];
    for p in files {
        let row = match keep_artifacts::bench::read(&p)? {
            Evidence::SideBySide(mut side) => {
                let (verdict, note) = crate::side::recompute(&side)
                    .map_err(|e| BenchError::Invalid(format!("{}: {e}", p.display())))?;
                let stored = std::mem::replace(&mut side.verdict, verdict);
                side.notes.extend(note.filter(|n| !side.notes.contains(n)));
                sides.push((p, side, stored));
                continue;
            }
            Evidence::KillTest(row) => row,
        };
        let clean = pressure::replay(&row.quiet)
            .map_err(|e| BenchError::Invalid(format!("{}: {e}", p.display())))?;
        let stored_verdict = row.verdict.clone();
        rows.push(SummaryRow {
            path: p,
            row,
            clean,
            stored_verdict,
        });
    }
    let distinct = |f: &dyn Fn(&Row) -> String| -> BTreeSet<String> {
        rows.iter()
            .map(|r| f(&r.row))
            .filter(|s| !s.is_empty())
            .collect()
    };
    for (what, set) in [
        ("resident formats", distinct(&|r| r.resident_format.clone())),
        (
            "row schema versions",
            distinct(&|r| r.schema_version.to_string()),
        ),
        (
            "quiet-gate versions",
            distinct(&|r| r.quiet.gate_version.to_string()),
        ),
    ] {
        if set.len() > 1 {
            let who: Vec<String> = rows
                .iter()
                .map(
                    |SummaryRow {
                         path: p, row: r, ..
                     }| {
                        format!(
                            "{} ({}, v{}, gate v{})",
                            p.file_name().unwrap_or_default().to_string_lossy(),
                            r.resident_format,
                            r.schema_version,
                            r.quiet.gate_version
                        )
                    },
                )
                .collect();
            return Err(BenchError::Invalid(format!(
                "{}: rows mix {what} {set:?}; summarise each run's directory on its own: {}",
                dir.display(),
                who.join(", ")
            )));
        }
    }
    for sr in &mut rows {
        let (verdict, note) = recompute(&sr.row, sr.clean)
            .map_err(|e| BenchError::Invalid(format!("{}: {e}", sr.path.display())))?;
        sr.row.verdict = verdict;
        if let Some(n) = note {
            if !sr.row.notes.contains(&n) {
                sr.row.notes.push(n);
            }
        }
    }
    // Run order (the bandwidth reference first).
    rows.sort_by_key(|r| {
        crate::killtests::TESTS
            .iter()
            .position(|t| *t == r.row.test)
            .unwrap_or(usize::MAX)
    });
    let bandwidth_gbps = rows
        .iter()
        .find(|r| r.row.test == "memory-bandwidth")
        .and_then(|r| r.row.bandwidth_gbps);
    Ok(Summary {
        rows,
        sides,
        bandwidth_gbps,
    })
}

impl Summary {
    /// The human table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{:<17} {:<7} {:<6} details", "test", "verdict", "quiet");
        for sr in &self.rows {
            let r = &sr.row;
            let line = crate::killtests::line(r);
            // `line` starts with the test and verdict; keep its details part.
            let details = line
                .split_once(&r.verdict)
                .map(|(_, d)| d.trim().to_string())
                .unwrap_or(line.clone());
            let mut details = details.split(" [").next().unwrap_or("").to_string();
            if sr.disagrees() {
                let _ = write!(
                    details,
                    " (the file says {}; recomputed from its raw timings and gates)",
                    sr.stored_verdict
                );
            }
            let _ = writeln!(
                s,
                "{:<17} {:<7} {:<6} {}",
                r.test,
                r.verdict,
                if sr.clean { "yes" } else { "NO" },
                details
            );
        }
        for (p, r, stored) in &self.sides {
            let _ = writeln!(
                s,
                "{:<17} {:<7} {:<6} median {} / {} time {:.3} (goal {}), {} rounds{}",
                r.bench.get(..17).unwrap_or(&r.bench),
                r.verdict,
                if r.quiet
                    .as_ref()
                    .is_some_and(crate::pressure::cold_read_clean)
                {
                    "yes"
                } else {
                    "NO"
                },
                r.baseline,
                r.subject,
                crate::median(
                    &r.baseline_seconds
                        .iter()
                        .zip(&r.subject_seconds)
                        .map(|(b, s)| b / s)
                        .collect::<Vec<_>>()
                ),
                r.goal,
                r.rounds,
                if *stored != r.verdict {
                    format!(
                        " (the file {} says {stored}; recomputed from its raw seconds and gates)",
                        p.file_name().unwrap_or_default().to_string_lossy()
                    )
                } else {
                    String::new()
                }
            );
        }
        if let Some(b) = self.bandwidth_gbps {
            let _ = writeln!(s, "\nGB/s per kernel (bandwidth {b:.1} GB/s):");
            for (name, g) in self.bars() {
                let _ = writeln!(s, "  {name:<34} {g:>7.2} GB/s  {:>5.2}x bandwidth", g / b);
            }
        }
        s
    }

    /// (kernel label, GB/s) for every `gbps.<format>.<shape>` metric.
    pub fn bars(&self) -> Vec<(String, f64)> {
        let mut v = vec![];
        for sr in &self.rows {
            for (k, g) in &sr.row.metrics {
                if let Some(rest) = k.strip_prefix("gbps.") {
                    v.push((rest.to_string(), *g));
                }
            }
        }
        v
    }

    /// The SVG plot: horizontal bars of GB/s per kernel, the bandwidth as a vertical line.
    pub fn svg(&self) -> String {
        let bars = self.bars();
        let bw = self.bandwidth_gbps.unwrap_or(0.0);
        let max = bars.iter().map(|b| b.1).fold(bw, f64::max).max(1e-9) * 1.1;
        let (left, width, bh, top) = (260.0, 520.0, 18.0, 40.0);
        let height = top + bars.len() as f64 * (bh + 6.0) + 40.0;
        let x = |g: f64| left + g / max * width;
        let esc = |t: &str| {
            t.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
        };
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="12">"#,
            left + width + 40.0
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="20" font-size="14">keep kill tests: effective GB/s per kernel (M=1, chained x43) vs measured read bandwidth</text>"#
        );
        for (i, (name, g)) in bars.iter().enumerate() {
            let y = top + i as f64 * (bh + 6.0);
            let colour = if name.starts_with("mxfp8") {
                "#d62728"
            } else if name.starts_with("bf16") {
                "#1f77b4"
            } else if name.starts_with("affine8") {
                "#2ca02c"
            } else {
                "#9467bd"
            };
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text><rect x="{left}" y="{y}" width="{:.1}" height="{bh}" fill="{colour}"/><text x="{:.1}" y="{}">{g:.1}</text>"#,
                left - 6.0,
                y + 13.0,
                esc(name),
                (x(*g) - left).max(0.5),
                x(*g) + 4.0,
                y + 13.0
            );
        }
        if bw > 0.0 {
            let _ = writeln!(
                s,
                r#"<line x1="{0:.1}" y1="{1}" x2="{0:.1}" y2="{2}" stroke="black" stroke-dasharray="4 3"/><text x="{0:.1}" y="{3}" text-anchor="middle">read bandwidth {bw:.1} GB/s</text>"#,
                x(bw),
                top - 6.0,
                height - 30.0,
                height - 14.0
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::killtests::ROW_FORMAT;
    use crate::pressure::{judge, parse_vmstat};

    /// A routed-ffn row whose raw timings give `ratio` of the interleaved bandwidth (chain 43
    /// of 1 GB; bandwidth reads of 1 GiB in 0.1 s), on a quiet idle machine.
    fn routed(ratio: f64) -> Row {
        let mut r = row("routed-ffn", "mxfp8", 2);
        let bw = (1u64 << 30) as f64 / 0.1;
        r.params = serde_json::json!({"chain": 43, "bytes_per_ffn": 1e9 / 43.0});
        r.raw_seconds
            .insert("mxfp4".into(), vec![1e9 / (ratio * bw); 3]);
        r.raw_seconds
            .insert("bandwidth".into(), vec![0.1, 0.1, 0.1]);
        r.metrics.insert("load_average_1m".into(), 0.5);
        r.metrics.insert("cores".into(), 2.0);
        r
    }

    fn row(test: &str, resident: &str, gate: u32) -> Row {
        let c = parse_vmstat("pgmajfault 1\npswpin 0\npswpout 0\n");
        let mut quiet = judge(c.clone(), c);
        if gate == 1 {
            quiet.gate_version = 1;
            quiet.inbound_gate = None;
        }
        Row {
            format: ROW_FORMAT.into(),
            schema_version: 2,
            test: test.into(),
            command: "keep bench kill-tests".into(),
            machine: serde_json::Value::Null,
            versions: Default::default(),
            formats: vec![],
            resident_format: resident.into(),
            params: serde_json::Value::Null,
            raw_seconds: Default::default(),
            median_seconds: Default::default(),
            metrics: [("gbps.mxfp4.routed-ffn".to_string(), 7.5)]
                .into_iter()
                .collect(),
            bandwidth_gbps: Some(10.0),
            verdict: if test == "memory-bandwidth" {
                "INFO"
            } else {
                "TUNE"
            }
            .into(),
            rule: "r".into(),
            quiet,
            notes: vec![],
        }
    }

    fn dir_with(rows: &[Row]) -> PathBuf {
        // One directory a call: tests run in parallel and build rows of the same shape.
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!(
            "keep-summary-test-{}-{n}-{}",
            std::process::id(),
            rows.len()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (i, r) in rows.iter().enumerate() {
            std::fs::write(
                d.join(format!("{i}.json")),
                serde_json::to_string(r).unwrap(),
            )
            .unwrap();
        }
        d
    }

    #[test]
    fn summarises_and_plots() {
        let mut bw = row("memory-bandwidth", "", 2);
        bw.metrics.clear();
        let d = dir_with(&[bw, routed(0.7)]);
        let s = load(&d).unwrap();
        assert_eq!(s.rows.len(), 2);
        assert!(s.table().contains("routed-ffn"));
        assert_eq!(s.rows[1].row.verdict, "TUNE");
        assert!(!s.rows[1].disagrees());
        let svg = s.svg();
        assert!(svg.starts_with("<svg") && svg.contains("read bandwidth 10.0"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn refuses_mixed_formats_and_gate_versions() {
        let d = dir_with(&[row("a", "mxfp8", 2), row("b", "bf16", 2)]);
        assert!(load(&d)
            .unwrap_err()
            .to_string()
            .contains("resident formats"));
        std::fs::remove_dir_all(d).unwrap();
        let d = dir_with(&[
            row("a", "mxfp8", 2),
            row("b", "mxfp8", 1),
            row("c", "mxfp8", 2),
        ]);
        assert!(load(&d)
            .unwrap_err()
            .to_string()
            .contains("quiet-gate versions"));
        std::fs::remove_dir_all(d).unwrap();
    }

    fn summarise(rows: &[Row]) -> Summary {
        let d = dir_with(rows);
        let s = load(&d).unwrap();
        std::fs::remove_dir_all(d).unwrap();
        s
    }

    #[test]
    fn verdicts_are_recomputed_from_raw_timings_not_read() {
        // The file says PASS; its timings give 0.3 of the bandwidth: KILL, shown as such.
        let mut r = routed(0.3);
        r.verdict = "PASS".into();
        let s = summarise(&[r]);
        assert_eq!(s.rows[0].row.verdict, "KILL");
        assert!(s.rows[0].disagrees());
        assert!(s.table().contains("the file says PASS"));
        // The stored medians and metrics are not read either.
        let mut r = routed(0.9);
        r.median_seconds.insert("mxfp4".into(), 1e9);
        r.metrics.insert("ratio_to_bandwidth".into(), 0.01);
        r.verdict = "PASS".into();
        let s = summarise(&[r]);
        assert_eq!(s.rows[0].row.verdict, "PASS");
        assert!(!s.rows[0].disagrees());
        // A row whose rule lacks a timing is refused, naming the file.
        let mut r = routed(0.9);
        r.raw_seconds.remove("bandwidth");
        let d = dir_with(&[r]);
        let e = load(&d).unwrap_err().to_string();
        assert!(e.contains("0.json") && e.contains("bandwidth"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_pass_needs_quiet_readable_counters_and_an_idle_machine() {
        let verdict = |r: Row| summarise(&[r]).rows[0].row.verdict.clone();
        assert_eq!(verdict(routed(0.9)), "PASS");
        // Busy: load above the cores, or no load recorded.
        let mut r = routed(0.9);
        r.metrics.insert("load_average_1m".into(), 2.5);
        assert_eq!(verdict(r), "BUSY");
        let mut r = routed(0.9);
        r.metrics.remove("load_average_1m");
        assert_eq!(verdict(r), "BUSY");
        // The quiet gate failed (swap-outs), even though the file says clean.
        let mut r = routed(0.9);
        r.quiet.after = parse_vmstat("pgmajfault 1\npswpin 0\npswpout 5\n");
        assert!(r.quiet.clean);
        assert_eq!(verdict(r), "UNQUIET");
        // Counters that could not be read.
        let mut r = routed(0.9);
        r.quiet.before = crate::pressure::Counters {
            source: "none".into(),
            values: Default::default(),
        };
        r.quiet.after = r.quiet.before.clone();
        assert_eq!(verdict(r), "UNQUIET");
        // A KILL stays a KILL on a busy machine, with a note.
        let mut r = routed(0.3);
        r.metrics.insert("load_average_1m".into(), 9.0);
        let s = summarise(&[r]);
        assert_eq!(s.rows[0].row.verdict, "KILL");
        assert!(s.rows[0].row.notes.iter().any(|n| n.contains("busy")));
    }

    #[test]
    fn committed_evidence_rows_recompute_to_their_verdicts() {
        // The kill-test rows under dev/evidence, written by the harness: the verdict recomputed
        // from their raw timings is the one they store.
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dev/evidence");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if !(name.starts_with("killtest-") && name.ends_with(".json")) {
                continue;
            }
            let row: Row = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let clean = crate::pressure::replay(&row.quiet).unwrap();
            let (v, _) = recompute(&row, clean).unwrap();
            assert_eq!(v, row.verdict, "{name}");
            n += 1;
        }
        assert!(n >= 5, "expected the committed kill-test rows, found {n}");
    }
}
