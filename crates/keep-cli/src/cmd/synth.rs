//! `keep synth`: write a random-weight checkpoint in DeepSeek's published format, or (with
//! `--family qwen3_moe`) a Qwen3-MoE one in Hugging Face's.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_checkpoint::DeepSeekConfig;
use keep_convert::presets::{self, Storage};
use keep_convert::synth::{experts_for_bytes, synth, with_engram_bytes, SynthOptions};

use crate::util::{byte_bar, human, parse_bytes};

/// `keep synth --draft`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SynthDraft {
    Dspark,
}

/// Write a random-weight checkpoint in DeepSeek's published format, for any V4.1 or V4 config.
///
/// Weights are drawn N(0, 1/fan_in) and stored as DeepSeek ships them: FP8 E4M3 residents with
/// E8M0 block scales, FP4 routed experts with a scale per 32 inputs, f32 hyper-connections,
/// sinks and router biases, bf16 elsewhere. Presets: `tiny` (every V4.1 attention path, for
/// tests), `tiny-v4flash` (a small V4-Flash: CSA and HCA layers, hash-routed first layers,
/// 128×128 blocks), `flash` (real V4.1-Flash shapes, 4 layers), `v4flash` (real V4-Flash
/// shapes, 4 layers). The output is the same for the same seed, whatever the thread count.
///
/// With --family qwen3_moe: a Qwen3-MoE checkpoint with Hugging Face's names, in bf16,
/// Qwen's FP8 layout or mlx-community's MLX affine 4/8-bit layout (--format mlx4|mlx8: experts
/// stacked in `switch_mlp`, as `mlx_lm.convert --quantize` writes), from a preset (qwen3-30b-a3b: real shapes; qwen3-tiny) or a
/// config; --layers N keeps the first N layers.
///
/// With --family deepseek_v3: a DeepSeek-V3-family checkpoint with Hugging Face's names, in
/// bf16 or DeepSeek's FP8 layout (128×128 E4M3 blocks, float32 weight_scale_inv; embedding,
/// head, norms and routers bf16), from a preset (deepseek-v3, kimi-k2: real shapes) or a config;
/// --layers N keeps the first N layers.
///
/// With --family gpt_oss: a gpt-oss checkpoint as OpenAI publishes it (experts stacked per
/// layer in MXFP4 `*_blocks`/`*_scales` with their biases, attention sinks, sliding and full
/// layers alternating, YaRN; bf16 elsewhere), from a preset (gpt-oss-20b, gpt-oss-120b: real
/// shapes) or a config; --layers N keeps the first N layers.
///
/// Example: keep synth --preset flash --experts-bytes 8GiB --out /tmp/flash-8g
///          keep synth --family qwen3_moe --preset qwen3-30b-a3b --layers 4 --format fp8 --out /tmp/q
///          keep synth --family deepseek_v3 --preset kimi-k2 --layers 1 --format fp8 --out /tmp/k
///          keep synth --family deepseek_v3 --preset kimi-k2 --layers 2 --experts int4-g32 --out /tmp/kt
///          keep synth --family gpt_oss --preset gpt-oss-20b --layers 2 --out /tmp/g
///          keep synth --preset tiny --engram-bytes 4MiB --out /tmp/tiny-engram
///          keep synth --preset tiny --draft dspark --out /tmp/tiny-dspark
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct SynthArgs {
    /// A config.json (DeepSeek V4.1 or V4 schema) to synthesise.
    #[arg(long, conflicts_with = "preset")]
    config: Option<PathBuf>,
    /// A named preset: tiny, tiny-v4flash, flash, v4flash (see --family for the others').
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
    /// Model family: deepseek (default), qwen3_moe (Hugging Face names; presets
    /// qwen3-30b-a3b, qwen3-tiny), deepseek_v3 (presets deepseek-v3, kimi-k2) or gpt_oss
    /// (presets gpt-oss-20b, gpt-oss-120b); a --config whose model_type is one of these picks
    /// its family too.
    #[arg(long)]
    family: Option<String>,
    /// Give the checkpoint a drafter: dspark writes a DeepSeek-V4.1 DSpark drafter (three
    /// stages under `mtp.0.*` … `mtp.2.*`, blocks of 5, reading the last three layers; the
    /// `dspark_*` keys in config.json), what `keep run --draft dspark` drafts with.
    #[arg(long, value_enum)]
    draft: Option<SynthDraft>,
    /// Keep only the first N decoder layers (qwen3_moe, deepseek_v3, gpt_oss).
    #[arg(long)]
    layers: Option<usize>,
    /// Storage of a qwen3_moe checkpoint: bf16 (default), fp8 (128×128 blocks, bf16
    /// weight_scale_inv), mlx4 or mlx8 (mlx-lm's affine layout, group 64, stacked experts); of a
    /// deepseek_v3 one: bf16 (default) or fp8 (128×128 blocks, float32 weight_scale_inv); a
    /// gpt_oss one is mxfp4 (OpenAI's layout) only.
    #[arg(long)]
    format: Option<String>,
    /// deepseek_v3: store the routed experts in a number format of keep-format's registry, by
    /// name (int4-g32: Kimi-K2-Thinking's INT4; nvfp4: compressed-tensors' NVFP4; an unknown
    /// name lists them), the rest bf16.
    #[arg(long)]
    experts: Option<String>,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

/// `keep synth --family qwen3_moe`: keep-convert's `synth_qwen3`.
fn run_qwen3(a: &SynthArgs, mut raw: serde_json::Value) -> anyhow::Result<()> {
    use keep_checkpoint::qwen3::Qwen3MoeConfig;
    use keep_convert::synth_qwen3::{experts_for_bytes, synth_qwen3, QwenFormat, QwenSynthOptions};
    if a.engram_bytes.is_some()
        || a.block.is_some()
        || a.f32_scales
        || a.hash_layers.is_some()
        || a.draft.is_some()
    {
        anyhow::bail!(
            "--engram-bytes, --block, --f32-scales, --hash-layers and --draft are DeepSeek's"
        );
    }
    let format = QwenFormat::parse(a.format.as_deref().unwrap_or("bf16"))?;
    let m = raw
        .as_object_mut()
        .ok_or_else(|| anyhow::anyhow!("config.json is not an object"))?;
    if let Some(n) = a.layers {
        m.insert("num_hidden_layers".into(), n.into());
        if let Some(serde_json::Value::Array(v)) = m.get_mut("mlp_only_layers") {
            v.retain(|l| l.as_u64().is_some_and(|l| (l as usize) < n));
        }
    }
    if let Some(bytes) = a.experts_bytes {
        let cfg = Qwen3MoeConfig::from_value(raw.clone()).map_err(anyhow::Error::msg)?;
        let n = experts_for_bytes(&cfg, format, bytes);
        raw["num_experts"] = n.into();
    }
    let cfg = Qwen3MoeConfig::from_value(raw.clone()).map_err(anyhow::Error::msg)?;
    let opts = QwenSynthOptions {
        seed: a.seed,
        format,
        force: a.force,
        max_shard_bytes: a.max_shard,
    };
    let bar = byte_bar(0, "synth");
    let out = synth_qwen3(&raw, &a.out, &opts, &|done, total| {
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
        "wrote {} ({}, qwen3_moe, {} layers, {} routed experts per layer, {:?}, seed {})",
        out.display(),
        human(size),
        cfg.num_hidden_layers,
        cfg.num_experts,
        format,
        a.seed
    );
    Ok(())
}

/// `keep synth --family deepseek_v3`: keep-convert's `synth_deepseek_v3`.
fn run_deepseek_v3(a: &SynthArgs, mut raw: serde_json::Value) -> anyhow::Result<()> {
    use keep_convert::synth_deepseek_v3::{
        synth_deepseek_v3, with_layers, DsV3Format, DsV3SynthOptions,
    };
    if a.engram_bytes.is_some()
        || a.block.is_some()
        || a.f32_scales
        || a.hash_layers.is_some()
        || a.draft.is_some()
        || a.experts_bytes.is_some()
    {
        anyhow::bail!(
            "--engram-bytes, --block, --f32-scales, --hash-layers, --draft and --experts-bytes \
             are not for --family deepseek_v3"
        );
    }
    let format = DsV3Format::parse(a.format.as_deref().unwrap_or("bf16"))?;
    if let Some(n) = a.layers {
        with_layers(&mut raw, n);
    }
    let opts = DsV3SynthOptions {
        seed: a.seed,
        format,
        force: a.force,
        max_shard_bytes: a.max_shard,
        experts: match a.experts.as_deref() {
            None => None,
            Some(n) => Some(keep_format::registry::find_by_name(n).ok_or_else(|| {
                anyhow::anyhow!(
                    "--experts {n}: not a registered format (known: {})",
                    keep_format::registry::REGISTRY
                        .iter()
                        .map(|f| f.name)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?),
        },
    };
    let bar = byte_bar(0, "synth");
    let out = synth_deepseek_v3(&raw, &a.out, &opts, &|done, total| {
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
        "wrote {} ({}, deepseek_v3, {} layers, {} routed experts per layer, {:?}, seed {})",
        out.display(),
        human(size),
        raw["num_hidden_layers"],
        raw["n_routed_experts"],
        format,
        a.seed
    );
    Ok(())
}

/// `keep synth --family gpt_oss`: keep-convert's `synth_gpt_oss`.
fn run_gpt_oss(a: &SynthArgs, mut raw: serde_json::Value) -> anyhow::Result<()> {
    use keep_convert::synth_gpt_oss::{synth_gpt_oss, with_layers, GptOssSynthOptions};
    if a.engram_bytes.is_some()
        || a.block.is_some()
        || a.f32_scales
        || a.hash_layers.is_some()
        || a.draft.is_some()
        || a.experts_bytes.is_some()
    {
        anyhow::bail!(
            "--engram-bytes, --block, --f32-scales, --hash-layers, --draft and --experts-bytes \
             are not for --family gpt_oss"
        );
    }
    if let Some(f) = a.format.as_deref().filter(|&f| f != "mxfp4") {
        anyhow::bail!("--format {f}: gpt_oss checkpoints are written as OpenAI ships them (mxfp4)");
    }
    if let Some(n) = a.layers {
        with_layers(&mut raw, n);
    }
    let opts = GptOssSynthOptions {
        seed: a.seed,
        force: a.force,
        max_shard_bytes: a.max_shard,
    };
    let bar = byte_bar(0, "synth");
    let out = synth_gpt_oss(&raw, &a.out, &opts, &|done, total| {
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
        "wrote {} ({}, gpt_oss, {} layers, {} routed experts per layer, mxfp4, seed {})",
        out.display(),
        human(size),
        raw["num_hidden_layers"],
        raw["num_local_experts"],
        a.seed
    );
    Ok(())
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    crate::util::check_out_of_cache(&a.out)?;
    // The family `--family` names, else the one that reads `--config`'s file.
    let family = a.family.clone().or_else(|| {
        a.config
            .as_ref()
            .and_then(|p| DeepSeekConfig::read(p).ok())
            .map(|c| c.family().name().to_string())
    });
    let v3 = family.as_deref() == Some(keep_checkpoint::families::deepseek_v3::MODEL_TYPE);
    if a.experts.is_some() && !v3 {
        anyhow::bail!(
            "--experts is for --family deepseek_v3 (routed experts in a registered format)"
        );
    }
    match a.family.as_deref() {
        None | Some("deepseek") => {}
        Some("qwen3_moe") => {
            let raw = match (&a.config, &a.preset) {
                (Some(p), None) => DeepSeekConfig::read(p)?.raw,
                (None, Some(name)) => keep_convert::synth_qwen3::preset_json(name)?,
                _ => anyhow::bail!("give --config FILE.json or --preset qwen3-30b-a3b|qwen3-tiny"),
            };
            return run_qwen3(&a, raw);
        }
        Some("deepseek_v3") => {
            let raw = match (&a.config, &a.preset) {
                (Some(p), None) => DeepSeekConfig::read(p)?.raw,
                (None, Some(name)) => keep_convert::synth_deepseek_v3::preset_json(name)?,
                _ => anyhow::bail!("give --config FILE.json or --preset deepseek-v3|kimi-k2"),
            };
            return run_deepseek_v3(&a, raw);
        }
        Some("gpt_oss") => {
            let raw = match (&a.config, &a.preset) {
                (Some(p), None) => DeepSeekConfig::read(p)?.raw,
                (None, Some(name)) => keep_convert::synth_gpt_oss::preset_json(name)?,
                _ => anyhow::bail!("give --config FILE.json or --preset gpt-oss-20b|gpt-oss-120b"),
            };
            return run_gpt_oss(&a, raw);
        }
        Some(f) => {
            anyhow::bail!("unknown --family `{f}` (deepseek, qwen3_moe, deepseek_v3, gpt_oss)")
        }
    }
    if let Some(p) = &a.config {
        let cfg = DeepSeekConfig::read(p)?;
        // The synth writer of the config's family (DeepSeek V4's below).
        match cfg.family().name() {
            keep_checkpoint::qwen3::MODEL_TYPE => return run_qwen3(&a, cfg.raw),
            keep_checkpoint::families::deepseek_v3::MODEL_TYPE => {
                return run_deepseek_v3(&a, cfg.raw)
            }
            keep_checkpoint::families::gpt_oss::MODEL_TYPE => return run_gpt_oss(&a, cfg.raw),
            _ => {}
        }
    }
    if a.layers.is_some() || a.format.is_some() {
        anyhow::bail!("--layers and --format are for --family qwen3_moe, deepseek_v3 or gpt_oss");
    }
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
    if a.draft == Some(SynthDraft::Dspark) {
        if cfg.model_type != "deepseek_v41" {
            anyhow::bail!(
                "--draft dspark: DSpark is DeepSeek-V4.1's drafter; this config's model_type is {}",
                cfg.model_type
            );
        }
        presets::with_dspark(&mut cfg);
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("--draft dspark: {e}"))?;
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
