//! One tier policy, three places: on a tiny synthetic model quantized to E8P2+E81 and an
//! allocation that gives half of each layer's experts `e8p2` (their residual codes are then
//! their upper stage) and half `e8p2+e81` (their residual is part of their base: without the
//! original checkpoint no upper stage, with it (`--upper-from`) their shipped expert), the
//! deterministic evaluation (`keep eval --tiers`), the replay (`keep residency --tau`) and the
//! runtime (`keep run --tiers`, its upper-stage reads completed by the test after each forward:
//! an admission delay of one token) serve the same routed slots at the same rungs, token by
//! token, with a prefill forward first.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use keep_artifacts::alloc::{Alloc, LayerAlloc, RungBytes};
use keep_artifacts::routes::{LayerRoutes, RouteTrace, Session};
use keep_calib::calibrate::{calibrate, CalibrateOptions};
use keep_calib::pack::{from_token_sources, write_pack, Pack, PackOptions, Split};
use keep_calib::tiers::{eval_tiers, TierOptions as EvalTierOptions};
use keep_checkpoint::Checkpoint;
use keep_model::{Logits, RouteEvent, RouteObserver, RungEvent};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;
use keep_residency::tiers::{
    replay_tiers_with, residual_bytes, shipped_bytes, stage_bytes, upper_stages, TierSpec,
};
use keep_runtime::{BudgetedModel, ReadGate, RuntimeOptions, TierOptions};

/// Routes and rungs of every layer pass, in order.
#[derive(Default)]
struct Log {
    /// Per layer: experts and gate weights of every token, in order.
    routes: BTreeMap<usize, (Vec<u16>, Vec<f32>, usize)>,
    /// Every slot's rung, in the order the passes chose them.
    upper: Vec<bool>,
    /// The experts of the slots served at the upper rung.
    upper_experts: Vec<u32>,
}

impl RouteObserver for Log {
    fn on_route(&mut self, ev: &RouteEvent) {
        let e = self.routes.entry(ev.layer).or_default();
        e.0.extend(ev.experts.iter().map(|&x| x as u16));
        e.1.extend_from_slice(ev.weights);
        e.2 = ev.top_k;
    }
    fn on_rungs(&mut self, ev: &RungEvent) {
        self.upper.extend_from_slice(ev.upper);
        self.upper_experts.extend(
            ev.experts
                .iter()
                .zip(ev.upper)
                .filter(|x| *x.1)
                .map(|x| *x.0),
        );
    }
}

fn pack(dir: &Path, vocab: usize) -> Pack {
    use keep_rng::Draw;
    let sources: Vec<(String, Vec<u32>)> = (0..3)
        .map(|i| {
            let mut r = keep_rng::rng(700 + i);
            (
                format!("doc{i}.txt"),
                (0..40).map(|_| r.below(vocab) as u32).collect(),
            )
        })
        .collect();
    let opts = PackOptions {
        max_tokens: 24,
        held_out_frac: 0.34,
        seed: 3,
    };
    let (m, r) = from_token_sources(&sources, "0".repeat(64), vocab, &opts).unwrap();
    let p = dir.join("pack");
    write_pack(&p, &m, &r, false).unwrap();
    Pack::open(&p).unwrap()
}

#[test]
fn eval_replay_and_runtime_serve_the_same_rungs() {
    let dir = tempfile::tempdir().unwrap();
    let residual_only = serve_the_same_rungs(dir.path(), false);
    let with_shipped = serve_the_same_rungs(dir.path(), true);
    // The shipped stages add upper slots (at τ = 0 every slot wants its upper rung).
    assert!(with_shipped.upper > residual_only.upper);
}

/// The comparison, with the original checkpoint as the shipped upper stage of the `e8p2+e81`
/// experts when `shipped` (`keep eval --upper-from`, `keep residency --upper-from`, `keep run
/// --upper-from`). Returns the runtime's counters.
fn serve_the_same_rungs(dir: &Path, shipped: bool) -> keep_runtime::TierStats {
    let dir = &dir.join(if shipped { "shipped" } else { "residual" });
    std::fs::create_dir_all(dir).unwrap();
    let src = common::synth_tiny(dir, "tiny", Some(16), None);
    let im = common::flat_imatrix(&src, dir);
    let q = dir.join("q");
    let qo = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: ExpertSelection::All,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    quantize(&src, &im, &q, &qo, &|_, _| {}).unwrap();
    let sck = Checkpoint::open(&src).unwrap();
    let c = sck.require_config().unwrap();
    let (nl, ne) = (c.num_hidden_layers, c.n_routed_experts);
    let alloc = Alloc {
        format: Alloc::FORMAT.into(),
        version: Alloc::VERSION,
        model: src.display().to_string(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(&src).unwrap(),
        budget_bytes: (nl * ne) as u64,
        bytes: (nl * ne) as u64,
        rungs: ["e8p2", "e8p2+e81"]
            .iter()
            .map(|l| RungBytes {
                label: l.to_string(),
                bytes_per_expert: 1,
            })
            .collect(),
        solver: "test".into(),
        grain_bytes: 1,
        predicted_loss: 0.0,
        saliency: "reap".into(),
        layers: (0..nl)
            .map(|l| LayerAlloc {
                layer: l,
                rungs: (0..ne)
                    .map(|e| if e % 2 == 0 { "e8p2" } else { "e8p2+e81" }.to_string())
                    .collect(),
            })
            .collect(),
        extra: BTreeMap::new(),
    };
    let ap = dir.join("alloc.json");
    alloc.write(&ap, false).unwrap();

    // The evaluation: one eval record, its first `prefill` tokens one forward.
    let pack = pack(dir, c.vocab_size);
    let teacher = dir.join("teacher");
    let co = CalibrateOptions {
        split: Split::Eval,
        chunk_tokens: 48,
        ..Default::default()
    };
    calibrate(&src, &pack, &teacher, &co, &mut |_| {}).unwrap();
    let (tau, prefill, cache) = (0.0f64, 5usize, 1u64 << 30);
    let eo = EvalTierOptions {
        taus: vec![tau],
        cache_bytes: cache,
        admit_delay: 1,
        upper_shipped: shipped,
        prefill_tokens: prefill,
        record: true,
    };
    let r = eval_tiers(
        &src,
        &ap,
        std::slice::from_ref(&q),
        &teacher,
        &pack,
        &eo,
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(r.upper_stages.get("residual"), Some(&(nl * ne / 2)));
    let other = if shipped { "shipped" } else { "none" };
    assert_eq!(r.upper_stages.get(other), Some(&(nl * ne / 2)));
    let tokens = r.record_tokens.clone().unwrap()[0].clone();
    let eval_served: Vec<bool> = r.students[1]
        .served
        .as_ref()
        .unwrap()
        .iter()
        .filter(|s| s.record == 0)
        .map(|s| s.upper)
        .collect();

    // The runtime on the same tokens: every slot in memory-budget slots, residual reads held
    // during each forward and completed after it (a delay of one token).
    let qck = Checkpoint::open(&q).unwrap();
    let mut m = BudgetedModel::load(
        &qck,
        &RuntimeOptions {
            tiers: Some(TierOptions {
                tau: tau as f32,
                alloc: Some(Arc::new(alloc.clone())),
                residual_cache: cache,
                io_threads: 1,
                upper_from: shipped.then(|| src.clone()),
            }),
            ..RuntimeOptions::new(u64::MAX / 4)
        },
    )
    .unwrap();
    let with_upper = if shipped { nl * ne } else { nl * ne / 2 };
    assert_eq!(m.cache().store().experts_with_upper(), with_upper);
    let gate = Arc::new(ReadGate::new());
    m.cache().store().hold_upper_reads(gate.clone());
    let mut log = Log::default();
    let mut kv = m.new_cache();
    let forwards: Vec<std::ops::Range<usize>> = std::iter::once(0..prefill)
        .chain((prefill..tokens.len()).map(|i| i..i + 1))
        .collect();
    for f in &forwards {
        m.forward(&tokens[f.clone()], &mut kv, Logits::Last, Some(&mut log))
            .unwrap();
        gate.open();
        while {
            let t = m.cache().tier_stats().unwrap();
            t.reads_done + t.failed < t.admissions
        } {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        gate.close();
    }
    let t = m.cache().tier_stats().unwrap();
    assert_eq!(t.failed, 0);

    // The replay of the runtime's routes.
    let layers: Vec<usize> = (0..nl).collect();
    let shipped_bytes = shipped.then(|| shipped_bytes(&src, &layers).unwrap());
    let stages = upper_stages(
        Some(&alloc),
        &layers,
        &residual_bytes(&q, &layers).unwrap(),
        shipped_bytes.as_deref(),
    )
    .unwrap();
    let trace = RouteTrace {
        path: "runtime".into(),
        sessions: vec![Session {
            id: "s".into(),
            model_fingerprint: None,
            layers: log
                .routes
                .iter()
                .map(|(&l, (ex, ws, k))| LayerRoutes {
                    layer: l,
                    top_k: *k,
                    n_experts: ne,
                    hash: false,
                    experts: ex.clone(),
                    weights: ws.clone(),
                })
                .collect(),
            source: None,
        }],
        skipped: vec![],
    };
    let spec = TierSpec {
        tau: tau as f32,
        cache_bytes: cache,
        admit_delay: 1,
        upper_bytes: stage_bytes(&stages),
        prefill_tokens: prefill,
    };
    let mut replay_served = vec![];
    let counts =
        replay_tiers_with(&trace, &spec, &mut |_, _, _, up| replay_served.push(up)).unwrap();

    assert_eq!(log.upper.len(), tokens.len() * nl * c.num_experts_per_tok);
    assert_eq!(
        eval_served, log.upper,
        "evaluation vs runtime, slot by slot"
    );
    assert_eq!(replay_served, log.upper, "replay vs runtime, slot by slot");
    assert_eq!((counts.upper, counts.admissions), (t.upper, t.admissions));
    // (The evaluation's mix pools all its records; the comparison above is its first.)
    // The rule is exercised: some slots upper, some found their stage in flight (the prefill);
    // the `e8p2+e81` (odd) experts upgrade to their shipped expert exactly when it is given.
    assert!(t.upper > 0 && t.in_flight > 0, "{t:?}");
    let odd_upper = log.upper_experts.iter().filter(|&&e| e % 2 == 1).count();
    if shipped {
        assert!(odd_upper > 0 && t.base == t.upper_misses, "{t:?}");
    } else {
        assert!(odd_upper == 0 && t.base > t.upper_misses, "{t:?}");
    }
    t
}
