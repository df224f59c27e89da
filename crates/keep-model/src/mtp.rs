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
use keep_kernels::{matmul, ops, WeightView};

use crate::cache::{Cache, LayerCache};
use crate::config::{LayerRoles, ModelConfig};
use crate::experts::{ExpertSource, ExpertWeights};
use crate::layer::{LayerWeights, Shared, Step, Streams};
use crate::model::{Globals, Logits, Model};
use crate::observer::RouteObserver;
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
    /// The module of `ck` (`None` when the checkpoint has none), checked against `cfg`.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>> {
        if !present(ck) {
            return Ok(None);
        }
        let mut c = cfg.clone();
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
        let experts = (0..cfg.n_experts)
            .map(|x| {
                let p = format!("{PREFIX}ffn.experts.{x}");
                Ok(ExpertWeights {
                    w1: weight(ck, &format!("{p}.w1"), i, d, hint)?,
                    w2: weight(ck, &format!("{p}.w2"), d, i, hint)?,
                    w3: weight(ck, &format!("{p}.w3"), i, d, hint)?,
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

    /// One prefill of `tokens` through `model` and then the module: row `i` of the result
    /// (`[(T − 1) × vocab]`) is the module's logits at position `i` (main streams of token `i`,
    /// embedding of token `i + 1`), the prediction of token `i + 2`.
    pub fn prefill_logits(&self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() < 2 {
            return Ok(vec![]);
        }
        let mut cache = model.new_cache();
        let (_, s) = model.forward_streams(tokens, &mut cache, Logits::None, None)?;
        let t = tokens.len();
        let mut mc = self.new_cache();
        Ok(self
            .forward(&s.rows(0, t - 1), &tokens[1..], &mut mc, Logits::All)?
            .0)
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
        crate::model::check_context(cfg, cache.pos, t)?;
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
        ops::rms_norm(&mut e, d, Some(&self.enorm), cfg.eps);
        let mut ep = vec![0f32; t * d];
        matmul(&e, t, &self.e_proj, &mut ep)?;
        // x = h_proj(hnorm(h)) per stream, plus e on every stream.
        let mut h = hidden.x.clone();
        ops::rms_norm(&mut h, d, Some(&self.hnorm), cfg.eps);
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
            previous: cache.pos.min(cfg.window),
        };
        self.block.forward(
            cfg,
            &self.experts,
            None,
            &mut s,
            step,
            &mut cache.layers,
            &mut Shared::default(),
            None,
        )?;
        s.check_finite(|| "the MTP block".into())?;
        cache.pos += t;
        let logits = self.out.finish(cfg, &s, which)?;
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
struct Verify {
    before: Cache,
    tokens: Vec<u32>,
    streams: Streams,
}

/// Speculative decoding state attached to a [`Model`] ([`Model::attach_mtp`]).
pub struct Drafter<'a> {
    mtp: Mtp<'a>,
    k: usize,
    /// Drafting may be turned off when it does not pay.
    auto: bool,
    cache: MtpCache,
    /// The main model's streams of the last token fed whose successor is not known yet.
    pending: Option<Streams>,
    verify: Option<Verify>,
}

impl<'a> Model<'a> {
    /// Draft `k` tokens per verify forward (clamped to 1..=[`MAX_DRAFT`]) with the MTP module of
    /// `ck`; `false` (nothing attached) when the checkpoint has none.
    pub fn attach_mtp(&mut self, ck: &'a Checkpoint, k: usize) -> Result<bool> {
        let Some(mtp) = Mtp::load(ck, &self.cfg)? else {
            return Ok(false);
        };
        let cache = mtp.new_cache();
        self.mtp = Some(Box::new(Drafter {
            mtp,
            k: k.clamp(1, MAX_DRAFT),
            auto: false,
            cache,
            pending: None,
            verify: None,
        }));
        Ok(true)
    }

    /// Drop the drafter (drafting off; forwards no longer feed the MTP module).
    pub fn detach_mtp(&mut self) {
        self.mtp = None;
    }

    /// Let generation turn drafting off when it does not pay (`--draft auto`).
    pub fn set_mtp_auto(&mut self, auto: bool) {
        if let Some(d) = self.mtp.as_mut() {
            d.auto = auto;
        }
    }

    /// Whether generation may turn drafting off ([`Model::set_mtp_auto`]).
    pub fn mtp_auto(&self) -> bool {
        self.mtp.as_ref().is_some_and(|d| d.auto)
    }

    /// Tokens drafted per verify forward (0: no drafter attached).
    pub fn draft_tokens(&self) -> usize {
        self.mtp.as_ref().map_or(0, |m| m.k)
    }

    /// [`Model::forward`] that keeps an attached drafter in step: the MTP module is fed every
    /// pair (hidden state, next token) these tokens complete. A forward from position 0 starts
    /// the drafter afresh.
    pub fn forward_drafting(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        if self.mtp.is_none() || tokens.is_empty() {
            return self.forward(tokens, cache, which, obs);
        }
        let fresh = cache.pos == 0;
        let (logits, s) = self.forward_streams(tokens, cache, which, obs)?;
        let dr = self.mtp.as_mut().expect("checked above");
        if fresh {
            dr.cache = dr.mtp.new_cache();
            dr.pending = None;
            dr.verify = None;
        }
        dr.feed(&s, tokens, tokens.len())?;
        Ok(logits)
    }

    /// Draft up to the attached drafter's K tokens after `last` (sampled, not yet fed): each
    /// drafted token with the MTP logits it was picked from by `pick`. Empty without a drafter
    /// (or before the first forward).
    pub fn draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> Result<Vec<(u32, Vec<f32>)>> {
        let Some(dr) = self.mtp.as_mut() else {
            return Ok(vec![]);
        };
        let Some(h) = dr.pending.take() else {
            return Ok(vec![]);
        };
        let k = k.min(dr.k);
        let mut out = Vec::with_capacity(k);
        if k == 0 {
            dr.pending = Some(h);
            return Ok(out);
        }
        // The first row pairs real hidden state with the real token: it stays in the cache.
        let (q, mut s) = dr.mtp.forward(&h, &[last], &mut dr.cache, Logits::Last)?;
        let d = pick(&q);
        out.push((d, q));
        if k > 1 {
            let keep = dr.cache.clone();
            let mut prev = d;
            for _ in 1..k {
                let (q, s2) = dr.mtp.forward(&s, &[prev], &mut dr.cache, Logits::Last)?;
                prev = pick(&q);
                out.push((prev, q));
                s = s2;
            }
            dr.cache = keep;
        }
        Ok(out)
    }

    /// Feed `tokens` (the last sampled token and the drafts) in one forward: the logits of
    /// every row; [`Model::accept_drafts`] then says how many stay.
    pub fn forward_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        if self.mtp.is_none() {
            return self.forward(tokens, cache, Logits::All, obs);
        }
        let before = cache.clone();
        let (logits, streams) = self.forward_streams(tokens, cache, Logits::All, obs)?;
        let dr = self.mtp.as_mut().expect("checked above");
        dr.verify = Some(Verify {
            before,
            tokens: tokens.to_vec(),
            streams,
        });
        Ok(logits)
    }

    /// Keep the first `keep` (≥ 1) tokens of the last verify forward: the main cache is rolled
    /// back to them (snapshot restored, the kept rows replayed) when fewer than all stay, and
    /// the MTP module is fed the kept pairs.
    pub fn accept_drafts(&mut self, cache: &mut Cache, keep: usize) -> Result<()> {
        let Some(v) = self.mtp.as_mut().and_then(|d| d.verify.take()) else {
            return Ok(());
        };
        let n = v.tokens.len();
        if keep == 0 || keep > n {
            return Err(ModelError::Cache(format!(
                "keeping {keep} of {n} verified tokens"
            )));
        }
        if keep < n {
            *cache = v.before;
            self.forward(&v.tokens[..keep], cache, Logits::None, None)?;
        }
        let dr = self.mtp.as_mut().expect("checked above");
        // The first token's pair went in while drafting.
        dr.feed(&v.streams, &v.tokens, keep)?;
        Ok(())
    }
}

impl Drafter<'_> {
    /// Feed the pairs that the first `n` rows of a main forward (`s`, `tokens`) complete: the
    /// pending row with `tokens[0]` (unless drafting already fed it), each row `i < n − 1` with
    /// `tokens[i + 1]`; row `n − 1` becomes pending.
    fn feed(&mut self, s: &Streams, tokens: &[u32], n: usize) -> Result<()> {
        let (hidden, next) = match self.pending.take() {
            Some(p) => (join(Some(&p), s, 0, n - 1), tokens[..n].to_vec()),
            None => (join(None, s, 0, n - 1), tokens[1..n].to_vec()),
        };
        if hidden.t > 0 {
            self.mtp
                .forward(&hidden, &next, &mut self.cache, Logits::None)?;
        }
        self.pending = Some(s.rows(n - 1, n));
        Ok(())
    }
}
