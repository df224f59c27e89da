//! The Qwen3-MoE family's `config.json` (`model_type` `qwen3_moe`) and its role view; the family's
//! public face is [`crate::qwen3`], which re-exports this.
//!
//! The config keys and their meaning are mlx-lm 0.32.2's `qwen3_moe.ModelArgs` (every key
//! required there is required here; `rope_scaling` is optional and, as in the reference, not
//! used by the forward). [`Qwen3MoeConfig::role_view`] is the same model described in keep's role
//! terms (a [`DeepSeekConfig`] whose `hidden_size`, `num_hidden_layers`, `n_routed_experts`,
//! `moe_intermediate_size`, `num_experts_per_tok`, `scoring_func` (`softmax`), `norm_topk_prob`,
//! `vocab_size`, `max_position_embeddings` and `quantization_config` are this model's, with the
//! family config itself in [`DeepSeekConfig::qwen3`]), so that stages working on roles
//! (calibration, selection, residency, the runtime's budget) read one kind of config.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{DeepSeekConfig, MAX_EXPERTS};

/// The `model_type` of this family.
pub const MODEL_TYPE: &str = "qwen3_moe";

/// `config.json` of a Qwen3-MoE checkpoint (mlx-lm's `qwen3_moe.ModelArgs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// The dense MLP's width (layers in `mlp_only_layers` or off the sparse step).
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    /// A layer `l` is MoE when `(l + 1) % decoder_sparse_step == 0` and it is not listed in
    /// `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub moe_intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub quantization_config: Option<crate::config::QuantizationConfig>,
    /// mlx-lm's `quantization` (`{group_size, bits, mode}` and per-module overrides such as
    /// `"model.layers.0.mlp.gate": {group_size, bits}`), as `mlx_lm.convert --quantize`
    /// writes it; each weight's width is read from its own shapes, so only what the shapes
    /// cannot say is checked here (group 64, mode `affine`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<Value>,
}

/// The group size of MLX affine weights keep reads (mlx-lm's default).
pub const MLX_GROUP: u64 = 64;

/// Check an mlx-lm `quantization` entry (the top level or a per-module override).
fn check_mlx_quantization(key: &str, q: &Value) -> std::result::Result<(), String> {
    let Some(m) = q.as_object() else {
        // `false` marks a module left unquantized; anything else is not mlx-lm's.
        return match q {
            Value::Bool(_) => Ok(()),
            _ => Err(format!("{key} = {q} is neither an object nor a boolean")),
        };
    };
    if let Some(g) = m.get("group_size") {
        if g.as_u64() != Some(MLX_GROUP) {
            return Err(format!(
                "{key}.group_size = {g}: keep reads MLX affine weights in groups of {MLX_GROUP} \
                 (mlx_lm.convert's default; convert again with --q-group-size {MLX_GROUP})"
            ));
        }
    }
    if let Some(b) = m.get("bits") {
        if !matches!(b.as_u64(), Some(2 | 3 | 4 | 8)) {
            return Err(format!(
                "{key}.bits = {b}: MLX affine weights are 2, 3, 4 or 8 bits"
            ));
        }
    }
    if let Some(mode) = m.get("mode") {
        if mode.as_str() != Some("affine") {
            return Err(format!(
                "{key}.mode = {mode}: keep reads mlx-lm's `affine` quantization only"
            ));
        }
    }
    Ok(())
}

impl Qwen3MoeConfig {
    /// Parse the (already `text_config`-flattened) JSON object of a `qwen3_moe` config and
    /// validate it.
    pub fn from_value(v: Value) -> std::result::Result<Qwen3MoeConfig, String> {
        let c: Qwen3MoeConfig =
            serde_json::from_value(v).map_err(|e| format!("qwen3_moe config: {e}"))?;
        c.validate()?;
        Ok(c)
    }

    /// Every number within bounds far above any published model and far below what would make
    /// an allocation run away, and the attention's shapes consistent.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.model_type != MODEL_TYPE {
            return Err(format!(
                "model_type `{}` is not `{MODEL_TYPE}`",
                self.model_type
            ));
        }
        for (key, v, lo, hi) in [
            ("vocab_size", self.vocab_size, 1, 1 << 24),
            ("hidden_size", self.hidden_size, 1, 1 << 16),
            ("num_hidden_layers", self.num_hidden_layers, 1, 1 << 10),
            ("intermediate_size", self.intermediate_size, 1, 1 << 18),
            ("num_attention_heads", self.num_attention_heads, 1, 1 << 10),
            ("num_key_value_heads", self.num_key_value_heads, 1, 1 << 10),
            ("head_dim", self.head_dim, 2, 1 << 12),
            (
                "moe_intermediate_size",
                self.moe_intermediate_size,
                1,
                1 << 18,
            ),
            ("num_experts", self.num_experts, 1, MAX_EXPERTS),
            ("decoder_sparse_step", self.decoder_sparse_step, 1, 1 << 10),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                1,
                1 << 24,
            ),
        ] {
            if v < lo || v > hi {
                return Err(format!("{key} = {v} must be in {lo}..={hi}"));
            }
        }
        for (key, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{key} = {v} must be a finite number > 0"));
            }
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(format!(
                "num_experts_per_tok = {} must be in 1..=num_experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_key_value_heads = {} does not divide num_attention_heads = {}",
                self.num_key_value_heads, self.num_attention_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim = {} must be even (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        if let Some(bad) = self
            .mlp_only_layers
            .iter()
            .find(|&&l| l >= self.num_hidden_layers)
        {
            return Err(format!(
                "mlp_only_layers names layer {bad} but num_hidden_layers is {}",
                self.num_hidden_layers
            ));
        }
        if let Some(q) = &self.quantization {
            check_mlx_quantization("quantization", q)?;
            if let Some(m) = q.as_object() {
                for (k, v) in m.iter().filter(|(_, v)| v.is_object() || v.is_boolean()) {
                    check_mlx_quantization(&format!("quantization.{k}"), v)?;
                }
            }
        }
        if let Some(q) = &self.quantization_config {
            match q.weight_block_size.as_deref() {
                None => {}
                Some([r, c])
                    if (1..=crate::config::MAX_BLOCK).contains(r)
                        && (1..=crate::config::MAX_BLOCK).contains(c) => {}
                Some(b) => {
                    return Err(format!(
                        "quantization_config.weight_block_size = {b:?} must be two sizes in 1..={}",
                        crate::config::MAX_BLOCK
                    ))
                }
            }
        }
        Ok(())
    }

    /// Whether decoder layer `layer` is a sparse MoE block (else a dense MLP), as
    /// `Qwen3MoeDecoderLayer.__init__` decides.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The model in keep's role terms (see the module doc); `raw` is the file as read.
    pub fn role_view(&self, raw: Value) -> DeepSeekConfig {
        let mut c: DeepSeekConfig =
            serde_json::from_value(Value::Object(Default::default())).expect("all keys default");
        c.model_type = MODEL_TYPE.into();
        c.vocab_size = self.vocab_size;
        c.hidden_size = self.hidden_size;
        c.num_hidden_layers = self.num_hidden_layers;
        c.num_attention_heads = self.num_attention_heads;
        c.head_dim = self.head_dim;
        c.moe_intermediate_size = self.moe_intermediate_size;
        c.n_routed_experts = self.num_experts;
        c.n_shared_experts = 0;
        c.num_experts_per_tok = self.num_experts_per_tok;
        c.scoring_func = "softmax".into();
        c.norm_topk_prob = self.norm_topk_prob;
        c.routed_scaling_factor = 1.0;
        c.rms_norm_eps = self.rms_norm_eps;
        c.rope_theta = self.rope_theta;
        c.rope_scaling = self.rope_scaling.clone();
        c.max_position_embeddings = self.max_position_embeddings;
        c.quantization_config = self.quantization_config.clone();
        c.qwen3 = Some(self.clone());
        c.raw = raw;
        c
    }

    /// The config key that holds the routed-expert count (what `keep prune` rewrites).
    pub const EXPERTS_KEY: &'static str = "num_experts";
}
