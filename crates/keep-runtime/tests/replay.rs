//! The simulator models the runtime: a route file that a budgeted `keep run` recorded while
//! generating (a one-token prompt, then decode: every forward is one token), replayed through
//! keep-residency with the same policy, a hot set of the cache's slots per layer and the same
//! warm start, gives the runtime's hits and misses exactly, layer by layer — for lru, decay
//! and static, cold and warm.

mod common;

use std::ops::ControlFlow;
use std::path::Path;

use keep_artifacts::routes::read_run;
use keep_checkpoint::Checkpoint;
use keep_model::generate::{GenerateOptions, Prompt, SamplerConfig};
use keep_residency::sim::{order_by, replay, ReplaySpec};
use keep_runtime::{
    warm_scores, BudgetPlan, BudgetedModel, Policy, RouteLog, RunModel, RuntimeOptions,
};

/// Decoded tokens per run: enough for every slot to be given up many times.
const DECODE_TOKENS: usize = 48;

/// Generate from a one-token prompt under `opts`, record the routes to `routes`; the hits and
/// misses per layer (prefill and decode together) and the slots per layer.
fn run(ck: &Checkpoint, opts: &RuntimeOptions, routes: &Path) -> (Vec<(u64, u64)>, usize) {
    let mut m = RunModel::load(ck, opts.kernels, Some(opts)).unwrap();
    let n_experts = m.cfg().n_experts;
    let prompt = common::prompt(1, m.cfg().vocab);
    let gen = GenerateOptions {
        max_tokens: DECODE_TOKENS,
        sampling: SamplerConfig {
            temperature: 1.0,
            top_p: 1.0,
            seed: 11,
        },
        tokenizer: None,
    };
    let mut log = RouteLog::new();
    let r = keep_runtime::run::run(&mut m, Prompt::Ids(&prompt), &gen, Some(&mut log), |_| {
        ControlFlow::Continue(())
    })
    .unwrap();
    log.write(routes, "replay", n_experts, true).unwrap();
    let (prefill, decode) = (r.prefill_cache.unwrap(), r.decode_cache.unwrap());
    let per_layer = prefill
        .per_layer
        .iter()
        .zip(&decode.per_layer)
        .map(|(p, d)| (p.hits + d.hits, p.misses + d.misses))
        .collect();
    (per_layer, m.budgeted().unwrap().plan().slots_per_layer)
}

#[test]
fn a_recorded_run_replays_to_the_runtimes_hits() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::synth_tiny(dir.path(), "tiny", Some(32), None);
    let ck = Checkpoint::open(&path).unwrap();
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let cfg = probe.cfg().clone();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    // Three slots beyond top-k per layer: 7 of 32 experts.
    let budget = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k)
        + 3 * slot * cfg.n_layers as u64;

    // A warm start recorded by a first run.
    let warm = dir.path().join("warm.safetensors");
    run(&ck, &RuntimeOptions::new(budget), &warm);
    let scores = warm_scores(&warm, cfg.n_layers, cfg.n_experts).unwrap();

    let routes = dir.path().join("routes.safetensors");
    for policy in [
        Policy::Lru,
        Policy::Decay { half_life: 4.0 },
        Policy::Static,
    ] {
        for warm_start in [None, Some(warm.clone())] {
            let mut opts = RuntimeOptions::new(budget);
            opts.policy = policy;
            opts.warm_start = warm_start.clone();
            let (got, slots) = run(&ck, &opts, &routes);
            assert_eq!(slots, cfg.top_k + 3);

            let trace = read_run(&routes).unwrap();
            let layers: Vec<usize> = trace.sessions[0].layers.iter().map(|l| l.layer).collect();
            // The prompt token, then every sampled token but the last is fed back.
            assert_eq!(trace.sessions[0].layers[0].tokens(), DECODE_TOKENS);
            let order: Vec<Vec<u16>> = layers
                .iter()
                .map(|&l| match warm_start {
                    Some(_) => order_by(&scores[l]),
                    None => (0..cfg.n_experts as u16).collect(),
                })
                .collect();
            let capacity = vec![slots; layers.len()];
            let half_life = match policy {
                Policy::Decay { half_life } => half_life,
                _ => 0.0,
            };
            let r = replay(
                &trace,
                &ReplaySpec {
                    policy: policy.kind(),
                    capacity: &capacity,
                    order: &order,
                    prefill: warm_start.is_some(),
                    half_life,
                    threshold: 0.0,
                },
            );
            let want: Vec<(u64, u64)> = r.layers.iter().map(|c| (c.hits, c.misses)).collect();
            let got: Vec<(u64, u64)> = layers.iter().map(|&l| got[l]).collect();
            assert_eq!(
                got,
                want,
                "{policy}, warm start {}: runtime (hits, misses) per layer vs the simulator's",
                warm_start.is_some()
            );
            assert!(want.iter().all(|&(h, m)| h > 0 && m > 0), "{want:?}");
        }
    }
}
