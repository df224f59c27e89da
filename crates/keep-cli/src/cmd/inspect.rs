//! `keep inspect`: what a checkpoint is, what it weighs, and what is wrong with it.

use std::path::PathBuf;

use clap::Args;
use keep_checkpoint::Checkpoint;
use keep_convert::inspect::inspect;

use crate::util::human;

/// Report what a checkpoint holds: architecture, layers, routed and shared experts, top-k,
/// hash-routed, engram and MTP layers, sidecars, bytes and bits per weight by role × format, FP8 block
/// shapes and scale kinds, per-layer expert counts, everything unknown or inconsistent, and
/// every reason the model's loader (keep run, keep logits) refuses the checkpoint — inspect
/// runs the same checks, so it never passes a checkpoint that run refuses.
///
/// DIR defaults to the bundled model. Exit status 0 even with problems (they are listed);
/// 1 when the checkpoint cannot be read at all (including a config.json keep refuses).
///
/// Example: keep inspect /tmp/tiny --json
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct InspectArgs {
    /// Checkpoint directory (default: the bundled model).
    dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: InspectArgs) -> anyhow::Result<()> {
    let dir = match a.dir {
        Some(d) => d,
        None => crate::bundled::default_model_dir()?,
    };
    let ck = Checkpoint::open(&dir)?;
    let mut r = inspect(&ck);
    // The rest of the loader's checks (views over every weight it reads, V4 compressors, hash
    // tables, Engram tables, the tokenizer map): what `keep run` would say, said here too.
    if r.refused.is_empty() && ck.config().is_some() {
        if let Err(e) = keep_model::Model::load(&ck) {
            r.refused.push(e.to_string());
            r.problems
                .push(format!("the model's loader refuses this checkpoint: {e}"));
        }
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let opt = |v: Option<usize>| v.map_or("?".into(), |x| x.to_string());
    println!("{}", r.dir);
    println!(
        "  architecture {}  layers {}  routed experts {}  shared {}  top-k {}",
        r.model_type.as_deref().unwrap_or("?"),
        opt(r.layers),
        opt(r.routed_experts),
        opt(r.shared_experts),
        opt(r.top_k)
    );
    println!(
        "  hash layers {:?}  engram layers {:?}  MTP layers {:?}",
        r.hash_layers, r.engram_layers, r.mtp_layers
    );
    for t in &r.engram_tables {
        println!(
            "  engram table of layer {}: {} rows × {} channels ({} bytes a row), {} (read row by row, never resident)",
            t.layer,
            t.rows,
            t.head_dim,
            t.row_bytes,
            human(t.bytes)
        );
    }
    println!(
        "  {} tensors in {} shard(s), {}",
        r.tensors,
        r.shards,
        human(r.total_bytes)
    );
    if let Some(q) = &r.quantization_config {
        println!("  quantization_config {q}");
    }
    if let Some(s) = &r.sidecar {
        let bytes = r
            .by_role_format
            .get("sidecar")
            .map_or(0, |row| row.values().map(|c| c.bytes).sum::<u64>());
        // Strings without their JSON quotes (`--ridge auto`), numbers as written.
        let plain =
            |v: &serde_json::Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
        let per_layer = match s["layer_ridges"].as_array() {
            Some(r) => format!(
                "; per layer {}",
                r.iter().map(plain).collect::<Vec<_>>().join(", ")
            ),
            None => String::new(),
        };
        println!(
            "  sidecars (keep sidecar): rank {} on layers {} (ridge {}{per_layer}), {}",
            s["rank"],
            s["layers"],
            plain(&s["ridge"]),
            human(bytes)
        );
    }
    println!();
    println!(
        "  {:<16} {:<26} {:>8} {:>14} {:>12} {:>8}",
        "role", "format", "tensors", "weights", "bytes", "bits/w"
    );
    for (role, row) in &r.by_role_format {
        for (fmt, c) in row {
            println!(
                "  {:<16} {:<26} {:>8} {:>14} {:>12} {:>8.3}",
                role,
                fmt,
                c.tensors,
                c.weights,
                human(c.bytes),
                c.bits_per_weight
            );
        }
    }
    if !r.fp8_blocks.is_empty() {
        println!();
        for (k, n) in &r.fp8_blocks {
            println!("  FP8 blocks {k}: {n} weights");
        }
    }
    let counts: std::collections::BTreeSet<usize> = r.experts_per_layer.values().copied().collect();
    println!(
        "  routed experts per layer: {}",
        if counts.len() == 1 {
            format!(
                "{} in each of {} layers",
                counts.iter().next().expect("one"),
                r.experts_per_layer.len()
            )
        } else {
            format!("{:?}", r.experts_per_layer)
        }
    );
    println!();
    if r.problems.is_empty() {
        println!("  no problems found");
    } else {
        println!("  {} problem(s):", r.problems.len());
        for p in &r.problems {
            println!("  - {p}");
        }
    }
    if !r.refused.is_empty() {
        println!();
        println!(
            "  keep run and keep logits refuse this checkpoint ({} reason(s)):",
            r.refused.len()
        );
        for p in &r.refused {
            println!("  - {p}");
        }
    }
    Ok(())
}
