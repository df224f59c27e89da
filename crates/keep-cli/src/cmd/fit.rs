//! `keep fit`: plan a run inside a memory budget (probes, candidate search, predictions) and
//! write the plan; `keep fit --check PLAN` runs a plan and prints predicted against measured.
//! Flags and printing only: the probes, search, plan application and check are keep-fit's.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_artifacts::fit_plan::{Candidate, Memory};
use keep_fit::check::{check, CheckOptions, CheckReport};
use keep_fit::probe::{auto_memory, ProbeOptions};

use super::logits::model_dir;
use crate::util::{human, parse_bytes};

/// Plan how to run a model inside a memory budget, with a predicted speed and quality.
///
/// Probes the machine first: one short budgeted decode of the model at its own shapes with the
/// smallest budget that runs, which reads the model's own expert bytes with O_DIRECT (read
/// bandwidth, seconds per miss) and times the compute per token on the chosen kernels. Then
/// searches experts kept (REAP levels from --run), hot-set policy (lru, decay, static) and the
/// hot set the memory leaves; tok/s is predicted by replaying the run's routes (a synthetic
/// trace without --run) through the runtime's own policies, KL from `keep eval --json` reports
/// (--eval), measured or interpolated between measured counts and marked so. Without
/// --min-quality only plans that keep every expert qualify. Prints the best candidates and
/// writes the plan (keep-fit-plan v1), its prune plan and the initial route profile beside it.
/// `--check PLAN` runs the plan and prints predicted against measured tok/s, hit rate, peak
/// RSS and (with --teacher) KL.
///
/// Example: keep fit --memory 12MiB --run /tmp/calib --eval eval.json --min-quality 0.05 --out plan.json
///          keep run --plan plan.json --build --prompt "Once upon a time"
///          keep fit --check plan.json --teacher /tmp/eval-run
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct FitArgs {
    /// Model directory (default: the bundled model).
    model: Option<PathBuf>,
    /// Memory to fit: bytes (e.g. 12GiB) or auto (MemAvailable minus a margin of 10%, at
    /// least 512 MiB).
    #[arg(long, required_unless_present = "check")]
    memory: Option<String>,
    /// Calibration run (after `keep finalize`): routes to replay, REAP levels to prune to.
    #[arg(long, value_name = "CALIB_RUN")]
    run: Option<PathBuf>,
    /// `keep eval --json` reports with the KL of masked students (repeatable).
    #[arg(long, value_name = "FILE", num_args = 1..)]
    eval: Vec<PathBuf>,
    /// Largest KL (nats per token, against the teacher) a plan may have.
    #[arg(long, value_name = "KL")]
    min_quality: Option<f64>,
    /// Experts-kept counts to try (default: 100, 87.5, 75, 62.5, 50, 37.5% of the experts).
    #[arg(long, value_delimiter = ',')]
    levels: Vec<usize>,
    /// Knobs the search may turn: all, or one alone (offload: every expert kept; prune:
    /// pruned until every survivor is in memory) for comparison.
    #[arg(long, value_enum, default_value_t = KnobArg::All)]
    knob: KnobArg,
    /// Kernels the plan runs on.
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Fast)]
    kernels: super::KernelsArg,
    /// Positions of context the plan holds (prompt + generated).
    #[arg(long, default_value_t = 512)]
    context: usize,
    /// Tokens the probes decode after each check-set prompt (and --check decodes again; a
    /// plan without a check set: tokens --check generates).
    #[arg(long, default_value_t = 32)]
    probe_tokens: usize,
    /// Prompt tokens of each check-set sequence.
    #[arg(long, default_value_t = 16)]
    prompt_tokens: usize,
    /// Sequences in the check set (the texts the probes and --check decode).
    #[arg(long, default_value_t = keep_fit::checkset::DEFAULT_SEQUENCES)]
    sequences: usize,
    /// A pack whose held-out records are the check set's texts (default: the bundled pack for
    /// the bundled model, synthetic ids for any other model).
    #[arg(long, value_name = "PACK")]
    held_out: Option<PathBuf>,
    /// Where the derived (pruned) checkpoint goes (default: beside the plan).
    #[arg(long)]
    derived_dir: Option<PathBuf>,
    /// The plan to write.
    #[arg(long, default_value = "plan.json")]
    out: PathBuf,
    /// Replace an existing plan (and its prune plan and profile).
    #[arg(long)]
    force: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Run this plan and compare measured with predicted instead of planning.
    #[arg(long, value_name = "PLAN")]
    check: Option<PathBuf>,
    /// With --check: an eval-split calibration run to measure the KL against.
    #[arg(long, requires = "check")]
    teacher: Option<PathBuf>,
    /// With --check --teacher: the pack the teacher was made from (default: the bundled pack).
    #[arg(long, requires = "teacher")]
    pack: Option<PathBuf>,
    /// With --check: build the plan's derived checkpoint when it is missing.
    #[arg(long)]
    build: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

/// `--knob`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum KnobArg {
    All,
    Offload,
    Prune,
}

fn tps(c: &Candidate) -> String {
    c.tokens_per_sec
        .value
        .map(|v| format!("{v:.1}"))
        .unwrap_or_else(|| "-".into())
}

fn kl(c: &Candidate) -> String {
    match c.kl.value {
        Some(v) => format!("{v:.4} {}", &c.kl.provenance[..1]),
        None => "- u".into(),
    }
}

fn print_table(rows: &[Candidate]) {
    println!(
        "  {:<24} {:>8} {:>6} {:>6} {:>9} {:>10} {:>10} {:>10}",
        "candidate", "policy", "hot", "hit", "tok/s", "KL", "memory", "on SSD"
    );
    for (i, c) in rows.iter().enumerate() {
        println!(
            "{} {:<24} {:>8} {:>6} {:>5.1}% {:>9} {:>10} {:>10} {:>10}{}",
            if i == 0 { "*" } else { " " },
            c.name,
            c.policy,
            format!("{}/{}", c.hot_set, c.experts_kept),
            100.0 * c.hit_rate,
            tps(c),
            kl(c),
            human(c.bytes_in_memory),
            human(c.bytes_on_ssd),
            if c.meets_quality { "" } else { "  (quality)" }
        );
    }
    println!("  KL: m measured, i interpolated, d by definition, u unknown; * the plan");
}

fn print_check(r: &CheckReport) {
    println!("plan {} on {} ({})", r.plan, r.checkpoint, r.candidate);
    println!(
        "  {:<14} {:>12} {:>12} {:>10}",
        "", "predicted", "measured", "within"
    );
    let yn = |b: Option<bool>| match b {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "-",
    };
    println!(
        "  {:<14} {:>12} {:>12.2} {:>10}",
        "decode tok/s",
        r.predicted_tps
            .map(|v| format!("{v:.2}"))
            .unwrap_or_else(|| "-".into()),
        r.measured_tps,
        yn(r.tps_within)
    );
    println!(
        "  {:<14} {:>11.1}% {:>12} {:>10}",
        "hit rate",
        100.0 * r.predicted_hit_rate,
        r.measured_hit_rate
            .map(|h| format!("{:.1}%", 100.0 * h))
            .unwrap_or_else(|| "-".into()),
        ""
    );
    println!(
        "  {:<14} {:>12} {:>12} {:>10}",
        "KL",
        r.predicted_kl
            .map(|v| format!("{v:.5}"))
            .unwrap_or_else(|| "-".into()),
        r.measured_kl
            .map(|v| format!("{v:.5}"))
            .unwrap_or_else(|| "-".into()),
        yn(r.kl_within)
    );
    println!(
        "  {:<14} {:>12} {:>12} {:>10}",
        "peak RSS",
        r.peak_rss_ceiling
            .map(|c| format!("<= {}", human(c)))
            .unwrap_or_else(|| "-".into()),
        r.peak_rss.map(human).unwrap_or_else(|| "-".into()),
        yn(r.peak_rss_within)
    );
    println!(
        "  {} decoded tokens over {} sequences ({}); load {}; profile {}",
        r.decode_tokens,
        r.sequences,
        r.check_source,
        r.loadavg.as_deref().unwrap_or("?"),
        r.profile
    );
}

pub fn run(a: FitArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    if let Some(plan) = &a.check {
        let teacher = match &a.teacher {
            Some(t) => Some((
                t.clone(),
                match &a.pack {
                    Some(p) => p.clone(),
                    None => super::calibrate::default_pack()?,
                },
            )),
            None => None,
        };
        let r = check(
            plan,
            &CheckOptions {
                prompt_tokens: a.prompt_tokens,
                decode_tokens: a.probe_tokens,
                teacher,
                build: a.build,
            },
        )
        .with_context(|| format!("checking {}", plan.display()))?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&r)?);
        } else {
            print_check(&r);
        }
        return Ok(());
    }
    let dir = model_dir(a.model.clone())?;
    crate::util::check_out_file(&a.out, a.force, &[&dir])?;
    let mem = a.memory.as_deref().unwrap_or("auto");
    let memory = if mem == "auto" {
        let (bytes, avail, margin) = auto_memory()?;
        Memory {
            bytes,
            auto: true,
            available: Some(avail),
            margin,
        }
    } else {
        Memory {
            bytes: parse_bytes(mem).map_err(|e| anyhow::anyhow!("--memory: {e}"))?,
            auto: false,
            available: keep_fit::probe::mem_available(),
            margin: 0,
        }
    };
    if let Some(q) = a.min_quality {
        anyhow::ensure!(
            q.is_finite() && q >= 0.0,
            "--min-quality must be a KL ≥ 0, not {q}"
        );
    }
    let kernels: keep_model::Kernels = a.kernels.into();
    let opts = keep_fit::FitOptions {
        model: dir.clone(),
        memory,
        run: a.run.clone(),
        evals: a.eval.clone(),
        min_quality: a.min_quality,
        kernels,
        probe: ProbeOptions {
            kernels,
            prompt_tokens: a.prompt_tokens,
            decode_tokens: a.probe_tokens,
            sequences: a.sequences,
            held_out: match (&a.held_out, &a.model) {
                (Some(p), _) => Some(p.clone()),
                (None, None) => Some(super::calibrate::default_pack()?),
                (None, Some(_)) => None,
            },
            context: a.context,
            io_threads: keep_runtime::DEFAULT_IO_THREADS,
        },
        out: a.out.clone(),
        derived_dir: a.derived_dir.clone(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        levels: a.levels.clone(),
        knob: match a.knob {
            KnobArg::All => keep_fit::search::Knob::All,
            KnobArg::Offload => keep_fit::search::Knob::Offload,
            KnobArg::Prune => keep_fit::search::Knob::Prune,
        },
    };
    let o = keep_fit::fit(&opts).with_context(|| format!("fitting {}", dir.display()))?;
    keep_fit::search::write(&o, &a.out, a.force)
        .with_context(|| format!("writing {}", a.out.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&o.plan)?);
        return Ok(());
    }
    let p = &o.plan;
    println!(
        "memory {}{}; probe: compute {:.3} ms/token ({} kernels, {} tokens, {}), a miss {:.3} ms per layer + {:.3} ms each, {:.2} GB/s {}",
        human(p.memory.bytes),
        if p.memory.auto {
            format!(
                " (auto: {} available − {} margin)",
                human(p.memory.available.unwrap_or(0)),
                human(p.memory.margin)
            )
        } else {
            String::new()
        },
        1e3 * p.probes.compute_secs_per_token,
        p.probes.kernels,
        p.probes.compute_probe_tokens,
        p.probes.compute_provenance,
        1e3 * p.probes.layer_latency_secs,
        1e3 * p.probes.miss_transfer_secs,
        p.probes.ssd_gbps,
        if p.probes.direct_io { "O_DIRECT" } else { "buffered" }
    );
    print_table(&p.candidates);
    for (what, c) in [
        ("offload only", &o.best_offload),
        ("prune only", &o.best_prune),
    ] {
        if let Some(c) = c {
            let r = match (p.prediction.tokens_per_sec.value, c.tokens_per_sec.value) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
                _ => "-".into(),
            };
            println!("plan vs best {what} ({}, {} tok/s): {r}", c.name, tps(c));
        }
    }
    for n in &o.notes {
        println!("note: {n}");
    }
    if let Some(d) = &p.derived {
        println!("derived checkpoint {}: build it with", d.dir);
        for c in &d.commands {
            println!("  {c}");
        }
        println!("  (or keep run --plan {} --build)", a.out.display());
    }
    println!("wrote {}", a.out.display());
    Ok(())
}
