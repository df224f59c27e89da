//! `keep fit` on a checkpoint of mixed precision rungs with Engram layers (`keep synth` of the
//! bundled model's config with Engram tables, half of its experts coded at E8P2+E81 as `keep quant --alloc`
//! writes them, the others left as shipped, so that experts differ in bytes): the hot set a plan
//! predicts is the one `keep fit --check` runs the plan with, at a budget where the default
//! Engram row cache takes its share of what the slots would otherwise get, and at the budget in
//! which every expert has a slot. No timing is asserted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_artifacts::fit_plan::Memory;
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, DeepSeekConfig, Dtype};
use keep_convert::presets::Storage;
use keep_convert::synth::{synth, with_engram_bytes, SynthOptions};
use keep_fit::check::{check, CheckOptions};
use keep_fit::probe::{slot_needs, ProbeOptions};
use keep_fit::{fit, FitOptions};
use keep_model::{Kernels, ModelConfig};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions, PARTS};
use keep_quant::QuantFormat;

/// A synthetic checkpoint of the bundled model's config (`keep synth --config`) with about
/// `engram` bytes of Engram tables.
fn tiny_engram(dir: &Path, engram: u64) -> PathBuf {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny/config.json");
    let mut cfg = DeepSeekConfig::read(&config).unwrap();
    with_engram_bytes(&mut cfg, engram).unwrap();
    let opts = SynthOptions {
        seed: 11,
        storage: Storage {
            block: cfg.weight_block_size().unwrap_or((32, 32)),
            ..Storage::V41
        },
        force: true,
        max_shard_bytes: 64 << 20,
    };
    synth(&cfg, &dir.join("tiny-engram"), &opts, &|_, _| {}).unwrap()
}

/// An imatrix of ones for every routed expert projection of `model`.
fn imatrix(model: &Path, dir: &Path) -> PathBuf {
    let ck = Checkpoint::open(model).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut metas = vec![];
    for l in 0..cfg.num_hidden_layers {
        for e in 0..cfg.experts_in_layer(l) {
            for p in PARTS {
                let cols = if p == "w2" {
                    cfg.moe_intermediate_size
                } else {
                    cfg.hidden_size
                };
                metas.push(TensorMeta::new(
                    format!("imatrix.{l}.ffn.experts.{e}.{p}"),
                    Dtype::F32,
                    &[cols as u64],
                ));
            }
        }
    }
    let out = dir.join("im");
    let mut w = CheckpointWriter::create(
        &out,
        metas.clone(),
        WriterOptions {
            shard_metadata: BTreeMap::from([("format".into(), "keep-imatrix".into())]),
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for m in &metas {
        let ones: Vec<u8> = (0..m.shape[0]).flat_map(|_| 1f32.to_le_bytes()).collect();
        w.write_tensor(&m.name, &ones).unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}

/// `model` with its even experts of every layer at E8P2+E81 and its odd ones as shipped (what
/// `keep quant --alloc` writes for such an allocation).
fn mixed_rungs(model: &Path, dir: &Path) -> PathBuf {
    let ck = Checkpoint::open(model).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut per = BTreeMap::new();
    for l in 0..cfg.num_hidden_layers {
        for e in (0..cfg.experts_in_layer(l)).step_by(2) {
            per.insert((l, e), QuantFormat::E8p2E81);
        }
    }
    let out = dir.join("mixed");
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: ExpertSelection::PerExpert(per),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    quantize(model, &imatrix(model, dir), &out, &opts, &|_, _| {}).unwrap();
    out
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

fn options(model: &Path, bytes: u64, out: PathBuf) -> FitOptions {
    FitOptions {
        model: model.to_path_buf(),
        memory: Memory {
            bytes,
            auto: false,
            available: None,
            margin: 0,
        },
        run: None,
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

/// Fit `model` into `bytes`, run the plan as `keep fit --check` does, and return the plan's hot
/// set and the slots per layer the run had.
fn planned_and_run(model: &Path, bytes: u64, out: PathBuf) -> (usize, usize) {
    let o = fit(&options(model, bytes, out.clone())).unwrap();
    keep_fit::search::write(&o, &out, false).unwrap();
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
    (o.plan.hot_set, r.slots_per_layer.expect("a budgeted run"))
}

#[test]
fn a_plans_hot_set_is_the_runs_on_mixed_rungs_with_engram_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let model = mixed_rungs(&tiny_engram(dir, 4 << 20), dir);
    let ck = Checkpoint::open(&model).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    assert!(cfg.engram.is_some(), "the checkpoint has Engram layers");
    let (n, k, l) = (cfg.n_experts, cfg.top_k, cfg.n_layers);

    // The experts are at two rungs of different sizes; every slot holds the largest.
    let store = keep_runtime::ExpertStore::open(&ck, &cfg, true).unwrap();
    let layouts: Vec<_> = (0..l)
        .flat_map(|x| (0..n).map(move |e| (x, e)))
        .map(|(x, e)| store.layout(x, e).unwrap())
        .collect();
    let rung = |even: bool| -> Vec<u64> {
        layouts
            .iter()
            .enumerate()
            .filter(|(i, _)| (i % n % 2 == 0) == even)
            .map(|(_, x)| x.bytes)
            .collect()
    };
    let (coded, shipped) = (rung(true), rung(false));
    assert!(
        coded.iter().max() < shipped.iter().min(),
        "E8P2+E81 experts {coded:?} bytes, shipped {shipped:?}"
    );
    let large = layouts.iter().map(|x| x.slot_bytes).max().unwrap();
    assert_eq!(store.slot_bytes(), large);
    let needs = slot_needs(&ck, &probe_opts()).unwrap();
    assert_eq!(needs.slot_bytes, large);

    // Room for every expert's slot beside the least budget, but not for the Engram row cache
    // too: the runtime gives the row cache its share and the slots what is left.
    let short = needs.minimum() + (n - k) as u64 * l as u64 * large;
    let (planned, ran) = planned_and_run(&model, short, dir.join("short.json"));
    assert_eq!(
        planned, ran,
        "keep fit planned a hot set of {planned} experts per layer, the run holds {ran} slots"
    );
    assert!(k <= ran && ran < n, "{ran} slots of {n}");

    // The budget in which every expert has a slot (the row cache whole beside them).
    let all = needs.every_expert();
    let (planned, ran) = planned_and_run(&model, all, dir.join("all.json"));
    assert_eq!((planned, ran), (n, n));
}
