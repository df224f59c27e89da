//! The Qwen3-MoE family (`model_type` `qwen3_moe`): its `config.json`, the map from its tensor
//! names to keep's roles (all of its renaming, in one place), and the check of its tensors
//! against the config.
//!
//! The config keys and their meaning are mlx-lm 0.32.2's `qwen3_moe.ModelArgs` (every key
//! required there is required here; `rope_scaling` is optional and, as in the reference, not
//! used by the forward). [`Qwen3MoeConfig::role_view`] is the same model described in keep's role
//! terms (a [`DeepSeekConfig`] whose `hidden_size`, `num_hidden_layers`, `n_routed_experts`,
//! `moe_intermediate_size`, `num_experts_per_tok`, `scoring_func` (`softmax`), `norm_topk_prob`,
//! `vocab_size`, `max_position_embeddings` and `quantization_config` are this model's, with the
//! family config itself in [`DeepSeekConfig::qwen3`]), so that stages working on roles
//! (calibration, selection, residency, the runtime's budget) read one kind of config. Names are
//! Hugging Face's (`model.layers.N.mlp.experts.E.gate_proj.weight`, router `mlp.gate.weight`;
//! FP8 block scales `*.weight_scale_inv`); [`parse`] turns them into keep's scope/role/part.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::config::{DeepSeekConfig, MAX_EXPERTS};
use crate::naming::{ExpertMat, Part, Role, Scope, TensorName};

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

/// Hugging Face's name of an expert matrix (`gate_proj`, `down_proj`, `up_proj`).
pub fn mat_name(mat: ExpertMat) -> &'static str {
    match mat {
        ExpertMat::W1 => "gate_proj",
        ExpertMat::W2 => "down_proj",
        ExpertMat::W3 => "up_proj",
    }
}

fn mat_parse(s: &str) -> Option<ExpertMat> {
    ExpertMat::ALL.into_iter().find(|&m| mat_name(m) == s)
}

/// `model.layers.{layer}.` .
pub fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}.")
}

/// `model.layers.{layer}.mlp.experts.{expert}.{gate,down,up}_proj.{part}` (`part`: `weight`
/// or `weight_scale_inv`).
pub fn expert_tensor(layer: usize, expert: usize, mat: ExpertMat, part: &str) -> String {
    format!(
        "model.layers.{layer}.mlp.experts.{expert}.{}.{part}",
        mat_name(mat)
    )
}

/// The weight base names (without `.weight`) of the model-level tensors.
pub const EMBED: &str = "model.embed_tokens";
/// The untied head (`lm_head.weight`; a tied model multiplies by the embedding).
pub const HEAD: &str = "lm_head";
/// The final norm's weight.
pub const NORM: &str = "model.norm.weight";

/// Parse a Qwen3-MoE tensor name into keep's scope, role and part (never fails: unrecognised
/// names get [`Role::Unknown`]). A dense MLP (`mlp.{gate,up,down}_proj` of a layer in
/// `mlp_only_layers`) is the layer's always-on FFN, [`Role::SharedExpert`].
pub fn parse(name: &str) -> TensorName {
    let part = if name.ends_with(".weight") {
        Part::Weight
    } else if name.ends_with(".weight_scale_inv") {
        Part::Scale
    } else {
        Part::Other
    };
    let stem = name
        .strip_suffix(".weight_scale_inv")
        .or_else(|| name.strip_suffix(".weight"))
        .unwrap_or(name);
    let layer = stem.strip_prefix("model.layers.").and_then(|r| {
        let dot = r.find('.')?;
        Some((r[..dot].parse::<usize>().ok()?, &r[dot + 1..]))
    });
    let (scope, role) = match layer {
        None => (
            Scope::Model,
            match stem {
                "model.embed_tokens" => Role::Embedding,
                "lm_head" => Role::Head,
                "model.norm" => Role::Norm,
                _ => Role::Unknown,
            },
        ),
        Some((l, rest)) => (Scope::Layer(l), layer_role(rest)),
    };
    TensorName { scope, role, part }
}

fn layer_role(rest: &str) -> Role {
    match rest {
        "input_layernorm"
        | "post_attention_layernorm"
        | "self_attn.q_norm"
        | "self_attn.k_norm" => return Role::Norm,
        "mlp.gate" => return Role::RouterWeight,
        _ => {}
    }
    if let Some(p) = rest.strip_prefix("self_attn.") {
        if matches!(p, "q_proj" | "k_proj" | "v_proj" | "o_proj") {
            return Role::AttnProj(p.to_string());
        }
    }
    if let Some(e) = rest.strip_prefix("mlp.experts.") {
        let mut it = e.split('.');
        if let (Some(idx), Some(w), None) = (it.next(), it.next(), it.next()) {
            if let (Ok(expert), Some(mat)) = (idx.parse(), mat_parse(w)) {
                return Role::RoutedExpert { expert, mat };
            }
        }
    }
    if let Some(mat) = rest.strip_prefix("mlp.").and_then(mat_parse) {
        return Role::SharedExpert(mat);
    }
    Role::Unknown
}

/// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read (the
/// family's part of [`crate::layout::model_problems`]): embedding, head (unless tied), final
/// norm, and per layer the norms, the attention projections, and the router and every routed
/// expert (MoE layers) or the dense MLP.
pub fn model_problems(ck: &Checkpoint, cfg: &Qwen3MoeConfig) -> Vec<String> {
    use crate::layout::{vector_problem, weight_as, MAX_PROBLEMS};
    let mut out = vec![];
    let hint =
        cfg.quantization_config
            .as_ref()
            .and_then(|q| match q.weight_block_size.as_deref() {
                Some([r, c]) => Some((*r, *c)),
                _ => None,
            });
    let (d, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let mat = |out: &mut Vec<String>, base: &str, r: usize, c: usize| {
        if let Err(e) = weight_as(ck, base, r, c, hint) {
            out.push(e);
        }
    };
    mat(&mut out, EMBED, v, d);
    if !cfg.tie_word_embeddings {
        mat(&mut out, HEAD, v, d);
    }
    out.extend(vector_problem(ck, NORM, d));
    let (h, kv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    for l in 0..cfg.num_hidden_layers {
        if out.len() >= MAX_PROBLEMS {
            break;
        }
        let p = layer_prefix(l);
        for (n, len) in [
            ("input_layernorm.weight", d),
            ("post_attention_layernorm.weight", d),
            ("self_attn.q_norm.weight", hd),
            ("self_attn.k_norm.weight", hd),
        ] {
            out.extend(vector_problem(ck, &format!("{p}{n}"), len));
        }
        for (n, r, c) in [
            ("self_attn.q_proj", h * hd, d),
            ("self_attn.k_proj", kv * hd, d),
            ("self_attn.v_proj", kv * hd, d),
            ("self_attn.o_proj", d, h * hd),
        ] {
            mat(&mut out, &format!("{p}{n}"), r, c);
        }
        if cfg.is_moe_layer(l) {
            mat(&mut out, &format!("{p}mlp.gate"), cfg.num_experts, d);
            let i = cfg.moe_intermediate_size;
            for e in 0..cfg.num_experts {
                if out.len() >= MAX_PROBLEMS {
                    break;
                }
                for (m, r, c) in [
                    (ExpertMat::W1, i, d),
                    (ExpertMat::W2, d, i),
                    (ExpertMat::W3, i, d),
                ] {
                    let base = format!("{p}mlp.experts.{e}.{}", mat_name(m));
                    mat(&mut out, &base, r, c);
                }
            }
        } else {
            let i = cfg.intermediate_size;
            for (m, r, c) in [
                (ExpertMat::W1, i, d),
                (ExpertMat::W2, d, i),
                (ExpertMat::W3, i, d),
            ] {
                mat(&mut out, &format!("{p}mlp.{}", mat_name(m)), r, c);
            }
        }
    }
    out.truncate(MAX_PROBLEMS);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    pub(crate) const TINY: &str = r#"{"model_type":"qwen3_moe","hidden_size":64,
        "num_hidden_layers":3,"intermediate_size":96,"num_attention_heads":4,"num_experts":8,
        "num_experts_per_tok":2,"decoder_sparse_step":1,"mlp_only_layers":[1],
        "moe_intermediate_size":32,"rms_norm_eps":1e-6,"vocab_size":256,"num_key_value_heads":2,
        "head_dim":16,"rope_theta":1000000.0,"tie_word_embeddings":false,
        "max_position_embeddings":4096,"norm_topk_prob":true,"bos_token_id":1,"eos_token_id":2}"#;

    #[test]
    fn config_is_read_as_its_family_and_its_role_view() {
        let c = DeepSeekConfig::from_json(Path::new("config.json"), TINY).unwrap();
        let q = c.qwen3.as_ref().unwrap();
        assert_eq!(c.model_type, MODEL_TYPE);
        assert_eq!((c.n_routed_experts, c.num_experts_per_tok), (8, 2));
        assert_eq!((c.hidden_size, c.moe_intermediate_size), (64, 32));
        assert_eq!(
            (c.scoring_func.as_str(), c.n_shared_experts),
            ("softmax", 0)
        );
        assert!(c.validate().is_ok());
        assert!(q.is_moe_layer(0) && !q.is_moe_layer(1) && q.is_moe_layer(2));
        // Nested under `text_config` as some exports write it.
        let nested = format!(r#"{{"model_type":"qwen3_moe","text_config":{TINY}}}"#);
        let n = DeepSeekConfig::from_json(Path::new("config.json"), &nested).unwrap();
        assert_eq!(n.qwen3, c.qwen3);
    }

    #[test]
    fn bad_configs_name_their_keys() {
        let tiny: Value = serde_json::from_str(TINY).unwrap();
        for (key, val, want) in [
            ("num_key_value_heads", Value::from(3), "num_key_value_heads"),
            ("num_experts_per_tok", Value::from(9), "num_experts_per_tok"),
            ("head_dim", Value::from(15), "head_dim"),
            ("mlp_only_layers", serde_json::json!([3]), "mlp_only_layers"),
            ("decoder_sparse_step", Value::from(0), "decoder_sparse_step"),
            ("rms_norm_eps", Value::from(-1.0), "rms_norm_eps"),
            ("num_experts", Value::Null, "missing field `num_experts`"),
        ] {
            let mut v = tiny.clone();
            if val.is_null() {
                v.as_object_mut().unwrap().remove(key);
            } else {
                v[key] = val;
            }
            let e = DeepSeekConfig::from_json(Path::new("config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{key}: {e}");
        }
        // A role view without its family config is refused by the one validation.
        let mut c = DeepSeekConfig::from_json(Path::new("config.json"), TINY).unwrap();
        c.qwen3 = None;
        assert!(c.validate().unwrap_err().contains(MODEL_TYPE));
    }

    #[test]
    fn names_map_to_roles() {
        let cases = [
            ("model.embed_tokens.weight", Scope::Model, Role::Embedding),
            ("lm_head.weight", Scope::Model, Role::Head),
            ("model.norm.weight", Scope::Model, Role::Norm),
            (
                "model.layers.3.self_attn.k_norm.weight",
                Scope::Layer(3),
                Role::Norm,
            ),
            (
                "model.layers.0.self_attn.o_proj.weight",
                Scope::Layer(0),
                Role::AttnProj("o_proj".into()),
            ),
            (
                "model.layers.7.mlp.gate.weight",
                Scope::Layer(7),
                Role::RouterWeight,
            ),
            (
                "model.layers.2.mlp.experts.17.up_proj.weight",
                Scope::Layer(2),
                Role::RoutedExpert {
                    expert: 17,
                    mat: ExpertMat::W3,
                },
            ),
            (
                "model.layers.1.mlp.down_proj.weight",
                Scope::Layer(1),
                Role::SharedExpert(ExpertMat::W2),
            ),
            (
                "model.layers.1.mlp.bogus.weight",
                Scope::Layer(1),
                Role::Unknown,
            ),
        ];
        for (name, scope, role) in cases {
            let n = parse(name);
            assert_eq!(
                (n.scope, &n.role, n.part),
                (scope, &role, Part::Weight),
                "{name}"
            );
        }
        let s = parse("model.layers.2.mlp.experts.5.gate_proj.weight_scale_inv");
        assert_eq!(s.part, Part::Scale);
        assert_eq!(
            expert_tensor(2, 5, ExpertMat::W1, "weight_scale_inv"),
            "model.layers.2.mlp.experts.5.gate_proj.weight_scale_inv"
        );
        for m in ExpertMat::ALL {
            let n = parse(&expert_tensor(4, 9, m, "weight"));
            assert_eq!(n.role, Role::RoutedExpert { expert: 9, mat: m });
        }
    }
}
