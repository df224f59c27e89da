//! `keep alloc` and `keep quant --alloc` on the bundled model: REAP statistics (synthetic
//! sums written through keep-artifacts' writer, bound to the model's fingerprint) and the
//! errors of a real `keep quant` run go into the knapsack; the allocation fits the budget,
//! gives the upper rung to the most salient coded experts, and the checkpoint `quantize`
//! writes from it stores each expert at its allocated rung. An allocation that prunes is
//! refused by `keep quant --alloc`.

use std::collections::BTreeSet;
use std::path::Path;

use keep_artifacts::alloc::{Alloc, LossModel, PRUNED, SHIPPED};
use keep_artifacts::reap::{LayerReap, ReapStats};
use keep_checkpoint::Checkpoint;
use keep_quant::alloc::{
    allocate, expert_table, fit_loss_model, loss_terms, rung_bytes, AllocOptions, Saliency, Solver,
};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;

mod common;
use common::{bundled, imatrix};

/// Experts 0..CODED of every layer are coded by the test's `keep quant` run.
const CODED: usize = 4;

fn reap_run(dir: &Path) -> std::path::PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
    let cfg = ck.require_config().unwrap();
    let (nl, ne, d) = (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.hidden_size);
    let mut layers = vec![];
    let mut scores = vec![];
    for l in 0..nl {
        let mut r = LayerReap::new(ne, d);
        for j in 0..ne {
            r.count[j] = 10;
            // saliency rises with the expert id, and with the layer
            r.sum_g_norm[j] = (1 + j + l) as f64;
            r.sum_g[j] = 1.0;
            r.sum_norm[j] = 1.0;
        }
        r.max_f.iter_mut().for_each(|v| *v = 1.0);
        r.min_f.iter_mut().for_each(|v| *v = -1.0);
        scores.push(r.score());
        layers.push(r);
    }
    let s = ReapStats {
        n_layers: nl,
        n_experts: ne,
        top_k: cfg.num_experts_per_tok,
        hidden: d,
        hash_layers: (0..cfg.num_hash_layers).collect(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(&bundled()).unwrap(),
        pack_fingerprint: "test".into(),
        split: "calib".into(),
        sessions: 1,
        tokens: 100,
        layers,
        scores,
    };
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    s.write(&run.join(keep_artifacts::reap::FILE), false)
        .unwrap();
    run
}

#[test]
fn allocation_fits_and_quant_writes_its_rungs() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let run = reap_run(tmp.path());
    let ck = Checkpoint::open(&bundled()).unwrap();
    let cfg = ck.require_config().unwrap();
    let (nl, ne) = (cfg.num_hidden_layers, cfg.n_routed_experts);
    // a real quant report for experts 0..CODED of every layer (both E8P rungs)
    let q = tmp.path().join("q");
    let sel = ExpertSelection::Only(
        (0..nl)
            .map(|l| (l, (0..CODED).collect::<BTreeSet<_>>()))
            .collect(),
    );
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: sel,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    quantize(&bundled(), &im, &q, &opts, &|_, _| {}).unwrap();

    let cost = |r: &str| rung_bytes(&ck, 0, 0, r).unwrap();
    let (shipped, e2, e3) = (cost(SHIPPED), cost("e8p2"), cost("e8p2+e81"));
    assert!(e2 < e3 && e3 < shipped, "{e2} {e3} {shipped}");
    // the coded experts at e8p2, the rest shipped, and room for 5 upgrades to e8p2+e81
    let floor = (nl * (ne - CODED)) as u64 * shipped + (nl * CODED) as u64 * e2;
    let budget = floor + 5 * (e3 - e2) + (e3 - e2) / 2;
    let rungs: Vec<String> = ["e8p2", "e8p2+e81", SHIPPED].map(String::from).to_vec();
    let mut ao = AllocOptions {
        model: bundled(),
        run: run.clone(),
        reports: vec![q.clone()],
        rungs,
        budget,
        solver: Solver::Auto,
        saliency: Saliency::ReapMass,
        loss_model: None,
    };
    let a = allocate(&ao).unwrap();
    assert!(a.bytes <= budget && a.bytes == floor + 5 * (e3 - e2));
    assert_eq!(a.solver, "exact-mckp");
    let mix = a.mix();
    assert_eq!(mix["e8p2+e81"], 5);
    assert_eq!(mix[SHIPPED], nl * (ne - CODED));
    // the greedy solver agrees on this instance (equal step sizes)
    ao.solver = Solver::Greedy;
    let g = allocate(&ao).unwrap();
    assert_eq!(g.bytes, a.bytes);
    assert!((g.predicted_loss - a.predicted_loss).abs() <= 1e-9 * a.predicted_loss.max(1.0));
    // A report whose error is not a number ≥ 0 is refused naming the expert, its layer, the
    // rung and the file, before solving.
    let bad = tmp.path().join("bad-report.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(q.join("quant-report.json")).unwrap())
            .unwrap();
    let (bl, be) = (
        v["experts"][0]["layer"].as_u64().unwrap(),
        v["experts"][0]["expert"].as_u64().unwrap(),
    );
    v["experts"][0]["rel_error"]["e8p2"] = (-1.0).into();
    std::fs::write(&bad, v.to_string()).unwrap();
    let e = allocate(&AllocOptions {
        reports: vec![bad.clone()],
        ..ao.clone()
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&format!("expert {be} of layer {bl}"))
            && e.contains("`e8p2`")
            && e.contains("bad-report.json"),
        "{e}"
    );

    // round trip through the file, then the checkpoint it describes
    let path = tmp.path().join("alloc.json");
    a.write(&path, false).unwrap();
    let a = Alloc::read(&path).unwrap();
    let out = tmp.path().join("mixed");
    let opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: ExpertSelection::from_alloc(&a).unwrap(),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let rep = quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap();
    assert_eq!(rep.method, "mixed");
    let qck = Checkpoint::open(&out).unwrap();
    let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let mut stored = 0u64;
    for l in 0..nl {
        for j in 0..ne {
            let want = a.rung(l, j).unwrap();
            let v = keep_model::weights::weight(
                &qck,
                &format!("layers.{l}.ffn.experts.{j}.w2"),
                d,
                i,
                None,
            )
            .unwrap();
            let label = if want == SHIPPED { "mxfp4" } else { want };
            assert_eq!(v.format_name(), label, "layer {l} expert {j}");
            for p in ["w1", "w2", "w3"] {
                for t in qck.tensors() {
                    let b = format!("layers.{l}.ffn.experts.{j}.{p}.");
                    if t.name.starts_with(&b) {
                        stored += t.bytes.len() as u64;
                    }
                }
            }
        }
    }
    assert_eq!(
        stored, a.bytes,
        "the allocation's bytes are the checkpoint's expert bytes"
    );

    // with pruning allowed and a budget below every coded rung, experts are pruned, and
    // keep quant --alloc refuses the allocation
    ao.solver = Solver::Auto;
    ao.rungs = [PRUNED, "e8p2", SHIPPED].map(String::from).to_vec();
    ao.budget = floor - 3 * shipped;
    let p = allocate(&ao).unwrap();
    assert!(p.mix()[PRUNED] >= 3);
    let err = ExpertSelection::from_alloc(&p).unwrap_err().to_string();
    assert!(err.contains("does not remove experts"), "{err}");

    // a loss model: what pruning costs decides whether the solver prunes to pay for better
    // rungs elsewhere
    let table = expert_table(
        &bundled(),
        &run,
        std::slice::from_ref(&q),
        Saliency::ReapMass,
    )
    .unwrap();
    let lm = |pruned: f64| LossModel {
        format: LossModel::FORMAT.into(),
        version: LossModel::VERSION,
        model_fingerprint: table.model_fingerprint.clone(),
        saliency: "reap-mass".into(),
        multipliers: [(PRUNED, pruned), ("e8p2", 1.0), ("e8p2+e81", 1.0)]
            .map(|(k, v)| (k.to_string(), v))
            .into(),
        fitted: vec![],
        held_out: vec![],
        extra: Default::default(),
    };
    ao.rungs = [PRUNED, "e8p2", "e8p2+e81", SHIPPED]
        .map(String::from)
        .to_vec();
    ao.budget = floor;
    ao.loss_model = Some(lm(1e-9));
    let cheap = allocate(&ao).unwrap();
    assert!(
        cheap.mix().get(PRUNED).copied().unwrap_or(0) > 0,
        "{:?}",
        cheap.mix()
    );
    ao.loss_model = Some(lm(1e9));
    let dear = allocate(&ao).unwrap();
    assert_eq!(dear.mix().get(PRUNED), None, "{:?}", dear.mix());
    // the objective is the loss model's prediction of the allocation
    let m = lm(1e9);
    let pred = m.predict(&loss_terms(&table, &dear).unwrap()).unwrap();
    assert!(
        (pred - dear.predicted_loss).abs() <= 1e-9 * pred.max(1.0),
        "{pred} vs {}",
        dear.predicted_loss
    );
    // fitted on the points a known model makes, the fit predicts a held-out point exactly
    let mut truth = m.clone();
    truth.multipliers = [(PRUNED, 2.0), ("e8p2", 0.5), ("e8p2+e81", 0.25)]
        .map(|(k, v)| (k.to_string(), v))
        .into();
    let kl = |a: &Alloc| truth.predict(&loss_terms(&table, a).unwrap()).unwrap();
    ao.loss_model = None;
    let mut pts = vec![];
    for (rungs, budget) in [
        (vec!["e8p2", SHIPPED], floor),
        (
            vec!["e8p2+e81", SHIPPED],
            floor + (nl * CODED) as u64 * (e3 - e2),
        ),
        (vec![PRUNED, SHIPPED], (nl * ne - 3) as u64 * shipped),
    ] {
        ao.rungs = rungs.into_iter().map(String::from).collect();
        ao.budget = budget;
        let a = allocate(&ao).unwrap();
        pts.push((format!("{:?}", ao.rungs), a.clone(), kl(&a)));
    }
    let held = vec![("cheap".to_string(), cheap.clone(), kl(&cheap))];
    let fit = fit_loss_model(&table, &pts, &held).unwrap();
    for (k, v) in &truth.multipliers {
        assert!(
            (fit.multipliers[k] - v).abs() <= 1e-6 * v,
            "{k}: {:?}",
            fit.multipliers
        );
    }
    let h = &fit.held_out[0];
    assert!((h.predicted - h.kl).abs() <= 1e-6 * h.kl, "{h:?}");
}

/// Experts no calibration token reached cost nothing to prune, so the solver prunes them at any
/// budget: a layer left with fewer than top-k is refused without advising a larger budget.
#[test]
fn pruning_free_experts_below_top_k_does_not_ask_for_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let run = reap_run(tmp.path());
    let file = run.join(keep_artifacts::reap::FILE);
    let mut s = ReapStats::read(&file).unwrap();
    let l = s.hash_layers.len(); // the first layer that can be pruned
    let ne = s.n_experts;
    for j in 1..ne {
        s.layers[l].sum_g_norm[j] = 0.0;
    }
    s.scores[l] = s.layers[l].score();
    s.write(&file, true).unwrap();
    let ck = Checkpoint::open(&bundled()).unwrap();
    let shipped = rung_bytes(&ck, 0, 0, SHIPPED).unwrap();
    let ao = AllocOptions {
        model: bundled(),
        run,
        reports: vec![],
        rungs: [PRUNED, SHIPPED].map(String::from).to_vec(),
        budget: shipped * (s.n_layers * ne) as u64,
        solver: Solver::Auto,
        saliency: Saliency::ReapMass,
        loss_model: None,
    };
    let e = allocate(&ao).unwrap_err().to_string();
    assert!(
        e.contains(&format!("of layer {l}"))
            && e.contains("a larger budget would not keep them")
            && !e.contains("raise --budget"),
        "{e}"
    );
}
