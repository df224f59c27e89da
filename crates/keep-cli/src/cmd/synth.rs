//! `keep synth`: write a random-weight checkpoint in DeepSeek's published format.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_checkpoint::DeepSeekConfig;
use keep_convert::presets::{self, Storage};
use keep_convert::synth::{experts_for_bytes, synth, with_engram_bytes, SynthOptions};

use crate::util::{byte_bar, human, parse_bytes};

/// Write a random-weight checkpoint in DeepSeek's published format, for any V4.1 or V4 config.
///
/// Weights are drawn N(0, 1/fan_in) and stored as DeepSeek ships them: FP8 E4M3 residents with
/// E8M0 block scales, FP4 routed experts with a scale per 32 inputs, f32 hyper-connections,
/// sinks and router biases, bf16 elsewhere. Presets: `tiny` (every V4.1 attention path, for
/// tests), `tiny-v4flash` (a small V4-Flash: CSA and HCA layers, hash-routed first layers,
/// 128×128 blocks), `flash` (real V4.1-Flash shapes, 4 layers), `v4flash` (real V4-Flash
/// shapes, 4 layers). The output is the same for the same seed, whatever the thread count.
///
/// Example: keep synth --preset flash --experts-bytes 8GiB --out /tmp/flash-8g
///          keep synth --preset tiny --engram-bytes 4MiB --out /tmp/tiny-engram
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct SynthArgs {
    /// A config.json (DeepSeek V4.1 or V4 schema) to synthesise.
    #[arg(long, conflicts_with = "preset")]
    config: Option<PathBuf>,
    /// A named preset: tiny, tiny-v4flash, flash, v4flash.
    #[arg(long)]
    preset: Option<String>,
    /// Output directory (refused if it exists, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Choose n_routed_experts so that routed experts take about this many bytes (e.g. 8GiB).
    #[arg(long, value_parser = parse_bytes)]
    experts_bytes: Option<u64>,
    /// Give the model Engram layers whose FP8 tables take about this many bytes in all (e.g.
    /// 40GiB): the config's engram layers and shapes, or V4.1-Flash's (layers 1 and 14·L/40).
    #[arg(long, value_parser = parse_bytes)]
    engram_bytes: Option<u64>,
    /// FP8 block size (square); 32 is V4.1, 128 is V4-Flash.
    #[arg(long)]
    block: Option<usize>,
    /// Store FP8 block scales as float32 powers of two (V4-Flash-Base) instead of E8M0.
    #[arg(long)]
    f32_scales: bool,
    /// Hash-route the first N layers with `gate.tid2eid` (V4-Flash).
    #[arg(long)]
    hash_layers: Option<usize>,
    /// Largest shard file.
    #[arg(long, value_parser = parse_bytes, default_value = "4GiB")]
    max_shard: u64,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    crate::util::check_out_of_cache(&a.out)?;
    let (mut cfg, mut storage) = match (&a.config, &a.preset) {
        (Some(p), None) => {
            let cfg = DeepSeekConfig::read(p)?;
            let block = cfg.weight_block_size().unwrap_or((32, 32));
            (
                cfg,
                Storage {
                    block,
                    ..Storage::V41
                },
            )
        }
        (None, Some(name)) => presets::preset(name)?,
        _ => anyhow::bail!(
            "give --config FILE.json or --preset NAME (tiny, tiny-v4flash, flash, v4flash)"
        ),
    };
    if let Some(b) = a.block {
        storage.block = (b, b);
    }
    storage.f32_scales |= a.f32_scales;
    if let Some(h) = a.hash_layers {
        storage.hash_layers = h;
    }
    if let Some(bytes) = a.experts_bytes {
        cfg.n_routed_experts = experts_for_bytes(&cfg, bytes);
        if let Some(m) = cfg.raw.as_object_mut() {
            m.insert("n_routed_experts".into(), cfg.n_routed_experts.into());
        }
    }
    if let Some(bytes) = a.engram_bytes {
        with_engram_bytes(&mut cfg, bytes)?;
    }
    let opts = SynthOptions {
        seed: a.seed,
        storage,
        force: a.force,
        max_shard_bytes: a.max_shard,
    };
    let bar = byte_bar(0, "synth");
    let out = synth(&cfg, &a.out, &opts, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    bar.finish_and_clear();
    let size: u64 = std::fs::read_dir(&out)?
        .flatten()
        .filter_map(|e| e.metadata().ok().map(|m| m.len()))
        .sum();
    println!(
        "wrote {} ({}, {} layers, {} routed experts per layer, seed {})",
        out.display(),
        human(size),
        cfg.num_hidden_layers,
        cfg.n_routed_experts,
        a.seed
    );
    Ok(())
}
