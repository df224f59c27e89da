//! `keep bench repack`: repack throughput against a plain copy of the same files, side by
//! side in one run, cold reads for both.
//!
//! Rounds are interleaved (copy, repack, copy, repack, ...); before each timed step every
//! source file is evicted from the page cache; neither side fsyncs its output (both leave
//! dirty pages to the kernel alike). The plain copy is `std::fs::copy` of every file (what `cp`
//! does: `copy_file_range` on Linux). The ratio is copy time / repack time per round; its
//! median is the result, and the goal is ≥ 0.8.

use std::path::Path;
use std::time::Instant;

use keep_convert::repack::{repack, RepackOptions, ResidentFormat};
use serde::Serialize;

use crate::cache::{evict_dir, EVICTS};
use crate::evidence::{command_line, machine, Machine};
use crate::{median, BenchError, Result};

/// The evidence row of the benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct RepackBench {
    pub schema_version: u32,
    pub bench: &'static str,
    pub command: String,
    pub machine: Machine,
    pub keep_version: &'static str,
    pub source: String,
    pub source_bytes: u64,
    pub cold_reads: bool,
    pub rounds: usize,
    pub copy_seconds: Vec<f64>,
    pub repack_seconds: Vec<f64>,
    pub ratios: Vec<f64>,
    pub median_ratio: f64,
    pub copy_gbps_median: f64,
    pub repack_gbps_median: f64,
    pub goal: f64,
    pub verdict: &'static str,
    pub rule: &'static str,
}

fn dir_bytes(d: &Path) -> Result<u64> {
    let rd = std::fs::read_dir(d).map_err(|e| BenchError::Io {
        path: d.to_path_buf(),
        source: e,
    })?;
    Ok(rd
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum())
}

fn plain_copy(src: &Path, dst: &Path) -> Result<()> {
    let io = |p: &Path, e| BenchError::Io {
        path: p.to_path_buf(),
        source: e,
    };
    std::fs::create_dir_all(dst).map_err(|e| io(dst, e))?;
    for e in std::fs::read_dir(src).map_err(|e| io(src, e))?.flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).map_err(|x| io(&e.path(), x))?;
        }
    }
    Ok(())
}

/// Run `rounds` interleaved rounds on checkpoint `src`, using `scratch` for outputs.
pub fn run(src: &Path, scratch: &Path, rounds: usize) -> Result<RepackBench> {
    if rounds == 0 {
        return Err(BenchError::Invalid("--rounds must be at least 1".into()));
    }
    let bytes = dir_bytes(src)?;
    let copy_out = scratch.join("bench-copy");
    let repack_out = scratch.join("bench-repack");
    let rm = |p: &Path| {
        let _ = std::fs::remove_dir_all(p);
    };
    rm(&copy_out);
    rm(&repack_out);
    let opts = RepackOptions {
        resident: ResidentFormat::Mxfp8,
        verify: false,
        force: false,
        sync: false,
    };
    let (mut tc, mut tr) = (vec![], vec![]);
    for _ in 0..rounds {
        evict_dir(src)?;
        let t = Instant::now();
        plain_copy(src, &copy_out)?;
        tc.push(t.elapsed().as_secs_f64());
        rm(&copy_out);

        evict_dir(src)?;
        let t = Instant::now();
        repack(src, &repack_out, &opts, &|_, _| {})?;
        tr.push(t.elapsed().as_secs_f64());
        rm(&repack_out);
    }
    let ratios: Vec<f64> = tc.iter().zip(&tr).map(|(c, r)| c / r).collect();
    let m = median(&ratios);
    let gb = bytes as f64 / 1e9;
    Ok(RepackBench {
        schema_version: 1,
        bench: "repack-vs-copy",
        command: command_line(),
        machine: machine(),
        keep_version: env!("CARGO_PKG_VERSION"),
        source: src.display().to_string(),
        source_bytes: bytes,
        cold_reads: EVICTS,
        rounds,
        copy_gbps_median: gb / median(&tc),
        repack_gbps_median: gb / median(&tr),
        copy_seconds: tc,
        repack_seconds: tr,
        ratios,
        median_ratio: m,
        goal: 0.8,
        verdict: if m >= 0.8 { "PASS" } else { "KILL" },
        rule: "PASS if median(copy seconds / repack seconds) over interleaved cold rounds >= 0.8",
    })
}
