//! `keep eval`: score the model and router-masked students against a teacher run.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use keep_calib::eval::{eval, plot_kl};
use keep_calib::pack::Pack;

/// Score a model — and students of it with plans applied as router masks — against the
/// teacher's stored top-64 log-probs on the held-out split.
///
/// The teacher is an eval run (`keep calibrate --split eval --out RUN`). For each student:
/// mean KL(teacher ‖ student) per position (the teacher's top-64 plus one tail bucket for the
/// mass outside them), the student's NLL of the true next token and its change from the
/// teacher's, and top-1 agreement. Each `--mask PLAN.json` (from `keep select`) makes pruned
/// experts unselectable and renormalises over the survivors (on a pruned hash-routed layer,
/// tid2eid is remapped by the plan's hash_remap instead, as `keep prune` writes it), without
/// writing a checkpoint;
/// a pruned checkpoint is scored by passing it as MODEL. With several plans, `--plot` draws KL
/// against experts kept.
///
/// With --tasks SPEC, judges models by what they write instead: each task's prompt is completed
/// `samples` times (the spec's temperature, top-p and seeds, the same seeds for every model) by
/// MODEL (the teacher) and by each --student checkpoint (a pruned or quantized variant), and
/// every completion is checked — parses as Python (tree-sitter's Python grammar), compiles, or
/// runs and prints the expected output (the user's python3, sandboxed, with a time limit;
/// refused up front when python3 is missing). Reports each task's pass rate with a Wilson 95%
/// interval, the teacher beside each student; --json the report with every completion, --plot
/// the pass rates with their intervals. A spec: tasks/python-basics.json.
///
/// Example: keep eval --teacher /tmp/eval-run --mask plan-50.json --mask plan-25.json --plot kl.svg
/// Example: keep eval --tasks tasks/python-basics.json --student /tmp/pruned --student /tmp/e8p2
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct EvalArgs {
    /// The model (default: the bundled model).
    model: Option<PathBuf>,
    /// The teacher: an eval-split calibration run.
    #[arg(long, required_unless_present = "tasks", conflicts_with = "tasks")]
    teacher: Option<PathBuf>,
    /// A task spec (`keep-tasks` JSON): judge MODEL and each --student by sampled completions.
    #[arg(long, value_name = "SPEC", conflicts_with_all = ["alloc", "tiers", "masks"])]
    tasks: Option<PathBuf>,
    /// A student checkpoint for --tasks (repeatable): a pruned or quantized variant of MODEL.
    #[arg(long = "student", value_name = "DIR", requires = "tasks")]
    students: Vec<PathBuf>,
    /// The pack the teacher run was made from (default: the bundled pack).
    #[arg(long)]
    pack: Option<PathBuf>,
    /// A prune plan to apply as a router mask (repeatable).
    #[arg(long = "mask")]
    masks: Vec<PathBuf>,
    /// Tokens run through the model at once.
    #[arg(long, default_value_t = 4096)]
    chunk_tokens: usize,
    /// Kernels: with `fast`, the model is also scored on the fast kernels (student
    /// `model --kernels fast`, KL / ΔNLL / top-1 against the teacher) and the masks run on them.
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Exact)]
    kernels: super::KernelsArg,
    /// Draw KL against experts kept (PNG or SVG by extension); with --tiers, KL against the
    /// upper-stage bytes read per token.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Score a precision-tier allocation (ALLOC.json from `keep alloc`) in memory: each expert
    /// at its rung from the model (shipped) or a --quant checkpoint, pruned ones masked.
    #[arg(long, conflicts_with = "tiers")]
    alloc: Option<PathBuf>,
    /// Score the allocation and the runtime's per-token tiers simulated in token order, one
    /// student per --tau (gate weight ≥ τ takes the upper stage when it is in the cache).
    #[arg(long)]
    tiers: Option<PathBuf>,
    /// `keep quant` outputs holding the allocation's E8P rungs.
    #[arg(long, num_args = 1..)]
    quant: Vec<PathBuf>,
    /// Gate thresholds for --tiers, comma-separated (e.g. 0.2,0.4,0.6).
    #[arg(long, value_delimiter = ',', value_parser = crate::util::parse_tau)]
    tau: Vec<f64>,
    /// Bytes of the residual cache for --tiers (e.g. 2M).
    #[arg(long, value_parser = crate::util::parse_bytes, default_value = "0")]
    residual_cache: u64,
    /// Tokens between an upper stage's admission and its first use (--tiers).
    #[arg(long, default_value_t = keep_calib::tiers::DEFAULT_ADMIT_DELAY)]
    admit_delay: u64,
    /// The original checkpoint (this model: the shipped experts --tiers reads): experts at the
    /// top quantized rung (`e8p2+e81`, `e8p2+e8p2`), and `e8p2` ones no --quant checkpoint
    /// carries residual codes for, upgrade to their shipped expert, as in keep run --tiers
    /// --upper-from. Without it they have no upper stage.
    #[arg(long, value_name = "DIR", requires = "tiers")]
    upper_from: Option<PathBuf>,
    /// Tokens of each record computed as one prefill forward (keep run's prompt pass) before
    /// the rest one token at a time (--tiers; 0: every token its own forward).
    #[arg(long, default_value_t = 0, value_name = "N", requires = "tiers")]
    prefill_tokens: usize,
    /// Replace an existing --plot file.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    if let Some(p) = &a.plot {
        crate::util::check_out_file(p, a.force, &[])?;
    }
    let model = match a.model.clone() {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    if let Some(spec) = &a.tasks {
        return super::tasks::run(super::tasks::TasksRun {
            spec,
            teacher: &model,
            students: &a.students,
            kernels: a.kernels.into(),
            json: a.json,
            plot: a.plot.as_deref(),
        });
    }
    let teacher = a
        .teacher
        .clone()
        .context("--teacher (an eval-split calibration run) is required")?;
    let pack_dir = match &a.pack {
        Some(p) => p.clone(),
        None => crate::cmd::calibrate::default_pack()?,
    };
    let pack =
        Pack::open(&pack_dir).with_context(|| format!("reading pack {}", pack_dir.display()))?;
    if let Some(alloc) = a.alloc.as_ref().or(a.tiers.as_ref()) {
        return run_tiers(&a, &model, &pack, alloc);
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("eval [{bar:30}] {pos}/{len} records ETA {eta}")
            .expect("valid template"),
    );
    let r = eval(
        &model,
        &teacher,
        &pack,
        &a.masks,
        a.chunk_tokens,
        a.kernels.into(),
        &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        },
    )
    .with_context(|| format!("scoring {} against {}", model.display(), teacher.display()))?;
    bar.finish_and_clear();
    if let Some(p) = &a.plot {
        plot_kl(&r, p)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "teacher {} ({} records, teacher NLL {:.4} nats/token)",
        r.teacher, r.records, r.teacher_nll
    );
    println!(
        "{:<28} {:>8} {:>10} {:>10} {:>10} {:>8}",
        "student", "experts", "KL", "NLL", "ΔNLL", "top-1"
    );
    for s in &r.students {
        println!(
            "{:<28} {:>4}/{:<3} {:>10.5} {:>10.4} {:>+10.4} {:>7.2}%",
            s.label,
            s.experts_kept,
            s.experts_total,
            s.mean_kl,
            s.mean_nll,
            s.mean_dnll,
            s.top1 * 100.0
        );
    }
    if let Some(e) = &r.engram {
        println!("{}", super::calibrate::engram_line(e));
    }
    Ok(())
}

fn run_tiers(a: &EvalArgs, model: &Path, pack: &Pack, alloc: &Path) -> anyhow::Result<()> {
    if a.tiers.is_some() && a.tau.is_empty() {
        anyhow::bail!("--tiers needs at least one --tau");
    }
    let opts = keep_calib::tiers::TierOptions {
        taus: if a.tiers.is_some() {
            a.tau.clone()
        } else {
            vec![]
        },
        cache_bytes: a.residual_cache,
        admit_delay: a.admit_delay,
        upper_shipped: a.upper_from.is_some(),
        prefill_tokens: a.prefill_tokens,
        record: false,
    };
    if let Some(u) = &a.upper_from {
        let fp = keep_checkpoint::fingerprint::model_fingerprint;
        anyhow::ensure!(
            fp(u)? == fp(model)?,
            "--upper-from {}: keep eval scores the shipped experts of the model it evaluates ({}); \
             give that checkpoint",
            u.display(),
            model.display()
        );
    }
    let teacher = a
        .teacher
        .as_ref()
        .context("--teacher (an eval-split calibration run) is required")?;
    let bar = crate::util::count_bar(0, "eval");
    let r =
        keep_calib::tiers::eval_tiers(model, alloc, &a.quant, teacher, pack, &opts, &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        })
        .with_context(|| format!("scoring {} against {}", alloc.display(), teacher.display()))?;
    bar.finish_and_clear();
    if let Some(p) = &a.plot {
        keep_calib::tiers::plot_tiers(&r, p)?;
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "allocation {} ({} records; rungs {:?}; upper stages {:?})",
        r.alloc, r.records, r.rung_mix, r.upper_stages
    );
    if let Some(n) = r
        .upper_stages
        .get("none")
        .filter(|_| a.upper_from.is_none())
    {
        println!(
            "{n} experts have no upper stage: at the top quantized rung (or shipped) their upper \
             stage would be the shipped expert (--upper-from MODEL)"
        );
    }
    println!(
        "{:<16} {:>10} {:>10} {:>8} {:>9} {:>9} {:>7} {:>7} {:>7} {:>10}",
        "student", "KL", "ΔNLL", "top-1", "base", "upper", "hits", "misses", "admits", "B/token"
    );
    for s in &r.students {
        let m = s.mix.clone().unwrap_or_default();
        println!(
            "{:<16} {:>10.5} {:>+10.4} {:>7.2}% {:>9} {:>9} {:>7} {:>7} {:>7} {:>10.0}",
            s.label,
            s.mean_kl,
            s.mean_dnll,
            s.top1 * 100.0,
            m.slots_base,
            m.slots_upper,
            m.hits,
            m.misses,
            m.admissions,
            m.bytes_read_per_token
        );
    }
    Ok(())
}
