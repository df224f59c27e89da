//! `keep select`: choose surviving experts per layer from REAP statistics and write a plan.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use keep_artifacts::hashremap::RemapPolicy;
use keep_calib::finalize::read_reap_stats;
use keep_calib::select::{select, to_plan, Keep, Saliency, SelectOptions, KILL_JACCARD};

/// Choose a uniform survivor set per layer and write a prune plan (keep-prune-plan v1).
///
/// Ranks experts by saliency (reap = Σg·‖f‖/count, frequency, weighted_frequency, ean_mean),
/// keeps the same number in every layer, and records the old→new id map. Reports the per-layer
/// Jaccard of the chosen set against the frequency-chosen set (the kill test: a mean ≥ 0.9 means
/// the saliency adds nothing over counts), super-expert candidates (REAP's outlier rule on
/// max |f|, both signs) and writes a plot of Jaccard and saliency spread beside the plan
/// (PLAN.jaccard.png and .svg). Hash-routed layers are left whole and marked, unless
/// --hash-remap names a policy: then they are pruned too, and the plan records for each removed
/// expert the kept experts that replace it in tid2eid, in order of preference (a token takes the
/// first one not already among its experts): reap-next (by REAP score), nearest (by the mean
/// squared distance of the experts' outputs on the calibration tokens routed to the removed
/// expert) or frequency (by route count, a baseline). A DeepSeek-V3 model whose router picks
/// among groups (n_group > 1) needs --groups N_GROUP: the same number kept in every group.
///
/// Example: keep select /tmp/run --keep 50% --out plan-50.json
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct SelectArgs {
    /// The run directory (after `keep finalize`) or its reap-stats.safetensors.
    run: PathBuf,
    /// Experts to keep per layer: a count (N) or a percentage (P%).
    #[arg(long, value_parser = parse_keep)]
    keep: Keep,
    /// Saliency: reap, frequency, weighted_frequency or ean_mean.
    #[arg(long, default_value = "reap", value_parser = parse_saliency)]
    saliency: Saliency,
    /// Shrink rare experts' mean saliency toward the layer mean: (n·s + α·mean)/(n + α).
    #[arg(long, value_name = "ALPHA")]
    shrink: Option<f64>,
    /// Always keep super-expert candidates.
    #[arg(long)]
    protect_super_experts: bool,
    /// Prune hash-routed layers too, remapping their tid2eid by this policy: reap-next,
    /// nearest or frequency (default: leave them whole).
    #[arg(long, value_name = "POLICY", value_parser = parse_remap)]
    hash_remap: Option<RemapPolicy>,
    /// Keep the same number of experts in each of G contiguous groups of a layer's experts: a
    /// group-limited router's groups (DeepSeek-V3's n_group), which `keep prune` needs whole.
    #[arg(long, value_name = "G", default_value_t = 1)]
    groups: usize,
    /// The plan to write (JSON).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing plan.
    #[arg(long)]
    force: bool,
    /// Do not write the plot.
    #[arg(long)]
    no_plot: bool,
    /// Print the selection as JSON.
    #[arg(long)]
    json: bool,
}

fn parse_keep(s: &str) -> Result<Keep, String> {
    match Keep::parse(s) {
        None => Err(format!("`{s}` is not N or P% (e.g. 64 or 50%)")),
        Some(Keep::Percent(p)) if !(p > 0.0 && p <= 100.0) => Err(format!(
            "{s} is out of range: keep more than 0% and at most 100% of the experts"
        )),
        Some(Keep::Count(0)) => Err("0 experts: keep at least one expert per layer".into()),
        Some(k) => Ok(k),
    }
}

fn parse_saliency(s: &str) -> Result<Saliency, String> {
    Saliency::parse(s).ok_or_else(|| {
        format!("`{s}` is not a saliency: reap, frequency, weighted_frequency, ean_mean")
    })
}

fn parse_remap(s: &str) -> Result<RemapPolicy, String> {
    RemapPolicy::parse(s)
        .ok_or_else(|| format!("`{s}` is not a remap policy: reap-next, nearest, frequency"))
}

fn sibling(out: &Path, ext: &str) -> PathBuf {
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "plan".into());
    out.with_file_name(format!("{stem}.jaccard.{ext}"))
}

pub fn run(a: SelectArgs) -> anyhow::Result<()> {
    crate::util::check_out_file(&a.out, a.force, &[&a.run])?;
    if !a.no_plot {
        for ext in ["png", "svg"] {
            crate::util::check_out_file(&sibling(&a.out, ext), a.force, &[&a.run])?;
        }
    }
    let stats = read_reap_stats(&a.run)?;
    let opts = SelectOptions {
        keep: a.keep,
        saliency: a.saliency,
        shrink: a.shrink,
        protect_super_experts: a.protect_super_experts,
        hash_remap: a.hash_remap,
        groups: a.groups,
    };
    let sel = select(&stats, &opts)?;
    let plan = to_plan(&sel, &stats, &opts);
    plan.write(&a.out, a.force)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let mut plots = vec![];
    if !a.no_plot {
        for ext in ["png", "svg"] {
            let p = sibling(&a.out, ext);
            match keep_calib::plot::plot(&sel, &p) {
                Ok(()) => plots.push(p),
                Err(e) => eprintln!("warning: no plot: {e}"),
            }
        }
    }
    if a.json {
        let mut v = serde_json::to_value(&sel)?;
        v["plan"] = serde_json::json!(a.out);
        v["plots"] = serde_json::json!(plots);
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} vs frequency, keeping {} of {} experts per layer ({} calibration tokens)",
        sel.saliency.name(),
        sel.keep,
        sel.n_experts,
        stats.tokens
    );
    println!("layer  jaccard  spread  super-experts");
    for l in &sel.layers {
        if l.hash_routed && l.survivors.is_none() {
            println!("{:>5}  hash-routed: left whole", l.layer);
            continue;
        }
        if let Some(r) = &l.remap {
            println!(
                "{:>5}  {:>7.3}  {:>6.3}  hash-routed: {} removed experts remapped by {}",
                l.layer,
                l.jaccard_vs_frequency.unwrap_or(f64::NAN),
                l.saliency_spread,
                r.candidates.len(),
                r.policy
            );
            continue;
        }
        println!(
            "{:>5}  {:>7.3}  {:>6.3}  {}",
            l.layer,
            l.jaccard_vs_frequency.unwrap_or(f64::NAN),
            l.saliency_spread,
            l.super_experts
                .iter()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    if let Some(m) = sel.mean_jaccard {
        println!(
            "mean Jaccard {m:.3}: {}",
            if m >= KILL_JACCARD {
                format!(
                    "≥ {KILL_JACCARD}: {} adds nothing over frequency (kill)",
                    sel.saliency.name()
                )
            } else {
                format!(
                    "< {KILL_JACCARD}: {} chooses differently from frequency",
                    sel.saliency.name()
                )
            }
        );
    }
    println!(
        "super-expert threshold max|f| > {:.4}: {} candidates",
        sel.super_threshold,
        sel.super_experts.len()
    );
    println!("wrote {}", a.out.display());
    for p in plots {
        println!("wrote {}", p.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_is_bounded_and_named_as_written() {
        assert!(matches!(parse_keep("50%"), Ok(Keep::Percent(p)) if p == 50.0));
        assert!(matches!(parse_keep("64"), Ok(Keep::Count(64))));
        for bad in ["101%", "0%", "-5%", "0", "many"] {
            assert!(parse_keep(bad).is_err(), "{bad}");
        }
        assert_eq!(Keep::Percent(0.0).to_string(), "0%");
    }
}
