//! The Qwen3-MoE family's tensor names (all of its renaming, in one place); the family's public
//! face is [`crate::qwen3`], which re-exports this.
//!
//! Names are Hugging Face's (`model.layers.N.mlp.experts.E.gate_proj.weight`, router
//! `mlp.gate.weight`; FP8 block scales `*.weight_scale_inv`) or mlx-lm's
//! (`mlx_lm.convert` stacks a layer's experts on a first axis of `num_experts` as
//! `model.layers.N.mlp.switch_mlp.{gate,up,down}_proj.weight`, and an MLX affine weight carries
//! `<base>.scales` and `<base>.biases`); [`parse`] turns them into keep's scope/role/part.

use crate::naming::{ExpertMat, Part, Role, Scope, TensorName, MLX_BIASES, MLX_SCALES};

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
    format!("{}{}.{part}", expert_prefix(layer, expert), mat_name(mat))
}

/// The prefix of routed expert `expert`'s tensors in `layer`
/// (`model.layers.{layer}.mlp.experts.{expert}.`).
pub fn expert_prefix(layer: usize, expert: usize) -> String {
    format!("model.layers.{layer}.mlp.experts.{expert}.")
}

/// `model.layers.{layer}.mlp.switch_mlp.{gate,down,up}_proj.{part}`: every routed expert's
/// matrix `mat` of `layer` stacked on a first axis of `num_experts`, as mlx-lm's `qwen3_moe`
/// (`SwitchGLU`) holds them and `mlx_lm.convert` writes them (`part`: `weight`, `scales`,
/// `biases`).
pub fn stacked_tensor(layer: usize, mat: ExpertMat, part: &str) -> String {
    format!(
        "model.layers.{layer}.mlp.switch_mlp.{}.{part}",
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
    } else if name.ends_with(".weight_scale_inv")
        || name.ends_with(".scale")
        || name.ends_with(MLX_SCALES)
        || name.ends_with(MLX_BIASES)
    {
        // MLX affine weights' `.scales` and `.biases` are their scale partners, as are the
        // per-row `.scale`s of the lattice codes `keep quant` writes.
        Part::Scale
    } else {
        Part::Other
    };
    let stem = name
        .strip_suffix(".weight_scale_inv")
        .or_else(|| name.strip_suffix(".weight"))
        .or_else(|| name.strip_suffix(".scale"))
        .or_else(|| name.strip_suffix(MLX_SCALES))
        .or_else(|| name.strip_suffix(MLX_BIASES))
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
    if let Some(mat) = rest.strip_prefix("mlp.switch_mlp.").and_then(mat_parse) {
        return Role::StackedExperts(mat);
    }
    if let Some(mat) = rest.strip_prefix("mlp.").and_then(mat_parse) {
        return Role::SharedExpert(mat);
    }
    Role::Unknown
}
