//! DeepSeek-V4 / V4-Flash attention compressors (spec: transformers 5.23 `modeling_deepseek_v4.py`,
//! names as DeepSeek publishes them): per layer, a compress ratio m picks the kind.
//!
//! - m = 0: sliding window only (plain RoPE over `rope_theta`).
//! - m = 4, CSA: `attn.compressor.{wkv,wgate}` project to `2·hd` (two series Ca | Cb) and
//!   `attn.compressor.ape` `[m × 2hd]` is added to the gate. Entry w pools, per feature, the
//!   `2m` slots {Ca of window w−1, Cb of window w} with a softmax over the gates (window 0 has
//!   no Ca slots), then `compressor.norm` (RMSNorm) and RoPE at position `w·m`. A Lightning
//!   indexer with its own compressor (`attn.indexer.compressor.*`, same scheme at
//!   `index_head_dim`) scores entries: `Σ_h relu(q_h·k)·ihd^-½ · (weights_proj(x)_h · H^-½)`
//!   with `q = indexer.wq_b(q_residual)` RoPE'd at the query position; the query attends to its
//!   top `index_topk` visible entries.
//! - m > 4, HCA: one series (`wkv`, `wgate` `[hd × dim]`, `ape` `[m × hd]`), entry w pools the m
//!   rows of window w; the query attends to every visible entry.
//!
//! Entry w is visible to the query at position t iff `w < (t + 1) / m` (its window has ended).
//! The pooled entries are a function of the tokens only, so prefill and decode build the same
//! ones: the open window's projections wait in the cache, and CSA keeps the last closed
//! window's rows for the next window's Ca slots.

use keep_checkpoint::Checkpoint;
use keep_kernels::ops::{self, Rope};
use keep_kernels::WeightView;

pub use crate::cache::{PoolState, V4Cache};
use crate::config::ModelConfig;
use crate::linear::{lin_into, top_k_by};
use crate::observer::RouteObserver;
use crate::scratch::{zeroed, Scratch};
use crate::weights::{vec_f32, weight};
use crate::Result;

/// One pooling compressor: `wkv`, `wgate` `[width·dim_out × dim]`, `ape` `[ratio × width·dim_out]`,
/// `norm` `[dim_out]`; width 2 when windows overlap (CSA), 1 otherwise.
pub struct Pool<'a> {
    pub wkv: WeightView<'a>,
    pub wgate: WeightView<'a>,
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub ratio: usize,
    pub overlap: bool,
    /// Features of one pooled entry.
    pub dim_out: usize,
}

/// The CSA indexer: query projection, head weights and its own key compressor.
pub struct Indexer<'a> {
    pub wq_b: WeightView<'a>,
    pub weights_proj: WeightView<'a>,
    pub pool: Pool<'a>,
}

/// A V4 layer's compressed-attention weights (none for a window-only layer).
pub struct V4Attn<'a> {
    pub pool: Pool<'a>,
    pub indexer: Option<Indexer<'a>>,
}

fn load_pool<'a>(
    ck: &'a Checkpoint,
    cfg: &ModelConfig,
    prefix: &str,
    ratio: usize,
    overlap: bool,
    dim_out: usize,
) -> Result<Pool<'a>> {
    let hint = cfg.raw.weight_block_size();
    let w = if overlap { 2 * dim_out } else { dim_out };
    Ok(Pool {
        wkv: weight(ck, &format!("{prefix}wkv"), w, cfg.dim, hint)?,
        wgate: weight(ck, &format!("{prefix}wgate"), w, cfg.dim, hint)?,
        ape: vec_f32(ck, &format!("{prefix}ape"), ratio * w)?,
        norm: vec_f32(ck, &format!("{prefix}norm.weight"), dim_out)?,
        ratio,
        overlap,
        dim_out,
    })
}

impl<'a> V4Attn<'a> {
    /// The compressor (and, for CSA, indexer) of `layer`; `None` for a window-only layer.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<Option<Self>> {
        let ratio = cfg.roles[layer].ratio;
        if ratio == 0 {
            return Ok(None);
        }
        let p = format!("layers.{layer}.attn.");
        let csa = ratio == 4;
        let pool = load_pool(
            ck,
            cfg,
            &format!("{p}compressor."),
            ratio,
            csa,
            cfg.head_dim,
        )?;
        let indexer = if csa {
            let hint = cfg.raw.weight_block_size();
            let (ih, ihd) = (cfg.index_heads, cfg.index_head_dim);
            Some(Indexer {
                wq_b: weight(ck, &format!("{p}indexer.wq_b"), ih * ihd, cfg.q_lora, hint)?,
                weights_proj: weight(ck, &format!("{p}indexer.weights_proj"), ih, cfg.dim, hint)?,
                pool: load_pool(
                    ck,
                    cfg,
                    &format!("{p}indexer.compressor."),
                    ratio,
                    true,
                    ihd,
                )?,
            })
        } else {
            None
        };
        Ok(Some(V4Attn { pool, indexer }))
    }
}

/// Feed `t` new rows `x` (`[t × dim]`, positions `start_pos..`) to a pool: closed windows become
/// entries appended to `st.entries`.
#[allow(clippy::too_many_arguments)]
pub fn pool_step(
    cfg: &ModelConfig,
    pw: &Pool,
    st: &mut PoolState,
    x: &[f32],
    t: usize,
    rope: &Rope,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    names: [&'static str; 2],
) -> Result<()> {
    let mut sc = Scratch::default();
    pool_step_with(cfg, pw, st, x, t, rope, obs, layer, names, &mut sc)
}

/// [`pool_step`] with its intermediates in `sc`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pool_step_with(
    cfg: &ModelConfig,
    pw: &Pool,
    st: &mut PoolState,
    x: &[f32],
    t: usize,
    rope: &Rope,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    names: [&'static str; 2],
    sc: &mut Scratch,
) -> Result<()> {
    let (kvp, gp) = (&mut sc.kvp, &mut sc.gp);
    lin_into(x, t, &pw.wkv, obs, layer, names[0], None, kvp)?;
    lin_into(x, t, &pw.wgate, obs, layer, names[1], None, gp)?;
    let w = pw.wkv.rows;
    let (m, hd) = (pw.ratio, pw.dim_out);
    st.pending_kv.extend_from_slice(kvp);
    st.pending_gate.extend_from_slice(gp);
    st.n_pending += t;
    let closed = st.n_pending / m;
    let slots = if pw.overlap { 2 * m } else { m };
    let g = zeroed(&mut sc.gcol, slots);
    let v = zeroed(&mut sc.vcol, slots);
    for c in 0..closed {
        let cur_kv = &st.pending_kv[c * m * w..(c + 1) * m * w];
        let cur_gate = &st.pending_gate[c * m * w..(c + 1) * m * w];
        let e = zeroed(&mut sc.entry, hd);
        for (dd, out) in e.iter_mut().enumerate() {
            let mut n = 0;
            if pw.overlap {
                if !st.prev_kv.is_empty() {
                    for r in 0..m {
                        v[n] = st.prev_kv[r * w + dd];
                        g[n] = st.prev_gate[r * w + dd] + pw.ape[r * w + dd];
                        n += 1;
                    }
                }
                for r in 0..m {
                    v[n] = cur_kv[r * w + hd + dd];
                    g[n] = cur_gate[r * w + hd + dd] + pw.ape[r * w + hd + dd];
                    n += 1;
                }
            } else {
                for r in 0..m {
                    v[n] = cur_kv[r * w + dd];
                    g[n] = cur_gate[r * w + dd] + pw.ape[r * w + dd];
                    n += 1;
                }
            }
            ops::softmax(&mut g[..n]);
            *out = v[..n].iter().zip(&g[..n]).map(|(a, b)| a * b).sum();
        }
        crate::linear::rms_norm(e, hd, Some(&pw.norm), cfg.eps);
        rope.apply(e, (st.n * m) as f32, false);
        st.entries.extend_from_slice(e);
        st.n += 1;
        if pw.overlap {
            st.prev_kv.clear();
            st.prev_kv.extend_from_slice(cur_kv);
            st.prev_gate.clear();
            st.prev_gate.extend_from_slice(cur_gate);
        }
    }
    st.pending_kv.drain(..closed * m * w);
    st.pending_gate.drain(..closed * m * w);
    st.n_pending -= closed * m;
    Ok(())
}

/// The indexer's pick for each of `t` queries: up to `index_topk` visible entries of `keys`
/// (`[n × ihd]`) by score, highest first (`-1` pads when fewer are visible).
#[allow(clippy::too_many_arguments)]
pub fn index_topk(
    cfg: &ModelConfig,
    ix: &Indexer,
    keys: &[f32],
    n: usize,
    x: &[f32],
    qr: &[f32],
    t: usize,
    start_pos: usize,
    rope: &Rope,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
) -> Result<(Vec<i32>, usize)> {
    let mut out = Vec::new();
    let mut sc = Scratch::default();
    let k = index_topk_into(
        cfg, ix, keys, n, x, qr, t, start_pos, rope, obs, layer, &mut sc, &mut out,
    )?;
    Ok((out, k))
}

/// [`index_topk`] into `out` (`[t × k]`; k returned), its intermediates in `sc`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn index_topk_into(
    cfg: &ModelConfig,
    ix: &Indexer,
    keys: &[f32],
    n: usize,
    x: &[f32],
    qr: &[f32],
    t: usize,
    start_pos: usize,
    rope: &Rope,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    sc: &mut Scratch,
    out: &mut Vec<i32>,
) -> Result<usize> {
    out.clear();
    let k = cfg.index_topk.min(n);
    if n == 0 {
        return Ok(0);
    }
    let (nh, ihd, m) = (cfg.index_heads, cfg.index_head_dim, ix.pool.ratio);
    let q = &mut sc.iq;
    lin_into(qr, t, &ix.wq_b, obs, layer, "attn.indexer.wq_b", None, q)?;
    for i in 0..t {
        for hh in 0..nh {
            let row = &mut q[(i * nh + hh) * ihd..(i * nh + hh + 1) * ihd];
            rope.apply(row, (start_pos + i) as f32, false);
        }
    }
    let w = &mut sc.iw;
    lin_into(
        x,
        t,
        &ix.weights_proj,
        obs,
        layer,
        "attn.indexer.weights_proj",
        None,
        w,
    )?;
    let wscale = (nh as f32).powf(-0.5);
    w.iter_mut().for_each(|v| *v *= wscale);
    let sscale = (ihd as f32).powf(-0.5);
    out.resize(t * k, -1);
    let row = &mut sc.ranked;
    for i in 0..t {
        let visible = ((start_pos + 1 + i) / m).min(n);
        row.clear();
        for j in 0..visible {
            let kr = &keys[j * ihd..(j + 1) * ihd];
            let mut acc = 0f32;
            for hh in 0..nh {
                let qq = &q[(i * nh + hh) * ihd..(i * nh + hh + 1) * ihd];
                acc += keep_kernels::matmul::dot(qq, kr).max(0.0) * sscale * w[i * nh + hh];
            }
            row.push((acc, j));
        }
        let kk = k.min(visible);
        top_k_by(row, kk);
        for (slot, &(_, j)) in row[..kk].iter().enumerate() {
            out[i * k + slot] = j as i32;
        }
    }
    Ok(k)
}

/// The unweighted per-head RMSNorm transformers applies to V4's queries (`q_b_norm`).
pub fn head_norm(q: &mut [f32], hd: usize, eps: f32) {
    crate::linear::rms_norm(q, hd, None, eps);
}
