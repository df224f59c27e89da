//! The gpt-oss decoder layer (`Family::GptOss`, `model_type` `gpt_oss`: gpt-oss-20b and
//! gpt-oss-120b), following transformers 5.23's `modeling_gpt_oss.py`, mlx-lm 0.32.2's
//! `gpt_oss.py` and OpenAI's own `gpt_oss/torch/model.py` operation by operation:
//! `input_layernorm` (RMSNorm); attention; residual; `post_attention_layernorm`; the MoE block;
//! residual. The head is untied (`lm_head`), after the final `model.norm`.
//!
//! Attention: q/k/v projections with biases, grouped-query heads (`num_key_value_heads`),
//! RoPE on the two halves of each head (non-interleaved) with YaRN's NTK-by-parts frequencies
//! and its concentration `0.1·ln(factor) + 1` on both the query and the key (transformers'
//! `attention_factor` on the cosine and sine); scores `q·k · head_dim^-0.5`; each head's learned
//! sink logit (`self_attn.sinks`, not scaled) joins the softmax's denominator and is then
//! dropped, so the weights over the visible positions sum to less than 1; `o_proj` with its
//! bias. Layers alternate by `layer_types`: a `sliding_attention` layer's query at position `p`
//! sees `p − sliding_window + 1 ..= p` (the three references agree), a `full_attention` layer's
//! every earlier position. RoPE's correction range is rounded to whole dimensions only under
//! `"truncate": true` (see `keep_checkpoint::config::gpt_oss::GptOssConfig::yarn`: OpenAI's code
//! and transformers with `truncate: false` do not round; mlx-lm 0.32.2 always rounds, which is
//! the one place it differs from the publisher).
//!
//! MoE: the router is a linear layer with a bias over all `num_local_experts`; the top-k
//! logits are chosen (experts masked dead never), and their softmax (over the k alone) weighs
//! the experts. An expert is one MXFP4 `gate_up_proj` `[2·intermediate × hidden]` (gate and up
//! rows interleaved) plus its bias, the clamped SwiGLU — `gate = min(gate, limit)`,
//! `up = clamp(up, −limit, limit)`, `(up + 1) · gate · σ(alpha · gate)` with `alpha`
//! `swiglu_alpha` (1.702) and `limit` `swiglu_limit` (7) — then the MXFP4 `down_proj`
//! `[hidden × intermediate]` plus its bias. Experts come from the model's [`ExpertSource`]
//! (`w1` the gate-up matrix, `w2` the down matrix, `w3` empty; [`GptOssExperts`] serves them as
//! views of the published stacks, nothing converted, or of an expert's own tensors where `keep
//! quant` coded it, with the incoherence transforms it stored rotated under); their biases are
//! small and held by the layer. Under `Kernels::Exact` every product decodes the MXFP4 bytes exactly (E2M1 value ·
//! `2^(scale − 127)`), the dequantized weights transformers computes with.
//!
//! The KV cache of a layer is [`KvRows`]: `rows` counts the positions seen; a full layer holds
//! every position's rotated keys and values, a sliding layer only the last `sliding_window − 1`
//! between forwards (what the next query can see; the oldest are dropped after each forward).
//! Each position is computed by the same instructions in a
//! prefill, a chunked prefill and a decode, so all three give the same logits bit for bit.

use std::mem::take;

use keep_checkpoint::config::gpt_oss::{layer_prefix, GptOssConfig, Stack, EMBED, HEAD, NORM};
use keep_checkpoint::naming::ExpertMat;
use keep_checkpoint::Checkpoint;
use keep_kernels::attend::{self, CausalRows, KvSource, Scale};
use keep_kernels::matmul::{matmul_many_levels, matmul_many_with};
use keep_kernels::profile::{self, Part};
use keep_kernels::scratch::recycle;
use keep_kernels::simd::Job;
use keep_kernels::{ops, Kernels, WeightView};

pub use crate::cache::KvRows;
use crate::config::ModelConfig;
use crate::experts::{coded_rht, rht_output, ExpertSource, ExpertWeights};
use crate::family::{DecoderLayer, LayerFamily};
use crate::globals::Globals;
use crate::linear::{lin_into, note_input, proj_into, top_k_by};
use crate::observer::{ExpertOutputEvent, RouteEvent, RouteObserver};
use crate::scratch::{zeroed, ExpertScratch, Scratch, KEEP_ROWS};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// The family config of a gpt-oss model config (an error for another family).
pub fn family_config(cfg: &ModelConfig) -> Result<&GptOssConfig> {
    cfg.raw
        .gpt_oss
        .as_ref()
        .ok_or_else(|| ModelError::Config("not a gpt_oss config".into()))
}

/// RoPE of every layer: `1 / period` per pair of features (`i`, `i + head_dim/2`) and the
/// concentration both the query and the key are multiplied by.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    pub concentration: f32,
}

/// The frequencies as transformers' `_compute_yarn_parameters` computes them, in f32: periods
/// `base^(2i/dim)`; extrapolation `1/period`, interpolation `1/(factor·period)`; the correction
/// range `[low, high]` from `beta_fast` / `beta_slow` over `original_max_position_embeddings`
/// (rounded out only under `truncate`), clamped to `[0, dim − 1]`; a linear ramp over the pairs
/// between them blends the two (`inv = interp·ramp + extrap·(1 − ramp)`, OpenAI's NTK by parts).
pub fn rope_of(c: &GptOssConfig) -> Result<Rope> {
    let dim = c.head_dim;
    let half = dim / 2;
    let base = c.rope_theta as f32;
    let period: Vec<f32> = (0..half)
        .map(|i| base.powf((2 * i) as f32 / dim as f32))
        .collect();
    let Some(y) = c.yarn().map_err(ModelError::Config)? else {
        return Ok(Rope {
            inv_freq: period.iter().map(|p| 1.0 / p).collect(),
            concentration: 1.0,
        });
    };
    let corr = |rot: f64| {
        (dim as f64
            * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln())
            / (2.0 * c.rope_theta.ln())
    };
    let (mut low, mut high) = (corr(y.beta_fast), corr(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    let (lo32, span32) = (low as f32, (high - low) as f32);
    let factor = y.factor as f32;
    let inv_freq = period
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let ramp = ((i as f32 - lo32) / span32).clamp(0.0, 1.0);
            let extrap_factor = 1.0 - ramp;
            let (extrap, interp) = (1.0 / p, 1.0 / (factor * p));
            interp * (1.0 - extrap_factor) + extrap * extrap_factor
        })
        .collect();
    Ok(Rope {
        inv_freq,
        concentration: y.concentration() as f32,
    })
}

impl Rope {
    /// Rotate one head `x` (`head_dim` features) by position `pos`: the first half against the
    /// second, cosine and sine times the concentration.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let theta = pos as f32 * f;
            let (c, s) = (
                theta.cos() * self.concentration,
                theta.sin() * self.concentration,
            );
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

/// A linear layer with an optional bias.
pub struct Linear<'a> {
    pub w: WeightView<'a>,
    pub bias: Option<Vec<f32>>,
}

impl Linear<'_> {
    /// `x · Wᵀ + b` over `t` rows into `y`.
    #[allow(clippy::too_many_arguments)]
    fn apply_into(
        &self,
        kernels: Kernels,
        x: &[f32],
        t: usize,
        obs: &mut Option<&mut dyn RouteObserver>,
        l: usize,
        name: &'static str,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        proj_into(kernels, x, t, &self.w, obs, l, name, None, y)?;
        add_rows(y, self.bias.as_deref());
        Ok(())
    }
}

fn add_rows(y: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(b.len()) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    }
}

/// One decoder layer's weights (views of the checkpoint; norms, sinks and biases decoded).
pub struct GptOssLayer<'a> {
    pub layer: usize,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub q: Linear<'a>,
    pub k: Linear<'a>,
    pub v: Linear<'a>,
    pub o: Linear<'a>,
    /// One sink logit per query head.
    pub sinks: Vec<f32>,
    /// The router `[experts × hidden]` and its bias.
    pub router: WeightView<'a>,
    pub router_bias: Vec<f32>,
    /// The experts' biases: `gate_up_proj_bias` `[experts × 2·intermediate]` (interleaved as
    /// the rows) and `down_proj_bias` `[experts × hidden]`.
    pub gate_up_bias: Vec<f32>,
    pub down_bias: Vec<f32>,
    /// The attention window (`None`: full attention).
    pub window: Option<usize>,
    pub head_dim: usize,
    rope: Rope,
}

impl<'a> GptOssLayer<'a> {
    /// Resolve layer `layer`'s weights (shapes and layouts checked).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        let c = family_config(cfg)?;
        let (d, hd, h, kv, e) = (
            c.hidden_size,
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.num_local_experts,
        );
        let p = layer_prefix(layer);
        let lin = |n: &str, r: usize, cols: usize| -> Result<Linear<'a>> {
            Ok(Linear {
                w: weight(ck, &format!("{p}{n}"), r, cols, None)?,
                bias: if c.attention_bias {
                    Some(vec_f32(ck, &format!("{p}{n}.bias"), r)?)
                } else {
                    None
                },
            })
        };
        Ok(GptOssLayer {
            layer,
            input_norm: vec_f32(ck, &format!("{p}input_layernorm.weight"), d)?,
            post_norm: vec_f32(ck, &format!("{p}post_attention_layernorm.weight"), d)?,
            q: lin("self_attn.q_proj", h * hd, d)?,
            k: lin("self_attn.k_proj", kv * hd, d)?,
            v: lin("self_attn.v_proj", kv * hd, d)?,
            o: lin("self_attn.o_proj", d, h * hd)?,
            sinks: vec_f32(ck, &format!("{p}self_attn.sinks"), h)?,
            router: weight(ck, &format!("{p}mlp.router"), e, d, None)?,
            router_bias: vec_f32(ck, &format!("{p}mlp.router.bias"), e)?,
            gate_up_bias: vec_f32(
                ck,
                &Stack::GateUp.name(layer, "_bias"),
                e * 2 * c.intermediate_size,
            )?,
            down_bias: vec_f32(ck, &Stack::Down.name(layer, "_bias"), e * d)?,
            window: c.window(layer),
            head_dim: hd,
            rope: rope_of(c)?,
        })
    }

    /// `GptOssDecoderLayer.forward` on `x` (`[t × hidden]`, in place) at positions
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

    /// [`GptOssLayer::forward`] with its intermediates in `sc` (no allocation once warm).
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

    /// The attention and MoE blocks of [`GptOssLayer::forward_into`], `hn` and `y` the blocks'
    /// input and output.
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
        self.attention(hn, t, start_pos, kv, obs, sc, y)?;
        for (xi, ai) in x.iter_mut().zip(y.iter()) {
            *xi += ai;
        }
        hn.clear();
        hn.extend_from_slice(x);
        crate::linear::rms_norm(hn, d, Some(&self.post_norm), cfg.eps);
        self.moe(cfg, c, experts, mask, hn, t, start_pos, obs, sc, y)?;
        for (xi, fi) in x.iter_mut().zip(y.iter()) {
            *xi += fi;
        }
        Ok(())
    }

    /// `GptOssAttention.forward`: `o_proj` of the heads' outputs into `out` (`[t × hidden]`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
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
        let hd = self.head_dim;
        let (h, kvh) = (self.q.w.rows / hd, self.k.w.rows / hd);
        let kn = sc.kernels;
        let (q, k, v) = (&mut sc.q, &mut sc.fam.k, &mut sc.fam.v);
        self.q.apply_into(kn, x, t, obs, l, "self_attn.q_proj", q)?;
        self.k.apply_into(kn, x, t, obs, l, "self_attn.k_proj", k)?;
        self.v.apply_into(kn, x, t, obs, l, "self_attn.v_proj", v)?;
        for (i, row) in q.chunks_exact_mut(h * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                self.rope.apply(head, start_pos + i);
            }
        }
        for (i, row) in k.chunks_exact_mut(kvh * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                self.rope.apply(head, start_pos + i);
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
        // Position `r` is held at row `r - base` (a sliding layer dropped the rows before).
        let kw = kvh * hd;
        let base = kv.rows - kv.k.len() / kw;
        drop(proj_span);
        let scores_span = profile::span(Part::AttnScores);
        let heads = zeroed(&mut sc.heads, t * h * hd);
        let rows = CausalRows {
            k: &kv.k,
            v: &kv.v,
            stride: kw,
            head_dim: hd,
            start: start_pos,
            base,
            window: self.window,
        };
        let shape = attend::Heads {
            queries: t,
            heads: h,
            head_dim: hd,
            group: h / kvh,
        };
        let scale = Scale::Score((hd as f32).powf(-0.5));
        let sinks = Some(&self.sinks[..]);
        attend::attend(shape, q, &rows, scale, sinks, heads, &mut sc.scores);
        let read: usize = (0..t).map(|i| rows.count(i)).sum();
        profile::read(read * 2 * kw * 4);
        if let Some(w) = self.window {
            // Keep what the next query sees: the last `w - 1` positions.
            let drop_rows = (kv.k.len() / kw).saturating_sub(w - 1);
            kv.k.drain(..drop_rows * kw);
            kv.v.drain(..drop_rows * kw);
        }
        drop(scores_span);
        let _p = profile::span(Part::AttnProj);
        self.o
            .apply_into(kn, heads, t, obs, l, "self_attn.o_proj", out)
    }

    /// `GptOssMLP.forward`: the router (linear with bias, top-k, softmax over the k), each
    /// chosen expert's clamped SwiGLU with its biases, the weighted sum into `out`.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &self,
        cfg: &ModelConfig,
        c: &GptOssConfig,
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
        if e != c.num_local_experts {
            return Err(ModelError::Config(format!(
                "layer {l}: {e} routed experts, the router holds {} (a pruned gpt-oss is not \
                 supported)",
                c.num_local_experts
            )));
        }
        let logits = &mut sc.logits;
        lin_into(x, t, &self.router, obs, l, "ffn.gate", None, logits)?;
        add_rows(logits, Some(&self.router_bias));
        let chosen = &mut sc.chosen;
        chosen.clear();
        chosen.resize(t * k, 0);
        let weights = zeroed(&mut sc.weights, t * k);
        let scores = zeroed(&mut sc.rscores, t * e);
        for i in 0..t {
            let row = &logits[i * e..(i + 1) * e];
            route_with(
                row,
                mask,
                &mut chosen[i * k..(i + 1) * k],
                &mut weights[i * k..(i + 1) * k],
                &mut sc.rcand,
            );
            let s = &mut scores[i * e..(i + 1) * e];
            s.copy_from_slice(row);
            ops::softmax(s);
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
        let bufs = (&mut sc.experts, &mut sc.fam.routes);
        let kernels = sc.kernels;
        self.experts_into(cfg, kernels, c, experts, x, t, chosen, bufs, ys, obs)?;
        // Each expert's inputs (the gate-up matrix's, `ffn.experts.w1`: the imatrix and its
        // route counts) and its unweighted outputs on its routes (`token · top_k + slot`, in
        // token order), as the shared MoE path reports them (REAP's ‖f‖ and g).
        for (j, rs) in sc.fam.routes.iter().enumerate().take(e) {
            if rs.is_empty() || obs.is_none() {
                continue;
            }
            if obs.as_deref().is_some_and(|o| o.wants_linear_inputs()) {
                let xin: Vec<f32> = rs
                    .iter()
                    .flat_map(|&r| x[(r / k) * d..(r / k + 1) * d].iter().copied())
                    .collect();
                note_input(obs, l, "ffn.experts.w1", Some(j), &xin, rs.len(), d);
            }
            if let Some(o) = obs.as_deref_mut().filter(|o| o.wants_expert_outputs()) {
                let rows: Vec<usize> = rs.iter().map(|&r| r / k).collect();
                let slots: Vec<usize> = rs.iter().map(|&r| r % k).collect();
                let ws: Vec<f32> = rs.iter().map(|&r| weights[r]).collect();
                let outputs: Vec<f32> = rs
                    .iter()
                    .flat_map(|&r| ys[r * d..(r + 1) * d].iter().copied())
                    .collect();
                o.on_expert_output(&ExpertOutputEvent {
                    layer: l,
                    expert: j,
                    token_rows: &rows,
                    slots: &slots,
                    weights: &ws,
                    outputs: &outputs,
                });
            }
        }
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

    /// Each route's expert output `[t × top_k × hidden]` (unweighted) into `ys`: the routes
    /// grouped by expert, the experts of a batch multiplied together (one kernel pass for their
    /// gate-up products, one for their down products). Each product equals the expert's alone,
    /// so the grouping changes no bit. `bufs`: the experts' working buffers and the routes of
    /// each expert.
    #[allow(clippy::too_many_arguments)]
    fn experts_into(
        &self,
        cfg: &ModelConfig,
        kernels: Kernels,
        c: &GptOssConfig,
        experts: &dyn ExpertSource,
        x: &[f32],
        t: usize,
        chosen: &[u32],
        bufs: (&mut ExpertScratch, &mut Vec<Vec<usize>>),
        ys: &mut Vec<f32>,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        let (es, routes) = bufs;
        let l = self.layer;
        let (d, k, inter) = (cfg.dim, cfg.top_k, c.intermediate_size);
        let e = c.num_local_experts;
        if routes.len() < e {
            // Each expert's list sized for a decode pass's routes when made.
            routes.resize_with(e, || Vec::with_capacity(KEEP_ROWS));
        }
        let routes = &mut routes[..e];
        routes.iter_mut().for_each(Vec::clear);
        for (r, &j) in chosen.iter().enumerate() {
            routes[j as usize].push(r);
        }
        let used = &mut es.used;
        used.clear();
        used.extend((0..e).filter(|&j| !routes[j].is_empty()));
        {
            let _io = profile::span(Part::IoWait);
            experts.prefetch(l, used);
        }
        let (limit, alpha) = (c.swiglu_limit as f32, c.swiglu_alpha as f32);
        let ys = zeroed(ys, t * k * d);
        // Buffers of borrowed views and jobs, kept between calls in their `'static` form.
        let mut views: Vec<ExpertWeights<'_>> = recycle(take(&mut es.views));
        for ids in es.used.chunks(experts.max_batch().max(1)) {
            views.clear();
            {
                let _io = profile::span(Part::IoWait);
                experts.experts_into(l, ids, &mut views)?;
            }
            if views.len() != ids.len() {
                return Err(ModelError::Expert {
                    layer: l,
                    expert: ids[0],
                    msg: format!("asked for {} experts, got {}", ids.len(), views.len()),
                });
            }
            for (&j, ew) in ids.iter().zip(&views) {
                if (ew.w1.rows, ew.w1.cols, ew.w2.rows, ew.w2.cols) != (2 * inter, d, d, inter) {
                    return Err(ModelError::Expert {
                        layer: l,
                        expert: j,
                        msg: format!(
                            "gate-up {}x{} and down {}x{}, expected {}x{d} and {d}x{inter}",
                            ew.w1.rows,
                            ew.w1.cols,
                            ew.w2.rows,
                            ew.w2.cols,
                            2 * inter
                        ),
                    });
                }
                profile::read(ew.w1.nbytes() + ew.w2.nbytes());
            }
            let m = &mut es.chunk;
            m.clear();
            m.extend(ids.iter().map(|&j| routes[j].len()));
            let rows: usize = m.iter().sum();
            let xin = &mut es.xin;
            xin.clear();
            for &j in ids {
                for &r in &routes[j] {
                    let i = r / k;
                    xin.extend_from_slice(&x[i * d..(i + 1) * d]);
                }
            }
            // A matrix stored rotated multiplies `V_in·x` (its rows in place in the copy).
            let mut off = 0;
            for (ew, &mi) in views.iter().zip(m.iter()) {
                if let Some(r) = ew.rht.w1 {
                    r.input.forward(&mut xin[off..off + mi * d])?;
                }
                off += mi * d;
            }
            let gu = zeroed(&mut es.g, rows * 2 * inter);
            {
                let mut jobs: Vec<Job<'_, '_>> = recycle(take(&mut es.jobs));
                let (mut xs, mut gs) = (&xin[..], &mut gu[..]);
                for (ew, &mi) in views.iter().zip(m.iter()) {
                    let (xa, xr) = xs.split_at(mi * d);
                    let (ga, gr) = take(&mut gs).split_at_mut(mi * 2 * inter);
                    (xs, gs) = (xr, gr);
                    jobs.push(Job::view(&ew.w1, xa, mi, ga)?);
                }
                matmul_many_with(kernels, &mut jobs)?;
                es.jobs = recycle(jobs);
            }
            let mut off = 0;
            for (ew, &mi) in views.iter().zip(m.iter()) {
                rht_output(ew.rht.w1, &mut gu[off..off + mi * 2 * inter])?;
                off += mi * 2 * inter;
            }
            let act = zeroed(&mut es.act, rows * inter);
            let mut row = 0;
            for (&j, &mi) in ids.iter().zip(m.iter()) {
                let b = &self.gate_up_bias[j * 2 * inter..(j + 1) * 2 * inter];
                for _ in 0..mi {
                    let g = &gu[row * 2 * inter..(row + 1) * 2 * inter];
                    let a = &mut act[row * inter..(row + 1) * inter];
                    for (q, a) in a.iter_mut().enumerate() {
                        *a = swiglu(
                            g[2 * q] + b[2 * q],
                            g[2 * q + 1] + b[2 * q + 1],
                            alpha,
                            limit,
                        );
                    }
                    row += 1;
                }
            }
            // Each expert's down-matrix inputs (`ffn.experts.w2`: the imatrix keep quant weights
            // the down matrix's codes by), then rotated where that matrix is stored rotated.
            let mut off = 0;
            for ((ew, &mi), &j) in views.iter().zip(m.iter()).zip(ids) {
                let seg = &mut act[off..off + mi * inter];
                note_input(obs, l, "ffn.experts.w2", Some(j), seg, mi, inter);
                if let Some(r) = ew.rht.w2 {
                    r.input.forward(seg)?;
                }
                off += mi * inter;
            }
            let y = zeroed(&mut es.out, rows * d);
            {
                let mut jobs: Vec<Job<'_, '_>> = recycle(take(&mut es.jobs));
                let (mut xs, mut ys_) = (&act[..], &mut y[..]);
                for (ew, &mi) in views.iter().zip(m.iter()) {
                    let (xa, xr) = xs.split_at(mi * inter);
                    let (ya, yr) = take(&mut ys_).split_at_mut(mi * d);
                    (xs, ys_) = (xr, yr);
                    jobs.push(Job::view(&ew.w2, xa, mi, ya)?);
                }
                matmul_many_levels(kernels, crate::layer::DOWN_ACTS, &mut jobs)?;
                es.jobs = recycle(jobs);
            }
            let mut off = 0;
            for (ew, &mi) in views.iter().zip(m.iter()) {
                rht_output(ew.rht.w2, &mut y[off..off + mi * d])?;
                off += mi * d;
            }
            let mut row = 0;
            for &j in ids {
                let b = &self.down_bias[j * d..(j + 1) * d];
                for &r in &routes[j] {
                    let dst = &mut ys[r * d..(r + 1) * d];
                    for ((o, v), b) in dst.iter_mut().zip(&y[row * d..(row + 1) * d]).zip(b) {
                        *o = v + b;
                    }
                    row += 1;
                }
            }
        }
        es.views = recycle(views);
        Ok(())
    }
}

/// The clamped SwiGLU of one (gate, up) pair: `(clamp(up, −limit, limit) + 1) ·
/// g · σ(alpha · g)` with `g = min(gate, limit)`.
#[inline]
pub fn swiglu(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    (u + 1.0) * (g * ops::sigmoid(alpha * g))
}

/// `GptOssTopKRouter.forward` for one token: `chosen` the top-k of `logits` (router output plus
/// bias; experts marked dead in `mask` never chosen; ties to the lower id), ordered by logit;
/// `weights` the softmax over the chosen logits.
pub fn route(logits: &[f32], mask: Option<&[bool]>, chosen: &mut [u32], weights: &mut [f32]) {
    route_with(logits, mask, chosen, weights, &mut Vec::new())
}

/// [`route`] with `cand` as scratch.
fn route_with(
    logits: &[f32],
    mask: Option<&[bool]>,
    chosen: &mut [u32],
    weights: &mut [f32],
    cand: &mut Vec<(f32, usize)>,
) {
    cand.clear();
    cand.extend(logits.iter().enumerate().map(|(j, &v)| {
        if mask.is_some_and(|m| m[j]) {
            (f32::NEG_INFINITY, j)
        } else {
            (v, j)
        }
    }));
    let k = chosen.len();
    top_k_by(cand, k);
    for s in 0..k {
        chosen[s] = cand[s].1 as u32;
        weights[s] = cand[s].0;
    }
    ops::softmax(weights);
}

/// Embedding, final norm and head under Hugging Face's names (one residual stream).
pub fn globals<'a>(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Globals<'a>> {
    let c = family_config(cfg)?;
    let embed = weight(ck, EMBED, cfg.vocab, cfg.dim, None)?;
    Ok(Globals {
        embed,
        head: if c.tie_word_embeddings {
            embed
        } else {
            weight(ck, HEAD, cfg.vocab, cfg.dim, None)?
        },
        norm: vec_f32(ck, NORM, cfg.dim)?,
        hc_head: None,
    })
}

/// The routed experts as views of the checkpoint's MXFP4 stacks (resolved and shape-checked
/// once; nothing copied): `w1` expert `e`'s `[2·intermediate × hidden]` slice of
/// `gate_up_proj_blocks` / `_scales`, `w2` its `[hidden × intermediate]` slice of `down_proj_*`,
/// `w3` empty; an expert `keep quant` coded is read from its own `mlp.experts.E.gate_up_proj.*`
/// and `down_proj.*` instead (keep-checkpoint's `layout::expert_matrix` decides).
pub struct GptOssExperts<'a> {
    per_layer: Vec<Vec<ExpertWeights<'a>>>,
}

impl<'a> GptOssExperts<'a> {
    /// Resolve every expert of every layer: its slices of the stacks, or its own tensors where
    /// `keep quant` coded it (E8P codes with their residual stage and incoherence transforms).
    pub fn new(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Self> {
        let c = family_config(cfg)?;
        let marker = crate::experts::incoherence_map(ck)?;
        let mut per_layer = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let mut layer = Vec::with_capacity(c.num_local_experts);
            for e in 0..c.num_local_experts {
                let view = |s: Stack| -> Result<WeightView<'a>> {
                    let mat = match s {
                        Stack::GateUp => ExpertMat::W1,
                        Stack::Down => ExpertMat::W2,
                    };
                    let em = keep_checkpoint::layout::expert_matrix(ck, &cfg.raw, l, e, mat)
                        .map_err(|msg| ModelError::Expert {
                            layer: l,
                            expert: e,
                            msg,
                        })?;
                    let resid = keep_checkpoint::layout::residual_of(ck, em.weight.name);
                    let (rows, cols) = s.shape(c);
                    crate::weights::expert_view(&em, resid, rows, cols, None)
                };
                layer.push(ExpertWeights {
                    w1: view(Stack::GateUp)?,
                    w2: view(Stack::Down)?,
                    w3: WeightView::f32(&[], 0, 0)?,
                    rht: coded_rht(&marker, &cfg.raw, l, e)?,
                });
            }
            per_layer.push(layer);
        }
        Ok(GptOssExperts { per_layer })
    }
}

impl ExpertSource for GptOssExperts<'_> {
    fn experts_into<'s>(
        &'s self,
        layer: usize,
        experts: &[usize],
        out: &mut Vec<ExpertWeights<'s>>,
    ) -> Result<()> {
        for &e in experts {
            out.push(self.expert(layer, e)?);
        }
        Ok(())
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        self.per_layer
            .get(layer)
            .and_then(|v| v.get(expert))
            .copied()
            .ok_or_else(|| ModelError::Expert {
                layer,
                expert,
                msg: "no such expert".into(),
            })
    }
}

/// The gpt-oss family's decoder-layer side ([`LayerFamily`]): its layers are [`GptOssLayer`], its embedding, norm and head [`globals`], its experts [`GptOssExperts`].
#[derive(Debug, Clone, Copy)]
pub struct GptOss;

impl crate::config::Family {
    /// The gpt-oss family's forward (the checkpoint family [`keep_checkpoint::families::gpt_oss::GptOss`]).
    #[allow(non_upper_case_globals)]
    pub const GptOss: crate::config::Family =
        crate::config::Family::HuggingFace(&keep_checkpoint::families::gpt_oss::GptOss);
}

impl LayerFamily for GptOss {
    fn load_layer<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Box<dyn DecoderLayer + 'a>> {
        Ok(Box::new(GptOssLayer::load(ck, cfg, layer)?))
    }

    /// Every position's keys and values; a sliding layer's window (the last `window - 1`
    /// positions, plus a chunk appended before the oldest are dropped).
    fn kv_floats(&self, cfg: &ModelConfig, layer: usize, context: usize, chunk: usize) -> usize {
        family_config(cfg).map_or(0, |g| {
            let rows = g
                .window(layer)
                .map_or(context, |w| (w - 1 + chunk).min(context));
            rows * g.num_key_value_heads * cfg.head_dim
        })
    }

    fn globals<'a>(&self, ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Globals<'a>> {
        globals(ck, cfg)
    }

    fn experts<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        _layers: std::ops::Range<usize>,
    ) -> Result<Box<dyn ExpertSource + 'a>> {
        Ok(Box::new(GptOssExperts::new(ck, cfg)?))
    }
}

impl DecoderLayer for GptOssLayer<'_> {
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
        GptOssLayer::forward_into(self, cfg, experts, mask, x, start_pos, kv, obs, sc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_clamps_the_gate_above_and_the_up_both_ways() {
        let (a, lim) = (1.702f32, 7.0f32);
        let f = |g: f32, u: f32| (u + 1.0) * g / (1.0 + (-a * g).exp());
        assert_eq!(swiglu(2.0, 3.0, a, lim), f(2.0, 3.0));
        assert_eq!(swiglu(9.0, 3.0, a, lim), f(7.0, 3.0));
        assert_eq!(swiglu(-9.0, 3.0, a, lim), f(-9.0, 3.0));
        assert_eq!(swiglu(2.0, 9.0, a, lim), f(2.0, 7.0));
        assert_eq!(swiglu(2.0, -9.0, a, lim), f(2.0, -7.0));
    }

    #[test]
    fn router_softmaxes_the_chosen_logits_only() {
        let logits = [0.5, 3.0, -1.0, 2.0];
        let (mut ch, mut w) = ([0u32; 2], [0f32; 2]);
        route(&logits, None, &mut ch, &mut w);
        assert_eq!(ch, [1, 3]);
        let z = 1.0 + (-1.0f32).exp();
        assert!((w[0] - 1.0 / z).abs() < 1e-6 && (w[1] - (-1.0f32).exp() / z).abs() < 1e-6);
        route(&logits, Some(&[false, true, false, false]), &mut ch, &mut w);
        assert_eq!(ch, [3, 0]);
    }
}
