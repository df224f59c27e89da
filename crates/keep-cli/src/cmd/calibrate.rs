//! `keep calibrate`: run the model layer-streamed over a pack and write one session file per
//! group (imatrix, REAP, routes, teacher log-probs for the eval split).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use keep_calib::calibrate::{calibrate, CalibrateOptions, Progress};
use keep_calib::pack::{Pack, Split};

/// Run the model over a calibration pack, one session per group, layer by layer.
///
/// Each session file (RUN/<group>.safetensors, keep-calib-session v1) holds, per layer: Σx² and
/// token counts of every linear (per expert for routed experts), REAP sums (Σg·‖f‖, Σg, Σ‖f‖,
/// route counts, per-channel max/min of f) with the model's own gate weights (a hash-routed
/// layer's: its tid2eid experts weighed by its gate), on hash-routed layers the output
/// distances between every pair of experts on the tokens routed to the first, the first 2,048
/// tokens of routing, and for --split eval the teacher's top-64 log-probs and the log-prob of
/// each true next token. Complete sessions are skipped and partial ones redone; --shard I/N runs
/// only groups ≡ I (mod N), so N processes (a Slurm array, a Kubernetes indexed Job) cover one
/// run. A run directory from another model or pack is refused.
///
/// Example: keep calibrate --pack /tmp/pack --out /tmp/run --shard 0/4
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct CalibrateArgs {
    /// The model directory (default: the bundled model).
    #[arg(value_name = "MODEL")]
    model: Option<PathBuf>,
    /// The pack (from `keep pack`; default: $KEEP_PACK, else the bundled pack).
    #[arg(long)]
    pack: Option<PathBuf>,
    /// The run directory (created; resumed when it holds sessions of this model and pack).
    #[arg(long)]
    out: PathBuf,
    /// Which split to run: calibration or eval.
    #[arg(long, default_value = "calibration", value_parser = parse_split)]
    split: Split,
    /// Run only this shard: I/N with 0 ≤ I < N.
    #[arg(long, value_parser = crate::util::parse_shard, default_value = "0/1")]
    shard: (usize, usize),
    /// Tokens per streamed batch (each batch streams the layers once; bounds activation memory).
    #[arg(long, default_value_t = 8192)]
    chunk_tokens: usize,
    /// Kernels the forward runs on (the teacher log-probs, imatrix and REAP sums come from
    /// them): exact, or fast (integer dot products where the weight format has them).
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Exact)]
    kernels: super::KernelsArg,
    /// Keep each finished layer's pages mapped (default: dropped, so RSS stays near one layer).
    #[arg(long)]
    keep_pages: bool,
    /// Skip the hash-routed layers' expert-to-expert output distances (by default every expert
    /// of a hash-routed layer runs on every calibration token, n_experts / top_k times those
    /// layers' expert work; the `nearest` remap of `keep select --hash-remap` needs them).
    #[arg(long)]
    no_hash_distances: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

fn parse_split(s: &str) -> Result<Split, String> {
    Split::parse(s).ok_or_else(|| format!("`{s}` is not a split: calibration or eval"))
}

/// The pack to use when none is given.
pub(crate) fn default_pack() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("KEEP_PACK") {
        return Ok(PathBuf::from(p));
    }
    crate::bundled::default_pack_dir()
}

/// Peak resident set of this process (VmHWM), in bytes, where /proc has it.
pub fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn run(a: CalibrateArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => crate::bundled::default_model_dir()?,
    };
    let pack_dir = match &a.pack {
        Some(p) => p.clone(),
        None => default_pack()?,
    };
    let pack =
        Pack::open(&pack_dir).with_context(|| format!("reading pack {}", pack_dir.display()))?;
    let opts = CalibrateOptions {
        split: a.split,
        shard: a.shard,
        chunk_tokens: a.chunk_tokens,
        release_pages: !a.keep_pages,
        kernels: a.kernels.into(),
        hash_distances: !a.no_hash_distances,
        ..Default::default()
    };
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {percent}% ETA {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let t0 = Instant::now();
    let mut session = String::new();
    let mut tokens_done = 0u64;
    let mut n_layers = 1usize;
    let report = calibrate(&model, &pack, &a.out, &opts, &mut |p| match p {
        Progress::Start {
            sessions,
            skipped,
            tokens,
            n_layers: nl,
        } => {
            n_layers = nl.max(1);
            bar.set_length(tokens * n_layers as u64);
            if skipped > 0 {
                bar.println(format!("{skipped} sessions already complete: skipped"));
            }
            bar.set_message(format!("{sessions} sessions"));
        }
        Progress::Session {
            index, of, group, ..
        } => {
            session = format!("session {}/{of} {group}", index + 1);
        }
        Progress::Layer {
            layer,
            n_layers,
            batch_tokens,
        } => {
            bar.inc(batch_tokens);
            let s = t0.elapsed().as_secs_f64();
            let tps = if s > 0.0 { tokens_done as f64 / s } else { 0.0 };
            bar.set_message(format!(
                "{session} layer {}/{n_layers} {tps:.0} tok/s",
                layer + 1
            ));
        }
        Progress::Tokens { done } => tokens_done = done,
    })
    .with_context(|| format!("calibrating {} into {}", model.display(), a.out.display()))?;
    bar.finish_and_clear();
    let rss = peak_rss();
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["peak_rss_bytes"] = serde_json::json!(rss);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for (s, why) in &report.sessions_redone {
            println!("redid partial session {s} ({why})");
        }
        println!(
            "{}: {} sessions run, {} skipped (shard {}/{}), {} tokens in {:.1} s = {:.0} tokens/s{}",
            report.run.display(),
            report.sessions_run.len(),
            report.sessions_skipped.len(),
            report.shard.0,
            report.shard.1,
            report.tokens,
            report.seconds,
            report.tokens_per_s,
            rss.map(|r| format!(", peak RSS {}", crate::util::human(r)))
                .unwrap_or_default()
        );
        if let Some(e) = &report.engram {
            println!("{}", engram_line(e));
        }
    }
    Ok(())
}

/// One line on the Engram tables a run used: bytes a token gathers and the distinct rows (what
/// a row cache would need to serve every repeated n-gram from memory).
pub fn engram_line(e: &keep_model::engram::EngramUseReport) -> String {
    format!(
        "engram layers {:?}: {} rows a token in each, {} of tables a token in all; {} tokens \
         touched {} distinct rows ({}) of {} gathered",
        e.layers,
        e.rows_per_token,
        crate::util::human(e.bytes_per_token),
        e.tokens,
        e.distinct_rows.iter().sum::<u64>(),
        crate::util::human(e.distinct_bytes),
        e.rows_gathered
    )
}
