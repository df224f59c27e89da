//! `keep bench summary DIR`: the kill-test rows of one directory as a table of verdicts and
//! ratios, and (optionally) an SVG of effective GB/s per kernel against the measured
//! read-bandwidth line.
//!
//! It refuses (an error naming the files) a directory whose rows mix resident formats, row
//! schema versions or quiet-gate versions, or a row whose quiet record declares a laxer inbound
//! gate than the harness's; each row's quiet flag is recomputed from its counters under the
//! rule of its own gate version ([`crate::pressure::replay`]). The plot is hand-written SVG
//! (no font or plotting dependency): one bar per kernel and shape, the bandwidth as a line.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::killtests::{Row, ROW_FORMAT};
use crate::pressure;
use crate::{BenchError, Result};

/// The rows of a directory with their replayed quiet flags.
#[derive(Debug)]
pub struct Summary {
    pub rows: Vec<(PathBuf, Row, bool)>,
    /// The bandwidth line (GB/s), from the `memory-bandwidth` row.
    pub bandwidth_gbps: Option<f64>,
}

/// Read every `*.json` row in `dir` (hidden files skipped) and check they can be summarised
/// together.
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
    for p in files {
        let text = std::fs::read_to_string(&p).map_err(|e| io(&p, e))?;
        let row: Row = serde_json::from_str(&text).map_err(|e| {
            BenchError::Invalid(format!("{}: not a kill-test row ({e})", p.display()))
        })?;
        if row.format != ROW_FORMAT {
            return Err(BenchError::Invalid(format!(
                "{}: format `{}` is not `{ROW_FORMAT}`",
                p.display(),
                row.format
            )));
        }
        let clean = pressure::replay(&row.quiet)
            .map_err(|e| BenchError::Invalid(format!("{}: {e}", p.display())))?;
        rows.push((p, row, clean));
    }
    let distinct = |f: &dyn Fn(&Row) -> String| -> BTreeSet<String> {
        rows.iter()
            .map(|(_, r, _)| f(r))
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
                .map(|(p, r, _)| {
                    format!(
                        "{} ({}, v{}, gate v{})",
                        p.file_name().unwrap_or_default().to_string_lossy(),
                        r.resident_format,
                        r.schema_version,
                        r.quiet.gate_version
                    )
                })
                .collect();
            return Err(BenchError::Invalid(format!(
                "{}: rows mix {what} {set:?}; summarise each run's directory on its own: {}",
                dir.display(),
                who.join(", ")
            )));
        }
    }
    // Run order (the bandwidth reference first), unknown tests last.
    rows.sort_by_key(|(_, r, _)| {
        crate::killtests::TESTS
            .iter()
            .position(|t| *t == r.test)
            .unwrap_or(usize::MAX)
    });
    let bandwidth_gbps = rows
        .iter()
        .find(|(_, r, _)| r.test == "memory-bandwidth")
        .and_then(|(_, r, _)| r.bandwidth_gbps);
    Ok(Summary {
        rows,
        bandwidth_gbps,
    })
}

impl Summary {
    /// The human table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "{:<17} {:<5} {:<6} details", "test", "verd.", "quiet");
        for (_, r, clean) in &self.rows {
            let line = r.line();
            // `line` starts with the test and verdict; keep its details part.
            let details = line
                .split_once(&r.verdict)
                .map(|(_, d)| d.trim().to_string())
                .unwrap_or(line.clone());
            let details = details.split(" [").next().unwrap_or("").to_string();
            let _ = writeln!(
                s,
                "{:<17} {:<5} {:<6} {}",
                r.test,
                r.verdict,
                if *clean { "yes" } else { "NO" },
                details
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
        for (_, r, _) in &self.rows {
            for (k, g) in &r.metrics {
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
    use crate::pressure::{judge, parse_vmstat};

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
            verdict: "TUNE".into(),
            rule: "r".into(),
            quiet,
            notes: vec![],
        }
    }

    fn dir_with(rows: &[Row]) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "keep-summary-test-{}-{}",
            std::process::id(),
            rows.len() * 10
                + rows
                    .iter()
                    .map(|r| r.quiet.gate_version as usize)
                    .sum::<usize>()
                + rows.iter().map(|r| r.resident_format.len()).sum::<usize>() * 100
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
        let d = dir_with(&[bw, row("routed-ffn", "mxfp8", 2)]);
        let s = load(&d).unwrap();
        assert_eq!(s.rows.len(), 2);
        assert!(s.table().contains("routed-ffn"));
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
}
