//! [`ModelConfig`]: the DeepSeek config keep's model runs, checked and with each layer's roles
//! worked out (compress ratio, KV source, index source, candidate source; hash routing).
//!
//! Two families share it ([`Family`]): DeepSeek-V4.1 (`model_type` `deepseek_v41`, spec mlx-lm's
//! `deepseek_v41.py`, plus the published Engram layers, laid out in `engram_hash`) and
//! DeepSeek-V4 / V4-Flash (`model_type` `deepseek_v4`, spec transformers'
//! `DeepseekV4ForCausalLM`, see `crate::v4`). What a config may hold is decided by the one config
//! validation, `DeepSeekConfig::validate` (keep-checkpoint; `keep inspect` runs the same), and
//! whether the tensors match it by `keep_checkpoint::layout::model_problems`, which
//! [`ModelConfig::from_checkpoint`] runs before anything is allocated.

use keep_checkpoint::DeepSeekConfig;

use crate::{ModelError, Result};

/// Which forward a checkpoint runs: DeepSeek V4.1's, V4's, or a Hugging Face family's (its
/// decoder-layer side found by [`crate::family_layer::layer_family`]). Each Hugging Face
/// family names its value in its own module (`Family::Qwen3Moe` in [`crate::qwen3`], and so
/// on): an associated constant of [`Family::HuggingFace`] with the family keep-checkpoint read
/// the config by.
#[derive(Clone, Copy)]
pub enum Family {
    /// DeepSeek-V4.1 (mlx-lm `deepseek_v41`): shared compressed KV, delayed hyper-connection
    /// pre-mix, fake-quantised KV.
    V41,
    /// DeepSeek-V4 / V4-Flash (transformers `deepseek_v4`): per-layer CSA (ratio 4, overlapping
    /// windows + indexer) / HCA (other ratios) compressors, hash-routed first layers.
    V4,
    /// A Hugging Face family (one residual stream, `hc` = 1; its layers a
    /// [`crate::family::DecoderLayer`]): the checkpoint family that read the config.
    HuggingFace(&'static dyn keep_checkpoint::family::Family),
}

impl PartialEq for Family {
    fn eq(&self, other: &Family) -> bool {
        match (self, other) {
            (Family::V41, Family::V41) | (Family::V4, Family::V4) => true,
            (Family::HuggingFace(a), Family::HuggingFace(b)) => a.name() == b.name(),
            _ => false,
        }
    }
}

impl Eq for Family {}

/// A Hugging Face family shows as its checkpoint family's type (`Qwen3Moe`, ...), as the
/// associated constant that names it.
impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Family::V41 => f.write_str("V41"),
            Family::V4 => f.write_str("V4"),
            Family::HuggingFace(c) => c.fmt(f),
        }
    }
}

impl Family {
    /// The model family of a checkpoint config: the checkpoint family that read it
    /// ([`DeepSeekConfig::family`]) when it is a Hugging Face one, else DeepSeek V4 or V4.1 by
    /// its `model_type`.
    pub fn of(c: &DeepSeekConfig) -> Family {
        let f = c.family();
        if !f.is_deepseek_v4() {
            Family::HuggingFace(f)
        } else if c.model_type == "deepseek_v4" {
            Family::V4
        } else {
            Family::V41
        }
    }

    /// Whether the family is a Hugging Face one (one residual stream, its layers a
    /// [`crate::family::DecoderLayer`]).
    pub fn is_hugging_face(self) -> bool {
        matches!(self, Family::HuggingFace(_))
    }
}

/// How router logits become scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scoring {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// YaRN parameters from `rope_scaling` (mlx-lm reads `factor`, `original_max_position_embeddings`,
/// `beta_fast`, `beta_slow`; V4.1 uses attention factor 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// What one layer does besides the sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRoles {
    /// `compress_ratios[layer]` (0: window only).
    pub ratio: usize,
    pub kv_source: bool,
    pub index_source: bool,
    pub candidate_source: bool,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub raw: DeepSeekConfig,
    pub family: Family,
    /// Layers `0..hash_layers` are hash-routed (`ffn.gate.tid2eid`; V4 only).
    pub hash_layers: usize,
    pub vocab: usize,
    pub dim: usize,
    pub n_layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub q_lora: usize,
    pub rope_dim: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub inter: usize,
    /// The most routed experts of any decoder layer: `n_routed_experts`, unless `keep prune`
    /// left some layers another count (`n_routed_experts_per_layer`: hash-routed layers kept
    /// whole). The stride of per-layer expert arrays; a layer's own count is
    /// [`ModelConfig::experts_in_layer`].
    pub n_experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    pub gate_temp: f32,
    pub norm_topk_prob: bool,
    pub route_scale: f32,
    pub swiglu_limit: f32,
    pub eps: f32,
    pub window: usize,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub candidate_topk_blocks: usize,
    pub candidate_block_size: usize,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub yarn: Yarn,
    pub hc: usize,
    pub hc_iters: usize,
    pub hc_eps: f32,
    pub roles: Vec<LayerRoles>,
    /// Engram layers' hashing (`None`: no `engram_layer_ids`); see `engram_hash`.
    pub engram: Option<crate::engram_hash::EngramLayout>,
    /// The beginning-of-sequence token: `bos_token_id`, else [`DEFAULT_BOS`]. Generation
    /// starts from it when the prompt encodes to no tokens.
    pub bos: u32,
    /// The end-of-sequence tokens (`eos_token_id`: one id or a list; absent or null: none,
    /// generation then runs to its token limit). Generation stops at the first of them.
    pub eos: Vec<u32>,
}

/// Tokens per forward pass of a long prompt. At 128 the largest per-pass buffer on the bundled
/// model at a 16k context, the indexer's scores and candidate mask (128 × 16k keys × 5 bytes),
/// is 10 MiB, against 1.3 GiB for one 16k pass, while each weight row decoded is still reused
/// for 128 rows; `keep run --prefill-chunk N` compares sizes (the speed of other sizes has not
/// been measured yet).
pub const DEFAULT_PREFILL_CHUNK: usize = 128;

/// The beginning-of-sequence token of a config without `bos_token_id`: 0 (DeepSeek's
/// `<｜begin▁of▁sentence｜>` and the bundled model's `<|endoftext|>` are both id 0).
pub const DEFAULT_BOS: u32 = 0;

/// Token ids under `key` of the raw `config.json` (a number or a list of numbers; absent or null:
/// none), each checked against the vocabulary.
fn token_ids(raw: &serde_json::Value, key: &str, vocab: usize) -> Result<Vec<u32>> {
    let bad = |v: &serde_json::Value| {
        unsupported(
            key,
            format!("{v} is not a token id (a non-negative integer) or a list of them"),
        )
    };
    let one = |v: &serde_json::Value| -> Result<u32> {
        let id = v.as_u64().ok_or_else(|| bad(v))?;
        if id >= vocab as u64 {
            return Err(unsupported(
                key,
                format!("token id {id} is outside the vocabulary (vocab_size {vocab})"),
            ));
        }
        Ok(id as u32)
    };
    match raw.get(key) {
        None | Some(serde_json::Value::Null) => Ok(vec![]),
        Some(serde_json::Value::Array(a)) => a.iter().map(one).collect(),
        Some(v) => Ok(vec![one(v)?]),
    }
}

fn unsupported(key: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Unsupported {
        key: key.into(),
        msg: msg.into(),
    }
}

impl ModelConfig {
    /// Whether `layer` routes by token id.
    pub fn is_hash(&self, layer: usize) -> bool {
        layer < self.hash_layers
    }

    /// Routed experts of `layer` (its router's rows): `n_routed_experts_per_layer[layer]` when
    /// `keep prune` left layers different counts, else `n_routed_experts`. Layer `n_layers + n`
    /// is MTP module `mtp.n`'s block (`n_routed_experts_mtp`; see [`crate::mtp`]).
    pub fn experts_in_layer(&self, layer: usize) -> usize {
        match layer.checked_sub(self.n_layers) {
            None => self.raw.experts_in_layer(layer),
            Some(n) => self.raw.experts_in_mtp(n),
        }
    }

    /// [`ModelConfig::from_deepseek`] of a checkpoint's config, after the tensors are checked
    /// against it (`keep_checkpoint::layout::model_problems`: refused, listing each problem,
    /// before anything is allocated), with the Engram token
    /// compression map built from the checkpoint's `tokenizer.json` when the config's
    /// `engram_compressed_vocab_size` differs from its `vocab_size`. Refuses such a checkpoint
    /// without a `tokenizer.json`, and one whose tokenizer compresses to another size.
    pub fn from_checkpoint(ck: &keep_checkpoint::Checkpoint) -> Result<ModelConfig> {
        let raw = ck.require_config()?;
        let problems = keep_checkpoint::layout::model_problems(ck, raw);
        if !problems.is_empty() {
            return Err(ModelError::Tensors {
                dir: ck.dir().display().to_string(),
                problems,
            });
        }
        let mut cfg = ModelConfig::from_deepseek(raw)?;
        if let Some(layout) = cfg.engram.as_mut() {
            if layout.needs_token_map() {
                let path = ck.dir().join("tokenizer.json");
                if !path.is_file() {
                    return Err(unsupported(
                        "engram_compressed_vocab_size",
                        format!(
                            "{} differs from vocab_size {}: the engram hash needs the \
                             tokenizer's compression map, and {} is missing",
                            layout.compressed_vocab,
                            layout.vocab,
                            path.display()
                        ),
                    ));
                }
                let tokens = crate::engram_tokens::compressed_token_map_from_file(&path)?;
                layout.set_compressed_tokens(tokens)?;
            }
        }
        Ok(cfg)
    }

    /// Check a checkpoint's config and derive the per-layer roles.
    pub fn from_deepseek(c: &DeepSeekConfig) -> Result<ModelConfig> {
        let family = Family::of(c);
        // The one config validation (keep-checkpoint's, which `keep inspect` runs too): every
        // bound, the family's rules (hash routing, compress ratios), scoring, shapes the
        // attention can split, Engram keys. Configs read from a file have passed it already;
        // one built by hand is checked here.
        c.validate().map_err(ModelError::Config)?;
        let scoring = match c.scoring_func.as_str() {
            "sqrtsoftplus" => Scoring::SqrtSoftplus,
            "sigmoid" => Scoring::Sigmoid,
            "softmax" => Scoring::Softmax,
            s => {
                return Err(unsupported(
                    "scoring_func",
                    format!("`{s}` is not one of sqrtsoftplus, sigmoid, softmax"),
                ))
            }
        };
        let rs = c.rope_scaling.as_ref().and_then(|v| v.as_object());
        let get = |k: &str, d: f64| {
            rs.and_then(|m| m.get(k))
                .and_then(|v| v.as_f64())
                .unwrap_or(d)
        };
        let yarn = Yarn {
            factor: get("factor", 1.0),
            original_max: get(
                "original_max_position_embeddings",
                c.max_position_embeddings as f64,
            ),
            beta_fast: get("beta_fast", 32.0).trunc(),
            beta_slow: get("beta_slow", 1.0).trunc(),
        };
        let roles = (0..c.num_hidden_layers)
            .map(|l| LayerRoles {
                ratio: c.compress_ratio(l),
                kv_source: c.kv_source_layer_ids.contains(&l),
                index_source: c.index_source_layer_ids.contains(&l),
                candidate_source: c.candidate_source_layer_id == l as i64,
            })
            .collect();
        Ok(ModelConfig {
            raw: c.clone(),
            family,
            hash_layers: if family == Family::V4 {
                c.num_hash_layers
            } else {
                0
            },
            vocab: c.vocab_size,
            dim: c.hidden_size,
            n_layers: c.num_hidden_layers,
            heads: c.num_attention_heads,
            head_dim: c.head_dim,
            q_lora: c.q_lora_rank,
            rope_dim: c.qk_rope_head_dim,
            o_groups: c.o_groups,
            o_lora: c.o_lora_rank,
            inter: c.moe_intermediate_size,
            n_experts: c.max_experts_in_a_layer(),
            top_k: c.num_experts_per_tok,
            scoring,
            gate_temp: c.gate_temp as f32,
            norm_topk_prob: c.norm_topk_prob,
            route_scale: c.routed_scaling_factor as f32,
            swiglu_limit: c.swiglu_limit as f32,
            eps: c.rms_norm_eps as f32,
            window: c.sliding_window,
            index_heads: c.index_n_heads,
            index_head_dim: c.index_head_dim,
            index_topk: c.index_topk,
            candidate_topk_blocks: c.candidate_topk_blocks,
            candidate_block_size: c.candidate_block_size,
            rope_theta: c.rope_theta,
            compress_rope_theta: c.compress_rope_theta,
            yarn,
            hc: if family.is_hugging_face() {
                1
            } else {
                c.hc_mult
            },
            hc_iters: c.hc_sinkhorn_iters,
            hc_eps: c.hc_eps as f32,
            roles,
            engram: crate::engram_hash::EngramLayout::from_config(c)?,
            bos: match token_ids(&c.raw, "bos_token_id", c.vocab_size)?[..] {
                [] => DEFAULT_BOS,
                [id] => id,
                _ => {
                    return Err(unsupported(
                        "bos_token_id",
                        "a list: one beginning-of-sequence token is expected",
                    ))
                }
            },
            eos: token_ids(&c.raw, "eos_token_id", c.vocab_size)?,
        })
    }

    /// The RoPE of a layer's attention: YaRN over `compress_rope_theta` for a compressing layer,
    /// plain over `rope_theta` otherwise (as `Attention.__init__`).
    pub fn rope(&self, layer: usize) -> keep_kernels::ops::Rope {
        if self.roles[layer].ratio > 0 {
            keep_kernels::ops::Rope::yarn(
                self.rope_dim,
                self.compress_rope_theta,
                self.yarn.factor,
                self.yarn.original_max,
                self.yarn.beta_fast,
                self.yarn.beta_slow,
                0.0,
                0.0,
            )
        } else {
            keep_kernels::ops::Rope::plain(self.rope_dim, self.rope_theta)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn cfg(json: &str) -> Result<ModelConfig> {
        let c = DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap();
        ModelConfig::from_deepseek(&c)
    }

    #[test]
    fn refusals_name_their_keys() {
        // Config refusals are the config validation's (the one `keep inspect` runs too).
        for (json, key) in [
            (
                r#"{"num_hidden_layers":4,"engram_layer_ids":[1]}"#,
                "engram_num_embeddings",
            ),
            (r#"{"num_hash_layers":3}"#, "V4-Flash"),
            (
                r#"{"model_type":"deepseek_v4","num_hidden_layers":2,"compress_ratios":[0,2]}"#,
                "compress_ratios",
            ),
            (
                r#"{"model_type":"deepseek_v4","num_hidden_layers":2,"num_hash_layers":3}"#,
                "num_hash_layers",
            ),
            (r#"{"scoring_func":"relu"}"#, "scoring_func"),
            (r#"{"n_shared_experts":2}"#, "n_shared_experts"),
            (r#"{"o_groups":7}"#, "o_groups"),
        ] {
            let e = DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap_err();
            assert!(e.to_string().contains(key), "{json}: {e}");
        }
        let v4 = cfg(r#"{"model_type":"deepseek_v4","num_hash_layers":3,"num_hidden_layers":4}"#)
            .unwrap();
        assert_eq!((v4.family, v4.hash_layers), (Family::V4, 3));
        assert!(cfg("{}").is_ok());
        // A config built by hand, never read, is checked by the same validation.
        let mut c = DeepSeekConfig::from_json(Path::new("config.json"), "{}").unwrap();
        c.scoring_func = "relu".into();
        let e = ModelConfig::from_deepseek(&c).unwrap_err();
        assert!(e.to_string().contains("scoring_func"), "{e}");
    }

    #[test]
    fn bos_and_eos_come_from_the_config_or_the_stated_fallback() {
        let c = cfg("{}").unwrap();
        assert_eq!((c.bos, c.eos.as_slice()), (DEFAULT_BOS, &[][..]));
        let c = cfg(r#"{"bos_token_id":null,"eos_token_id":null}"#).unwrap();
        assert_eq!((c.bos, c.eos.as_slice()), (DEFAULT_BOS, &[][..]));
        let c = cfg(r#"{"bos_token_id":5,"eos_token_id":1}"#).unwrap();
        assert_eq!((c.bos, c.eos.as_slice()), (5, &[1][..]));
        let c = cfg(r#"{"eos_token_id":[1,7]}"#).unwrap();
        assert_eq!(c.eos, vec![1, 7]);
        for (json, key) in [
            (r#"{"eos_token_id":"</s>"}"#, "eos_token_id"),
            (r#"{"eos_token_id":-1}"#, "eos_token_id"),
            (r#"{"vocab_size":16,"eos_token_id":[1,16]}"#, "eos_token_id"),
            (r#"{"bos_token_id":1.5}"#, "bos_token_id"),
            (r#"{"bos_token_id":[0,1]}"#, "bos_token_id"),
        ] {
            let e = cfg(json).unwrap_err();
            assert!(e.to_string().contains(key), "{json}: {e}");
        }
    }
}
