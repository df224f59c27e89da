//! A batched decode step gives each sequence exactly the logits it gets alone: the committed
//! small models of both families (V4.1 with its shared compressor and indexer, V4.1 with Engram
//! layers, V4-Flash with CSA/HCA compressors and hash-routed layers) and the bundled keep-tiny,
//! with both kernel sets. Sequences sit at different positions (prompts shorter and longer than
//! the sliding window and across compressor groups), each steps through its own cache, and
//! the batch shrinks and grows between steps as a server's does.

use std::path::{Path, PathBuf};

use keep_checkpoint::Checkpoint;
use keep_model::{Cache, Kernels, Logits, Model, ModelError};

/// Batched vs alone: the kernels compute each (row, column) dot by the same instructions
/// whatever M is, so any difference is a bug.
const BATCH_MAX_ABS: f32 = 0.0;

/// Prompt lengths: 1 token, inside the window (12), past it, across many compressor groups.
const PROMPTS: [usize; 6] = [1, 5, 12, 17, 40, 71];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn prompt(n: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + salt * 101 + 11) % vocab) as u32)
        .collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

fn check_model(dir: &Path, kernels: Kernels) {
    let ck = Checkpoint::open(dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.kernels = kernels;
    let vocab = model.cfg.vocab;
    // Each sequence twice: one cache stepped alone, one stepped in the batch.
    let mut alone: Vec<Cache> = vec![];
    let mut batched: Vec<Cache> = vec![];
    let mut next: Vec<u32> = vec![];
    for (s, &n) in PROMPTS.iter().enumerate() {
        let p = prompt(n, s, vocab);
        let mut c = model.new_cache();
        let l = model.forward(&p, &mut c, Logits::Last, None).unwrap();
        next.push(keep_model::generate::argmax(&l));
        alone.push(c.clone());
        batched.push(c);
    }
    // Steps over changing subsets: all, a middle slice, one, all again.
    let subsets: [Vec<usize>; 5] = [
        (0..PROMPTS.len()).collect(),
        vec![1, 2, 4],
        vec![3],
        vec![5, 0, 2],
        (0..PROMPTS.len()).collect(),
    ];
    for (step, set) in subsets.iter().enumerate() {
        let toks: Vec<u32> = set.iter().map(|&i| next[i]).collect();
        let mut refs: Vec<Option<&mut Cache>> = batched.iter_mut().map(Some).collect();
        let mut caches: Vec<&mut Cache> = set.iter().map(|&i| refs[i].take().unwrap()).collect();
        let got = model.forward_batch(&toks, &mut caches).unwrap();
        assert_eq!(got.len(), set.len() * vocab);
        for (r, &i) in set.iter().enumerate() {
            let want = model
                .forward(&[next[i]], &mut alone[i], Logits::Last, None)
                .unwrap();
            let d = max_abs(&got[r * vocab..(r + 1) * vocab], &want);
            assert!(
                d <= BATCH_MAX_ABS,
                "{dir:?} {kernels:?} step {step}, sequence {i}: max |diff| {d}"
            );
            assert_eq!(alone[i].pos, batched[i].pos);
            next[i] = keep_model::generate::argmax(&want);
        }
    }
}

#[test]
fn batched_step_equals_alone_v41() {
    check_model(&root().join("tests/data/small"), Kernels::Exact);
}

#[test]
fn batched_step_equals_alone_v41_fast_kernels() {
    check_model(&root().join("tests/data/small"), Kernels::Fast);
}

#[test]
fn batched_step_equals_alone_engram() {
    check_model(&root().join("tests/data/small-engram"), Kernels::Exact);
}

#[test]
fn batched_step_equals_alone_v4flash() {
    check_model(&root().join("tests/data/small-v4flash"), Kernels::Exact);
    check_model(&root().join("tests/data/small-v4flash"), Kernels::Fast);
}

#[test]
fn batched_step_equals_alone_keep_tiny() {
    let dir = root().join("../../models/keep-tiny");
    check_model(&dir, Kernels::Fast);
}

#[test]
fn a_batch_is_checked_before_any_cache_moves() {
    let ck = Checkpoint::open(&root().join("tests/data/small")).unwrap();
    let model = Model::load(&ck).unwrap();
    let mut a = model.new_cache();
    let mut b = model.new_cache();
    let e = model
        .forward_batch(&[1], &mut [&mut a, &mut b])
        .unwrap_err();
    assert!(matches!(e, ModelError::Cache(_)), "{e}");
    let mut wrong = Cache::new(1);
    let e = model
        .forward_batch(&[1, 2], &mut [&mut a, &mut wrong])
        .unwrap_err();
    assert!(matches!(e, ModelError::Cache(_)), "{e}");
    assert_eq!((a.pos, b.pos), (0, 0));
    let e = model
        .forward_batch(&[model.cfg.vocab as u32], &mut [&mut a])
        .unwrap_err();
    assert!(matches!(e, ModelError::Token { .. }), "{e}");
    assert!(model.forward_batch(&[], &mut []).unwrap().is_empty());
}
