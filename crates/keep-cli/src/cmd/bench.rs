//! `keep bench`: benchmarks that measure side by side in one run and write JSON evidence.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::util::human;

/// Benchmarks that measure side by side in one run and write JSON evidence.
#[derive(Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Which,
}

#[derive(Subcommand)]
enum Which {
    Repack(SideArgs),
    Prune(SideArgs),
}

/// Repack throughput against a plain copy of the same files, cold reads for both.
///
/// Rounds are interleaved (copy, repack, ...); every source file is evicted from the page
/// cache (posix_fadvise DONTNEED) before each timed step; neither side fsyncs. Goal: median
/// copy-time / repack-time ≥ 0.8. Make a ≥ 2 GiB source with
/// `keep synth --preset flash --out DIR`.
///
/// `keep bench prune` does the same for pruning half of every layer's experts, against a
/// plain read/write copy of exactly the bytes the pruned checkpoint keeps.
///
/// Example: keep bench repack /tmp/flash --scratch /tmp --rounds 3 --out repack-bench.json
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct SideArgs {
    /// The source checkpoint.
    dir: PathBuf,
    /// Where the copies and repacks are written (and deleted).
    #[arg(long, default_value = "/tmp")]
    scratch: PathBuf,
    /// Interleaved rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Write the evidence row here (JSON).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let (r, row) = match a.which {
        Which::Repack(r) => {
            let row = keep_bench::repack::run(&r.dir, &r.scratch, r.rounds)
                .with_context(|| format!("benchmarking repack of {}", r.dir.display()))?;
            (r, row)
        }
        Which::Prune(r) => {
            let row = keep_bench::prune::run(&r.dir, &r.scratch, r.rounds)
                .with_context(|| format!("benchmarking prune of {}", r.dir.display()))?;
            (r, row)
        }
    };
    let json = serde_json::to_string_pretty(&row)?;
    if let Some(p) = &r.out {
        std::fs::write(p, &json).with_context(|| format!("writing {}", p.display()))?;
    }
    println!(
        "{} on {} ({}): {} {:.2} GB/s, {} {:.2} GB/s, ratio {:.3} (median of {}) → {} [{}]",
        row.bench,
        r.dir.display(),
        human(row.subject_bytes),
        row.baseline,
        row.baseline_gbps_median,
        row.subject,
        row.subject_gbps_median,
        row.median_ratio,
        row.rounds,
        row.verdict,
        row.rule
    );
    Ok(())
}
