//! Pruning a DeepSeek-V4-Flash model's hash-routed layers end to end on the synthetic
//! `tiny-v4flash` (two hash-routed layers of 16 experts, top-4): calibration counts each hash
//! layer's routes from `tid2eid` and gathers expert-to-expert output distances, `select` builds
//! a remap per policy, `prune` rewrites `tid2eid`, and the pruned checkpoint's logits equal —
//! bit for bit — the unpruned model run with the plan's router mask and remapped tables (the
//! student `keep eval` scores).

use std::path::Path;

use keep_artifacts::hashremap::RemapPolicy;
use keep_calib::calibrate::{calibrate, CalibrateOptions};
use keep_calib::eval::remapped_tables;
use keep_calib::finalize::{finalize, read_reap_stats};
use keep_calib::pack::{from_token_sources, write_pack, Pack, PackOptions, Split};
use keep_calib::select::{select, to_plan, Keep, Saliency, SelectOptions};
use keep_checkpoint::Checkpoint;
use keep_convert::prune::{prune, PruneOptions};
use keep_convert::ConvertError;
use keep_model::hash::HashTable;
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{Logits, Model, ModelConfig};

/// An expert's output against itself, computed once over its routed rows and once over every
/// row: the same products in another batch shape, so a few ulps of f32 at most (relative to
/// the summed ‖f‖², well above anything a real distance between two random experts reaches).
const SELF_DIST_REL: f64 = 1e-6;

fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut r = keep_rng::lcg(seed.wrapping_mul(keep_rng::Lcg64::A) | 1);
    (0..n)
        .map(|_| ((keep_rng::RngCore::next_u64(&mut r) >> 33) as u32) % vocab)
        .collect()
}

fn make_pack(dir: &Path) -> Pack {
    let sources: Vec<(String, Vec<u32>)> = (0..4)
        .map(|i| {
            (
                format!("doc{i}.txt"),
                tokens(50 + i, 40 + 9 * i as usize, 512),
            )
        })
        .collect();
    let opts = PackOptions {
        max_tokens: 32,
        held_out_frac: 0.0,
        seed: 1,
    };
    let (m, r) = from_token_sources(&sources, "0".repeat(64), 512, &opts).unwrap();
    let p = dir.join("pack");
    write_pack(&p, &m, &r, false).unwrap();
    Pack::open(&p).unwrap()
}

#[test]
fn hash_layers_calibrate_select_prune_and_match_the_student() {
    let d = tempfile::tempdir().unwrap();
    let (cfg, storage) = keep_convert::presets::preset("tiny-v4flash").unwrap();
    let model = d.path().join("v4flash");
    let so = keep_convert::synth::SynthOptions {
        seed: 5,
        storage,
        force: false,
        max_shard_bytes: 1 << 30,
    };
    keep_convert::synth::synth(&cfg, &model, &so, &|_, _| {}).unwrap();
    let pack = make_pack(d.path());
    let run = d.path().join("run");
    let co = CalibrateOptions {
        split: Split::Calibration,
        chunk_tokens: 64,
        ..Default::default()
    };
    calibrate(&model, &pack, &run, &co, &mut |_| {}).unwrap();
    finalize(&run).unwrap();
    let stats = read_reap_stats(&run).unwrap();
    assert_eq!(stats.hash_layers, vec![0, 1]);

    let ck = Checkpoint::open(&model).unwrap();
    let mcfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let (ne, k) = (mcfg.n_experts, mcfg.top_k);
    // Hash layers' REAP counts are the table's routes of the calibration tokens.
    let calib_tokens: Vec<u32> = pack
        .groups(Split::Calibration)
        .iter()
        .flat_map(|g| pack.records_of(&g.id).flat_map(|r| r.tokens.clone()))
        .collect();
    for &l in &stats.hash_layers {
        let t = HashTable::load(&ck, &mcfg, l).unwrap();
        let mut want = vec![0u64; ne];
        for &tok in &calib_tokens {
            for &e in t.experts(tok).unwrap() {
                want[e as usize] += 1;
            }
        }
        let r = &stats.layers[l];
        assert_eq!(r.count, want, "layer {l}: REAP counts follow tid2eid");
        assert_eq!(r.dist.len(), ne * ne, "layer {l}: distances gathered");
        for e in (0..ne).filter(|&e| r.count[e] > 0) {
            let dist = r.mean_dist(e).unwrap();
            let others = (0..ne).filter(|&j| j != e).map(|j| dist[j]);
            let nearest_other = others.fold(f64::INFINITY, f64::min);
            assert!(dist.iter().all(|v| v.is_finite() && *v >= 0.0));
            assert!(
                dist[e] <= SELF_DIST_REL * nearest_other,
                "layer {l} expert {e}: self-distance {} vs nearest other {nearest_other}",
                dist[e]
            );
        }
    }
    // Top-k layers gather no distances.
    assert!(stats.layers[2].dist.is_empty());

    let toks = tokens(99, 48, 512);
    let mut tables_seen = vec![];
    for policy in RemapPolicy::ALL {
        let o = SelectOptions {
            keep: Keep::Count(8),
            saliency: Saliency::Reap,
            shrink: None,
            protect_super_experts: false,
            hash_remap: Some(policy),
            groups: 1,
        };
        let sel = select(&stats, &o).unwrap();
        let plan = to_plan(&sel, &stats, &o);
        plan.validate().unwrap();
        for &l in &stats.hash_layers {
            let r = plan.hash_remap(l).expect("hash layers carry a remap");
            assert_eq!(r.policy, policy.name());
            assert_eq!(r.candidates.len(), ne - 8);
        }
        let back: keep_artifacts::plan::PrunePlan =
            serde_json::from_str(&serde_json::to_string(&plan).unwrap()).unwrap();
        assert_eq!(back.layers, plan.layers);

        let out = d.path().join(format!("pruned-{}", policy.name()));
        let (_, rep) = prune(&model, &plan, &out, &PruneOptions::default(), &|_, _| {}).unwrap();
        assert_eq!(rep.tensors_rewritten, 2);
        let pck = Checkpoint::open(&out).unwrap();
        let pcfg = ModelConfig::from_checkpoint(&pck).unwrap();
        assert_eq!(pcfg.n_experts, 8);
        // The rewritten tables: in range (HashTable::load checks), no expert twice per token,
        // and equal to the remapped table renumbered.
        let remapped = remapped_tables(&ck, &mcfg, &plan).unwrap();
        for &l in &stats.hash_layers {
            let pt = HashTable::load(&pck, &pcfg, l).unwrap();
            let surv = plan.survivors(l).unwrap();
            let orig = remapped[l].as_ref().unwrap();
            for (row, orow) in pt.ids.chunks(k).zip(orig.ids.chunks(k)) {
                let mut s = row.to_vec();
                s.sort();
                s.dedup();
                assert_eq!(s.len(), k, "a token names one expert twice: {row:?}");
                let back: Vec<u32> = row.iter().map(|&j| surv[j as usize] as u32).collect();
                assert_eq!(back, orow);
            }
            tables_seen.push((policy, l, pt.ids.clone()));
        }

        // The pruned checkpoint against the masked, remapped student.
        let pruned = Model::load(&pck).unwrap();
        let mut cache = pruned.new_cache();
        let got = pruned
            .forward(&toks, &mut cache, Logits::All, None)
            .unwrap();
        let mut student = Model::load(&ck).unwrap();
        for (l, table) in remapped.iter().enumerate().take(mcfg.n_layers) {
            student.set_router_mask(l, plan.pruned_mask(l)).unwrap();
            if let Some(t) = table {
                student.set_hash_table(l, t.clone()).unwrap();
            }
        }
        let mut cache = student.new_cache();
        let want = student
            .forward(&toks, &mut cache, Logits::All, None)
            .unwrap();
        assert!(
            want.iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: pruned checkpoint and remapped student differ",
            policy.name()
        );
        // The streamed student (what keep eval runs) is the same function.
        let so = StreamOptions {
            logits: Logits::All,
            masks: (0..mcfg.n_layers).map(|l| plan.pruned_mask(l)).collect(),
            hash_tables: remapped.clone(),
            release_pages: false,
            ..Default::default()
        };
        let streamed = forward_streamed(&ck, std::slice::from_ref(&toks), so, None).unwrap();
        assert!(streamed[0]
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    // The three policies do not all write the same tables (the test can fail).
    let layer0: Vec<&Vec<u32>> = tables_seen
        .iter()
        .filter(|(_, l, _)| *l == 0)
        .map(|(_, _, t)| t)
        .collect();
    assert!(layer0.windows(2).any(|w| w[0] != w[1]));

    // A plan that prunes hash layers without a remap is refused by prune and by the student.
    let o = SelectOptions {
        keep: Keep::Count(8),
        saliency: Saliency::Reap,
        shrink: None,
        protect_super_experts: false,
        hash_remap: Some(RemapPolicy::ReapNext),
        groups: 1,
    };
    let sel = select(&stats, &o).unwrap();
    let mut plan = to_plan(&sel, &stats, &o);
    for l in &mut plan.layers {
        l.hash_remap = None;
    }
    let e = prune(
        &model,
        &plan,
        &d.path().join("refused"),
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap_err();
    assert!(matches!(e, ConvertError::Refused { .. }), "{e}");
    assert!(remapped_tables(&ck, &mcfg, &plan).is_err());
    // Left whole (no policy): the hash layers carry no survivors and prune accepts the plan.
    let o = SelectOptions {
        hash_remap: None,
        groups: 1,
        ..o
    };
    let plan = to_plan(&select(&stats, &o).unwrap(), &stats, &o);
    assert!(plan.survivors(0).is_none() && plan.layers[0].hash_routed);
    prune(
        &model,
        &plan,
        &d.path().join("whole"),
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap();
}
