//! The bundled trained model (`models/keep-tiny`, or `KEEP_TINY_DIR`) with a budget far below
//! its routed experts' size: logits bit-identical to the plain model's, prefill and greedy
//! decode. Skips (with a note) when the model is not in the tree.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_runtime::{BudgetPlan, BudgetedModel, Policy, RuntimeOptions};

fn model_dir() -> Option<PathBuf> {
    let p = std::env::var_os("KEEP_TINY_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
        });
    p.join("config.json").is_file().then_some(p)
}

#[test]
fn bundled_model_logits_identical_under_a_small_budget() {
    let Some(dir) = model_dir() else {
        eprintln!("models/keep-tiny is not here: skipped");
        return;
    };
    let ck = Checkpoint::open(&dir).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let prompt: Vec<u32> = (0..48u32).map(|i| (i * 97 + 13) % v as u32).collect();
    let mut want = vec![];
    let mut cache = plain.new_cache();
    let l = plain
        .forward(&prompt, &mut cache, Logits::All, None)
        .unwrap();
    let mut tok = argmax(&l[l.len() - v..]);
    want.push(l);
    for _ in 0..16 {
        let l = plain
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        tok = argmax(&l);
        want.push(l);
    }

    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let p = probe.plan().clone();
    let experts = probe.cache().store().total_bytes();
    drop(probe);
    let min = BudgetPlan::minimum(p.fixed(), p.slot_bytes, p.n_layers, p.top_k);
    assert!(
        min - p.fixed() < experts / 4,
        "slots must be far below the experts' size"
    );
    for policy in [
        Policy::Lru,
        Policy::Decay { half_life: 8.0 },
        Policy::Static,
    ] {
        let mut opts = RuntimeOptions::new(min);
        opts.policy = policy;
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        let mut cache = m.new_cache();
        let l = m.forward(&prompt, &mut cache, Logits::All, None).unwrap();
        let mut tok = argmax(&l[l.len() - v..]);
        let mut got = vec![l];
        for _ in 0..16 {
            let l = m.forward(&[tok], &mut cache, Logits::Last, None).unwrap();
            tok = argmax(&l);
            got.push(l);
        }
        for (a, b) in got.iter().zip(&want) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "logits differ under {policy}"
            );
        }
        let s = m.cache().stats();
        assert!(s.misses > 0 && s.bytes_read > 0);
    }
}

/// A batched decode step under the smallest budget (fewer slots per layer than the batch's
/// expert union: the union goes through the slot cache in chunks) gives every sequence the
/// plain model's logits alone, bit for bit.
#[test]
fn bundled_model_batched_step_identical_under_a_small_budget() {
    use keep_model::{Cache, Generate};
    let Some(dir) = model_dir() else {
        eprintln!("models/keep-tiny is not here: skipped");
        return;
    };
    let ck = Checkpoint::open(&dir).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let p = probe.plan().clone();
    drop(probe);
    let min = BudgetPlan::minimum(p.fixed(), p.slot_bytes, p.n_layers, p.top_k);
    let mut m = BudgetedModel::load(&ck, &RuntimeOptions::new(min)).unwrap();
    let lens = [3usize, 9, 20, 33, 70, 5];
    let mut alone: Vec<Cache> = vec![];
    let mut batched: Vec<Cache> = vec![];
    let mut next = vec![];
    for (s, &n) in lens.iter().enumerate() {
        let prompt: Vec<u32> = (0..n as u32)
            .map(|i| (i * 97 + 13 + s as u32 * 31) % v as u32)
            .collect();
        let mut c = plain.new_cache();
        let l = plain.forward(&prompt, &mut c, Logits::Last, None).unwrap();
        next.push(argmax(&l));
        alone.push(c);
        let mut c = m.new_cache();
        m.forward(&prompt, &mut c, Logits::None, None).unwrap();
        batched.push(c);
    }
    for step in 0..6 {
        let mut refs: Vec<&mut Cache> = batched.iter_mut().collect();
        let got = m.forward_batch(&next, &mut refs).unwrap();
        for i in 0..lens.len() {
            let want = plain
                .forward(&[next[i]], &mut alone[i], Logits::Last, None)
                .unwrap();
            assert!(
                got[i * v..(i + 1) * v]
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "step {step}, sequence {i}: logits differ"
            );
            next[i] = argmax(&want);
        }
    }
    assert!(m.cache().stats().misses > 0);
}
