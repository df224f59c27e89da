//! The DeepSeek-V3 decoder layer (`Family::DeepseekV3`, `model_type` `deepseek_v3`: DeepSeek-V3,
//! R1, V3.1, Kimi-K2), following transformers 5.23's `modeling_deepseek_v3.py` and mlx-lm
//! 0.32.2's `deepseek_v3.py` operation by operation: `input_layernorm`; multi-head latent
//! attention; residual; `post_attention_layernorm`; the dense MLP (the first
//! `first_k_dense_replace` layers and those off `moe_layer_freq`) or the MoE block; residual.
//!
//! Attention: the query from `q_a_proj` → `q_a_layernorm` → `q_b_proj` (or `q_proj` when
//! `q_lora_rank` is null), split per head into `qk_nope_head_dim` and `qk_rope_head_dim`;
//! `kv_a_proj_with_mqa` gives the compressed KV (`kv_lora_rank`, then `kv_a_layernorm`) and one
//! decoupled RoPE key shared by all heads. RoPE (interleaved pairs, DeepSeek's layout; YaRN from
//! `rope_scaling`, its `mscale / mscale_all_dim` on the rotated features) turns the rope parts
//! only; the softmax scale is `qk_head_dim^-0.5`, times `yarn_get_mscale(factor,
//! mscale_all_dim)²` under YaRN. The KV cache is the compressed one ([`KvRows`]: `k` holds each
//! position's normalised compressed KV `[kv_lora_rank]`, `v` its rotated RoPE key
//! `[qk_rope_head_dim]`), and attention runs on it in the absorbed form (mlx-lm's decode path):
//! each head's no-RoPE query is taken through its `kv_b_proj` key rows into the latent space,
//! scores are latent · compressed KV + RoPE query · RoPE key, and the weighted sum of
//! compressed KV goes out through the head's `kv_b_proj` value rows. That equals the expanded
//! form of transformers up to f32 rounding, and computes each position the same way in a
//! prefill and a decode, so the two give the same logits bit for bit.
//!
//! Router: sigmoid scores; `e_score_correction_bias` added for the choice only; the experts
//! split into `n_group` groups, a group's score the sum of its two best biased scores, the
//! `topk_group` best groups kept (the others' experts are never chosen — transformers' `-inf`;
//! mlx-lm zeroes them instead, which picks the same experts whenever a kept expert's biased
//! score is positive, and DeepSeek's own inference code uses `-inf`); top-k of the biased
//! scores; weights the unbiased scores, divided by their sum (+1e-20, transformers') when
//! `norm_topk_prob`, times `routed_scaling_factor`. Routed experts come from the model's
//! [`ExpertSource`] through `layer::routed_experts_into` (the runtime's SSD slot cache, tiers and
//! observers work unchanged); the shared experts are one SwiGLU of width `n_shared_experts ×
//! moe_intermediate_size`. An MoE layer is `layer >= first_k_dense_replace and layer %
//! moe_layer_freq == 0` (mlx-lm's and DeepSeek's rule; transformers ignores `moe_layer_freq`,
//! which every published model sets to 1).

use std::mem::take;

use keep_checkpoint::config::deepseek_v3::{layer_prefix, DeepseekV3Config, Yarn};
use keep_checkpoint::Checkpoint;
use keep_kernels::attend::par_blocks;
use keep_kernels::ops::{self, Rope};
use keep_kernels::profile::{self, Part};
use keep_kernels::WeightView;

pub use crate::cache::KvRows;
use crate::config::ModelConfig;
use crate::experts::ExpertSource;
use crate::family::{DecoderLayer, LayerFamily};
use crate::linear::{lin_into, top_k_by};
use crate::observer::{RouteEvent, RouteObserver};
use crate::scratch::{zeroed, FamilyScratch, Scratch};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm` (both references construct them with
/// the RMSNorm default, not `rms_norm_eps`).
const LATENT_EPS: f32 = 1e-6;

/// Head tasks per worker thread of the latent attention: each holds its heads' decoded
/// `kv_b_proj` rows, so few, but more than one per thread for work stealing to even out.
const MLA_TASKS_PER_THREAD: usize = 2;

/// The family config of a DeepSeek-V3 model config (an error for another family).
pub fn family_config(cfg: &ModelConfig) -> Result<&DeepseekV3Config> {
    cfg.raw
        .deepseek_v3
        .as_ref()
        .ok_or_else(|| ModelError::Config("not a deepseek_v3 config".into()))
}

/// A SwiGLU MLP: gate, up `[inter × hidden]`, down `[hidden × inter]`.
pub struct Mlp<'a> {
    pub gate: WeightView<'a>,
    pub up: WeightView<'a>,
    pub down: WeightView<'a>,
}

/// The FFN of a layer.
pub enum Ffn<'a> {
    /// The MoE block: router `mlp.gate` `[experts × hidden]`, its `e_score_correction_bias`,
    /// the shared experts (absent without `n_shared_experts`); routed experts from the model's
    /// [`ExpertSource`].
    Moe {
        gate: WeightView<'a>,
        bias: Vec<f32>,
        shared: Option<Mlp<'a>>,
    },
    /// The dense MLP (`intermediate_size`).
    Dense(Mlp<'a>),
}

/// The query projection.
pub enum QProj<'a> {
    /// `q_a_proj` `[q_lora × hidden]`, `q_a_layernorm`, `q_b_proj` `[heads·qk_head × q_lora]`.
    Lora {
        a: WeightView<'a>,
        norm: Vec<f32>,
        b: WeightView<'a>,
    },
    /// `q_proj` `[heads·qk_head × hidden]` (`q_lora_rank` null).
    Full(WeightView<'a>),
}

/// One decoder layer's weights (views of the checkpoint).
pub struct DeepseekV3Layer<'a> {
    pub layer: usize,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q: QProj<'a>,
    /// `kv_a_proj_with_mqa` `[kv_lora + rope × hidden]`.
    pub kv_a: WeightView<'a>,
    pub kv_norm: Vec<f32>,
    /// `kv_b_proj` `[heads·(nope + v) × kv_lora]`: per head, `nope` key rows then `v` value rows.
    pub kv_b: WeightView<'a>,
    /// `o_proj` `[hidden × heads·v]`.
    pub o: WeightView<'a>,
    pub ffn: Ffn<'a>,
    rope: Rope,
    scale: f32,
}

/// The RoPE of every layer: YaRN from `rope_scaling` or plain over `rope_theta`, interleaved.
pub fn rope_of(c: &DeepseekV3Config) -> Result<Rope> {
    let yarn = c.yarn().map_err(ModelError::Config)?;
    Ok(match yarn {
        Some(y) => Rope::yarn(
            c.qk_rope_head_dim,
            c.rope_theta,
            y.factor,
            y.original_max_position_embeddings,
            y.beta_fast,
            y.beta_slow,
            y.mscale,
            y.mscale_all_dim,
        ),
        None => Rope::yarn(
            c.qk_rope_head_dim,
            c.rope_theta,
            1.0,
            1.0,
            32.0,
            1.0,
            1.0,
            0.0,
        ),
    })
}

/// The softmax scale: `qk_head_dim^-0.5`, times `yarn_get_mscale(factor, mscale_all_dim)²`
/// under YaRN with `mscale_all_dim` set.
pub fn softmax_scale(c: &DeepseekV3Config) -> Result<f32> {
    let mut s = (c.qk_head_dim() as f64).powf(-0.5);
    if let Some(y) = c.yarn().map_err(ModelError::Config)? {
        if y.mscale_all_dim != 0.0 {
            let m = Yarn::get_mscale(y.factor, y.mscale_all_dim);
            s *= m * m;
        }
    }
    Ok(s as f32)
}

impl<'a> DeepseekV3Layer<'a> {
    /// Resolve layer `layer`'s weights (shapes and layouts checked).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let c = family_config(cfg)?;
        let hint = cfg.raw.weight_block_size();
        let (d, h) = (c.hidden_size, c.num_attention_heads);
        let p = layer_prefix(layer);
        let w = |n: &str, r, cols| weight(ck, &format!("{p}{n}"), r, cols, hint);
        let mlp = |base: &str, i: usize| -> Result<Mlp<'a>> {
            Ok(Mlp {
                gate: w(&format!("{base}.gate_proj"), i, d)?,
                up: w(&format!("{base}.up_proj"), i, d)?,
                down: w(&format!("{base}.down_proj"), d, i)?,
            })
        };
        let ffn = if c.is_moe_layer(layer) {
            let e = c.n_routed_experts;
            Ffn::Moe {
                gate: w("mlp.gate", e, d)?,
                bias: vec_f32(ck, &format!("{p}mlp.gate.e_score_correction_bias"), e)?,
                shared: match c.n_shared_experts {
                    Some(n) => Some(mlp("mlp.shared_experts", n * c.moe_intermediate_size)?),
                    None => None,
                },
            }
        } else {
            Ffn::Dense(mlp("mlp", c.intermediate_size)?)
        };
        let qk = c.qk_head_dim();
        let q = match c.q_lora_rank {
            Some(r) => QProj::Lora {
                a: w("self_attn.q_a_proj", r, d)?,
                norm: vec_f32(ck, &format!("{p}self_attn.q_a_layernorm.weight"), r)?,
                b: w("self_attn.q_b_proj", h * qk, r)?,
            },
            None => QProj::Full(w("self_attn.q_proj", h * qk, d)?),
        };
        let (kvl, rope) = (c.kv_lora_rank, c.qk_rope_head_dim);
        Ok(DeepseekV3Layer {
            layer,
            input_norm: vec_f32(ck, &format!("{p}input_layernorm.weight"), d)?,
            post_norm: vec_f32(ck, &format!("{p}post_attention_layernorm.weight"), d)?,
            q,
            kv_a: w("self_attn.kv_a_proj_with_mqa", kvl + rope, d)?,
            kv_norm: vec_f32(ck, &format!("{p}self_attn.kv_a_layernorm.weight"), kvl)?,
            kv_b: w(
                "self_attn.kv_b_proj",
                h * (c.qk_nope_head_dim + c.v_head_dim),
                kvl,
            )?,
            o: w("self_attn.o_proj", d, h * c.v_head_dim)?,
            ffn,
            rope: rope_of(c)?,
            scale: softmax_scale(c)?,
        })
    }

    /// `DeepseekV3DecoderLayer.forward` on `x` (`[t × hidden]`, in place) at positions
    /// `start_pos..start_pos + t` on `kernels`, appending this layer's compressed KV to `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        let mut sc = Scratch::on(kernels);
        self.forward_into(cfg, experts, mask, x, start_pos, kv, obs, &mut sc)
    }

    /// [`DeepseekV3Layer::forward`] with its intermediates in `sc` (no allocation once warm).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_into(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        mut obs: Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
    ) -> Result<()> {
        // The normalised input and the block's output, lent out of the scratch for the call.
        let (mut hn, mut y) = (take(&mut sc.h), take(&mut sc.block_out));
        let r = self.blocks(
            cfg, experts, mask, x, start_pos, kv, &mut obs, sc, &mut hn, &mut y,
        );
        (sc.h, sc.block_out) = (hn, y);
        r
    }

    /// The attention and feed-forward blocks of [`DeepseekV3Layer::forward_into`], `hn` and `y`
    /// the blocks' input and output.
    #[allow(clippy::too_many_arguments)]
    fn blocks(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        hn: &mut Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let c = family_config(cfg)?;
        let d = cfg.dim;
        let t = x.len() / d;
        hn.clear();
        hn.extend_from_slice(x);
        crate::linear::rms_norm(hn, d, Some(&self.input_norm), cfg.eps);
        self.attention(c, hn, t, start_pos, kv, obs, sc, y)?;
        for (xi, ai) in x.iter_mut().zip(y.iter()) {
            *xi += ai;
        }
        hn.clear();
        hn.extend_from_slice(x);
        crate::linear::rms_norm(hn, d, Some(&self.post_norm), cfg.eps);
        let l = self.layer;
        match &self.ffn {
            Ffn::Dense(m) => {
                let _p = profile::span(Part::SharedExpert);
                let names = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"];
                let (g, u, act) = (&mut sc.sg, &mut sc.su, &mut sc.sact);
                swiglu_into(m, hn, t, l, obs, names, [g, u, act], y)?;
            }
            Ffn::Moe { gate, bias, shared } => {
                self.moe(
                    cfg, c, gate, bias, experts, mask, hn, t, start_pos, obs, sc, y,
                )?;
                if let Some(m) = shared {
                    let _p = profile::span(Part::SharedExpert);
                    let names = [
                        "mlp.shared_experts.gate_proj",
                        "mlp.shared_experts.up_proj",
                        "mlp.shared_experts.down_proj",
                    ];
                    let (g, u, act) = (&mut sc.sg, &mut sc.su, &mut sc.sact);
                    swiglu_into(m, hn, t, l, obs, names, [g, u, act], &mut sc.sh)?;
                    for (a, b) in y.iter_mut().zip(&sc.sh) {
                        *a += b;
                    }
                }
            }
        }
        for (xi, fi) in x.iter_mut().zip(y.iter()) {
            *xi += fi;
        }
        Ok(())
    }

    /// Multi-head latent attention: `o_proj` of the heads' outputs into `out` (`[t × hidden]`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        c: &DeepseekV3Config,
        x: &[f32],
        t: usize,
        start_pos: usize,
        kv: &mut KvRows,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let proj_span = profile::span(Part::AttnProj);
        let l = self.layer;
        let h = c.num_attention_heads;
        let (nope, rope, vd, kvl) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let qk = nope + rope;
        let q = &mut sc.q;
        match &self.q {
            QProj::Lora { a, norm, b } => {
                let qa = &mut sc.qr;
                lin_into(x, t, a, obs, l, "self_attn.q_a_proj", None, qa)?;
                crate::linear::rms_norm(qa, a.rows, Some(norm), LATENT_EPS);
                lin_into(qa, t, b, obs, l, "self_attn.q_b_proj", None, q)?;
            }
            QProj::Full(w) => lin_into(x, t, w, obs, l, "self_attn.q_proj", None, q)?,
        }
        let kva = &mut sc.kv;
        let name = "self_attn.kv_a_proj_with_mqa";
        lin_into(x, t, &self.kv_a, obs, l, name, None, kva)?;
        if kv.rows != start_pos {
            return Err(ModelError::Cache(format!(
                "layer {l} holds {} positions, the forward starts at {start_pos}",
                kv.rows
            )));
        }
        let f = &mut sc.fam;
        for i in 0..t {
            let pos = (start_pos + i) as f32;
            for head in q[i * h * qk..(i + 1) * h * qk].chunks_exact_mut(qk) {
                self.rope.apply(head, pos, false);
            }
            let row = &kva[i * (kvl + rope)..(i + 1) * (kvl + rope)];
            let ckv = &mut sc.ckv;
            ckv.clear();
            ckv.extend_from_slice(&row[..kvl]);
            crate::linear::rms_norm(ckv, kvl, Some(&self.kv_norm), LATENT_EPS);
            let kpe = &mut f.kpe;
            kpe.clear();
            kpe.extend_from_slice(&row[kvl..]);
            self.rope.apply(kpe, pos, false);
            kv.k.extend_from_slice(ckv);
            kv.v.extend_from_slice(kpe);
        }
        kv.rows += t;
        drop(proj_span);
        let scores_span = profile::span(Part::AttnScores);
        // Each query reads the compressed KV and RoPE keys of the positions up to its own.
        profile::read((t * start_pos + t * (t + 1) / 2) * (kvl + rope) * 4);
        // Heads run in parallel, a task's heads one after another on its own working space
        // (the head's `kv_b_proj` key and value rows, latent query and output, RoPE query,
        // scores), each into its own `[t × vd]` block of `by_head`; the blocks are then laid
        // out as `[t × h × vd]`. Each head's arithmetic is the same whatever the cut.
        let tasks = h
            .min(MLA_TASKS_PER_THREAD * keep_kernels::cpu::threads())
            .max(1);
        let per = h.div_ceil(tasks);
        let tasks = h.div_ceil(per);
        let (wlen, most) = ((nope + vd) * kvl + 2 * kvl + rope, start_pos + t);
        let work = zeroed(&mut f.mla_work, tasks * wlen);
        let by_head = zeroed(&mut f.mla_heads, h * t * vd);
        let scores = zeroed(&mut sc.scores, tasks * most);
        let (kv, q) = (&*kv, &q[..]);
        let one_head = |head: usize, o: &mut [f32], w: &mut [f32], scores: &mut [f32]| {
            let (wk, rest) = w.split_at_mut(nope * kvl);
            let (wv, rest) = rest.split_at_mut(vd * kvl);
            let (q_lat, rest) = rest.split_at_mut(kvl);
            let (o_lat, q_pe) = rest.split_at_mut(kvl);
            // The head's key and value rows of `kv_b_proj`, decoded once for all queries.
            let r0 = head * (nope + vd);
            for j in 0..nope {
                self.kv_b
                    .decode_row(r0 + j, &mut wk[j * kvl..(j + 1) * kvl]);
            }
            for j in 0..vd {
                self.kv_b
                    .decode_row(r0 + nope + j, &mut wv[j * kvl..(j + 1) * kvl]);
            }
            for i in 0..t {
                let qh = &q[(i * h + head) * qk..(i * h + head + 1) * qk];
                // The no-RoPE query in the latent space: q_nope · W_k (scaled once here).
                q_lat.fill(0.0);
                for j in 0..nope {
                    let a = qh[j] * self.scale;
                    for (o, w) in q_lat.iter_mut().zip(&wk[j * kvl..(j + 1) * kvl]) {
                        *o += a * w;
                    }
                }
                for (o, v) in q_pe.iter_mut().zip(&qh[nope..]) {
                    *o = v * self.scale;
                }
                let visible = start_pos + i + 1;
                let scores = &mut scores[..visible];
                for (r, s) in scores.iter_mut().enumerate() {
                    *s = keep_kernels::matmul::dot(q_lat, &kv.k[r * kvl..(r + 1) * kvl])
                        + keep_kernels::matmul::dot(q_pe, &kv.v[r * rope..(r + 1) * rope]);
                }
                ops::softmax(scores);
                o_lat.fill(0.0);
                for (r, &p) in scores.iter().enumerate() {
                    for (o, ck) in o_lat.iter_mut().zip(&kv.k[r * kvl..(r + 1) * kvl]) {
                        *o += p * ck;
                    }
                }
                let oh = &mut o[i * vd..(i + 1) * vd];
                for (j, o) in oh.iter_mut().enumerate() {
                    *o = keep_kernels::matmul::dot(o_lat, &wv[j * kvl..(j + 1) * kvl]);
                }
            }
        };
        let parallel = tasks > 1 && h * t * most * kvl * 2 >= keep_kernels::cpu::PAR_MIN_MACS;
        let (ol, sl) = (per * t * vd, most);
        par_blocks(
            by_head,
            ol,
            work,
            wlen,
            scores,
            sl,
            parallel,
            |c, o, w, sc| {
                for (k, o) in o.chunks_exact_mut(t * vd).enumerate() {
                    one_head(c * per + k, o, w, sc);
                }
            },
        );
        let heads = zeroed(&mut sc.heads, t * h * vd);
        for (head, block) in by_head.chunks_exact(t * vd).enumerate() {
            for (i, row) in block.chunks_exact(vd).enumerate() {
                heads[(i * h + head) * vd..(i * h + head + 1) * vd].copy_from_slice(row);
            }
        }
        drop(scores_span);
        let _p = profile::span(Part::AttnProj);
        lin_into(heads, t, &self.o, obs, l, "self_attn.o_proj", None, out)
    }

    /// `DeepseekV3MoE.forward` without the shared experts: the group-limited sigmoid router and
    /// the weighted sum of the chosen routed experts, into `out`.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        cfg: &ModelConfig,
        c: &DeepseekV3Config,
        gate: &WeightView,
        bias: &[f32],
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &[f32],
        t: usize,
        start_pos: usize,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let router_span = profile::span(Part::Router);
        let l = self.layer;
        let (d, e, k) = (cfg.dim, cfg.experts_in_layer(l), cfg.top_k);
        if bias.len() != e || e != c.n_routed_experts {
            return Err(ModelError::Config(format!(
                "layer {l}: {e} routed experts, the router and its correction bias hold {} and \
                 {} (a pruned DeepSeek-V3 is not supported)",
                c.n_routed_experts,
                bias.len()
            )));
        }
        let logits = &mut sc.logits;
        lin_into(x, t, gate, obs, l, "ffn.gate", None, logits)?;
        let chosen = &mut sc.chosen;
        chosen.clear();
        chosen.resize(t * k, 0);
        let weights = zeroed(&mut sc.weights, t * k);
        let scores = zeroed(&mut sc.rscores, t * e);
        for i in 0..t {
            route_with(
                c,
                &logits[i * e..(i + 1) * e],
                bias,
                mask,
                &mut chosen[i * k..(i + 1) * k],
                &mut weights[i * k..(i + 1) * k],
                &mut scores[i * e..(i + 1) * e],
                (&mut sc.fam, &mut sc.rcand),
            );
        }
        if let Some(o) = obs.as_deref_mut() {
            o.on_route(&RouteEvent {
                layer: l,
                start_pos,
                tokens: t,
                top_k: k,
                experts: chosen,
                weights,
                scores,
            });
        }
        drop(router_span);
        let _p = profile::span(Part::Experts);
        let (chosen, weights, ys) = (&sc.chosen, &sc.weights, &mut sc.ys);
        crate::layer::routed_experts_into(
            cfg,
            sc.kernels,
            experts,
            l,
            x,
            t,
            chosen,
            weights,
            |g, u| ops::silu(g) * u,
            &mut |_| Ok(()),
            obs,
            &mut sc.experts,
            ys,
        )?;
        let out = zeroed(out, t * d);
        for i in 0..t {
            let o = &mut out[i * d..(i + 1) * d];
            for s in 0..k {
                let w = weights[i * k + s];
                for (a, b) in o.iter_mut().zip(&ys[(i * k + s) * d..(i * k + s + 1) * d]) {
                    *a += b * w;
                }
            }
        }
        Ok(())
    }
}

/// `DeepseekV3TopkRouter.forward` for one token: `scores` the sigmoid of `logits`; `chosen` the
/// top-k experts of the biased scores among the `topk_group` best groups (experts marked dead in
/// `mask` never chosen), ordered by biased score; `weights` their unbiased scores, normalised
/// and scaled.
pub fn route(
    c: &DeepseekV3Config,
    logits: &[f32],
    bias: &[f32],
    mask: Option<&[bool]>,
    chosen: &mut [u32],
    weights: &mut [f32],
    scores: &mut [f32],
) {
    let mut f = FamilyScratch::default();
    let mut cand = Vec::new();
    route_with(
        c,
        logits,
        bias,
        mask,
        chosen,
        weights,
        scores,
        (&mut f, &mut cand),
    )
}

/// [`route`] with its intermediates in `buf` (the biased scores, the groups' scores, one
/// group's ranking and the groups kept; the candidates' ranking).
#[allow(clippy::too_many_arguments)]
fn route_with(
    c: &DeepseekV3Config,
    logits: &[f32],
    bias: &[f32],
    mask: Option<&[bool]>,
    chosen: &mut [u32],
    weights: &mut [f32],
    scores: &mut [f32],
    buf: (&mut FamilyScratch, &mut Vec<(f32, usize)>),
) {
    let (f, cand) = buf;
    let e = logits.len();
    for (s, &v) in scores.iter_mut().zip(logits) {
        *s = ops::sigmoid(v);
    }
    let biased = &mut f.biased;
    biased.clear();
    biased.extend((0..e).map(|j| {
        if mask.is_some_and(|m| m[j]) {
            f32::NEG_INFINITY
        } else {
            scores[j] + bias[j]
        }
    }));
    if c.n_group > 1 {
        let per = e / c.n_group;
        let (groups, v) = (&mut f.groups, &mut f.group);
        groups.clear();
        for (g, s) in biased.chunks_exact(per).enumerate() {
            v.clear();
            v.extend(s.iter().copied().zip(0..));
            top_k_by(v, 2);
            groups.push((v[0].0 + v[1].0, g));
        }
        top_k_by(groups, c.topk_group);
        let keep = &mut f.keep;
        keep.clear();
        keep.resize(c.n_group, false);
        for &(_, g) in &groups[..c.topk_group] {
            keep[g] = true;
        }
        for (g, s) in biased.chunks_exact_mut(per).enumerate() {
            if !keep[g] {
                s.fill(f32::NEG_INFINITY);
            }
        }
    }
    cand.clear();
    cand.extend(biased.iter().copied().zip(0..));
    let k = chosen.len();
    top_k_by(cand, k);
    let mut sum = 0f32;
    for s in 0..k {
        let j = cand[s].1;
        chosen[s] = j as u32;
        weights[s] = scores[j];
        sum += scores[j];
    }
    for w in weights.iter_mut() {
        if c.norm_topk_prob {
            *w /= sum + 1e-20;
        }
        *w *= c.routed_scaling_factor as f32;
    }
}

/// `down(silu(gate(x)) · up(x))` over `t` rows into `y` (`bufs`: the gate, up and activation).
#[allow(clippy::too_many_arguments)]
fn swiglu_into(
    m: &Mlp,
    x: &[f32],
    t: usize,
    l: usize,
    obs: &mut Option<&mut dyn RouteObserver>,
    names: [&'static str; 3],
    bufs: [&mut Vec<f32>; 3],
    y: &mut Vec<f32>,
) -> Result<()> {
    let [g, u, act] = bufs;
    lin_into(x, t, &m.gate, obs, l, names[0], None, g)?;
    lin_into(x, t, &m.up, obs, l, names[1], None, u)?;
    act.clear();
    act.extend(g.iter().zip(u.iter()).map(|(&g, &u)| ops::silu(g) * u));
    lin_into(act, t, &m.down, obs, l, names[2], None, y)
}

/// The DeepSeek-V3 family's decoder-layer side ([`LayerFamily`]): its layers are [`DeepseekV3Layer`].
#[derive(Debug, Clone, Copy)]
pub struct DeepseekV3;

impl crate::config::Family {
    /// The DeepSeek-V3 family's forward (the checkpoint family [`keep_checkpoint::families::deepseek_v3::DeepseekV3`]).
    #[allow(non_upper_case_globals)]
    pub const DeepseekV3: crate::config::Family =
        crate::config::Family::HuggingFace(&keep_checkpoint::families::deepseek_v3::DeepseekV3);
}

impl LayerFamily for DeepseekV3 {
    fn load_layer<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Box<dyn DecoderLayer + 'a>> {
        Ok(Box::new(DeepseekV3Layer::load(ck, cfg, layer)?))
    }

    /// The compressed KV, `kv_lora_rank` a position (the RoPE key, smaller, is reserved
    /// alike).
    fn kv_floats(&self, cfg: &ModelConfig, _layer: usize, context: usize, _chunk: usize) -> usize {
        family_config(cfg).map_or(0, |c| context * c.kv_lora_rank)
    }

    fn attention_work_floats(&self, cfg: &ModelConfig, chunk: usize, threads: usize) -> usize {
        family_config(cfg).map_or(0, |c| {
            let (nope, rope, vd, kvl) = (
                c.qk_nope_head_dim,
                c.qk_rope_head_dim,
                c.v_head_dim,
                c.kv_lora_rank,
            );
            let tasks = c.num_attention_heads.min(MLA_TASKS_PER_THREAD * threads);
            tasks * ((nope + vd) * kvl + 2 * kvl + rope) + c.num_attention_heads * chunk * vd
        })
    }
}

impl DecoderLayer for DeepseekV3Layer<'_> {
    fn layer(&self) -> usize {
        self.layer
    }

    fn forward_into(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &mut [f32],
        start_pos: usize,
        kv: &mut KvRows,
        obs: Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
    ) -> Result<()> {
        DeepseekV3Layer::forward_into(self, cfg, experts, mask, x, start_pos, kv, obs, sc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(n_group: usize, topk_group: usize, k: usize) -> DeepseekV3Config {
        let v = serde_json::json!({"model_type": "deepseek_v3", "n_routed_experts": 8,
            "n_group": n_group, "topk_group": topk_group, "num_experts_per_tok": k,
            "routed_scaling_factor": 2.0, "norm_topk_prob": true});
        DeepseekV3Config::from_value(v).unwrap()
    }

    /// The group limit: the best single expert sits in a group whose top-2 sum loses, so it is
    /// never chosen; weights come from the unbiased scores.
    #[test]
    fn router_keeps_the_best_groups_and_weighs_by_unbiased_scores() {
        let c = cfg(4, 2, 2);
        // Groups of 2: g0 {0,1}, g1 {2,3}, g2 {4,5}, g3 {6,7}.
        let logits = [3.0, -3.0, 1.0, 1.0, 0.5, 0.5, -2.0, -2.0];
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        let (mut ch, mut w, mut s) = ([0u32; 2], [0f32; 2], [0f32; 8]);
        route(&c, &logits, &bias, None, &mut ch, &mut w, &mut s);
        // g0 = σ(3)+σ(-3) = 1.0, g1 = 2σ(1) = 1.46, g2 = 2σ(.5) = 1.25: g1 and g2 are kept.
        assert_eq!(ch, [2, 3]);
        assert!(
            (w[0] - 1.0).abs() < 1e-6 && (w[1] - 1.0).abs() < 1e-6,
            "{w:?}"
        );
        // A bias moves the choice but not the weights.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0];
        route(&c, &logits, &bias, None, &mut ch, &mut w, &mut s);
        assert_eq!(ch, [5, 2]);
        let (a, b) = (ops::sigmoid(0.5), ops::sigmoid(1.0));
        assert!((w[0] - 2.0 * a / (a + b)).abs() < 1e-6, "{w:?}");
    }
}
