//! keep-fit on a synthetic tiny checkpoint (`keep synth`'s tiny preset): planning with and
//! without a route trace, writing the plan beside its profile, the refusal and the build of a
//! derived checkpoint, the check run and the route profile it folds in and warm-starts from.

use std::path::{Path, PathBuf};

use keep_artifacts::fit_plan::{Derived, FitPlan, Memory};
use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_artifacts::route_profile::RouteProfile;
use keep_checkpoint::Checkpoint;
use keep_convert::presets;
use keep_convert::synth::{synth, SynthOptions};
use keep_fit::check::{check, CheckOptions};
use keep_fit::probe::{minimum_budget, ProbeOptions};
use keep_fit::{apply, fit, FitError, FitOptions};
use keep_model::{Kernels, ModelConfig};
use keep_residency::synth::SynthSpec;

fn tiny(dir: &Path) -> PathBuf {
    let (cfg, storage) = presets::preset("tiny").unwrap();
    let opts = SynthOptions {
        seed: 7,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    synth(&cfg, &dir.join("tiny"), &opts, &|_, _| {}).unwrap()
}

fn probe_opts() -> ProbeOptions {
    ProbeOptions {
        kernels: Kernels::Fast,
        prompt_tokens: 4,
        decode_tokens: 4,
        sequences: 2,
        held_out: None,
        context: 16,
        io_threads: 2,
    }
}

/// The least budget plus `extra` expert slots per layer.
fn budget(model: &Path, extra: u64) -> u64 {
    let ck = Checkpoint::open(model).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let slot = keep_runtime::ExpertStore::open(&ck, &cfg, true)
        .unwrap()
        .slot_bytes();
    minimum_budget(&ck, &probe_opts()).unwrap() + extra * slot * cfg.n_layers as u64
}

fn options(model: &Path, bytes: u64, run: Option<PathBuf>, out: PathBuf) -> FitOptions {
    FitOptions {
        model: model.to_path_buf(),
        memory: Memory {
            bytes,
            auto: false,
            available: None,
            margin: 0,
        },
        run,
        evals: vec![],
        min_quality: None,
        kernels: Kernels::Fast,
        probe: probe_opts(),
        out,
        derived_dir: None,
        command: "keep fit (test)".into(),
        levels: vec![],
        knob: keep_fit::search::Knob::All,
    }
}

#[test]
fn fit_write_check_and_profile() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let run = dir.path().join("run");
    keep_residency::synth::write_run(
        &run,
        &SynthSpec {
            layers: 8,
            n_experts: 16,
            top_k: 4,
            tokens: 64,
            sessions: 1,
            working_set: 6,
            ..SynthSpec::default()
        },
    )
    .unwrap();
    let out = dir.path().join("plan.json");
    let bytes = budget(&model, 4);
    let o = fit(&options(&model, bytes, Some(run), out.clone())).unwrap();
    let p = &o.plan;
    // No REAP statistics: every expert kept, offloaded with the slots the memory leaves.
    assert!(p.derived.is_none());
    assert_eq!(p.budget, Some(bytes));
    assert_eq!(p.hot_set, 8);
    assert_eq!(p.prediction.tokens_per_sec.provenance, "simulated");
    assert!(p.prediction.tokens_per_sec.value.unwrap() > 0.0);
    assert!(p.prediction.meets_quality);
    assert!(o.notes.iter().any(|n| n.contains("REAP")), "{:?}", o.notes);
    assert!(p.probes.compute_probe_tokens > 0);
    keep_fit::search::write(&o, &out, false).unwrap();
    assert!(
        keep_fit::search::write(&o, &out, false).is_err(),
        "existing plan refused"
    );
    // JSON keeps every field (floats to serde_json's shortest round trip, not always the last bit).
    let back = FitPlan::read(&out).unwrap();
    assert_eq!(
        (
            back.budget,
            back.hot_set,
            &back.policy,
            &back.prediction.name
        ),
        (p.budget, p.hot_set, &p.policy, &p.prediction.name)
    );
    let prof_path = apply::profile_path(&out, p).unwrap();
    assert_eq!(RouteProfile::read(&prof_path).unwrap().runs, 1);

    // The runtime warm-starts from the profile.
    let ck = keep_checkpoint::Checkpoint::open(Path::new(&p.model)).unwrap();
    let ro = apply::runtime_options(&out, p, &ck, 16).unwrap().unwrap();
    assert_eq!(ro.warm_start.as_deref(), Some(prof_path.as_path()));
    assert_eq!(ro.budget, bytes);

    let r = check(
        &out,
        &CheckOptions {
            prompt_tokens: 4,
            decode_tokens: 4,
            teacher: None,
            build: false,
        },
    )
    .unwrap();
    assert!(r.measured_tps > 0.0);
    assert_eq!(
        (r.sequences, r.decode_tokens),
        (2, 8),
        "the plan's check set, decoded"
    );
    assert!(r.measured_hit_rate.is_some());
    assert_eq!(r.slots_per_layer, Some(8));
    assert!(r.tps_error.is_some());
    let prof = RouteProfile::read(&prof_path).unwrap();
    assert_eq!(prof.runs, 2, "the check folded its routes in");
    assert!(prof.tokens > 64);
}

#[test]
fn without_a_run_plans_offload_on_the_check_sets_routes() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = dir.path().join("plan.json");
    let o = fit(&options(&model, budget(&model, 2), None, out)).unwrap();
    assert_eq!(o.plan.prediction.tokens_per_sec.provenance, "simulated");
    let set = o
        .plan
        .check_set
        .as_ref()
        .expect("the plan names its check set");
    assert_eq!((set.sequences.len(), set.prompt_tokens), (2, 4));
    assert!(set.sequences.iter().all(|s| s.len() == 8));
    assert_eq!(o.plan.hot_set, 6);
    assert!(o.profile.is_none());
    assert!(o.notes.iter().any(|n| n.contains("no calibration run")));
    // Too little memory for top-k slots is refused, saying why.
    let e = fit(&options(&model, 4096, None, dir.path().join("p2.json"))).unwrap_err();
    assert!(matches!(e, FitError::NoFit(_)), "{e}");
}

#[test]
fn derived_checkpoint_is_refused_with_its_command_then_built() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = dir.path().join("plan.json");
    let mut o = fit(&options(&model, budget(&model, 2), None, out.clone())).unwrap();
    let mut pp = PrunePlan::new(16, 8, "reap");
    pp.layers = (0..8)
        .map(|l| LayerPlan {
            layer: l,
            survivors: Some((0..8).collect()),
            hash_routed: false,
            hash_remap: None,
        })
        .collect();
    pp.bind_to(&model).unwrap();
    let pp_path = dir.path().join("plan.prune.json");
    pp.write(&pp_path, false).unwrap();
    let derived = dir.path().join("tiny-keep8");
    o.plan.derived = Some(Derived {
        dir: derived.display().to_string(),
        experts_kept: 8,
        experts_total: 16,
        rung: None,
        prune_plan: Some("plan.prune.json".into()),
        commands: vec![format!(
            "keep prune {} {} --plan {}",
            model.display(),
            derived.display(),
            pp_path.display()
        )],
    });
    let e = apply::checkpoint(&out, &o.plan, false, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("keep prune") && e.contains("--build"), "{e}");
    let built = apply::checkpoint(&out, &o.plan, true, &|_, _| {}).unwrap();
    let ck = Checkpoint::open(&built).unwrap();
    assert_eq!(ck.require_config().unwrap().n_routed_experts, 8);
}

#[test]
fn the_check_sets_routes_do_not_depend_on_the_budget() {
    // The prediction replays the routes the probe recorded at the smallest budget; the check
    // decodes the same sequences in the plan's budget. Feeding the text (not the model's
    // picks) makes them the same routes.
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let ck = Checkpoint::open(&model).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let set = keep_fit::checkset::synthetic(cfg.vocab, 2, 4, 4);
    let traces: Vec<_> = [budget(&model, 0), budget(&model, 10)]
        .into_iter()
        .map(|b| {
            let mut ro = keep_runtime::RuntimeOptions::new(b);
            ro.context = Some(16);
            ro.io_threads = 2;
            let mut m = keep_runtime::RunModel::load(&ck, Kernels::Fast, Some(&ro)).unwrap();
            let d = keep_fit::checkset::decode(&mut m, &set, true, None).unwrap();
            assert_eq!(d.decode_tokens, 8);
            d.trace
        })
        .collect();
    assert_eq!(traces[0].sessions.len(), 2);
    assert_eq!(traces[0], traces[1]);
}

/// A plan whose `draft` is `dspark` runs the checkpoint's DSpark drafter with a whole block per
/// verify forward (as `keep run --draft dspark`), its runtime options plan the budget for
/// drafting (the drafter's tensors and the cache copy held), and `keep fit --check` runs it so.
#[test]
fn a_dspark_plan_drafts_with_the_dspark_drafter() {
    use keep_runtime::run::DraftMode;
    let dir = tempfile::tempdir().unwrap();
    let (mut cfg, storage) = presets::preset("tiny").unwrap();
    presets::with_dspark(&mut cfg);
    let opts = SynthOptions {
        seed: 13,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    let model = synth(&cfg, &dir.path().join("tiny-dspark"), &opts, &|_, _| {}).unwrap();
    let ck = Checkpoint::open(&model).unwrap();
    let dspark: u64 = ck
        .tensors()
        .filter(|t| t.name.starts_with("mtp."))
        .map(|t| t.bytes.len() as u64)
        .sum();
    assert!(dspark > 0);
    // Room for the drafter and a cache copy beside four slots per layer.
    let bytes = budget(&model, 4) + 2 * dspark;
    let out = dir.path().join("plan.json");
    let o = fit(&options(&model, bytes, None, out.clone())).unwrap();
    keep_fit::search::write(&o, &out, false).unwrap();
    let mut plan = o.plan.clone();
    assert_eq!(apply::draft(&plan, &ck), (DraftMode::None, 0));
    plan.draft = "dspark".into();
    plan.write(&out, true).unwrap();
    let plan = FitPlan::read(&out).unwrap();
    assert_eq!(apply::draft(&plan, &ck), (DraftMode::DSpark, 5));
    let ro = apply::runtime_options(&out, &plan, &ck, 16)
        .unwrap()
        .unwrap();
    assert_eq!(ro.draft_tokens, 5);
    // The drafting budget holds every DSpark tensor beside the rest.
    let drafting = keep_runtime::BudgetedModel::load(&ck, &ro)
        .unwrap()
        .plan()
        .fixed();
    let mut plain = ro.clone();
    plain.draft_tokens = 0;
    let plain = keep_runtime::BudgetedModel::load(&ck, &plain)
        .unwrap()
        .plan()
        .fixed();
    assert!(
        drafting >= plain + dspark,
        "the plan's drafting budget ({drafting} B) does not hold the DSpark tensors ({dspark} B) beside the rest ({plain} B)"
    );
    // A plan naming a drafter its checkpoint lacks does not draft.
    let tiny = tiny(dir.path());
    let tck = Checkpoint::open(&tiny).unwrap();
    assert_eq!(apply::draft(&plan, &tck), (DraftMode::None, 0));
    let r = check(
        &out,
        &CheckOptions {
            prompt_tokens: 4,
            decode_tokens: 4,
            teacher: None,
            build: false,
        },
    )
    .unwrap();
    assert!(r.measured_tps > 0.0);
}
