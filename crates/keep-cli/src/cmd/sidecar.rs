//! `keep sidecar`: a pruned checkpoint with reduced-rank ridge sidecars fitted against the
//! teacher.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_artifacts::plan::PrunePlan;
use keep_calib::pack::Pack;
use keep_calib::sidecar::{calibration_records, fit, LayerFit, Ridge, SidecarOptions};
use keep_checkpoint::writer::TensorMeta;
use keep_checkpoint::Dtype;
use keep_convert::prune::{prune_with, PruneExtra, PruneOptions};
use serde::Serialize;

use crate::util::{byte_bar, count_bar, human};

/// Prune MODEL by PLAN and add, per pruned MoE layer, a low-rank sidecar that wins back part
/// of what the removed experts contributed.
///
/// A layer's sidecar is a rank-R linear map from the MoE block's input x to
/// teacher MoE(x) − pruned MoE(x), added to the block's output: out += (x·A)·B, 2·R·hidden
/// numbers per layer (F32), resident, one small product per token. Fitted by reduced-rank ridge
/// regression (f64) on the calibration split of the pack the run RUN was made from, layer by
/// layer: each layer's inputs come from the pruned model with the sidecars kept before it
/// applied. Every fifth calibration group (whole sources) is held out as validation records;
/// fit and validation records are taken round-robin over their groups. A layer keeps its
/// sidecar only where it explains part of the validation rows and lowers the whole pruned
/// model's KL to the teacher on them; the report gives both per layer. Memory: one record's
/// activations and four hidden × hidden sums per layer. --ridge is relative to the mean input
/// energy (λ·tr(XᵀX)/hidden is added to the diagonal); auto (the default) picks it per layer
/// by the validation rows.
///
/// Writes OUT: the checkpoint `keep prune` writes (byte copy) plus the tensors
/// layers.L.ffn.sidecar.a.weight [R × hidden] and layers.L.ffn.sidecar.b.weight [hidden × R],
/// and "keep_sidecar" in config.json. Every verb that loads OUT (run, run --memory-budget,
/// logits, eval, serve) applies the sidecars; keep inspect lists them.
///
/// Example: keep sidecar models/keep-tiny --teacher-run /tmp/run-cal --plan reap-50.json --rank 32 --out /tmp/tiny-50-sc32
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct SidecarArgs {
    /// The teacher checkpoint the plan was made for (default: the bundled model).
    model: Option<PathBuf>,
    /// A calibration run of MODEL (`keep calibrate`, either split): names the pack to fit on.
    #[arg(long, value_name = "RUN")]
    teacher_run: PathBuf,
    /// The pack RUN was made from (default: the bundled pack).
    #[arg(long)]
    pack: Option<PathBuf>,
    /// The prune plan (keep-prune-plan JSON from `keep select`).
    #[arg(long)]
    plan: PathBuf,
    /// Rank of each layer's sidecar (at most hidden).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rank: u64,
    /// Ridge, relative to the mean diagonal of XᵀX, or `auto`: per layer, the ridge whose
    /// sidecar explains the most of the validation records.
    #[arg(long, default_value = "auto", value_parser = parse_ridge)]
    ridge: Ridge,
    /// Fit on at most this many calibration tokens (whole records, pack order; default: all).
    #[arg(long, value_name = "N")]
    max_tokens: Option<usize>,
    /// The output directory.
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing output keep wrote.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

fn parse_ridge(s: &str) -> Result<Ridge, String> {
    if s == "auto" {
        return Ok(Ridge::Auto);
    }
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(Ridge::Relative(v)),
        _ => Err(format!("`{s}` is neither `auto` nor a finite number ≥ 0")),
    }
}

/// `--ridge` as written to the report and config.json: a number or "auto".
fn ridge_json(r: Ridge) -> serde_json::Value {
    match r {
        Ridge::Relative(v) => serde_json::json!(v),
        Ridge::Auto => serde_json::json!("auto"),
    }
}

#[derive(Serialize)]
struct Report {
    format: &'static str,
    version: u32,
    model: String,
    plan: String,
    output: String,
    rank: usize,
    ridge: serde_json::Value,
    tokens: u64,
    validation_tokens: u64,
    sidecar_bytes: u64,
    experts_kept: usize,
    experts_total: usize,
    bytes_before: u64,
    bytes_after: u64,
    layers: Vec<LayerFit>,
}

pub fn run(a: SidecarArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let model = match a.model.clone() {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    let pack_dir = match &a.pack {
        Some(p) => p.clone(),
        None => crate::cmd::calibrate::default_pack()?,
    };
    crate::util::check_out_of_cache(&a.out)?;
    keep_checkpoint::writer::check_dir_target(
        &a.out,
        a.force,
        &[
            model.clone(),
            a.plan.clone(),
            a.teacher_run.clone(),
            pack_dir.clone(),
        ],
    )?;
    let plan = PrunePlan::read(&a.plan)?;
    let pack =
        Pack::open(&pack_dir).with_context(|| format!("reading pack {}", pack_dir.display()))?;
    let records = calibration_records(&a.teacher_run, &pack, &model, a.max_tokens)?;
    let opts = SidecarOptions {
        rank: a.rank as usize,
        ridge: a.ridge,
    };
    let bar = count_bar(
        (records.fit.len() + records.validation.len()) as u64,
        "sidecar",
    );
    let f = fit(&model, &plan, &records, &opts, &mut |l, done, total| {
        bar.set_message(format!("sidecar layer {l}"));
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| {
        format!(
            "fitting sidecars of {} on {}",
            a.plan.display(),
            model.display()
        )
    })?;
    bar.finish_and_clear();

    let mut extra = PruneExtra::default();
    let mut layers = vec![];
    let mut sidecar_bytes = 0u64;
    let rank = f.layers.first().map_or(0, |l| l.rank);
    for (l, sc) in f.sidecars.iter().enumerate() {
        let Some(sc) = sc else { continue };
        let [na, nb] = keep_model::sidecar::tensor_names(&format!("layers.{l}."));
        let (r, d) = (sc.rank as u64, sc.hidden as u64);
        let bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        extra
            .tensors
            .push((TensorMeta::new(na, Dtype::F32, &[r, d]), bytes(sc.a())));
        extra
            .tensors
            .push((TensorMeta::new(nb, Dtype::F32, &[d, r]), bytes(sc.b())));
        sidecar_bytes += 2 * r * d * 4;
        layers.push(l);
    }
    extra.config.push((
        "keep_sidecar".into(),
        serde_json::json!({
            "rank": rank,
            "ridge": ridge_json(a.ridge),
            "layers": layers,
            // The relative ridge each kept layer's fit used (`--ridge auto` chooses per layer).
            "layer_ridges": layers
                .iter()
                .map(|&l| f.layers.iter().find(|x| x.layer == l).map(|x| x.ridge))
                .collect::<Vec<_>>(),
            "dtype": "F32",
            "tokens": f.tokens,
            "plan_saliency": plan.saliency,
        }),
    ));
    let popts = PruneOptions {
        force: a.force,
        sync: true,
    };
    let bar = byte_bar(0, "write");
    let (out, r) = prune_with(&model, &plan, &a.out, &popts, &extra, &|d, t| {
        bar.set_length(t);
        bar.set_position(d);
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    bar.finish_and_clear();
    let rep = Report {
        format: "keep-sidecar-report",
        version: 1,
        model: model.display().to_string(),
        plan: a.plan.display().to_string(),
        output: out.display().to_string(),
        rank,
        ridge: ridge_json(a.ridge),
        tokens: f.tokens,
        validation_tokens: f.validation_tokens,
        sidecar_bytes,
        experts_kept: r.n_experts_after,
        experts_total: r.n_experts_before,
        bytes_before: r.bytes_before,
        bytes_after: r.bytes_after,
        layers: f.layers,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rep)?);
        return Ok(());
    }
    println!(
        "wrote {}: {} → {} experts per layer, {} → {} (sidecars {}, rank {}, fitted on {} tokens)",
        rep.output,
        rep.experts_total,
        rep.experts_kept,
        human(rep.bytes_before),
        human(rep.bytes_after),
        human(rep.sidecar_bytes),
        rep.rank,
        rep.tokens
    );
    for l in &rep.layers {
        let val = match l.explained_validation {
            Some(v) => format!(", validation {:.1}%", 100.0 * v),
            None => String::new(),
        };
        println!(
            "  layer {:>3}: removed experts' energy {:.4}/token, explained {:.1}% (full-rank ridge {:.1}%){val}, ridge {}{}",
            l.layer,
            l.y_energy,
            100.0 * l.explained,
            100.0 * l.explained_full,
            l.ridge,
            if l.kept { "" } else { ": no sidecar (it explains nothing of the validation records)" }
        );
    }
    Ok(())
}
