//! The DeepSeek-V3 family (`model_type` `deepseek_v3`: DeepSeek-V3, R1, V3.1, Moonshot's
//! Kimi-K2): its `config.json`, its role view, and the check of its tensors against it.
//!
//! The keys and their defaults are mlx-lm 0.32.2's `deepseek_v3.ModelArgs` (a key missing from a
//! file means the same here as there); transformers 5.23 writes `rope_parameters` (with
//! `rope_theta` inside) where DeepSeek's files have `rope_scaling`, and either is read.
//! [`DeepseekV3Config::role_view`] is the same model in keep's role terms (a [`DeepSeekConfig`]
//! whose sizes, router keys and `quantization_config` are this model's, with the family config
//! itself in [`DeepSeekConfig::deepseek_v3`]), so that stages working on roles read one kind of
//! config. Tensor names are Hugging Face's, as DeepSeek publishes them
//! (`model.layers.N.self_attn.q_a_proj.weight`, `model.layers.N.mlp.experts.E.gate_proj.weight`,
//! FP8 blocks in `*.weight_scale_inv`), the same routed-expert names as Qwen3-MoE's.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{DeepSeekConfig, MAX_EXPERTS};

/// The `model_type` of this family.
pub const MODEL_TYPE: &str = "deepseek_v3";

macro_rules! defaults {
    ($($name:ident: $t:ty = $v:expr;)*) => {
        $(pub(super) fn $name() -> $t { $v })*
    };
}

mod d {
    defaults! {
        vocab_size: usize = 102400;
        hidden_size: usize = 4096;
        intermediate_size: usize = 11008;
        moe_intermediate_size: usize = 1407;
        num_hidden_layers: usize = 30;
        num_attention_heads: usize = 32;
        one_f: f64 = 1.0;
        kv_lora_rank: usize = 512;
        q_lora_rank: Option<usize> = Some(1536);
        qk_rope_head_dim: usize = 64;
        v_head_dim: usize = 128;
        qk_nope_head_dim: usize = 128;
        topk_method: String = "noaux_tc".into();
        scoring_func: String = "sigmoid".into();
        t: bool = true;
        one: usize = 1;
        max_position_embeddings: usize = 2048;
        rms_norm_eps: f64 = 1e-6;
        rope_theta: f64 = 10000.0;
    }
}

/// `config.json` of a DeepSeek-V3 checkpoint (mlx-lm's `deepseek_v3.ModelArgs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    pub model_type: String,
    #[serde(default = "d::vocab_size")]
    pub vocab_size: usize,
    #[serde(default = "d::hidden_size")]
    pub hidden_size: usize,
    /// The dense MLP's width (the first `first_k_dense_replace` layers and those off
    /// `moe_layer_freq`).
    #[serde(default = "d::intermediate_size")]
    pub intermediate_size: usize,
    #[serde(default = "d::moe_intermediate_size")]
    pub moe_intermediate_size: usize,
    #[serde(default = "d::num_hidden_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d::num_attention_heads")]
    pub num_attention_heads: usize,
    /// Shared experts of an MoE layer: one SwiGLU of width `n × moe_intermediate_size`
    /// (absent or null: none).
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    pub n_routed_experts: usize,
    #[serde(default = "d::one_f")]
    pub routed_scaling_factor: f64,
    #[serde(default = "d::kv_lora_rank")]
    pub kv_lora_rank: usize,
    /// The rank of the query's low-rank projection (`q_a_proj` → `q_a_layernorm` → `q_b_proj`);
    /// null: one `q_proj`.
    #[serde(default = "d::q_lora_rank")]
    pub q_lora_rank: Option<usize>,
    #[serde(default = "d::qk_rope_head_dim")]
    pub qk_rope_head_dim: usize,
    #[serde(default = "d::v_head_dim")]
    pub v_head_dim: usize,
    #[serde(default = "d::qk_nope_head_dim")]
    pub qk_nope_head_dim: usize,
    #[serde(default = "d::topk_method")]
    pub topk_method: String,
    #[serde(default = "d::scoring_func")]
    pub scoring_func: String,
    #[serde(default = "d::t")]
    pub norm_topk_prob: bool,
    #[serde(default = "d::one")]
    pub n_group: usize,
    #[serde(default = "d::one")]
    pub topk_group: usize,
    #[serde(default = "d::one")]
    pub num_experts_per_tok: usize,
    #[serde(default = "d::one")]
    pub moe_layer_freq: usize,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default = "d::max_position_embeddings")]
    pub max_position_embeddings: usize,
    #[serde(default = "d::rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d::rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub quantization_config: Option<crate::config::QuantizationConfig>,
}

/// YaRN from `rope_scaling` (type `yarn`), with mlx-lm's `YarnRoPE` defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl Yarn {
    /// `0.1 · m · ln(factor) + 1` (1 when `factor` ≤ 1), the references' `yarn_get_mscale`.
    pub fn get_mscale(factor: f64, m: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    }
}

impl DeepseekV3Config {
    /// Parse the (already `text_config`-flattened) JSON object of a `deepseek_v3` config and
    /// validate it.
    pub fn from_value(mut v: Value) -> std::result::Result<DeepseekV3Config, String> {
        // transformers' `rope_parameters` (`rope_theta` inside) where the file has no
        // `rope_scaling`.
        if let Some(m) = v.as_object_mut() {
            if m.get("rope_scaling").is_none_or(Value::is_null) {
                if let Some(Value::Object(rp)) = m.get("rope_parameters").cloned() {
                    if let Some(theta) = rp.get("rope_theta") {
                        m.entry("rope_theta").or_insert(theta.clone());
                    }
                    let ty = rp
                        .get("rope_type")
                        .or_else(|| rp.get("type"))
                        .and_then(Value::as_str)
                        .unwrap_or("default");
                    if ty != "default" {
                        m.insert("rope_scaling".into(), Value::Object(rp));
                    }
                }
            }
        }
        let c: DeepseekV3Config =
            serde_json::from_value(v).map_err(|e| format!("deepseek_v3 config: {e}"))?;
        c.validate()?;
        Ok(c)
    }

    /// Every number within bounds far above any published model and far below what would make
    /// an allocation run away; the router's groups, the attention's options and the RoPE
    /// scaling the forward computes.
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
            (
                "moe_intermediate_size",
                self.moe_intermediate_size,
                1,
                1 << 18,
            ),
            ("num_attention_heads", self.num_attention_heads, 1, 1 << 10),
            ("n_routed_experts", self.n_routed_experts, 1, MAX_EXPERTS),
            (
                "n_shared_experts",
                self.n_shared_experts.unwrap_or(1),
                1,
                1 << 10,
            ),
            ("kv_lora_rank", self.kv_lora_rank, 1, 1 << 16),
            ("q_lora_rank", self.q_lora_rank.unwrap_or(1), 1, 1 << 16),
            ("qk_rope_head_dim", self.qk_rope_head_dim, 2, 1 << 12),
            ("qk_nope_head_dim", self.qk_nope_head_dim, 1, 1 << 12),
            ("v_head_dim", self.v_head_dim, 1, 1 << 12),
            ("n_group", self.n_group, 1, 1 << 10),
            ("topk_group", self.topk_group, 1, self.n_group),
            ("moe_layer_freq", self.moe_layer_freq, 1, 1 << 10),
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
            ("routed_scaling_factor", self.routed_scaling_factor),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{key} = {v} must be a finite number > 0"));
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "qk_rope_head_dim = {} must be even (RoPE rotates pairs)",
                self.qk_rope_head_dim
            ));
        }
        if self.topk_method != "noaux_tc" {
            return Err(format!(
                "topk_method = `{}`: keep runs DeepSeek-V3's `noaux_tc` router only",
                self.topk_method
            ));
        }
        if self.scoring_func != "sigmoid" {
            return Err(format!(
                "scoring_func = `{}`: keep runs DeepSeek-V3's `sigmoid` router only",
                self.scoring_func
            ));
        }
        if self.attention_bias {
            return Err(
                "attention_bias = true: keep runs DeepSeek-V3 attention without \
                        biases (every published model)"
                    .into(),
            );
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(format!(
                "n_group = {} does not divide n_routed_experts = {}",
                self.n_group, self.n_routed_experts
            ));
        }
        let per_group = self.n_routed_experts / self.n_group;
        if self.n_group > 1 && per_group < 2 {
            return Err(format!(
                "n_group = {} leaves {per_group} expert per group; a group's score is the sum \
                 of its top 2",
                self.n_group
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.topk_group * per_group {
            return Err(format!(
                "num_experts_per_tok = {} must be in 1..=topk_group × experts per group ({})",
                self.num_experts_per_tok,
                self.topk_group * per_group
            ));
        }
        self.yarn()?;
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

    /// The YaRN scaling of `rope_scaling` (`None`: plain RoPE, no `rope_scaling` or type
    /// `default`); any other type is refused.
    pub fn yarn(&self) -> std::result::Result<Option<Yarn>, String> {
        let Some(rs) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let m = rs
            .as_object()
            .ok_or_else(|| format!("rope_scaling = {rs} is not an object"))?;
        let ty = m
            .get("type")
            .or_else(|| m.get("rope_type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        match ty {
            "default" => return Ok(None),
            "yarn" | "deepseek_yarn" => {}
            t => {
                return Err(format!(
                    "rope_scaling type `{t}`: keep runs DeepSeek-V3 with YaRN or plain RoPE"
                ))
            }
        }
        let num = |k: &str, d: Option<f64>| -> std::result::Result<f64, String> {
            match m.get(k).filter(|v| !v.is_null()) {
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("rope_scaling.{k} = {v} is not a finite number")),
                None => d.ok_or_else(|| format!("rope_scaling (yarn) has no `{k}`")),
            }
        };
        let y = Yarn {
            factor: num("factor", None)?,
            original_max_position_embeddings: num("original_max_position_embeddings", None)?,
            beta_fast: num("beta_fast", Some(32.0))?,
            beta_slow: num("beta_slow", Some(1.0))?,
            mscale: num("mscale", Some(1.0))?,
            mscale_all_dim: num("mscale_all_dim", Some(0.0))?,
        };
        if !(y.factor > 0.0 && y.original_max_position_embeddings >= 1.0) {
            return Err(format!(
                "rope_scaling: factor = {} and original_max_position_embeddings = {} must be > 0",
                y.factor, y.original_max_position_embeddings
            ));
        }
        Ok(Some(y))
    }

    /// Whether decoder layer `layer` is an MoE block (else the dense MLP), as mlx-lm's
    /// `DeepseekV3DecoderLayer.__init__` and DeepSeek's own inference code decide.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq)
    }

    /// Whether pruning an MoE layer to `survivors` (ascending ids of `0..n_routed_experts`;
    /// the rest removed, the survivors renumbered in order) keeps the router what it was with
    /// the removed experts masked. With `n_group` > 1 the experts are `n_group` contiguous
    /// groups, ranked by the sum of their top 2: every group must keep the same number, at
    /// least 2, so that each renumbered expert stays in its group and `n_group` still divides
    /// the count; `n_group` and `topk_group` are then kept as they are, and
    /// `num_experts_per_tok` must fit in `topk_group` groups. Any other plan is refused: the
    /// publisher's code would accept fewer groups, but it would route differently from the
    /// masked original that calibration and selection scored.
    pub fn check_survivors(&self, survivors: &[usize]) -> std::result::Result<(), String> {
        if self.n_group <= 1 {
            return Ok(());
        }
        let per = self.n_routed_experts / self.n_group;
        let mut counts = vec![0usize; self.n_group];
        for &e in survivors {
            if let Some(c) = counts.get_mut(e / per) {
                *c += 1;
            }
        }
        let kept = counts[0];
        if counts.iter().any(|&c| c != kept) || kept < 2 {
            return Err(format!(
                "it keeps {counts:?} experts of the n_group = {} groups of {per}: DeepSeek-V3's \
                 router ranks groups of equal size by the sum of their top 2, so every group \
                 must keep the same number, at least 2; make the plan with `keep select \
                 --groups {}`",
                self.n_group, self.n_group
            ));
        }
        if self.num_experts_per_tok > self.topk_group * kept {
            return Err(format!(
                "it keeps {kept} experts per group, and num_experts_per_tok = {} does not fit \
                 in topk_group = {} groups of {kept}; keep more experts",
                self.num_experts_per_tok, self.topk_group
            ));
        }
        Ok(())
    }

    /// One query/key head: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
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
        c.head_dim = self.qk_head_dim();
        c.q_lora_rank = self.q_lora_rank.unwrap_or(0);
        c.qk_rope_head_dim = self.qk_rope_head_dim;
        c.moe_intermediate_size = self.moe_intermediate_size;
        c.n_routed_experts = self.n_routed_experts;
        c.n_shared_experts = self.n_shared_experts.unwrap_or(0);
        c.num_experts_per_tok = self.num_experts_per_tok;
        c.scoring_func = "sigmoid".into();
        c.norm_topk_prob = self.norm_topk_prob;
        c.routed_scaling_factor = self.routed_scaling_factor;
        c.rms_norm_eps = self.rms_norm_eps;
        c.rope_theta = self.rope_theta;
        c.rope_scaling = self.rope_scaling.clone();
        c.max_position_embeddings = self.max_position_embeddings;
        c.quantization_config = self.quantization_config.clone();
        c.deepseek_v3 = Some(self.clone());
        c.raw = raw;
        c
    }

    /// The FP8 block shape declared by `quantization_config`, if any.
    pub(crate) fn block_hint(&self) -> Option<(usize, usize)> {
        match self
            .quantization_config
            .as_ref()?
            .weight_block_size
            .as_deref()
        {
            Some([r, c]) => Some((*r, *c)),
            _ => None,
        }
    }
}

/// `model.layers.{layer}.` .
pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// The weight base names (without `.weight`) of the model-level tensors.
pub const EMBED: &str = "model.embed_tokens";
/// The untied head.
pub const HEAD: &str = "lm_head";
/// The final norm's weight.
pub const NORM: &str = "model.norm.weight";

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"model_type":"deepseek_v3","vocab_size":67,"hidden_size":33,
        "intermediate_size":41,"moe_intermediate_size":13,"num_hidden_layers":2,
        "num_attention_heads":2,"n_routed_experts":8,"n_shared_experts":1,"q_lora_rank":11,
        "kv_lora_rank":9,"qk_nope_head_dim":6,"qk_rope_head_dim":4,"v_head_dim":5,"n_group":2,
        "topk_group":1,"num_experts_per_tok":2,"first_k_dense_replace":1,
        "rope_parameters":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":64,
        "rope_theta":5000.0,"mscale":1.0,"mscale_all_dim":0.8}}"#;

    #[test]
    fn reads_a_config_and_its_role_view() {
        let v: Value = serde_json::from_str(TINY).unwrap();
        let c = DeepseekV3Config::from_value(v.clone()).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
        let y = c.yarn().unwrap().unwrap();
        assert_eq!((y.factor, y.mscale_all_dim, y.beta_fast), (4.0, 0.8, 32.0));
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1));
        let r = c.role_view(v);
        assert_eq!((r.n_routed_experts, r.head_dim, r.q_lora_rank), (8, 10, 11));
        assert!(r.validate().is_ok());
        let text = TINY.replace("\"n_group\":2", "\"n_group\":3");
        let e = DeepSeekConfig::from_json(std::path::Path::new("config.json"), &text).unwrap_err();
        assert!(e.to_string().contains("n_group"), "{e}");
    }

    #[test]
    fn pruning_keeps_the_router_groups_whole() {
        // 8 experts in 2 groups of 4, top-2 from 1 group.
        let c = DeepseekV3Config::from_value(serde_json::from_str(TINY).unwrap()).unwrap();
        assert!(c.check_survivors(&[0, 2, 5, 7]).is_ok());
        assert!(c.check_survivors(&(0..8).collect::<Vec<_>>()).is_ok());
        let e = c.check_survivors(&[0, 1, 2, 5]).unwrap_err();
        assert!(e.contains("[3, 1]") && e.contains("--groups 2"), "{e}");
        // One per group cannot be ranked by a top-2 sum.
        assert!(c.check_survivors(&[0, 4]).is_err());
        // Without groups any survivors do.
        let mut one = c.clone();
        one.n_group = 1;
        one.topk_group = 1;
        assert!(one.check_survivors(&[0, 1, 2]).is_ok());
    }

    #[test]
    fn refusals_name_their_keys() {
        for (from, to, key) in [
            ("\"topk_group\":1", "\"topk_group\":3", "topk_group"),
            (
                "\"qk_rope_head_dim\":4",
                "\"qk_rope_head_dim\":5",
                "qk_rope_head_dim",
            ),
            (
                "\"num_experts_per_tok\":2",
                "\"num_experts_per_tok\":5",
                "num_experts_per_tok",
            ),
            (
                "\"rope_type\":\"yarn\"",
                "\"rope_type\":\"longrope\"",
                "rope_scaling",
            ),
            (
                "\"n_group\":2",
                "\"n_group\":2,\"scoring_func\":\"softmax\"",
                "scoring_func",
            ),
        ] {
            let text = TINY.replace(from, to);
            assert_ne!(text, TINY);
            let e = DeepseekV3Config::from_value(serde_json::from_str(&text).unwrap()).unwrap_err();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
