//! The multi-token-prediction (MTP) module of a DeepSeek-V4 / V4.1 checkpoint (`mtp.0.*`) and the
//! drafter that speculative decoding runs with it (`docs/mtp.md` has the equations and every
//! point where public copies disagree).
//!
//! [`Mtp`] follows `MTPBlock.forward` of DeepSeek-V4's published `inference/model.py`: for row
//! `i` (position `p`), the main model's last-layer streams `h_p` (`[hc × dim]`, before the final
//! collapse) and the embedding of the token at `p + 1` are each RMS-normalised (`hnorm` per
//! stream, `enorm`), projected (`h_proj` per stream, `e_proj` once and added to every stream),
//! run through one decoder block of the model's own kind (`mtp.0.attn.*`, `mtp.0.ffn.*`, hyper
//! connections; a window-only block, compress ratio 0, with its own sliding-window cache), then
//! collapsed by the module's own `hc_head_{fn,base,scale}`, normalised by `mtp.0.norm` and
//! projected by the main model's shared `head` to the logits of the token at `p + 2`.
//!
//! [`Drafter`] keeps the module's cache in step with the main model (every main forward feeds
//! the pairs whose next token is known), drafts K tokens by chaining the module on its own output
//! streams, and rolls the main cache back after a verify forward: the sliding window drops rows
//! and compressor groups pool as they close, so there is no cheap exact truncation; the cache is
//! snapshot before the verify forward and, when a draft is rejected, restored and the accepted
//! rows replayed (bit-identical, since each row's computation does not depend on how many rows a
//! forward runs).

use keep_checkpoint::Checkpoint;
use keep_kernels::{matmul, WeightView};

use crate::cache::{Cache, LayerCache};
use crate::config::{LayerRoles, ModelConfig};
use crate::experts::{ExpertSource, ExpertWeights};
use crate::globals::{Globals, Logits};
use crate::layer::{LayerWeights, Shared, Step, Streams};
use crate::weights::{tensor, vec_f32, view, weight};
use crate::{ModelError, Result};

/// The most tokens one verify forward drafts.
pub const MAX_DRAFT: usize = 8;

/// The checkpoint prefix of the MTP module keep runs (the first of `num_nextn_predict_layers`).
pub const PREFIX: &str = "mtp.0.";

/// Whether `ck` carries an MTP module keep can draft with.
pub fn present(ck: &Checkpoint) -> bool {
    ck.contains(&format!("{PREFIX}e_proj.weight"))
}

/// The module's routed experts (`mtp.0.ffn.experts.E.w{1,2,3}`), answered as layer `layer`.
struct MtpExperts<'a> {
    layer: usize,
    experts: Vec<ExpertWeights<'a>>,
}

impl ExpertSource for MtpExperts<'_> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        match self.experts.get(expert) {
            Some(w) if layer == self.layer => Ok(*w),
            _ => Err(ModelError::Expert {
                layer,
                expert,
                msg: "not an expert of the MTP block".into(),
            }),
        }
    }
}

/// The MTP module's weights (views of the checkpoint).
pub struct Mtp<'a> {
    /// The model's config with one more layer role: the block's (window only).
    cfg: ModelConfig,
    /// The kernels its products run on (the main model's; exact unless
    /// [`Mtp::with_kernels`] gives others).
    kernels: keep_kernels::Kernels,
    block: LayerWeights<'a>,
    experts: MtpExperts<'a>,
    e_proj: WeightView<'a>,
    h_proj: WeightView<'a>,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    /// Shared embedding and head; the module's own `norm` and `hc_head_*`.
    out: Globals<'a>,
}

/// The MTP block's cache: its sliding window, and how many rows it has seen.
#[derive(Debug, Clone)]
pub struct MtpCache {
    /// One slot per main layer plus the block's (the block runs as layer `n_layers`).
    layers: Vec<LayerCache>,
    pub pos: usize,
}

impl<'a> Mtp<'a> {
    /// The module to run its products on `kernels`.
    pub fn with_kernels(mut self, kernels: keep_kernels::Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// The module of `ck` (`None` when the checkpoint has none), checked against `cfg`.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>> {
        if !present(ck) {
            return Ok(None);
        }
        let mut c = cfg.clone();
        // The block's own router and experts: a pruned module may keep another count.
        c.n_experts = cfg.raw.experts_in_mtp(0);
        let layer = cfg.n_layers;
        c.roles.truncate(layer);
        c.roles.push(LayerRoles {
            ratio: 0,
            kv_source: false,
            index_source: false,
            candidate_source: false,
        });
        let block = LayerWeights::load_at(ck, &c, layer, PREFIX)?;
        let hint = cfg.raw.weight_block_size();
        let (d, i) = (cfg.dim, cfg.inter);
        let marker = crate::experts::incoherence_map(ck)?;
        let experts = (0..c.n_experts)
            .map(|x| {
                let p = format!("{PREFIX}ffn.experts.{x}");
                let b = [format!("{p}.w1"), format!("{p}.w2"), format!("{p}.w3")];
                Ok(ExpertWeights {
                    w1: weight(ck, &b[0], i, d, hint)?,
                    w2: weight(ck, &b[1], d, i, hint)?,
                    w3: weight(ck, &b[2], i, d, hint)?,
                    rht: crate::experts::expert_rht(&marker, [&b[0], &b[1], &b[2]], d, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let hc_fn = tensor(ck, &format!("{PREFIX}hc_head_fn"))?;
        let out = Globals {
            embed: weight(ck, "embed", cfg.vocab, d, hint)?,
            head: weight(ck, "head", cfg.vocab, d, hint)?,
            norm: vec_f32(ck, &format!("{PREFIX}norm.weight"), d)?,
            hc_head: Some((
                view(hc_fn, None, cfg.hc, cfg.hc * d, None)?,
                vec_f32(ck, &format!("{PREFIX}hc_head_base"), cfg.hc)?,
                vec_f32(ck, &format!("{PREFIX}hc_head_scale"), 1)?[0],
            )),
        };
        Ok(Some(Mtp {
            kernels: keep_kernels::Kernels::Exact,
            block,
            experts: MtpExperts { layer, experts },
            e_proj: weight(ck, &format!("{PREFIX}e_proj"), d, d, hint)?,
            h_proj: weight(ck, &format!("{PREFIX}h_proj"), d, d, hint)?,
            enorm: vec_f32(ck, &format!("{PREFIX}enorm.weight"), d)?,
            hnorm: vec_f32(ck, &format!("{PREFIX}hnorm.weight"), d)?,
            out,
            cfg: c,
        }))
    }

    /// An empty cache for the block.
    pub fn new_cache(&self) -> MtpCache {
        MtpCache {
            layers: vec![LayerCache::default(); self.cfg.n_layers + 1],
            pos: 0,
        }
    }

    /// Run the module on `hidden` (the main model's last-layer streams of consecutive positions
    /// from `cache.pos`, with the pre-mix that layer handed on) and `next` (the token after each
    /// of them): the logits asked for (of the token two after each position) and the block's
    /// output streams (what a chained draft feeds back as its hidden state).
    pub fn forward(
        &self,
        hidden: &Streams,
        next: &[u32],
        cache: &mut MtpCache,
        which: Logits,
    ) -> Result<(Vec<f32>, Streams)> {
        let previous = cache.pos.min(self.cfg.window);
        self.forward_at(hidden, next, cache, which, previous)
    }

    /// Put the pairs `hidden`, `next` of positions `cache.pos + gap ..` into the block's cache,
    /// the `gap` positions before them never run: the block's window is refilled from these
    /// pairs alone. Its cache is then exactly what running every pair makes as long as these
    /// are at least the window's length (or `gap` is 0): the block is window-only, and a
    /// window row is its own position's key and value, which depend on that position's pair
    /// alone (the attention outputs of this forward, which do read the window, are not kept).
    pub(crate) fn refill(
        &self,
        hidden: &Streams,
        next: &[u32],
        cache: &mut MtpCache,
        gap: usize,
    ) -> Result<()> {
        if gap == 0 {
            self.forward(hidden, next, cache, Logits::None)?;
            return Ok(());
        }
        if next.len() < self.cfg.window {
            return Err(ModelError::Cache(format!(
                "the MTP window refilled from {} pairs, fewer than its {} rows",
                next.len(),
                self.cfg.window
            )));
        }
        let block = cache
            .layers
            .get_mut(self.cfg.n_layers)
            .ok_or_else(|| ModelError::Cache("not a cache of this MTP module".into()))?;
        block.window.clear();
        block.window_rows = 0;
        cache.pos += gap;
        self.forward_at(hidden, next, cache, Logits::None, 0)?;
        Ok(())
    }

    /// [`Mtp::forward`] with `previous` window rows in the block's cache.
    fn forward_at(
        &self,
        hidden: &Streams,
        next: &[u32],
        cache: &mut MtpCache,
        which: Logits,
        previous: usize,
    ) -> Result<(Vec<f32>, Streams)> {
        let cfg = &self.cfg;
        let (hc, d, t) = (cfg.hc, cfg.dim, next.len());
        if hidden.t != t || hidden.x.len() != t * hc * d || hidden.pre_mix.len() != t * hc {
            return Err(ModelError::Config(format!(
                "the MTP module got {} hidden rows for {t} tokens",
                hidden.t
            )));
        }
        if cache.layers.len() != cfg.n_layers + 1 {
            return Err(ModelError::Cache("not a cache of this MTP module".into()));
        }
        crate::globals::check_context(cfg, cache.pos, t)?;
        // e = e_proj(enorm(embed(next))), once per token.
        let mut e = vec![0f32; t * d];
        for (i, &id) in next.iter().enumerate() {
            if id as usize >= cfg.vocab {
                return Err(ModelError::Token {
                    id,
                    vocab: cfg.vocab,
                });
            }
            self.out
                .embed
                .decode_row(id as usize, &mut e[i * d..(i + 1) * d]);
        }
        crate::linear::rms_norm(&mut e, d, Some(&self.enorm), cfg.eps);
        let mut ep = vec![0f32; t * d];
        matmul(&e, t, &self.e_proj, &mut ep)?;
        // x = h_proj(hnorm(h)) per stream, plus e on every stream.
        let mut h = hidden.x.clone();
        crate::linear::rms_norm(&mut h, d, Some(&self.hnorm), cfg.eps);
        let mut x = vec![0f32; t * hc * d];
        matmul(&h, t * hc, &self.h_proj, &mut x)?;
        for i in 0..t {
            for k in 0..hc {
                let o = (i * hc + k) * d;
                for (a, b) in x[o..o + d].iter_mut().zip(&ep[i * d..(i + 1) * d]) {
                    *a += b;
                }
            }
        }
        let mut s = Streams {
            t,
            x,
            pre_mix: hidden.pre_mix.clone(),
            tokens: next.to_vec(),
        };
        let step = Step {
            start_pos: cache.pos,
            previous,
        };
        self.block.forward(
            cfg,
            &self.experts,
            None,
            &mut s,
            step,
            &mut cache.layers,
            &mut Shared::on(self.kernels),
            None,
        )?;
        s.check_finite(|| "the MTP block".into())?;
        cache.pos += t;
        let logits = self.out.finish(cfg, self.kernels, &s, which)?;
        Ok((logits, s))
    }
}

/// The rows of `first` (if any) followed by rows `a..b` of `s`.
fn join(first: Option<&Streams>, s: &Streams, a: usize, b: usize) -> Streams {
    let mut out = match first {
        Some(f) => f.clone(),
        None => Streams {
            t: 0,
            x: vec![],
            pre_mix: vec![],
            tokens: vec![],
        },
    };
    let part = s.rows(a, b);
    out.t += part.t;
    out.x.extend_from_slice(&part.x);
    out.pre_mix.extend_from_slice(&part.pre_mix);
    out.tokens.extend_from_slice(&part.tokens);
    out
}

/// The last verify forward: the main cache before it, the tokens and their output streams.
pub(crate) struct Verify {
    pub(crate) before: Cache,
    pub(crate) tokens: Vec<u32>,
    pub(crate) streams: Streams,
}

/// Speculative decoding state attached to a [`Model`](crate::Model)
/// ([`Model::attach_mtp`](crate::Model::attach_mtp)).
pub struct Drafter<'a> {
    pub(crate) mtp: Mtp<'a>,
    pub(crate) k: usize,
    /// Drafting may be turned off when it does not pay.
    pub(crate) auto: bool,
    pub(crate) cache: MtpCache,
    /// The main model's streams of the last token fed whose successor is not known yet.
    pub(crate) pending: Option<Streams>,
    pub(crate) verify: Option<Verify>,
    /// Drafting is switched off for now (`--draft auto`): the pairs fed wait in `backlog` and
    /// go through the module in one forward when drafting resumes.
    pub(crate) paused: bool,
    /// Pairs (main streams, next token) not yet through the module, in order, and how many
    /// pairs before them were dropped unrun (see [`Drafter::feed`]).
    pub(crate) backlog: Option<(Streams, Vec<u32>, usize)>,
}

impl Drafter<'_> {
    /// Feed the pairs that the first `n` rows of a main forward (`s`, `tokens`) complete: the
    /// pending row with `tokens[0]` (unless drafting already fed it), each row `i < n − 1` with
    /// `tokens[i + 1]`; row `n − 1` becomes pending.
    /// While [`Drafter::paused`] the pairs are held back (see [`Drafter::catch_up`]); of a
    /// long pause only the last window's worth is ever run: the block is window-only, so the
    /// pairs before them cannot reach its cache ([`Mtp::refill`]). A paused drafter costs a
    /// copy of each token's streams, never a forward of the block.
    pub(crate) fn feed(&mut self, s: &Streams, tokens: &[u32], n: usize) -> Result<()> {
        let (hidden, next) = match self.pending.take() {
            Some(p) => (join(Some(&p), s, 0, n - 1), tokens[..n].to_vec()),
            None => (join(None, s, 0, n - 1), tokens[1..n].to_vec()),
        };
        self.pending = Some(s.rows(n - 1, n));
        if hidden.t == 0 {
            return Ok(());
        }
        let (hidden, next, gap) = match self.backlog.take() {
            Some((mut h, mut t, gap)) => {
                h.t += hidden.t;
                h.x.extend_from_slice(&hidden.x);
                h.pre_mix.extend_from_slice(&hidden.pre_mix);
                h.tokens.extend_from_slice(&hidden.tokens);
                t.extend_from_slice(&next);
                (h, t, gap)
            }
            None => (hidden, next, 0),
        };
        if self.paused {
            // Past two windows, drop all but the last window (amortised: one copy per window
            // of tokens).
            let w = self.mtp.cfg.window.max(1);
            self.backlog = Some(if hidden.t >= 2 * w {
                let drop = hidden.t - w;
                (
                    hidden.rows(drop, hidden.t),
                    next[drop..].to_vec(),
                    gap + drop,
                )
            } else {
                (hidden, next, gap)
            });
            return Ok(());
        }
        self.run(hidden, next, gap)
    }

    /// Run the held-back pairs through the module in one forward. The module's cache is then
    /// what feeding every pair one by one makes, bit for bit: a forward's rows do not depend on
    /// how many come together, and pairs dropped unrun lie outside the window
    /// ([`Mtp::refill`]).
    pub(crate) fn catch_up(&mut self) -> Result<()> {
        if let Some((hidden, next, gap)) = self.backlog.take() {
            self.run(hidden, next, gap)?;
        }
        Ok(())
    }

    /// Pairs `hidden`, `next` through the block, `gap` pairs before them dropped unrun; only
    /// the last window's worth runs when any was dropped or they are more than a window.
    fn run(&mut self, hidden: Streams, next: Vec<u32>, gap: usize) -> Result<()> {
        let drop = hidden.t.saturating_sub(self.mtp.cfg.window.max(1));
        if drop == 0 {
            return self.mtp.refill(&hidden, &next, &mut self.cache, gap);
        }
        let h = hidden.rows(drop, hidden.t);
        self.mtp
            .refill(&h, &next[drop..], &mut self.cache, gap + drop)
    }
}
