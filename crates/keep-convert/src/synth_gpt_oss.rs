//! `keep synth --family gpt_oss`: random-weight gpt-oss checkpoints with Hugging Face's names
//! and real shapes, in the layout OpenAI publishes.
//!
//! The routed experts are stacked per layer in MXFP4 as openai/gpt-oss-20b and -120b ship them:
//! `mlp.experts.gate_up_proj_blocks` `U8 [experts, 2·intermediate, hidden/32, 16]` with
//! `gate_up_proj_scales` `U8 [experts, 2·intermediate, hidden/32]` (E8M0) and
//! `gate_up_proj_bias` `[experts, 2·intermediate]` (gate and up rows interleaved), then
//! `down_proj_*` likewise; `quantization_config` {quant_method mxfp4, modules_to_not_convert}.
//! Everything else is bfloat16: embedding, head, norms, the q/k/v/o projections and their
//! biases, the attention sinks `[heads]`, the router and its bias. The MXFP4 encoder is
//! keep-format's (a shared power-of-two exponent per 32 inputs, nearest-even E2M1 elements).
//! Weights are N(0, 1/fan_in), norms 1 + N(0, 0.1²), biases N(0, 0.01²), sinks N(0, 1); the
//! same seed gives the same bytes.

use std::path::{Path, PathBuf};

use keep_checkpoint::config::gpt_oss::{self as names, GptOssConfig, Stack};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::Dtype;
use keep_format::mx::quantize_mxfp4_row;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::synth::{bf16_bytes, chunk_rows, normals};
use crate::{ConvertError, Result};

/// Inputs sharing one MXFP4 scale.
const MX_GROUP: usize = 32;

/// The preset names of this family.
pub const PRESETS: [&str; 2] = ["gpt-oss-20b", "gpt-oss-120b"];

/// A preset's `config.json`: openai/gpt-oss-20b's or openai/gpt-oss-120b's published values.
pub fn preset_json(name: &str) -> Result<Value> {
    let (layers, experts) = match name {
        "gpt-oss-20b" => (24, 32),
        "gpt-oss-120b" => (36, 128),
        _ => {
            return Err(ConvertError::Invalid(format!(
                "unknown gpt_oss preset `{name}` (known: {})",
                PRESETS.join(", ")
            )))
        }
    };
    let mut v = json!({
        "architectures": ["GptOssForCausalLM"], "model_type": names::MODEL_TYPE,
        "attention_bias": true, "attention_dropout": 0.0, "eos_token_id": 200002,
        "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "max_position_embeddings": 131072, "num_attention_heads": 64,
        "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts,
        "output_router_logits": false, "rms_norm_eps": 1e-5,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
        "vocab_size": 201088,
    });
    with_layers(&mut v, layers);
    Ok(v)
}

/// `raw` cut to (or given) `layers` decoder layers: `num_hidden_layers` and `layer_types`
/// (sliding and full alternating from a sliding first layer, as published, where the file has
/// none; the first `layers` of the file's otherwise).
pub fn with_layers(raw: &mut Value, layers: usize) {
    let Some(m) = raw.as_object_mut() else {
        return;
    };
    m.insert("num_hidden_layers".into(), layers.into());
    let types: Vec<Value> = match m.get("layer_types") {
        Some(Value::Array(t)) if t.len() >= layers => t[..layers].to_vec(),
        _ => (0..layers)
            .map(|l| {
                if l % 2 == 0 {
                    names::SLIDING
                } else {
                    names::FULL
                }
                .into()
            })
            .collect(),
    };
    m.insert("layer_types".into(), Value::Array(types));
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A bf16 matrix, N(0, 1/cols).
    Mat,
    /// bf16 values, mean + N(0, std²).
    Vals { mean: f32, std: f32 },
    /// An MXFP4 expert stack of `experts` matrices (`*_blocks`; `*_scales` follows).
    Stack { experts: usize },
}

#[derive(Debug, Clone)]
struct Planned {
    /// The weight's name (`*_blocks` for a stack).
    name: String,
    rows: usize,
    cols: usize,
    /// The stored shape (a stack: its blocks').
    shape: Vec<u64>,
    kind: Kind,
}

fn plan(cfg: &GptOssConfig) -> Vec<Planned> {
    let mut out = vec![];
    let mut push = |name: String, rows: usize, cols: usize, shape: Vec<u64>, kind| {
        out.push(Planned {
            name,
            rows,
            cols,
            shape,
            kind,
        })
    };
    let (d, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let (h, kv, e) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.num_local_experts,
    );
    let norm = Kind::Vals {
        mean: 1.0,
        std: 0.1,
    };
    let bias = Kind::Vals {
        mean: 0.0,
        std: 0.01,
    };
    let mat = |r: usize, c: usize| vec![r as u64, c as u64];
    push(
        format!("{}.weight", names::EMBED),
        v,
        d,
        mat(v, d),
        Kind::Mat,
    );
    if !cfg.tie_word_embeddings {
        push(
            format!("{}.weight", names::HEAD),
            v,
            d,
            mat(v, d),
            Kind::Mat,
        );
    }
    push(names::NORM.into(), 1, d, vec![d as u64], norm);
    for l in 0..cfg.num_hidden_layers {
        let p = names::layer_prefix(l);
        for n in ["input_layernorm", "post_attention_layernorm"] {
            push(format!("{p}{n}.weight"), 1, d, vec![d as u64], norm);
        }
        for (n, r, c) in [
            ("self_attn.q_proj", h * hd, d),
            ("self_attn.k_proj", kv * hd, d),
            ("self_attn.v_proj", kv * hd, d),
            ("self_attn.o_proj", d, h * hd),
            ("mlp.router", e, d),
        ] {
            push(format!("{p}{n}.weight"), r, c, mat(r, c), Kind::Mat);
            if cfg.attention_bias || n == "mlp.router" {
                push(format!("{p}{n}.bias"), 1, r, vec![r as u64], bias);
            }
        }
        push(
            format!("{p}self_attn.sinks"),
            1,
            h,
            vec![h as u64],
            Kind::Vals {
                mean: 0.0,
                std: 1.0,
            },
        );
        for s in [Stack::GateUp, Stack::Down] {
            let (r, c) = s.shape(cfg);
            let shape = vec![e as u64, r as u64, (c / MX_GROUP) as u64, 16];
            push(
                s.name(l, names::BLOCKS),
                r,
                c,
                shape,
                Kind::Stack { experts: e },
            );
            push(s.name(l, "_bias"), e, r, mat(e, r), bias);
        }
    }
    out
}

fn metas(plan: &[Planned]) -> Vec<TensorMeta> {
    let mut out = vec![];
    for t in plan {
        match t.kind {
            Kind::Stack { .. } => {
                out.push(TensorMeta::new(&t.name, Dtype::U8, &t.shape));
                out.push(TensorMeta::new(
                    scales_name(&t.name),
                    Dtype::U8,
                    &t.shape[..3],
                ));
            }
            _ => out.push(TensorMeta::new(&t.name, Dtype::BF16, &t.shape)),
        }
    }
    out
}

fn scales_name(blocks: &str) -> String {
    format!(
        "{}{}",
        blocks.strip_suffix(names::BLOCKS).unwrap_or(blocks),
        names::SCALES
    )
}

/// Options of [`synth_gpt_oss`].
#[derive(Debug, Clone)]
pub struct GptOssSynthOptions {
    pub seed: u64,
    pub force: bool,
    pub max_shard_bytes: u64,
}

/// Write a random gpt-oss checkpoint of config `raw` (a `gpt_oss` `config.json` object,
/// validated here; `hidden_size` and `intermediate_size` multiples of 32, as MXFP4 needs) to
/// `out`, its `layer_types` written out (keep's default alternation where `raw` has none). Calls `progress(bytes_done, bytes_total)` as it goes.
pub fn synth_gpt_oss(
    raw: &Value,
    out: &Path,
    opts: &GptOssSynthOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PathBuf> {
    let mut raw = raw.clone();
    if let Some(m) = raw.as_object_mut() {
        m.insert(
            "quantization_config".into(),
            json!({"modules_to_not_convert": ["model.layers.*.self_attn",
                   "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                   "quant_method": "mxfp4"}),
        );
    }
    let cfg = GptOssConfig::from_value(raw.clone())
        .map_err(|e| ConvertError::Invalid(format!("config: {e}")))?;
    // `layer_types` written out, as the published configs carry it.
    if let Some(m) = raw.as_object_mut() {
        m.insert("layer_types".into(), json!(cfg.layer_types()));
    }
    for (k, v) in [
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
    ] {
        if !v.is_multiple_of(MX_GROUP) {
            return Err(ConvertError::Invalid(format!(
                "{k} = {v} must be a multiple of {MX_GROUP} (MXFP4 experts have one scale per \
                 {MX_GROUP} inputs)"
            )));
        }
    }
    let plan = plan(&cfg);
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
    let mut written = 0u64;
    let (mean, std) = match t.kind {
        Kind::Vals { mean, std } => (mean, std),
        _ => (0.0, (1.0 / cols as f32).sqrt()),
    };
    let Kind::Stack { experts } = t.kind else {
        let cr = chunk_rows(cols, 1);
        let starts: Vec<usize> = (0..rows).step_by(cr).collect();
        for group in starts.chunks(8) {
            let parts: Vec<Vec<u8>> = group
                .par_iter()
                .map(|&r0| {
                    let n = (rows - r0).min(cr) * cols;
                    bf16_bytes(&normals(seed, &t.name, r0 as u64, n, mean, std))
                })
                .collect();
            for b in parts {
                written += b.len() as u64;
                w.write_chunk(&t.name, &b)?;
            }
        }
        return Ok(written);
    };
    let mut scales: Vec<u8> = vec![];
    let cr = chunk_rows(cols, 1);
    let starts: Vec<usize> = (0..rows).step_by(cr).collect();
    for e in 0..experts {
        let src = format!("{}.{e}", t.name);
        for group in starts.chunks(8) {
            let parts: Vec<Result<(Vec<u8>, Vec<u8>)>> = group
                .par_iter()
                .map(|&r0| {
                    let n = (rows - r0).min(cr);
                    let v = normals(seed, &src, r0 as u64, n * cols, mean, std);
                    let mut packed = vec![0u8; n * cols / 2];
                    let mut sc = vec![0u8; n * cols / MX_GROUP];
                    for r in 0..n {
                        quantize_mxfp4_row(
                            &v[r * cols..(r + 1) * cols],
                            &mut packed[r * cols / 2..(r + 1) * cols / 2],
                            &mut sc[r * cols / MX_GROUP..(r + 1) * cols / MX_GROUP],
                        )
                        .map_err(|err| ConvertError::Format {
                            tensor: t.name.clone(),
                            err,
                        })?;
                    }
                    Ok((packed, sc))
                })
                .collect();
            for part in parts {
                let (q, sc) = part?;
                written += q.len() as u64;
                w.write_chunk(&t.name, &q)?;
                scales.extend_from_slice(&sc);
            }
        }
    }
    written += scales.len() as u64;
    w.write_tensor(&scales_name(&t.name), &scales)?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_carry_the_published_values() {
        for (p, layers, experts) in [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)] {
            let c = GptOssConfig::from_value(preset_json(p).unwrap()).unwrap();
            assert_eq!(
                (c.num_hidden_layers, c.num_local_experts),
                (layers, experts)
            );
            assert_eq!(
                (c.hidden_size, c.intermediate_size, c.num_experts_per_tok),
                (2880, 2880, 4)
            );
            assert_eq!(
                (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
                (64, 8, 64)
            );
            assert_eq!((c.vocab_size, c.sliding_window), (201088, Some(128)));
            assert_eq!((c.rope_theta, c.swiglu_limit), (150000.0, 7.0));
            let y = c.yarn().unwrap().unwrap();
            assert_eq!((y.factor, y.truncate), (32.0, false));
            let t = c.layer_types();
            assert_eq!(t.len(), layers);
            assert!(t[0] == names::SLIDING && t[1] == names::FULL);
        }
        assert!(preset_json("gpt-oss-7b").is_err());
    }

    #[test]
    fn the_plan_is_the_published_layout() {
        let mut raw = preset_json("gpt-oss-20b").unwrap();
        with_layers(&mut raw, 2);
        let cfg = GptOssConfig::from_value(raw).unwrap();
        let m = metas(&plan(&cfg));
        let get = |n: &str| m.iter().find(|t| t.name == n).unwrap();
        let b = get("model.layers.1.mlp.experts.gate_up_proj_blocks");
        assert_eq!(
            (b.dtype, b.shape.clone()),
            (Dtype::U8, vec![32, 5760, 90, 16])
        );
        let s = get("model.layers.1.mlp.experts.down_proj_scales");
        assert_eq!((s.dtype, s.shape.clone()), (Dtype::U8, vec![32, 2880, 90]));
        assert_eq!(
            get("model.layers.0.mlp.experts.gate_up_proj_bias").shape,
            vec![32, 5760]
        );
        assert_eq!(get("model.layers.0.self_attn.sinks").shape, vec![64]);
        assert_eq!(
            get("model.layers.0.self_attn.q_proj.bias").shape,
            vec![4096]
        );
    }
}
