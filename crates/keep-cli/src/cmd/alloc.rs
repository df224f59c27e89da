//! `keep alloc`: a precision tier for every routed expert under a byte budget (keep-quant's
//! `alloc` solves it, keep-artifacts' `alloc` writes the file), and `keep alloc-fit`: the loss
//! model that calibrates its objective on measured points.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_artifacts::alloc::{Alloc, LossModel};
use keep_quant::alloc::{allocate, expert_table, fit_loss_model, AllocOptions, Saliency, Solver};

/// Allocate a rung to every routed expert under a byte budget (ALLOC.json).
///
/// Each expert (l, j) can be pruned, coded E8P2 / E8P2+E81 / E8P2+E8P2, or kept as shipped.
/// Its predicted loss at a rung is its REAP saliency (from the finalized calibration run RUN)
/// times its imatrix-weighted relative reconstruction error at that rung (from the
/// quant-report.json of `keep quant` runs; pruned = 1, shipped = 0). The rungs' bytes come from
/// the model's tensor shapes, codes and scales included. The allocation minimising the summed
/// loss within --budget bytes of routed experts is found by an exact multiple-choice knapsack
/// (dynamic programming over the budget at the rung sizes' common grain) or, with --solver
/// greedy, by marginal gain on each expert's convex hull. Hash-routed layers are never pruned.
/// With --loss-model (from `keep alloc-fit`), each rung's loss is scaled by the multiplier
/// fitted on measured KL, and the predicted loss is a predicted KL.
///
/// Example: keep quant --imatrix RUN --format e8p2+e81 --out Q3; keep quant --imatrix RUN
///   --format e8p2+e8p2 --out Q4; keep alloc RUN --budget 12M --quant-report Q3 Q4 --out a.json
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct AllocArgs {
    /// The finalized calibration run (reap-stats.safetensors from `keep finalize`).
    run: PathBuf,
    /// The model as shipped (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Bytes of routed experts to fit (e.g. 12M, 3.5G).
    #[arg(long, value_parser = crate::util::parse_bytes)]
    budget: u64,
    /// Output ALLOC.json (refused if it exists, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Rungs to choose from, comma-separated.
    #[arg(long, default_value = "pruned,e8p2,e8p2+e81,e8p2+e8p2,shipped")]
    rungs: String,
    /// quant-report.json files (or the `keep quant` outputs holding them).
    #[arg(long, num_args = 1..)]
    quant_report: Vec<PathBuf>,
    /// Solver: exact (dynamic programming; the default) or greedy (marginal gain on hulls).
    #[arg(long, default_value = "exact")]
    solver: String,
    /// Saliency: reap-mass (Σ g‖f‖ per calibration token; default) or reap (mean g‖f‖ per
    /// routed token, as `keep select` ranks).
    #[arg(long, default_value = "reap-mass")]
    saliency: String,
    /// A loss model (LOSS.json from `keep alloc-fit`): per-rung multipliers of the loss.
    #[arg(long)]
    loss_model: Option<PathBuf>,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Print the allocation as JSON.
    #[arg(long)]
    json: bool,
}

/// Fit `keep alloc`'s loss model on measured points (LOSS.json).
///
/// Each point is an allocation (ALLOC.json from `keep alloc`: a uniform rung is `--rungs e8p2`
/// with a large budget, pruning to fit `--rungs pruned,shipped`) and its KL measured by `keep
/// eval --alloc` against the teacher. A point's loss terms are, per rung, Σ saliency ×
/// relative error over the experts at that rung (pruned: error 1); the fit finds one
/// non-negative multiplier per rung so that Σ multiplier × term predicts the KL, minimising
/// the squared relative error (exact non-negative least squares). --check points are not
/// fitted on: their predictions against their measured KL are the held-out check. Needs at
/// least as many --point as rungs with terms.
///
/// Example: keep alloc-fit RUN --quant-report Q3 --point u2.json=0.0077 --point u3.json=0.0023
///   --point prune.json=0.088 --check alloc.json=0.0080 --out loss.json
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct AllocFitArgs {
    /// The finalized calibration run the allocations were solved with.
    run: PathBuf,
    /// The model as shipped (default: the bundled model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// quant-report.json files (or the `keep quant` outputs holding them).
    #[arg(long, num_args = 1..)]
    quant_report: Vec<PathBuf>,
    /// A fitted point: ALLOC.json=KL (repeatable).
    #[arg(long = "point", required = true)]
    points: Vec<String>,
    /// A held-out point, predicted but not fitted on: ALLOC.json=KL (repeatable).
    #[arg(long = "check")]
    checks: Vec<String>,
    /// Saliency the allocations use: reap-mass (default) or reap.
    #[arg(long, default_value = "reap-mass")]
    saliency: String,
    /// Output LOSS.json (refused if it exists, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Print the loss model as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_point(s: &str) -> anyhow::Result<(String, Alloc, f64)> {
    let (path, kl) = s
        .rsplit_once('=')
        .with_context(|| format!("point `{s}`: expected ALLOC.json=KL"))?;
    let kl: f64 = kl
        .parse()
        .with_context(|| format!("point `{s}`: KL `{kl}` is not a number"))?;
    let a = Alloc::read(std::path::Path::new(path)).with_context(|| format!("point `{s}`"))?;
    Ok((path.to_string(), a, kl))
}

pub fn run_fit(a: AllocFitArgs) -> anyhow::Result<()> {
    let model = match a.model {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    let mut inputs: Vec<&std::path::Path> = vec![&model, &a.run];
    inputs.extend(a.quant_report.iter().map(|p| p.as_path()));
    crate::util::check_out_file(&a.out, a.force, &inputs)?;
    let saliency = Saliency::parse(&a.saliency)
        .with_context(|| format!("unknown --saliency {}: reap-mass or reap", a.saliency))?;
    let points = a
        .points
        .iter()
        .map(|s| parse_point(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let checks = a
        .checks
        .iter()
        .map(|s| parse_point(s))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let table = expert_table(&model, &a.run, &a.quant_report, saliency)
        .with_context(|| format!("reading {}", a.run.display()))?;
    let lm = fit_loss_model(&table, &points, &checks)?;
    lm.write(&a.out, a.force)
        .with_context(|| format!("writing {}", a.out.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&lm)?);
        return Ok(());
    }
    println!(
        "wrote {}: multipliers (KL per saliency × error)",
        a.out.display()
    );
    for (k, v) in &lm.multipliers {
        println!("  {k:<10} {v:.6}");
    }
    for (what, pts) in [("fitted", &lm.fitted), ("held out", &lm.held_out)] {
        for p in pts.iter() {
            println!(
                "  {what:<8} {}: KL {:.6}, predicted {:.6} ({:.2}×)",
                p.alloc,
                p.kl,
                p.predicted,
                p.predicted / p.kl
            );
        }
    }
    Ok(())
}

pub fn run(a: AllocArgs) -> anyhow::Result<()> {
    let model = match a.model {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    let mut inputs: Vec<&std::path::Path> = vec![&model, &a.run];
    inputs.extend(a.quant_report.iter().map(|p| p.as_path()));
    inputs.extend(a.loss_model.iter().map(|p| p.as_path()));
    crate::util::check_out_file(&a.out, a.force, &inputs)?;
    let solver = match a.solver.as_str() {
        "exact" => Solver::Auto,
        "greedy" => Solver::Greedy,
        s => anyhow::bail!("unknown --solver {s}: exact or greedy"),
    };
    let saliency = Saliency::parse(&a.saliency)
        .with_context(|| format!("unknown --saliency {}: reap-mass or reap", a.saliency))?;
    let loss_model = match &a.loss_model {
        Some(p) => Some(LossModel::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let opts = AllocOptions {
        loss_model,
        model: model.clone(),
        run: a.run.clone(),
        reports: a.quant_report.clone(),
        rungs: a.rungs.split(',').map(|s| s.trim().to_string()).collect(),
        budget: a.budget,
        solver,
        saliency,
    };
    let alloc = allocate(&opts).with_context(|| format!("allocating {}", model.display()))?;
    alloc
        .write(&a.out, a.force)
        .with_context(|| format!("writing {}", a.out.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&alloc)?);
        return Ok(());
    }
    println!(
        "wrote {}: {} of {} budget, predicted loss {:.6} ({}, grain {} B, saliency {})",
        a.out.display(),
        crate::util::human(alloc.bytes),
        crate::util::human(alloc.budget_bytes),
        alloc.predicted_loss,
        alloc.solver,
        alloc.grain_bytes,
        alloc.saliency
    );
    for (label, n) in alloc.mix() {
        let per = alloc
            .rungs
            .iter()
            .find(|r| r.label == label)
            .map_or(0, |r| r.bytes_per_expert);
        println!("  {label:<10} {n:>6} experts × {}", crate::util::human(per));
    }
    Ok(())
}
