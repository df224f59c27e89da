//! The Qwen3-MoE decoder layer (`Family::Qwen3Moe`, `model_type` `qwen3_moe`), following
//! mlx-lm 0.32.2's `qwen3_moe.py` operation by operation: `input_layernorm`, attention (q/k/v
//! projections, per-head RMSNorm of queries and keys, non-traditional RoPE — the two halves of
//! each head rotate — over the whole head, grouped-query SDPA with the causal mask and scale
//! `head_dim^-0.5`, `o_proj`), residual, `post_attention_layernorm`, then either the sparse MoE
//! block (softmax router over all experts, top-k, gate weights renormalised when
//! `norm_topk_prob`, per-expert SwiGLU) or the dense MLP (`mlp_only_layers` and layers off the
//! `decoder_sparse_step`), residual.
//!
//! Tensor names are the family module's (`keep_checkpoint::qwen3`); routed experts come from
//! the model's [`ExpertSource`] like every family's, so the runtime's SSD slot cache and the
//! calibration observers work unchanged. The KV cache of a layer is [`KvRows`] (every position's
//! keys and values; no window).

use keep_checkpoint::qwen3 as names;
use std::mem::take;

use keep_checkpoint::Checkpoint;
use keep_kernels::attend::{self, CausalRows, Scale};
use keep_kernels::ops;
use keep_kernels::profile::{self, Part};
use keep_kernels::WeightView;

pub use crate::cache::KvRows;
use crate::config::ModelConfig;
pub use crate::experts::expert_bases;
use crate::experts::ExpertSource;
use crate::family::{DecoderLayer, LayerFamily};
use crate::layer::route_with;
use crate::linear::{lin_into, proj_into};
use crate::observer::{RouteEvent, RouteObserver};
use crate::scratch::{zeroed, Scratch};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// The FFN of a layer.
pub enum Ffn<'a> {
    /// The sparse block: the router `mlp.gate` `[num_experts × hidden]`; experts from the
    /// model's [`ExpertSource`].
    Moe { gate: WeightView<'a> },
    /// The dense MLP: gate, up `[intermediate × hidden]`, down `[hidden × intermediate]`.
    Dense {
        gate: WeightView<'a>,
        up: WeightView<'a>,
        down: WeightView<'a>,
    },
}

/// One decoder layer's weights (views of the checkpoint).
pub struct Qwen3Layer<'a> {
    pub layer: usize,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub q: WeightView<'a>,
    pub k: WeightView<'a>,
    pub v: WeightView<'a>,
    pub o: WeightView<'a>,
    pub ffn: Ffn<'a>,
    /// RoPE's `1 / period` per rotated pair (`base^(-i / (head_dim/2))`, as MLX's `fast.rope`).
    inv_freq: Vec<f32>,
}

/// RoPE frequencies of MLX's `fast.rope(dims, traditional=False, base)`: pair `i` (features `i`
/// and `i + dims/2`) turns by `pos · base^(-2i/dims)`.
pub fn rope_inv_freq(dims: usize, base: f64) -> Vec<f32> {
    let half = dims / 2;
    (0..half)
        .map(|i| (-(i as f64) * base.ln() / half as f64).exp() as f32)
        .collect()
}

/// Rotate one head `x` (`dims` features) by position `pos`: the first half against the second.
pub fn rope_halves(x: &mut [f32], inv_freq: &[f32], pos: usize) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let theta = pos as f32 * f;
        let (s, c) = theta.sin_cos();
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = a * s + b * c;
    }
}

impl<'a> Qwen3Layer<'a> {
    /// Resolve layer `layer`'s weights (shapes and layouts checked).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let q3 = family_config(cfg)?;
        let hint = cfg.raw.weight_block_size();
        let (d, hd, h, kv) = (
            cfg.dim,
            q3.head_dim,
            q3.num_attention_heads,
            q3.num_key_value_heads,
        );
        let p = names::layer_prefix(layer);
        let w = |n: &str, r, c| weight(ck, &format!("{p}{n}"), r, c, hint);
        let ffn = if q3.is_moe_layer(layer) {
            Ffn::Moe {
                gate: w("mlp.gate", q3.num_experts, d)?,
            }
        } else {
            let i = q3.intermediate_size;
            Ffn::Dense {
                gate: w("mlp.gate_proj", i, d)?,
                up: w("mlp.up_proj", i, d)?,
                down: w("mlp.down_proj", d, i)?,
            }
        };
        Ok(Qwen3Layer {
            layer,
            input_norm: vec_f32(ck, &format!("{p}input_layernorm.weight"), d)?,
            post_norm: vec_f32(ck, &format!("{p}post_attention_layernorm.weight"), d)?,
            q_norm: vec_f32(ck, &format!("{p}self_attn.q_norm.weight"), hd)?,
            k_norm: vec_f32(ck, &format!("{p}self_attn.k_norm.weight"), hd)?,
            q: w("self_attn.q_proj", h * hd, d)?,
            k: w("self_attn.k_proj", kv * hd, d)?,
            v: w("self_attn.v_proj", kv * hd, d)?,
            o: w("self_attn.o_proj", d, h * hd)?,
            ffn,
            inv_freq: rope_inv_freq(hd, q3.rope_theta),
        })
    }

    /// `Qwen3MoeDecoderLayer.__call__` on `x` (`[t × hidden]`, in place) at positions
    /// `start_pos..start_pos + t` on `kernels`, appending this layer's keys and values to `kv`.
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

    /// [`Qwen3Layer::forward`] with its intermediates in `sc` (no allocation once warm).
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

    /// The attention and feed-forward blocks of [`Qwen3Layer::forward_into`], `hn` and `y` the
    /// blocks' input and output.
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
        let d = cfg.dim;
        let t = x.len() / d;
        hn.clear();
        hn.extend_from_slice(x);
        crate::linear::rms_norm(hn, d, Some(&self.input_norm), cfg.eps);
        self.attention(cfg, hn, t, start_pos, kv, obs, sc, y)?;
        {
            let _p = profile::span(Part::AttnProj);
            for (xi, ai) in x.iter_mut().zip(y.iter()) {
                *xi += ai;
            }
        }
        hn.clear();
        hn.extend_from_slice(x);
        crate::linear::rms_norm(hn, d, Some(&self.post_norm), cfg.eps);
        match &self.ffn {
            Ffn::Moe { gate } => {
                self.moe(cfg, gate, experts, mask, hn, t, start_pos, obs, sc, y)?
            }
            Ffn::Dense { gate, up, down } => {
                let _p = profile::span(Part::SharedExpert);
                let (l, k) = (self.layer, sc.kernels);
                proj_into(k, hn, t, gate, obs, l, "mlp.gate_proj", None, &mut sc.sg)?;
                proj_into(k, hn, t, up, obs, l, "mlp.up_proj", None, &mut sc.su)?;
                let act = &mut sc.sact;
                act.clear();
                act.extend(sc.sg.iter().zip(&sc.su).map(|(&g, &u)| ops::silu(g) * u));
                proj_into(k, act, t, down, obs, l, "mlp.down_proj", None, y)?;
            }
        }
        let _p = profile::span(Part::Experts);
        for (xi, fi) in x.iter_mut().zip(y.iter()) {
            *xi += fi;
        }
        Ok(())
    }

    /// `Attention.__call__`: `o_proj` of the attention output into `out` (`[t × hidden]`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        cfg: &ModelConfig,
        x: &[f32],
        t: usize,
        start_pos: usize,
        kv: &mut KvRows,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let _p = profile::span(Part::AttnProj);
        let l = self.layer;
        let hd = self.q_norm.len();
        let (h, kvh) = (self.q.rows / hd, self.k.rows / hd);
        let kn = sc.kernels;
        let (q, k, v) = (&mut sc.q, &mut sc.fam.k, &mut sc.fam.v);
        crate::linear::projs_into(
            kn,
            x,
            t,
            [
                (&self.q, "self_attn.q_proj", q),
                (&self.k, "self_attn.k_proj", k),
                (&self.v, "self_attn.v_proj", v),
            ],
            obs,
            l,
        )?;
        crate::linear::rms_norm(q, hd, Some(&self.q_norm), cfg.eps);
        crate::linear::rms_norm(k, hd, Some(&self.k_norm), cfg.eps);
        for (i, row) in q.chunks_exact_mut(h * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                rope_halves(head, &self.inv_freq, start_pos + i);
            }
        }
        for (i, row) in k.chunks_exact_mut(kvh * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                rope_halves(head, &self.inv_freq, start_pos + i);
            }
        }
        if kv.rows != start_pos {
            return Err(ModelError::Cache(format!(
                "layer {l} holds {} positions, the forward starts at {start_pos}",
                kv.rows
            )));
        }
        kv.k.extend_from_slice(k);
        kv.v.extend_from_slice(v);
        kv.rows += t;
        let scores_span = profile::span(Part::AttnScores);
        // Each query reads the keys and values of the positions up to its own.
        profile::read((t * start_pos + t * (t + 1) / 2) * 2 * kvh * hd * 4);
        let heads = zeroed(&mut sc.heads, t * h * hd);
        let rows = CausalRows {
            k: &kv.k,
            v: &kv.v,
            stride: kvh * hd,
            head_dim: hd,
            start: start_pos,
            base: 0,
            window: None,
        };
        let shape = attend::Heads {
            queries: t,
            heads: h,
            head_dim: hd,
            group: h / kvh,
        };
        let scale = Scale::Query((hd as f32).powf(-0.5));
        attend::attend(shape, q, &rows, scale, None, heads, &mut sc.scores);
        drop(scores_span);
        proj_into(kn, heads, t, &self.o, obs, l, "self_attn.o_proj", None, out)
    }

    /// `Qwen3MoeSparseMoeBlock.__call__`: softmax router, top-k (experts in `mask` never
    /// chosen), renormalised weights, each chosen expert's SwiGLU, weighted sum into `out`.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        cfg: &ModelConfig,
        gate: &WeightView,
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
        let logits = &mut sc.logits;
        lin_into(x, t, gate, obs, l, "ffn.gate", None, logits)?;
        let chosen = &mut sc.chosen;
        chosen.clear();
        chosen.resize(t * k, 0);
        let weights = zeroed(&mut sc.weights, t * k);
        let scores = zeroed(&mut sc.rscores, t * e);
        let no_bias = zeroed(&mut sc.fam.zeros, e);
        for i in 0..t {
            // keep's router with `softmax` scoring, no bias, temperature 1, scale 1 is exactly
            // the reference's; only its renormalisation skips k = 1, where the reference's
            // `scores / sum(scores)` is 1.
            route_with(
                cfg,
                &mut logits[i * e..(i + 1) * e],
                no_bias,
                mask,
                &mut chosen[i * k..(i + 1) * k],
                &mut weights[i * k..(i + 1) * k],
                &mut scores[i * e..(i + 1) * e],
                &mut sc.rcand,
            );
            if k == 1 && cfg.norm_topk_prob {
                weights[i] = 1.0;
            }
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

/// The family config of a Qwen3-MoE model config (an error for another family).
pub fn family_config(cfg: &ModelConfig) -> Result<&keep_checkpoint::qwen3::Qwen3MoeConfig> {
    cfg.raw
        .qwen3
        .as_ref()
        .ok_or_else(|| ModelError::Config("not a qwen3_moe config".into()))
}

/// The Qwen3-MoE family's decoder-layer side ([`LayerFamily`]): its layers are [`Qwen3Layer`].
#[derive(Debug, Clone, Copy)]
pub struct Qwen3Moe;

impl crate::config::Family {
    /// The Qwen3-MoE family's forward (the checkpoint family [`keep_checkpoint::qwen3::Qwen3Moe`]).
    #[allow(non_upper_case_globals)]
    pub const Qwen3Moe: crate::config::Family =
        crate::config::Family::HuggingFace(&keep_checkpoint::qwen3::Qwen3Moe);
}

impl LayerFamily for Qwen3Moe {
    fn load_layer<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Box<dyn DecoderLayer + 'a>> {
        Ok(Box::new(Qwen3Layer::load(ck, cfg, layer)?))
    }

    /// Every position's keys and values.
    fn kv_floats(&self, cfg: &ModelConfig, _layer: usize, context: usize, _chunk: usize) -> usize {
        family_config(cfg).map_or(0, |q| context * q.num_key_value_heads * cfg.head_dim)
    }
}

impl DecoderLayer for Qwen3Layer<'_> {
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
        Qwen3Layer::forward_into(self, cfg, experts, mask, x, start_pos, kv, obs, sc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 rotation vs the f64 formula over a few turns.
    const TOL: f64 = 1e-5;

    #[test]
    fn rope_rotates_halves_like_the_formula() {
        let dims = 8;
        let inv = rope_inv_freq(dims, 10000.0);
        let x: Vec<f32> = (0..dims).map(|i| (i as f32 * 0.7).sin()).collect();
        for pos in [0usize, 1, 5, 37] {
            let mut y = x.clone();
            rope_halves(&mut y, &inv, pos);
            for i in 0..dims / 2 {
                let f = 10000f64.powf(-(2.0 * i as f64) / dims as f64);
                let th = pos as f64 * f;
                let (a, b) = (x[i] as f64, x[i + dims / 2] as f64);
                let want = [a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()];
                assert!((y[i] as f64 - want[0]).abs() < TOL, "pos {pos} pair {i}");
                assert!((y[i + dims / 2] as f64 - want[1]).abs() < TOL);
            }
        }
    }
}
