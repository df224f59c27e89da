//! Precision tiers at run time: a tiny synthetic model quantized to E8P2+E81 (every routed
//! expert a base stage and a residual stage), run under a memory budget with the residual
//! stages read apart into the residual cache. A store that holds every residual read until the
//! test lets it through changes the serving mix (no slot is upper while the reads are held) but
//! never stalls the forward, and the logits are then exactly the base model's; a τ above every
//! gate weight gives exactly the base model's logits; once the reads are through, upper slots
//! are served and the logits change.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;
use keep_runtime::{BudgetedModel, ReadGate, RuntimeOptions, TierOptions};

/// `src` without its residual stages (`*.resid.*`): the base model.
fn strip_residuals(src: &Path, out: &Path) -> PathBuf {
    let ck = Checkpoint::open(src).unwrap();
    let keep: Vec<_> = ck
        .tensors()
        .filter(|t| !t.name.contains(".resid."))
        .collect();
    let metas: Vec<TensorMeta> = keep
        .iter()
        .map(|t| TensorMeta::new(t.name, t.dtype, t.shape))
        .collect();
    let mut w = CheckpointWriter::create(out, metas, WriterOptions::default()).unwrap();
    for t in &keep {
        w.write_tensor(t.name, t.bytes).unwrap();
    }
    w.copy_file("config.json", &src.join("config.json"))
        .unwrap();
    w.finish().unwrap()
}

/// The tiny preset (32 experts) quantized to E8P2+E81, and its base model.
fn models(dir: &Path) -> (PathBuf, PathBuf) {
    let (_, q, base) = models_and_original(dir);
    (q, base)
}

/// The tiny preset (32 experts), it quantized to E8P2+E81, and the latter's base model.
fn models_and_original(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let src = common::synth_tiny(dir, "tiny", Some(32), None);
    let im = common::flat_imatrix(&src, dir);
    let q = dir.join("q");
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: ExpertSelection::All,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    quantize(&src, &im, &q, &opts, &|_, _| {}).unwrap();
    let base = strip_residuals(&q, &dir.join("base"));
    (src, q, base)
}

fn run_plain(model: &Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut out = vec![model
        .forward(prompt, &mut cache, Logits::All, None)
        .unwrap()];
    let v = model.cfg.vocab;
    let mut tok = argmax(&out[0][out[0].len() - v..]);
    for _ in 0..steps {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        tok = argmax(&l);
        out.push(l);
    }
    out
}

fn run_budget(model: &mut BudgetedModel, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut out = vec![model
        .forward(prompt, &mut cache, Logits::All, None)
        .unwrap()];
    let v = model.cfg().vocab;
    let mut tok = argmax(&out[0][out[0].len() - v..]);
    for _ in 0..steps {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        tok = argmax(&l);
        out.push(l);
    }
    out
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// A budget with 8 slots per layer (of 32 experts) and a residual cache of `cache` bytes.
fn tiered(ck: &Checkpoint, tau: f32, cache: u64) -> BudgetedModel<'_> {
    tiered_with(
        ck,
        TierOptions {
            tau,
            alloc: None,
            residual_cache: cache,
            io_threads: 2,
            upper_from: None,
        },
    )
}

/// [`tiered`] with these tier options.
fn tiered_with(ck: &Checkpoint, t: TierOptions) -> BudgetedModel<'_> {
    let probe = BudgetedModel::load(
        ck,
        &RuntimeOptions {
            tiers: Some(t.clone()),
            ..RuntimeOptions::new(u64::MAX / 4)
        },
    )
    .unwrap();
    let p = probe.plan().clone();
    drop(probe);
    // `fixed` already holds the residual cache.
    let budget = p.fixed() + 8 * p.n_layers as u64 * p.slot_bytes;
    BudgetedModel::load(
        ck,
        &RuntimeOptions {
            tiers: Some(t),
            ..RuntimeOptions::new(budget)
        },
    )
    .unwrap()
}

/// An allocation of `src` giving every routed expert `rung`.
fn alloc_all(src: &Path, rung: &str) -> keep_artifacts::alloc::Alloc {
    use keep_artifacts::alloc::{Alloc, LayerAlloc};
    let c = Checkpoint::open(src)
        .unwrap()
        .require_config()
        .unwrap()
        .clone();
    Alloc {
        format: Alloc::FORMAT.into(),
        version: Alloc::VERSION,
        model: src.display().to_string(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(src).unwrap(),
        budget_bytes: 1,
        bytes: 1,
        rungs: vec![],
        solver: "test".into(),
        grain_bytes: 1,
        predicted_loss: 0.0,
        saliency: "reap".into(),
        layers: (0..c.num_hidden_layers)
            .map(|l| LayerAlloc {
                layer: l,
                rungs: vec![rung.to_string(); c.experts_in_layer(l)],
            })
            .collect(),
        extra: Default::default(),
    }
}

/// Run until a pass admits nothing (every stage its routes want is in memory), waiting for the
/// reads between passes; returns the logits of that last pass.
fn warm_until_every_stage_is_in_memory(
    m: &mut BudgetedModel,
    prompt: &[u32],
    steps: usize,
) -> Vec<Vec<u32>> {
    loop {
        run_budget(m, prompt, steps);
        while {
            let t = m.cache().tier_stats().unwrap();
            t.reads_done + t.failed < t.admissions
        } {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        m.cache().reset_stats();
        let got = bits(&run_budget(m, prompt, steps));
        let t = m.cache().tier_stats().unwrap();
        assert_eq!(t.failed, 0, "{t:?}");
        if t.admissions == 0 {
            assert_eq!(t.base, 0, "{t:?}");
            return got;
        }
    }
}

#[test]
fn held_residual_reads_never_stall_and_tau_above_every_gate_is_the_base_model() {
    let dir = tempfile::tempdir().unwrap();
    let (q, base) = models(dir.path());
    let qck = Checkpoint::open(&q).unwrap();
    let bck = Checkpoint::open(&base).unwrap();
    let plain_base = Model::load(&bck).unwrap();
    let plain_full = Model::load(&qck).unwrap();
    let prompt = common::prompt(12, plain_base.cfg.vocab);
    let steps = 8;
    let want_base = bits(&run_plain(&plain_base, &prompt, steps));
    let want_full = bits(&run_plain(&plain_full, &prompt, steps));
    assert_ne!(
        want_base, want_full,
        "the residual stages change the logits"
    );

    // τ above every gate weight: no slot wants its upper stage; exactly the base model.
    let mut m = tiered(&qck, f32::INFINITY, 1 << 20);
    assert!(m.cache().store().experts_with_upper() > 0);
    assert_eq!(bits(&run_budget(&mut m, &prompt, steps)), want_base);
    let t = m.cache().tier_stats().unwrap();
    assert_eq!((t.upper, t.admissions, t.above_tau), (0, 0, 0));
    assert!(t.base > 0);
    drop(m);

    // τ = 0: every slot wants its upper stage, but every residual read is held. The run
    // finishes (it never waits for one), serves every slot at the base rung, and its logits are
    // the base model's.
    let cache = 64 << 20;
    let mut m = tiered(&qck, 0.0, cache);
    let gate = Arc::new(ReadGate::new());
    m.cache().store().hold_upper_reads(gate.clone());
    let got = bits(&run_budget(&mut m, &prompt, steps));
    let t = m.cache().tier_stats().unwrap();
    assert_eq!(got, want_base);
    assert_eq!(t.upper, 0);
    assert!(t.admissions > 0 && t.upper_misses == t.base, "{t:?}");
    assert!(
        t.in_flight > 0,
        "later slots found their stage still being read: {t:?}"
    );
    assert_eq!(
        t.reads_done, 0,
        "the held reads cannot have finished: {t:?}"
    );
    assert_eq!(t.wait_secs, 0.0);

    // Let the reads through and wait for them (outside any forward); the next run serves the
    // stages in memory at the upper rung, and its logits move away from the base model's.
    gate.open();
    while {
        let t = m.cache().tier_stats().unwrap();
        t.reads_done + t.failed < t.admissions
    } {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let t0 = m.cache().tier_stats().unwrap();
    assert_eq!(t0.failed, 0);
    let again = bits(&run_budget(&mut m, &prompt, steps));
    let t = m.cache().tier_stats().unwrap();
    assert!(t.upper > t0.upper, "{t:?}");
    assert_ne!(again, want_base);
    assert!(t.cached_bytes <= cache);
}

#[test]
fn every_stage_in_memory_gives_the_full_rung() {
    // A residual cache holding every stage, τ = 0: after one warming pass and its reads, a run
    // whose every stage is in memory computes every slot at the upper rung — exactly the full
    // E8P2+E81 model.
    let dir = tempfile::tempdir().unwrap();
    let (q, _) = models(dir.path());
    let qck = Checkpoint::open(&q).unwrap();
    let plain_full = Model::load(&qck).unwrap();
    let prompt = common::prompt(12, plain_full.cfg.vocab);
    let want_full = bits(&run_plain(&plain_full, &prompt, 4));
    let mut m = tiered(&qck, 0.0, 256 << 20);
    let total = m.cache().store().upper_total_bytes();
    assert!(total > 0 && total < 128 << 20);
    // Warm: every expert of every layer routed once is admitted; repeat until nothing new.
    loop {
        run_budget(&mut m, &prompt, 4);
        while {
            let t = m.cache().tier_stats().unwrap();
            t.reads_done + t.failed < t.admissions
        } {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        m.cache().reset_stats();
        let got = bits(&run_budget(&mut m, &prompt, 4));
        let t = m.cache().tier_stats().unwrap();
        if t.admissions == 0 {
            assert_eq!(t.base, 0, "{t:?}");
            assert_eq!(got, want_full);
            break;
        }
    }
}

#[test]
fn every_shipped_stage_in_memory_gives_the_original_model() {
    // Every expert allocated `e8p2+e81` (its residual in its slot) with the original checkpoint
    // as --upper-from, τ = 0: once every shipped stage is in the residual cache, every slot is
    // computed with the original expert — exactly the original model's logits. Without the
    // original, no expert has an upper stage.
    let dir = tempfile::tempdir().unwrap();
    let (src, q, _) = models_and_original(dir.path());
    let qck = Checkpoint::open(&q).unwrap();
    let sck = Checkpoint::open(&src).unwrap();
    let original = Model::load(&sck).unwrap();
    let quantized = Model::load(&qck).unwrap();
    let prompt = common::prompt(12, original.cfg.vocab);
    let want = bits(&run_plain(&original, &prompt, 4));
    assert_ne!(want, bits(&run_plain(&quantized, &prompt, 4)));
    let alloc = Arc::new(alloc_all(&src, "e8p2+e81"));
    let opts = |upper_from: Option<PathBuf>| TierOptions {
        tau: 0.0,
        alloc: Some(alloc.clone()),
        residual_cache: 256 << 20,
        io_threads: 2,
        upper_from,
    };
    let m = tiered_with(&qck, opts(None));
    assert_eq!(m.cache().store().experts_with_upper(), 0);
    drop(m);
    let mut m = tiered_with(&qck, opts(Some(src.clone())));
    let st = m.cache().store();
    let c = &m.cfg().clone();
    assert_eq!(st.experts_with_upper(), c.n_layers * c.n_experts);
    assert_eq!(st.experts_with_shipped_upper(), c.n_layers * c.n_experts);
    let got = warm_until_every_stage_is_in_memory(&mut m, &prompt, 4);
    assert_eq!(got, want);
}

#[test]
fn an_upper_from_that_is_not_the_original_is_refused_naming_the_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let (src, q, _) = models_and_original(dir.path());
    let qck = Checkpoint::open(&q).unwrap();
    let load = |alloc: Option<keep_artifacts::alloc::Alloc>, upper_from: &Path| {
        BudgetedModel::load(
            &qck,
            &RuntimeOptions {
                tiers: Some(TierOptions {
                    tau: 0.0,
                    alloc: alloc.map(Arc::new),
                    residual_cache: 1 << 20,
                    io_threads: 1,
                    upper_from: Some(upper_from.to_path_buf()),
                }),
                ..RuntimeOptions::new(u64::MAX / 4)
            },
        )
        .err()
        .map(|e| e.to_string())
    };
    // Another model than the allocation's: its fingerprint.
    let other = common::synth_tiny(dir.path(), "other", Some(16), None);
    let msg = load(Some(alloc_all(&src, "e8p2+e81")), &other).unwrap();
    assert!(
        msg.contains("fingerprint") && msg.contains("--upper-from"),
        "{msg}"
    );
    // Without an allocation to check it against: its expert count, then its expert width.
    let msg = load(None, &other).unwrap();
    assert!(msg.contains("layer 0 has 16 routed experts"), "{msg}");
    let wide = common::synth_tiny(dir.path(), "wide", Some(32), Some(128));
    let msg = load(None, &wide).unwrap();
    assert!(msg.contains("expert width"), "{msg}");
    // The original itself is accepted either way.
    assert_eq!(load(Some(alloc_all(&src, "e8p2+e81")), &src), None);
}
