//! `config.json` as DeepSeek publishes it, deserialised straight from the file.
//!
//! Defaults are mlx-lm 0.32.2's `deepseek_v41.ModelArgs` defaults, so that a key missing from a
//! file means the same here as in the reference. A nested `text_config` is flattened the way the
//! reference does. The untouched JSON is kept in [`DeepSeekConfig::raw`] so that writers (repack,
//! prune) change only the keys they mean to change.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{CheckpointError, Result};

/// `quantization_config` of a published checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct QuantizationConfig {
    #[serde(default)]
    pub quant_method: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fmt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_fmt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_block_size: Option<Vec<usize>>,
}

macro_rules! defaults {
    ($($name:ident: $t:ty = $v:expr;)*) => {
        $(pub(super) fn $name() -> $t { $v })*
    };
}

mod d {
    defaults! {
        model_type: String = "deepseek_v41".into();
        vocab_size: usize = 129280;
        hidden_size: usize = 5120;
        num_hidden_layers: usize = 40;
        num_attention_heads: usize = 64;
        head_dim: usize = 512;
        q_lora_rank: usize = 1280;
        qk_rope_head_dim: usize = 64;
        o_groups: usize = 8;
        o_lora_rank: usize = 1024;
        moe_intermediate_size: usize = 2304;
        n_routed_experts: usize = 384;
        n_shared_experts: usize = 1;
        num_experts_per_tok: usize = 6;
        scoring_func: String = "sqrtsoftplus".into();
        gate_temp: f64 = 1.0;
        t: bool = true;
        routed_scaling_factor: f64 = 1.5;
        swiglu_limit: f64 = 10.0;
        rms_norm_eps: f64 = 1e-20;
        sliding_window: usize = 128;
        compress_rope_theta: f64 = 160000.0;
        candidate_source_layer_id: i64 = -1;
        candidate_topk_blocks: usize = 2048;
        candidate_block_size: usize = 8;
        index_n_heads: usize = 32;
        index_head_dim: usize = 128;
        index_topk: usize = 512;
        rope_theta: f64 = 10000.0;
        max_position_embeddings: usize = 1048576;
        hc_mult: usize = 4;
        hc_sinkhorn_iters: usize = 20;
        hc_eps: f64 = 1e-6;
        engram_pad_id: usize = 2;
    }
}

/// The DeepSeek-V4/V4.1 configuration keys keep reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepSeekConfig {
    #[serde(default = "d::model_type")]
    pub model_type: String,
    #[serde(default = "d::vocab_size")]
    pub vocab_size: usize,
    #[serde(default = "d::hidden_size")]
    pub hidden_size: usize,
    #[serde(default = "d::num_hidden_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d::num_attention_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d::head_dim")]
    pub head_dim: usize,
    #[serde(default = "d::q_lora_rank")]
    pub q_lora_rank: usize,
    #[serde(default = "d::qk_rope_head_dim")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "d::o_groups")]
    pub o_groups: usize,
    #[serde(default = "d::o_lora_rank")]
    pub o_lora_rank: usize,
    #[serde(default = "d::moe_intermediate_size")]
    pub moe_intermediate_size: usize,
    #[serde(default = "d::n_routed_experts")]
    pub n_routed_experts: usize,
    #[serde(default = "d::n_shared_experts")]
    pub n_shared_experts: usize,
    #[serde(default = "d::num_experts_per_tok")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d::scoring_func")]
    pub scoring_func: String,
    #[serde(default = "d::gate_temp")]
    pub gate_temp: f64,
    #[serde(default = "d::t")]
    pub norm_topk_prob: bool,
    #[serde(default = "d::routed_scaling_factor")]
    pub routed_scaling_factor: f64,
    #[serde(default = "d::swiglu_limit")]
    pub swiglu_limit: f64,
    #[serde(default = "d::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d::sliding_window")]
    pub sliding_window: usize,
    #[serde(default)]
    pub compress_ratios: Vec<usize>,
    #[serde(default)]
    pub kv_source_layer_ids: Vec<usize>,
    #[serde(default)]
    pub index_source_layer_ids: Vec<usize>,
    #[serde(default = "d::compress_rope_theta")]
    pub compress_rope_theta: f64,
    #[serde(default = "d::candidate_source_layer_id")]
    pub candidate_source_layer_id: i64,
    #[serde(default = "d::candidate_topk_blocks")]
    pub candidate_topk_blocks: usize,
    #[serde(default = "d::candidate_block_size")]
    pub candidate_block_size: usize,
    #[serde(default = "d::index_n_heads")]
    pub index_n_heads: usize,
    #[serde(default = "d::index_head_dim")]
    pub index_head_dim: usize,
    #[serde(default = "d::index_topk")]
    pub index_topk: usize,
    #[serde(default = "d::rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default = "d::max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "d::hc_mult")]
    pub hc_mult: usize,
    #[serde(default = "d::hc_sinkhorn_iters")]
    pub hc_sinkhorn_iters: usize,
    #[serde(default = "d::hc_eps")]
    pub hc_eps: f64,
    #[serde(default)]
    pub engram_layer_ids: Vec<usize>,
    /// Engram: table rows per engram layer (the sum of the layer's bucket primes, or more).
    #[serde(default)]
    pub engram_num_embeddings: Vec<u64>,
    /// Engram: n-grams of sizes 2..=this are hashed at each position.
    #[serde(default)]
    pub engram_max_ngram_size: usize,
    /// Engram: hash heads per n-gram size.
    #[serde(default)]
    pub engram_n_heads: usize,
    /// Engram: where the search for bucket primes starts (primes are drawn above `this - 1`).
    #[serde(default)]
    pub engram_vocab_size: u64,
    /// Engram: channels of one table row.
    #[serde(default)]
    pub engram_head_dim: usize,
    /// Engram: the raw token id whose compressed id fills look-back before the sequence start.
    #[serde(default = "d::engram_pad_id")]
    pub engram_pad_id: usize,
    /// Engram: the size of the normalised token id space the hash runs over (0: `vocab_size`).
    #[serde(default)]
    pub engram_compressed_vocab_size: usize,
    /// Written by `keep prune` when hash-routed layers stay whole while others are pruned:
    /// the routed experts of each decoder layer (overrides `n_routed_experts` per layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_routed_experts_per_layer: Option<Vec<usize>>,
    /// V4-Flash: the first this-many layers are hash-routed (`gate.tid2eid`).
    #[serde(default)]
    pub num_hash_layers: usize,
    /// Multi-token-prediction layers stored under `mtp.N.*`.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
    /// The file as read (after `text_config` flattening is *not* applied), for writers.
    #[serde(skip)]
    pub raw: Value,
}

impl DeepSeekConfig {
    /// Parse a config from JSON text.
    pub fn from_json(path: &Path, text: &str) -> Result<DeepSeekConfig> {
        let cerr = |msg: String| CheckpointError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let raw: Value =
            serde_json::from_str(text).map_err(|e| cerr(format!("not valid JSON: {e}")))?;
        let obj = raw
            .as_object()
            .ok_or_else(|| cerr("config is not a JSON object".into()))?;
        // The reference flattens `text_config` into the top level, keeping model_type.
        let flat = match obj.get("text_config") {
            Some(Value::Object(tc)) => {
                let mut m = tc.clone();
                if let Some(mt) = obj.get("model_type") {
                    m.insert("model_type".into(), mt.clone());
                }
                if !m.contains_key("quantization_config") {
                    if let Some(q) = obj.get("quantization_config") {
                        m.insert("quantization_config".into(), q.clone());
                    }
                }
                Value::Object(m)
            }
            _ => raw.clone(),
        };
        let mut cfg: DeepSeekConfig =
            serde_json::from_value(flat).map_err(|e| cerr(format!("unexpected value: {e}")))?;
        cfg.raw = raw;
        cfg.check().map_err(cerr)?;
        Ok(cfg)
    }

    /// Read `config.json` from a file.
    pub fn read(path: &Path) -> Result<DeepSeekConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| CheckpointError::io(path, e))?;
        DeepSeekConfig::from_json(path, &text)
    }

    /// Internal consistency that does not need the tensors.
    fn check(&self) -> std::result::Result<(), String> {
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
            return Err(format!(
                "num_experts_per_tok = {} must be in 1..=n_routed_experts ({})",
                self.num_experts_per_tok, self.n_routed_experts
            ));
        }
        if !self.compress_ratios.is_empty() && self.compress_ratios.len() < self.num_hidden_layers {
            return Err(format!(
                "compress_ratios has {} entries but num_hidden_layers is {}",
                self.compress_ratios.len(),
                self.num_hidden_layers
            ));
        }
        for (key, ids) in [
            ("kv_source_layer_ids", &self.kv_source_layer_ids),
            ("index_source_layer_ids", &self.index_source_layer_ids),
            ("engram_layer_ids", &self.engram_layer_ids),
        ] {
            if let Some(bad) = ids.iter().find(|&&i| i >= self.num_hidden_layers) {
                return Err(format!(
                    "{key} names layer {bad} but num_hidden_layers is {}",
                    self.num_hidden_layers
                ));
            }
        }
        Ok(())
    }

    /// Routed experts in decoder layer `layer`.
    pub fn experts_in_layer(&self, layer: usize) -> usize {
        self.n_routed_experts_per_layer
            .as_ref()
            .and_then(|v| v.get(layer).copied())
            .unwrap_or(self.n_routed_experts)
    }

    /// The compress ratio of a layer (0 when not listed).
    pub fn compress_ratio(&self, layer: usize) -> usize {
        self.compress_ratios.get(layer).copied().unwrap_or(0)
    }

    /// FP8 block shape declared by `quantization_config`, if any.
    pub fn weight_block_size(&self) -> Option<(usize, usize)> {
        let b = self
            .quantization_config
            .as_ref()?
            .weight_block_size
            .as_ref()?;
        match b.as_slice() {
            [r, c] => Some((*r, *c)),
            _ => None,
        }
    }

    /// Serialise `raw` with `edits` applied at the top level (or inside `text_config` when the
    /// file nests it), for writers that change a few keys.
    pub fn raw_with(&self, edits: &[(&str, Value)]) -> Value {
        let mut raw = self.raw.clone();
        let nested = raw.get("text_config").is_some_and(Value::is_object);
        for (k, v) in edits {
            let target = if nested && *k != "quantization_config" {
                raw.get_mut("text_config")
            } else {
                Some(&mut raw)
            };
            if let Some(Value::Object(m)) = target {
                m.insert((*k).to_string(), v.clone());
            }
        }
        raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_reference() {
        let c = DeepSeekConfig::from_json(Path::new("c.json"), "{}").unwrap();
        assert_eq!(c.hidden_size, 5120);
        assert_eq!(c.n_routed_experts, 384);
        assert_eq!(c.num_experts_per_tok, 6);
        assert_eq!(c.rms_norm_eps, 1e-20);
        assert!(c.norm_topk_prob);
    }

    #[test]
    fn text_config_is_flattened() {
        let c = DeepSeekConfig::from_json(
            Path::new("c.json"),
            r#"{"model_type":"x","text_config":{"hidden_size":64,"n_routed_experts":8,"num_experts_per_tok":2}}"#,
        )
        .unwrap();
        assert_eq!(c.hidden_size, 64);
        assert_eq!(c.model_type, "x");
        let raw = c.raw_with(&[("n_routed_experts", Value::from(4))]);
        assert_eq!(raw["text_config"]["n_routed_experts"], 4);
    }

    #[test]
    fn bad_configs_are_errors() {
        for bad in [
            "[]",
            "{",
            r#"{"hidden_size":"big"}"#,
            r#"{"num_hidden_layers":2,"compress_ratios":[0]}"#,
            r#"{"num_hidden_layers":2,"kv_source_layer_ids":[5]}"#,
            r#"{"n_routed_experts":4,"num_experts_per_tok":6}"#,
        ] {
            let e = DeepSeekConfig::from_json(Path::new("c.json"), bad).unwrap_err();
            assert!(e.to_string().starts_with("c.json"), "{e}");
        }
    }
}
