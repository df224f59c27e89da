//! Bench evidence files: the kill-test rows (`keep-killtest`, written by `keep bench
//! kill-tests --out DIR`, one `<test>.json` per test) and the side-by-side rows
//! (`keep-side-by-side`, written by `keep bench repack` / `keep bench prune --out FILE`), with
//! the memory-pressure records they embed; all read back by `keep bench summary`.
//!
//! Both are pretty-printed JSON objects with no final newline, tagged with `format` and
//! versioned by `schema_version` (kill-test rows 1–2, side-by-side rows 1–2). Side-by-side rows
//! written before they carried a `format` field are recognised by their `bench` field and read
//! as `keep-side-by-side` ([`parse`]). One typed reader ([`read`]) and one atomic writer
//! ([`write`], through keep-checkpoint: an existing file is replaced only with `force`). What
//! the numbers mean — the verdict rules, the quiet gate's replay — is keep-bench's; this module
//! only defines, reads and writes the files.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{ArtifactError, Result};

/// The `format` field of a kill-test row.
pub const KILLTEST_FORMAT: &str = "keep-killtest";
/// The kill-test row schema this keep writes (2: rows carry an inbound quiet gate).
pub const KILLTEST_VERSION: u32 = 2;
/// The `format` field of a side-by-side row (absent from rows written before it existed).
pub const SIDE_FORMAT: &str = "keep-side-by-side";
/// The side-by-side row schema this keep writes (2: rows carry the cold-read quiet gate and
/// the load average).
pub const SIDE_VERSION: u32 = 2;
/// Largest evidence file the reader accepts (rows are tens of kilobytes).
pub const MAX_BYTES: u64 = 16 << 20;

/// One reading of the memory-pressure counters: name → value (pages, or KiB for Linux `pgpg*`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    /// `"linux-vmstat"`, `"macos-vm_stat"` or `"none"`.
    pub source: String,
    pub values: BTreeMap<String, u64>,
}

/// Counter deltas mapped onto the quiet gate's classes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Classes {
    pub outbound: u64,
    pub pageins: u64,
    pub swapins: u64,
    pub decompressions: u64,
}

/// The inbound half of the quiet gate (gate version 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InboundGate {
    /// Clean only if page-ins < this.
    pub pageins_below: u64,
    /// Clean only if decompressions < this.
    pub decompressions_below: u64,
    /// Clean only if swap-ins ≤ this.
    pub swapins_at_most: u64,
}

impl InboundGate {
    /// The harness's gate: 4,096 page-ins, 4,096 decompressions (64 MiB each at 16 KiB
    /// pages), zero swap-ins.
    pub const HARNESS: InboundGate = InboundGate {
        pageins_below: 4096,
        decompressions_below: 4096,
        swapins_at_most: 0,
    };

    /// Whether this gate lets through anything `h` would not.
    pub fn laxer_than(&self, h: &InboundGate) -> bool {
        self.pageins_below > h.pageins_below
            || self.decompressions_below > h.decompressions_below
            || self.swapins_at_most > h.swapins_at_most
    }

    /// Whether deltas of these classes pass this gate.
    pub fn admits(&self, c: &Classes) -> bool {
        c.pageins < self.pageins_below
            && c.decompressions < self.decompressions_below
            && c.swapins <= self.swapins_at_most
    }
}

/// The quiet record of one timed window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Quiet {
    /// 1 (outbound only) or 2 (outbound + inbound gate).
    pub gate_version: u32,
    pub before: Counters,
    pub after: Counters,
    pub deltas: BTreeMap<String, u64>,
    pub classes: Classes,
    /// Present on version 2.
    pub inbound_gate: Option<InboundGate>,
    pub outbound_clean: bool,
    pub inbound_clean: bool,
    /// Whether the counters could be read before and after; records written before this
    /// field existed read as `true` (keep-bench's replay re-checks them).
    #[serde(default = "read_by_default")]
    pub counters_read: bool,
    pub clean: bool,
    pub rule: String,
}

fn read_by_default() -> bool {
    true
}

/// One kill-test row (`keep-killtest`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// [`KILLTEST_FORMAT`].
    pub format: String,
    /// The row's version (1 or 2; [`KILLTEST_VERSION`] when written by this keep).
    pub schema_version: u32,
    pub test: String,
    pub command: String,
    pub machine: serde_json::Value,
    pub versions: BTreeMap<String, String>,
    /// The weight formats this row measures (the summary refuses rows that disagree on the
    /// resident format).
    pub formats: Vec<String>,
    pub resident_format: String,
    pub params: serde_json::Value,
    /// Seconds per rep and variant (a rep is one whole chain or batch of calls).
    pub raw_seconds: BTreeMap<String, Vec<f64>>,
    /// Median seconds per rep and variant (reps interleaved across variants).
    pub median_seconds: BTreeMap<String, f64>,
    /// Derived numbers (ratios, GB/s, bit counts).
    pub metrics: BTreeMap<String, f64>,
    /// The read bandwidth every ratio in this row is against (GB/s).
    pub bandwidth_gbps: Option<f64>,
    pub verdict: String,
    pub rule: String,
    pub quiet: Quiet,
    pub notes: Vec<String>,
}

fn side_format() -> String {
    SIDE_FORMAT.into()
}

/// The row of a side-by-side benchmark (baseline time / subject time; `keep-side-by-side`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideBySide {
    /// [`SIDE_FORMAT`] (rows written before the field existed read as [`SIDE_FORMAT`]).
    #[serde(default = "side_format")]
    pub format: String,
    /// The row's version (1 or 2; [`SIDE_VERSION`] when written by this keep).
    pub schema_version: u32,
    pub bench: String,
    pub command: String,
    pub machine: serde_json::Value,
    pub keep_version: String,
    pub source: String,
    pub baseline: String,
    pub subject: String,
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
    pub verdict: String,
    pub rule: String,
    /// The pressure counters around all rounds (absent from version 1 rows).
    #[serde(default)]
    pub quiet: Option<Quiet>,
    /// Whether `quiet` passed the cold-read gate.
    #[serde(default)]
    pub quiet_clean: bool,
    #[serde(default)]
    pub quiet_rule: String,
    /// The 1-minute load average when the rounds ended (`None`: not read).
    #[serde(default)]
    pub load_average_1m: Option<f64>,
    #[serde(default)]
    pub cores: Option<f64>,
    /// What the gates changed.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// A bench evidence file of either kind.
#[derive(Debug, Clone, PartialEq)]
pub enum Evidence {
    KillTest(Row),
    SideBySide(SideBySide),
}

impl From<Row> for Evidence {
    fn from(r: Row) -> Self {
        Evidence::KillTest(r)
    }
}

impl From<SideBySide> for Evidence {
    fn from(r: SideBySide) -> Self {
        Evidence::SideBySide(r)
    }
}

fn check_version(what: &str, v: u32, latest: u32) -> std::result::Result<(), String> {
    if (1..=latest).contains(&v) {
        Ok(())
    } else {
        Err(format!(
            "schema_version {v} of {what}: this keep reads versions 1 to {latest}"
        ))
    }
}

/// Parse the text of an evidence file (`path` names it in errors): a `keep-killtest` row, a
/// `keep-side-by-side` row, or a side-by-side row without `format` (recognised by `bench`).
/// Refuses other formats and unknown versions.
pub fn parse(path: &Path, text: &str) -> Result<Evidence> {
    let bad = |msg: String| ArtifactError::invalid(path, msg);
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let format = v
        .get("format")
        .map(|f| f.as_str().unwrap_or("").to_string());
    let side = match format.as_deref() {
        Some(KILLTEST_FORMAT) => false,
        Some(SIDE_FORMAT) => true,
        None if v.get("bench").is_some() => true,
        Some(f) => {
            return Err(bad(format!(
                "format `{f}` is not `{KILLTEST_FORMAT}` or `{SIDE_FORMAT}`"
            )))
        }
        None => {
            return Err(bad(format!(
                "no `format`: not a {KILLTEST_FORMAT} or {SIDE_FORMAT} row"
            )))
        }
    };
    if side {
        let r: SideBySide =
            serde_json::from_value(v).map_err(|e| bad(format!("not a side-by-side row ({e})")))?;
        check_version(SIDE_FORMAT, r.schema_version, SIDE_VERSION).map_err(bad)?;
        Ok(Evidence::SideBySide(r))
    } else {
        let r: Row =
            serde_json::from_value(v).map_err(|e| bad(format!("not a kill-test row ({e})")))?;
        check_version(KILLTEST_FORMAT, r.schema_version, KILLTEST_VERSION).map_err(bad)?;
        Ok(Evidence::KillTest(r))
    }
}

/// Read an evidence file (at most [`MAX_BYTES`]).
pub fn read(path: &Path) -> Result<Evidence> {
    let text = keep_checkpoint::small_file::read_text(path, MAX_BYTES)?;
    parse(path, &text)
}

/// The file's bytes: pretty-printed JSON, no final newline. Refuses a row that is not of this
/// keep's format and version.
pub fn to_json(e: &Evidence) -> Result<String> {
    let (format, want_format, version, want_version) = match e {
        Evidence::KillTest(r) => (
            &r.format,
            KILLTEST_FORMAT,
            r.schema_version,
            KILLTEST_VERSION,
        ),
        Evidence::SideBySide(r) => (&r.format, SIDE_FORMAT, r.schema_version, SIDE_VERSION),
    };
    if format != want_format || version != want_version {
        return Err(ArtifactError::Config(format!(
            "bench rows are written as {want_format} v{want_version}, not `{format}` v{version}"
        )));
    }
    let json = match e {
        Evidence::KillTest(r) => serde_json::to_string_pretty(r),
        Evidence::SideBySide(r) => serde_json::to_string_pretty(r),
    };
    json.map_err(|e| ArtifactError::Config(format!("bench row: {e}")))
}

/// Write an evidence file atomically (temporary sibling, renamed when complete); an existing
/// `path` is replaced only with `force`, a `path` that is not a regular file never.
pub fn write(path: &Path, e: &Evidence, force: bool) -> Result<()> {
    keep_checkpoint::atomic::write_file(path, to_json(e)?.as_bytes(), force)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet() -> Quiet {
        let c = |v: u64| Counters {
            source: "linux-vmstat".into(),
            values: [("pgmajfault".to_string(), v), ("pswpout".to_string(), 0)].into(),
        };
        Quiet {
            gate_version: 2,
            before: c(1),
            after: c(3),
            deltas: [("pgmajfault".to_string(), 2)].into(),
            classes: Classes {
                pageins: 2,
                ..Classes::default()
            },
            inbound_gate: Some(InboundGate::HARNESS),
            outbound_clean: true,
            inbound_clean: true,
            counters_read: true,
            clean: true,
            rule: "r".into(),
        }
    }

    fn row() -> Row {
        Row {
            format: KILLTEST_FORMAT.into(),
            schema_version: KILLTEST_VERSION,
            test: "routed-ffn".into(),
            command: "keep bench kill-tests".into(),
            machine: serde_json::json!({"cpus": 2}),
            versions: [("keep".to_string(), "0.1".to_string())].into(),
            formats: vec!["mxfp4".into()],
            resident_format: "mxfp8".into(),
            params: serde_json::json!({"reps": 3}),
            raw_seconds: [("mxfp4".to_string(), vec![0.5, 0.25])].into(),
            median_seconds: [("mxfp4".to_string(), 0.375)].into(),
            metrics: [("gbps".to_string(), 12.5)].into(),
            bandwidth_gbps: Some(20.0),
            verdict: "TUNE".into(),
            rule: "rule".into(),
            quiet: quiet(),
            notes: vec!["n".into()],
        }
    }

    fn side() -> SideBySide {
        SideBySide {
            format: SIDE_FORMAT.into(),
            schema_version: SIDE_VERSION,
            bench: "repack-vs-copy".into(),
            command: "keep bench repack".into(),
            machine: serde_json::json!({"cpus": 2}),
            keep_version: "0.1".into(),
            source: "/m".into(),
            baseline: "copy".into(),
            subject: "repack".into(),
            baseline_bytes: 10,
            subject_bytes: 12,
            cold_reads: true,
            rounds: 2,
            baseline_seconds: vec![1.0, 2.0],
            subject_seconds: vec![1.5, 2.5],
            ratios: vec![0.75, 0.8],
            median_ratio: 0.775,
            baseline_gbps_median: 1.25,
            subject_gbps_median: 1.5,
            goal: 0.8,
            verdict: "KILL".into(),
            rule: "rule".into(),
            quiet: Some(quiet()),
            quiet_clean: true,
            quiet_rule: "cold".into(),
            load_average_1m: Some(0.5),
            cores: Some(2.0),
            notes: vec![],
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("row.json");
        for e in [Evidence::from(row()), Evidence::from(side())] {
            write(&p, &e, true).unwrap();
            assert_eq!(read(&p).unwrap(), e);
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.starts_with("{\n  \"format\": \"keep-"), "{text}");
            assert!(text.ends_with('}'));
            let err = write(&p, &e, false).unwrap_err();
            assert!(err.to_string().contains("exists"), "{err}");
        }
        // Only this keep's format and version are written.
        let mut old = side();
        old.schema_version = 1;
        assert!(write(&p, &old.into(), true).is_err());
        let mut other = row();
        other.format = "keep-routes".into();
        assert!(write(&p, &other.into(), true).is_err());
        // A side-by-side row without `format` reads as one; other formats, unknown versions
        // and untagged objects do not.
        let mut v = serde_json::to_value(side()).unwrap();
        v.as_object_mut().unwrap().remove("format");
        assert_eq!(
            parse(&p, &v.to_string()).unwrap(),
            Evidence::SideBySide(side())
        );
        v["schema_version"] = 3.into();
        let e = parse(&p, &v.to_string()).unwrap_err().to_string();
        assert!(e.contains("schema_version 3"), "{e}");
        let mut v = serde_json::to_value(row()).unwrap();
        v["schema_version"] = 0.into();
        assert!(parse(&p, &v.to_string()).is_err());
        v["format"] = "keep-routes".into();
        let e = parse(&p, &v.to_string()).unwrap_err().to_string();
        assert!(e.contains("keep-routes"), "{e}");
        assert!(parse(&p, "{\"test\": 1}").is_err());
        assert!(parse(&p, "{").unwrap_err().to_string().contains("not JSON"));
    }

    /// serde_json's default float parser may miss the nearest double by an ulp or so.
    const PARSE_REL_TOLERANCE: f64 = 1e-15;

    #[test]
    fn committed_rows_read_and_rewrite_to_their_bytes() {
        // A kill-test row, which written back is the same bytes but for a defaulted field, and a version 1 side-by-side
        // row written before side rows carried `format` (nor the quiet gate's fields).
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../dev/evidence");
        let kt = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/killtest-row-without-counters-read.json");
        let Evidence::KillTest(r) = read(&kt).unwrap() else {
            panic!("{} is a kill-test row", kt.display());
        };
        assert_eq!(r.test, "fast-kernels");
        let text = std::fs::read_to_string(&kt).unwrap();
        // Written before quiet records carried `counters_read` (read as `true`).
        assert!(!text.contains("counters_read"));
        let again = to_json(&Evidence::KillTest(r)).unwrap();
        let again = again.replace("\n    \"counters_read\": true,", "");
        assert_eq!(again.lines().count(), text.lines().count());
        for (a, b) in again.lines().zip(text.lines()).filter(|(a, b)| a != b) {
            // Only a number may differ, by the reader's last-digit rounding.
            let split = |l: &str| {
                let l = l.trim_end_matches(',');
                let i = l.rfind([' ', '[']).map_or(0, |i| i + 1);
                (l[..i].to_string(), l[i..].parse::<f64>().unwrap())
            };
            let ((pa, xa), (pb, xb)) = (split(a), split(b));
            assert_eq!(pa, pb);
            assert!(
                (xa - xb).abs() <= PARSE_REL_TOLERANCE * xb.abs(),
                "{a} / {b}"
            );
        }
        let sb = dir.join("repack-bench-flash.json");
        let Evidence::SideBySide(mut s) = read(&sb).unwrap() else {
            panic!("{} is a side-by-side row", sb.display());
        };
        assert_eq!(s.format, SIDE_FORMAT);
        assert_eq!((s.bench.as_str(), s.schema_version), ("repack-vs-copy", 1));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&sb).unwrap()).unwrap();
        assert_eq!(v.get("format"), None);
        assert_eq!(v["median_ratio"].as_f64(), Some(s.median_ratio));
        assert_eq!(s.quiet, None);
        s.format.clear();
        assert!(to_json(&Evidence::SideBySide(s)).is_err());
    }
}
