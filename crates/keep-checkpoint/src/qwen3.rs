//! The Qwen3-MoE family (`model_type` `qwen3_moe`): its `config.json`, the map from its tensor
//! names to keep's roles, and the check of its tensors against the config, in one public place.
//!
//! Each part lives beside the module it belongs to, so that the crate's modules import one way:
//! the config and its role view in `config::qwen3` (see [`Qwen3MoeConfig`]), the names in
//! `naming::qwen3` (see [`parse`]), the tensor check in `layout::qwen3` (see
//! [`model_problems`]). This module re-exports all three and answers for the family
//! ([`Qwen3Moe`], its [`crate::family::Family`]).

pub use crate::config::qwen3::{Qwen3MoeConfig, MODEL_TYPE};
pub use crate::layout::qwen3::model_problems;
pub use crate::naming::qwen3::{
    expert_tensor, layer_prefix, mat_name, parse, stacked_tensor, EMBED, HEAD, NORM,
};

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::family::{own, Family};
use crate::layout::{named_expert_matrix, stacked_expert_matrix, ExpertMatrix};
use crate::naming::{ExpertMat, Scope};
use crate::DeepSeekConfig;

/// The Qwen3-MoE family ([`Family`]): Hugging Face's per-expert names or mlx-lm's stacked
/// `switch_mlp`, dense layers from `mlp_only_layers` / `decoder_sparse_step`.
#[derive(Debug, Clone, Copy)]
pub struct Qwen3Moe;

impl Family for Qwen3Moe {
    fn name(&self) -> &'static str {
        MODEL_TYPE
    }

    fn model_types(&self) -> &'static [&'static str] {
        &[MODEL_TYPE]
    }

    fn role_view(&self, flat: Value, raw: Value) -> Result<DeepSeekConfig, String> {
        Ok(Qwen3MoeConfig::from_value(flat)?.role_view(raw))
    }

    fn validate(&self, cfg: &DeepSeekConfig) -> Result<(), String> {
        own(&cfg.qwen3, cfg)?.validate()
    }

    fn model_problems(&self, ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
        match own(&cfg.qwen3, cfg) {
            Ok(q) => model_problems(ck, q),
            Err(e) => vec![e],
        }
    }

    fn is_moe_layer(&self, cfg: &DeepSeekConfig, layer: usize) -> bool {
        cfg.qwen3.as_ref().is_none_or(|q| q.is_moe_layer(layer))
    }

    fn experts_key(&self) -> &'static str {
        Qwen3MoeConfig::EXPERTS_KEY
    }

    fn expert_prefix(&self, scope: Scope, expert: usize) -> Option<String> {
        match scope {
            Scope::Layer(l) => Some(crate::naming::qwen3::expert_prefix(l, expert)),
            _ => None,
        }
    }

    fn expert_tensor(
        &self,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
        part: &str,
    ) -> Option<String> {
        Some(expert_tensor(layer, expert, mat, part))
    }

    /// The expert's own tensors, or its slices of mlx-lm's stacked `switch_mlp` (weight,
    /// `.scales` and `.biases` each sliced alike).
    fn expert_matrix<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
    ) -> Result<ExpertMatrix<'a>, String> {
        let stacked = stacked_tensor(layer, mat, "weight");
        if let Some(m) = stacked_expert_matrix(ck, &stacked, expert, cfg.experts_in_layer(layer))? {
            return Ok(m);
        }
        named_expert_matrix(ck, &expert_tensor(layer, expert, mat, "weight"))
    }

    fn tie_word_embeddings(&self, cfg: &DeepSeekConfig) -> bool {
        cfg.qwen3.as_ref().is_some_and(|q| q.tie_word_embeddings)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::naming::{ExpertMat, Part, Role, Scope};
    use crate::DeepSeekConfig;
    use serde_json::Value;
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
            // mlx-lm's stacked experts and MLX affine partners.
            for (part, want) in [
                ("weight", Part::Weight),
                ("scales", Part::Scale),
                ("biases", Part::Scale),
            ] {
                let n = parse(&stacked_tensor(4, m, part));
                assert_eq!(
                    (n.scope, &n.role, n.part),
                    (Scope::Layer(4), &Role::StackedExperts(m), want)
                );
                assert!(n.role.is_routed_expert());
            }
        }
        assert_eq!(
            stacked_tensor(0, ExpertMat::W2, "scales"),
            "model.layers.0.mlp.switch_mlp.down_proj.scales"
        );
        let r = parse("model.layers.3.mlp.gate.biases");
        assert_eq!((r.role, r.part), (Role::RouterWeight, Part::Scale));
        let e = parse("model.embed_tokens.scales");
        assert_eq!((e.role, e.part), (Role::Embedding, Part::Scale));
    }

    #[test]
    fn mlx_quantization_is_read_and_checked() {
        let mut v: Value = serde_json::from_str(TINY).unwrap();
        v["quantization"] = serde_json::json!({"group_size": 64, "bits": 4, "mode": "affine",
            "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}});
        let c = DeepSeekConfig::from_json(Path::new("config.json"), &v.to_string()).unwrap();
        assert!(c.qwen3.unwrap().quantization.is_some());
        for (q, want) in [
            (
                serde_json::json!({"group_size": 32, "bits": 4}),
                "group_size",
            ),
            (serde_json::json!({"group_size": 64, "bits": 5}), "bits"),
            (
                serde_json::json!({"group_size": 64, "bits": 4, "mode": "mxfp4"}),
                "mode",
            ),
            (
                serde_json::json!({"group_size": 64, "bits": 4,
                    "model.layers.0.mlp.gate": {"group_size": 128, "bits": 8}}),
                "model.layers.0.mlp.gate.group_size",
            ),
        ] {
            v["quantization"] = q;
            let e = DeepSeekConfig::from_json(Path::new("config.json"), &v.to_string())
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
    }
}
