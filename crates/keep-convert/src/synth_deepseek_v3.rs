//! `keep synth --family deepseek_v3`: random-weight DeepSeek-V3-family checkpoints (DeepSeek-V3,
//! Moonshot's Kimi-K2) with Hugging Face's names and real shapes, in the layouts DeepSeek ships.
//!
//! Layouts ([`DsV3Format`]): `fp8` (as deepseek-ai/DeepSeek-V3 and moonshotai/Kimi-K2-Instruct:
//! every attention projection, dense MLP, shared and routed expert FP8 E4M3 in 128×128 blocks
//! with a float32 `weight_scale_inv` per block, `quantization_config` {quant_method fp8, fmt
//! e4m3, activation_scheme dynamic, weight_block_size [128, 128]}; embedding, head, norms and
//! routers bfloat16, the routers' `e_score_correction_bias` float32) and `bf16` (every tensor
//! bfloat16 but the correction biases, float32). The FP8 encoder is keep-format's (each block's
//! scale the power of two that puts its largest magnitude at or under 448). Weights are
//! N(0, 1/fan_in), norms 1 + N(0, 0.1²), correction biases N(0, 0.01²); the same seed gives the
//! same bytes. The multi-token-prediction layer of the releases is not written
//! (`num_nextn_predict_layers` 0).
//!
//! [`DsV3SynthOptions::experts`] stores the routed experts in a format of keep-format's registry
//! instead (`keep synth --experts int4-g32`: Kimi-K2-Thinking's INT4 group-32 experts, each
//! matrix as the entry's parts `weight_packed` / `weight_scale` / `weight_shape`, encoded by the
//! entry from the same N(0, 1/fan_in) draws), with the `quantization_config` the entry says such
//! a release declares; everything else bf16.

use std::path::{Path, PathBuf};

use keep_checkpoint::config::deepseek_v3::{self as names, DeepseekV3Config};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::Dtype;
use keep_format::fp8block::{encode_fp8_block, BlockShape};
use keep_format::registry::{find_by_name, FormatSpec, PartKind};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::synth::{bf16_bytes, chunk_rows, normals};
use crate::{ConvertError, Result};

/// FP8 block side of DeepSeek's FP8 releases.
pub const DSV3_FP8_BLOCK: usize = 128;

/// The layouts `keep synth --family deepseek_v3` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DsV3Format {
    Bf16,
    Fp8,
}

impl DsV3Format {
    /// `bf16` or `fp8`.
    pub fn parse(s: &str) -> Result<DsV3Format> {
        match s {
            "bf16" => Ok(DsV3Format::Bf16),
            "fp8" => Ok(DsV3Format::Fp8),
            _ => Err(ConvertError::Invalid(format!(
                "format `{s}`: deepseek_v3 checkpoints are written as bf16 or fp8"
            ))),
        }
    }
}

/// The preset names of this family.
pub const PRESETS: [&str; 2] = ["deepseek-v3", "kimi-k2"];

/// A preset's `config.json`: `deepseek-v3` (deepseek-ai/DeepSeek-V3's published values) or
/// `kimi-k2` (moonshotai/Kimi-K2-Instruct's, with `model_type` `deepseek_v3` where Moonshot's
/// file says `kimi_k2`: the same architecture, which keep reads under DeepSeek's name).
/// `num_nextn_predict_layers` is 0: the MTP layer is not written.
pub fn preset_json(name: &str) -> Result<Value> {
    let common = json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": names::MODEL_TYPE,
        "attention_bias": false, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
        "ep_size": 1, "hidden_act": "silu", "initializer_range": 0.02,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_layer_freq": 1,
        "norm_topk_prob": true, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "seq_aux": true, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1, "torch_dtype": "bfloat16",
        "use_cache": true,
    });
    let shapes = match name {
        "deepseek-v3" => json!({
            "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
            "first_k_dense_replace": 3, "n_routed_experts": 256, "n_group": 8, "topk_group": 4,
            "num_attention_heads": 128, "num_key_value_heads": 128,
            "routed_scaling_factor": 2.5, "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        }),
        "kimi-k2" => json!({
            "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163585,
            "first_k_dense_replace": 1, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
            "num_attention_heads": 64, "num_key_value_heads": 64,
            "routed_scaling_factor": 2.827, "max_position_embeddings": 131072,
            "rope_theta": 50000.0,
            "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
        }),
        _ => {
            return Err(ConvertError::Invalid(format!(
                "unknown deepseek_v3 preset `{name}` (known: {})",
                PRESETS.join(", ")
            )))
        }
    };
    let mut v = common;
    if let (Some(m), Some(s)) = (v.as_object_mut(), shapes.as_object()) {
        for (k, x) in s {
            m.insert(k.clone(), x.clone());
        }
    }
    Ok(v)
}

/// `raw` cut to its first `layers` decoder layers (`first_k_dense_replace` kept: a depth at or
/// under it is all dense).
pub fn with_layers(raw: &mut Value, layers: usize) {
    if let Some(m) = raw.as_object_mut() {
        m.insert("num_hidden_layers".into(), layers.into());
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A matrix, N(0, 1/cols); FP8 blocks when `fp8`.
    Mat { fp8: bool },
    /// A matrix, N(0, 1/cols), in the registered format of this name.
    Registered(&'static str),
    /// A norm weight, 1 + N(0, 0.1²), bfloat16.
    Norm,
    /// A router's correction bias, N(0, 0.01²), float32.
    Bias,
}

#[derive(Debug, Clone)]
struct Planned {
    name: String,
    rows: usize,
    cols: usize,
    kind: Kind,
}

fn plan(
    cfg: &DeepseekV3Config,
    format: DsV3Format,
    experts: Option<&'static FormatSpec>,
) -> Vec<Planned> {
    let fp8 = format == DsV3Format::Fp8;
    let mut out = vec![];
    let mut mat = |name: String, rows, cols, q: bool| {
        out.push(Planned {
            name: format!("{name}.weight"),
            rows,
            cols,
            kind: Kind::Mat { fp8: fp8 && q },
        })
    };
    let (d, v, h) = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads);
    let (kvl, rope, nope, vh) = (
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
    );
    mat(names::EMBED.into(), v, d, false);
    if !cfg.tie_word_embeddings {
        mat(names::HEAD.into(), v, d, false);
    }
    let mut vecs = vec![(names::NORM.to_string(), d, Kind::Norm)];
    for l in 0..cfg.num_hidden_layers {
        let p = names::layer_prefix(l);
        vecs.push((format!("{p}input_layernorm.weight"), d, Kind::Norm));
        vecs.push((format!("{p}post_attention_layernorm.weight"), d, Kind::Norm));
        vecs.push((
            format!("{p}self_attn.kv_a_layernorm.weight"),
            kvl,
            Kind::Norm,
        ));
        match cfg.q_lora_rank {
            Some(r) => {
                vecs.push((format!("{p}self_attn.q_a_layernorm.weight"), r, Kind::Norm));
                mat(format!("{p}self_attn.q_a_proj"), r, d, true);
                mat(
                    format!("{p}self_attn.q_b_proj"),
                    h * cfg.qk_head_dim(),
                    r,
                    true,
                );
            }
            None => mat(
                format!("{p}self_attn.q_proj"),
                h * cfg.qk_head_dim(),
                d,
                true,
            ),
        }
        mat(
            format!("{p}self_attn.kv_a_proj_with_mqa"),
            kvl + rope,
            d,
            true,
        );
        mat(
            format!("{p}self_attn.kv_b_proj"),
            h * (nope + vh),
            kvl,
            true,
        );
        mat(format!("{p}self_attn.o_proj"), d, h * vh, true);
        let mut swiglu = |base: String, i: usize| {
            mat(format!("{base}.gate_proj"), i, d, true);
            mat(format!("{base}.up_proj"), i, d, true);
            mat(format!("{base}.down_proj"), d, i, true);
        };
        if cfg.is_moe_layer(l) {
            let e = cfg.n_routed_experts;
            for x in 0..e {
                swiglu(format!("{p}mlp.experts.{x}"), cfg.moe_intermediate_size);
            }
            if let Some(n) = cfg.n_shared_experts.filter(|&n| n > 0) {
                swiglu(
                    format!("{p}mlp.shared_experts"),
                    n * cfg.moe_intermediate_size,
                );
            }
            mat(format!("{p}mlp.gate"), e, d, false);
            vecs.push((
                format!("{p}mlp.gate.e_score_correction_bias"),
                e,
                Kind::Bias,
            ));
        } else {
            swiglu(format!("{p}mlp"), cfg.intermediate_size);
        }
    }
    if let Some(f) = experts {
        for t in out.iter_mut().filter(|t| t.name.contains(".mlp.experts.")) {
            t.kind = Kind::Registered(f.name);
        }
    }
    out.extend(vecs.into_iter().map(|(name, len, kind)| Planned {
        name,
        rows: 1,
        cols: len,
        kind,
    }));
    out
}

fn scale_name(weight: &str) -> String {
    format!("{weight}_scale_inv")
}

fn metas(plan: &[Planned]) -> Vec<TensorMeta> {
    let mut out = vec![];
    for t in plan {
        let (r, c) = (t.rows as u64, t.cols as u64);
        match t.kind {
            Kind::Norm => out.push(TensorMeta::new(&t.name, Dtype::BF16, &[c])),
            Kind::Bias => out.push(TensorMeta::new(&t.name, Dtype::F32, &[c])),
            Kind::Mat { fp8: false } => out.push(TensorMeta::new(&t.name, Dtype::BF16, &[r, c])),
            Kind::Registered(f) => {
                let f = find_by_name(f).expect("planned from the registry");
                for (i, p) in f.parts.iter().enumerate() {
                    if matches!(p.kind, PartKind::Optional) {
                        continue;
                    }
                    let name = f.part_name(&t.name, i).expect("a .weight name");
                    let dtype = Dtype::parse(p.dtype).expect("a registry dtype");
                    out.push(TensorMeta::new(name, dtype, &(p.shape)(t.rows, t.cols)));
                }
            }
            Kind::Mat { fp8: true } => {
                let b = DSV3_FP8_BLOCK as u64;
                out.push(TensorMeta::new(&t.name, Dtype::F8_E4M3, &[r, c]));
                out.push(TensorMeta::new(
                    scale_name(&t.name),
                    Dtype::F32,
                    &[r.div_ceil(b), c.div_ceil(b)],
                ));
            }
        }
    }
    out
}

/// Options of [`synth_deepseek_v3`].
#[derive(Debug, Clone)]
pub struct DsV3SynthOptions {
    pub seed: u64,
    pub format: DsV3Format,
    pub force: bool,
    pub max_shard_bytes: u64,
    /// Routed experts in this registered format (`None`: as `format`).
    pub experts: Option<&'static FormatSpec>,
}

/// Write a random DeepSeek-V3-family checkpoint of config `raw` (a `deepseek_v3`
/// `config.json` object, validated here) to `out`. Calls `progress(bytes_done, bytes_total)` as
/// it goes.
pub fn synth_deepseek_v3(
    raw: &Value,
    out: &Path,
    opts: &DsV3SynthOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PathBuf> {
    let mut raw = raw.clone();
    if let Some(m) = raw.as_object_mut() {
        m.remove("quantization_config");
        if let Some(f) = opts.experts {
            if opts.format != DsV3Format::Bf16 {
                return Err(ConvertError::Invalid(format!(
                    "routed experts in {} take --format bf16 for the rest (as the release)",
                    f.name
                )));
            }
            let q: Value = f
                .hf_quantization_config
                .map(serde_json::from_str)
                .transpose()
                .map_err(|e| {
                    ConvertError::Invalid(format!("{}: quantization_config: {e}", f.name))
                })?
                .ok_or_else(|| {
                    ConvertError::Invalid(format!(
                        "no published quantization_config for {}",
                        f.name
                    ))
                })?;
            m.insert("quantization_config".into(), q);
        } else if opts.format == DsV3Format::Fp8 {
            m.insert(
                "quantization_config".into(),
                json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [DSV3_FP8_BLOCK, DSV3_FP8_BLOCK]}),
            );
        }
    }
    let cfg = DeepseekV3Config::from_value(raw.clone())
        .map_err(|e| ConvertError::Invalid(format!("config: {e}")))?;
    let plan = plan(&cfg, opts.format, opts.experts);
    let metas = metas(&plan);
    let total: u64 = metas.iter().map(TensorMeta::nbytes).sum();
    let wopts = WriterOptions {
        max_shard_bytes: opts.max_shard_bytes,
        force: opts.force,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, metas, wopts)?;
    let mut done = 0u64;
    for t in &plan {
        done += write(&mut w, t, opts.seed)?;
        progress(done, total);
    }
    let text =
        serde_json::to_string_pretty(&raw).map_err(|e| ConvertError::Invalid(e.to_string()))?;
    w.add_file("config.json", text.as_bytes())?;
    Ok(w.finish()?)
}

fn write(w: &mut CheckpointWriter, t: &Planned, seed: u64) -> Result<u64> {
    let (rows, cols) = (t.rows, t.cols);
    let (mean, std) = match t.kind {
        Kind::Norm => (1.0, 0.1),
        Kind::Bias => (0.0, 0.01),
        Kind::Mat { .. } | Kind::Registered(_) => (0.0, (1.0 / cols as f32).sqrt()),
    };
    let mut written = 0u64;
    if let Kind::Registered(f) = t.kind {
        return write_registered(w, t, find_by_name(f).expect("planned"), seed, std);
    }
    if t.kind != (Kind::Mat { fp8: true }) {
        let cr = chunk_rows(cols, 1);
        let starts: Vec<usize> = (0..rows).step_by(cr).collect();
        for group in starts.chunks(8) {
            let parts: Vec<Vec<u8>> = group
                .par_iter()
                .map(|&r0| {
                    let n = (rows - r0).min(cr) * cols;
                    let v = normals(seed, &t.name, r0 as u64, n, mean, std);
                    if t.kind == Kind::Bias {
                        v.iter().flat_map(|x| x.to_le_bytes()).collect()
                    } else {
                        bf16_bytes(&v)
                    }
                })
                .collect();
            for b in parts {
                written += b.len() as u64;
                w.write_chunk(&t.name, &b)?;
            }
        }
        return Ok(written);
    }
    let block = BlockShape {
        rows: DSV3_FP8_BLOCK,
        cols: DSV3_FP8_BLOCK,
    };
    let cr = chunk_rows(cols, DSV3_FP8_BLOCK);
    let starts: Vec<usize> = (0..rows).step_by(cr).collect();
    let mut scales: Vec<u8> = vec![];
    for group in starts.chunks(8) {
        let parts: Vec<(Vec<u8>, Vec<u8>)> = group
            .par_iter()
            .map(|&r0| {
                let n = (rows - r0).min(cr);
                let v = normals(seed, &t.name, r0 as u64, n * cols, mean, std);
                encode_fp8_block(&v, n, cols, block)
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| ConvertError::Format {
                tensor: t.name.clone(),
                err: e,
            })?;
        for (q, s) in parts {
            written += q.len() as u64;
            w.write_chunk(&t.name, &q)?;
            scales.extend_from_slice(&s);
        }
    }
    // E8M0 powers of two as float32 multipliers, as DeepSeek's `weight_scale_inv`.
    let sb: Vec<u8> = scales
        .iter()
        .flat_map(|&b| keep_format::e8m0::e8m0_to_f32(b).to_le_bytes())
        .collect();
    written += sb.len() as u64;
    w.write_tensor(&scale_name(&t.name), &sb)?;
    Ok(written)
}

/// A matrix in registered format `f`: the same draws as a bf16 one, encoded by the entry row
/// chunk by row chunk (the per-row parts streamed, the others written at the end).
fn write_registered(
    w: &mut CheckpointWriter,
    t: &Planned,
    f: &'static FormatSpec,
    seed: u64,
    std: f32,
) -> Result<u64> {
    let (rows, cols) = (t.rows, t.cols);
    let names: Vec<String> = (0..f.parts.len())
        .map(|i| f.part_name(&t.name, i).expect("a .weight name"))
        .collect();
    // A format with a per-tensor part (a global scale from the whole matrix) is encoded in one
    // piece, the others in chunks of rows.
    let whole = f.parts.iter().any(|p| matches!(p.kind, PartKind::Tensor));
    let cr = if whole {
        rows.max(1)
    } else {
        chunk_rows(cols, 1)
    };
    let starts: Vec<usize> = (0..rows).step_by(cr).collect();
    let mut rest: Vec<Vec<u8>> = vec![vec![]; f.parts.len()];
    let mut written = 0u64;
    for group in starts.chunks(8) {
        let parts: Vec<Vec<Vec<u8>>> = group
            .par_iter()
            .map(|&r0| {
                let n = (rows - r0).min(cr);
                let v = normals(seed, &t.name, r0 as u64, n * cols, 0.0, std);
                (f.encode_ref)(&v, n, cols)
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| ConvertError::Format {
                tensor: t.name.clone(),
                err: e,
            })?;
        for p in parts {
            for (i, b) in p.into_iter().enumerate() {
                if i == 0 {
                    written += b.len() as u64;
                    w.write_chunk(&names[0], &b)?;
                } else if f.parts[i].computed() {
                    written += b.len() as u64;
                    rest[i].extend_from_slice(&b);
                }
            }
        }
    }
    // Parts the kernels never read (the logical shape) are the whole matrix's, not a chunk's.
    for (i, p) in f.parts.iter().enumerate().skip(1) {
        if matches!(p.kind, PartKind::Optional) {
            continue;
        }
        if let PartKind::Fill(fill) = p.kind {
            rest[i] = fill(rows, cols);
            written += rest[i].len() as u64;
        }
        w.write_tensor(&names[i], &rest[i])?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_carry_the_published_values() {
        for p in PRESETS {
            DeepseekV3Config::from_value(preset_json(p).unwrap()).unwrap();
        }
        let v3 = DeepseekV3Config::from_value(preset_json("deepseek-v3").unwrap()).unwrap();
        assert_eq!(
            (
                v3.hidden_size,
                v3.num_hidden_layers,
                v3.first_k_dense_replace
            ),
            (7168, 61, 3)
        );
        assert_eq!(
            (
                v3.n_routed_experts,
                v3.num_experts_per_tok,
                v3.n_shared_experts
            ),
            (256, 8, Some(1))
        );
        assert_eq!((v3.n_group, v3.topk_group), (8, 4));
        assert_eq!(
            (v3.moe_intermediate_size, v3.intermediate_size),
            (2048, 18432)
        );
        assert_eq!((v3.q_lora_rank, v3.kv_lora_rank), (Some(1536), 512));
        assert_eq!(
            (v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim),
            (128, 64, 128)
        );
        assert_eq!((v3.num_attention_heads, v3.vocab_size), (128, 129280));
        assert_eq!(v3.routed_scaling_factor, 2.5);
        let y = v3.yarn().unwrap().unwrap();
        assert_eq!(
            (
                y.factor,
                y.original_max_position_embeddings,
                y.mscale_all_dim
            ),
            (40.0, 4096.0, 1.0)
        );

        let k2 = DeepseekV3Config::from_value(preset_json("kimi-k2").unwrap()).unwrap();
        assert_eq!(
            (
                k2.hidden_size,
                k2.num_hidden_layers,
                k2.first_k_dense_replace
            ),
            (7168, 61, 1)
        );
        assert_eq!((k2.n_routed_experts, k2.num_experts_per_tok), (384, 8));
        assert_eq!((k2.n_group, k2.topk_group), (1, 1));
        assert_eq!((k2.num_attention_heads, k2.vocab_size), (64, 163840));
        assert_eq!((k2.routed_scaling_factor, k2.rope_theta), (2.827, 50000.0));
        assert_eq!(k2.yarn().unwrap().unwrap().factor, 32.0);
        assert!(preset_json("deepseek-v2").is_err());
        assert!(DsV3Format::parse("mlx4").is_err());
    }

    #[test]
    fn the_plan_matches_the_layout_check_shapes() {
        let mut raw = preset_json("deepseek-v3").unwrap();
        with_layers(&mut raw, 4);
        let cfg = DeepseekV3Config::from_value(raw).unwrap();
        let p = plan(&cfg, DsV3Format::Fp8, None);
        let get = |n: &str| p.iter().find(|t| t.name == n).unwrap();
        // Layers 0..3 dense, layer 3 MoE: 256 experts, a shared expert, a router.
        assert_eq!(get("model.layers.2.mlp.gate_proj.weight").rows, 18432);
        assert!(p
            .iter()
            .all(|t| !t.name.starts_with("model.layers.2.mlp.experts")));
        assert_eq!(
            get("model.layers.3.mlp.experts.255.down_proj.weight").cols,
            2048
        );
        assert_eq!(
            get("model.layers.3.mlp.gate.weight").kind,
            Kind::Mat { fp8: false }
        );
        assert_eq!(
            get("model.layers.3.self_attn.q_b_proj.weight").rows,
            128 * 192
        );
        assert_eq!(
            get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").rows,
            576
        );
        let m = metas(&p);
        let s = m
            .iter()
            .find(|t| t.name == "model.layers.0.self_attn.o_proj.weight_scale_inv")
            .unwrap();
        assert_eq!((s.dtype, s.shape.clone()), (Dtype::F32, vec![56, 128]));
    }
}
