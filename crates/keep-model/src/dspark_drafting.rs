//! Speculative decoding with the DSpark drafter ([`crate::dspark`], docs/dspark.md) on the whole
//! model: [`Model::attach_dspark`] and the state that keeps the drafter in step.
//!
//! Every main forward with the drafter attached records, per row, the streams entering the
//! layers of `dspark_target_layer_ids` averaged over the hyper-connection streams, and projects
//! them (`main_proj`, `main_norm`) into the drafter's context rows; the last `sliding_window`
//! rows are kept. After the target samples `t_n` from row `n − 1`, a draft reads the context
//! through row `n − 1` with `t_n` in the first slot (the serving copies' convention) and
//! proposes `d_1 … d_k`; `[t_n, d_1 … d_k]` is verified in one forward of the target (the
//! snapshot and replay rollback of [`crate::mtp`]), and the context rows of the kept prefix
//! come from that forward's capture.

use keep_checkpoint::Checkpoint;

use crate::cache::Cache;
use crate::dspark::DSpark;
use crate::dspark::{DSparkDrafter, DSparkVerify};
use crate::model::{Logits, Model};
use crate::mtp::MAX_DRAFT;
use crate::observer::RouteObserver;
use crate::{ModelError, Result};

impl<'a> Model<'a> {
    /// Draft with the DSpark drafter of `ck`, verifying `k` drafts per forward (clamped to
    /// 1..=min(block size, [`MAX_DRAFT`])); `false` (nothing attached) when the checkpoint
    /// declares none. Any MTP drafter is dropped.
    pub fn attach_dspark(&mut self, ck: &'a Checkpoint, k: usize) -> Result<bool> {
        if !crate::dspark::present(ck) {
            return Ok(false);
        }
        let Some(ds) = DSpark::load(ck, &self.cfg)? else {
            return Ok(false);
        };
        let ds = ds.with_kernels(self.opts.kernels);
        if let Some(&l) = ds
            .keys
            .target_layer_ids
            .iter()
            .find(|&&l| l >= self.layers.len())
        {
            return Err(ModelError::Config(format!(
                "dspark_target_layer_ids names layer {l} of a {}-layer model",
                self.layers.len()
            )));
        }
        let k = k.clamp(1, ds.block_size().min(MAX_DRAFT));
        self.mtp = None;
        self.dspark = Some(Box::new(DSparkDrafter {
            ds,
            k,
            auto: false,
            min_confidence: None,
            ctx: vec![],
            next: 0,
            verify: None,
        }));
        Ok(true)
    }

    /// Verify, of each drafted block, only the leading drafts whose predicted chance of all
    /// being accepted — the product of `sigmoid(c_j)` of the confidence head's logits, the
    /// estimate NeMo trains it for (docs/dspark.md, "Confidence") — is at least `p`; none
    /// when the first is below it (that step decodes without drafts). `None`: every draft
    /// (up to K). No effect without a DSpark drafter.
    pub fn set_dspark_confidence(&mut self, p: Option<f32>) {
        if let Some(d) = self.dspark.as_mut() {
            d.min_confidence = p;
        }
    }

    /// The DSpark drafter's block size (0 when none is attached).
    pub fn dspark_block_size(&self) -> usize {
        self.dspark.as_ref().map_or(0, |d| d.ds.block_size())
    }

    /// [`Model::forward_drafting`] with the DSpark drafter attached.
    pub(crate) fn dspark_forward(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let dr = self.dspark.as_ref().expect("checked by the caller");
        let mut cap = dr.capture();
        let start = cache.pos;
        let (logits, _) = self.forward_captured(tokens, cache, which, obs, Some(&mut cap))?;
        let dr = self.dspark.as_mut().expect("checked above");
        if start == 0 {
            dr.ctx.clear();
            dr.next = 0;
            dr.verify = None;
        }
        dr.push(&cap.rows, start, tokens.len())?;
        Ok(logits)
    }

    /// [`Model::draft`] with the DSpark drafter attached.
    pub(crate) fn dspark_draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> Result<Vec<(u32, Vec<f32>)>> {
        let dr = self.dspark.as_mut().expect("checked by the caller");
        let d = dr.ds.cfg.dim;
        let rows = dr.ctx.len() / d;
        let k = k.min(dr.k);
        if rows == 0 || k == 0 {
            return Ok(vec![]);
        }
        let block = dr.ds.draft_with(&dr.ctx, rows, dr.next - 1, last, pick)?;
        let v = dr.ds.cfg.vocab;
        let k = match dr.min_confidence {
            Some(p) => confident_prefix(&block.confidence[..k], p),
            None => k,
        };
        Ok((0..k)
            .map(|j| {
                (
                    block.tokens[j],
                    block.draft_logits[j * v..(j + 1) * v].to_vec(),
                )
            })
            .collect())
    }

    /// [`Model::forward_verify`] with the DSpark drafter attached.
    pub(crate) fn dspark_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let dr = self.dspark.as_ref().expect("checked by the caller");
        let mut cap = dr.capture();
        let before = cache.clone();
        let (logits, _) = self.forward_captured(tokens, cache, Logits::All, obs, Some(&mut cap))?;
        let dr = self.dspark.as_mut().expect("checked above");
        dr.verify = Some(DSparkVerify {
            before,
            tokens: tokens.to_vec(),
            rows: cap.rows,
        });
        Ok(logits)
    }

    /// [`Model::accept_drafts`] with the DSpark drafter attached.
    pub(crate) fn dspark_accept(&mut self, cache: &mut Cache, keep: usize) -> Result<()> {
        let Some(v) = self.dspark.as_mut().and_then(|d| d.verify.take()) else {
            return Ok(());
        };
        let n = v.tokens.len();
        if keep == 0 || keep > n {
            return Err(ModelError::Cache(format!(
                "keeping {keep} of {n} verified tokens"
            )));
        }
        let start = v.before.pos;
        if keep < n {
            *cache = v.before;
            self.forward(&v.tokens[..keep], cache, Logits::None, None)?;
        }
        let dr = self.dspark.as_mut().expect("checked above");
        dr.push(&v.rows, start, keep)
    }
}

/// How many leading drafts keep the product of their confidences' sigmoids at least `p`.
fn confident_prefix(confidence: &[f32], p: f32) -> usize {
    let mut all = 1f64;
    confidence
        .iter()
        .take_while(|&&c| {
            all /= 1.0 + (-(c as f64)).exp();
            all >= p as f64
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::confident_prefix;

    #[test]
    fn the_confident_prefix_stops_where_the_product_falls_below() {
        // sigmoid(0) = 0.5: products 0.5, 0.25, 0.125.
        assert_eq!(confident_prefix(&[0.0, 0.0, 0.0], 0.3), 1);
        assert_eq!(confident_prefix(&[0.0, 0.0, 0.0], 0.25), 2);
        assert_eq!(confident_prefix(&[0.0, 0.0, 0.0], 0.6), 0);
        assert_eq!(confident_prefix(&[20.0, 20.0, 0.0], 0.9), 2);
        assert_eq!(confident_prefix(&[20.0, 20.0, 20.0], 0.0), 3);
    }
}
