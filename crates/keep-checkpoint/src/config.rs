//! `config.json` as DeepSeek publishes it, deserialised straight from the file.
//!
//! Defaults are mlx-lm 0.32.2's `deepseek_v41.ModelArgs` defaults, so that a key missing from a
//! file means the same here as in the reference. A nested `text_config` is flattened the way the
//! reference does. The untouched JSON is kept in [`DeepSeekConfig::raw`] so that writers (repack,
//! prune) change only the keys they mean to change.
//!
//! [`DeepSeekConfig`] is DeepSeek V4's own config and every family's role view: the family
//! that owns a file's `model_type` ([`crate::family::Family`], listed in
//! [`crate::families::FAMILIES`]) reads it, and the role view's family-dependent answers are
//! one call to [`DeepSeekConfig::family`].

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::naming;
use crate::{CheckpointError, Result};

pub mod deepseek_v3;
pub mod gpt_oss;
pub(crate) mod qwen3;

/// One routed expert matrix as `keep quant` codes it ([`DeepSeekConfig::coded_matrices`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CodedMatrix {
    /// Which of the expert's matrices (gpt-oss's gate-up matrix is `W1`, with no `W3`).
    pub mat: naming::ExpertMat,
    pub rows: usize,
    pub cols: usize,
    /// The coded tensors' base name (`{base}.weight`, `{base}.scale`, `{base}.resid.*`).
    pub base: String,
    /// The source tensors it is read from that the coded output drops once every matrix
    /// listing them is coded (its own weight and scale, or the layer's stack).
    pub replaces: Vec<String>,
}

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

/// The `model_type`s keep reads (V4-Flash and V4.1; mlx-lm's `deepseek_v4`/`deepseek_v41`).
pub const MODEL_TYPES: &[&str] = &["deepseek_v41", "deepseek_v4"];
/// Most routed experts per layer (route ids are stored as I16 in keep-routes files).
pub const MAX_EXPERTS: usize = 1 << 15;
/// Most sinkhorn iterations of the hyper-connections (the published models use 20).
pub const MAX_SINKHORN_ITERS: usize = 1000;
/// Largest compress ratio (the published models use 4 and 128).
pub const MAX_COMPRESS_RATIO: usize = 1 << 12;
/// Largest FP8 block side (the published models use 32 or 128).
pub const MAX_BLOCK: usize = 1 << 12;

/// The router scoring functions of the reference models.
pub const SCORING_FUNCS: &[&str] = &["sqrtsoftplus", "sigmoid", "softmax"];
/// Most Engram hash columns over all engram layers (`layers × (max_ngram − 1) × heads`).
pub const MAX_ENGRAM_COLUMNS: usize = 4096;
/// Largest Engram vocabulary / table size (the published tables hold ~2^23 rows a layer).
pub const MAX_ENGRAM_VOCAB: u64 = 1 << 40;

fn is_zero(v: &usize) -> bool {
    *v == 0
}

/// The DSpark drafter's keys with their defaults applied ([`DeepSeekConfig::dspark`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DSparkKeys {
    /// Draft positions per block (`dspark_block_size`).
    pub block_size: usize,
    /// Target layers read, in concatenation order (`dspark_target_layer_ids`).
    pub target_layer_ids: Vec<usize>,
    /// Token of the draft slots after the first (`dspark_noise_token_id`).
    pub noise_token_id: usize,
    /// Markov-head rank (`dspark_markov_rank`).
    pub markov_rank: usize,
    /// Routed experts per stage (`dspark_n_routed_experts`).
    pub n_routed_experts: usize,
    /// Experts per draft row (`dspark_num_experts_per_tok`).
    pub num_experts_per_tok: usize,
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
    /// The published `config.json` (and NeMo) call it `engram_pad_token_id`; the released
    /// inference code's arguments call it `engram_pad_id`. Either is read.
    #[serde(
        default = "d::engram_pad_id",
        rename = "engram_pad_token_id",
        alias = "engram_pad_id"
    )]
    pub engram_pad_id: usize,
    /// Engram: the size of the normalised token id space the hash runs over (0: `vocab_size`).
    #[serde(default)]
    pub engram_compressed_vocab_size: usize,
    /// Written by `keep prune` when hash-routed layers stay whole while others are pruned:
    /// the routed experts of each decoder layer (overrides `n_routed_experts` per layer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_routed_experts_per_layer: Option<Vec<usize>>,
    /// Written by `keep prune` when an MTP module (`mtp.N.*`) keeps a different number of
    /// routed experts than the decoder layers (its block has a router and experts of its own;
    /// a plan without `mtp_layers` leaves them whole): the routed experts of each module
    /// (overrides `n_routed_experts` for `mtp.N`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_routed_experts_mtp: Option<Vec<usize>>,
    /// V4-Flash: the first this-many layers are hash-routed (`gate.tid2eid`).
    #[serde(default)]
    pub num_hash_layers: usize,
    /// Multi-token-prediction layers stored under `mtp.N.*`.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    /// DSpark (V4.1's parallel drafter under `mtp.N.*`, docs/dspark.md): draft positions per
    /// block. Absent or 0 with no `dspark_target_layer_ids`: the `mtp.N.*` modules are not DSpark.
    /// The `dspark_*` keys are written only when set, so a config without them round-trips
    /// without them.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dspark_block_size: usize,
    /// DSpark: the target layers whose hidden states the drafter reads, in concatenation order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dspark_target_layer_ids: Vec<usize>,
    /// DSpark: the token whose embedding fills the draft slots after the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dspark_noise_token_id: Option<usize>,
    /// DSpark: rank of the Markov head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dspark_markov_rank: Option<usize>,
    /// DSpark: routed experts of each drafter stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dspark_n_routed_experts: Option<usize>,
    /// DSpark: experts chosen per draft row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dspark_num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
    /// A Qwen3-MoE checkpoint's own config (`model_type` `qwen3_moe`): this struct is then its
    /// role view (`qwen3::Qwen3MoeConfig::role_view`).
    #[serde(skip)]
    pub qwen3: Option<qwen3::Qwen3MoeConfig>,
    /// A DeepSeek-V3 checkpoint's own config (`model_type` `deepseek_v3`): this struct is then
    /// its role view (`deepseek_v3::DeepseekV3Config::role_view`).
    #[serde(skip)]
    pub deepseek_v3: Option<deepseek_v3::DeepseekV3Config>,
    /// A gpt-oss checkpoint's own config (`model_type` `gpt_oss`): this struct is then its role
    /// view (`gpt_oss::GptOssConfig::role_view`).
    #[serde(skip)]
    pub gpt_oss: Option<gpt_oss::GptOssConfig>,
    /// The file as read (after `text_config` flattening is *not* applied), for writers.
    #[serde(skip)]
    pub raw: Value,
}

impl DeepSeekConfig {
    /// DeepSeek V4 / V4.1's own config from `flat` (the file with `text_config` flattened),
    /// validated; `raw` is the file as read ([`crate::deepseek_v4::DeepSeekV4`]'s role view,
    /// which is the config itself).
    pub(crate) fn deepseek_v4_from_value(
        flat: Value,
        raw: Value,
    ) -> std::result::Result<DeepSeekConfig, String> {
        // The Engram pad id under both its names (the published key and the inference
        // argument): one value is read; two different values are refused.
        let mut flat = flat;
        if let Some(m) = flat.as_object_mut() {
            if let (Some(a), Some(b)) = (m.get("engram_pad_token_id"), m.get("engram_pad_id")) {
                if a != b {
                    return Err(format!(
                        "engram_pad_token_id = {a} and engram_pad_id = {b} disagree"
                    ));
                }
                m.remove("engram_pad_id");
            }
        }
        let mut cfg: DeepSeekConfig =
            serde_json::from_value(flat).map_err(|e| format!("unexpected value: {e}"))?;
        cfg.raw = raw;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parse a config from JSON text: the family that owns its `model_type`
    /// ([`crate::families::FAMILIES`]; DeepSeek V4 when none does) reads it into keep's roles.
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
        let model_type = flat
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or(MODEL_TYPES[0]);
        DeepSeekConfig::family_of(model_type)
            .role_view(flat, raw)
            .map_err(cerr)
    }

    /// Read `config.json` from a file.
    pub fn read(path: &Path) -> Result<DeepSeekConfig> {
        let text = crate::small_file::read_text(path, crate::small_file::MAX_SMALL_FILE)?;
        DeepSeekConfig::from_json(path, &text)
    }

    /// The one validation of a config, shared by every reader (`inspect`, `repack`, `prune`,
    /// the model's loader): the family's ([`crate::family::Family::validate`]).
    pub fn validate(&self) -> std::result::Result<(), String> {
        self.family().validate(self)
    }

    /// DeepSeek V4 / V4.1's validation: every number within the bounds a DeepSeek V4/V4.1
    /// model can have, and internal consistency that does not need the tensors. Bounds are far
    /// above any published model and far below what would make an allocation or a loop run
    /// away.
    pub(crate) fn validate_deepseek_v4(&self) -> std::result::Result<(), String> {
        if !MODEL_TYPES.contains(&self.model_type.as_str()) {
            return Err(format!(
                "model_type `{}` is not a DeepSeek V4 model ({})",
                self.model_type,
                MODEL_TYPES.join(", ")
            ));
        }
        for (key, v, lo, hi) in [
            ("vocab_size", self.vocab_size, 1, 1 << 24),
            ("hidden_size", self.hidden_size, 1, 1 << 16),
            ("num_hidden_layers", self.num_hidden_layers, 1, 1 << 10),
            ("num_attention_heads", self.num_attention_heads, 1, 1 << 10),
            ("head_dim", self.head_dim, 1, 1 << 12),
            ("q_lora_rank", self.q_lora_rank, 1, 1 << 16),
            ("o_lora_rank", self.o_lora_rank, 1, 1 << 16),
            ("o_groups", self.o_groups, 1, 1 << 10),
            (
                "moe_intermediate_size",
                self.moe_intermediate_size,
                1,
                1 << 18,
            ),
            ("n_routed_experts", self.n_routed_experts, 1, MAX_EXPERTS),
            ("sliding_window", self.sliding_window, 1, 1 << 20),
            ("index_n_heads", self.index_n_heads, 1, 1 << 10),
            ("index_head_dim", self.index_head_dim, 1, 1 << 12),
            ("index_topk", self.index_topk, 1, 1 << 20),
            (
                "candidate_topk_blocks",
                self.candidate_topk_blocks,
                1,
                1 << 20,
            ),
            (
                "candidate_block_size",
                self.candidate_block_size,
                1,
                1 << 12,
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1,
                1 << 24,
            ),
            ("hc_mult", self.hc_mult, 1, 64),
            (
                "hc_sinkhorn_iters",
                self.hc_sinkhorn_iters,
                1,
                MAX_SINKHORN_ITERS,
            ),
            ("num_hash_layers", self.num_hash_layers, 0, 1 << 10),
            (
                "num_nextn_predict_layers",
                self.num_nextn_predict_layers,
                0,
                64,
            ),
        ] {
            if v < lo || v > hi {
                return Err(format!("{key} = {v} must be in {lo}..={hi}"));
            }
        }
        for (key, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("hc_eps", self.hc_eps),
            ("rope_theta", self.rope_theta),
            ("compress_rope_theta", self.compress_rope_theta),
            ("gate_temp", self.gate_temp),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{key} = {v} must be a finite number > 0"));
            }
        }
        for (key, v) in [
            ("routed_scaling_factor", self.routed_scaling_factor),
            ("swiglu_limit", self.swiglu_limit),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{key} = {v} must be a finite number ≥ 0"));
            }
        }
        if let Some(r) = self
            .compress_ratios
            .iter()
            .find(|&&r| r != 0 && (!r.is_power_of_two() || r > MAX_COMPRESS_RATIO))
        {
            return Err(format!(
                "compress_ratios holds {r}: each must be 0 (window only) or a power of two up to {MAX_COMPRESS_RATIO}"
            ));
        }
        if let Some(q) = &self.quantization_config {
            match q.weight_block_size.as_deref() {
                None => {}
                Some([r, c]) if (1..=MAX_BLOCK).contains(r) && (1..=MAX_BLOCK).contains(c) => {}
                Some(b) => {
                    return Err(format!(
                        "quantization_config.weight_block_size = {b:?} must be two sizes in 1..={MAX_BLOCK}"
                    ))
                }
            }
        }
        if let Some(per) = &self.n_routed_experts_per_layer {
            if per.len() != self.num_hidden_layers {
                return Err(format!(
                    "n_routed_experts_per_layer has {} entries but num_hidden_layers is {}",
                    per.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(n) = per
                .iter()
                .find(|&&n| n < self.num_experts_per_tok || n > MAX_EXPERTS)
            {
                return Err(format!(
                    "n_routed_experts_per_layer holds {n}: each must be in num_experts_per_tok ({})..={MAX_EXPERTS}",
                    self.num_experts_per_tok
                ));
            }
        }
        if let Some(per) = &self.n_routed_experts_mtp {
            if per.len() != self.num_nextn_predict_layers {
                return Err(format!(
                    "n_routed_experts_mtp has {} entries but num_nextn_predict_layers is {}",
                    per.len(),
                    self.num_nextn_predict_layers
                ));
            }
            if let Some(n) = per
                .iter()
                .find(|&&n| n < self.num_experts_per_tok || n > MAX_EXPERTS)
            {
                return Err(format!(
                    "n_routed_experts_mtp holds {n}: each must be in num_experts_per_tok ({})..={MAX_EXPERTS}",
                    self.num_experts_per_tok
                ));
            }
        }
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
        self.validate_family()?;
        self.validate_engram()?;
        self.validate_dspark()?;
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

    /// What the attention, the router and each family need beyond bounds: V4.1 and V4 shapes
    /// the attention can split, a known `scoring_func`, one shared expert, hash routing only in
    /// V4 and only over existing layers, V4 compress ratios of 0 or at least 4.
    fn validate_family(&self) -> std::result::Result<(), String> {
        let v4 = self.model_type == "deepseek_v4";
        if !SCORING_FUNCS.contains(&self.scoring_func.as_str()) {
            return Err(format!(
                "scoring_func `{}` is not one of {}",
                self.scoring_func,
                SCORING_FUNCS.join(", ")
            ));
        }
        if !(self.num_attention_heads * self.head_dim).is_multiple_of(self.o_groups) {
            return Err(format!(
                "o_groups = {} does not divide num_attention_heads × head_dim ({} × {})",
                self.o_groups, self.num_attention_heads, self.head_dim
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2)
            || self.qk_rope_head_dim > self.head_dim
            || self.qk_rope_head_dim > self.index_head_dim
        {
            return Err(format!(
                "qk_rope_head_dim = {} must be even and at most head_dim ({}) and index_head_dim ({})",
                self.qk_rope_head_dim, self.head_dim, self.index_head_dim
            ));
        }
        if self.n_shared_experts != 1 {
            return Err(format!(
                "n_shared_experts = {}: DeepSeek V4 models have exactly one shared expert",
                self.n_shared_experts
            ));
        }
        if self.num_hash_layers > 0 && !v4 {
            return Err(format!(
                "num_hash_layers = {} in a `{}` config: hash routing (`ffn.gate.tid2eid`) is \
                 V4-Flash's; a V4-Flash checkpoint declares model_type `deepseek_v4`",
                self.num_hash_layers, self.model_type
            ));
        }
        if self.num_hash_layers > self.num_hidden_layers {
            return Err(format!(
                "num_hash_layers = {} but num_hidden_layers is {}",
                self.num_hash_layers, self.num_hidden_layers
            ));
        }
        if v4 {
            if let Some((l, r)) = (0..self.num_hidden_layers)
                .map(|l| (l, self.compress_ratio(l)))
                .find(|&(_, r)| (1..4).contains(&r))
            {
                return Err(format!(
                    "compress_ratios: layer {l} has ratio {r}; DeepSeek-V4 layers compress by 0 \
                     (window only), 4 (CSA) or more (HCA)"
                ));
            }
        }
        if self.candidate_source_layer_id < -1
            || self.candidate_source_layer_id >= self.num_hidden_layers as i64
        {
            return Err(format!(
                "candidate_source_layer_id = {} must be -1 (none) or a layer below num_hidden_layers ({})",
                self.candidate_source_layer_id, self.num_hidden_layers
            ));
        }
        Ok(())
    }

    /// DSpark keys, resolved: the drafter's shape when the config declares one (a block size or
    /// target layers), each absent key at the default of NeMo Automodel's
    /// `DeepseekV41TextConfig` (the followed copy, docs/dspark.md).
    pub fn dspark(&self) -> Option<DSparkKeys> {
        if self.dspark_block_size == 0 && self.dspark_target_layer_ids.is_empty() {
            return None;
        }
        Some(DSparkKeys {
            block_size: self.dspark_block_size,
            target_layer_ids: self.dspark_target_layer_ids.clone(),
            noise_token_id: self.dspark_noise_token_id.unwrap_or(128_799),
            markov_rank: self.dspark_markov_rank.unwrap_or(256),
            n_routed_experts: self.dspark_n_routed_experts.unwrap_or(128),
            num_experts_per_tok: self.dspark_num_experts_per_tok.unwrap_or(3),
        })
    }

    /// DSpark keys: stages to run, a block of 1..=64, target layers that exist (each once), a
    /// noise token inside the vocabulary, a bounded Markov rank, expert counts a router can
    /// hold, and window-only draft layers where `compress_ratios` lists them.
    fn validate_dspark(&self) -> std::result::Result<(), String> {
        let Some(k) = self.dspark() else {
            return Ok(());
        };
        if self.num_nextn_predict_layers == 0 {
            return Err(
                "dspark_* keys declare a DSpark drafter but num_nextn_predict_layers is 0 \
                 (its stages are the mtp.N.* modules)"
                    .into(),
            );
        }
        if !(1..=64).contains(&k.block_size) {
            return Err(format!(
                "dspark_block_size = {} must be in 1..=64",
                k.block_size
            ));
        }
        if k.target_layer_ids.is_empty() {
            return Err(
                "dspark_target_layer_ids is empty: DSpark reads at least one target layer".into(),
            );
        }
        if let Some(bad) = k
            .target_layer_ids
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            return Err(format!(
                "dspark_target_layer_ids names layer {bad} but num_hidden_layers is {}",
                self.num_hidden_layers
            ));
        }
        let mut seen = k.target_layer_ids.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != k.target_layer_ids.len() {
            return Err(format!(
                "dspark_target_layer_ids {:?} names a layer twice",
                k.target_layer_ids
            ));
        }
        if k.noise_token_id >= self.vocab_size {
            return Err(format!(
                "dspark_noise_token_id = {} must be below vocab_size ({})",
                k.noise_token_id, self.vocab_size
            ));
        }
        if !(1..=1 << 16).contains(&k.markov_rank) {
            return Err(format!(
                "dspark_markov_rank = {} must be in 1..=65536",
                k.markov_rank
            ));
        }
        if !(1..=MAX_EXPERTS).contains(&k.n_routed_experts) {
            return Err(format!(
                "dspark_n_routed_experts = {} must be in 1..={MAX_EXPERTS}",
                k.n_routed_experts
            ));
        }
        if k.num_experts_per_tok == 0 || k.num_experts_per_tok > k.n_routed_experts {
            return Err(format!(
                "dspark_num_experts_per_tok = {} must be in 1..=dspark_n_routed_experts ({})",
                k.num_experts_per_tok, k.n_routed_experts
            ));
        }
        let first = self.num_hidden_layers;
        if let Some(l) =
            (first..first + self.num_nextn_predict_layers).find(|&l| self.compress_ratio(l) != 0)
        {
            return Err(format!(
                "compress_ratios gives draft layer {l} (DSpark stage {}) ratio {}: DSpark stages \
                 attend over a window only (ratio 0)",
                l - first,
                self.compress_ratio(l)
            ));
        }
        Ok(())
    }

    /// Engram keys: one table size per engram layer, n-grams of size ≥ 2, heads and a row
    /// width, bounded hash columns and vocabularies, a pad id inside the vocabulary.
    fn validate_engram(&self) -> std::result::Result<(), String> {
        let n = self.engram_layer_ids.len();
        if n == 0 {
            return Ok(());
        }
        if self.engram_num_embeddings.len() != n {
            return Err(format!(
                "engram_num_embeddings has {} entries for {n} engram layers {:?}",
                self.engram_num_embeddings.len(),
                self.engram_layer_ids
            ));
        }
        let mut seen = self.engram_layer_ids.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != n {
            return Err(format!(
                "engram_layer_ids {:?} names a layer twice",
                self.engram_layer_ids
            ));
        }
        for (k, v, lo, hi) in [
            ("engram_max_ngram_size", self.engram_max_ngram_size, 2, 64),
            ("engram_n_heads", self.engram_n_heads, 1, MAX_ENGRAM_COLUMNS),
            ("engram_head_dim", self.engram_head_dim, 1, 1 << 16),
        ] {
            if v < lo || v > hi {
                return Err(format!(
                    "{k} = {v} must be in {lo}..={hi} (an engram layer needs n-grams of size ≥ 2, heads and a row width)"
                ));
            }
        }
        if (self.engram_max_ngram_size - 1)
            .saturating_mul(self.engram_n_heads)
            .saturating_mul(n)
            > MAX_ENGRAM_COLUMNS
        {
            return Err(format!(
                "engram_n_heads: {n} layers × {} n-gram sizes × {} heads is more than {MAX_ENGRAM_COLUMNS} hash columns",
                self.engram_max_ngram_size - 1,
                self.engram_n_heads
            ));
        }
        if !(2..=MAX_ENGRAM_VOCAB).contains(&self.engram_vocab_size) {
            return Err(format!(
                "engram_vocab_size = {} must be in 2..={MAX_ENGRAM_VOCAB} (the bucket primes start above it)",
                self.engram_vocab_size
            ));
        }
        if let Some(&r) = self
            .engram_num_embeddings
            .iter()
            .find(|&&r| r == 0 || r > MAX_ENGRAM_VOCAB)
        {
            return Err(format!(
                "engram_num_embeddings holds {r}: each must be in 1..={MAX_ENGRAM_VOCAB}"
            ));
        }
        if self.engram_compressed_vocab_size as u64 > MAX_ENGRAM_VOCAB {
            return Err(format!(
                "engram_compressed_vocab_size = {} is more than {MAX_ENGRAM_VOCAB}",
                self.engram_compressed_vocab_size
            ));
        }
        if self.engram_pad_id >= self.vocab_size {
            return Err(format!(
                "engram_pad_id = {} is outside the vocabulary ({})",
                self.engram_pad_id, self.vocab_size
            ));
        }
        Ok(())
    }

    /// Whether decoder layer `layer` has routed experts, as its family decides (Qwen3-MoE's
    /// `mlp_only_layers`, DeepSeek-V3's `first_k_dense_replace` dense layers hold a dense MLP
    /// instead; every layer of DeepSeek V4 and gpt-oss is routed).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.family().is_moe_layer(self, layer)
    }

    /// Whether this is a DeepSeek V4 / V4.1 config (no other family's config behind it): the
    /// keys only V4 has (`n_routed_experts_per_layer`, `n_routed_experts_mtp`) apply.
    pub fn is_deepseek_v4(&self) -> bool {
        self.family().is_deepseek_v4()
    }

    /// The `config.json` key that holds the routed-expert count, in the family's words (what
    /// `keep prune` rewrites).
    pub fn experts_key(&self) -> &'static str {
        self.family().experts_key()
    }

    /// The prefix of routed expert `expert`'s own tensors in `scope`, as the family names them
    /// (DeepSeek V4's `layers.N.ffn.experts.E.`, Hugging Face's
    /// `model.layers.N.mlp.experts.E.`); `None` where the family has no such scope (a Hugging
    /// Face family's MTP) or keeps its experts only stacked (gpt-oss).
    pub fn expert_prefix(&self, scope: naming::Scope, expert: usize) -> Option<String> {
        self.family().expert_prefix(scope, expert)
    }

    /// Tensor `part` (`weight`, `scale`, …) of matrix `mat` of routed expert `expert` of decoder
    /// layer `layer`, as the family names its per-expert tensors (DeepSeek V4's
    /// `layers.L.ffn.experts.E.w1.weight`, Hugging Face's `model.layers.L.mlp.experts.E.
    /// gate_proj.weight`); `None` for gpt-oss, whose experts are only stacked.
    pub fn expert_tensor(
        &self,
        layer: usize,
        expert: usize,
        mat: naming::ExpertMat,
        part: &str,
    ) -> Option<String> {
        self.family().expert_tensor(layer, expert, mat, part)
    }

    /// The matrices of routed expert `expert` of decoder layer `layer` that `keep quant` codes,
    /// as the family stores them: DeepSeek V4's `w1`/`w2`/`w3` and Hugging Face's per-expert
    /// `gate_proj`/`down_proj`/`up_proj` each under its own name (its weight and block scale
    /// replaced, [`per_expert_coded_matrices`]), gpt-oss's gate-up and down matrices
    /// (`gpt_oss::GptOssConfig::coded_matrices`: coded under per-expert names, replacing the
    /// layer's stacks once every expert of it is coded).
    pub fn coded_matrices(&self, layer: usize, expert: usize) -> Vec<CodedMatrix> {
        self.family().coded_matrices(self, layer, expert)
    }

    /// Whether decoder layer `layer` pruned to `survivors` (ascending ids; the rest removed,
    /// the survivors renumbered in order) leaves a router the family's own code runs exactly as
    /// it runs the original with the removed experts masked: DeepSeek-V3's group-limited router
    /// needs every group to keep the same number ([`deepseek_v3::DeepseekV3Config::
    /// check_survivors`]); every other family's router takes any survivors. The error says what
    /// to do.
    pub fn check_survivors(&self, survivors: &[usize]) -> std::result::Result<(), String> {
        self.family().check_survivors(self, survivors)
    }

    /// Routed experts in decoder layer `layer`.
    pub fn experts_in_layer(&self, layer: usize) -> usize {
        self.n_routed_experts_per_layer
            .as_ref()
            .and_then(|v| v.get(layer).copied())
            .unwrap_or(self.n_routed_experts)
    }

    /// The most routed experts of any decoder layer (`n_routed_experts` unless
    /// `n_routed_experts_per_layer` gives layers other counts): what a per-layer array of
    /// experts (route traces, REAP statistics, the runtime's expert store) is sized by.
    pub fn max_experts_in_a_layer(&self) -> usize {
        (0..self.num_hidden_layers)
            .map(|l| self.experts_in_layer(l))
            .max()
            .unwrap_or(self.n_routed_experts)
    }

    /// Routed experts in MTP module `mtp.N`: `n_routed_experts_mtp` where pruning left a count,
    /// else `dspark_n_routed_experts` when the modules are a DSpark drafter, else
    /// `n_routed_experts`.
    pub fn experts_in_mtp(&self, n: usize) -> usize {
        self.n_routed_experts_mtp
            .as_ref()
            .and_then(|v| v.get(n).copied())
            .or_else(|| self.dspark().map(|k| k.n_routed_experts))
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

/// The routed expert matrices `keep quant` codes where the family names each expert's own
/// matrices (DeepSeek V4, Qwen3-MoE, DeepSeek-V3): `w1`/`w2`/`w3` under their own names, each
/// replacing its weight and its block scale.
pub(crate) fn per_expert_coded_matrices(
    cfg: &DeepSeekConfig,
    layer: usize,
    expert: usize,
) -> Vec<CodedMatrix> {
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    naming::ExpertMat::ALL
        .into_iter()
        .filter_map(|mat| {
            let w = cfg.expert_tensor(layer, expert, mat, "weight")?;
            let base = w.strip_suffix(".weight")?.to_string();
            let (rows, cols) = match mat {
                naming::ExpertMat::W2 => (d, i),
                _ => (i, d),
            };
            // The source's block scale: V4's `.scale`, DeepSeek-V3's and Qwen's
            // `.weight_scale_inv`.
            let replaces = vec![
                w.clone(),
                format!("{base}.scale"),
                format!("{base}.weight_scale_inv"),
            ];
            Some(CodedMatrix {
                mat,
                rows,
                cols,
                base,
                replaces,
            })
        })
        .collect()
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
            r#"{"model_type":"deepseek_v4","text_config":{"hidden_size":64,"n_routed_experts":8,"num_experts_per_tok":2}}"#,
        )
        .unwrap();
        assert_eq!(c.hidden_size, 64);
        assert_eq!(c.model_type, "deepseek_v4");
        let raw = c.raw_with(&[("n_routed_experts", Value::from(4))]);
        assert_eq!(raw["text_config"]["n_routed_experts"], 4);
    }

    #[test]
    fn per_layer_expert_counts() {
        let j = |per: &str| {
            format!(
                r#"{{"model_type":"deepseek_v4","num_hidden_layers":3,"num_hash_layers":2,
                    "n_routed_experts":8,"num_experts_per_tok":4,
                    "n_routed_experts_per_layer":{per}}}"#
            )
        };
        let c = DeepSeekConfig::from_json(Path::new("c.json"), &j("[16, 16, 8]")).unwrap();
        let per: Vec<usize> = (0..3).map(|l| c.experts_in_layer(l)).collect();
        assert_eq!(per, [16, 16, 8]);
        assert_eq!(c.max_experts_in_a_layer(), 16);
        assert_eq!(c.experts_in_mtp(0), 8);
        let plain = DeepSeekConfig::from_json(Path::new("c.json"), "{}").unwrap();
        assert_eq!(plain.max_experts_in_a_layer(), plain.n_routed_experts);
        for bad in ["[16, 8]", "[16, 16, 2]"] {
            let e = DeepSeekConfig::from_json(Path::new("c.json"), &j(bad)).unwrap_err();
            assert!(e.to_string().contains("n_routed_experts_per_layer"), "{e}");
        }
    }

    #[test]
    fn dspark_keys_resolve_and_refuse_by_name() {
        let ok = r#"{"num_hidden_layers":4,"num_nextn_predict_layers":3,"vocab_size":50,
            "compress_ratios":[0,0,4,4,0,0,0],"dspark_block_size":5,
            "dspark_target_layer_ids":[1,3],"dspark_noise_token_id":49,"dspark_markov_rank":6}"#;
        let c = DeepSeekConfig::from_json(Path::new("c.json"), ok).unwrap();
        let k = c.dspark().unwrap();
        assert_eq!(
            (
                k.block_size,
                k.target_layer_ids.clone(),
                k.noise_token_id,
                k.markov_rank
            ),
            (5, vec![1, 3], 49, 6)
        );
        // Absent keys take NeMo's DeepseekV41TextConfig defaults.
        assert_eq!((k.n_routed_experts, k.num_experts_per_tok), (128, 3));
        let plain = DeepSeekConfig::from_json(Path::new("c.json"), "{}").unwrap();
        assert_eq!(plain.dspark(), None);
        // Written back only when set (a writer that serialises the struct adds no keys).
        let v = serde_json::to_value(&plain).unwrap();
        assert!(
            v.as_object()
                .unwrap()
                .keys()
                .all(|k| !k.starts_with("dspark")),
            "{v}"
        );
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["dspark_markov_rank"], 6);
        assert!(v.get("dspark_n_routed_experts").is_none());
        let with = |extra: &str| ok.replacen('{', &format!("{{{extra},"), 1);
        for (bad, key) in [
            (
                ok.replace(r#""dspark_block_size":5"#, r#""dspark_block_size":0"#),
                "dspark_block_size",
            ),
            (
                ok.replace(r#""dspark_block_size":5"#, r#""dspark_block_size":65"#),
                "dspark_block_size",
            ),
            (ok.replace("[1,3]", "[1,4]"), "dspark_target_layer_ids"),
            (ok.replace("[1,3]", "[3,3]"), "dspark_target_layer_ids"),
            (ok.replace("[1,3]", "[]"), "dspark_target_layer_ids"),
            (
                ok.replace(
                    r#""dspark_noise_token_id":49"#,
                    r#""dspark_noise_token_id":50"#,
                ),
                "dspark_noise_token_id",
            ),
            (
                ok.replace(r#""dspark_markov_rank":6"#, r#""dspark_markov_rank":0"#),
                "dspark_markov_rank",
            ),
            (
                with(r#""dspark_n_routed_experts":2"#),
                "dspark_num_experts_per_tok",
            ),
            (
                ok.replace("[0,0,4,4,0,0,0]", "[0,0,4,4,0,4,0]"),
                "compress_ratios",
            ),
            (
                ok.replace(
                    r#""num_nextn_predict_layers":3"#,
                    r#""num_nextn_predict_layers":0"#,
                ),
                "num_nextn_predict_layers",
            ),
        ] {
            let e = DeepSeekConfig::from_json(Path::new("c.json"), &bad).unwrap_err();
            assert!(e.to_string().contains(key), "{key}: {e}");
        }
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
        // Numbers out of bounds are refused naming the key, before anything is allocated.
        for (bad, key) in [
            (r#"{"model_type":"llama"}"#, "model_type"),
            (r#"{"sliding_window":0}"#, "sliding_window"),
            (r#"{"index_topk":0}"#, "index_topk"),
            (
                r#"{"max_position_embeddings":0}"#,
                "max_position_embeddings",
            ),
            (r#"{"n_routed_experts":4294967296}"#, "n_routed_experts"),
            (r#"{"hc_sinkhorn_iters":1000000000}"#, "hc_sinkhorn_iters"),
            (
                r#"{"num_hidden_layers":1,"compress_ratios":[3]}"#,
                "compress_ratios",
            ),
            (
                r#"{"num_hidden_layers":1,"compress_ratios":[2147483648]}"#,
                "compress_ratios",
            ),
            (
                r#"{"num_hidden_layers":1,"compress_ratios":[9223372036854775808]}"#,
                "compress_ratios",
            ),
            (r#"{"rms_norm_eps":0}"#, "rms_norm_eps"),
            (
                r#"{"quantization_config":{"weight_block_size":[0,0]}}"#,
                "weight_block_size",
            ),
            (
                r#"{"quantization_config":{"weight_block_size":[128]}}"#,
                "weight_block_size",
            ),
            // The family's rules and Engram keys: one validation for inspect and the loader.
            (r#"{"scoring_func":"relu"}"#, "scoring_func"),
            (r#"{"n_shared_experts":0}"#, "n_shared_experts"),
            (r#"{"o_groups":7}"#, "o_groups"),
            (r#"{"qk_rope_head_dim":63}"#, "qk_rope_head_dim"),
            (r#"{"num_hash_layers":3}"#, "num_hash_layers"),
            (
                r#"{"model_type":"deepseek_v4","num_hidden_layers":2,"num_hash_layers":3}"#,
                "num_hash_layers",
            ),
            (
                r#"{"model_type":"deepseek_v4","num_hidden_layers":2,"compress_ratios":[0,2]}"#,
                "compress_ratios",
            ),
            (
                r#"{"num_hidden_layers":2,"candidate_source_layer_id":2}"#,
                "candidate_source_layer_id",
            ),
            (
                r#"{"num_hidden_layers":2,"engram_layer_ids":[1]}"#,
                "engram_num_embeddings",
            ),
            (
                r#"{"num_hidden_layers":2,"engram_layer_ids":[1],"engram_num_embeddings":[9],"engram_max_ngram_size":1,"engram_n_heads":1,"engram_head_dim":32,"engram_vocab_size":5}"#,
                "engram_max_ngram_size",
            ),
            (
                r#"{"num_hidden_layers":2,"engram_layer_ids":[1],"engram_num_embeddings":[9],"engram_max_ngram_size":3,"engram_n_heads":1,"engram_head_dim":32,"engram_vocab_size":1}"#,
                "engram_vocab_size",
            ),
            (
                r#"{"num_hidden_layers":2,"vocab_size":10,"engram_layer_ids":[1],"engram_num_embeddings":[9],"engram_max_ngram_size":3,"engram_n_heads":1,"engram_head_dim":32,"engram_vocab_size":5,"engram_pad_id":10}"#,
                "engram_pad_id",
            ),
            (
                r#"{"num_hidden_layers":2,"vocab_size":10,"engram_layer_ids":[1],"engram_num_embeddings":[9],"engram_max_ngram_size":3,"engram_n_heads":1,"engram_head_dim":32,"engram_vocab_size":5,"engram_pad_id":2,"engram_compressed_vocab_size":2199023255553}"#,
                "engram_compressed_vocab_size",
            ),
        ] {
            let e = DeepSeekConfig::from_json(Path::new("c.json"), bad)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("c.json") && e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn engram_pad_reads_the_published_key_and_the_inference_argument() {
        for key in ["engram_pad_token_id", "engram_pad_id"] {
            let json = format!(r#"{{"num_hidden_layers":2,"vocab_size":10,"{key}":7}}"#);
            let c = DeepSeekConfig::from_json(Path::new("c.json"), &json).unwrap();
            assert_eq!(c.engram_pad_id, 7, "{key}");
        }
        // Both names: one value read, or refused when they disagree.
        let both =
            r#"{"num_hidden_layers":2,"vocab_size":10,"engram_pad_token_id":7,"engram_pad_id":7}"#;
        let c = DeepSeekConfig::from_json(Path::new("c.json"), both).unwrap();
        assert_eq!(c.engram_pad_id, 7);
        // Written under the published key.
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["engram_pad_token_id"], 7);
        assert!(v.get("engram_pad_id").is_none());
        let clash =
            r#"{"num_hidden_layers":2,"vocab_size":10,"engram_pad_token_id":7,"engram_pad_id":3}"#;
        let e = DeepSeekConfig::from_json(Path::new("c.json"), clash)
            .unwrap_err()
            .to_string();
        assert!(e.contains("disagree"), "{e}");
    }
}
