//! The DeepSeek-V3 family's tensor names that Hugging Face's Qwen3-style naming does not cover:
//! multi-head latent attention (`self_attn.q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`,
//! `kv_b_proj`, their `q_a_layernorm` / `kv_a_layernorm`), the router's correction bias
//! (`mlp.gate.e_score_correction_bias`) and the shared experts (`mlp.shared_experts.*_proj`).
//! Routed experts, the router weight, the dense MLP, the layer norms and `o_proj` are named as
//! Qwen3-MoE names them ([`crate::naming::qwen3`]).

use crate::naming::{ExpertMat, Part, Role, Scope, TensorName};

/// The attention projections only multi-head latent attention has (`q_proj` and `o_proj` are
/// the Qwen3 names).
const MLA_PROJ: [&str; 4] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];

/// keep's scope, role and part of a DeepSeek-V3 tensor the Qwen3 naming does not know (`None`
/// for every other name).
pub fn parse_name(name: &str) -> Option<TensorName> {
    let rest = name.strip_prefix("model.layers.")?;
    let dot = rest.find('.')?;
    let layer = rest[..dot].parse::<usize>().ok()?;
    let rest = &rest[dot + 1..];
    if rest == "mlp.gate.e_score_correction_bias" {
        return Some(TensorName {
            scope: Scope::Layer(layer),
            role: Role::RouterBias,
            part: Part::Other,
        });
    }
    let (stem, part) = if let Some(s) = rest.strip_suffix(".weight_scale_inv") {
        (s, Part::Scale)
    } else if let Some(s) = rest.strip_suffix(".weight") {
        (s, Part::Weight)
    } else {
        return None;
    };
    let role = if let Some(p) = stem.strip_prefix("self_attn.") {
        match p {
            "q_a_layernorm" | "kv_a_layernorm" => Role::Norm,
            p if MLA_PROJ.contains(&p) => Role::AttnProj(p.to_string()),
            _ => return None,
        }
    } else {
        let m = stem.strip_prefix("mlp.shared_experts.")?;
        Role::SharedExpert(
            ExpertMat::ALL
                .into_iter()
                .find(|&x| crate::naming::qwen3::mat_name(x) == m)?,
        )
    };
    Some(TensorName {
        scope: Scope::Layer(layer),
        role,
        part,
    })
}
