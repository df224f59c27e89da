//! A short probe of what speculative decoding computes, for the drafting cost model
//! ([`keep_residency::draft::ComputeCost`]): on the model with its weights in memory (mapped
//! whole), after a prompt of `context` tokens, it times a decode forward of one row, verify
//! forwards of 1..=K + 1 rows, replays of 1..=K rows, the cache snapshot, and the drafter's
//! passes — the MTP module's (one drafted row; 1..=K fed rows; its cache snapshot) or DSpark's
//! (one block drafted over the window's projected context rows; the projection of 1..=K + 1
//! kept rows' target features). Each is the median of `reps` runs from a clone of the same
//! cache, so every run does the same work.

use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_model::dspark::DSpark;
use keep_model::mtp::Mtp;
use keep_model::{Logits, Model, ModelError};
use keep_residency::draft::{ComputeCost, Drafter};

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

/// Probe the checkpoint `ck` (which must carry `drafter`: an MTP module, or a DSpark drafter)
/// for `k` drafts per verify forward (DSpark: at most its block) after a prompt of `context`
/// tokens, `reps` runs each, with `kernels`.
pub fn draft_compute(
    ck: &Checkpoint,
    kernels: keep_kernels::Kernels,
    drafter: Drafter,
    k: usize,
    context: usize,
    reps: usize,
) -> Result<ComputeCost> {
    let model = Model::load_opts(ck, keep_model::RunOptions::with_kernels(kernels))?;
    let mtp = match drafter {
        Drafter::Mtp => Some(
            Mtp::load(ck, &model.cfg)?
                .ok_or_else(|| {
                    ModelError::Config("the checkpoint has no MTP module (mtp.0.*) to probe".into())
                })?
                .with_kernels(kernels),
        ),
        Drafter::DSpark => None,
    };
    let dspark = match drafter {
        Drafter::DSpark if keep_model::dspark::present(ck) => {
            DSpark::load(ck, &model.cfg)?.map(|d| d.with_kernels(kernels))
        }
        _ => None,
    };
    if drafter == Drafter::DSpark && dspark.is_none() {
        return Err(ModelError::Config(
            "the checkpoint has no DSpark drafter (dspark_* config keys and \
             mtp.0.main_proj.weight) to probe"
                .into(),
        )
        .into());
    }
    let most = dspark.as_ref().map_or(keep_model::mtp::MAX_DRAFT, |d| {
        d.block_size().min(keep_model::mtp::MAX_DRAFT)
    });
    let cfg = &model.cfg;
    let k = k.clamp(1, most);
    // Room for the fed rows below: at least K + 2 prompt tokens.
    let context = context.max(k + 2);
    // A fixed token sequence (the probe measures time, not text).
    let tok = |i: usize| ((i * 7919 + 13) % cfg.vocab) as u32;
    let prompt: Vec<u32> = (0..context).map(tok).collect();
    let rows: Vec<u32> = (context..context + k + 1).map(tok).collect();
    let mut cache = model.new_cache();
    let (_, s) = model.forward_streams(&prompt, &mut cache, Logits::None, None)?;

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
    let mut cost = ComputeCost {
        plain_s,
        verify_s,
        replay_s,
        snapshot_s,
        ..ComputeCost::default()
    };
    if let Some(mtp) = &mtp {
        let mut mcache = mtp.new_cache();
        let fed = s.rows(0, context - 1);
        mtp.forward(&fed, &prompt[1..], &mut mcache, Logits::None)?;
        let last = s.rows(context - 1, context);
        cost.mtp_draft_s = median(reps, || {
            let mut c = mcache.clone();
            mtp.forward(&last, &rows[..1], &mut c, Logits::Last)?;
            Ok(())
        })?;
        // Fed rows: the prompt's last rows stand in for the kept rows' streams (same shapes).
        for n in 1..=k {
            let h = s.rows(context - 1 - n, context - 1);
            let next = &prompt[context - n..];
            cost.mtp_feed_s.push(median(reps, || {
                let mut c = mcache.clone();
                mtp.forward(&h, next, &mut c, Logits::None)?;
                Ok(())
            })?);
        }
        cost.mtp_snapshot_s = median(reps, || {
            std::hint::black_box(mcache.clone());
            Ok(())
        })?;
    }
    if let Some(ds) = &dspark {
        // Target features stand in for the captured ones (same shapes; the probe measures
        // time): the window's rows projected once, then a block drafted after the prompt.
        let d = ds.cfg.dim;
        let width = d * ds.keys.target_layer_ids.len();
        let c = context.min(ds.cfg.window.max(1)).max(k + 1);
        let features: Vec<f32> = (0..c * width)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) * 0.05)
            .collect();
        let ctx = ds.project(&features, c)?;
        let c = ctx.len() / d;
        cost.dspark_draft_s = median(reps, || {
            std::hint::black_box(ds.draft(&ctx, c, context - 1, rows[0])?);
            Ok(())
        })?;
        for n in 1..=k + 1 {
            cost.dspark_project_s.push(median(reps, || {
                std::hint::black_box(ds.project(&features[..n * width], n)?);
                Ok(())
            })?);
        }
    }
    Ok(cost)
}
