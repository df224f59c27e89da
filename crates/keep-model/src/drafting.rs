//! Speculative decoding on the whole model: [`Model`]'s drafting methods (attach the MTP
//! drafter of a checkpoint, keep it in step with every forward, draft, verify K + 1 rows in one
//! forward, roll the cache back past the first rejection) and [`Mtp::prefill_logits`] (the
//! module's logits over a prompt). The module and the drafter's state are `mtp.rs`'s; the
//! equations and the rollback are described in `docs/mtp.md`.

use keep_checkpoint::Checkpoint;

use crate::cache::Cache;
use crate::model::{Logits, Model};
use crate::mtp::{Drafter, Mtp, Verify, MAX_DRAFT};
use crate::observer::RouteObserver;
use crate::{ModelError, Result};

impl Mtp<'_> {
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
}

impl<'a> Model<'a> {
    /// Draft `k` tokens per verify forward (clamped to 1..=[`MAX_DRAFT`]) with the MTP module of
    /// `ck`; `false` (nothing attached) when the checkpoint has none.
    pub fn attach_mtp(&mut self, ck: &'a Checkpoint, k: usize) -> Result<bool> {
        let Some(mtp) = Mtp::load(ck, &self.cfg)? else {
            return Ok(false);
        };
        let mtp = mtp.with_kernels(self.opts.kernels);
        let cache = mtp.new_cache();
        self.dspark = None;
        self.mtp = Some(Box::new(Drafter {
            mtp,
            k: k.clamp(1, MAX_DRAFT),
            auto: false,
            cache,
            pending: None,
            verify: None,
            paused: false,
            backlog: None,
        }));
        Ok(true)
    }

    /// Switch drafting off for now (`paused`) or back on (`--draft auto`): while off, the
    /// forwards hand the drafter their (streams, next token) pairs without running the MTP
    /// module on them; the next [`Model::draft`] runs them all in one forward first.
    pub fn pause_drafting(&mut self, paused: bool) {
        if let Some(d) = self.mtp.as_mut() {
            d.paused = paused;
        }
    }

    /// Drop the drafter, MTP or DSpark (drafting off; forwards no longer feed it).
    pub fn detach_mtp(&mut self) {
        self.mtp = None;
        self.dspark = None;
    }

    /// Let generation turn drafting off when it does not pay (`--draft auto`).
    pub fn set_mtp_auto(&mut self, auto: bool) {
        if let Some(d) = self.mtp.as_mut() {
            d.auto = auto;
        }
        if let Some(d) = self.dspark.as_mut() {
            d.auto = auto;
        }
    }

    /// Whether generation may turn drafting off ([`Model::set_mtp_auto`]).
    pub fn mtp_auto(&self) -> bool {
        self.mtp.as_ref().is_some_and(|d| d.auto) || self.dspark.as_ref().is_some_and(|d| d.auto)
    }

    /// Tokens drafted per verify forward (0: no drafter attached).
    pub fn draft_tokens(&self) -> usize {
        match &self.dspark {
            Some(d) => d.k,
            None => self.mtp.as_ref().map_or(0, |m| m.k),
        }
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
        if self.dspark.is_some() && !tokens.is_empty() {
            return self.dspark_forward(tokens, cache, which, obs);
        }
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
            dr.backlog = None;
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
        if self.dspark.is_some() {
            return self.dspark_draft(last, k, pick);
        }
        let Some(dr) = self.mtp.as_mut() else {
            return Ok(vec![]);
        };
        dr.paused = false;
        dr.catch_up()?;
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
        if self.dspark.is_some() {
            return self.dspark_verify(tokens, cache, obs);
        }
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
        if self.dspark.is_some() {
            return self.dspark_accept(cache, keep);
        }
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
