//! Named `keep synth` configurations.
//!
//! - `tiny`: eight small layers covering every V4.1 attention path mlx-lm implements (compress
//!   ratios 0, 4, 2 and 1; kv-source, index-source and plain readers; a candidate-source layer
//!   and an index layer that reads its candidates), 16 experts top-4. For tests.
//! - `tiny-v4flash`: a small DeepSeek-V4-Flash (`deepseek_v4`): six layers with compress ratios
//!   0, 4 (CSA), 8 (HCA), 4, 8, 0, the first two hash-routed (`gate.tid2eid`), 128×128 FP8
//!   blocks over a 192-wide hidden state (partial blocks at the edges), 16 experts top-4. For
//!   tests and the transformers conformance check.
//! - `flash`: the real V4.1-Flash shapes (hidden 5120, 64 heads of 512, 2304-wide experts,
//!   vocabulary 129,280) with 4 layers and 16 experts. For benchmarks.
//! - `v4flash`: the real V4-Flash shapes (hidden 4096, 64 heads of 512, 2048-wide experts,
//!   q rank 1024, 64 indexer heads, vocabulary 129,280) with 4 layers (ratios 0, 0, 4, 128;
//!   three hash-routed) and 16 experts. For benchmarks.

use keep_checkpoint::config::QuantizationConfig;
use keep_checkpoint::DeepSeekConfig;
use serde_json::json;

use crate::{ConvertError, Result};

/// How a synthetic checkpoint stores its FP8 residents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Storage {
    /// FP8 block shape (rows, cols).
    pub block: (usize, usize),
    /// Write FP8 block scales as float32 powers of two instead of E8M0 bytes.
    pub f32_scales: bool,
    /// The first this-many layers are hash-routed (V4-Flash).
    pub hash_layers: usize,
}

impl Storage {
    /// DeepSeek-V4.1: 32×32 E8M0 blocks, no hash layers.
    pub const V41: Storage = Storage {
        block: (32, 32),
        f32_scales: false,
        hash_layers: 0,
    };
}

/// Give `cfg` a DSpark drafter (docs/dspark.md): three stages (`num_nextn_predict_layers` 3,
/// window-only), blocks of 5, reading the last three layers (or all, if fewer), the last
/// token of the vocabulary as the noise token, Markov rank 8, `dspark_n_routed_experts` = the
/// main count (at least 2) with 2 active per row. `keep synth` then writes the drafter's tensors.
pub fn with_dspark(cfg: &mut DeepSeekConfig) {
    let n = 3;
    let layers = cfg.num_hidden_layers;
    cfg.num_nextn_predict_layers = n;
    cfg.compress_ratios.truncate(layers);
    cfg.compress_ratios.resize(layers, 0);
    cfg.compress_ratios.extend([0; 3]);
    cfg.dspark_block_size = 5;
    cfg.dspark_target_layer_ids = (layers.saturating_sub(3)..layers).collect();
    cfg.dspark_noise_token_id = Some(cfg.vocab_size - 1);
    cfg.dspark_markov_rank = Some(8);
    let experts = cfg.n_routed_experts.max(2);
    cfg.dspark_n_routed_experts = Some(experts);
    cfg.dspark_num_experts_per_tok = Some(2.min(experts));
    cfg.n_routed_experts_mtp = None;
    if let Some(m) = cfg.raw.as_object_mut() {
        for (k, v) in [
            ("num_nextn_predict_layers", json!(n)),
            ("compress_ratios", json!(cfg.compress_ratios)),
            ("dspark_block_size", json!(cfg.dspark_block_size)),
            (
                "dspark_target_layer_ids",
                json!(cfg.dspark_target_layer_ids),
            ),
            ("dspark_noise_token_id", json!(cfg.dspark_noise_token_id)),
            ("dspark_markov_rank", json!(cfg.dspark_markov_rank)),
            (
                "dspark_n_routed_experts",
                json!(cfg.dspark_n_routed_experts),
            ),
            (
                "dspark_num_experts_per_tok",
                json!(cfg.dspark_num_experts_per_tok),
            ),
        ] {
            m.insert(k.into(), v);
        }
        m.remove("n_routed_experts_mtp");
    }
}

/// The preset names.
pub const PRESETS: [&str; 4] = ["tiny", "tiny-v4flash", "flash", "v4flash"];

fn base(v: serde_json::Value) -> DeepSeekConfig {
    let mut cfg: DeepSeekConfig = serde_json::from_value(v).expect("preset JSON is valid");
    cfg.raw = serde_json::to_value(&cfg).expect("serialisable");
    cfg
}

fn tiny_json() -> serde_json::Value {
    json!({
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 2, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
        "moe_intermediate_size": 64, "n_routed_experts": 16, "n_shared_experts": 1,
        "num_experts_per_tok": 4, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
        "sliding_window": 16,
        "compress_ratios": [0, 4, 4, 2, 2, 1, 1, 1],
        "kv_source_layer_ids": [1, 3, 5],
        "index_source_layer_ids": [1, 3, 5, 6],
        "candidate_source_layer_id": 5, "candidate_topk_blocks": 2, "candidate_block_size": 4,
        "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [32, 32]}
    })
}

/// Look up a preset: its config and storage.
pub fn preset(name: &str) -> Result<(DeepSeekConfig, Storage)> {
    match name {
        "tiny" => Ok((base(tiny_json()), Storage::V41)),
        "tiny-v4flash" => {
            let v = json!({
                "architectures": ["DeepseekV4ForCausalLM"],
                "model_type": "deepseek_v4",
                "vocab_size": 512, "hidden_size": 192, "num_hidden_layers": 6,
                "num_attention_heads": 2, "head_dim": 64, "qk_rope_head_dim": 16,
                "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 32,
                "moe_intermediate_size": 64, "n_routed_experts": 16, "n_shared_experts": 1,
                "num_experts_per_tok": 4, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
                "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
                "sliding_window": 16, "num_hash_layers": 2,
                "compress_ratios": [0, 4, 8, 4, 8, 0],
                "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
                "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 32, "beta_slow": 1},
                "max_position_embeddings": 4096,
                "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
                "num_nextn_predict_layers": 1,
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                        "weight_block_size": [128, 128]}
            });
            Ok((
                base(v),
                Storage {
                    block: (128, 128),
                    f32_scales: false,
                    hash_layers: 2,
                },
            ))
        }
        "flash" => {
            let v = json!({
                "architectures": ["DeepseekV41ForCausalLM"],
                "model_type": "deepseek_v41",
                "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 4,
                "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
                "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
                "moe_intermediate_size": 2304, "n_routed_experts": 16, "n_shared_experts": 1,
                "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
                "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
                "sliding_window": 128,
                "compress_ratios": [0, 2, 1, 4],
                "kv_source_layer_ids": [1, 2, 3],
                "index_source_layer_ids": [1, 2, 3],
                "candidate_source_layer_id": -1,
                "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
                "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                "max_position_embeddings": 1048576,
                "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                        "weight_block_size": [32, 32]}
            });
            Ok((base(v), Storage::V41))
        }
        "v4flash" => {
            let v = json!({
                "architectures": ["DeepseekV4ForCausalLM"],
                "model_type": "deepseek_v4",
                "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 4,
                "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
                "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
                "moe_intermediate_size": 2048, "n_routed_experts": 16, "n_shared_experts": 1,
                "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
                "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
                "sliding_window": 128, "num_hash_layers": 3,
                "compress_ratios": [0, 0, 4, 128],
                "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
                "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
                "rope_scaling": {"type": "yarn", "factor": 16.0,
                                 "original_max_position_embeddings": 65536,
                                 "beta_fast": 32, "beta_slow": 1},
                "max_position_embeddings": 1048576,
                "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
                "num_nextn_predict_layers": 1,
                "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                        "weight_block_size": [128, 128]}
            });
            Ok((
                base(v),
                Storage {
                    block: (128, 128),
                    f32_scales: false,
                    hash_layers: 3,
                },
            ))
        }
        other => Err(ConvertError::Invalid(format!(
            "unknown preset `{other}`; presets: {}",
            PRESETS.join(", ")
        ))),
    }
}

/// The `quantization_config` a synthetic checkpoint with this storage declares.
pub fn quantization_config(s: &Storage) -> QuantizationConfig {
    QuantizationConfig {
        quant_method: "fp8".into(),
        fmt: Some("e4m3".into()),
        scale_fmt: Some("ue8m0".into()),
        weight_block_size: Some(vec![s.block.0, s.block.1]),
    }
}
