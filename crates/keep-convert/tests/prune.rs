//! `keep prune` by byte copy: survivors renumbered with identical bytes, router rows sliced,
//! config updated, hash-routed layers refused unless left whole or remapped (their `tid2eid`
//! then rewritten: removed ids replaced, all ids renumbered, everything else byte-identical).

use std::path::Path;

use keep_artifacts::hashremap::{HashRemap, RemapPolicy};
use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_checkpoint::naming::{expert_tensor, ExpertMat};
use keep_checkpoint::Checkpoint;
use keep_convert::inspect::inspect;
use keep_convert::presets::preset;
use keep_convert::prune::{prune, PruneOptions};
use keep_convert::synth::{synth, SynthOptions};

fn make(dir: &Path, name: &str) -> std::path::PathBuf {
    let (mut cfg, st) = preset(name).unwrap();
    // Pruning does not cover the MTP module's experts yet (`mtp.N.ffn.experts`): these
    // checkpoints are written without one.
    cfg.num_nextn_predict_layers = 0;
    cfg.raw["num_nextn_predict_layers"] = 0.into();
    let out = dir.join(name);
    let o = SynthOptions {
        seed: 5,
        storage: st,
        force: false,
        max_shard_bytes: 64 << 10,
    };
    synth(&cfg, &out, &o, &|_, _| {}).unwrap()
}

/// A plan for the model in `src` (its fingerprint recorded).
fn plan(src: &Path, n: usize, layers: &[(usize, Option<Vec<usize>>)]) -> PrunePlan {
    let mut p = PrunePlan {
        format: PrunePlan::FORMAT.into(),
        version: 1,
        n_experts: n,
        keep: layers
            .iter()
            .find_map(|(_, s)| s.as_ref().map(Vec::len))
            .unwrap_or(n),
        saliency: "test".into(),
        layers: layers
            .iter()
            .map(|(l, s)| LayerPlan {
                layer: *l,
                survivors: s.clone(),
                hash_routed: false,
                hash_remap: None,
            })
            .collect(),
        mtp_layers: vec![],
        extra: Default::default(),
    };
    p.bind_to(src).unwrap();
    p
}

#[test]
fn prune_copies_survivor_bytes_and_slices_the_router() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny");
    // Different survivors per layer, 6 of 16 each.
    let layers: Vec<_> = (0..8)
        .map(|l| {
            (
                l,
                Some(
                    (0..16)
                        .filter(|e| (e + l) % 3 != 0)
                        .take(6)
                        .collect::<Vec<_>>(),
                ),
            )
        })
        .collect();
    let p = plan(&src, 16, &layers);
    let out = d.path().join("pruned");
    let opts = PruneOptions::default();
    let (_, rep) = prune(&src, &p, &out, &opts, &|_, _| {}).unwrap();
    assert_eq!(rep.n_experts_after, 6);
    let s = Checkpoint::open(&src).unwrap();
    let o = Checkpoint::open(&out).unwrap();
    assert_eq!(o.config().unwrap().n_routed_experts, 6);
    for (l, surv) in &layers {
        let surv = surv.as_ref().unwrap();
        for (new, &old) in surv.iter().enumerate() {
            for mat in ExpertMat::ALL {
                for part in ["weight", "scale"] {
                    assert_eq!(
                        o.tensor(&expert_tensor(*l, new, mat, part)).unwrap().bytes,
                        s.tensor(&expert_tensor(*l, old, mat, part)).unwrap().bytes
                    );
                }
            }
        }
        assert!(!o.contains(&expert_tensor(*l, 6, ExpertMat::W1, "weight")));
        for (name, width) in [
            ("gate.weight", 128 * 2),
            ("gate.bias", 4),
            ("gate.bias_vl", 4),
        ] {
            let sv = s.tensor(&format!("layers.{l}.ffn.{name}")).unwrap();
            let ov = o.tensor(&format!("layers.{l}.ffn.{name}")).unwrap();
            assert_eq!(ov.shape[0], 6);
            for (new, &old) in surv.iter().enumerate() {
                assert_eq!(
                    &ov.bytes[new * width..(new + 1) * width],
                    &sv.bytes[old * width..(old + 1) * width]
                );
            }
        }
    }
    assert_eq!(rep.id_map["3"][&surv_of(&layers, 3)[2]], 2);
    let r = inspect(&o);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(keep_checkpoint::sums::verify_dir(&out).unwrap().passed());
    // Source shards holding no expert or router tensor are linked into the output whole.
    assert!(
        rep.reused.linked_shards > 0 && rep.reused.copied_shards == 0,
        "{:?}",
        rep.reused
    );
    for t in s
        .tensors()
        .filter(|t| !t.name.contains(".ffn.experts.") && !t.name.contains(".ffn.gate."))
    {
        assert_eq!(o.tensor(t.name).unwrap().bytes, t.bytes, "{}", t.name);
    }
    // A rerun is refused without --force.
    assert!(prune(&src, &p, &out, &opts, &|_, _| {}).is_err());
}

fn surv_of(layers: &[(usize, Option<Vec<usize>>)], l: usize) -> Vec<usize> {
    layers[l].1.clone().unwrap()
}

#[test]
fn hash_layers_are_refused_unless_left_whole_or_remapped() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny-v4flash");
    let keep: Vec<usize> = (0..8).collect();
    // tiny-v4flash has six layers, the first two hash-routed.
    let all: Vec<_> = (0..6).map(|l| (l, Some(keep.clone()))).collect();
    let e = prune(
        &src,
        &plan(&src, 16, &all),
        &d.path().join("x"),
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("layers 0, 1") && e.contains("hash-routed"),
        "{e}"
    );
    assert!(!d.path().join("x").exists());
    // Leaving layers 0 and 1 whole works, with per-layer counts in config.json.
    let some: Vec<_> = (0..6)
        .map(|l| (l, if l < 2 { None } else { Some(keep.clone()) }))
        .collect();
    let out = d.path().join("y");
    prune(
        &src,
        &plan(&src, 16, &some),
        &out,
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap();
    let o = Checkpoint::open(&out).unwrap();
    let c = o.config().unwrap();
    assert_eq!(c.experts_in_layer(0), 16);
    assert_eq!(c.experts_in_layer(5), 8);
    // Each layer is checked against its own count: inspect (and so the model's loader) finds
    // nothing wrong with a checkpoint whose hash layers were left whole.
    let r = inspect(&o);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.refused.is_empty(), "{:?}", r.refused);
    // Pruned again, a plan may prune only layers of its count (8 here): pruning a whole hash
    // layer of 16 as a layer of 8 is refused; the 8-expert layers prune, the hash layers keep 16.
    let again: Vec<_> = (0..6).map(|l| (l, Some((0..4).collect()))).collect();
    let e = prune(
        &out,
        &plan(&out, 8, &again),
        &d.path().join("y2"),
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("layer 0 as a layer of 8 experts"), "{e}");
    let again: Vec<_> = (0..6)
        .map(|l| (l, (l >= 2).then(|| (0..4).collect())))
        .collect();
    prune(
        &out,
        &plan(&out, 8, &again),
        &d.path().join("y3"),
        &PruneOptions::default(),
        &|_, _| {},
    )
    .unwrap();
    let y3 = Checkpoint::open(&d.path().join("y3")).unwrap();
    let c3 = y3.config().unwrap();
    assert_eq!(c3.experts_in_layer(0), 16);
    assert_eq!(c3.experts_in_layer(5), 4);
    assert!(inspect(&y3).refused.is_empty());

    // With a remap on layers 0 and 1 (survivors 4..12; every removed expert prefers 11, 10,
    // …, 4), the tables are rewritten; computed here by hand from the source table.
    let surv: Vec<usize> = (4..12).collect();
    let pref: Vec<usize> = surv.iter().rev().copied().collect();
    let all: Vec<_> = (0..6).map(|l| (l, Some(surv.clone()))).collect();
    let mut p = plan(&src, 16, &all);
    for l in &mut p.layers[..2] {
        l.hash_routed = true;
        l.hash_remap = Some(HashRemap::uniform(
            RemapPolicy::ReapNext,
            "test",
            16,
            &surv,
            &pref,
        ));
    }
    let out = d.path().join("z");
    let (_, rep) = prune(&src, &p, &out, &PruneOptions::default(), &|_, _| {}).unwrap();
    assert_eq!(rep.tensors_rewritten, 2);
    let s = Checkpoint::open(&src).unwrap();
    let o = Checkpoint::open(&out).unwrap();
    let ids = |ck: &Checkpoint, name: &str| -> Vec<i64> {
        let t = ck.tensor(name).unwrap();
        let w = t.dtype.bits() / 8;
        t.bytes
            .chunks_exact(w)
            .map(|c| {
                if w == 4 {
                    i32::from_le_bytes(c.try_into().unwrap()) as i64
                } else {
                    i64::from_le_bytes(c.try_into().unwrap())
                }
            })
            .collect()
    };
    for l in 0..2 {
        let name = format!("layers.{l}.ffn.gate.tid2eid");
        let (a, b) = (ids(&s, &name), ids(&o, &name));
        assert_eq!(
            s.tensor(&name).unwrap().shape,
            o.tensor(&name).unwrap().shape
        );
        let mut changed = 0;
        for (ra, rb) in a.chunks(4).zip(b.chunks(4)) {
            let mut want: Vec<i64> = ra.to_vec();
            for i in 0..4 {
                if !(4..12).contains(&want[i]) {
                    let pick = pref.iter().map(|&e| e as i64).find(|e| !want.contains(e));
                    want[i] = pick.unwrap();
                    changed += 1;
                }
            }
            let want: Vec<i64> = want.iter().map(|&e| e - 4).collect();
            assert_eq!(rb, &want[..], "row {ra:?}");
        }
        assert!(changed > 0);
    }
    // Everything else of the hash layers is copied or sliced as for any layer.
    let g = "layers.0.ffn.gate.weight";
    let row = s.tensor(g).unwrap().bytes.len() / 16;
    assert_eq!(
        o.tensor(g).unwrap().bytes,
        &s.tensor(g).unwrap().bytes[4 * row..12 * row]
    );
    assert!(
        inspect(&o).problems.is_empty(),
        "{:?}",
        inspect(&o).problems
    );
}

#[test]
fn bad_plans_are_errors() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny");
    let o = PruneOptions::default();
    // Wrong expert count for the model.
    assert!(prune(
        &src,
        &plan(&src, 32, &[(0, Some(vec![1, 2, 3, 4]))]),
        &d.path().join("a"),
        &o,
        &|_, _| {}
    )
    .is_err());
    // Uneven counts across routed layers.
    let e = prune(
        &src,
        &plan(&src, 16, &[(0, Some(vec![1, 2, 3, 4]))]),
        &d.path().join("b"),
        &o,
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("same number"), "{e}");
    // Fewer survivors than top-k.
    let layers: Vec<_> = (0..8).map(|l| (l, Some(vec![0, 1]))).collect();
    assert!(prune(
        &src,
        &plan(&src, 16, &layers),
        &d.path().join("c"),
        &o,
        &|_, _| {}
    )
    .is_err());
    // Validation.
    let mut p = plan(&src, 16, &[(0, Some(vec![3, 1]))]);
    assert!(p.validate().is_err());
    p.layers[0].survivors = Some(vec![1, 99]);
    assert!(p.validate().is_err());
    // Every field is checked: a duplicate layer, a layer the model lacks, a layer keeping
    // other than `keep`, and a plan made for another model with the same expert count.
    let keep4: Vec<_> = (0..8).map(|l| (l, Some(vec![0, 1, 2, 3]))).collect();
    let good = plan(&src, 16, &keep4);
    let mut dup = good.clone();
    dup.layers.push(dup.layers[0].clone());
    let mut far = good.clone();
    far.layers[7].layer = 8;
    let mut uneven = good.clone();
    uneven.keep = 5;
    let other = {
        let d2 = d.path().join("other");
        std::fs::create_dir(&d2).unwrap();
        let (cfg, st) = preset("tiny").unwrap();
        let o = SynthOptions {
            seed: 6,
            storage: st,
            force: false,
            max_shard_bytes: 64 << 10,
        };
        let m2 = synth(&cfg, &d2.join("tiny"), &o, &|_, _| {}).unwrap();
        plan(&m2, 16, &keep4)
    };
    for (p, what) in [
        (&dup, "twice"),
        (&far, "layer 8"),
        (&uneven, "keep"),
        (&other, "fingerprint"),
    ] {
        let e = prune(&src, p, &d.path().join("z"), &o, &|_, _| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains(what), "{what}: {e}");
        assert!(!d.path().join("z").exists());
    }
    let mut bare = good.clone();
    bare.extra.clear();
    let e = prune(&src, &bare, &d.path().join("z"), &o, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("model_fingerprint"), "{e}");
    prune(&src, &good, &d.path().join("z"), &o, &|_, _| {}).unwrap();
}
