//! `keep synth`: a random-weight checkpoint in DeepSeek's published format for any V4.1 config.
//!
//! Weights are drawn N(0, 1/fan_in) and stored the way DeepSeek ships them: FP8 E4M3 residents
//! with block scales (DeepSeek's ceil rule for the exponent), FP4 E2M1 routed experts with an
//! E8M0 scale per 32 inputs, f32 hyper-connection parameters, sinks and router biases, bf16
//! elsewhere (norm weights near 1); Engram layers (`engram_layer_ids`) get their tables as FP8
//! rows with one E8M0 scale per 32 channels, `wkv` FP8 block-scaled and bf16 `q/k_weight`. Every tensor is generated from its own seed (the run's seed
//! and the tensor's name), in row chunks that are also seeded by position, so the output is
//! the same whatever the thread count, and tensors of any size stream to disk without being
//! held whole in memory. The generator is keep-rng's (Xoshiro256++ seeded by SplitMix64, the
//! stream of rand 0.9's `SmallRng`, which earlier checkpoints were drawn from); the normals
//! are rand_distr 0.5's `StandardNormal` over it.

use std::path::{Path, PathBuf};

use keep_checkpoint::naming::{expert_tensor, ExpertMat};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{DeepSeekConfig, Dtype};
use keep_format::bf16::f32_to_bf16;
use keep_format::fp8block::{encode_fp8_block, BlockShape};
use keep_format::mx::quantize_mxfp4_row;
use rand::Rng;
use rand_distr::StandardNormal;
use rayon::prelude::*;

use crate::presets::{quantization_config, Storage};
use crate::{ConvertError, Result};

/// How a tensor's values are drawn and stored.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// bf16, N(0, std²).
    Bf16 { std: f32 },
    /// bf16, 1 + N(0, std²) (norm weights).
    Bf16Ones { std: f32 },
    /// f32, mean + N(0, std²).
    F32 { mean: f32, std: f32 },
    /// FP8 E4M3 block-scaled resident `[rows, cols]`, N(0, 1/cols); the scale follows.
    Fp8 { rows: usize, cols: usize },
    /// FP4 routed-expert matrix `[rows, cols]`, N(0, 1/cols); the scale follows.
    Fp4 { rows: usize, cols: usize },
    /// FP8 E4M3 rows with one E8M0 scale per 32 channels (Engram tables), N(0, 1); the scale
    /// (`[rows, cols/32]`) follows.
    Fp8Rows { rows: usize, cols: usize },
    /// Hash routing table `[vocab, top_k]` of distinct expert ids per token.
    Tid2eid {
        vocab: usize,
        top_k: usize,
        experts: usize,
    },
}

/// One logical tensor of the plan (a weight and, for FP8/FP4, its scale).
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
}

fn p(name: String, shape: &[usize], kind: Kind) -> Planned {
    Planned {
        name,
        shape: shape.to_vec(),
        kind,
    }
}

/// The tensors of a V4/V4.1 text model with this config, in published names and order.
pub fn plan(cfg: &DeepSeekConfig, st: &Storage) -> Result<Vec<Planned>> {
    let h = cfg.hidden_size;
    let hc = cfg.hc_mult;
    let mix = (2 + hc) * hc;
    let hd = cfg.head_dim;
    let heads = cfg.num_attention_heads;
    if cfg.o_groups == 0 || !(heads * hd).is_multiple_of(cfg.o_groups) {
        return Err(ConvertError::Invalid(format!(
            "num_attention_heads*head_dim = {} is not divisible by o_groups = {}",
            heads * hd,
            cfg.o_groups
        )));
    }
    for (k, v) in [
        ("hidden_size", h),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
    ] {
        if v % 32 != 0 || v == 0 {
            return Err(ConvertError::Invalid(format!(
                "{k} = {v} must be a positive multiple of 32 (FP4 experts have one scale per 32 inputs)"
            )));
        }
    }
    let fp8 = |rows, cols| Kind::Fp8 { rows, cols };
    let norm = Kind::Bf16Ones { std: 0.05 };
    let mut out = vec![p(
        "embed.weight".into(),
        &[cfg.vocab_size, h],
        Kind::Bf16 { std: 1.0 },
    )];
    for l in 0..cfg.num_hidden_layers {
        let n = |s: &str| format!("layers.{l}.{s}");
        out.push(p(n("attn_norm.weight"), &[h], norm.clone()));
        out.push(p(n("ffn_norm.weight"), &[h], norm.clone()));
        for which in ["attn", "ffn"] {
            out.push(p(
                n(&format!("hc_{which}_fn")),
                &[mix, hc * h],
                Kind::F32 {
                    mean: 0.0,
                    std: (1.0 / (hc * h) as f32).sqrt(),
                },
            ));
            out.push(p(
                n(&format!("hc_{which}_base")),
                &[mix],
                Kind::F32 {
                    mean: 0.0,
                    std: 0.5,
                },
            ));
            out.push(p(
                n(&format!("hc_{which}_scale")),
                &[3],
                Kind::F32 {
                    mean: 1.0,
                    std: 0.1,
                },
            ));
        }
        out.push(p(
            n("attn.wq_a.weight"),
            &[cfg.q_lora_rank, h],
            fp8(cfg.q_lora_rank, h),
        ));
        out.push(p(n("attn.q_norm.weight"), &[cfg.q_lora_rank], norm.clone()));
        out.push(p(
            n("attn.wq_b.weight"),
            &[heads * hd, cfg.q_lora_rank],
            fp8(heads * hd, cfg.q_lora_rank),
        ));
        out.push(p(n("attn.wkv.weight"), &[hd, h], fp8(hd, h)));
        out.push(p(n("attn.kv_norm.weight"), &[hd], norm.clone()));
        let og = cfg.o_groups * cfg.o_lora_rank;
        out.push(p(
            n("attn.wo_a.weight"),
            &[og, heads * hd / cfg.o_groups],
            fp8(og, heads * hd / cfg.o_groups),
        ));
        out.push(p(n("attn.wo_b.weight"), &[h, og], fp8(h, og)));
        out.push(p(
            n("attn.attn_sink"),
            &[heads],
            Kind::F32 {
                mean: 0.0,
                std: 1.0,
            },
        ));
        let ratio = cfg.compress_ratio(l);
        let v4 = cfg.model_type == "deepseek_v4";
        let kv_src = !v4 && ratio > 0 && cfg.kv_source_layer_ids.contains(&l);
        let idx_src = !v4 && ratio > 0 && cfg.index_source_layer_ids.contains(&l);
        let lin = |fan_in: usize| Kind::Bf16 {
            std: (1.0 / fan_in as f32).sqrt(),
        };
        if v4 && ratio > 0 {
            // DeepSeek-V4: every compressing layer has its own compressor; ratio 4 (CSA)
            // projects two overlapping series and has an indexer with its own compressor.
            let csa = ratio == 4;
            let pool = |out: &mut Vec<Planned>, pre: &str, dim_out: usize| {
                let w = if csa { 2 * dim_out } else { dim_out };
                out.push(p(n(&format!("{pre}wkv.weight")), &[w, h], lin(h)));
                out.push(p(n(&format!("{pre}wgate.weight")), &[w, h], lin(h)));
                out.push(p(
                    n(&format!("{pre}ape")),
                    &[ratio, w],
                    Kind::F32 {
                        mean: 0.0,
                        std: 0.5,
                    },
                ));
                out.push(p(n(&format!("{pre}norm.weight")), &[dim_out], norm.clone()));
            };
            pool(&mut out, "attn.compressor.", hd);
            if csa {
                let iq = cfg.index_n_heads * cfg.index_head_dim;
                out.push(p(
                    n("attn.indexer.wq_b.weight"),
                    &[iq, cfg.q_lora_rank],
                    fp8(iq, cfg.q_lora_rank),
                ));
                out.push(p(
                    n("attn.indexer.weights_proj.weight"),
                    &[cfg.index_n_heads, h],
                    lin(h),
                ));
                pool(&mut out, "attn.indexer.compressor.", cfg.index_head_dim);
            }
        }
        if kv_src {
            out.push(p(n("attn.compressor.wkv.weight"), &[hd, h], lin(h)));
            if ratio > 1 {
                out.push(p(n("attn.compressor.wgate.weight"), &[hd, h], lin(h)));
            }
            out.push(p(n("attn.compressor.norm.weight"), &[hd], norm.clone()));
        }
        if idx_src {
            let iq = cfg.index_n_heads * cfg.index_head_dim;
            out.push(p(
                n("attn.indexer.wq_b.weight"),
                &[iq, cfg.q_lora_rank],
                fp8(iq, cfg.q_lora_rank),
            ));
            out.push(p(
                n("attn.indexer.weights_proj.weight"),
                &[cfg.index_n_heads, h],
                lin(h),
            ));
            if kv_src {
                out.push(p(
                    n("attn.indexer.wk.weight"),
                    &[cfg.index_head_dim, hd],
                    lin(hd),
                ));
                out.push(p(
                    n("attn.indexer.k_norm.weight"),
                    &[cfg.index_head_dim],
                    norm.clone(),
                ));
            }
        }
        let e = cfg.experts_in_layer(l);
        out.push(p(n("ffn.gate.weight"), &[e, h], lin(h)));
        if l < st.hash_layers {
            out.push(p(
                n("ffn.gate.tid2eid"),
                &[cfg.vocab_size, cfg.num_experts_per_tok],
                Kind::Tid2eid {
                    vocab: cfg.vocab_size,
                    top_k: cfg.num_experts_per_tok,
                    experts: e,
                },
            ));
        } else {
            let bias = Kind::F32 {
                mean: 0.0,
                std: 0.01,
            };
            out.push(p(n("ffn.gate.bias"), &[e], bias.clone()));
            if cfg.model_type != "deepseek_v4" {
                out.push(p(n("ffn.gate.bias_vl"), &[e], bias));
            }
        }
        let m = cfg.moe_intermediate_size;
        for x in 0..e {
            for mat in ExpertMat::ALL {
                let (r, c) = match mat {
                    ExpertMat::W2 => (h, m),
                    _ => (m, h),
                };
                out.push(p(
                    expert_tensor(l, x, mat, "weight"),
                    &[r, c],
                    Kind::Fp4 { rows: r, cols: c },
                ));
            }
        }
        let sm = m * cfg.n_shared_experts;
        if cfg.n_shared_experts > 0 {
            for mat in ExpertMat::ALL {
                let (r, c) = match mat {
                    ExpertMat::W2 => (h, sm),
                    _ => (sm, h),
                };
                out.push(p(
                    n(&format!("ffn.shared_experts.{}.weight", mat.name())),
                    &[r, c],
                    fp8(r, c),
                ));
            }
        }
        if cfg.engram_layer_ids.contains(&l) {
            out.extend(engram_plan(cfg, l)?);
        }
    }
    if cfg.model_type == "deepseek_v4" {
        out.push(p(
            "hc_head_fn".into(),
            &[hc, hc * h],
            Kind::F32 {
                mean: 0.0,
                std: (1.0 / (hc * h) as f32).sqrt(),
            },
        ));
        out.push(p(
            "hc_head_base".into(),
            &[hc],
            Kind::F32 {
                mean: 0.0,
                std: 0.5,
            },
        ));
        out.push(p(
            "hc_head_scale".into(),
            &[1],
            Kind::F32 {
                mean: 1.0,
                std: 0.1,
            },
        ));
    }
    out.push(p("norm.weight".into(), &[h], norm.clone()));
    out.push(p(
        "head.weight".into(),
        &[cfg.vocab_size, h],
        Kind::Bf16 {
            std: (1.0 / h as f32).sqrt(),
        },
    ));
    if let Some(keys) = cfg.dspark() {
        out.extend(dspark_plan(cfg, st, &keys)?);
    } else {
        for k in 0..cfg.num_nextn_predict_layers {
            out.extend(mtp_plan(cfg, st, k)?);
        }
    }
    Ok(out)
}

/// The decoder block of module `k` under `mtp.{k}.`: a layer of the model's kind without a
/// compressor (compress ratio 0, score-routed, no Engram) with the module's expert count.
fn module_block(cfg: &DeepSeekConfig, st: &Storage, k: usize) -> Result<Vec<Planned>> {
    let mut one = cfg.clone();
    one.num_hidden_layers = 1;
    one.compress_ratios = vec![0];
    one.kv_source_layer_ids = vec![];
    one.index_source_layer_ids = vec![];
    one.engram_layer_ids = vec![];
    one.n_routed_experts_per_layer = None;
    one.n_routed_experts = cfg.experts_in_mtp(k);
    one.n_routed_experts_mtp = None;
    one.num_nextn_predict_layers = 0;
    one.dspark_block_size = 0;
    one.dspark_target_layer_ids = vec![];
    let st1 = Storage {
        hash_layers: 0,
        ..*st
    };
    let pre = format!("mtp.{k}.");
    Ok(plan(&one, &st1)?
        .into_iter()
        .filter_map(|t| {
            t.name.strip_prefix("layers.0.").map(|rest| Planned {
                name: format!("{pre}{rest}"),
                ..t
            })
        })
        .collect())
}

/// The tensors of a DSpark drafter (docs/dspark.md, "Tensors"): `num_nextn_predict_layers`
/// stages under `mtp.{k}.`, each a window-only decoder block with `dspark_n_routed_experts`
/// experts; stage 0's FP8 block-scaled `main_proj` `[dim, L·dim]` and bf16 `main_norm`; the
/// last stage's bf16 `norm`, Markov head (`markov_head.embed` and `.head`, `[vocab, rank]`,
/// bf16) and f32 `confidence_head.proj` `[1, dim + rank]`.
fn dspark_plan(
    cfg: &DeepSeekConfig,
    st: &Storage,
    keys: &keep_checkpoint::DSparkKeys,
) -> Result<Vec<Planned>> {
    let (h, v, r) = (cfg.hidden_size, cfg.vocab_size, keys.markov_rank);
    let n = cfg.num_nextn_predict_layers;
    let cols = h * keys.target_layer_ids.len();
    let norm = Kind::Bf16Ones { std: 0.05 };
    let mut out = vec![];
    for k in 0..n {
        out.extend(module_block(cfg, st, k)?);
    }
    out.push(p(
        "mtp.0.main_proj.weight".into(),
        &[h, cols],
        Kind::Fp8 { rows: h, cols },
    ));
    out.push(p("mtp.0.main_norm.weight".into(), &[h], norm.clone()));
    let last = format!("mtp.{}.", n.saturating_sub(1));
    out.push(p(format!("{last}norm.weight"), &[h], norm));
    out.push(p(
        format!("{last}markov_head.embed.weight"),
        &[v, r],
        Kind::Bf16 { std: 1.0 },
    ));
    out.push(p(
        format!("{last}markov_head.head.weight"),
        &[v, r],
        Kind::Bf16 {
            std: (1.0 / r as f32).sqrt(),
        },
    ));
    out.push(p(
        format!("{last}confidence_head.proj.weight"),
        &[1, h + r],
        Kind::F32 {
            mean: 0.0,
            std: (1.0 / (h + r) as f32).sqrt(),
        },
    ));
    Ok(out)
}

/// The tensors of MTP module `k` as DeepSeek-V4 publishes them (`mtp.{k}.*`): one decoder block
/// of the model's kind without a compressor (compress ratio 0, score-routed, no Engram) under
/// `mtp.{k}.`, FP8 block-scaled `e_proj`/`h_proj` `[dim, dim]`, bf16 `enorm`/`hnorm`/`norm`, and
/// f32 `hc_head_{fn,base,scale}` (the module's own stream collapse).
fn mtp_plan(cfg: &DeepSeekConfig, st: &Storage, k: usize) -> Result<Vec<Planned>> {
    let h = cfg.hidden_size;
    let hc = cfg.hc_mult;
    let pre = format!("mtp.{k}.");
    let mut out = module_block(cfg, st, k)?;
    let norm = Kind::Bf16Ones { std: 0.05 };
    out.push(p(format!("{pre}enorm.weight"), &[h], norm.clone()));
    out.push(p(format!("{pre}hnorm.weight"), &[h], norm.clone()));
    out.push(p(
        format!("{pre}e_proj.weight"),
        &[h, h],
        Kind::Fp8 { rows: h, cols: h },
    ));
    out.push(p(
        format!("{pre}h_proj.weight"),
        &[h, h],
        Kind::Fp8 { rows: h, cols: h },
    ));
    out.push(p(
        format!("{pre}hc_head_fn"),
        &[hc, hc * h],
        Kind::F32 {
            mean: 0.0,
            std: (1.0 / (hc * h) as f32).sqrt(),
        },
    ));
    out.push(p(
        format!("{pre}hc_head_base"),
        &[hc],
        Kind::F32 {
            mean: 0.0,
            std: 0.5,
        },
    ));
    out.push(p(
        format!("{pre}hc_head_scale"),
        &[1],
        Kind::F32 {
            mean: 1.0,
            std: 0.1,
        },
    ));
    out.push(p(format!("{pre}norm.weight"), &[h], norm));
    Ok(out)
}

/// The tensors of decoder layer `layer`'s Engram, as published: `engram.embed.{weight,scale}`
/// (FP8 rows, 1×32 E8M0 scales), `engram.wkv` (FP8 block-scaled), `engram.{q,k}_weight` (bf16).
fn engram_plan(cfg: &DeepSeekConfig, layer: usize) -> Result<Vec<Planned>> {
    let slot = cfg
        .engram_layer_ids
        .iter()
        .position(|&l| l == layer)
        .unwrap_or(0);
    let rows = *cfg.engram_num_embeddings.get(slot).ok_or_else(|| {
        ConvertError::Invalid(format!(
            "engram_num_embeddings has no entry for engram layer {layer}"
        ))
    })? as usize;
    let hd = cfg.engram_head_dim;
    if hd == 0 || !hd.is_multiple_of(32) {
        return Err(ConvertError::Invalid(format!(
            "engram_head_dim = {hd} must be a positive multiple of 32 (one scale per 32 channels)"
        )));
    }
    let (h, hc) = (cfg.hidden_size, cfg.hc_mult);
    let cols = cfg.engram_max_ngram_size.saturating_sub(1) * cfg.engram_n_heads * hd;
    let n = |s: &str| format!("layers.{layer}.engram.{s}");
    let qk = Kind::Bf16Ones { std: 0.1 };
    Ok(vec![
        p(
            n("embed.weight"),
            &[rows, hd],
            Kind::Fp8Rows { rows, cols: hd },
        ),
        p(
            n("wkv.weight"),
            &[(hc + 1) * h, cols],
            Kind::Fp8 {
                rows: (hc + 1) * h,
                cols,
            },
        ),
        p(n("q_weight"), &[hc, h], qk.clone()),
        p(n("k_weight"), &[hc, h], qk),
    ])
}

/// Bytes of one Engram table row (FP8 channels and their E8M0 scales).
pub fn engram_row_bytes(head_dim: usize) -> u64 {
    (head_dim + head_dim / 32) as u64
}

/// Give `cfg` Engram layers whose tables take about `bytes` in all: the published hashing
/// (every table is exactly the sum of its bucket primes, drawn above `engram_vocab_size`), with
/// `engram_vocab_size` chosen for the size. Keeps the config's engram layers and shape keys when
/// it has them; otherwise layers 1 and max(2, 14·L/40) (V4.1-Flash's places for L = 40), n-grams 2..4 over 8 heads
/// of 256 channels (V4.1-Flash) or, for hidden sizes under 1024, 2..3 over 2 heads of 32. The
/// token ids are hashed uncompressed (`engram_compressed_vocab_size` = `vocab_size`).
pub fn with_engram_bytes(cfg: &mut DeepSeekConfig, bytes: u64) -> Result<()> {
    let l = cfg.num_hidden_layers;
    if l < 2 {
        return Err(ConvertError::Invalid(
            "Engram layers need at least 2 decoder layers".into(),
        ));
    }
    if cfg.engram_layer_ids.is_empty() {
        let mut ids = vec![1, (14 * l / 40).clamp(2, l - 1)];
        ids.dedup();
        cfg.engram_layer_ids = ids;
    }
    let big = cfg.hidden_size >= 1024;
    if cfg.engram_max_ngram_size < 2 {
        cfg.engram_max_ngram_size = if big { 4 } else { 3 };
    }
    if cfg.engram_n_heads == 0 {
        cfg.engram_n_heads = if big { 8 } else { 2 };
    }
    if cfg.engram_head_dim == 0 {
        cfg.engram_head_dim = if big { 256 } else { 32 };
    }
    if cfg.engram_pad_id >= cfg.vocab_size {
        cfg.engram_pad_id = 0;
    }
    cfg.engram_compressed_vocab_size = cfg.vocab_size;
    let n = cfg.engram_layer_ids.len() as u64;
    let cols = ((cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads) as u64;
    let rows = bytes / n / engram_row_bytes(cfg.engram_head_dim);
    cfg.engram_vocab_size = (rows / cols).max(2);
    cfg.engram_num_embeddings = engram_table_rows(
        cfg.engram_layer_ids.len(),
        cfg.engram_max_ngram_size,
        cfg.engram_n_heads,
        cfg.engram_vocab_size,
    );
    if let Some(m) = cfg.raw.as_object_mut() {
        let m = match m.get_mut("text_config") {
            Some(serde_json::Value::Object(_)) => m
                .get_mut("text_config")
                .and_then(|v| v.as_object_mut())
                .expect("checked"),
            _ => m,
        };
        // The published key; the inference argument's name must not appear beside it.
        m.remove("engram_pad_id");
        for (k, v) in [
            ("engram_layer_ids", serde_json::json!(cfg.engram_layer_ids)),
            (
                "engram_num_embeddings",
                serde_json::json!(cfg.engram_num_embeddings),
            ),
            (
                "engram_max_ngram_size",
                serde_json::json!(cfg.engram_max_ngram_size),
            ),
            ("engram_n_heads", serde_json::json!(cfg.engram_n_heads)),
            (
                "engram_vocab_size",
                serde_json::json!(cfg.engram_vocab_size),
            ),
            ("engram_head_dim", serde_json::json!(cfg.engram_head_dim)),
            ("engram_pad_token_id", serde_json::json!(cfg.engram_pad_id)),
            (
                "engram_compressed_vocab_size",
                serde_json::json!(cfg.engram_compressed_vocab_size),
            ),
        ] {
            m.insert(k.into(), v);
        }
    }
    Ok(())
}

/// Rows of each engram table under the published prime rule (the sum of its bucket primes).
pub fn engram_table_rows(layers: usize, max_ngram: usize, heads: usize, vocab: u64) -> Vec<u64> {
    let mut seen = std::collections::HashSet::new();
    let is_prime = |n: u64| {
        if n < 2 {
            return false;
        }
        if n.is_multiple_of(2) {
            return n == 2;
        }
        let mut d = 3u64;
        while d * d <= n {
            if n.is_multiple_of(d) {
                return false;
            }
            d += 2;
        }
        true
    };
    (0..layers)
        .map(|_| {
            let mut sum = 0u64;
            for _ in 1..max_ngram {
                let mut cur = vocab - 1;
                for _ in 0..heads {
                    cur += 1;
                    while !is_prime(cur) || seen.contains(&cur) {
                        cur += 1;
                    }
                    seen.insert(cur);
                    sum += cur;
                }
            }
            sum
        })
        .collect()
}

/// The stored tensors (weights and scales) of a plan.
pub fn metas(plan: &[Planned], st: &Storage) -> Vec<TensorMeta> {
    let mut out = vec![];
    let u = |v: &[usize]| v.iter().map(|&x| x as u64).collect::<Vec<_>>();
    for t in plan {
        match &t.kind {
            Kind::Bf16 { .. } | Kind::Bf16Ones { .. } => {
                out.push(TensorMeta::new(&t.name, Dtype::BF16, &u(&t.shape)))
            }
            Kind::F32 { .. } => out.push(TensorMeta::new(&t.name, Dtype::F32, &u(&t.shape))),
            Kind::Tid2eid { .. } => out.push(TensorMeta::new(&t.name, Dtype::I32, &u(&t.shape))),
            Kind::Fp8 { rows, cols } => {
                out.push(TensorMeta::new(&t.name, Dtype::F8_E4M3, &u(&t.shape)));
                let grid = [rows.div_ceil(st.block.0), cols.div_ceil(st.block.1)];
                let dt = if st.f32_scales {
                    Dtype::F32
                } else {
                    Dtype::F8_E8M0
                };
                out.push(TensorMeta::new(scale_name(&t.name), dt, &u(&grid)));
            }
            Kind::Fp8Rows { rows, cols } => {
                out.push(TensorMeta::new(&t.name, Dtype::F8_E4M3, &u(&t.shape)));
                out.push(TensorMeta::new(
                    scale_name(&t.name),
                    Dtype::F8_E8M0,
                    &u(&[*rows, cols / 32]),
                ));
            }
            Kind::Fp4 { rows, cols } => {
                out.push(TensorMeta::new(&t.name, Dtype::I8, &u(&[*rows, cols / 2])));
                out.push(TensorMeta::new(
                    scale_name(&t.name),
                    Dtype::F8_E8M0,
                    &u(&[*rows, cols / 32]),
                ));
            }
        }
    }
    out
}

fn scale_name(weight: &str) -> String {
    format!("{}.scale", weight.strip_suffix(".weight").unwrap_or(weight))
}

pub(crate) fn seed_for(seed: u64, name: &str, chunk: u64) -> u64 {
    // FNV-1a over the name, mixed with the run seed and the chunk index.
    let mut h: u64 = 0xcbf29ce484222325 ^ seed.wrapping_mul(0x9E3779B97F4A7C15);
    for b in name.bytes().chain(chunk.to_le_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Draw `n` values mean + std·N(0,1) from a chunk's own generator.
pub(crate) fn normals(
    seed: u64,
    name: &str,
    chunk: u64,
    n: usize,
    mean: f32,
    std: f32,
) -> Vec<f32> {
    let mut rng = keep_rng::rng(seed_for(seed, name, chunk));
    (0..n)
        .map(|_| {
            let z: f32 = rng.sample(StandardNormal);
            mean + std * z
        })
        .collect()
}

/// Rows per generated chunk: about 4 M values, a multiple of `align` rows.
pub(crate) fn chunk_rows(cols: usize, align: usize) -> usize {
    let r = ((4 << 20) / cols.max(1)).max(1);
    r.div_ceil(align) * align
}

/// Options of [`synth`].
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub seed: u64,
    pub storage: Storage,
    pub force: bool,
    pub max_shard_bytes: u64,
}

/// Bytes of one routed expert (three FP4 matrices and their scales) under this config.
pub fn expert_bytes(cfg: &DeepSeekConfig) -> u64 {
    let params = 3 * cfg.hidden_size as u64 * cfg.moe_intermediate_size as u64;
    params / 2 + params / 32
}

/// Choose `n_routed_experts` so that the routed experts take about `bytes` in all.
pub fn experts_for_bytes(cfg: &DeepSeekConfig, bytes: u64) -> usize {
    let per_layer = expert_bytes(cfg) * cfg.num_hidden_layers.max(1) as u64;
    let n = bytes.div_ceil(per_layer.max(1)) as usize;
    n.max(cfg.num_experts_per_tok)
}

/// Write a synthetic checkpoint to `out`. Calls `progress(bytes_done, bytes_total)` as it goes.
pub fn synth(
    cfg: &DeepSeekConfig,
    out: &Path,
    opts: &SynthOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<PathBuf> {
    let st = opts.storage;
    cfg.validate()
        .map_err(|e| ConvertError::Invalid(format!("config: {e}")))?;
    let max = keep_checkpoint::config::MAX_BLOCK;
    if !(1..=max).contains(&st.block.0) || !(1..=max).contains(&st.block.1) {
        return Err(ConvertError::Invalid(format!(
            "FP8 block {}×{} must have sides in 1..={max}",
            st.block.0, st.block.1
        )));
    }
    if st.hash_layers > cfg.num_hidden_layers {
        return Err(ConvertError::Invalid(format!(
            "{} hash-routed layers but the model has {}",
            st.hash_layers, cfg.num_hidden_layers
        )));
    }
    let plan = plan(cfg, &st)?;
    let metas = metas(&plan, &st);
    let total: u64 = metas.iter().map(TensorMeta::nbytes).sum();
    let wopts = WriterOptions {
        max_shard_bytes: opts.max_shard_bytes,
        force: opts.force,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, metas, wopts)?;
    let mut done = 0u64;
    for t in &plan {
        done += write_planned(&mut w, t, opts.seed, &st)?;
        progress(done, total);
    }
    let mut config = cfg.clone();
    config.quantization_config = Some(quantization_config(&st));
    if st.hash_layers > 0 {
        config.num_hash_layers = st.hash_layers;
    }
    let mut json =
        serde_json::to_value(&config).map_err(|e| ConvertError::Invalid(e.to_string()))?;
    if let (Some(dst), Some(src)) = (json.as_object_mut(), cfg.raw.as_object()) {
        for (k, v) in src {
            dst.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    let text =
        serde_json::to_string_pretty(&json).map_err(|e| ConvertError::Invalid(e.to_string()))?;
    w.add_file("config.json", text.as_bytes())?;
    Ok(w.finish()?)
}

pub(crate) fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
        .collect()
}

fn write_planned(w: &mut CheckpointWriter, t: &Planned, seed: u64, st: &Storage) -> Result<u64> {
    let numel: usize = t.shape.iter().product();
    let cols = *t.shape.last().unwrap_or(&1);
    let rows = numel / cols.max(1);
    let mut written = 0u64;
    let fmt_err = |e: keep_format::FormatError| ConvertError::Format {
        tensor: t.name.clone(),
        err: e,
    };
    match &t.kind {
        Kind::Bf16 { std } | Kind::Bf16Ones { std } => {
            let mean = if matches!(t.kind, Kind::Bf16Ones { .. }) {
                1.0
            } else {
                0.0
            };
            let cr = chunk_rows(cols, 1);
            let starts: Vec<usize> = (0..rows).step_by(cr).collect();
            for group in starts.chunks(8) {
                let parts: Vec<Vec<u8>> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr) * cols;
                        bf16_bytes(&normals(seed, &t.name, r0 as u64, n, mean, *std))
                    })
                    .collect();
                for b in parts {
                    written += b.len() as u64;
                    w.write_chunk(&t.name, &b)?;
                }
            }
        }
        Kind::F32 { mean, std } => {
            let v = normals(seed, &t.name, 0, numel, *mean, *std);
            let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            written += b.len() as u64;
            w.write_tensor(&t.name, &b)?;
        }
        Kind::Tid2eid {
            vocab,
            top_k,
            experts,
        } => {
            let mut rng = keep_rng::rng(seed_for(seed, &t.name, 0));
            let mut b = Vec::with_capacity(vocab * top_k * 4);
            for _ in 0..*vocab {
                let mut ids: Vec<i32> = vec![];
                while ids.len() < *top_k {
                    let x = rng.random_range(0..*experts as i32);
                    if !ids.contains(&x) {
                        ids.push(x);
                    }
                }
                for x in ids {
                    b.extend_from_slice(&x.to_le_bytes());
                }
            }
            written += b.len() as u64;
            w.write_tensor(&t.name, &b)?;
        }
        Kind::Fp8 { rows, cols } => {
            let (rows, cols) = (*rows, *cols);
            let std = (1.0 / cols as f32).sqrt();
            let cr = chunk_rows(cols, st.block.0);
            let starts: Vec<usize> = (0..rows).step_by(cr).collect();
            let mut scales: Vec<u8> = vec![];
            for group in starts.chunks(8) {
                let parts: Vec<(Vec<u8>, Vec<u8>)> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr);
                        let v = normals(seed, &t.name, r0 as u64, n * cols, 0.0, std);
                        encode_fp8_block(
                            &v,
                            n,
                            cols,
                            BlockShape {
                                rows: st.block.0,
                                cols: st.block.1,
                            },
                        )
                    })
                    .collect::<std::result::Result<_, _>>()
                    .map_err(fmt_err)?;
                for (q, s) in parts {
                    written += q.len() as u64;
                    w.write_chunk(&t.name, &q)?;
                    scales.extend_from_slice(&s);
                }
            }
            let sb: Vec<u8> = if st.f32_scales {
                scales
                    .iter()
                    .flat_map(|&b| keep_format::e8m0::e8m0_to_f32(b).to_le_bytes())
                    .collect()
            } else {
                scales
            };
            written += sb.len() as u64;
            w.write_tensor(&scale_name(&t.name), &sb)?;
        }
        Kind::Fp8Rows { rows, cols } => {
            let (rows, cols) = (*rows, *cols);
            let cr = chunk_rows(cols, 1);
            let starts: Vec<usize> = (0..rows).step_by(cr).collect();
            let mut scales: Vec<u8> = Vec::with_capacity(rows * cols / 32);
            for group in starts.chunks(8) {
                let parts: Vec<(Vec<u8>, Vec<u8>)> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr);
                        let v = normals(seed, &t.name, r0 as u64, n * cols, 0.0, 1.0);
                        encode_fp8_block(&v, n, cols, BlockShape { rows: 1, cols: 32 })
                    })
                    .collect::<std::result::Result<_, _>>()
                    .map_err(fmt_err)?;
                for (q, sc) in parts {
                    written += q.len() as u64;
                    w.write_chunk(&t.name, &q)?;
                    scales.extend_from_slice(&sc);
                }
            }
            written += scales.len() as u64;
            w.write_tensor(&scale_name(&t.name), &scales)?;
        }
        Kind::Fp4 { rows, cols } => {
            let (rows, cols) = (*rows, *cols);
            let std = (1.0 / cols as f32).sqrt();
            let cr = chunk_rows(cols, 1);
            let starts: Vec<usize> = (0..rows).step_by(cr).collect();
            let mut scales: Vec<u8> = vec![];
            for group in starts.chunks(8) {
                let parts: Vec<Result<(Vec<u8>, Vec<u8>)>> = group
                    .par_iter()
                    .map(|&r0| {
                        let n = (rows - r0).min(cr);
                        let v = normals(seed, &t.name, r0 as u64, n * cols, 0.0, std);
                        let mut packed = vec![0u8; n * cols / 2];
                        let mut sc = vec![0u8; n * cols / 32];
                        for r in 0..n {
                            quantize_mxfp4_row(
                                &v[r * cols..(r + 1) * cols],
                                &mut packed[r * cols / 2..(r + 1) * cols / 2],
                                &mut sc[r * cols / 32..(r + 1) * cols / 32],
                            )
                            .map_err(fmt_err)?;
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
            written += scales.len() as u64;
            w.write_tensor(&scale_name(&t.name), &scales)?;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// keep-rng's generator is the stream `keep synth` draws from (rand 0.9's
    /// `SmallRng`, Xoshiro256++ seeded by SplitMix64 on 64-bit targets), so a seed makes the
    /// same checkpoint; and so are the normals and integer ranges drawn over it.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn the_generator_is_the_stream_earlier_checkpoints_were_drawn_from() {
        use rand::{rngs::SmallRng, RngCore, SeedableRng};
        for seed in [0u64, 1, 11, seed_for(7, "layers.0.attn.wq_a.weight", 3)] {
            let (mut a, mut b) = (keep_rng::rng(seed), SmallRng::seed_from_u64(seed));
            for _ in 0..64 {
                assert_eq!(a.next_u64(), b.next_u64());
                let (x, y): (f32, f32) = (a.sample(StandardNormal), b.sample(StandardNormal));
                assert_eq!(x.to_bits(), y.to_bits());
                assert_eq!(a.random_range(0..37), b.random_range(0..37));
            }
        }
    }
    use crate::presets::preset;

    #[test]
    fn engram_bytes_size_the_tables_by_the_prime_rule() {
        let (mut cfg, st) = preset("tiny").unwrap();
        let want = 3u64 << 20;
        with_engram_bytes(&mut cfg, want).unwrap();
        assert_eq!(cfg.engram_layer_ids.len(), 2);
        let plan = plan(&cfg, &st).unwrap();
        let tables: u64 = metas(&plan, &st)
            .iter()
            .filter(|m| keep_checkpoint::naming::is_engram_table(&m.name))
            .map(TensorMeta::nbytes)
            .sum();
        // Primes above engram_vocab_size make each table a little larger than asked for.
        assert!(
            tables >= want * 99 / 100 && tables <= want * 101 / 100,
            "{tables}"
        );
        let names: Vec<&str> = plan.iter().map(|p| p.name.as_str()).collect();
        for l in &cfg.engram_layer_ids {
            for s in ["embed.weight", "wkv.weight", "q_weight", "k_weight"] {
                assert!(names.contains(&format!("layers.{l}.engram.{s}").as_str()));
            }
        }
        // The published V4.1-Flash tables follow from the same rule.
        assert_eq!(
            engram_table_rows(2, 4, 8, 16_000_000),
            vec![384_006_168, 384_016_682]
        );
    }
}
