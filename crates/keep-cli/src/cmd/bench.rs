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
    KillTests(KillArgs),
    Summary(SummaryArgs),
    Matmul(MatmulArgs),
    Peak(PeakArgs),
    Report(ReportArgs),
}

/// Render the measured tables of a document from the evidence files they cite.
///
/// Each table in the document is an HTML comment `<!-- table … -->` holding its template
/// (`@name = dev/evidence/FILE.json` bindings, then Markdown rows whose cells are
/// `{name/json/pointer|format}` values or `{= expression |format}`; `{for row in name/rows}`
/// repeats a row), followed by the table itself. Without --write, exits non-zero naming each
/// table that differs from what its evidence renders; with --write, rewrites those tables.
/// The template language is described in keep-bench's `report` module.
///
/// Example: keep bench report docs/results.md --write
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct ReportArgs {
    /// The Markdown document.
    doc: PathBuf,
    /// The directory evidence paths are relative to (default: the current directory).
    #[arg(long, default_value = ".")]
    root: PathBuf,
    /// Rewrite the document's tables from their evidence (atomically).
    #[arg(long)]
    write: bool,
}

fn report(a: ReportArgs) -> anyhow::Result<()> {
    let (text, mismatches) = keep_bench::report::render(&a.doc, &a.root)
        .with_context(|| format!("rendering the tables of {}", a.doc.display()))?;
    if a.write {
        if !mismatches.is_empty() {
            keep_checkpoint::atomic::write_file(&a.doc, text.as_bytes(), true)?;
        }
        eprintln!(
            "{}: {} table(s) rewritten from their evidence",
            a.doc.display(),
            mismatches.len()
        );
        return Ok(());
    }
    for m in &mismatches {
        eprint!("{}: {m}", a.doc.display());
    }
    anyhow::ensure!(
        mismatches.is_empty(),
        "{}: {} table(s) differ from their evidence (rerun with --write to render them)",
        a.doc.display(),
        mismatches.len()
    );
    eprintln!("{}: every table matches its evidence", a.doc.display());
    Ok(())
}

/// The machine's arithmetic peak, measured: f32 FMA GFLOP/s and int8 dot-product GOP/s
/// (AVX-512 VNNI) in register-only loops on --threads threads (the line prefill GFLOP/s of
/// `keep bench matmul --m 128` is read against).
///
/// Example: keep bench peak --threads 2 --json
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct PeakArgs {
    /// Threads (one loop each).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Timed seconds per loop.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Print JSON instead of a line.
    #[arg(long)]
    json: bool,
}

fn peak(a: PeakArgs) -> anyhow::Result<()> {
    let p = keep_bench::peak::measure(a.threads, a.seconds)?;
    if a.json {
        println!("{}", serde_json::to_string(&p)?);
    } else {
        println!(
            "threads={} f32 {:.1} GFLOP/s ({}); int8 {} ({})",
            p.threads,
            p.f32_gflops,
            p.f32_path,
            p.int8_gops
                .map(|g| format!("{g:.1} GOP/s"))
                .unwrap_or_else(|| "-".into()),
            p.int8_path.unwrap_or("none")
        );
    }
    Ok(())
}

/// One weight product timed per thread, the way llama.cpp's `test-backend-ops perf` times
/// MUL_MAT: the same weight every call (cache-resident when it fits), at least --seconds after
/// one warm-up call, on a pool of --threads threads.
///
/// Runs every combination of --format, --shape, --m and --kernels and prints one line per
/// case (JSON lines with --json): microseconds per call, weight bytes per second (the
/// format's packed bytes, scales included) and GFLOP/s. Weights are synthesised; nothing is
/// read or written. `dev/llama-cpp-side-by-side.sh` puts these beside llama.cpp's numbers.
///
/// Example: keep bench matmul --format mxfp4,e8p --shape 2304x5120 --m 1,8,32 --kernels fast --threads 1
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct MatmulArgs {
    /// Weight formats: mxfp4, e8p, affine8, mlx4, mxfp8, bf16.
    #[arg(long, value_delimiter = ',', required = true)]
    format: Vec<String>,
    /// Weight shapes as OUTxIN (output rows x input columns).
    #[arg(long, value_delimiter = ',', required = true)]
    shape: Vec<String>,
    /// Activation rows (tokens) per call.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    m: Vec<usize>,
    /// Kernels: exact, fast.
    #[arg(long, value_delimiter = ',', default_value = "fast")]
    kernels: Vec<String>,
    /// Threads of the pool the products run on.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Minimum timed seconds per case.
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Print JSON lines instead of the table.
    #[arg(long)]
    json: bool,
}

fn matmul(a: MatmulArgs) -> anyhow::Result<()> {
    use keep_bench::matmul::{time_case, Case, Format};
    let formats = a
        .format
        .iter()
        .map(|f| Format::parse(f).with_context(|| format!("unknown format {f:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let kernels = a
        .kernels
        .iter()
        .map(|k| {
            keep_bench::matmul::Kernels::parse(k).with_context(|| format!("unknown kernels {k:?}"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shapes = a
        .shape
        .iter()
        .map(|s| {
            let (r, c) = s
                .split_once('x')
                .with_context(|| format!("shape {s:?} is not OUTxIN"))?;
            Ok((r.parse::<usize>()?, c.parse::<usize>()?))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    for &format in &formats {
        for &(rows, cols) in &shapes {
            for &m in &a.m {
                for &k in &kernels {
                    let case = Case {
                        format,
                        kernels: k,
                        rows,
                        cols,
                        m,
                    };
                    let r = time_case(&case, a.threads, a.seconds).with_context(|| {
                        format!("{} {rows}x{cols} m={m} {}", format.name(), k.name())
                    })?;
                    if a.json {
                        println!("{}", serde_json::to_string(&r)?);
                    } else {
                        println!(
                            "{:>8} {:>5} {rows:>5}x{cols:<5} m={m:<3} threads={} {:>10.2} us/call {:>7.2} GB/s {:>7.2} GFLOP/s{}",
                            format.name(),
                            k.name(),
                            r.threads,
                            r.us_per_call,
                            r.weight_gbps,
                            r.gflops,
                            r.thread_cpu_us_per_call
                                .map(|c| format!(" {c:>10.2} us/call thread CPU"))
                                .unwrap_or_default()
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// The decode-kernel kill tests: each decides one optimisation on evidence measured in this run.
///
/// Runs, in order: the memory read bandwidth (>= 1 GiB, the reference for every ratio);
/// mxfp8 residents (bit-exact against bf16 at the eight V4.1-Flash resident shapes, then M=1
/// time with 43 dependent calls per chain against bf16 and affine-8); the fused HC sinkhorn
/// against the unfused path; a routed FFN with E8P codes; a routed FFN in MXFP4 (top-6 at the
/// V4.1-Flash expert shape, chained x43). Each test prints one verdict line and, with --out,
/// writes <test>.json (schema_version 2: raw timings, medians of interleaved reps, the
/// verdict and its rule, and the memory-pressure quiet gate). Nothing is downloaded; all
/// weights are synthesised. Full run: a few minutes; --quick: smaller working sets, fewer reps.
///
/// Example: keep bench kill-tests --out bench/kill-tests --quick
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct KillArgs {
    /// Write one JSON evidence row per test into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Smaller working sets (256 MiB copies and expert pools) and fewer reps.
    #[arg(long)]
    quick: bool,
    /// Re-run the untimed warm-up after the quiet pause, so the timed window starts warm.
    #[arg(long)]
    rewarm_after_quiet: bool,
    /// The quiet pause before each timed window, in milliseconds.
    #[arg(long, default_value_t = 500)]
    quiet_ms: u64,
    /// Run only these tests (the bandwidth reference always runs): mxfp8-residents,
    /// fused-sinkhorn, e8p-m1, routed-ffn, fast-kernels, fast-residents.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// Tabulate a directory of kill-test rows: verdicts, ratios, GB/s per kernel.
///
/// Refuses directories whose rows mix resident formats, row schema versions or quiet-gate
/// versions, and rows that declare a laxer inbound gate than the harness's; each row's quiet
/// flag is recomputed from its counters under its own gate version. --plot writes an SVG of
/// GB/s per kernel against the measured bandwidth line.
///
/// Example: keep bench summary bench/kill-tests --plot bench/kill-tests.svg
#[derive(Args)]
#[command(verbatim_doc_comment)]
struct SummaryArgs {
    /// A directory written by `keep bench kill-tests --out`.
    dir: PathBuf,
    /// Write the plot here (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print the rows as JSON instead of the table.
    #[arg(long)]
    json: bool,
    /// Replace an existing --plot file.
    #[arg(long)]
    force: bool,
}

fn kill_tests(a: KillArgs) -> anyhow::Result<()> {
    let opts = keep_bench::killtests::Options {
        quick: a.quick,
        out: a.out.clone(),
        rewarm_after_quiet: a.rewarm_after_quiet,
        quiet: std::time::Duration::from_millis(a.quiet_ms),
        only: a.only,
    };
    let rows = keep_bench::killtests::run(&opts, &mut |row| {
        println!("{}", keep_bench::killtests::line(row))
    })
    .context("running the kill tests")?;
    if let Some(d) = &a.out {
        eprintln!("{} rows written to {}", rows.len(), d.display());
    }
    Ok(())
}

fn summary(a: SummaryArgs) -> anyhow::Result<()> {
    let s = keep_bench::summary::load(&a.dir)
        .with_context(|| format!("summarising {}", a.dir.display()))?;
    if a.json {
        let rows: Vec<_> = s.rows.iter().map(|r| &r.row).collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", s.table());
    }
    if let Some(p) = &a.plot {
        keep_checkpoint::atomic::write_file(p, s.svg().as_bytes(), a.force)?;
        eprintln!("plot written to {}", p.display());
    }
    Ok(())
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
    /// Replace an existing --out file.
    #[arg(long)]
    force: bool,
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let (r, row) = match a.which {
        Which::KillTests(k) => return kill_tests(k),
        Which::Summary(k) => return summary(k),
        Which::Matmul(k) => return matmul(k),
        Which::Peak(k) => return peak(k),
        Which::Report(k) => return report(k),
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
    if let Some(p) = &r.out {
        keep_artifacts::bench::write(p, &row.clone().into(), r.force)?;
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
    for n in &row.notes {
        println!("  note: {n}");
    }
    Ok(())
}
