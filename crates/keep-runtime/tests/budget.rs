//! The slot cache against the plain model: logits bit-identical with a budget far below the
//! routed experts' size (every policy, cold and warm), the budget refusal naming the bytes
//! needed, and aligned direct reads at odd offsets (direct and buffered fallback).

mod common;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_runtime::store::read_range;
use keep_runtime::{BudgetPlan, BudgetedModel, Policy, RouteLog, RuntimeError, RuntimeOptions};

/// Prefill `prompt` (all logits), then greedy-decode `steps` tokens; all logits in order.
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

#[test]
fn logits_identical_with_a_small_budget() {
    let dir = tempfile::tempdir().unwrap();
    // 32 experts of which top-k = 4 fit at the least budget: 1/8 of the experts.
    let path = common::synth_tiny(dir.path(), "tiny", Some(32), None);
    let ck = Checkpoint::open(&path).unwrap();
    let plain = Model::load(&ck).unwrap();
    let cfg = plain.cfg.clone();
    let prompt = common::prompt(40, cfg.vocab);
    let want = run_plain(&plain, &prompt, 12);

    // The least budget: top-k slots per layer (4 of 16 experts).
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    let experts_total = probe.cache().store().total_bytes();
    drop(probe);
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    assert!(
        min - residents < experts_total / 4,
        "the budget must be far below the experts' size"
    );

    let routes = dir.path().join("routes.safetensors");
    for (i, policy) in [
        Policy::Lru,
        Policy::Decay { half_life: 4.0 },
        Policy::Static,
    ]
    .into_iter()
    .enumerate()
    {
        for budget in [min, min + 3 * slot * cfg.n_layers as u64] {
            let mut opts = RuntimeOptions::new(budget);
            opts.policy = policy;
            opts.io_threads = 1 + i * 3;
            let mut m = BudgetedModel::load(&ck, &opts).unwrap();
            assert_eq!(
                m.plan().slots_per_layer,
                if budget == min {
                    cfg.top_k
                } else {
                    cfg.top_k + 3
                }
            );
            let got = run_budget(&mut m, &prompt, 12);
            assert!(
                bits(&got) == bits(&want),
                "logits differ under {policy} at budget {budget}"
            );
            let s = m.cache().stats();
            assert!(s.misses > 0 && s.bytes_read > 0, "{s:?}");
            assert!(s.hits + s.misses > 0);
            // Prefill routes to more experts than there are slots, so some are read twice at
            // most once per layer per forward: reads ≤ misses.
            assert!(s.experts_read <= s.misses, "{s:?}");
        }
    }

    // Next-layer guesses read ahead: same logits, and the guesses are scored.
    for budget in [min, min + 4 * slot * cfg.n_layers as u64] {
        let mut opts = RuntimeOptions::new(budget);
        opts.prefetch_next = true;
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        let got = run_budget(&mut m, &prompt, 12);
        assert!(
            bits(&got) == bits(&want),
            "logits differ with next-layer prefetch"
        );
        let g = m.cache().stats().guess;
        assert!(g.passes > 0 && g.routed > 0 && g.right <= g.routed, "{g:?}");
        assert!(g.saved <= g.reads, "{g:?}");
    }

    // Record routes, then warm-start from them: same logits, slots filled before the run.
    let mut log = RouteLog::new();
    {
        let mut m = BudgetedModel::load(&ck, &RuntimeOptions::new(min)).unwrap();
        let mut cache = m.new_cache();
        m.forward(&prompt, &mut cache, Logits::All, Some(&mut log))
            .unwrap();
    }
    assert_eq!(log.tokens(), prompt.len());
    log.write(&routes, "test", cfg.n_experts, false).unwrap();
    for policy in [Policy::Lru, Policy::Static] {
        let mut opts = RuntimeOptions::new(min + slot * cfg.n_layers as u64);
        opts.policy = policy;
        opts.warm_start = Some(routes.clone());
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        assert!(m.cache().stats().warm_bytes > 0);
        assert!(m.cache().resident(0).iter().all(|e| e.is_some()));
        let got = run_budget(&mut m, &prompt, 12);
        assert!(
            bits(&got) == bits(&want),
            "logits differ after a warm start ({policy})"
        );
    }
}

#[test]
fn budget_refusal_names_the_bytes_needed() {
    let dir = tempfile::tempdir().unwrap();
    let path = common::synth_tiny(dir.path(), "tiny", None, None);
    let ck = Checkpoint::open(&path).unwrap();
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let p = probe.plan().clone();
    drop(probe);
    let need = BudgetPlan::minimum(p.fixed(), p.slot_bytes, p.n_layers, p.top_k);
    let err = BudgetedModel::load(&ck, &RuntimeOptions::new(need - 1))
        .err()
        .expect("refused");
    assert!(matches!(err, RuntimeError::BudgetTooSmall { needed, .. } if needed == need));
    let msg = err.to_string();
    assert!(msg.contains(&format!("at least {need} bytes")), "{msg}");
    assert!(BudgetedModel::load(&ck, &RuntimeOptions::new(need)).is_ok());
}

fn check_reads(dir: &std::path::Path) -> bool {
    let path = dir.join("data.bin");
    let data: Vec<u8> = (0..300_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&path, &data).unwrap();
    let cases = [
        (0u64, 1u64),
        (1, 4095),
        (4095, 2),
        (4096, 4096),
        (12_345, 67_891),
        (299_999, 1),
        (290_001, 9_999),
        (0, 300_000),
    ];
    for direct in [true, false] {
        let mut used = vec![];
        for (off, len) in cases {
            let (got, d) = read_range(&path, off, len, direct).unwrap();
            assert_eq!(
                got,
                &data[off as usize..(off + len) as usize],
                "offset {off} len {len}"
            );
            used.push(d);
        }
        // Direct I/O is used for every read or (filesystem refuses it) for none: never a
        // fallback in the middle, e.g. at the end of the file.
        assert!(used.iter().all(|&d| d == used[0]), "{used:?}");
        if !direct {
            assert!(!used[0]);
        }
        // Past the end of the file: an error, not short data.
        assert!(read_range(&path, 299_990, 20, direct).is_err());
    }
    read_range(&path, 1, 1, true).unwrap().1
}

#[test]
fn aligned_reads_at_odd_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let direct = check_reads(dir.path());
    eprintln!("direct I/O in {}: {direct}", dir.path().display());
    // tmpfs (before Linux 6.6) refuses O_DIRECT: the buffered fallback must give the same bytes.
    if std::path::Path::new("/dev/shm").is_dir() {
        if let Ok(d) = tempfile::tempdir_in("/dev/shm") {
            let direct = check_reads(d.path());
            eprintln!("direct I/O in {}: {direct}", d.path().display());
        }
    }
}

#[test]
fn v4flash_hash_layers_prefetched_exactly_with_identical_logits() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, storage) = keep_convert::presets::preset("tiny-v4flash").unwrap();
    let opts = keep_convert::synth::SynthOptions {
        seed: 5,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    let path =
        keep_convert::synth::synth(&cfg, &dir.path().join("v4f"), &opts, &|_, _| {}).unwrap();
    let ck = Checkpoint::open(&path).unwrap();
    let plain = Model::load(&ck).unwrap();
    let cfg = plain.cfg.clone();
    assert_eq!(cfg.hash_layers, 2);
    let prompt = common::prompt(40, cfg.vocab);
    let steps = 10;
    let want = run_plain(&plain, &prompt, steps);
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    for (budget, next) in [(min, false), (min + 2 * slot * cfg.n_layers as u64, true)] {
        let mut opts = RuntimeOptions::new(budget);
        opts.prefetch_next = next;
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        let got = run_budget(&mut m, &prompt, steps);
        assert!(
            bits(&got) == bits(&want),
            "logits differ at budget {budget}"
        );
        let s = m.cache().stats();
        // One exact pass per hash layer per forward (prefill + each decode step).
        assert_eq!(
            s.exact_passes,
            (cfg.hash_layers * (steps + 1)) as u64,
            "{s:?}"
        );
        assert!(
            s.hash_hits + s.hash_misses > 0 && s.hash_misses <= s.misses,
            "{s:?}"
        );
        assert!(s.hash_wait_secs <= s.wait_secs, "{s:?}");
    }
}
