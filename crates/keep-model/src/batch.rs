//! One decode step over N sequences, each with its own [`Cache`]: what a server that batches
//! concurrent requests runs between admissions ([`Model::forward_batch`]).
//!
//! The N new tokens (one per sequence) travel through each layer as N rows of one
//! [`Streams`]: the hyper-connection mixes, norms, router, routed experts (each expert once over
//! the rows routed to it: the batch's expert union) and shared expert run once over the rows
//! through the M = 1..32 kernels; attention runs per sequence on its own cache, at its own
//! position, with its own cross-layer [`Shared`] state. The kernels compute each
//! (input row, output row) dot by the same instruction sequence whatever M is, so every
//! sequence gets exactly the logits it gets alone, bit for bit (`tests/batch.rs` checks it).
//! The layer skeleton below is [`LayerWeights::forward`]'s with the attention call split per
//! sequence; both families are handled as there.

use crate::cache::Cache;
use crate::config::Family;
use crate::layer::{collapse, expand, hc_mix, LayerWeights, Shared, Step, Streams};
use crate::model::{check_context, step_of, Logits, Model};
use crate::{ModelError, Result};

impl Model<'_> {
    /// Feed `tokens[i]` to sequence `i` (after what `caches[i]` holds) in one batched step;
    /// the logits `[N × vocab]`, row `i` bit-identical to
    /// `forward(&[tokens[i]], caches[i], Logits::Last, None)`. Every cache is checked before
    /// any is touched (layer count, context); a failure inside a layer leaves the caches
    /// partly advanced, as a failed single forward does.
    pub fn forward_batch(&self, tokens: &[u32], caches: &mut [&mut Cache]) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        if tokens.len() != caches.len() {
            return Err(ModelError::Cache(format!(
                "{} tokens for {} caches in a batched step",
                tokens.len(),
                caches.len()
            )));
        }
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        if cfg.family.is_hugging_face() {
            // The Hugging Face families have no batched step: one sequence at a time (the
            // same logits, one weight read per sequence).
            let mut out = Vec::with_capacity(tokens.len() * cfg.vocab);
            for (&t, c) in tokens.iter().zip(caches.iter_mut()) {
                out.extend(self.forward(&[t], c, crate::Logits::Last, None)?);
            }
            return Ok(out);
        }
        for c in caches.iter() {
            if c.layers.len() != cfg.n_layers {
                return Err(ModelError::Cache(format!(
                    "{} layer caches for a {}-layer model",
                    c.layers.len(),
                    cfg.n_layers
                )));
            }
            check_context(cfg, c.pos, 1)?;
        }
        let mut s = self.globals.embed(cfg, tokens)?;
        s.check_finite(|| "the embedding".into())?;
        let steps: Vec<Step> = caches.iter().map(|c| step_of(cfg, c)).collect();
        let kernels = self.opts.kernels;
        let mut shared: Vec<Shared> = caches.iter().map(|_| Shared::on(kernels)).collect();
        let mut engram = crate::engram::EngramScratch::default();
        if let Some(e) = &self.engram {
            // Row-major per token, so the sequences' ids concatenate into the batch's.
            for (c, &t) in caches.iter_mut().zip(tokens) {
                engram.ids.extend(e.hash(&mut c.engram_history, &[t])?);
            }
        }
        for lw in &self.layers {
            if let Some(e) = &self.engram {
                e.apply(cfg, kernels, lw.layer, &mut s, &mut engram)?;
            }
            self.layer_batch(lw, &mut s, &steps, caches, &mut shared)?;
            s.check_finite(|| format!("layer {}", lw.layer))?;
        }
        for c in caches.iter_mut() {
            c.pos += 1;
        }
        self.globals.finish(cfg, kernels, &s, Logits::All)
    }

    /// [`LayerWeights::forward`] over one row per sequence.
    fn layer_batch(
        &self,
        lw: &LayerWeights,
        s: &mut Streams,
        steps: &[Step],
        caches: &mut [&mut Cache],
        shared: &mut [Shared],
    ) -> Result<()> {
        let (cfg, kernels) = (&self.cfg, self.opts.kernels);
        let (hc, d) = (cfg.hc, cfg.dim);
        let experts = self.experts.as_ref();
        let mask = self.masks[lw.layer].as_deref();
        // Attention of row i on sequence i's cache, at its position.
        let attend =
            |h: &[f32], caches: &mut [&mut Cache], shared: &mut [Shared]| -> Result<Vec<f32>> {
                let mut out = Vec::with_capacity(h.len());
                for (i, (c, sh)) in caches.iter_mut().zip(shared.iter_mut()).enumerate() {
                    let x = &h[i * d..(i + 1) * d];
                    let a = if cfg.family == Family::V4 {
                        lw.attention_v4(cfg, kernels, x, 1, steps[i], &mut c.layers, &mut None)?
                    } else {
                        lw.attention(cfg, x, 1, steps[i], &mut c.layers, sh, &mut None)?
                    };
                    out.extend_from_slice(&a);
                }
                Ok(out)
            };
        // The MoE's step only labels observer events; none is attached here.
        let moe_step = steps[0];
        if cfg.family == Family::V4 {
            let (pre, post, comb) = hc_mix(&lw.hc_attn, s, cfg)?;
            let mut h = collapse(s, &pre, hc, d);
            crate::linear::rms_norm(&mut h, d, Some(&lw.attn_norm), cfg.eps);
            let a = attend(&h, caches, shared)?;
            expand(&a, s, &post, &comb, hc, d);
            let (pre, post, comb) = hc_mix(&lw.hc_ffn, s, cfg)?;
            let mut h = collapse(s, &pre, hc, d);
            crate::linear::rms_norm(&mut h, d, Some(&lw.ffn_norm), cfg.eps);
            let m = lw.moe(
                cfg, kernels, experts, mask, &h, &s.tokens, moe_step, &mut None,
            )?;
            expand(&m, s, &post, &comb, hc, d);
            return Ok(());
        }
        let (attn_pre, attn_post, attn_comb) = hc_mix(&lw.hc_attn, s, cfg)?;
        let mut h = collapse(s, &s.pre_mix, hc, d);
        crate::linear::rms_norm(&mut h, d, Some(&lw.attn_norm), cfg.eps);
        let a = attend(&h, caches, shared)?;
        expand(&a, s, &attn_post, &attn_comb, hc, d);
        let (ffn_pre, ffn_post, ffn_comb) = hc_mix(&lw.hc_ffn, s, cfg)?;
        let mut h = collapse(s, &attn_pre, hc, d);
        crate::linear::rms_norm(&mut h, d, Some(&lw.ffn_norm), cfg.eps);
        let m = lw.moe(
            cfg, kernels, experts, mask, &h, &s.tokens, moe_step, &mut None,
        )?;
        expand(&m, s, &ffn_post, &ffn_comb, hc, d);
        s.pre_mix = ffn_pre;
        Ok(())
    }
}
