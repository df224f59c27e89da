//! A short probe of what speculative decoding computes, for the drafting cost model
//! ([`keep_residency::draft::ComputeCost`]): on the model with its weights in memory (mapped
//! whole), after a prompt of `context` tokens, it times a decode forward of one row, verify
//! forwards of 1..=K + 1 rows, replays of 1..=K rows, the cache snapshot, and the MTP module's
//! passes (one drafted row; 1..=K fed rows; its cache snapshot). Each is the median of `reps`
//! runs from a clone of the same cache, so every run does the same work.

use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_model::mtp::Mtp;
use keep_model::{Logits, Model, ModelError};
use keep_residency::draft::ComputeCost;

use crate::Result;

/// Median seconds of `reps` (≥ 1) runs of `f`.
fn median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut t = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Probe the checkpoint `ck` (which must have an MTP module) for `k` drafts per verify forward
/// after a prompt of `context` tokens, `reps` runs each, with `kernels`.
pub fn draft_compute(
    ck: &Checkpoint,
    kernels: keep_kernels::Kernels,
    k: usize,
    context: usize,
    reps: usize,
) -> Result<ComputeCost> {
    let mut model = Model::load(ck)?;
    model.cfg.kernels = kernels;
    let mtp = Mtp::load(ck, &model.cfg)?.ok_or_else(|| {
        ModelError::Config("the checkpoint has no MTP module (mtp.0.*) to probe".into())
    })?;
    let cfg = &model.cfg;
    let k = k.clamp(1, keep_model::mtp::MAX_DRAFT);
    // Room for the fed rows below: at least K + 2 prompt tokens.
    let context = context.max(k + 2);
    // A fixed token sequence (the probe measures time, not text).
    let tok = |i: usize| ((i * 7919 + 13) % cfg.vocab) as u32;
    let prompt: Vec<u32> = (0..context).map(tok).collect();
    let rows: Vec<u32> = (context..context + k + 1).map(tok).collect();
    let mut cache = model.new_cache();
    let (_, s) = model.forward_streams(&prompt, &mut cache, Logits::None, None)?;
    let mut mcache = mtp.new_cache();
    let fed = s.rows(0, context - 1);
    mtp.forward(&fed, &prompt[1..], &mut mcache, Logits::None)?;
    let last = s.rows(context - 1, context);

    let plain_s = median(reps, || {
        let mut c = cache.clone();
        model.forward(&rows[..1], &mut c, Logits::Last, None)?;
        Ok(())
    })?;
    let mut verify_s = vec![];
    for n in 1..=k + 1 {
        verify_s.push(median(reps, || {
            let mut c = cache.clone();
            model.forward_streams(&rows[..n], &mut c, Logits::All, None)?;
            Ok(())
        })?);
    }
    let mut replay_s = vec![];
    for n in 1..=k {
        replay_s.push(median(reps, || {
            let mut c = cache.clone();
            model.forward(&rows[..n], &mut c, Logits::None, None)?;
            Ok(())
        })?);
    }
    let snapshot_s = median(reps, || {
        std::hint::black_box(cache.clone());
        Ok(())
    })?;
    let mtp_draft_s = median(reps, || {
        let mut c = mcache.clone();
        mtp.forward(&last, &rows[..1], &mut c, Logits::Last)?;
        Ok(())
    })?;
    // Fed rows: the prompt's last rows stand in for the kept rows' streams (same shapes).
    let mut mtp_feed_s = vec![];
    for n in 1..=k {
        let h = s.rows(context - 1 - n, context - 1);
        let next = &prompt[context - n..];
        mtp_feed_s.push(median(reps, || {
            let mut c = mcache.clone();
            mtp.forward(&h, next, &mut c, Logits::None)?;
            Ok(())
        })?);
    }
    let mtp_snapshot_s = median(reps, || {
        std::hint::black_box(mcache.clone());
        Ok(())
    })?;
    Ok(ComputeCost {
        plain_s,
        verify_s,
        replay_s,
        snapshot_s,
        mtp_draft_s,
        mtp_feed_s,
        mtp_snapshot_s,
    })
}
