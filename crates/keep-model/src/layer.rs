//! One decoder layer of DeepSeek-V4.1: its weights ([`LayerWeights`], views into the checkpoint)
//! and its forward ([`LayerWeights::forward`]), following `DecoderLayer.__call__` of mlx-lm's
//! `deepseek_v41.py`: hyper-connection mixes (RMS-normalised, sigmoid pre/post, softmax then
//! sinkhorn comb), collapse, attention (low-rank q, shared KV, interleaved RoPE on the trailing
//! dims, sliding window with sinks, compressor, indexer with candidate blocks, sparse attention
//! over window + selected compressed rows, inverse RoPE, grouped `wo_a`, `wo_b`), expand, then
//! the MoE (router with bias-corrected top-k, clamped SwiGLU experts, shared expert).
//!
//! A DeepSeek-V4 / V4-Flash layer (`Family::V4`) runs the same skeleton with transformers'
//! differences: the pre-mix of each block comes from its own hyper-connection (not the previous
//! block's), the queries get an unweighted per-head RMSNorm, KV rows are not fake-quantised,
//! the compressed rows come from this layer's own CSA/HCA compressor ([`crate::v4`]), and the
//! first `num_hash_layers` layers route by token id ([`crate::hash`]).
//!
//! The whole-model forward and the layer-streamed forward both call this one function, which is
//! what makes them bit-identical.

use std::borrow::Cow;

use keep_checkpoint::Checkpoint;
use keep_kernels::attend::{self, attend_one, Heads, Scale, SharedRows};
use keep_kernels::matmul::{matmul_many_levels, matmul_many_with};
use keep_kernels::ops::{self, Rope};
use keep_kernels::profile::{self, Part};
use keep_kernels::scratch::recycle;
use keep_kernels::simd::Job;
use keep_kernels::ActLevels;
use keep_kernels::{matmul, Kernels, WeightView};

use crate::cache::LayerCache;
use crate::config::{Family, LayerRoles, ModelConfig, Scoring};
use crate::experts::{rht_input, rht_output, ExpertSource, ExpertWeights, Rung};
use crate::hash::{route_hash, HashTable};
pub use crate::linear::top_k_by;
use crate::linear::{lin_into, note_input, proj_into};
use crate::observer::{
    CandidateOutputEvent, ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver, RungEvent,
};
use crate::scratch::{zeroed, ExpertScratch, Scratch};
use crate::sidecar::Sidecar;
use crate::v4::{head_norm, index_topk_into, pool_step_with, V4Attn};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// Hyper-connection parameters (`hc_{attn,ffn}_{fn,base,scale}`).
pub struct Hc<'a> {
    pub fn_: WeightView<'a>,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

/// The compressor of a KV-source layer.
pub struct Compressor<'a> {
    pub wkv: WeightView<'a>,
    pub wgate: Option<WeightView<'a>>,
    pub norm: Vec<f32>,
}

/// The indexer of an index-source layer.
pub struct Indexer<'a> {
    pub wq_b: WeightView<'a>,
    pub weights_proj: WeightView<'a>,
    /// Index-key projection and norm (KV-source layers only).
    pub wk: Option<(WeightView<'a>, Vec<f32>)>,
}

/// Per-layer router mask: experts that can never be chosen (the hook that makes a masked model equal its pruned checkpoint).
pub type RouterMask = Option<Vec<bool>>;

/// The weights of one layer (routed experts excluded: they come from an [`ExpertSource`]).
pub struct LayerWeights<'a> {
    pub layer: usize,
    pub roles: LayerRoles,
    pub rope: Rope,
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: Hc<'a>,
    pub hc_ffn: Hc<'a>,
    pub wq_a: WeightView<'a>,
    pub q_norm: Vec<f32>,
    pub wq_b: WeightView<'a>,
    pub wkv: WeightView<'a>,
    pub kv_norm: Vec<f32>,
    pub wo_a: WeightView<'a>,
    pub wo_b: WeightView<'a>,
    pub sinks: Vec<f32>,
    pub compressor: Option<Compressor<'a>>,
    pub indexer: Option<Indexer<'a>>,
    pub gate: WeightView<'a>,
    /// Empty on a hash-routed layer.
    pub gate_bias: Vec<f32>,
    pub shared: [WeightView<'a>; 3],
    /// V4: this layer's compressor and indexer (`None`: window only, or a V4.1 layer).
    pub v4: Option<V4Attn<'a>>,
    /// V4-Flash: the layer's `tid2eid` table (hash-routed layers only).
    pub hash: Option<HashTable>,
    /// The reduced-rank sidecar added to the MoE block's output (`keep sidecar`; `None`:
    /// none, the block runs as the checkpoint's experts alone).
    pub sidecar: Option<Sidecar>,
}

/// What one forward call shares between layers (the reference's `shared` dict), and the
/// call's working buffers.
#[derive(Default)]
pub struct Shared {
    /// Layer whose cache holds the compressed KV the next layers read.
    pub compress_kv: Option<usize>,
    /// Layer whose cache holds the index keys.
    pub index_k: Option<usize>,
    /// k of the top-k compressed rows per query (`topk_rows`).
    pub topk: Option<usize>,
    /// Top-k compressed rows per query `[T × k]` (-1: none).
    pub topk_rows: Vec<i32>,
    /// n of the candidate mask over index keys (`candidate_mask`).
    pub candidates: Option<usize>,
    /// Candidate mask `[T × n]` over index keys.
    pub candidate_mask: Vec<bool>,
    /// The forward's working buffers (a [`crate::Cache`]'s, lent for the call; what the layers
    /// pass on lives in the fields above, never here).
    pub scratch: Scratch,
}

impl Shared {
    /// The state of a new forward call whose products run on `kernels`, over an empty scratch.
    pub fn on(kernels: Kernels) -> Shared {
        Shared::with(Scratch::on(kernels))
    }

    /// The state of a new forward call over `scratch` (nothing shared yet; the shared rows'
    /// buffers are the scratch's spare ones).
    pub fn with(mut scratch: Scratch) -> Shared {
        Shared {
            topk_rows: std::mem::take(&mut scratch.topk),
            candidate_mask: std::mem::take(&mut scratch.candidates),
            scratch,
            ..Shared::default()
        }
    }

    /// The working buffers back, with the shared rows' buffers as spares.
    pub fn into_scratch(self) -> Scratch {
        let mut sc = self.scratch;
        (sc.topk, sc.candidates) = (self.topk_rows, self.candidate_mask);
        sc.topk.clear();
        sc.candidates.clear();
        sc
    }
}

/// The hidden state between layers: `hc` residual streams per token and the pre-mix the next
/// layer collapses them with.
#[derive(Debug, Clone, Default)]
pub struct Streams {
    pub t: usize,
    /// `[T × hc × dim]`.
    pub x: Vec<f32>,
    /// `[T × hc]`.
    pub pre_mix: Vec<f32>,
    /// The token ids (hash-routed layers pick their experts from them).
    pub tokens: Vec<u32>,
}

impl Streams {
    /// A copy of tokens `a..b`.
    pub fn rows(&self, a: usize, b: usize) -> Streams {
        let w = self.x.len() / self.t.max(1);
        let m = self.pre_mix.len() / self.t.max(1);
        Streams {
            t: b - a,
            x: self.x[a * w..b * w].to_vec(),
            pre_mix: self.pre_mix[a * m..b * m].to_vec(),
            tokens: self.tokens[a..b].to_vec(),
        }
    }

    /// Write `part` (a [`Streams::rows`] copy, computed on) back over tokens `a..`.
    pub fn set_rows(&mut self, a: usize, part: &Streams) {
        let w = self.x.len() / self.t.max(1);
        let m = self.pre_mix.len() / self.t.max(1);
        self.x[a * w..(a + part.t) * w].copy_from_slice(&part.x);
        self.pre_mix[a * m..(a + part.t) * m].copy_from_slice(&part.pre_mix);
    }

    /// Refuse to go on once the hidden state holds a NaN or an infinity (a NaN scale, router or
    /// embedding in the checkpoint): `at` names where ("layer 3", "the embedding").
    pub fn check_finite(&self, at: impl FnOnce() -> String) -> Result<()> {
        if self.x.iter().chain(&self.pre_mix).all(|v| v.is_finite()) {
            Ok(())
        } else {
            Err(ModelError::NonFinite(at()))
        }
    }
}

/// The rows of source layer `src`'s compressed cache (`held` of them) that exist once the
/// tokens up to the end of this pass are in: all of them in the whole model, which runs every
/// layer on a chunk before the next chunk; in the layer-streamed path, which runs a layer on
/// every chunk before the next layer, the source already holds later chunks' rows, and these
/// are not counted (no query of this pass can see them).
fn visible(cfg: &ModelConfig, src: usize, held: usize, step: Step, t: usize) -> usize {
    held.min((step.start_pos + t) / cfg.roles[src].ratio.max(1))
}

/// Position information of one forward call.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    /// Position of the first new token.
    pub start_pos: usize,
    /// Window rows held before this call (`min(start_pos, window)`).
    pub previous: usize,
}

fn hc_load<'a>(ck: &'a Checkpoint, p: &str, k: &str, cfg: &ModelConfig) -> Result<Hc<'a>> {
    let mix = (2 + cfg.hc) * cfg.hc;
    let name = format!("{p}hc_{k}_fn");
    let t = crate::weights::tensor(ck, &name)?;
    let fn_ = crate::weights::view(t, None, mix, cfg.hc * cfg.dim, None)?;
    Ok(Hc {
        fn_,
        base: vec_f32(ck, &format!("{p}hc_{k}_base"), mix)?,
        scale: vec_f32(ck, &format!("{p}hc_{k}_scale"), 3)?,
    })
}

impl<'a> LayerWeights<'a> {
    /// Resolve and check the weights of `layer`.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Self> {
        Self::load_at(ck, cfg, layer, &format!("layers.{layer}."))
    }

    /// Resolve the weights of a block stored under `p` (`"layers.3."`, `"mtp.0."`) that runs as
    /// layer `layer` of `cfg` (its roles, RoPE and cache slot).
    pub fn load_at(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize, p: &str) -> Result<Self> {
        let p = p.to_string();
        let hint = cfg.raw.weight_block_size();
        let roles = cfg.roles[layer];
        let (d, h, hd) = (cfg.dim, cfg.heads, cfg.head_dim);
        let v4 = cfg.family == Family::V4;
        if !cfg.is_hash(layer) && ck.contains(&format!("{p}ffn.gate.tid2eid")) {
            return Err(ModelError::Unsupported {
                key: "num_hash_layers".into(),
                msg: format!(
                    "layer {layer} has `ffn.gate.tid2eid` but the config makes only layers \
                     0..{} hash-routed",
                    cfg.hash_layers
                ),
            });
        }
        let w = |n: &str, r: usize, c: usize| weight(ck, &format!("{p}{n}"), r, c, hint);
        let v = |n: &str, len: usize| vec_f32(ck, &format!("{p}{n}"), len);
        let compressor = if !v4 && roles.kv_source && roles.ratio > 0 {
            Some(Compressor {
                wkv: w("attn.compressor.wkv", hd, d)?,
                wgate: if roles.ratio > 1 {
                    Some(w("attn.compressor.wgate", hd, d)?)
                } else {
                    None
                },
                norm: v("attn.compressor.norm.weight", hd)?,
            })
        } else {
            None
        };
        let indexer = if !v4 && roles.index_source && roles.ratio > 0 {
            let (ih, ihd) = (cfg.index_heads, cfg.index_head_dim);
            Some(Indexer {
                wq_b: w("attn.indexer.wq_b", ih * ihd, cfg.q_lora)?,
                weights_proj: w("attn.indexer.weights_proj", ih, d)?,
                wk: if roles.kv_source {
                    Some((
                        w("attn.indexer.wk", ihd, hd)?,
                        v("attn.indexer.k_norm.weight", ihd)?,
                    ))
                } else {
                    None
                },
            })
        } else {
            None
        };
        let ig = h * hd / cfg.o_groups;
        Ok(LayerWeights {
            layer,
            roles,
            rope: cfg.rope(layer),
            attn_norm: v("attn_norm.weight", d)?,
            ffn_norm: v("ffn_norm.weight", d)?,
            hc_attn: hc_load(ck, &p, "attn", cfg)?,
            hc_ffn: hc_load(ck, &p, "ffn", cfg)?,
            wq_a: w("attn.wq_a", cfg.q_lora, d)?,
            q_norm: v("attn.q_norm.weight", cfg.q_lora)?,
            wq_b: w("attn.wq_b", h * hd, cfg.q_lora)?,
            wkv: w("attn.wkv", hd, d)?,
            kv_norm: v("attn.kv_norm.weight", hd)?,
            wo_a: w("attn.wo_a", cfg.o_groups * cfg.o_lora, ig)?,
            wo_b: w("attn.wo_b", d, cfg.o_groups * cfg.o_lora)?,
            sinks: v("attn.attn_sink", h)?,
            compressor,
            indexer,
            gate: w("ffn.gate", cfg.experts_in_layer(layer), d)?,
            gate_bias: if cfg.is_hash(layer) {
                vec![]
            } else {
                v("ffn.gate.bias", cfg.experts_in_layer(layer))?
            },
            shared: [
                w("ffn.shared_experts.w1", cfg.inter, d)?,
                w("ffn.shared_experts.w2", d, cfg.inter)?,
                w("ffn.shared_experts.w3", cfg.inter, d)?,
            ],
            v4: if v4 {
                V4Attn::load(ck, cfg, layer)?
            } else {
                None
            },
            hash: if cfg.is_hash(layer) {
                Some(HashTable::load(ck, cfg, layer)?)
            } else {
                None
            },
            sidecar: Sidecar::load(ck, &p, d)?,
        })
    }
}

impl LayerWeights<'_> {
    /// Route this hash-routed layer by `table` instead of the checkpoint's `tid2eid` (a pruning
    /// plan's remap, in the checkpoint's expert ids). Refused on a top-k layer and for a table
    /// of another shape.
    pub fn replace_hash_table(&mut self, cfg: &ModelConfig, table: HashTable) -> Result<()> {
        let l = self.layer;
        if self.hash.is_none() {
            return Err(ModelError::Config(format!(
                "layer {l} is not hash-routed: it has no tid2eid table to replace"
            )));
        }
        if table.vocab != cfg.vocab
            || table.top_k != cfg.top_k
            || table.ids.len() != cfg.vocab * cfg.top_k
            || table
                .ids
                .iter()
                .any(|&j| j as usize >= cfg.experts_in_layer(l))
        {
            return Err(ModelError::Config(format!(
                "layer {l}: a replacement tid2eid table must be [{} × {}] with ids below {}",
                cfg.vocab,
                cfg.top_k,
                cfg.experts_in_layer(l)
            )));
        }
        self.hash = Some(table);
        Ok(())
    }
}

/// `HyperConnection.__call__`: (pre `[T×hc]`, post `[T×hc]`, comb `[T×hc×hc]`).
pub(crate) fn hc_mix(
    hcw: &Hc,
    s: &Streams,
    cfg: &ModelConfig,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let (mut flat, mut mix) = (Vec::new(), Vec::new());
    let (mut pre, mut post, mut comb) = (Vec::new(), Vec::new(), Vec::new());
    hc_mix_into(
        hcw, s, cfg, &mut flat, &mut mix, &mut pre, &mut post, &mut comb,
    )?;
    Ok((pre, post, comb))
}

/// [`hc_mix`] into `pre`, `post`, `comb` (`flat`, `mix`: scratch).
#[allow(clippy::too_many_arguments)]
pub(crate) fn hc_mix_into(
    hcw: &Hc,
    s: &Streams,
    cfg: &ModelConfig,
    flat: &mut Vec<f32>,
    mix: &mut Vec<f32>,
    pre: &mut Vec<f32>,
    post: &mut Vec<f32>,
    comb: &mut Vec<f32>,
) -> Result<()> {
    let _p = profile::span(Part::HyperConn);
    let (t, hc, d) = (s.t, cfg.hc, cfg.dim);
    flat.clear();
    flat.extend_from_slice(&s.x);
    crate::linear::rms_norm(flat, hc * d, None, cfg.eps);
    let nm = (2 + hc) * hc;
    let mix = zeroed(mix, t * nm);
    profile::read(hcw.fn_.nbytes());
    matmul(flat, t, &hcw.fn_, mix)?;
    let pre = zeroed(pre, t * hc);
    let post = zeroed(post, t * hc);
    let comb = zeroed(comb, t * hc * hc);
    for i in 0..t {
        let m = &mut mix[i * nm..(i + 1) * nm];
        for (j, v) in m.iter_mut().enumerate() {
            let sid = if j < hc {
                0
            } else if j < 2 * hc {
                1
            } else {
                2
            };
            *v = *v * hcw.scale[sid] + hcw.base[j];
        }
        for j in 0..hc {
            pre[i * hc + j] = ops::sigmoid(m[j]) + cfg.hc_eps;
            post[i * hc + j] = 2.0 * ops::sigmoid(m[hc + j]);
        }
        let _sk = profile::span(Part::Sinkhorn);
        let c = &mut comb[i * hc * hc..(i + 1) * hc * hc];
        c.copy_from_slice(&m[2 * hc..]);
        for row in c.chunks_exact_mut(hc) {
            ops::softmax(row);
            for v in row.iter_mut() {
                *v += cfg.hc_eps;
            }
        }
        ops::sinkhorn(c, hc, cfg.hc_iters, cfg.hc_eps);
    }
    Ok(())
}

/// `_collapse`: `Σ_k mix[k] · streams[k]` per token.
pub(crate) fn collapse(s: &Streams, mix: &[f32], hc: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::new();
    collapse_into(s, mix, hc, d, &mut out);
    out
}

/// [`collapse`] into `out`.
pub(crate) fn collapse_into(s: &Streams, mix: &[f32], hc: usize, d: usize, out: &mut Vec<f32>) {
    let _p = profile::span(Part::HyperConn);
    let out = zeroed(out, s.t * d);
    for i in 0..s.t {
        let o = &mut out[i * d..(i + 1) * d];
        for k in 0..hc {
            let m = mix[i * hc + k];
            let src = &s.x[(i * hc + k) * d..(i * hc + k + 1) * d];
            for (a, b) in o.iter_mut().zip(src) {
                *a += m * b;
            }
        }
    }
}

/// `_expand`: `streams'[j] = post[j] · x + Σ_i comb[i, j] · streams[i]` per token.
pub(crate) fn expand(x: &[f32], s: &mut Streams, post: &[f32], comb: &[f32], hc: usize, d: usize) {
    expand_with(x, s, post, comb, hc, d, &mut Vec::new())
}

/// [`expand`] with `mixed` as scratch.
pub(crate) fn expand_with(
    x: &[f32],
    s: &mut Streams,
    post: &[f32],
    comb: &[f32],
    hc: usize,
    d: usize,
    mixed: &mut Vec<f32>,
) {
    let _p = profile::span(Part::HyperConn);
    let mixed = zeroed(mixed, hc * d);
    for i in 0..s.t {
        mixed.iter_mut().for_each(|v| *v = 0.0);
        let res = &s.x[i * hc * d..(i + 1) * hc * d];
        for j in 0..hc {
            let mj = &mut mixed[j * d..(j + 1) * d];
            for a in 0..hc {
                let c = comb[(i * hc + a) * hc + j];
                for (m, r) in mj.iter_mut().zip(&res[a * d..(a + 1) * d]) {
                    *m += c * r;
                }
            }
        }
        let xi = &x[i * d..(i + 1) * d];
        let out = &mut s.x[i * hc * d..(i + 1) * hc * d];
        for j in 0..hc {
            let p = post[i * hc + j];
            for ((o, m), xv) in out[j * d..(j + 1) * d]
                .iter_mut()
                .zip(&mixed[j * d..(j + 1) * d])
                .zip(xi)
            {
                *o = p * xv + m;
            }
        }
    }
}

impl LayerWeights<'_> {
    /// Run this layer on `s` (in place), updating `caches[self.layer]` and `shared`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        s: &mut Streams,
        step: Step,
        caches: &mut [LayerCache],
        shared: &mut Shared,
        mut obs: Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        let (hc, d) = (cfg.hc, cfg.dim);
        // Every intermediate lives in the call's scratch: a buffer the next op needs while
        // `shared` is lent again is taken out (no allocation) and put back after.
        let v4 = cfg.family == Family::V4;
        let sc = &mut shared.scratch;
        hc_mix_into(
            &self.hc_attn,
            s,
            cfg,
            &mut sc.hc_flat,
            &mut sc.hc_mix,
            &mut sc.attn_pre,
            &mut sc.post,
            &mut sc.comb,
        )?;
        // V4 collapses with its own pre-mix, V4.1 with the previous block's.
        let mix = if v4 { &sc.attn_pre } else { &s.pre_mix };
        collapse_into(s, mix, hc, d, &mut sc.h);
        crate::linear::rms_norm(&mut sc.h, d, Some(&self.attn_norm), cfg.eps);
        let h = std::mem::take(&mut sc.h);
        let mut a = std::mem::take(&mut sc.block_out);
        if v4 {
            self.attention_v4_into(cfg, &h, s.t, step, caches, &mut obs, sc, &mut a)?;
        } else {
            self.attention_into(cfg, &h, s.t, step, caches, shared, &mut obs, &mut a)?;
        }
        let sc = &mut shared.scratch;
        expand_with(&a, s, &sc.post, &sc.comb, hc, d, &mut sc.mixed);

        hc_mix_into(
            &self.hc_ffn,
            s,
            cfg,
            &mut sc.hc_flat,
            &mut sc.hc_mix,
            &mut sc.pre,
            &mut sc.post,
            &mut sc.comb,
        )?;
        let mut h = h;
        let mix = if v4 { &sc.pre } else { &sc.attn_pre };
        collapse_into(s, mix, hc, d, &mut h);
        crate::linear::rms_norm(&mut h, d, Some(&self.ffn_norm), cfg.eps);
        let mut m = a;
        self.moe_into(
            cfg, experts, mask, &h, &s.tokens, step, &mut obs, sc, &mut m,
        )?;
        expand_with(&m, s, &sc.post, &sc.comb, hc, d, &mut sc.mixed);
        if !v4 {
            s.pre_mix.clear();
            s.pre_mix.extend_from_slice(&sc.pre);
        }
        (sc.h, sc.block_out) = (h, m);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        cfg: &ModelConfig,
        x: &[f32],
        t: usize,
        step: Step,
        caches: &mut [LayerCache],
        shared: &mut Shared,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.attention_into(cfg, x, t, step, caches, shared, obs, &mut out)?;
        Ok(out)
    }

    /// [`LayerWeights::attention`] into `y` (`[t × dim]`), its intermediates in
    /// `shared.scratch`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_into(
        &self,
        cfg: &ModelConfig,
        x: &[f32],
        t: usize,
        step: Step,
        caches: &mut [LayerCache],
        shared: &mut Shared,
        obs: &mut Option<&mut dyn RouteObserver>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let _p = profile::span(Part::AttnProj);
        let l = self.layer;
        let (h, hd, ql) = (cfg.heads, cfg.head_dim, cfg.q_lora);
        let sc = &mut shared.scratch;
        let k = sc.kernels;
        // `wq_a` and `wkv` read the same input: one pass.
        crate::linear::projs_into(
            k,
            x,
            t,
            [
                (&self.wq_a, "attn.wq_a", &mut sc.qr),
                (&self.wkv, "attn.wkv", &mut sc.kv),
            ],
            obs,
            l,
        )?;
        crate::linear::rms_norm(&mut sc.qr, ql, Some(&self.q_norm), cfg.eps);
        proj_into(
            k,
            &sc.qr,
            t,
            &self.wq_b,
            obs,
            l,
            "attn.wq_b",
            None,
            &mut sc.q,
        )?;
        for i in 0..t {
            let pos = (step.start_pos + i) as f32;
            for hh in 0..h {
                let o = (i * h + hh) * hd;
                self.rope.apply(&mut sc.q[o..o + hd], pos, false);
            }
        }
        let kv = &mut sc.kv;
        crate::linear::rms_norm(kv, hd, Some(&self.kv_norm), cfg.eps);
        for i in 0..t {
            let row = &mut kv[i * hd..(i + 1) * hd];
            self.rope.apply(row, (step.start_pos + i) as f32, false);
        }
        let before = obs
            .as_ref()
            .is_some_and(|o| o.wants_kv_fp8())
            .then(|| kv.clone());
        for row in kv.chunks_exact_mut(hd) {
            ops::fake_quant_fp8(row, 32);
        }
        if let (Some(before), Some(o)) = (before, obs.as_mut()) {
            o.on_kv_fp8(&crate::observer::KvFp8Event {
                layer: l,
                start_pos: step.start_pos,
                rows: t,
                cols: hd,
                before: &before,
                after: kv,
            });
        }
        // The window with the new rows appended (truncated after attending).
        {
            let c = &mut caches[l];
            if c.window_rows != step.previous {
                return Err(ModelError::Cache(format!(
                    "layer {l} holds {} window rows, the model expects {}",
                    c.window_rows, step.previous
                )));
            }
            c.window.extend_from_slice(kv);
            c.window_rows += t;
        }

        if self.roles.ratio > 0 {
            if self.compressor.is_some() {
                self.compress(cfg, x, t, step, caches, shared, obs)?;
            }
            if let Some(ix) = &self.indexer {
                let qr = std::mem::take(&mut shared.scratch.qr);
                let k = self.index(cfg, ix, x, &qr, t, step, caches, shared, obs);
                shared.scratch.qr = qr;
                shared.topk = Some(k?);
            }
        }

        // Sparse attention over the window rows and the selected compressed rows.
        let scale = (hd as f32).powf(-0.5);
        let window = &caches[l].window;
        let sc = &mut shared.scratch;
        let comp: Option<(&[f32], &[i32], usize)> = if self.roles.ratio > 0 {
            match (shared.compress_kv, shared.topk) {
                (Some(src), Some(k))
                    if k > 0 && visible(cfg, src, caches[src].n_compressed, step, t) > 0 =>
                {
                    Some((&caches[src].compress_kv[..], &shared.topk_rows[..], k))
                }
                _ => None,
            }
        } else {
            None
        };
        let scores_span = profile::span(Part::AttnScores);
        let out = zeroed(&mut sc.heads, t * h * hd);
        let (keys, scores) = (&mut sc.keys, &mut sc.scores);
        let q = &sc.q;
        for i in 0..t {
            let end = step.previous + i;
            let start = (end + 1).saturating_sub(cfg.window);
            keys.clear();
            // Window rows are ids 0.., compressed rows are ids offset by 1<<40.
            keys.extend(start..=end);
            if let Some((_, idx, k)) = comp {
                for &j in &idx[i * k..(i + 1) * k] {
                    if j >= 0 {
                        keys.push((1usize << 40) + j as usize);
                    }
                }
            }
            let row = |r: usize| -> &[f32] {
                let key = keys[r];
                if key >= 1 << 40 {
                    let j = key - (1 << 40);
                    &comp.unwrap().0[j * hd..(j + 1) * hd]
                } else {
                    &window[key * hd..(key + 1) * hd]
                }
            };
            profile::read(keys.len() * hd * 4);
            let shape = Heads {
                queries: 1,
                heads: h,
                head_dim: hd,
                group: h,
            };
            let (qi, oi) = (&q[i * h * hd..(i + 1) * h * hd], &mut out[i * h * hd..]);
            let rows = SharedRows { n: keys.len(), row };
            let sinks = Some(&self.sinks[..]);
            attend::attend(shape, qi, &rows, Scale::Query(scale), sinks, oi, scores);
            for o in oi[..h * hd].chunks_exact_mut(hd) {
                self.rope.apply(o, (step.start_pos + i) as f32, true);
            }
        }
        {
            let c = &mut caches[l];
            if c.window_rows > cfg.window {
                let drop = c.window_rows - cfg.window;
                c.window.drain(..drop * hd);
                c.window_rows = cfg.window;
            }
        }
        drop(scores_span);

        let heads = std::mem::take(&mut sc.heads);
        let r = self.grouped_out_into(cfg, &heads, t, obs, sc, y);
        sc.heads = heads;
        r
    }

    /// Grouped `wo_a` (group g reads its own heads' slice) then `wo_b`, on `kernels`.
    pub(crate) fn grouped_out(
        &self,
        cfg: &ModelConfig,
        kernels: Kernels,
        out: &[f32],
        t: usize,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut y = Vec::new();
        self.grouped_out_into(cfg, out, t, obs, &mut Scratch::on(kernels), &mut y)?;
        Ok(y)
    }

    /// [`LayerWeights::grouped_out`] into `y`, its intermediates in `sc`.
    pub(crate) fn grouped_out_into(
        &self,
        cfg: &ModelConfig,
        out: &[f32],
        t: usize,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let l = self.layer;
        let (h, hd) = (cfg.heads, cfg.head_dim);
        let (g, ol) = (cfg.o_groups, cfg.o_lora);
        let ig = h * hd / g;
        let oa = zeroed(&mut sc.oa, t * g * ol);
        let xin = zeroed(&mut sc.xin, t * ig);
        let yg = zeroed(&mut sc.yg, t * ol);
        for gi in 0..g {
            for i in 0..t {
                xin[i * ig..(i + 1) * ig]
                    .copy_from_slice(&out[i * h * hd + gi * ig..i * h * hd + (gi + 1) * ig]);
            }
            if let Some(o) = obs.as_deref_mut() {
                if o.wants_linear_inputs() {
                    o.on_linear_input(&LinearInputEvent {
                        layer: l,
                        name: "attn.wo_a",
                        expert: Some(gi),
                        rows: t,
                        cols: ig,
                        x: xin,
                    });
                }
            }
            let wg = self.wo_a.slice_rows(gi * ol, (gi + 1) * ol)?;
            keep_kernels::matmul_with(sc.kernels, xin, t, &wg, yg)?;
            for i in 0..t {
                oa[i * g * ol + gi * ol..i * g * ol + (gi + 1) * ol]
                    .copy_from_slice(&yg[i * ol..(i + 1) * ol]);
            }
        }
        proj_into(sc.kernels, oa, t, &self.wo_b, obs, l, "attn.wo_b", None, y)
    }

    /// `Attention._compress` with `Compressor.__call__`.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        cfg: &ModelConfig,
        x: &[f32],
        t: usize,
        step: Step,
        caches: &mut [LayerCache],
        shared: &mut Shared,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<()> {
        let _p = profile::span(Part::Compressor);
        let l = self.layer;
        let cp = self.compressor.as_ref().expect("checked by caller");
        let hd = cfg.head_dim;
        let ratio = self.roles.ratio;
        let c = &mut caches[l];
        let sc = &mut shared.scratch;
        let lat = &mut sc.lat;
        let (n, first) = if ratio == 1 {
            lin_into(x, t, &cp.wkv, obs, l, "attn.compressor.wkv", None, lat)?;
            crate::linear::rms_norm(lat, hd, Some(&cp.norm), cfg.eps);
            (t, step.start_pos)
        } else {
            let kvp = &mut sc.kvp;
            lin_into(x, t, &cp.wkv, obs, l, "attn.compressor.wkv", None, kvp)?;
            let gw = cp.wgate.as_ref().expect("loaded for ratio > 1");
            let gp = &mut sc.gp;
            lin_into(x, t, gw, obs, l, "attn.compressor.wgate", None, gp)?;
            let pending = c.n_pending;
            c.pending_kv.extend_from_slice(kvp);
            c.pending_gate.extend_from_slice(gp);
            let total = pending + t;
            let full = total - total % ratio;
            let first = (step.start_pos - pending) / ratio;
            let n = full / ratio;
            pool_groups_into(
                &c.pending_kv,
                &c.pending_gate,
                n,
                ratio,
                hd,
                lat,
                &mut sc.gcol,
            );
            c.pending_kv.drain(..full * hd);
            c.pending_gate.drain(..full * hd);
            c.n_pending = total - full;
            crate::linear::rms_norm(lat, hd, Some(&cp.norm), cfg.eps);
            (n, first)
        };
        if n > 0 {
            let kv = &mut sc.ckv;
            kv.clear();
            kv.extend_from_slice(lat);
            for i in 0..n {
                let row = &mut kv[i * hd..(i + 1) * hd];
                self.rope.apply(row, ((first + i) * ratio) as f32, false);
                ops::fake_quant_fp4(row, 16, true);
            }
            c.compress_kv.extend_from_slice(kv);
            c.n_compressed += n;
            if self.roles.index_source {
                if let Some((wk, kn)) = self.indexer.as_ref().and_then(|ix| ix.wk.as_ref()) {
                    let ihd = cfg.index_head_dim;
                    let k = &mut sc.ik;
                    lin_into(lat, n, wk, obs, l, "attn.indexer.wk", None, k)?;
                    crate::linear::rms_norm(k, ihd, Some(kn), cfg.eps);
                    for i in 0..n {
                        let row = &mut k[i * ihd..(i + 1) * ihd];
                        self.rope.apply(row, ((first + i) * ratio) as f32, false);
                        ops::fake_quant_fp4(row, 32, false);
                    }
                    c.index_k.extend_from_slice(k);
                    c.n_index += n;
                }
            }
        }
        shared.compress_kv = if c.n_compressed > 0 { Some(l) } else { None };
        if self.roles.index_source {
            shared.index_k = if c.n_index > 0 { Some(l) } else { None };
        }
        Ok(())
    }

    /// `Indexer.__call__`: top-k compressed rows per query into `shared.topk_rows`
    /// (`[t × k]`, `-1`: none; k returned) and the candidate mask.
    #[allow(clippy::too_many_arguments)]
    fn index(
        &self,
        cfg: &ModelConfig,
        ix: &Indexer,
        x: &[f32],
        qr: &[f32],
        t: usize,
        step: Step,
        caches: &[LayerCache],
        shared: &mut Shared,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<usize> {
        let _p = profile::span(Part::Indexer);
        let l = self.layer;
        let (keys, n) = match shared.index_k {
            Some(src) => (
                &caches[src],
                visible(cfg, src, caches[src].n_index, step, t),
            ),
            None => return Ok(0),
        };
        if n == 0 {
            return Ok(0);
        }
        let sc = &mut shared.scratch;
        let keys = &keys.index_k[..n * cfg.index_head_dim];
        let (nh, ihd) = (cfg.index_heads, cfg.index_head_dim);
        let q = &mut sc.iq;
        lin_into(qr, t, &ix.wq_b, obs, l, "attn.indexer.wq_b", None, q)?;
        for i in 0..t {
            for hh in 0..nh {
                let row = &mut q[(i * nh + hh) * ihd..(i * nh + hh + 1) * ihd];
                self.rope.apply(row, (step.start_pos + i) as f32, false);
                ops::fake_quant_fp4(row, 32, false);
            }
        }
        let w = &mut sc.iw;
        lin_into(
            x,
            t,
            &ix.weights_proj,
            obs,
            l,
            "attn.indexer.weights_proj",
            None,
            w,
        )?;
        let wscale = (nh as f32).powf(-0.5);
        w.iter_mut().for_each(|v| *v *= wscale);
        let sscale = (ihd as f32).powf(-0.5);
        let ratio = self.roles.ratio;
        let scores = zeroed(&mut sc.iscores, t * n);
        for i in 0..t {
            let lens = (step.start_pos + 1 + i) / ratio;
            for j in 0..n {
                if j >= lens {
                    scores[i * n + j] = f32::NEG_INFINITY;
                    continue;
                }
                let kr = &keys[j * ihd..(j + 1) * ihd];
                let mut acc = 0f32;
                for hh in 0..nh {
                    let qq = &q[(i * nh + hh) * ihd..(i * nh + hh + 1) * ihd];
                    let score = keep_kernels::matmul::dot(qq, kr).max(0.0) * sscale;
                    acc += score * w[i * nh + hh];
                }
                scores[i * n + j] = acc;
            }
        }
        if self.roles.candidate_source && cfg.candidate_topk_blocks > 0 {
            let b = cfg.candidate_block_size;
            let nb = n.div_ceil(b);
            let kb = cfg.candidate_topk_blocks.min(nb);
            let cand = &mut shared.candidate_mask;
            cand.clear();
            cand.resize(t * n, false);
            let bs = &mut sc.blocks;
            for i in 0..t {
                let lens = (step.start_pos + 1 + i) / ratio;
                bs.clear();
                for bi in 0..nb {
                    let m = scores[i * n + bi * b..(i * n + ((bi + 1) * b).min(n))]
                        .iter()
                        .copied()
                        .fold(f32::NEG_INFINITY, f32::max);
                    bs.push((m, bi));
                }
                if lens > 0 {
                    bs[(lens - 1) / b].0 = f32::INFINITY;
                }
                top_k_by(bs, kb);
                for &(best, bi) in &bs[..kb] {
                    if best > f32::NEG_INFINITY {
                        for j in bi * b..((bi + 1) * b).min(n) {
                            cand[i * n + j] = true;
                        }
                    }
                }
            }
            shared.candidates = Some(n);
        } else if let Some(cn) = shared.candidates {
            if cn != n {
                return Err(ModelError::Config(format!(
                    "layer {l}: the candidate mask covers {cn} index keys but the indexer scores {n}; \
                     candidate_source_layer_id must read the same index keys"
                )));
            }
            for (s, &c) in scores.iter_mut().zip(shared.candidate_mask.iter()) {
                if !c {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        let k = cfg.index_topk.min(n);
        let out = &mut shared.topk_rows;
        out.clear();
        out.resize(t * k, -1);
        let row = &mut sc.ranked;
        for i in 0..t {
            let lens = (step.start_pos + 1 + i) / ratio;
            row.clear();
            row.extend((0..n).map(|j| (scores[i * n + j], j)));
            top_k_by(row, k);
            for (slot, &(_, j)) in row[..k].iter().enumerate() {
                out[i * k + slot] = if j < lens { j as i32 } else { -1 };
            }
        }
        Ok(k)
    }

    /// `MoE.__call__`: router, routed experts (grouped by expert), shared expert, on `kernels`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe(
        &self,
        cfg: &ModelConfig,
        kernels: Kernels,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &[f32],
        tokens: &[u32],
        step: Step,
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        let mut sc = Scratch::on(kernels);
        self.moe_into(cfg, experts, mask, x, tokens, step, obs, &mut sc, &mut out)?;
        Ok(out)
    }

    /// [`LayerWeights::moe`] into `out` (`[t × dim]`), its intermediates in `sc`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe_into(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &[f32],
        tokens: &[u32],
        step: Step,
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let router_span = profile::span(Part::Router);
        let l = self.layer;
        let t = tokens.len();
        let (d, e, k) = (cfg.dim, cfg.experts_in_layer(l), cfg.top_k);
        let logits = &mut sc.logits;
        lin_into(x, t, &self.gate, obs, l, "ffn.gate", None, logits)?;
        let chosen = &mut sc.chosen;
        chosen.clear();
        chosen.resize(t * k, 0);
        let weights = zeroed(&mut sc.weights, t * k);
        let scores = zeroed(&mut sc.rscores, t * e);
        for i in 0..t {
            if let Some(table) = &self.hash {
                let ids = table.experts(tokens[i]).ok_or(ModelError::Token {
                    id: tokens[i],
                    vocab: table.vocab,
                })?;
                if let Some(m) = mask {
                    if let Some(&j) = ids.iter().find(|&&j| m[j as usize]) {
                        return Err(ModelError::Config(format!(
                            "layer {l} is hash-routed: token {} names expert {j}, which the \
                             router mask removes; a hash layer needs a remap, not a mask",
                            tokens[i]
                        )));
                    }
                }
                route_hash(
                    cfg,
                    &mut logits[i * e..(i + 1) * e],
                    ids,
                    &mut chosen[i * k..(i + 1) * k],
                    &mut weights[i * k..(i + 1) * k],
                    &mut scores[i * e..(i + 1) * e],
                );
                continue;
            }
            route_with(
                cfg,
                &mut logits[i * e..(i + 1) * e],
                &self.gate_bias,
                mask,
                &mut chosen[i * k..(i + 1) * k],
                &mut weights[i * k..(i + 1) * k],
                &mut scores[i * e..(i + 1) * e],
                &mut sc.rcand,
            );
        }
        if let Some(o) = obs.as_deref_mut() {
            o.on_route(&RouteEvent {
                layer: l,
                start_pos: step.start_pos,
                tokens: t,
                top_k: k,
                experts: chosen,
                weights,
                scores,
            });
        }

        drop(router_span);
        // Routed experts, grouped by expert.
        let limit = cfg.swiglu_limit;
        // The shared expert is computed while routed experts' reads are in flight (or after
        // the routed experts when none is).
        let (chosen, weights) = (&sc.chosen, &sc.weights);
        let (sg, su, sact, sh) = (&mut sc.sg, &mut sc.su, &mut sc.sact, &mut sc.sh);
        let ys = &mut sc.ys;
        let kernels = sc.kernels;
        routed_experts_into(
            cfg,
            kernels,
            experts,
            l,
            x,
            t,
            chosen,
            weights,
            |g, u| ops::swiglu_clamped(g, u, limit),
            &mut |obs| self.shared_expert_into(kernels, x, t, limit, obs, sg, su, sact, sh),
            obs,
            &mut sc.experts,
            ys,
        )?;
        if self.hash.is_some() {
            if let Some(o) = obs.as_deref_mut() {
                if o.wants_candidate_outputs(l) {
                    candidate_outputs(cfg, kernels, experts, l, x, t, chosen, ys, o)?;
                }
            }
        }
        let _p = profile::span(Part::Experts);
        let out = zeroed(out, t * d);
        for i in 0..t {
            let o = &mut out[i * d..(i + 1) * d];
            for s in 0..k {
                let w = weights[i * k + s];
                for (a, b) in o.iter_mut().zip(&ys[(i * k + s) * d..(i * k + s + 1) * d]) {
                    *a += b * w;
                }
            }
            for (a, b) in o.iter_mut().zip(&sc.sh[i * d..(i + 1) * d]) {
                *a += b;
            }
        }
        if let Some(sidecar) = &self.sidecar {
            sidecar.add_to(x, t, out)?;
        }
        Ok(())
    }

    /// The MoE block's output on its input rows `x` (`[t × dim]`, one per token of `tokens`)
    /// with router mask `mask`: what [`LayerWeights::forward`] adds to the streams, sidecar
    /// included, on the exact kernels. No observer is told.
    pub fn moe_output(
        &self,
        cfg: &ModelConfig,
        experts: &dyn ExpertSource,
        mask: Option<&[bool]>,
        x: &[f32],
        tokens: &[u32],
    ) -> Result<Vec<f32>> {
        if x.len() != tokens.len() * cfg.dim {
            return Err(ModelError::Config(format!(
                "layer {}: MoE input of {} numbers for {} tokens of {}",
                self.layer,
                x.len(),
                tokens.len(),
                cfg.dim
            )));
        }
        let step = Step {
            start_pos: 0,
            previous: 0,
        };
        self.moe(
            cfg,
            Kernels::Exact,
            experts,
            mask,
            x,
            tokens,
            step,
            &mut None,
        )
    }
}

impl LayerWeights<'_> {
    /// The shared expert on `t` rows of `x`: clamped SwiGLU of `w1`/`w3`, then `w2`, into `y`
    /// (`g`, `u`, `act`: scratch).
    #[allow(clippy::too_many_arguments)]
    fn shared_expert_into(
        &self,
        kernels: Kernels,
        x: &[f32],
        t: usize,
        limit: f32,
        obs: &mut Option<&mut dyn RouteObserver>,
        g: &mut Vec<f32>,
        u: &mut Vec<f32>,
        act: &mut Vec<f32>,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let _span = profile::span(Part::SharedExpert);
        let l = self.layer;
        let [sw1, sw2, sw3] = &self.shared;
        crate::linear::projs_into(
            kernels,
            x,
            t,
            [
                (sw1, "ffn.shared_experts.w1", g),
                (sw3, "ffn.shared_experts.w3", u),
            ],
            obs,
            l,
        )?;
        act.clear();
        act.extend(
            g.iter()
                .zip(u.iter())
                .map(|(&g, &u)| ops::swiglu_clamped(g, u, limit)),
        );
        proj_into(
            kernels,
            act,
            t,
            sw2,
            obs,
            l,
            "ffn.shared_experts.w2",
            None,
            y,
        )
    }
}

/// Every expert of hash-routed layer `l` on every token row of `x` (`[t × dim]`), each reported
/// to `o` with the routed experts' outputs `ys` (`[t × top_k × dim]`) beside it.
#[allow(clippy::too_many_arguments)]
fn candidate_outputs(
    cfg: &ModelConfig,
    kernels: Kernels,
    experts: &dyn ExpertSource,
    l: usize,
    x: &[f32],
    t: usize,
    chosen: &[u32],
    ys: &[f32],
    o: &mut dyn RouteObserver,
) -> Result<()> {
    let (d, inter, limit) = (cfg.dim, cfg.inter, cfg.swiglu_limit);
    let all: Vec<usize> = (0..cfg.experts_in_layer(l)).collect();
    for chunk in all.chunks(experts.max_batch().max(1)) {
        let views = experts.experts(l, chunk)?;
        if views.len() != chunk.len() {
            return Err(ModelError::Expert {
                layer: l,
                expert: chunk[0],
                msg: format!("asked for {} experts, got {}", chunk.len(), views.len()),
            });
        }
        for (&j, ew) in chunk.iter().zip(&views) {
            let (mut g, mut u) = (vec![0f32; t * inter], vec![0f32; t * inter]);
            {
                let (x1, x3) = (rht_input(ew.rht.w1, x)?, rht_input(ew.rht.w3, x)?);
                let mut jobs = vec![
                    Job::view(&ew.w1, &x1, t, &mut g)?,
                    Job::view(&ew.w3, &x3, t, &mut u)?,
                ];
                matmul_many_with(kernels, &mut jobs)?;
            }
            rht_output(ew.rht.w1, &mut g)?;
            rht_output(ew.rht.w3, &mut u)?;
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| ops::swiglu_clamped(g, u, limit))
                .collect();
            let mut y = vec![0f32; t * d];
            {
                let a2 = rht_input(ew.rht.w2, &act)?;
                let mut jobs = vec![Job::view(&ew.w2, &a2, t, &mut y)?];
                matmul_many_levels(kernels, DOWN_ACTS, &mut jobs)?;
            }
            rht_output(ew.rht.w2, &mut y)?;
            o.on_candidate_output(&CandidateOutputEvent {
                layer: l,
                top_k: cfg.top_k,
                expert: j,
                chosen,
                routed: ys,
                outputs: &y,
            });
        }
    }
    Ok(())
}

/// One query head of `_sparse_attention`: softmax over `q·k·scale` of the given rows with the
/// sink as one more logit in the denominator (MLX SDPA's `sinks`), values = keys (the shared KV);
/// adds the result into `out`. `scores` is scratch.
pub fn attend(
    q: &[f32],
    scale: f32,
    rows: &[&[f32]],
    sink: f32,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    attend_rows(q, scale, rows.len(), |r| rows[r], sink, out, scores)
}

/// [`attend`] over `n` rows given by `row(r)` (no list of row slices to build): keep-kernels'
/// attention op on one query head.
pub fn attend_rows<'r>(
    q: &[f32],
    scale: f32,
    n: usize,
    row: impl Fn(usize) -> &'r [f32] + Sync,
    sink: f32,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    if scores.len() < n {
        scores.resize(n, 0.0);
    }
    let rows = SharedRows { n, row };
    attend_one(&rows, 0, 0, q, Scale::Query(scale), Some(sink), out, scores);
}

/// `Compressor.__call__`'s pooling: each of `n` groups of `ratio` rows becomes
/// `Σ_r kv[r] · softmax_r(gate[r])` per feature (rows `[n·ratio × hd]` in, `[n × hd]` out).
pub fn pool_groups(kv: &[f32], gate: &[f32], n: usize, ratio: usize, hd: usize) -> Vec<f32> {
    let mut lat = Vec::new();
    pool_groups_into(kv, gate, n, ratio, hd, &mut lat, &mut Vec::new());
    lat
}

/// [`pool_groups`] into `lat` (`gcol`: scratch).
pub(crate) fn pool_groups_into(
    kv: &[f32],
    gate: &[f32],
    n: usize,
    ratio: usize,
    hd: usize,
    lat: &mut Vec<f32>,
    gcol: &mut Vec<f32>,
) {
    let lat = zeroed(lat, n * hd);
    let gcol = zeroed(gcol, ratio);
    for gi in 0..n {
        for dd in 0..hd {
            for r in 0..ratio {
                gcol[r] = gate[(gi * ratio + r) * hd + dd];
            }
            ops::softmax(gcol);
            let mut acc = 0f32;
            for r in 0..ratio {
                acc += kv[(gi * ratio + r) * hd + dd] * gcol[r];
            }
            lat[gi * hd + dd] = acc;
        }
    }
}

/// `Router.__call__` for one token: scores from the logits (divided by `gate_temp` in place),
/// top-k on the bias-corrected scores (experts in `mask` never chosen), gate weights from the
/// unbiased scores, renormalised (when `norm_topk_prob` and k > 1) and scaled.
pub fn route(
    cfg: &ModelConfig,
    logits: &mut [f32],
    bias: &[f32],
    mask: Option<&[bool]>,
    chosen: &mut [u32],
    weights: &mut [f32],
    scores: &mut [f32],
) {
    route_with(
        cfg,
        logits,
        bias,
        mask,
        chosen,
        weights,
        scores,
        &mut Vec::new(),
    )
}

/// [`route`] with `cand` as scratch.
#[allow(clippy::too_many_arguments)]
pub fn route_with(
    cfg: &ModelConfig,
    logits: &mut [f32],
    bias: &[f32],
    mask: Option<&[bool]>,
    chosen: &mut [u32],
    weights: &mut [f32],
    scores: &mut [f32],
    cand: &mut Vec<(f32, usize)>,
) {
    let (e, k) = (logits.len(), chosen.len());
    for v in logits.iter_mut() {
        *v /= cfg.gate_temp;
    }
    match cfg.scoring {
        Scoring::Sigmoid => scores
            .iter_mut()
            .zip(logits.iter())
            .for_each(|(s, &v)| *s = ops::sigmoid(v)),
        Scoring::SqrtSoftplus => scores
            .iter_mut()
            .zip(logits.iter())
            .for_each(|(s, &v)| *s = ops::softplus(v).sqrt()),
        Scoring::Softmax => {
            scores.copy_from_slice(logits);
            if let Some(m) = mask {
                for (s, &dead) in scores.iter_mut().zip(m) {
                    if dead {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            ops::softmax(scores);
        }
    }
    cand.clear();
    cand.extend((0..e).map(|j| {
        let dead = mask.is_some_and(|m| m[j]);
        let b = if dead {
            f32::NEG_INFINITY
        } else {
            scores[j] + bias[j]
        };
        (b, j)
    }));
    top_k_by(cand, k);
    let mut sum = 0f32;
    for s in 0..k {
        let j = cand[s].1;
        chosen[s] = j as u32;
        weights[s] = scores[j];
        sum += scores[j];
    }
    for w in weights.iter_mut() {
        if cfg.norm_topk_prob && k > 1 {
            *w /= sum + 1e-20;
        }
        *w *= cfg.route_scale;
    }
}

/// The int8 levels of the routed experts' down-projection inputs under the fast kernels: two
/// (`x ≈ q₁·d₁ + q₂·d₂`). One level (a step of 1/127 of each block's largest value) is coarse
/// for every SwiGLU product much smaller than its block's largest; on the bundled model that
/// rounding was the largest single part of the fast kernels' distance from the exact ones
/// (`keep eval --kernels fast`). The gate and up projections keep one level.
pub(crate) const DOWN_ACTS: ActLevels = ActLevels::Two;

/// The routed experts of layer `l` over `t` rows of `x` (`chosen`/`weights`: `[t × top_k]`):
/// grouped by expert, each expert's chunk multiplied together (one kernel pass for all gate and
/// up projections, one for all down projections), `act(gate, up)` between them, the observer
/// told every expert input and output. Writes each route's output into `ys`, `[t × top_k ×
/// dim]` (row i, slot s), unweighted, its intermediates in `es`. Every family's MoE layer runs
/// its experts through this, but one whose experts carry biases (its own expert loop).
/// With a tiered source ([`ExpertSource::tiers`]) each slot's rung is chosen first (in token
/// then slot order), the routes are grouped by (expert, rung), base before upper, the views come
/// from [`ExpertSource::experts_at`] and the observer is told the rungs ([`RungEvent`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn routed_experts_into(
    cfg: &ModelConfig,
    kernels: Kernels,
    experts: &dyn ExpertSource,
    l: usize,
    x: &[f32],
    t: usize,
    chosen: &[u32],
    weights: &[f32],
    act: impl Fn(f32, f32) -> f32,
    while_reading: WhileReading<'_>,
    obs: &mut Option<&mut dyn RouteObserver>,
    es: &mut ExpertScratch,
    ys: &mut Vec<f32>,
) -> Result<()> {
    let _p = profile::span(Part::Experts);
    let (d, e, k) = (cfg.dim, cfg.experts_in_layer(l), cfg.top_k);
    // Routed experts, grouped by (expert, rung): per group, the (token, slot) routes to it.
    // Without tiers every slot is at the base rung and the groups are the experts.
    let tiers = experts.tiers();
    if es.by_key.len() < 2 * e {
        // Each group sized for a decode pass's routes when made: an expert first chosen late
        // in a run does not allocate then.
        es.by_key
            .resize_with(2 * e, || Vec::with_capacity(crate::scratch::KEEP_ROWS));
    }
    let by_key = &mut es.by_key[..2 * e];
    by_key.iter_mut().for_each(Vec::clear);
    let upper = &mut es.upper;
    upper.clear();
    upper.resize(if tiers.is_some() { t * k } else { 0 }, false);
    for i in 0..t {
        for s in 0..k {
            let j = chosen[i * k + s] as usize;
            let rung = match tiers {
                Some(p) => p.choose(l, i, j, weights[i * k + s]).rung(),
                None => Rung::Base,
            };
            if rung == Rung::Upper {
                upper[i * k + s] = true;
            }
            by_key[2 * j + (rung == Rung::Upper) as usize].push((i, s));
        }
    }
    if let (Some(o), Some(_)) = (obs.as_deref_mut(), tiers) {
        o.on_rungs(&RungEvent {
            layer: l,
            tokens: t,
            top_k: k,
            experts: chosen,
            upper,
        });
    }
    let keys = &mut es.keys;
    keys.clear();
    keys.extend(
        (0..2 * e)
            .filter(|&q| !by_key[q].is_empty())
            .map(|q| (q / 2, if q % 2 == 1 { Rung::Upper } else { Rung::Base })),
    );
    let key = |&(j, r): &(usize, Rung)| 2 * j + (r == Rung::Upper) as usize;
    let used = &mut es.used;
    used.clear();
    used.extend(keys.iter().map(|p| p.0));
    used.dedup();
    {
        let _io = profile::span(Part::IoWait);
        experts.prefetch(l, used);
    }
    let ys = zeroed(ys, t * k * d);
    let inter = cfg.inter;
    // The experts of a chunk are multiplied together: one parallel kernel pass for all
    // their gate and up projections, one for all their down projections (a decode token's
    // top-k experts are one chunk). Each product equals `matmul` of that expert alone, so
    // the order of the chunks changes no bit: experts in memory go first, then
    // `while_reading`, then each missed expert as its read lands.
    let batch = experts.max_batch().max(1);
    let left = &mut es.left;
    left.clear();
    left.extend_from_slice(keys);
    let mut while_reading = Some(while_reading);
    // Buffers of borrowed views, kept between calls in their `'static` form.
    let mut views: Vec<ExpertWeights<'_>> = recycle(std::mem::take(&mut es.views));
    while !left.is_empty() {
        let chunk_keys = &mut es.batch;
        next_batch(
            experts,
            l,
            left,
            batch,
            &mut while_reading,
            obs,
            (&mut es.ids, &mut es.ready, &mut es.take),
            chunk_keys,
        )?;
        views.clear();
        {
            let _io = profile::span(Part::IoWait);
            match tiers {
                None => {
                    let ids = &mut es.ids;
                    ids.clear();
                    ids.extend(chunk_keys.iter().map(|p| p.0));
                    experts.experts_into(l, ids, &mut views)?;
                }
                Some(_) => views.extend(experts.experts_at(l, chunk_keys)?),
            }
        }
        if profile::enabled() {
            for ew in &views {
                profile::read(ew.w1.nbytes() + ew.w2.nbytes() + ew.w3.nbytes());
            }
        }
        let chunk = &mut es.chunk;
        chunk.clear();
        chunk.extend(chunk_keys.iter().map(key));
        if views.len() != chunk.len() {
            return Err(ModelError::Expert {
                layer: l,
                expert: chunk_keys[0].0,
                msg: format!("asked for {} experts, got {}", chunk.len(), views.len()),
            });
        }
        let by_expert = &*by_key;
        // Each expert's rows live in one buffer per stage (inputs, gate, up, activation,
        // output), expert `c` of the chunk at rows `offs[c]..offs[c + 1]`: the buffers are
        // the scratch's, whatever the chunk's number of experts.
        let offs = &mut es.offs;
        offs.clear();
        offs.push(0usize);
        for &j in chunk.iter() {
            offs.push(offs[offs.len() - 1] + by_expert[j].len());
        }
        let offs = &*offs;
        let rows_total = offs[chunk.len()];
        let span = |c: usize, w: usize| offs[c] * w..offs[c + 1] * w;
        let xin_all = &mut es.xin;
        xin_all.clear();
        for &j in chunk.iter() {
            for &(i, _) in &by_expert[j] {
                xin_all.extend_from_slice(&x[i * d..(i + 1) * d]);
            }
        }
        for (c, (&j, ew)) in chunk.iter().zip(&views).enumerate() {
            let (m, xin) = (by_expert[j].len(), &xin_all[span(c, d)]);
            note_input(obs, l, "ffn.experts.w1", Some(j / 2), xin, m, ew.w1.cols);
            note_input(obs, l, "ffn.experts.w3", Some(j / 2), xin, m, ew.w3.cols);
        }
        let g_all = zeroed(&mut es.g, rows_total * inter);
        let u_all = zeroed(&mut es.u, rows_total * inter);
        {
            // matrices stored rotated multiply the rotated activations (a copy each); the
            // lists borrowing this pass's inputs and outputs are recycled per pass
            let mut x1s: Vec<Cow<'_, [f32]>> = recycle(std::mem::take(&mut es.x1s));
            let mut x3s: Vec<Cow<'_, [f32]>> = recycle(std::mem::take(&mut es.x3s));
            let mut jobs: Vec<Job<'_, '_>> = recycle(std::mem::take(&mut es.jobs));
            for (c, ew) in views.iter().enumerate() {
                x1s.push(rht_input(ew.rht.w1, &xin_all[span(c, d)])?);
                x3s.push(rht_input(ew.rht.w3, &xin_all[span(c, d)])?);
            }
            let (mut g_rest, mut u_rest) = (&mut g_all[..], &mut u_all[..]);
            for (((&j, ew), x1), x3) in chunk.iter().zip(&views).zip(&x1s).zip(&x3s) {
                let m = by_expert[j].len();
                let (g, gr) = std::mem::take(&mut g_rest).split_at_mut(m * inter);
                let (u, ur) = std::mem::take(&mut u_rest).split_at_mut(m * inter);
                (g_rest, u_rest) = (gr, ur);
                jobs.push(Job::view(&ew.w1, x1, m, g)?);
                jobs.push(Job::view(&ew.w3, x3, m, u)?);
            }
            matmul_many_with(kernels, &mut jobs)?;
            es.jobs = recycle(jobs);
            (es.x1s, es.x3s) = (recycle(x1s), recycle(x3s));
        }
        for (c, ew) in views.iter().enumerate() {
            rht_output(ew.rht.w1, &mut g_all[span(c, inter)])?;
            rht_output(ew.rht.w3, &mut u_all[span(c, inter)])?;
        }
        let act_all = &mut es.act;
        act_all.clear();
        act_all.extend(g_all.iter().zip(u_all.iter()).map(|(&g, &u)| act(g, u)));
        for (c, (&j, ew)) in chunk.iter().zip(&views).enumerate() {
            let (m, a) = (by_expert[j].len(), &act_all[span(c, inter)]);
            note_input(obs, l, "ffn.experts.w2", Some(j / 2), a, m, ew.w2.cols);
        }
        let out_all = zeroed(&mut es.out, rows_total * d);
        {
            let mut a2s: Vec<Cow<'_, [f32]>> = recycle(std::mem::take(&mut es.a2s));
            let mut jobs: Vec<Job<'_, '_>> = recycle(std::mem::take(&mut es.jobs));
            for (c, ew) in views.iter().enumerate() {
                a2s.push(rht_input(ew.rht.w2, &act_all[span(c, inter)])?);
            }
            let mut y_rest = &mut out_all[..];
            for ((&j, ew), a) in chunk.iter().zip(&views).zip(&a2s) {
                let m = by_expert[j].len();
                let (y, yr) = std::mem::take(&mut y_rest).split_at_mut(m * d);
                y_rest = yr;
                jobs.push(Job::view(&ew.w2, a, m, y)?);
            }
            matmul_many_levels(kernels, DOWN_ACTS, &mut jobs)?;
            es.jobs = recycle(jobs);
            es.a2s = recycle(a2s);
        }
        for (c, ew) in views.iter().enumerate() {
            rht_output(ew.rht.w2, &mut out_all[span(c, d)])?;
        }
        for (c, &j) in chunk.iter().enumerate() {
            let (routes, y) = (&by_expert[j], &out_all[span(c, d)]);
            if let Some(o) = obs.as_deref_mut() {
                if o.wants_expert_outputs() {
                    let rows: Vec<usize> = routes.iter().map(|r| r.0).collect();
                    let slots: Vec<usize> = routes.iter().map(|r| r.1).collect();
                    let ws: Vec<f32> = routes.iter().map(|&(i, s)| weights[i * k + s]).collect();
                    o.on_expert_output(&ExpertOutputEvent {
                        layer: l,
                        expert: j / 2,
                        token_rows: &rows,
                        slots: &slots,
                        weights: &ws,
                        outputs: y,
                    });
                }
            }
            for (r, &(i, s)) in routes.iter().enumerate() {
                ys[(i * k + s) * d..(i * k + s + 1) * d].copy_from_slice(&y[r * d..(r + 1) * d]);
            }
        }
    }
    es.views = recycle(views);
    if let Some(f) = while_reading.take() {
        f(obs)?;
    }
    Ok(())
}

/// Work a MoE layer does beside its routed experts (the shared expert), given to
/// [`routed_experts_into`] to run while expert reads are in flight.
pub(crate) type WhileReading<'w> =
    &'w mut dyn FnMut(&mut Option<&mut dyn RouteObserver>) -> Result<()>;

/// The next (expert, rung) keys of `left` to multiply, taken out of it in order into
/// `picked`: the first `batch` whose weights are in memory; when none is, `while_reading`
/// first (once, then readiness is asked again), else the first key alone, which waits for its
/// read. `scratch`: expert ids, their readiness, the positions taken.
#[allow(clippy::too_many_arguments)]
fn next_batch(
    experts: &dyn ExpertSource,
    l: usize,
    left: &mut Vec<(usize, Rung)>,
    batch: usize,
    while_reading: &mut Option<WhileReading<'_>>,
    obs: &mut Option<&mut dyn RouteObserver>,
    (ids, ready, take): (&mut Vec<usize>, &mut Vec<bool>, &mut Vec<usize>),
    picked: &mut Vec<(usize, Rung)>,
) -> Result<()> {
    picked.clear();
    loop {
        ids.clear();
        ids.extend(left.iter().map(|p| p.0));
        experts.ready_into(l, ids, ready);
        take.clear();
        take.extend(
            (0..left.len())
                .filter(|&i| ready.get(i).copied().unwrap_or(true))
                .take(batch),
        );
        if !take.is_empty() {
            picked.extend(take.iter().map(|&i| left[i]));
            for &i in take.iter().rev() {
                left.remove(i);
            }
            return Ok(());
        }
        match while_reading.take() {
            Some(f) => f(obs)?,
            None => {
                picked.push(left.remove(0));
                return Ok(());
            }
        }
    }
}

impl LayerWeights<'_> {
    /// `DeepseekV4Attention.forward` for `t` new rows `x` (normalised block input) on
    /// `kernels`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_v4(
        &self,
        cfg: &ModelConfig,
        kernels: Kernels,
        x: &[f32],
        t: usize,
        step: Step,
        caches: &mut [crate::cache::LayerCache],
        obs: &mut Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut y = Vec::new();
        let mut sc = Scratch::on(kernels);
        self.attention_v4_into(cfg, x, t, step, caches, obs, &mut sc, &mut y)?;
        Ok(y)
    }

    /// [`LayerWeights::attention_v4`] into `y`, its intermediates in `sc`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_v4_into(
        &self,
        cfg: &ModelConfig,
        x: &[f32],
        t: usize,
        step: Step,
        caches: &mut [crate::cache::LayerCache],
        obs: &mut Option<&mut dyn RouteObserver>,
        sc: &mut Scratch,
        y: &mut Vec<f32>,
    ) -> Result<()> {
        let _p = profile::span(Part::AttnProj);
        let l = self.layer;
        let (h, hd, ql) = (cfg.heads, cfg.head_dim, cfg.q_lora);
        let k = sc.kernels;
        // `wq_a` and `wkv` read the same input: one pass.
        crate::linear::projs_into(
            k,
            x,
            t,
            [
                (&self.wq_a, "attn.wq_a", &mut sc.qr),
                (&self.wkv, "attn.wkv", &mut sc.kv),
            ],
            obs,
            l,
        )?;
        crate::linear::rms_norm(&mut sc.qr, ql, Some(&self.q_norm), cfg.eps);
        let q = &mut sc.q;
        proj_into(k, &sc.qr, t, &self.wq_b, obs, l, "attn.wq_b", None, q)?;
        head_norm(q, hd, cfg.eps);
        for i in 0..t {
            let pos = (step.start_pos + i) as f32;
            for hh in 0..h {
                let o = (i * h + hh) * hd;
                self.rope.apply(&mut q[o..o + hd], pos, false);
            }
        }
        let kv = &mut sc.kv;
        crate::linear::rms_norm(kv, hd, Some(&self.kv_norm), cfg.eps);
        for i in 0..t {
            self.rope.apply(
                &mut kv[i * hd..(i + 1) * hd],
                (step.start_pos + i) as f32,
                false,
            );
        }
        let c = &mut caches[l];
        if c.window_rows != step.previous {
            return Err(crate::ModelError::Cache(format!(
                "layer {l} holds {} window rows, the model expects {}",
                c.window_rows, step.previous
            )));
        }
        c.window.extend_from_slice(kv);
        c.window_rows += t;

        // Compressed rows and, for CSA, the indexer's pick per query (`sc.picks`, k of them).
        let mut picks: Option<usize> = None;
        if let Some(va) = &self.v4 {
            let compressor_span = profile::span(Part::Compressor);
            pool_step_with(
                cfg,
                &va.pool,
                &mut c.v4.kv,
                x,
                t,
                &self.rope,
                obs,
                l,
                ["attn.compressor.wkv", "attn.compressor.wgate"],
                sc,
            )?;
            drop(compressor_span);
            if let Some(ix) = &va.indexer {
                let _ix = profile::span(Part::Indexer);
                pool_step_with(
                    cfg,
                    &ix.pool,
                    &mut c.v4.index,
                    x,
                    t,
                    &self.rope,
                    obs,
                    l,
                    [
                        "attn.indexer.compressor.wkv",
                        "attn.indexer.compressor.wgate",
                    ],
                    sc,
                )?;
                let st = &c.v4.index;
                let mut out = std::mem::take(&mut sc.picks);
                let qr = std::mem::take(&mut sc.qr);
                let r = index_topk_into(
                    cfg,
                    ix,
                    &st.entries,
                    st.n,
                    x,
                    &qr,
                    t,
                    step.start_pos,
                    &self.rope,
                    obs,
                    l,
                    sc,
                    &mut out,
                );
                (sc.picks, sc.qr) = (out, qr);
                picks = Some(r?);
            }
        }

        let scores_span = profile::span(Part::AttnScores);
        let scale = (hd as f32).powf(-0.5);
        let comp = &c.v4.kv;
        let ratio = self.roles.ratio.max(1);
        let out = zeroed(&mut sc.heads, t * h * hd);
        let (keys, scores, q, idx) = (&mut sc.keys, &mut sc.scores, &sc.q, &sc.picks);
        let window = &c.window;
        for i in 0..t {
            let end = step.previous + i;
            let start = (end + 1).saturating_sub(cfg.window);
            keys.clear();
            // Window rows are ids 0.., compressed entries are ids offset by 1<<40.
            keys.extend(start..=end);
            if self.v4.is_some() {
                let visible = ((step.start_pos + 1 + i) / ratio).min(comp.n);
                match picks {
                    Some(k) => {
                        for &j in &idx[i * k..(i + 1) * k] {
                            if j >= 0 && (j as usize) < visible {
                                keys.push((1usize << 40) + j as usize);
                            }
                        }
                    }
                    None => keys.extend((0..visible).map(|j| (1usize << 40) + j)),
                }
            }
            let row = |r: usize| -> &[f32] {
                let key = keys[r];
                if key >= 1 << 40 {
                    let j = key - (1 << 40);
                    &comp.entries[j * hd..(j + 1) * hd]
                } else {
                    &window[key * hd..(key + 1) * hd]
                }
            };
            profile::read(keys.len() * hd * 4);
            let shape = Heads {
                queries: 1,
                heads: h,
                head_dim: hd,
                group: h,
            };
            let (qi, oi) = (&q[i * h * hd..(i + 1) * h * hd], &mut out[i * h * hd..]);
            let rows = SharedRows { n: keys.len(), row };
            let sinks = Some(&self.sinks[..]);
            attend::attend(shape, qi, &rows, Scale::Query(scale), sinks, oi, scores);
            for o in oi[..h * hd].chunks_exact_mut(hd) {
                self.rope.apply(o, (step.start_pos + i) as f32, true);
            }
        }
        if c.window_rows > cfg.window {
            let drop = c.window_rows - cfg.window;
            c.window.drain(..drop * hd);
            c.window_rows = cfg.window;
        }
        drop(scores_span);
        let heads = std::mem::take(&mut sc.heads);
        let r = self.grouped_out_into(cfg, &heads, t, obs, sc, y);
        sc.heads = heads;
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    /// f32 component vs a plain f64 version: a few ulps of accumulation over short sums.
    const TOL: f64 = 1e-5;

    /// keep-rng's generator with the draw these tests use (uniform in [-1, 1]).
    struct Rng(keep_rng::Rng);
    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(keep_rng::rng(seed))
        }
        fn f(&mut self) -> f32 {
            keep_rng::Draw::signed_unit_f32(&mut self.0)
        }
    }

    fn cfg(json: &str) -> ModelConfig {
        let c = keep_checkpoint::DeepSeekConfig::from_json(std::path::Path::new("c.json"), json)
            .unwrap();
        ModelConfig::from_deepseek(&c).unwrap()
    }

    #[test]
    fn hyper_connections_match_plain_f64() {
        let c = cfg(
            r#"{"hidden_size":8,"hc_mult":3,"num_hidden_layers":1,"rms_norm_eps":1e-6,"hc_sinkhorn_iters":20,"hc_eps":1e-6}"#,
        );
        let (hc, d, t) = (3usize, 8usize, 2usize);
        let mut rng = Rng::new(5);
        let nm = (2 + hc) * hc;
        let fnw: Vec<f32> = (0..nm * hc * d).map(|_| rng.f() * 0.3).collect();
        let fnb: Vec<u8> = fnw.iter().flat_map(|v| v.to_le_bytes()).collect();
        let hcw = Hc {
            fn_: WeightView::f32(&fnb, nm, hc * d).unwrap(),
            base: (0..nm).map(|_| rng.f()).collect(),
            scale: vec![0.7, 1.3, 0.9],
        };
        let s = Streams {
            t,
            x: (0..t * hc * d).map(|_| rng.f() * 3.0).collect(),
            pre_mix: vec![0.0; t * hc],
            tokens: vec![0; t],
        };
        let (pre, post, comb) = hc_mix(&hcw, &s, &c).unwrap();
        for i in 0..t {
            let x: Vec<f64> = s.x[i * hc * d..(i + 1) * hc * d]
                .iter()
                .map(|&v| v as f64)
                .collect();
            let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + 1e-6).sqrt();
            let mix: Vec<f64> = (0..nm)
                .map(|j| {
                    let dot: f64 = (0..hc * d)
                        .map(|q| x[q] * r * fnw[j * hc * d + q] as f64)
                        .sum();
                    let sid = if j < hc {
                        0
                    } else if j < 2 * hc {
                        1
                    } else {
                        2
                    };
                    dot * hcw.scale[sid] as f64 + hcw.base[j] as f64
                })
                .collect();
            let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
            let mut m = vec![0f64; hc * hc];
            for a in 0..hc {
                let row = &mix[2 * hc + a * hc..2 * hc + (a + 1) * hc];
                let mx = row.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = row.iter().map(|v| (v - mx).exp()).sum();
                for b in 0..hc {
                    m[a * hc + b] = (row[b] - mx).exp() / z + 1e-6;
                }
            }
            for it in 0..20 {
                if it > 0 {
                    for a in 0..hc {
                        let sum: f64 = (0..hc).map(|b| m[a * hc + b]).sum::<f64>() + 1e-6;
                        (0..hc).for_each(|b| m[a * hc + b] /= sum);
                    }
                }
                for b in 0..hc {
                    let sum: f64 = (0..hc).map(|a| m[a * hc + b]).sum::<f64>() + 1e-6;
                    (0..hc).for_each(|a| m[a * hc + b] /= sum);
                }
            }
            for j in 0..hc {
                assert!((pre[i * hc + j] as f64 - (sig(mix[j]) + 1e-6)).abs() < TOL);
                assert!((post[i * hc + j] as f64 - 2.0 * sig(mix[hc + j])).abs() < TOL);
            }
            for q in 0..hc * hc {
                assert!(
                    (comb[i * hc * hc + q] as f64 - m[q]).abs() < TOL,
                    "comb {q}"
                );
            }
        }
        // collapse and expand against their formulas.
        let col = collapse(&s, &pre, hc, d);
        let xin: Vec<f32> = (0..t * d).map(|_| rng.f()).collect();
        let mut s2 = s.clone();
        expand(&xin, &mut s2, &post, &comb, hc, d);
        for i in 0..t {
            for q in 0..d {
                let want: f64 = (0..hc)
                    .map(|k| pre[i * hc + k] as f64 * s.x[(i * hc + k) * d + q] as f64)
                    .sum();
                assert!((col[i * d + q] as f64 - want).abs() < TOL);
                for j in 0..hc {
                    let mixed: f64 = (0..hc)
                        .map(|a| {
                            comb[(i * hc + a) * hc + j] as f64 * s.x[(i * hc + a) * d + q] as f64
                        })
                        .sum();
                    let want = post[i * hc + j] as f64 * xin[i * d + q] as f64 + mixed;
                    assert!((s2.x[(i * hc + j) * d + q] as f64 - want).abs() < TOL);
                }
            }
        }
    }

    #[test]
    fn router_matches_plain_f64() {
        let mut rng = Rng::new(9);
        for (func, temp) in [("sqrtsoftplus", 1.0), ("sigmoid", 0.7), ("softmax", 1.3)] {
            let c = cfg(&format!(
                r#"{{"n_routed_experts":12,"num_experts_per_tok":3,"scoring_func":"{func}","gate_temp":{temp},"routed_scaling_factor":2.5,"num_hidden_layers":1}}"#
            ));
            for masked in [false, true] {
                let mask: Vec<bool> = (0..12).map(|j| masked && j % 4 == 1).collect();
                let raw: Vec<f32> = (0..12).map(|_| rng.f() * 4.0).collect();
                let bias: Vec<f32> = (0..12).map(|_| rng.f() * 0.1).collect();
                let (mut ch, mut w, mut sc) = (vec![0u32; 3], vec![0f32; 3], vec![0f32; 12]);
                route(
                    &c,
                    &mut raw.clone(),
                    &bias,
                    masked.then_some(&mask[..]),
                    &mut ch,
                    &mut w,
                    &mut sc,
                );
                let l: Vec<f64> = raw.iter().map(|&v| (v / temp as f32) as f64).collect();
                let score: Vec<f64> = match func {
                    "sigmoid" => l.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect(),
                    "sqrtsoftplus" => l.iter().map(|v| (1.0 + v.exp()).ln().sqrt()).collect(),
                    _ => {
                        let alive: Vec<usize> = (0..12).filter(|&j| !mask[j]).collect();
                        let z: f64 = alive.iter().map(|&j| l[j].exp()).sum();
                        (0..12)
                            .map(|j| if mask[j] { 0.0 } else { l[j].exp() / z })
                            .collect()
                    }
                };
                let mut order: Vec<usize> = (0..12).filter(|&j| !mask[j]).collect();
                order.sort_by(|&a, &b| {
                    (score[b] + bias[b] as f64)
                        .partial_cmp(&(score[a] + bias[a] as f64))
                        .unwrap()
                });
                let top = &order[..3];
                assert_eq!(
                    ch.iter().map(|&v| v as usize).collect::<Vec<_>>(),
                    top,
                    "{func}"
                );
                let sum: f64 = top.iter().map(|&j| score[j]).sum();
                for s in 0..3 {
                    assert!(
                        (w[s] as f64 - score[top[s]] / sum * 2.5).abs() < TOL,
                        "{func} weight"
                    );
                }
            }
        }
    }

    #[test]
    fn attention_with_sink_matches_plain_f64() {
        let mut rng = Rng::new(11);
        let hd = 40;
        let q: Vec<f32> = (0..hd).map(|_| rng.f()).collect();
        let keys: Vec<Vec<f32>> = (0..7)
            .map(|_| (0..hd).map(|_| rng.f() * 2.0).collect())
            .collect();
        let rows: Vec<&[f32]> = keys.iter().map(|k| &k[..]).collect();
        let (scale, sink) = (0.3f32, 0.8f32);
        let mut out = vec![0f32; hd];
        attend(&q, scale, &rows, sink, &mut out, &mut Vec::new());
        let logits: Vec<f64> = keys
            .iter()
            .map(|k| (0..hd).map(|i| q[i] as f64 * k[i] as f64).sum::<f64>() * scale as f64)
            .collect();
        let z: f64 = logits.iter().map(|v| v.exp()).sum::<f64>() + (sink as f64).exp();
        for i in 0..hd {
            let want: f64 = keys
                .iter()
                .zip(&logits)
                .map(|(k, l)| l.exp() / z * k[i] as f64)
                .sum();
            assert!((out[i] as f64 - want).abs() < TOL, "{i}");
        }
    }

    #[test]
    fn pooling_matches_plain_f64() {
        let mut rng = Rng::new(3);
        let (n, ratio, hd) = (3usize, 4usize, 5usize);
        let kv: Vec<f32> = (0..n * ratio * hd).map(|_| rng.f() * 2.0).collect();
        let gate: Vec<f32> = (0..n * ratio * hd).map(|_| rng.f() * 5.0).collect();
        let lat = pool_groups(&kv, &gate, n, ratio, hd);
        for g in 0..n {
            for q in 0..hd {
                let gs: Vec<f64> = (0..ratio)
                    .map(|r| gate[(g * ratio + r) * hd + q] as f64)
                    .collect();
                let z: f64 = gs.iter().map(|v| v.exp()).sum();
                let want: f64 = (0..ratio)
                    .map(|r| kv[(g * ratio + r) * hd + q] as f64 * gs[r].exp() / z)
                    .sum();
                assert!((lat[g * hd + q] as f64 - want).abs() < TOL);
            }
        }
    }

    /// `top_k_by` against a plain full sort with the same rule, on tie-heavy inputs with signed
    /// zeros and infinities.
    #[test]
    fn top_k_matches_full_sort() {
        let mut seed = 1u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let vals = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.5,
        ];
        for _ in 0..500 {
            let n = 1 + (next() % 60) as usize;
            let k = 1 + (next() % n as u64) as usize;
            let v: Vec<(f32, usize)> = (0..n).map(|i| (vals[(next() % 7) as usize], i)).collect();
            let mut fast = v.clone();
            top_k_by(&mut fast, k);
            let mut slow = v.clone();
            // Plain: stable sort by value descending (signed zeros equal) keeps index order.
            slow.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
            assert_eq!(&fast[..k], &slow[..k]);
        }
    }
}
