//! The gpt-oss family's tensor names that Hugging Face's Qwen3-style naming does not cover: the
//! attention sinks and projection biases, the router and its bias, and the MXFP4 expert stacks
//! (`*_blocks` / `*_scales`). The family's config and layout (`crate::config::gpt_oss`) re-export
//! them.

use crate::naming::{ExpertMat, Part, Role, Scope, TensorName};

/// How an expert stack's packed FP4 tensor's name ends (the stacked MXFP4 naming).
pub use crate::naming::MXFP4_BLOCKS as BLOCKS;
/// How an expert stack's E8M0 scale tensor's name ends.
pub use crate::naming::MXFP4_SCALES as SCALES;

/// keep's scope, role and part of a gpt-oss tensor the Hugging Face naming does not know
/// (`None` for every other name): the attention sinks and projection biases, the router and
/// its bias, and the expert stacks (`gate_up_proj_*` as the gate matrix's stack, `down_proj_*`
/// the down matrix's; `_blocks` the weight, `_scales` its scale, `_bias` other).
pub fn parse_name(name: &str) -> Option<TensorName> {
    let rest = name.strip_prefix("model.layers.")?;
    let dot = rest.find('.')?;
    let layer = rest[..dot].parse::<usize>().ok()?;
    let rest = &rest[dot + 1..];
    let (role, part) = match rest {
        "self_attn.sinks" => (Role::AttnSink, Part::Other),
        "mlp.router.weight" => (Role::RouterWeight, Part::Weight),
        "mlp.router.bias" => (Role::RouterBias, Part::Other),
        _ => {
            if let Some(p) = rest
                .strip_prefix("self_attn.")
                .and_then(|r| r.strip_suffix(".bias"))
                .filter(|p| matches!(*p, "q_proj" | "k_proj" | "v_proj" | "o_proj"))
            {
                (Role::AttnProj(p.to_string()), Part::Other)
            } else {
                let e = rest.strip_prefix("mlp.experts.")?;
                if let Some(n) = coded_expert(layer, e) {
                    return Some(n);
                }
                let (stem, part) = [
                    (BLOCKS, Part::Weight),
                    (SCALES, Part::Scale),
                    ("_bias", Part::Other),
                ]
                .into_iter()
                .find_map(|(suffix, part)| Some((e.strip_suffix(suffix)?, part)))?;
                let mat = match stem {
                    "gate_up_proj" => ExpertMat::W1,
                    "down_proj" => ExpertMat::W2,
                    _ => return None,
                };
                (Role::StackedExperts(mat), part)
            }
        }
    };
    Some(TensorName {
        scope: Scope::Layer(layer),
        role,
        part,
    })
}

/// An expert matrix `keep quant` coded under its own name (`mlp.experts.{E}.{gate_up_proj|
/// down_proj}.{weight|scale|resid.weight|resid.scale}`, `rest` after `mlp.experts.`).
fn coded_expert(layer: usize, rest: &str) -> Option<TensorName> {
    let dot = rest.find('.')?;
    let expert = rest[..dot].parse::<usize>().ok()?;
    let rest = &rest[dot + 1..];
    let dot = rest.find('.')?;
    let mat = match &rest[..dot] {
        "gate_up_proj" => ExpertMat::W1,
        "down_proj" => ExpertMat::W2,
        _ => return None,
    };
    let part = match &rest[dot + 1..] {
        "weight" => Part::Weight,
        "scale" => Part::Scale,
        "resid.weight" | "resid.scale" => Part::Other,
        _ => return None,
    };
    Some(TensorName {
        scope: Scope::Layer(layer),
        role: Role::RoutedExpert { expert, mat },
        part,
    })
}
