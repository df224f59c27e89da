//! The check of a Qwen3-MoE checkpoint's tensors against its config; the family's public face is
//! [`crate::qwen3`], which re-exports this.

use crate::checkpoint::Checkpoint;
use crate::config::qwen3::Qwen3MoeConfig;
use crate::naming::qwen3::{layer_prefix, mat_name, stacked_tensor, EMBED, HEAD, NORM};
use crate::naming::ExpertMat;

/// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read (the
/// family's part of [`crate::layout::model_problems`]): embedding, head (unless tied), final
/// norm, and per layer the norms, the attention projections, and the router and every routed
/// expert (MoE layers: one tensor per expert, or mlx-lm's `switch_mlp` stacks of
/// `[num_experts, rows, …]` with their `.scales`/`.biases` stacked alike) or the dense MLP.
/// Any of these may be MLX affine (`.scales` + `.biases`), as `mlx_lm.convert --quantize`
/// writes them.
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
            if ck.contains(&stacked_tensor(l, ExpertMat::W1, "weight")) {
                for (m, r, c) in [
                    (ExpertMat::W1, i, d),
                    (ExpertMat::W2, d, i),
                    (ExpertMat::W3, i, d),
                ] {
                    out.extend(stacked_problem(ck, l, m, cfg.num_experts, r, c));
                }
                continue;
            }
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

/// The stacked matrix `mat` of layer `layer` (`[n, rows, …]`, its scales and biases stacked
/// alike): every slice has the shape of the first, so the first is classified for all.
fn stacked_problem<'a>(
    ck: &'a Checkpoint,
    layer: usize,
    mat: ExpertMat,
    n: usize,
    rows: usize,
    cols: usize,
) -> Option<String> {
    use crate::layout::{biases_of, expert_matrix_as, expert_slice, scale_of, ExpertMatrix};
    let name = stacked_tensor(layer, mat, "weight");
    let Some(w) = ck.get(&name) else {
        return Some(format!("tensor `{name}` is missing"));
    };
    let part = |t: Option<crate::TensorRef<'a>>| t.map(|t| expert_slice(t, 0, n)).transpose();
    let m = (|| {
        Ok::<_, String>(ExpertMatrix {
            weight: expert_slice(w, 0, n)?,
            scale: part(scale_of(ck, &name))?,
            biases: part(biases_of(ck, &name))?,
            further: vec![],
        })
    })();
    m.and_then(|m| expert_matrix_as(&m, rows, cols, None)).err()
}
