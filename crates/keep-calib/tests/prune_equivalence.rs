//! Pruning's exactness test: a checkpoint pruned by byte copy gives the same logits as the full
//! model with the plan applied as a router mask (same experts, same renormalised weights), on a
//! `keep synth` model, on the bundled model, and on a V4-Flash whose hash-routed layers the plan
//! leaves whole (the pruned checkpoint's layers then hold different counts); and the streamed
//! student (what `keep eval` runs) equals the whole-model masked forward.

use std::path::Path;

use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_checkpoint::Checkpoint;
use keep_convert::presets::preset;
use keep_convert::prune::{prune, PruneOptions};
use keep_convert::synth::{synth, SynthOptions};
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{Logits, Model};

/// A plan keeping `keep` scattered experts of every layer but the first `whole` (left whole).
fn plan_for(n: usize, layers: usize, keep: usize, whole: usize) -> PrunePlan {
    PrunePlan {
        format: PrunePlan::FORMAT.into(),
        version: 1,
        n_experts: n,
        keep,
        saliency: "test".into(),
        layers: (0..layers)
            .map(|l| LayerPlan {
                layer: l,
                // A different, scattered survivor set in every layer.
                survivors: (l >= whole).then(|| {
                    let mut v: Vec<usize> = (0..n).filter(|e| (e * 7 + l * 3) % n < keep).collect();
                    v.sort();
                    v
                }),
                hash_routed: false,
                hash_remap: None,
            })
            .collect(),
        mtp_layers: vec![],
        extra: Default::default(),
    }
}

fn check(full: &Path, tokens: &[u32], keep: usize, whole: usize, scratch: &Path) {
    let ck = Checkpoint::open(full).unwrap();
    let cfg = ck.config().unwrap().clone();
    let plan = plan_for(cfg.n_routed_experts, cfg.num_hidden_layers, keep, whole);
    plan.validate().unwrap();
    for l in &plan.layers[whole..] {
        assert_eq!(l.survivors.as_ref().unwrap().len(), keep);
    }
    let out = scratch.join("pruned");
    let mut plan = plan;
    plan.bind_to(full).unwrap();
    prune(full, &plan, &out, &PruneOptions::default(), &|_, _| {}).unwrap();

    let mut masked = Model::load(&ck).unwrap();
    for l in 0..cfg.num_hidden_layers {
        masked.set_router_mask(l, plan.pruned_mask(l)).unwrap();
    }
    let mut cache = masked.new_cache();
    let want = masked
        .forward(tokens, &mut cache, Logits::All, None)
        .unwrap();

    let pck = Checkpoint::open(&out).unwrap();
    let pcfg = pck.config().unwrap();
    for l in 0..cfg.num_hidden_layers {
        let want = if l < whole {
            cfg.n_routed_experts
        } else {
            keep
        };
        assert_eq!(pcfg.experts_in_layer(l), want, "layer {l}");
    }
    let pruned = Model::load(&pck).unwrap();
    let mut cache = pruned.new_cache();
    let got = pruned
        .forward(tokens, &mut cache, Logits::All, None)
        .unwrap();
    assert_eq!(want.len(), got.len());
    let same = want
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "pruned checkpoint and router-masked model differ");

    // The streamed student keep eval runs is the same function.
    let so = StreamOptions {
        logits: Logits::All,
        masks: (0..cfg.num_hidden_layers)
            .map(|l| plan.pruned_mask(l))
            .collect(),
        on_layer: None,
        release_pages: false,
        ..Default::default()
    };
    let streamed = forward_streamed(&ck, &[tokens.to_vec()], so, None).unwrap();
    assert!(streamed[0]
        .iter()
        .zip(&want)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // And masking really changes the output (the test can fail).
    let full_model = Model::load(&ck).unwrap();
    let mut cache = full_model.new_cache();
    let unmasked = full_model
        .forward(tokens, &mut cache, Logits::All, None)
        .unwrap();
    assert!(unmasked.iter().zip(&want).any(|(a, b)| a != b));
}

#[test]
fn pruned_equals_masked_on_a_synth_model() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, st) = preset("tiny").unwrap();
    let src = d.path().join("tiny");
    let o = SynthOptions {
        seed: 9,
        storage: st,
        force: false,
        max_shard_bytes: 1 << 30,
    };
    synth(&cfg, &src, &o, &|_, _| {}).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
    check(&src, &tokens, 6, 0, d.path());
}

#[test]
fn pruned_equals_masked_with_whole_hash_layers() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, st) = preset("tiny-v4flash").unwrap();
    assert_eq!(cfg.num_hash_layers, 2);
    let src = d.path().join("v4f");
    let o = SynthOptions {
        seed: 4,
        storage: st,
        force: false,
        max_shard_bytes: 1 << 30,
    };
    synth(&cfg, &src, &o, &|_, _| {}).unwrap();
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 512).collect();
    check(&src, &tokens, 6, 2, d.path());
}

#[test]
fn pruned_equals_masked_on_the_bundled_model() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
    let d = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..72).map(|i| (i * 131 + 7) % 4096).collect();
    check(&model, &tokens, 16, 0, d.path());
}
