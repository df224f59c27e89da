//! `keep synth --family qwen3_moe`: random-weight Qwen3-MoE checkpoints with Hugging Face's
//! names and real shapes, in the layouts Qwen ships.
//!
//! Layouts ([`QwenFormat`]): `bf16` (every tensor bfloat16, as Qwen/Qwen3-30B-A3B) and `fp8`
//! (attention, expert and dense-MLP projections FP8 E4M3 in 128×128 blocks with a bfloat16
//! `weight_scale_inv` per block, `quantization_config` {quant_method fp8, fmt e4m3,
//! weight_block_size [128, 128]}, as Qwen/Qwen3-30B-A3B-FP8; embedding, head, norms and routers
//! bfloat16), and `mlx4` / `mlx8` (what `mlx_lm.convert --quantize --q-bits 4|8` writes, as the
//! mlx-community releases: every routed expert's matrices stacked per layer as
//! `mlp.switch_mlp.{gate,up,down}_proj` `[num_experts, rows, …]`, and every linear layer and the
//! embedding whose input width is a multiple of 64 MLX affine in groups of 64 — `uint32` codes
//! with bfloat16 `.scales` and `.biases` — the router `mlp.gate` at 8 bits as mlx-lm's
//! `qwen3_moe` predicate asks; `quantization` {group_size 64, bits, mode affine, the routers'
//! overrides} in `config.json`; norms bfloat16). The MLX codes are keep-format's `mx.quantize`
//! (checked byte for byte against MLX's fixtures) of the bfloat16 weights the `bf16` layout
//! holds for the same seed. The FP8 encoder is keep-format's (DeepSeek's ceil rule: each block's scale is the
//! power of two that puts its largest magnitude at or under 448, exact in bfloat16), so a
//! synthetic FP8 checkpoint repacks to MXFP8 losslessly; Qwen's own files carry
//! `amax / 448` scales, which the oracle (`tools/oracle/qwen3_ref.py`) writes instead.
//! Weights are N(0, 1/fan_in), norms 1 + N(0, 0.1²); the same seed gives the same bytes.

use std::path::{Path, PathBuf};

use keep_checkpoint::naming::ExpertMat;
use keep_checkpoint::qwen3::{self as names, Qwen3MoeConfig};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::Dtype;
use keep_format::fp8block::{encode_fp8_block, BlockShape};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::synth::{bf16_bytes, chunk_rows, normals};
use crate::{ConvertError, Result};

/// FP8 block side of Qwen's FP8 releases.
pub const QWEN_FP8_BLOCK: usize = 128;

/// The layouts `keep synth --family qwen3_moe` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QwenFormat {
    Bf16,
    Fp8,
    /// mlx-lm's affine layout at 4 or 8 bits (stacked `switch_mlp` experts).
    Mlx(u32),
}

impl QwenFormat {
    /// `bf16`, `fp8`, `mlx4` or `mlx8`.
    pub fn parse(s: &str) -> Result<QwenFormat> {
        match s {
            "bf16" => Ok(QwenFormat::Bf16),
            "fp8" => Ok(QwenFormat::Fp8),
            "mlx4" => Ok(QwenFormat::Mlx(4)),
            "mlx8" => Ok(QwenFormat::Mlx(8)),
            _ => Err(ConvertError::Invalid(format!(
                "format `{s}`: qwen3_moe checkpoints are written as bf16, fp8, mlx4 or mlx8"
            ))),
        }
    }
}

/// The group size of the MLX affine layout (mlx-lm's default).
pub const MLX_GROUP: usize = 64;

/// Bits of the router `mlp.gate` in the MLX layout (mlx-lm's `qwen3_moe.quant_predicate`).
pub const MLX_ROUTER_BITS: u32 = 8;

/// The preset names of this family.
pub const PRESETS: [&str; 2] = ["qwen3-30b-a3b", "qwen3-tiny"];

/// A preset's `config.json` (`qwen3-30b-a3b`: Qwen/Qwen3-30B-A3B's published shapes;
/// `qwen3-tiny`: a small model for tests, with a dense layer).
pub fn preset_json(name: &str) -> Result<Value> {
    let common = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "norm_topk_prob": true, "tie_word_embeddings": false, "rope_scaling": null,
    });
    let shapes = match name {
        "qwen3-30b-a3b" => json!({
            "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
            "intermediate_size": 6144, "moe_intermediate_size": 768,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "rope_theta": 1000000.0,
            "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
        }),
        "qwen3-tiny" => json!({
            "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4,
            "intermediate_size": 96, "moe_intermediate_size": 64, "mlp_only_layers": [2],
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 16, "num_experts_per_tok": 4, "rope_theta": 1000000.0,
            "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
        }),
        _ => {
            return Err(ConvertError::Invalid(format!(
                "unknown qwen3_moe preset `{name}` (known: {})",
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

/// Bytes of one routed expert in `format`.
pub fn expert_bytes(cfg: &Qwen3MoeConfig, format: QwenFormat) -> u64 {
    let (d, i) = (cfg.hidden_size as u64, cfg.moe_intermediate_size as u64);
    let b = QWEN_FP8_BLOCK as u64;
    match format {
        QwenFormat::Bf16 => 3 * d * i * 2,
        QwenFormat::Fp8 => 3 * d * i + 3 * 2 * d.div_ceil(b) * i.div_ceil(b),
        QwenFormat::Mlx(bits) => [(i, d), (i, d), (d, i)]
            .iter()
            .map(|&(r, c)| match c.is_multiple_of(MLX_GROUP as u64) {
                true => r * c * bits as u64 / 8 + 2 * 2 * r * (c / MLX_GROUP as u64),
                false => r * c * 2,
            })
            .sum(),
    }
}

/// `num_experts` for routed experts of about `bytes` in all (at least `num_experts_per_tok`).
pub fn experts_for_bytes(cfg: &Qwen3MoeConfig, format: QwenFormat, bytes: u64) -> usize {
    let moe_layers = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .count()
        .max(1) as u64;
    let n = bytes.div_ceil((expert_bytes(cfg, format) * moe_layers).max(1)) as usize;
    n.max(cfg.num_experts_per_tok)
}

/// One tensor to write: its name, `[rows, cols]` (a vector is `[1, n]`), and how it is drawn.
struct Planned {
    name: String,
    rows: usize,
    cols: usize,
    /// Norm weight (1 + N(0, 0.1²)) rather than N(0, 1/cols).
    norm: bool,
    /// Stored as FP8 blocks (in the fp8 layout).
    fp8: bool,
    /// Stored as MLX affine codes of this many bits (in the mlx layouts).
    mlx: Option<u32>,
    /// The per-expert weights stacked on a first axis, in expert order (mlx-lm's
    /// `switch_mlp`; each drawn as the bf16 layout draws that expert's tensor); empty: the
    /// tensor is drawn under its own name.
    stack: Vec<String>,
    /// A vector (1-D shape).
    vector: bool,
}

fn plan(cfg: &Qwen3MoeConfig, format: QwenFormat) -> Vec<Planned> {
    let fp8 = format == QwenFormat::Fp8;
    let bits = match format {
        QwenFormat::Mlx(b) => Some(b),
        _ => None,
    };
    // mlx-lm quantizes a linear layer or embedding whose input width is a multiple of the group.
    let mlx_at = |cols: usize, b: Option<u32>| b.filter(|_| cols.is_multiple_of(MLX_GROUP));
    let mut out = vec![];
    // `q`: quantized in the fp8 layout; `b`: bits in the mlx layouts.
    let mut mat = |name: String, rows, cols, q: bool, b: Option<u32>| {
        out.push(Planned {
            name,
            rows,
            cols,
            norm: false,
            fp8: fp8 && q,
            mlx: mlx_at(cols, b),
            stack: vec![],
            vector: false,
        })
    };
    let (d, hd, v) = (cfg.hidden_size, cfg.head_dim, cfg.vocab_size);
    let (h, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    mat(format!("{}.weight", names::EMBED), v, d, false, bits);
    if !cfg.tie_word_embeddings {
        mat(format!("{}.weight", names::HEAD), v, d, false, bits);
    }
    let mut norms = vec![(names::NORM.to_string(), d)];
    let mut stacks = vec![];
    for l in 0..cfg.num_hidden_layers {
        let p = names::layer_prefix(l);
        for (n, len) in [
            ("input_layernorm", d),
            ("post_attention_layernorm", d),
            ("self_attn.q_norm", hd),
            ("self_attn.k_norm", hd),
        ] {
            norms.push((format!("{p}{n}.weight"), len));
        }
        mat(format!("{p}self_attn.q_proj.weight"), h * hd, d, true, bits);
        mat(
            format!("{p}self_attn.k_proj.weight"),
            kv * hd,
            d,
            true,
            bits,
        );
        mat(
            format!("{p}self_attn.v_proj.weight"),
            kv * hd,
            d,
            true,
            bits,
        );
        mat(format!("{p}self_attn.o_proj.weight"), d, h * hd, true, bits);
        if cfg.is_moe_layer(l) {
            let i = cfg.moe_intermediate_size;
            let router_bits = bits.map(|_| MLX_ROUTER_BITS);
            mat(
                format!("{p}mlp.gate.weight"),
                cfg.num_experts,
                d,
                false,
                router_bits,
            );
            let shapes = [
                (ExpertMat::W1, i, d),
                (ExpertMat::W3, i, d),
                (ExpertMat::W2, d, i),
            ];
            if bits.is_some() {
                for (m, r, c) in shapes {
                    stacks.push((l, m, r, c));
                }
                continue;
            }
            for e in 0..cfg.num_experts {
                for (m, r, c) in shapes {
                    mat(names::expert_tensor(l, e, m, "weight"), r, c, true, bits);
                }
            }
        } else {
            let i = cfg.intermediate_size;
            mat(format!("{p}mlp.gate_proj.weight"), i, d, true, bits);
            mat(format!("{p}mlp.up_proj.weight"), i, d, true, bits);
            mat(format!("{p}mlp.down_proj.weight"), d, i, true, bits);
        }
    }
    for (l, m, rows, cols) in stacks {
        out.push(Planned {
            name: names::stacked_tensor(l, m, "weight"),
            rows,
            cols,
            norm: false,
            fp8: false,
            mlx: mlx_at(cols, bits),
            stack: (0..cfg.num_experts)
                .map(|e| names::expert_tensor(l, e, m, "weight"))
                .collect(),
            vector: false,
        });
    }
    for (name, len) in norms {
        out.push(Planned {
            name,
            rows: 1,
            cols: len,
            norm: true,
            fp8: false,
            mlx: None,
            stack: vec![],
            vector: true,
        });
    }
    out
}

fn scale_name(weight: &str) -> String {
    format!("{weight}_scale_inv")
}

fn grid(t: &Planned) -> [u64; 2] {
    [
        t.rows.div_ceil(QWEN_FP8_BLOCK) as u64,
        t.cols.div_ceil(QWEN_FP8_BLOCK) as u64,
    ]
}

fn metas(plan: &[Planned]) -> Vec<TensorMeta> {
    let mut out = vec![];
    for t in plan {
        let lead: Vec<u64> = match t.stack.len() {
            0 => vec![],
            n => vec![n as u64],
        };
        let shape: Vec<u64> = if t.vector {
            vec![t.cols as u64]
        } else {
            [lead.clone(), vec![t.rows as u64, t.cols as u64]].concat()
        };
        if let Some(bits) = t.mlx {
            let words = (t.cols * bits as usize / 32) as u64;
            let groups = (t.cols / MLX_GROUP) as u64;
            let base = t.name.trim_end_matches(".weight");
            let sshape = [lead.clone(), vec![t.rows as u64, groups]].concat();
            out.push(TensorMeta::new(
                &t.name,
                Dtype::U32,
                &[lead, vec![t.rows as u64, words]].concat(),
            ));
            out.push(TensorMeta::new(
                format!("{base}.scales"),
                Dtype::BF16,
                &sshape,
            ));
            out.push(TensorMeta::new(
                format!("{base}.biases"),
                Dtype::BF16,
                &sshape,
            ));
        } else if t.fp8 {
            out.push(TensorMeta::new(&t.name, Dtype::F8_E4M3, &shape));
            out.push(TensorMeta::new(scale_name(&t.name), Dtype::BF16, &grid(t)));
        } else {
            out.push(TensorMeta::new(&t.name, Dtype::BF16, &shape));
        }
    }
    out
}

/// Options of [`synth_qwen3`].
#[derive(Debug, Clone)]
pub struct QwenSynthOptions {
    pub seed: u64,
    pub format: QwenFormat,
    pub force: bool,
    pub max_shard_bytes: u64,
}

/// Write a random Qwen3-MoE checkpoint of config `raw` (a `qwen3_moe` `config.json` object,
/// validated here) to `out`. Calls `progress(bytes_done, bytes_total)` as it goes.
pub fn synth_qwen3(
    raw: &Value,
    out: &Path,
    opts: &QwenSynthOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PathBuf> {
    let mut raw = raw.clone();
    if let Some(m) = raw.as_object_mut() {
        m.remove("quantization_config");
        m.remove("quantization");
        if opts.format == QwenFormat::Fp8 {
            m.insert(
                "quantization_config".into(),
                json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [QWEN_FP8_BLOCK, QWEN_FP8_BLOCK]}),
            );
        }
    }
    let cfg = Qwen3MoeConfig::from_value(raw.clone())
        .map_err(|e| ConvertError::Invalid(format!("config: {e}")))?;
    if let (QwenFormat::Mlx(bits), Some(m)) = (opts.format, raw.as_object_mut()) {
        // As `mlx_lm.utils.quantize_model` records it (and `save_config` copies it).
        let mut q = json!({"group_size": MLX_GROUP, "bits": bits, "mode": "affine"});
        for l in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
            if cfg.hidden_size.is_multiple_of(MLX_GROUP) {
                q[format!("{}mlp.gate", names::layer_prefix(l))] =
                    json!({"group_size": MLX_GROUP, "bits": MLX_ROUTER_BITS});
            }
        }
        m.insert("quantization".into(), q.clone());
        m.insert("quantization_config".into(), q);
    }
    let plan = plan(&cfg, opts.format);
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
    let (mean, std) = if t.norm {
        (1.0, 0.1)
    } else {
        (0.0, (1.0 / cols as f32).sqrt())
    };
    let mut written = 0u64;
    if let Some(bits) = t.mlx {
        let own = [t.name.clone()];
        let sources: &[String] = if t.stack.is_empty() { &own } else { &t.stack };
        let (mut scales, mut biases) = (vec![], vec![]);
        for src in sources {
            let cr = chunk_rows(cols, 1);
            let starts: Vec<usize> = (0..rows).step_by(cr).collect();
            for group in starts.chunks(8) {
                let parts: Vec<MlxRows> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr);
                        // The bf16 layout's values for this tensor, then `mx.quantize`.
                        let v = normals(seed, src, r0 as u64, n * cols, mean, std);
                        mlx_rows(bits, &v, n, cols)
                    })
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| ConvertError::Format {
                        tensor: t.name.clone(),
                        err: e,
                    })?;
                for (q, s, b) in parts {
                    written += q.len() as u64;
                    w.write_chunk(&t.name, &q)?;
                    scales.extend_from_slice(&s);
                    biases.extend_from_slice(&b);
                }
            }
        }
        let base = t.name.trim_end_matches(".weight");
        written += (scales.len() + biases.len()) as u64;
        w.write_tensor(&format!("{base}.scales"), &scales)?;
        w.write_tensor(&format!("{base}.biases"), &biases)?;
        return Ok(written);
    }
    if !t.fp8 {
        // bf16; a stack (mlx-lm leaves a stacked matrix whose input width is not a multiple of
        // the group in bf16) is its experts' bf16 tensors one after the other.
        let own = [t.name.clone()];
        let sources: &[String] = if t.stack.is_empty() { &own } else { &t.stack };
        let cr = chunk_rows(cols, 1);
        let starts: Vec<usize> = (0..rows).step_by(cr).collect();
        for src in sources {
            for group in starts.chunks(8) {
                let parts: Vec<Vec<u8>> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr) * cols;
                        bf16_bytes(&normals(seed, src, r0 as u64, n, mean, std))
                    })
                    .collect();
                for b in parts {
                    written += b.len() as u64;
                    w.write_chunk(&t.name, &b)?;
                }
            }
        }
        return Ok(written);
    }
    if !t.stack.is_empty() {
        return Err(ConvertError::Invalid(format!(
            "`{}`: stacked experts are written in the mlx layouts only",
            t.name
        )));
    }
    let block = BlockShape {
        rows: QWEN_FP8_BLOCK,
        cols: QWEN_FP8_BLOCK,
    };
    let cr = chunk_rows(cols, QWEN_FP8_BLOCK);
    let starts: Vec<usize> = (0..rows).step_by(cr).collect();
    let mut scales: Vec<u8> = vec![];
    for group in starts.chunks(8) {
        let parts: Vec<(Vec<u8>, Vec<u8>)> = group
            .par_iter()
            .map(|&r0| {
                let n = (rows - r0).min(cr);
                let v = normals(seed, &t.name, r0 as u64, n * cols, 0.0, std);
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
    // E8M0 powers of two as bf16 multipliers (exact: bf16 keeps f32's exponent range).
    let sb: Vec<u8> = scales
        .iter()
        .flat_map(|&b| {
            keep_format::bf16::f32_to_bf16(keep_format::e8m0::e8m0_to_f32(b)).to_le_bytes()
        })
        .collect();
    written += sb.len() as u64;
    w.write_tensor(&scale_name(&t.name), &sb)?;
    Ok(written)
}

/// Packed codes, scales and biases (little-endian bytes) of some rows.
type MlxRows = (Vec<u8>, Vec<u8>, Vec<u8>);

/// `n` rows of `cols` values rounded to bfloat16 (what the bf16 layout stores) and quantized as
/// `mx.quantize(w, group_size=64, bits)` quantizes a bfloat16 weight: packed little-endian
/// `uint32` words, bfloat16 scales and biases.
fn mlx_rows(
    bits: u32,
    v: &[f32],
    n: usize,
    cols: usize,
) -> std::result::Result<MlxRows, keep_format::FormatError> {
    let row_bytes = cols * bits as usize / 8;
    let g = cols / MLX_GROUP;
    let mut q = vec![0u8; n * row_bytes];
    let (mut s, mut b) = (vec![0u16; n * g], vec![0u16; n * g]);
    let mut row = vec![0f32; cols];
    for r in 0..n {
        for (o, &x) in row.iter_mut().zip(&v[r * cols..(r + 1) * cols]) {
            *o = keep_format::bf16::bf16_to_f32(keep_format::bf16::f32_to_bf16(x));
        }
        keep_format::mlx_affine::quantize_row_bf16(
            bits,
            &row,
            &mut q[r * row_bytes..(r + 1) * row_bytes],
            &mut s[r * g..(r + 1) * g],
            &mut b[r * g..(r + 1) * g],
        )?;
    }
    let le = |x: Vec<u16>| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    Ok((q, le(s), le(b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_expert_bytes_choose_counts() {
        for p in PRESETS {
            let v = preset_json(p).unwrap();
            let c = Qwen3MoeConfig::from_value(v).unwrap();
            assert!(c.num_experts >= c.num_experts_per_tok);
        }
        let c = Qwen3MoeConfig::from_value(preset_json("qwen3-30b-a3b").unwrap()).unwrap();
        // 3 × 2048 × 768 bf16 = 9 MiB per expert; 128 experts × 48 layers ≈ 56.6 GiB.
        assert_eq!(expert_bytes(&c, QwenFormat::Bf16), 3 * 2048 * 768 * 2);
        assert_eq!(
            experts_for_bytes(&c, QwenFormat::Bf16, 128 * 48 * 3 * 2048 * 768 * 2),
            128
        );
        assert!(preset_json("qwen3-nope").is_err());
        assert_eq!(QwenFormat::parse("mlx4").unwrap(), QwenFormat::Mlx(4));
        assert!(QwenFormat::parse("mlx5").is_err());
    }
}
