//! The check of a DeepSeek-V3 checkpoint's tensors against its config (the family's part of
//! [`crate::layout::model_problems`]).

use crate::checkpoint::Checkpoint;
use crate::config::deepseek_v3::{layer_prefix, DeepseekV3Config, EMBED, HEAD, NORM};
use crate::layout::{vector_problem, weight_as, MAX_PROBLEMS};

/// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read:
/// embedding, head (unless tied), final norm, and per layer the norms, the attention
/// projections, and the router (weight and `e_score_correction_bias`), shared experts and every
/// routed expert (MoE layers) or the dense MLP. Any projection may be bf16, f32 or FP8 blocks.
pub fn model_problems(ck: &Checkpoint, cfg: &DeepseekV3Config) -> Vec<String> {
    let mut out = vec![];
    let hint = cfg.block_hint();
    let (d, v, h) = (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads);
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
    let (kvl, rope, nope, vh) = (
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.qk_nope_head_dim,
        cfg.v_head_dim,
    );
    for l in 0..cfg.num_hidden_layers {
        if out.len() >= MAX_PROBLEMS {
            break;
        }
        let p = layer_prefix(l);
        let mut vecs = vec![
            ("input_layernorm.weight", d),
            ("post_attention_layernorm.weight", d),
            ("self_attn.kv_a_layernorm.weight", kvl),
        ];
        let mut mats = vec![
            ("self_attn.kv_a_proj_with_mqa", kvl + rope, d),
            ("self_attn.kv_b_proj", h * (nope + vh), kvl),
            ("self_attn.o_proj", d, h * vh),
        ];
        match cfg.q_lora_rank {
            Some(r) => {
                vecs.push(("self_attn.q_a_layernorm.weight", r));
                mats.push(("self_attn.q_a_proj", r, d));
                mats.push(("self_attn.q_b_proj", h * cfg.qk_head_dim(), r));
            }
            None => mats.push(("self_attn.q_proj", h * cfg.qk_head_dim(), d)),
        }
        for (n, len) in vecs {
            out.extend(vector_problem(ck, &format!("{p}{n}"), len));
        }
        for (n, r, c) in mats {
            mat(&mut out, &format!("{p}{n}"), r, c);
        }
        let swiglu = |out: &mut Vec<String>, base: &str, i: usize| {
            for (n, r, c) in [("gate_proj", i, d), ("up_proj", i, d), ("down_proj", d, i)] {
                mat(out, &format!("{base}.{n}"), r, c);
            }
        };
        if cfg.is_moe_layer(l) {
            let e = cfg.n_routed_experts;
            mat(&mut out, &format!("{p}mlp.gate"), e, d);
            out.extend(vector_problem(
                ck,
                &format!("{p}mlp.gate.e_score_correction_bias"),
                e,
            ));
            if let Some(n) = cfg.n_shared_experts {
                swiglu(
                    &mut out,
                    &format!("{p}mlp.shared_experts"),
                    n * cfg.moe_intermediate_size,
                );
            }
            for x in 0..e {
                if out.len() >= MAX_PROBLEMS {
                    break;
                }
                swiglu(
                    &mut out,
                    &format!("{p}mlp.experts.{x}"),
                    cfg.moe_intermediate_size,
                );
            }
        } else {
            swiglu(&mut out, &format!("{p}mlp"), cfg.intermediate_size);
        }
    }
    out.truncate(MAX_PROBLEMS);
    out
}
