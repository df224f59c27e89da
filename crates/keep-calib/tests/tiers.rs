//! `keep eval --alloc` / `--tiers` on a tiny synthetic model: an allocation of E8P2 everywhere
//! scores exactly as the E8P2 checkpoint does; the tier simulation with τ above every gate (or
//! no cache) scores exactly as the allocation, with every slot at the base rung; with τ = 0, a
//! cache holding every residual and an admission delay of one token, every slot after its stage's first
//! miss is served at the upper rung; a longer admission delay never gives more hits.

use std::collections::BTreeMap;
use std::path::Path;

use keep_artifacts::alloc::{Alloc, LayerAlloc, RungBytes};
use keep_calib::calibrate::{calibrate, CalibrateOptions};
use keep_calib::eval::eval;
use keep_calib::finalize::finalize;
use keep_calib::pack::{from_token_sources, write_pack, Pack, PackOptions, Split};
use keep_calib::tiers::{eval_tiers, TierOptions};
use keep_model::Kernels;
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;

fn pack(dir: &Path) -> Pack {
    use keep_rng::Draw;
    let sources: Vec<(String, Vec<u32>)> = (0..6)
        .map(|i| {
            let mut r = keep_rng::rng(900 + i);
            let n = 30 + 13 * i as usize;
            (
                format!("doc{i}.txt"),
                (0..n).map(|_| r.below(512) as u32).collect(),
            )
        })
        .collect();
    let opts = PackOptions {
        max_tokens: 32,
        held_out_frac: 0.34,
        seed: 9,
    };
    let (m, r) = from_token_sources(&sources, "0".repeat(64), 512, &opts).unwrap();
    let p = dir.join("pack");
    write_pack(&p, &m, &r, false).unwrap();
    Pack::open(&p).unwrap()
}

#[test]
fn allocation_and_tier_simulation_score_as_their_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    let (cfg, storage) = keep_convert::presets::preset("tiny").unwrap();
    let so = keep_convert::synth::SynthOptions {
        seed: 7,
        storage,
        force: false,
        max_shard_bytes: 4 << 30,
    };
    keep_convert::synth::synth(&cfg, &model, &so, &|_, _| {}).unwrap();
    let pack = pack(dir.path());
    let calib = dir.path().join("calib");
    let teacher = dir.path().join("teacher");
    for (split, out) in [(Split::Calibration, &calib), (Split::Eval, &teacher)] {
        let o = CalibrateOptions {
            split,
            chunk_tokens: 48,
            ..Default::default()
        };
        calibrate(&model, &pack, out, &o, &mut |_| {}).unwrap();
    }
    finalize(&calib).unwrap();
    let mut qs = vec![];
    for format in [QuantFormat::E8p2, QuantFormat::E8p2E81] {
        let out = dir.path().join(format.label());
        let qo = QuantOptions {
            format,
            experts: ExpertSelection::All,
            shard: (0, 1),
            force: false,
            mlx_bits: None,
        };
        quantize(&model, &calib, &out, &qo, &|_, _| {}).unwrap();
        qs.push(out);
    }
    let kl_of = |m: &Path| {
        eval(
            m,
            &teacher,
            &pack,
            &[],
            4096,
            Kernels::Exact,
            &mut |_, _| {},
        )
        .unwrap()
        .students[0]
            .mean_kl
    };
    let (kl2, kl3) = (kl_of(&qs[0]), kl_of(&qs[1]));
    assert!(kl2 > kl3 && kl3 > 0.0, "{kl2} {kl3}");

    let ck = keep_checkpoint::Checkpoint::open(&model).unwrap();
    let c = ck.require_config().unwrap();
    let ne = c.n_routed_experts;
    let per = 1000u64;
    let alloc = Alloc {
        format: Alloc::FORMAT.into(),
        version: Alloc::VERSION,
        model: model.display().to_string(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(&model).unwrap(),
        budget_bytes: per * (ne * c.num_hidden_layers) as u64,
        bytes: per * (ne * c.num_hidden_layers) as u64,
        rungs: vec![RungBytes {
            label: "e8p2".into(),
            bytes_per_expert: per,
        }],
        solver: "test".into(),
        grain_bytes: 1,
        predicted_loss: 0.0,
        saliency: "reap".into(),
        layers: (0..c.num_hidden_layers)
            .map(|l| LayerAlloc {
                layer: l,
                rungs: vec!["e8p2".into(); ne],
            })
            .collect(),
        extra: BTreeMap::new(),
    };
    let ap = dir.path().join("alloc.json");
    alloc.write(&ap, false).unwrap();
    let run = |taus: Vec<f64>, cache: u64, delay: u64| {
        let o = TierOptions {
            taus,
            cache_bytes: cache,
            admit_delay: delay,
            ..TierOptions::default()
        };
        // only the E8P2+E81 checkpoint: the e8p2 rung is its base
        eval_tiers(&model, &ap, &qs[1..], &teacher, &pack, &o, &mut |_, _| {}).unwrap()
    };
    let r = run(vec![f64::INFINITY, 0.0], 1 << 40, 1);
    assert_eq!(
        r.students[0].mean_kl, kl2,
        "the allocation scores as the E8P2 checkpoint"
    );
    let never = r.students[1].mix.clone().unwrap();
    assert_eq!(never.slots_upper, 0);
    assert_eq!(
        r.students[1].mean_kl, kl2,
        "τ above every gate: the base model, exactly"
    );
    let all = r.students[2].mix.clone().unwrap();
    assert!(all.slots_upper > 0 && all.evictions == 0);
    // each stage misses once (its admission), then always hits
    assert_eq!(all.misses, all.admissions);
    assert!(r.students[2].mean_kl < kl2);

    let r0 = run(vec![0.0], 0, 1);
    let m = r0.students[1].mix.clone().unwrap();
    assert_eq!(
        (m.slots_upper, m.admissions),
        (0, 0),
        "no cache, no upper slots"
    );
    assert_eq!(r0.students[1].mean_kl, kl2);

    let late = run(vec![0.0], 1 << 40, 5).students[1].mix.clone().unwrap();
    // (Admissions may differ by a few: the rungs served change the hidden states, and so the
    // routes of later layers and tokens.)
    assert!(late.hits < all.hits, "{late:?} {all:?}");
}
