//! `keep eval`: score the model and router-masked students against a teacher run.

use std::path::PathBuf;

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
/// Example: keep eval --teacher /tmp/eval-run --mask plan-50.json --mask plan-25.json --plot kl.svg
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct EvalArgs {
    /// The model (default: the bundled model).
    model: Option<PathBuf>,
    /// The teacher: an eval-split calibration run.
    #[arg(long)]
    teacher: PathBuf,
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
    /// Draw KL against experts kept (PNG or SVG by extension).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Replace an existing --plot file.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: EvalArgs) -> anyhow::Result<()> {
    if let Some(p) = &a.plot {
        crate::util::check_out_file(p, a.force, &[])?;
    }
    let model = match a.model {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    let pack_dir = match &a.pack {
        Some(p) => p.clone(),
        None => crate::cmd::calibrate::default_pack()?,
    };
    let pack =
        Pack::open(&pack_dir).with_context(|| format!("reading pack {}", pack_dir.display()))?;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("eval [{bar:30}] {pos}/{len} records ETA {eta}")
            .expect("valid template"),
    );
    let r = eval(
        &model,
        &a.teacher,
        &pack,
        &a.masks,
        a.chunk_tokens,
        a.kernels.into(),
        &mut |d, t| {
            bar.set_length(t as u64);
            bar.set_position(d as u64);
        },
    )
    .with_context(|| {
        format!(
            "scoring {} against {}",
            model.display(),
            a.teacher.display()
        )
    })?;
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
