//! `keep prune`: write a smaller checkpoint by byte copy, following a plan from `keep select`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_artifacts::plan::PrunePlan;
use keep_convert::prune::{prune, PruneOptions};

use crate::util::{byte_bar, human};

/// Drop the routed experts a plan prunes and write the rest by byte copy.
///
/// Survivors are renumbered 0..E'-1 in their original order; gate.weight rows and
/// gate.bias / gate.bias_vl entries are sliced; n_routed_experts is updated; FP8, FP4 and E8M0
/// bytes are never decoded; tensors keep does not know are copied and listed. A pruned
/// hash-routed layer's gate.tid2eid is rewritten through the plan's hash_remap (each removed
/// expert replaced, then every id renumbered; `keep select --hash-remap`); without a remap such
/// a layer is refused. Writes prune-map.json
/// (old → new ids), the index and SHA256SUMS; the output appears only when complete.
///
/// Example: keep prune --plan plan-50.json /tmp/keep-tiny-50
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct PruneArgs {
    /// [MODEL] OUT: the model to prune (default: the bundled model) and the output directory.
    #[arg(value_name = "[MODEL] OUT", num_args = 1..=2, required = true)]
    paths: Vec<PathBuf>,
    /// The plan (keep-prune-plan JSON from `keep select`).
    #[arg(long)]
    plan: PathBuf,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
}

pub fn run(a: PruneArgs) -> anyhow::Result<()> {
    let (model, out) = match a.paths.as_slice() {
        [out] => (crate::bundled::default_model_dir()?, out.clone()),
        [model, out] => (model.clone(), out.clone()),
        _ => anyhow::bail!("give [MODEL] OUT"),
    };
    crate::util::check_out_of_cache(&out)?;
    keep_checkpoint::writer::check_dir_target(&out, a.force, &[model.clone(), a.plan.clone()])?;
    let plan = PrunePlan::read(&a.plan)?;
    let opts = PruneOptions {
        force: a.force,
        sync: true,
    };
    let bar = byte_bar(0, "prune");
    let (out, r) = prune(&model, &plan, &out, &opts, &|d, t| {
        bar.set_length(t);
        bar.set_position(d);
    })
    .with_context(|| format!("pruning {} into {}", model.display(), out.display()))?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} → {} experts per layer, {} → {}; {} tensors copied, {} sliced, {} dropped",
        out.display(),
        r.n_experts_before,
        r.n_experts_after,
        human(r.bytes_before),
        human(r.bytes_after),
        r.tensors_copied,
        r.tensors_sliced,
        r.tensors_dropped
    );
    crate::util::print_reused(&r.reused);
    for (l, p) in &r.hash_remapped {
        println!("layer {l}: tid2eid rewritten through the {p} remap");
    }
    if !r.unknown_copied.is_empty() {
        println!(
            "copied {} tensors keep does not understand, untouched: {}",
            r.unknown_copied.len(),
            r.unknown_copied.join(", ")
        );
    }
    Ok(())
}
