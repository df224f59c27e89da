//! Generation: keep's one [`generate`] over the [`Generate`] trait, which the whole model
//! implements here and keep-runtime's budgeted model implements there. It encodes the prompt
//! with the model's tokenizer ([`Prompt`]), refuses a run longer than the model's context,
//! samples greedy (temperature 0) or temperature + top-p with a seeded generator
//! ([`Sampler`], deterministic for a seed), stops at the config's end-of-sequence tokens,
//! streams the text through the detokenizer ([`TextStream`]) and times prefill and decode
//! ([`GenStats`]). It never prints: the caller gets each [`Piece`] and decides.

use std::ops::ControlFlow;
use std::path::Path;
use std::time::Instant;

use keep_kernels::profile::{self, Part, Phase};
use keep_rng::Draw;
use tokenizers::Tokenizer;

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::model::{Logits, Model};
use crate::observer::{RouteEvent, RouteObserver};
use crate::{ModelError, Result};

/// Sampling settings.
#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = no truncation.
    pub top_p: f32,
    pub seed: u64,
}

impl SamplerConfig {
    /// Refuse settings that would sample garbage: a temperature that is not a finite number
    /// ≥ 0, a top-p outside (0, 1] (NaN included).
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::Sampling(format!(
                "temperature must be a finite number ≥ 0, not {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Sampling(format!(
                "top-p must be in (0, 1], not {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A seeded sampler: one uniform draw per sampled token from keep-rng's SplitMix64 stream
/// started at `seed ^ 0x9E3779B97F4A7C15` (so a
/// seed samples the same text on every version and platform).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: keep_rng::SplitMix64,
    /// The nucleus of the last sampled row (kept: sampling a row allocates nothing once it
    /// has held a vocabulary's worth).
    nucleus: Vec<(f64, u32)>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        Sampler {
            cfg,
            rng: keep_rng::splitmix(cfg.seed ^ 0x9E37_79B9_7F4A_7C15),
            nucleus: Vec::new(),
        }
    }

    /// Pick a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let _p = profile::span(Part::Sample);
        if self.is_greedy() {
            return argmax(logits);
        }
        let mut p = std::mem::take(&mut self.nucleus);
        let mass = self.nucleus_into(logits, &mut p);
        let mut u = self.rng.unit() * mass;
        let mut id = p[p.len() - 1].1;
        for x in &p {
            u -= x.0;
            if u <= 0.0 {
                id = x.1;
                break;
            }
        }
        self.nucleus = p;
        id
    }

    /// The temperature-scaled weights of the top-p nucleus, largest first (ties by id), into
    /// `p`, and their sum: what [`Sampler::sample`] draws from and [`Sampler::probs`]
    /// normalises.
    fn nucleus_into(&self, logits: &[f32], p: &mut Vec<(f64, u32)>) -> f64 {
        let t = self.cfg.temperature;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        p.clear();
        p.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &v)| ((((v - m) / t) as f64).exp(), i as u32)),
        );
        let z: f64 = p.iter().map(|x| x.0).sum();
        // A total order (no two ids equal): the unstable sort, in place, orders as a stable
        // one would.
        p.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut keep = p.len();
        if self.cfg.top_p < 1.0 {
            let mut c = 0.0;
            for (i, x) in p.iter().enumerate() {
                c += x.0 / z;
                if c >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = p[..keep].iter().map(|x| x.0).sum();
        p.truncate(keep);
        mass
    }
}

impl Sampler {
    /// Whether this sampler is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0
    }

    /// The distribution [`Sampler::sample`] draws from for one row of logits: the
    /// temperature softmax over the top-p nucleus (one-hot at the arg-max when greedy).
    pub fn probs(&self, logits: &[f32]) -> Vec<f64> {
        let _p = profile::span(Part::Sample);
        let mut out = vec![0f64; logits.len()];
        if logits.is_empty() {
            return out;
        }
        if self.is_greedy() {
            out[argmax(logits) as usize] = 1.0;
            return out;
        }
        let mut p = Vec::new();
        let mass = self.nucleus_into(logits, &mut p);
        for x in &p {
            out[x.1 as usize] = x.0 / mass;
        }
        out
    }

    /// One draw from `probs` (arg-max without a draw when greedy).
    pub fn draw(&mut self, probs: &[f64]) -> u32 {
        if self.is_greedy() {
            return argmax_f64(probs);
        }
        draw_from(probs, self.rng.unit())
    }

    /// The speculative-sampling decision for draft token `d` drawn from `q` where the target
    /// distribution is `p`: `None` accepts it (with probability min(1, p(d)/q(d))), `Some(t)`
    /// rejects it for `t` drawn from the normalised residual max(0, p − q). Greedy (one-hot
    /// `p` and `q`) this accepts exactly when `d` is the target's arg-max and otherwise returns
    /// the arg-max, drawing nothing.
    pub fn verify(&mut self, p: &[f64], q: &[f64], d: u32) -> Option<u32> {
        if self.is_greedy() {
            let a = argmax_f64(p);
            return (a != d).then_some(a);
        }
        let u = self.rng.unit();
        let v = self.rng.unit();
        speculative_step(p, q, d, u, v)
    }
}

/// The speculative-sampling rule with its two uniform draws `u` (accept) and `v` (residual):
/// accept `d` when `u · q(d) < p(d)`, else draw from max(0, p − q) normalised (from `p` if that
/// has no mass, which only rounding can cause).
pub fn speculative_step(p: &[f64], q: &[f64], d: u32, u: f64, v: f64) -> Option<u32> {
    let di = d as usize;
    if u * q[di] < p[di] {
        return None;
    }
    let r: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    if r.iter().sum::<f64>() > 0.0 {
        Some(draw_from(&r, v))
    } else {
        Some(draw_from(p, v))
    }
}

/// Inverse-CDF draw from unnormalised weights `w` with a uniform `u` in [0, 1).
fn draw_from(w: &[f64], u: f64) -> u32 {
    let total: f64 = w.iter().sum();
    let mut x = u * total;
    let mut last = 0;
    for (i, &p) in w.iter().enumerate() {
        if p > 0.0 {
            last = i;
            if x < p {
                return i as u32;
            }
            x -= p;
        }
    }
    last as u32
}

/// Index of the largest value (first on ties).
fn argmax_f64(v: &[f64]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Index of the largest logit (first on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Counts and timings of a generation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    /// Decode forwards (sampled tokens fed back).
    pub generated: usize,
    pub decode_secs: f64,
    /// Whether it stopped at an end-of-sequence token (rather than at its token limit or at
    /// the caller's request).
    pub stopped_at_eos: bool,
    /// Speculative decoding counters (all zero without a drafter).
    pub draft: DraftStats,
}

/// What speculative decoding did in one generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Tokens drafted per verify forward (0: no drafting).
    pub k: usize,
    /// Verify forwards run (each feeds the last sampled token and its drafts).
    pub verify_forwards: u64,
    /// Rollbacks that restored the cache and replayed the kept rows (a draft was rejected).
    pub replays: u64,
    /// Drafts proposed and accepted at each draft position (position 0 = the first draft).
    pub proposed: [u64; crate::mtp::MAX_DRAFT],
    pub accepted: [u64; crate::mtp::MAX_DRAFT],
    /// Tokens the verify forwards produced (accepted drafts plus the corrected or bonus
    /// token of each).
    pub tokens: u64,
    /// `--draft auto` turned drafting off at least once (it did not pay then).
    pub auto_off: bool,
    /// `--draft auto`: times drafting was switched off, and back on
    /// ([`crate::autodraft::AutoDraft`]).
    pub auto_offs: u64,
    pub auto_ons: u64,
    /// `--draft auto` stopped drafting for the rest of the generation.
    pub auto_stopped: bool,
    /// Tokens decoded without drafts while `--draft auto` had drafting off.
    pub plain_tokens: u64,
    /// Distinct routed experts the verify forwards' MoE layers asked for, summed over
    /// layers and forwards (each forward's union per layer; its mean per forward and layer
    /// is what drafting multiplies the expert reads by, against `top_k` for one token).
    pub window_experts: u64,
    /// MoE layer passes of the verify forwards (what `window_experts` is summed over).
    pub window_layers: u64,
}

impl DraftStats {
    /// Acceptance rate at each draft position (of those proposed there).
    pub fn acceptance(&self) -> Vec<f64> {
        (0..self.k.min(crate::mtp::MAX_DRAFT))
            .map(|i| {
                if self.proposed[i] == 0 {
                    0.0
                } else {
                    self.accepted[i] as f64 / self.proposed[i] as f64
                }
            })
            .collect()
    }

    /// Distinct routed experts per MoE layer per verify forward, on average (0 when none ran).
    pub fn window_experts_per_layer(&self) -> f64 {
        if self.window_layers == 0 {
            0.0
        } else {
            self.window_experts as f64 / self.window_layers as f64
        }
    }

    /// Tokens per verify forward (0 when none ran).
    pub fn tokens_per_forward(&self) -> f64 {
        if self.verify_forwards == 0 {
            0.0
        } else {
            self.tokens as f64 / self.verify_forwards as f64
        }
    }
}

impl GenStats {
    /// Prompt tokens per second of the prefill (0 when it took no measurable time).
    pub fn prefill_tps(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_secs)
    }

    /// Decode forwards per second (0 when none ran).
    pub fn decode_tps(&self) -> f64 {
        rate(self.generated, self.decode_secs)
    }
}

/// `n / secs`, 0 when `secs` is not positive.
pub fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// A model [`generate`] can drive: the whole model or one whose routed experts live
/// elsewhere (keep-runtime's budgeted model).
pub trait Generate {
    /// The model's config (vocabulary, context, beginning- and end-of-sequence tokens).
    fn cfg(&self) -> &ModelConfig;
    /// An empty KV cache.
    fn new_cache(&self) -> Cache;
    /// Feed `tokens` after those in `cache`; the logits of the last one.
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>>;
    /// [`Generate::forward_last`] into `logits` (replaced), the buffer [`generate`] keeps for
    /// the whole run. Default: through `forward_last`; a model that writes into the caller's
    /// buffer overrides it, so that a warm decode step allocates nothing.
    fn forward_last_into(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        *logits = self.forward_last(tokens, cache, obs)?;
        Ok(())
    }
    /// An empty KV cache for a run of `context` tokens (the prompt and every token to
    /// sample). Default: [`Generate::new_cache`]; a model whose cache can be reserved up front
    /// overrides it, so that no decode step grows it.
    fn new_cache_for(&self, context: usize) -> Cache {
        let _ = context;
        self.new_cache()
    }
    /// Tokens drafted per verify forward (0, the default: this model does not draft).
    fn draft_tokens(&self) -> usize {
        0
    }
    /// Whether drafting may be switched off and on by its running estimate of whether it pays
    /// ([`crate::autodraft::AutoDraft`]).
    fn draft_auto(&self) -> bool {
        false
    }
    /// Drafting is over for this generation (the drafter need not be kept in step any more).
    fn stop_drafting(&mut self) {}
    /// Drafting is switched off for now (`true`) or back on: a drafter may then hold back the
    /// work of keeping in step until it drafts again.
    fn pause_drafting(&mut self, _paused: bool) {}
    /// Draft up to `k` tokens after `last` (sampled, not yet fed), each with the drafter's
    /// logits it was picked from by `pick`; empty when the model cannot draft now.
    fn draft(
        &mut self,
        _last: u32,
        _k: usize,
        _pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> Result<Vec<(u32, Vec<f32>)>> {
        Ok(vec![])
    }
    /// Feed `tokens` (the last sampled token and its drafts) in one forward; the logits of
    /// every row. Only called after a non-empty [`Generate::draft`].
    fn forward_verify(
        &mut self,
        _tokens: &[u32],
        _cache: &mut Cache,
        _obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        Err(ModelError::Config("this model does not draft".into()))
    }
    /// Keep the first `keep` tokens of the last verify forward (roll the caches back past
    /// the others).
    fn accept_drafts(&mut self, _cache: &mut Cache, _keep: usize) -> Result<()> {
        Ok(())
    }
    /// Feed `tokens[i]` to the sequence of `caches[i]`, one token each; the logits
    /// `[N × vocab]`, row `i` equal to `forward_last(&[tokens[i]], caches[i])`. The default runs
    /// the sequences one by one; the whole and the budgeted model run one batched step
    /// ([`Model::forward_batch`]).
    fn forward_batch(&mut self, tokens: &[u32], caches: &mut [&mut Cache]) -> Result<Vec<f32>> {
        if tokens.len() != caches.len() {
            return Err(ModelError::Cache(format!(
                "{} tokens for {} caches in a batched step",
                tokens.len(),
                caches.len()
            )));
        }
        let mut out = Vec::with_capacity(tokens.len() * self.cfg().vocab);
        for (&t, c) in tokens.iter().zip(caches.iter_mut()) {
            out.extend(self.forward_last(&[t], c, None)?);
        }
        Ok(out)
    }
    /// Called once, right before the prompt's forward (a budgeted model zeroes its counters).
    fn starting(&mut self) {}
    /// Called once, right after the prompt's forward (a budgeted model takes its prefill
    /// counters here).
    fn prefilled(&mut self) {}
}

impl Generate for Model<'_> {
    fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }
    fn new_cache(&self) -> Cache {
        Model::new_cache(self)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        self.forward_drafting(tokens, cache, Logits::Last, obs)
    }
    /// Without a drafter, [`Model::forward_into`]: a warm decode step allocates nothing.
    fn forward_last_into(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if self.mtp.is_some() || self.dspark.is_some() {
            *logits = self.forward_drafting(tokens, cache, Logits::Last, obs)?;
            return Ok(());
        }
        self.forward_into(tokens, cache, Logits::Last, obs, logits)
    }
    /// [`Cache::for_context`]: every buffer reserved for the run.
    fn new_cache_for(&self, context: usize) -> Cache {
        Cache::for_context(&self.cfg, context, self.opts.chunk())
    }
    fn draft_tokens(&self) -> usize {
        Model::draft_tokens(self)
    }
    fn draft_auto(&self) -> bool {
        self.mtp_auto()
    }
    fn stop_drafting(&mut self) {
        self.detach_mtp();
    }
    fn pause_drafting(&mut self, paused: bool) {
        Model::pause_drafting(self, paused);
    }
    fn draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> Result<Vec<(u32, Vec<f32>)>> {
        Model::draft(self, last, k, pick)
    }
    fn forward_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        Model::forward_verify(self, tokens, cache, obs)
    }
    fn accept_drafts(&mut self, cache: &mut Cache, keep: usize) -> Result<()> {
        Model::accept_drafts(self, cache, keep)
    }
    fn forward_batch(&mut self, tokens: &[u32], caches: &mut [&mut Cache]) -> Result<Vec<f32>> {
        Model::forward_batch(self, tokens, caches)
    }
}

/// The model's tokenizer: `tokenizer.json` in its directory.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let p = dir.join("tokenizer.json");
    Tokenizer::from_file(&p).map_err(|e| {
        ModelError::Tokenizer(format!("{}: cannot load the tokenizer: {e}", p.display()))
    })
}

/// Where the prompt's token ids come from.
#[derive(Debug, Clone, Copy)]
pub enum Prompt<'a> {
    /// Text encoded with the tokenizer as mlx-lm's `generate` encodes (the tokenizer's special
    /// tokens added). Empty text starts from the beginning-of-sequence token.
    Text(&'a str),
    /// Token ids as they are (none: the beginning-of-sequence token).
    Ids(&'a [u32]),
    /// `n` deterministic token ids for models without a tokenizer ([`synthetic_prompt`]).
    Synthetic(usize),
    /// A text prompt with its last token backed off ([`Healed`]).
    Healed(&'a Healed),
}

/// A text prompt with its last token backed off ("token healing", as guidance does): the model
/// is prefilled with every token but the last, and the first sampled token must begin with the
/// backed-off token's text. A prompt that ends inside what the tokenizer makes one token (a
/// newline before an indented line: a byte-level BPE merges `"\n"` and the indent into one
/// token) is then continued as the model saw such text in training, not as if the token
/// boundary were real, where a model takes a lone `"\n"` token to end the block. The text
/// handed on starts after the prompt's text. Built once per prompt and tokenizer (it decodes
/// every token of the vocabulary).
#[derive(Debug, Clone)]
pub struct Healed {
    ids: Vec<u32>,
    /// The backed-off token's text; empty when nothing was backed off.
    prefix: String,
    /// The tokens whose text begins with `prefix` (the backed-off token among them).
    allowed: Vec<u32>,
}

impl Healed {
    /// `text` encoded as [`Prompt::Text`] encodes it, its last token backed off when it is an
    /// ordinary token whose text is whole characters and at least one token stays before it;
    /// tokens are the first `vocab` ids (the model's logits).
    pub fn new(tok: &Tokenizer, text: &str, vocab: usize) -> Result<Healed> {
        let err = |e| ModelError::Tokenizer(format!("tokenizing the prompt: {e}"));
        let mut ids = tok.encode(text, true).map_err(err)?.get_ids().to_vec();
        let one = |id: u32| tok.decode(&[id], false).map_err(err);
        let plain = Healed {
            ids: ids.clone(),
            prefix: String::new(),
            allowed: vec![],
        };
        let Some(&last) = ids.last() else {
            return Ok(plain);
        };
        let prefix = one(last)?;
        // A special token decodes to nothing once special tokens are skipped.
        let special = tok.decode(&[last], true).map_err(err)?.is_empty();
        if ids.len() < 2 || special || prefix.is_empty() || prefix.contains('\u{FFFD}') {
            return Ok(plain);
        }
        let mut allowed = vec![];
        for id in 0..vocab.min(tok.get_vocab_size(true)) as u32 {
            if one(id)?.starts_with(&prefix) {
                allowed.push(id);
            }
        }
        ids.pop();
        Ok(Healed {
            ids,
            prefix,
            allowed,
        })
    }

    /// The prompt's ids as prefilled.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The backed-off token's text (empty: nothing was backed off).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Restrict the first token's `logits` to the tokens that begin with the prefix.
    fn mask(&self, logits: &mut [f32]) {
        if self.prefix.is_empty() {
            return;
        }
        let mut keep = vec![false; logits.len()];
        for &a in &self.allowed {
            if let Some(k) = keep.get_mut(a as usize) {
                *k = true;
            }
        }
        for (l, k) in logits.iter_mut().zip(keep) {
            if !k {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The part of `piece` past what is left of a healed prompt's prefix in `strip` (consumed as it
/// is matched; a piece that does not continue it ends the stripping and is handed on whole).
fn strip_healed<'s>(strip: &mut String, piece: &'s str) -> &'s str {
    if strip.is_empty() {
        return piece;
    }
    if let Some(rest) = piece.strip_prefix(strip.as_str()) {
        strip.clear();
        return rest;
    }
    if strip.starts_with(piece) {
        strip.drain(..piece.len());
        return "";
    }
    strip.clear();
    piece
}

/// The state keep-rng's [`keep_rng::Lcg64`] stream starts from for [`synthetic_prompt`].
pub const SYNTHETIC_PROMPT_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// `n` deterministic token ids below `vocab` (keep-rng's 64-bit LCG stream, Knuth's MMIX
/// constants, from [`SYNTHETIC_PROMPT_SEED`]; bits 33.. of each output modulo `vocab`): the
/// prompt of a model without a tokenizer, the same for every run.
pub fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    use keep_rng::RngCore;
    let mut r = keep_rng::lcg(SYNTHETIC_PROMPT_SEED);
    (0..n)
        .map(|_| ((r.next_u64() >> 33) % vocab.max(1) as u64) as u32)
        .collect()
}

/// The prompt's token ids: text needs `tok`; a prompt of no tokens becomes `[cfg.bos]`. Refuses
/// a prompt that, with `max_tokens` more, exceeds the model's context
/// (`max_position_embeddings`) — checked before a synthetic prompt is allocated.
pub fn encode_prompt(
    cfg: &ModelConfig,
    tok: Option<&Tokenizer>,
    prompt: Prompt,
    max_tokens: usize,
) -> Result<Vec<u32>> {
    let check = |n: usize| {
        let limit = cfg.raw.max_position_embeddings;
        if n.saturating_add(max_tokens) > limit {
            return Err(ModelError::TooLong {
                prompt: n,
                max_tokens,
                limit,
            });
        }
        Ok(())
    };
    let mut ids = match prompt {
        Prompt::Text("") => vec![],
        Prompt::Text(t) => {
            let tok = tok.ok_or_else(|| {
                ModelError::Tokenizer("a text prompt needs the model's tokenizer".into())
            })?;
            tok.encode(t, true)
                .map_err(|e| ModelError::Tokenizer(format!("tokenizing the prompt: {e}")))?
                .get_ids()
                .to_vec()
        }
        Prompt::Ids(ids) => ids.to_vec(),
        Prompt::Healed(h) => h.ids.clone(),
        Prompt::Synthetic(n) => {
            check(n)?;
            synthetic_prompt(n, cfg.vocab)
        }
    };
    if ids.is_empty() {
        ids.push(cfg.bos);
    }
    check(ids.len())?;
    Ok(ids)
}

/// The streaming detokenizer: generated text as it grows, multi-token characters whole.
///
/// Each token decodes a short window, not the whole sequence: the tokens from the start of the
/// piece returned before the last (`prefix`) on, and what is new is the window's text past
/// the text of its already returned tokens (the offsets text-generation-inference and
/// `tokenizers`' `DecodeStream` keep). A decoder that strips a leading space or merges across
/// tokens sees the same context either way, so the pieces are those of decoding the whole
/// sequence at every token ([`TextStream::push_whole`], the reference the tests hold this to);
/// where the window's text does not extend what was returned (a decoder rewrote earlier text)
/// the whole sequence is decoded as the reference does, from where it differs. A token costs
/// two decodes of a few tokens, where decoding the whole sequence made a generation's
/// detokenizing quadratic in its length.
pub struct TextStream<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    /// Every piece returned so far, joined.
    printed: String,
    /// The window starts at `ids[prefix]`; `ids[prefix..read]` were returned, and their text
    /// decoded alone is `prefix_text`.
    prefix: usize,
    read: usize,
    prefix_text: String,
    /// The piece the last [`TextStream::push`] returned.
    piece: String,
    /// Tokens whose piece needed the whole sequence decoded.
    whole_decodes: usize,
}

impl<'t> TextStream<'t> {
    pub fn new(tok: &'t Tokenizer) -> TextStream<'t> {
        TextStream {
            tok,
            ids: vec![],
            printed: String::new(),
            prefix: 0,
            read: 0,
            prefix_text: String::new(),
            piece: String::new(),
            whole_decodes: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tok
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer(format!("detokenizing: {e}")))
    }

    /// Add a token; the text that follows what was returned so far (empty while the text ends
    /// in an incomplete character; if decoding rewrote earlier text, from where it differs).
    pub fn push(&mut self, t: u32) -> Result<&str> {
        self.ids.push(t);
        let text = self.decode(&self.ids[self.prefix..])?;
        if text.ends_with('\u{FFFD}') {
            return Ok("");
        }
        match text.strip_prefix(self.prefix_text.as_str()) {
            Some("") => return Ok(""),
            Some(new) => {
                self.piece.clear();
                self.piece.push_str(new);
                self.printed.push_str(new);
            }
            None => {
                // Earlier text rewritten: the whole sequence, as the reference decodes it.
                self.whole_decodes += 1;
                let whole = self.decode(&self.ids)?;
                if whole.ends_with('\u{FFFD}') || whole == self.printed {
                    return Ok("");
                }
                let common = common_prefix(&self.printed, &whole);
                self.piece.clear();
                self.piece.push_str(&whole[common..]);
                self.printed = whole;
            }
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        self.prefix_text = self.decode(&self.ids[self.prefix..self.read])?;
        Ok(&self.piece)
    }

    /// [`TextStream::push`] by decoding the whole sequence at every token: the reference
    /// (quadratic in the length; for tests).
    pub fn push_whole(&mut self, t: u32) -> Result<&str> {
        self.ids.push(t);
        let text = self.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') || text == self.printed {
            return Ok("");
        }
        let common = common_prefix(&self.printed, &text);
        self.printed = text;
        Ok(&self.printed[common..])
    }
}

/// Bytes of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .take_while(|((_, x), y)| x == y)
        .last()
        .map(|((i, c), _)| i + c.len_utf8())
        .unwrap_or(0)
}

/// What a generation hands its caller, in order.
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    /// The prompt's token ids, once, after they were encoded and checked and before any
    /// forward.
    Prompt(&'a [u32]),
    /// New text (with a tokenizer); never empty.
    Text(&'a str),
    /// A sampled token (without a tokenizer).
    Token(u32),
}

/// How to generate.
#[derive(Clone, Copy)]
pub struct GenerateOptions<'a> {
    /// Most tokens to sample (the end-of-sequence token included).
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    /// Encodes a text prompt and detokenizes the output; without one the caller gets token
    /// ids.
    pub tokenizer: Option<&'a Tokenizer>,
}

/// What [`Decoder::next`] made of one row of logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampled<'a> {
    /// An end-of-sequence token: the sequence is over (the token is neither handed on nor fed
    /// back).
    Eos(u32),
    /// A token and the text it completes (empty while a character is incomplete, or without a
    /// tokenizer); `last` when it was the last the token limit allows (not to be fed back).
    Token { id: u32, text: &'a str, last: bool },
}

/// One sequence's sampling state: its [`Sampler`], end-of-sequence tokens, token limit and
/// streaming detokenizer. [`generate`] drives one; a server that batches sequences drives one
/// per sequence, so both sample and stop alike.
pub struct Decoder<'t> {
    sampler: Sampler,
    text: Option<TextStream<'t>>,
    eos: Vec<u32>,
    max_tokens: usize,
    sampled: usize,
}

impl<'t> Decoder<'t> {
    /// A decoder for `cfg`'s end-of-sequence tokens with `opts`' limit, sampling and tokenizer;
    /// refuses bad sampling settings ([`SamplerConfig::check`]).
    pub fn new(cfg: &ModelConfig, opts: &GenerateOptions<'t>) -> Result<Decoder<'t>> {
        opts.sampling.check()?;
        Ok(Decoder {
            sampler: Sampler::new(opts.sampling),
            text: opts.tokenizer.map(TextStream::new),
            eos: cfg.eos.clone(),
            max_tokens: opts.max_tokens,
            sampled: 0,
        })
    }

    /// Tokens sampled so far (an end-of-sequence token included).
    pub fn sampled(&self) -> usize {
        self.sampled
    }

    /// Whether the token limit is reached.
    pub fn done(&self) -> bool {
        self.sampled >= self.max_tokens
    }

    /// Sample the next token from `logits` (the last position's row).
    pub fn next(&mut self, logits: &[f32]) -> Result<Sampled<'_>> {
        let id = self.sampler.sample(logits);
        self.push(id)
    }

    /// Tokens the limit still allows.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.sampled)
    }

    /// Hand on `id`, chosen elsewhere (an accepted draft, or a rejected draft's correction).
    pub fn push(&mut self, id: u32) -> Result<Sampled<'_>> {
        self.sampled += 1;
        if self.eos.contains(&id) {
            return Ok(Sampled::Eos(id));
        }
        let last = self.sampled >= self.max_tokens;
        let text = match self.text.as_mut() {
            Some(ts) => ts.push(id)?,
            None => "",
        };
        Ok(Sampled::Token { id, text, last })
    }
}

/// Positions [`generate`] reserves its cache for up front: a run's prompt and `max_tokens`, up
/// to this many (a `max_tokens` far past what a run will use must not reserve memory for it).
pub const MAX_RESERVED_CONTEXT: usize = 8192;

/// Positions [`generate`] reserves for a prompt of `prompt` tokens and `max_tokens` more.
fn reserved_context(prompt: usize, max_tokens: usize) -> usize {
    prompt.saturating_add(max_tokens).min(MAX_RESERVED_CONTEXT)
}

/// Encode `prompt`, prefill it, then sample up to `opts.max_tokens` tokens, handing each to
/// `on_piece` (as text with a tokenizer, else as an id); stops early at one of the config's
/// end-of-sequence tokens (neither handed on nor fed back) or when `on_piece` breaks. `obs`
/// sees every forward.
pub fn generate<G: Generate + ?Sized>(
    model: &mut G,
    prompt: Prompt,
    opts: &GenerateOptions,
    mut obs: Option<&mut dyn RouteObserver>,
    mut on_piece: impl FnMut(Piece) -> ControlFlow<()>,
) -> Result<GenStats> {
    let mut dec = Decoder::new(model.cfg(), opts)?;
    let healed = match prompt {
        Prompt::Healed(h) => Some(h),
        _ => None,
    };
    let mut strip = healed.map(|h| h.prefix.clone()).unwrap_or_default();
    let prompt = encode_prompt(model.cfg(), opts.tokenizer, prompt, opts.max_tokens)?;
    let mut stats = GenStats {
        prompt_tokens: prompt.len(),
        ..GenStats::default()
    };
    if on_piece(Piece::Prompt(&prompt)).is_break() {
        return Ok(stats);
    }
    // The cache reserved for the run (at most MAX_RESERVED_CONTEXT positions: a run asked for
    // more grows its cache past that as it goes) and one logits buffer kept for it: a decode
    // step of a model that writes into them allocates nothing.
    let mut cache = model.new_cache_for(reserved_context(prompt.len(), opts.max_tokens));
    let mut logits = Vec::new();
    model.starting();
    profile::set_phase(Phase::Prefill);
    let t0 = Instant::now();
    model.forward_last_into(
        &prompt,
        &mut cache,
        obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
        &mut logits,
    )?;
    stats.prefill_secs = t0.elapsed().as_secs_f64();
    if let Some(h) = healed {
        h.mask(&mut logits);
    }
    model.prefilled();
    profile::set_phase(Phase::Decode);
    let t1 = Instant::now();
    let k = model.draft_tokens().min(crate::mtp::MAX_DRAFT);
    stats.draft.k = k;
    let mut auto = (k > 0 && model.draft_auto()).then(|| crate::autodraft::AutoDraft::new(k));
    let vocab = model.cfg().vocab;
    // The next token: drawn from `logits`, or already chosen (a rejected draft's correction).
    let mut chosen: Option<u32> = None;
    // Hand one token on; `true` when the generation ends here.
    let mut emit = |dec: &mut Decoder, tok: u32, stats: &mut GenStats| -> Result<bool> {
        let _p = profile::span(Part::Output);
        Ok(match dec.push(tok)? {
            Sampled::Eos(_) => {
                stats.stopped_at_eos = true;
                true
            }
            Sampled::Token { id, text, last } => {
                let flow = match (opts.tokenizer, strip_healed(&mut strip, text)) {
                    (Some(_), "") => ControlFlow::Continue(()),
                    (Some(_), s) => on_piece(Piece::Text(s)),
                    (None, _) => on_piece(Piece::Token(id)),
                };
                flow.is_break() || last
            }
        })
    };
    'gen: while !dec.done() {
        let tok = match chosen.take() {
            Some(t) => t,
            None => dec.sampler.sample(&logits),
        };
        if emit(&mut dec, tok, &mut stats)? {
            break;
        }
        let step0 = Instant::now();
        // Drafts past the token limit could never be handed on.
        let want = if auto.as_ref().is_some_and(|a| !a.drafting()) {
            0
        } else {
            k.min(dec.remaining())
        };
        let drafts = if want > 0 {
            let s = &mut dec.sampler;
            model.draft(tok, want, &mut |q| {
                let pq = s.probs(q);
                s.draw(&pq)
            })?
        } else {
            vec![]
        };
        if drafts.is_empty() {
            model.forward_last_into(
                &[tok],
                &mut cache,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
                &mut logits,
            )?;
            stats.generated += 1;
            if let Some(a) = auto.as_mut() {
                let sw = a.step(false, step0.elapsed().as_secs_f64(), 1);
                auto_switched(model, a, sw, &mut stats.draft);
            }
            continue;
        }
        let mut fed = Vec::with_capacity(drafts.len() + 1);
        fed.push(tok);
        fed.extend(drafts.iter().map(|d| d.0));
        let mut union = WindowUnion {
            inner: obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
            experts: 0,
            layers: 0,
            seen: vec![],
        };
        let rows = model.forward_verify(&fed, &mut cache, Some(&mut union))?;
        stats.draft.window_experts += union.experts;
        stats.draft.window_layers += union.layers;
        stats.draft.verify_forwards += 1;
        let mut keep = 1;
        for (i, (d, q)) in drafts.iter().enumerate() {
            stats.draft.proposed[i] += 1;
            let p = dec.sampler.probs(&rows[i * vocab..(i + 1) * vocab]);
            let pq = dec.sampler.probs(q);
            match dec.sampler.verify(&p, &pq, *d) {
                None => {
                    stats.draft.accepted[i] += 1;
                    stats.draft.tokens += 1;
                    keep += 1;
                    if emit(&mut dec, *d, &mut stats)? {
                        stats.generated += keep;
                        break 'gen;
                    }
                }
                Some(t) => {
                    chosen = Some(t);
                    break;
                }
            }
        }
        stats.draft.tokens += 1;
        if keep < fed.len() {
            stats.draft.replays += 1;
        } else {
            logits.clear();
            logits.extend_from_slice(&rows[drafts.len() * vocab..]);
        }
        model.accept_drafts(&mut cache, keep)?;
        stats.generated += keep;
        if let Some(a) = auto.as_mut() {
            let sw = a.step(true, step0.elapsed().as_secs_f64(), keep as u64);
            auto_switched(model, a, sw, &mut stats.draft);
        }
    }
    stats.decode_secs = t1.elapsed().as_secs_f64();
    Ok(stats)
}

/// The observer of a verify forward: counts the distinct experts each MoE layer routes the
/// window's rows to, passing every event on.
struct WindowUnion<'o> {
    inner: Option<&'o mut dyn RouteObserver>,
    experts: u64,
    layers: u64,
    seen: Vec<bool>,
}

impl RouteObserver for WindowUnion<'_> {
    fn wants_expert_outputs(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|o| o.wants_expert_outputs())
    }
    fn wants_linear_inputs(&self) -> bool {
        self.inner.as_ref().is_some_and(|o| o.wants_linear_inputs())
    }
    fn wants_candidate_outputs(&self, layer: usize) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|o| o.wants_candidate_outputs(layer))
    }
    fn wants_kv_fp8(&self) -> bool {
        self.inner.as_ref().is_some_and(|o| o.wants_kv_fp8())
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        self.layers += 1;
        self.seen.clear();
        for &e in ev.experts {
            let e = e as usize;
            if e >= self.seen.len() {
                self.seen.resize(e + 1, false);
            }
            if !self.seen[e] {
                self.seen[e] = true;
                self.experts += 1;
            }
        }
        if let Some(o) = self.inner.as_mut() {
            o.on_route(ev);
        }
    }
    fn on_candidate_output(&mut self, ev: &crate::observer::CandidateOutputEvent) {
        if let Some(o) = self.inner.as_mut() {
            o.on_candidate_output(ev);
        }
    }
    fn on_expert_output(&mut self, ev: &crate::observer::ExpertOutputEvent) {
        if let Some(o) = self.inner.as_mut() {
            o.on_expert_output(ev);
        }
    }
    fn on_linear_input(&mut self, ev: &crate::observer::LinearInputEvent) {
        if let Some(o) = self.inner.as_mut() {
            o.on_linear_input(ev);
        }
    }
    fn on_kv_fp8(&mut self, ev: &crate::observer::KvFp8Event) {
        if let Some(o) = self.inner.as_mut() {
            o.on_kv_fp8(ev);
        }
    }
}

/// Carry out `--draft auto`'s switch `sw` and count it.
fn auto_switched<G: Generate + ?Sized>(
    model: &mut G,
    a: &crate::autodraft::AutoDraft,
    sw: crate::autodraft::Switch,
    d: &mut DraftStats,
) {
    match sw {
        crate::autodraft::Switch::Stop => {
            model.stop_drafting();
            d.auto_stopped = true;
        }
        crate::autodraft::Switch::Off => model.pause_drafting(true),
        crate::autodraft::Switch::On => model.pause_drafting(false),
        crate::autodraft::Switch::Keep => {}
    }
    d.auto_offs = a.offs;
    d.auto_ons = a.ons;
    d.auto_off = a.offs > 0;
    d.plain_tokens = a.plain_tokens;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every piece [`TextStream::push`] returns, against decoding the whole sequence at each
    /// token ([`TextStream::push_whole`]).
    /// How many tokens needed the whole sequence decoded.
    fn stream_like_whole(tok: &Tokenizer, ids: &[u32], what: &str) -> usize {
        let (mut fast, mut whole) = (TextStream::new(tok), TextStream::new(tok));
        for (i, &t) in ids.iter().enumerate() {
            let a = fast.push(t).unwrap().to_string();
            let b = whole.push_whole(t).unwrap().to_string();
            assert_eq!(a, b, "{what}: token {i} ({t}) of {ids:?}");
        }
        fast.whole_decodes
    }

    #[test]
    fn the_windowed_detokenizer_returns_the_whole_decodes_pieces() {
        // The bundled model's byte-level BPE: real text (multi-byte characters split over
        // tokens) and random ids (incomplete and invalid byte sequences anywhere).
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/keep-tiny");
        let tok = load_tokenizer(std::path::Path::new(dir)).unwrap();
        for text in [
            "def parse(line):\n    return line.split(',')  # naïve — 日本語 🙂\n",
            "   leading spaces\tand tabs\n\n\nclass A:\n    pass",
            "ñ🙂🙂 é",
        ] {
            let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
            // Text decodes in windows alone.
            assert_eq!(
                stream_like_whole(&tok, &ids, text),
                0,
                "whole decodes: {text}"
            );
        }
        let vocab = tok.get_vocab_size(true);
        let mut r = keep_rng::rng(7);
        for n in 0..200 {
            let ids: Vec<u32> = (0..1 + n % 40).map(|_| r.below(vocab) as u32).collect();
            stream_like_whole(&tok, &ids, "random ids");
        }
        // A SentencePiece-style decoder (Llama's: `▁` to space, byte fallback, fuse, strip
        // one leading space): a window that starts mid-text strips its first token's space,
        // which the piece must not lose.
        let sp = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,
            "decoder":{"type":"Sequence","decoders":[
              {"type":"Replace","pattern":{"String":"▁"},"content":" "},
              {"type":"ByteFallback"},{"type":"Fuse"},
              {"type":"Strip","content":" ","start":1,"stop":0}]},
            "model":{"type":"WordLevel","unk_token":"<unk>","vocab":{"<unk>":0,"▁Hello":1,
              "▁world":2,"!":3,"<0xE6>":4,"<0x97>":5,"<0xA5>":6,"▁":7,"ab":8,"<0xFF>":9}}}"#;
        let tok: Tokenizer = sp.parse().unwrap();
        for ids in [
            vec![1, 2, 3, 7, 4, 5, 6, 2, 8, 1],
            vec![7, 7, 1, 4, 5, 2, 6, 9, 8, 3],
            vec![4, 5, 6, 4, 5, 6, 7, 1, 9, 9, 2],
        ] {
            assert_eq!(stream_like_whole(&tok, &ids, "sentencepiece"), 0);
        }
        for n in 0..200 {
            let ids: Vec<u32> = (0..1 + n % 30).map(|_| r.below(10) as u32).collect();
            stream_like_whole(&tok, &ids, "sentencepiece, random ids");
        }
    }

    #[test]
    fn the_cache_is_reserved_for_the_run_up_to_the_cap() {
        // A run's prompt and tokens, up to MAX_RESERVED_CONTEXT positions: a model with a
        // context of a million positions asked for all of it reserves no more than the cap.
        assert_eq!(reserved_context(8, 100), 108);
        assert_eq!(reserved_context(100, 1 << 20), MAX_RESERVED_CONTEXT);
        assert_eq!(reserved_context(usize::MAX, 1), MAX_RESERVED_CONTEXT);
    }

    /// A model whose logits favour `(last token + 1) % vocab`, for the loop's bookkeeping.
    struct Counter {
        cfg: ModelConfig,
        forwards: Vec<Vec<u32>>,
    }

    impl Generate for Counter {
        fn cfg(&self) -> &ModelConfig {
            &self.cfg
        }
        fn new_cache(&self) -> Cache {
            Cache::new(0)
        }
        fn forward_last(
            &mut self,
            tokens: &[u32],
            _: &mut Cache,
            _: Option<&mut dyn RouteObserver>,
        ) -> Result<Vec<f32>> {
            self.forwards.push(tokens.to_vec());
            let mut l = vec![0f32; self.cfg.vocab];
            l[(*tokens.last().unwrap() as usize + 1) % self.cfg.vocab] = 1.0;
            Ok(l)
        }
    }

    fn counter(json: &str) -> Counter {
        let c = keep_checkpoint::DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap();
        Counter {
            cfg: ModelConfig::from_deepseek(&c).unwrap(),
            forwards: vec![],
        }
    }

    const GREEDY: SamplerConfig = SamplerConfig {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };

    fn run(m: &mut Counter, prompt: Prompt, max_tokens: usize) -> (Vec<u32>, GenStats) {
        let mut got = vec![];
        let opts = GenerateOptions {
            max_tokens,
            sampling: GREEDY,
            tokenizer: None,
        };
        let s = generate(m, prompt, &opts, None, |p| {
            if let Piece::Token(t) = p {
                got.push(t);
            }
            ControlFlow::Continue(())
        })
        .unwrap();
        (got, s)
    }

    #[test]
    fn a_healed_prompt_backs_off_its_last_token_and_the_first_token_continues_it() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/keep-tiny");
        let tok = load_tokenizer(std::path::Path::new(dir)).unwrap();
        let text = "def f(x):\n    \"\"\"Doc.\"\"\"\n";
        let plain = tok.encode(text, true).unwrap().get_ids().to_vec();
        let h = Healed::new(&tok, text, 4096).unwrap();
        assert_eq!(h.ids(), &plain[..plain.len() - 1]);
        assert_eq!(h.prefix(), "\n");
        // The byte-level BPE's newline-and-indent token is among the allowed first tokens.
        let indent = tok.encode("def f(x):\n    return x", true).unwrap();
        let nl_indent = indent.get_ids()[indent
            .get_tokens()
            .iter()
            .position(|t| t.starts_with('Ċ'))
            .unwrap()];
        assert!(h.allowed.contains(&nl_indent) && h.allowed.contains(&plain[plain.len() - 1]));
        let decode = |id: u32| tok.decode(&[id], false).unwrap();
        assert!(h.allowed.iter().all(|&a| decode(a).starts_with('\n')));

        // Through generate: the model (favouring the token after the last one fed) may only
        // start with a token that begins with "\n", and the text handed on starts after it.
        let opts = |tokenizer| GenerateOptions {
            max_tokens: 3,
            sampling: GREEDY,
            tokenizer,
        };
        let gen = |prompt: Prompt| {
            let mut m = counter(r#"{"vocab_size":4096}"#);
            let mut text = String::new();
            generate(&mut m, prompt, &opts(Some(&tok)), None, |p| {
                if let Piece::Text(t) = p {
                    text.push_str(t);
                }
                ControlFlow::Continue(())
            })
            .unwrap();
            (m.forwards, text)
        };
        let (fwd, healed_text) = gen(Prompt::Healed(&h));
        assert_eq!(fwd[0], h.ids());
        let first = fwd[1][0];
        assert!(h.allowed.contains(&first), "{first} {:?}", decode(first));
        let want: String = [first, fwd[2][0]]
            .iter()
            .map(|&t| decode(t))
            .collect::<String>()
            .strip_prefix('\n')
            .unwrap()
            .to_string();
        assert!(healed_text.starts_with(&want), "{healed_text:?} {want:?}");
        // The plain prompt takes the token after the last one, which is no newline.
        let (fwd, _) = gen(Prompt::Text(text));
        assert_eq!(fwd[0], plain);
        assert_eq!(fwd[1][0], plain[plain.len() - 1] + 1);
        assert!(!h.allowed.contains(&fwd[1][0]));
    }

    #[test]
    fn stripping_a_healed_prefix_follows_the_pieces() {
        let mut s = String::from("\n  ");
        assert_eq!(strip_healed(&mut s, "\n"), "");
        assert_eq!(strip_healed(&mut s, "  x"), "x");
        assert_eq!(strip_healed(&mut s, "y"), "y");
        let mut s = String::from("ab");
        assert_eq!(strip_healed(&mut s, "zz"), "zz");
        assert_eq!(strip_healed(&mut s, "ab"), "ab");
    }

    #[test]
    fn stops_at_eos_without_handing_it_on_or_feeding_it_back() {
        let mut m = counter(r#"{"vocab_size":16,"bos_token_id":3,"eos_token_id":[7]}"#);
        let (got, s) = run(&mut m, Prompt::Ids(&[]), 10);
        assert_eq!(got, vec![4, 5, 6]);
        assert!(s.stopped_at_eos);
        assert_eq!(m.forwards, vec![vec![3], vec![4], vec![5], vec![6]]);
        assert_eq!((s.prompt_tokens, s.generated), (1, 3));
    }

    #[test]
    fn stops_at_the_token_limit_without_feeding_the_last_back() {
        let mut m = counter(r#"{"vocab_size":16}"#);
        let (got, s) = run(&mut m, Prompt::Ids(&[1, 2]), 3);
        assert_eq!(got, vec![3, 4, 5]);
        assert!(!s.stopped_at_eos);
        assert_eq!(m.forwards.len(), 3);
        assert_eq!(s.generated, 2);
    }

    #[test]
    fn refuses_a_run_beyond_the_context_before_any_forward() {
        let mut m = counter(r#"{"vocab_size":16,"max_position_embeddings":8}"#);
        let opts = GenerateOptions {
            max_tokens: 5,
            sampling: GREEDY,
            tokenizer: None,
        };
        let e = generate(&mut m, Prompt::Synthetic(4), &opts, None, |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert!(matches!(e, ModelError::TooLong { prompt: 4, .. }), "{e}");
        assert!(m.forwards.is_empty());
        assert!(generate(&mut m, Prompt::Synthetic(3), &opts, None, |_| {
            ControlFlow::Continue(())
        })
        .is_ok());
        let bad = GenerateOptions {
            sampling: SamplerConfig {
                top_p: f32::NAN,
                ..GREEDY
            },
            ..opts
        };
        let e = generate(&mut m, Prompt::Ids(&[1]), &bad, None, |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err();
        assert!(e.to_string().contains("top-p"), "{e}");
    }

    /// Chi-square critical value for 5 degrees of freedom at false-failure probability 1e-6
    /// (survival function of χ²₅ at 35.9 is 9.95e-7): a correct rule fails this test with a
    /// freshly seeded generator at most once in a million; this test seeds it with a fixed
    /// value, so the run is reproducible.
    const CHI2_5DF_P1E6: f64 = 35.9;

    /// Pearson's χ² of `counts` against distribution `p`.
    fn chi2(counts: &[u64], p: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&c, &pi)| {
                let e = pi * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn speculative_sampling_keeps_the_target_distribution() {
        // Six tokens; the draft distribution q puts mass where p has little and none where p
        // has some, so acceptance, rejection and the residual all matter.
        let p = [0.30, 0.25, 0.20, 0.12, 0.08, 0.05];
        let q = [0.05, 0.40, 0.00, 0.25, 0.20, 0.10];
        let n = 200_000;
        let mut r = keep_rng::rng(2024);
        let (mut out, mut drafted) = ([0u64; 6], [0u64; 6]);
        let mut accepted = 0;
        for _ in 0..n {
            let d = draw_from(&q, r.unit());
            drafted[d as usize] += 1;
            let t = match speculative_step(&p, &q, d, r.unit(), r.unit()) {
                None => {
                    accepted += 1;
                    d
                }
                Some(t) => t,
            };
            out[t as usize] += 1;
        }
        let got = chi2(&out, &p);
        assert!(got < CHI2_5DF_P1E6, "output vs p: χ² = {got}");
        // The test can fail: the drafts themselves follow q, not p.
        let drafts = chi2(&drafted, &p);
        assert!(drafts > CHI2_5DF_P1E6, "drafts vs p: χ² = {drafts}");
        // Acceptance is Σ min(p, q) = 0.55 (binomial sd 0.0011 at n = 200k).
        let rate = accepted as f64 / n as f64;
        assert!((rate - 0.55).abs() < 0.006, "acceptance {rate}");
    }

    #[test]
    fn greedy_verification_accepts_exactly_the_argmax() {
        let mut s = Sampler::new(GREEDY);
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let p = s.probs(&logits);
        assert_eq!(p, vec![0.0, 1.0, 0.0, 0.0]);
        let q = s.probs(&[3.0, 0.0, 0.0, 0.0]);
        assert_eq!(s.draw(&q), 0);
        assert_eq!(s.verify(&p, &q, 0), Some(1));
        let q1 = s.probs(&[0.0, 3.0, 0.0, 0.0]);
        assert_eq!(s.verify(&p, &q1, 1), None);
    }

    #[test]
    fn probs_is_the_distribution_sample_draws_from() {
        let logits: Vec<f32> = (0..7).map(|i| (i as f32 * 0.9).cos() * 2.0).collect();
        let cfg = SamplerConfig {
            temperature: 0.7,
            top_p: 0.8,
            seed: 5,
        };
        let mut s = Sampler::new(cfg);
        let p = s.probs(&logits);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let n = 100_000;
        let mut c = [0u64; 7];
        for _ in 0..n {
            c[s.sample(&logits) as usize] += 1;
        }
        // Tokens outside the nucleus are never drawn; the others match p (χ² over the kept
        // tokens, fewer than 7 of them, so the 5-degree bound is conservative only when at
        // most 6 are kept: checked).
        let kept: Vec<usize> = (0..7).filter(|&i| p[i] > 0.0).collect();
        assert!(kept.len() <= 6 && kept.len() >= 2, "{kept:?}");
        for i in 0..7 {
            if p[i] == 0.0 {
                assert_eq!(c[i], 0);
            }
        }
        let ck: Vec<u64> = kept.iter().map(|&i| c[i]).collect();
        let pk: Vec<f64> = kept.iter().map(|&i| p[i]).collect();
        assert!(chi2(&ck, &pk) < CHI2_5DF_P1E6);
    }

    #[test]
    fn synthetic_prompts_are_fixed_and_in_the_vocabulary() {
        let p = synthetic_prompt(6, 100);
        assert_eq!(p, synthetic_prompt(6, 100));
        assert!(p.iter().all(|&t| t < 100));
        assert_eq!(synthetic_prompt(3, 1), vec![0, 0, 0]);
        // The ids every earlier run drew (the LCG written out: s ← s·A + C, (s >> 33) % vocab).
        assert_eq!(p, vec![44, 78, 29, 73, 26, 87]);
        assert_eq!(
            synthetic_prompt(6, 129280),
            vec![75024, 48038, 79909, 77473, 2026, 62447]
        );
    }

    #[test]
    fn the_same_seed_samples_the_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let cfg = SamplerConfig {
            temperature: 0.8,
            top_p: 0.9,
            seed: 42,
        };
        let draw = |c| {
            let mut s = Sampler::new(c);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(cfg), draw(cfg));
        assert_ne!(draw(cfg), draw(SamplerConfig { seed: 43, ..cfg }));
        // The uniform stream, written out: SplitMix64 from `seed ^ φ`, 53 bits per draw.
        let mut state = 42u64 ^ 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        let mut s = Sampler::new(cfg);
        for _ in 0..10 {
            assert_eq!(s.rng.unit(), next());
        }
    }
}
