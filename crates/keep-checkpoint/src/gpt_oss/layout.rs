//! The check of a gpt-oss checkpoint's tensors against its config (the family's part of
//! [`crate::layout::model_problems`]).

use crate::checkpoint::Checkpoint;
use crate::config::gpt_oss::{layer_prefix, GptOssConfig, Mxfp4Stack, Stack, EMBED, HEAD, NORM};
use crate::layout::{
    expert_slice, scale_of, vector_problem, weight_as, ExpertMatrix, MAX_PROBLEMS,
};
use crate::naming::ExpertMat;

/// Matrix `mat` of expert `expert` of `layer`: `W1` its `[2·intermediate, hidden]` slice of
/// the gate-up stack (gate and up rows interleaved), `W2` its slice of the down stack (blocks and
/// scales sliced alike, nothing copied), or the expert's own coded tensors where `keep quant`
/// wrote them (`Stack::coded_base`). gpt-oss has no `W3`: the up rows are in `W1`.
pub(crate) fn expert_matrix<'a>(
    ck: &'a Checkpoint,
    cfg: &GptOssConfig,
    layer: usize,
    expert: usize,
    mat: ExpertMat,
) -> Result<ExpertMatrix<'a>, String> {
    let s = match mat {
        ExpertMat::W1 => Stack::GateUp,
        ExpertMat::W2 => Stack::Down,
        ExpertMat::W3 => {
            return Err(format!(
                "layer {layer}, expert {expert}: gpt-oss has no separate up matrix (its up rows \
                 are interleaved with the gate's in gate_up_proj)"
            ))
        }
    };
    // An expert `keep quant` coded is read from its own tensors.
    let coded = format!("{}.weight", s.coded_base(layer, expert));
    if let Some(w) = ck.get(&coded) {
        return Ok(ExpertMatrix {
            weight: w,
            scale: scale_of(ck, &coded),
            biases: None,
            further: vec![],
        });
    }
    let st = Mxfp4Stack::open(ck, cfg, layer, s)?;
    Ok(ExpertMatrix {
        weight: expert_slice(st.blocks, expert, st.experts)?,
        scale: Some(expert_slice(st.scales, expert, st.experts)?),
        biases: None,
        further: vec![],
    })
}

/// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read:
/// embedding, head (unless tied), final norm, and per layer the two norms, the q/k/v/o
/// projections and their biases, the attention sinks, the router (weight and bias), and the
/// MXFP4 expert stacks with their biases. The dense weights may be bf16 or f32.
pub fn model_problems(ck: &Checkpoint, cfg: &GptOssConfig) -> Vec<String> {
    let mut out = vec![];
    let (d, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let (h, kv, e) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.num_local_experts,
    );
    let mat = |out: &mut Vec<String>, base: &str, r: usize, c: usize| {
        if let Err(e) = weight_as(ck, base, r, c, None) {
            out.push(e);
        }
    };
    mat(&mut out, EMBED, v, d);
    if !cfg.tie_word_embeddings {
        mat(&mut out, HEAD, v, d);
    }
    out.extend(vector_problem(ck, NORM, d));
    for l in 0..cfg.num_hidden_layers {
        if out.len() >= MAX_PROBLEMS {
            break;
        }
        let p = layer_prefix(l);
        for (n, r, c) in [
            ("self_attn.q_proj", h * hd, d),
            ("self_attn.k_proj", kv * hd, d),
            ("self_attn.v_proj", kv * hd, d),
            ("self_attn.o_proj", d, h * hd),
            ("mlp.router", e, d),
        ] {
            mat(&mut out, &format!("{p}{n}"), r, c);
            if cfg.attention_bias || n == "mlp.router" {
                out.extend(vector_problem(ck, &format!("{p}{n}.bias"), r));
            }
        }
        for (n, len) in [
            ("input_layernorm.weight", d),
            ("post_attention_layernorm.weight", d),
            ("self_attn.sinks", h),
        ] {
            out.extend(vector_problem(ck, &format!("{p}{n}"), len));
        }
        for s in [Stack::GateUp, Stack::Down] {
            // Experts `keep quant` coded have their own tensors; the rest are the stack's.
            let (r, c) = s.shape(cfg);
            let coded: Vec<String> = (0..e)
                .map(|x| s.coded_base(l, x))
                .filter(|b| ck.contains(&format!("{b}.weight")))
                .collect();
            if coded.len() < e {
                if let Err(m) = Mxfp4Stack::open(ck, cfg, l, s) {
                    out.push(m);
                }
            }
            for b in &coded {
                mat(&mut out, b, r, c);
            }
            out.extend(vector_problem(ck, &s.name(l, "_bias"), e * s.shape(cfg).0));
        }
    }
    out.truncate(MAX_PROBLEMS);
    out
}
