//! Chunked prefill gives the logits of one pass bit for bit: the committed small models of both
//! families (V4.1 with its shared compressor and indexer, V4.1 with Engram layers, V4-Flash with
//! CSA/HCA compressors, its indexer and hash-routed layers) run a prompt longer than their
//! sliding window (12) and several compressor groups at chunk sizes that straddle the
//! compress ratios (1, 2, 4, 8) and the window; the layer-streamed path chunks the same way;
//! decode after a chunked prefill equals decode after one pass. Prompts past
//! `max_position_embeddings` are refused.

use std::path::{Path, PathBuf};

use keep_checkpoint::Checkpoint;
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{Kernels, Logits, Model, ModelError};

/// Chunked vs one pass: every row is computed by the same instructions whatever the batch and
/// a chunk continues from the cache as a decode step does (any difference is a bug).
const CHUNKED_MAX_ABS: f32 = 0.0;

/// Prompt length: past the window and many compressor groups of every ratio.
const PROMPT: usize = 150;

/// Chunk sizes: 1 (decode), around the ratios 2, 4 and 8, around the window 12, and odd sizes
/// whose boundaries fall inside groups and windows.
const CHUNKS: [usize; 10] = [1, 3, 4, 5, 7, 8, 12, 13, 29, 64];

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 37 + 11) % vocab) as u32).collect()
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
    let toks = prompt(PROMPT, model.cfg.vocab);
    model.opts.prefill_chunk = PROMPT;
    let mut cache = model.new_cache();
    let whole = model.forward(&toks, &mut cache, Logits::All, None).unwrap();
    let next = model.forward(&[5], &mut cache, Logits::Last, None).unwrap();
    for &chunk in &CHUNKS {
        model.opts.prefill_chunk = chunk;
        let mut c = model.new_cache();
        let all = model.forward(&toks, &mut c, Logits::All, None).unwrap();
        let d = max_abs(&whole, &all);
        assert!(
            d <= CHUNKED_MAX_ABS,
            "{dir:?} chunk {chunk}: max |diff| {d}"
        );
        let after = model.forward(&[5], &mut c, Logits::Last, None).unwrap();
        assert_eq!(
            after, next,
            "{dir:?} chunk {chunk}: decode after the prefill"
        );
        let mut c = keep_model::Cache::for_context(&model.cfg, PROMPT + 1, model.opts.chunk());
        let last = model.forward(&toks, &mut c, Logits::Last, None).unwrap();
        assert_eq!(
            last[..],
            whole[(PROMPT - 1) * model.cfg.vocab..],
            "{dir:?} chunk {chunk}"
        );
    }
}

#[test]
fn chunked_prefill_equals_one_pass_v41() {
    check_model(&data().join("small"), Kernels::Exact);
}

#[test]
fn chunked_prefill_equals_one_pass_v41_fast_kernels() {
    check_model(&data().join("small"), Kernels::Fast);
}

#[test]
fn chunked_prefill_equals_one_pass_engram() {
    check_model(&data().join("small-engram"), Kernels::Exact);
}

#[test]
fn chunked_prefill_equals_one_pass_v4flash() {
    check_model(&data().join("small-v4flash"), Kernels::Exact);
}

/// The layer-streamed path chunks each record inside each layer and still equals the whole
/// model, for records shorter and longer than a chunk.
#[test]
fn streamed_chunks_equal_the_whole_model() {
    for name in ["small", "small-engram", "small-v4flash"] {
        let dir = data().join(name);
        let ck = Checkpoint::open(&dir).unwrap();
        let mut model = Model::load(&ck).unwrap();
        model.opts.prefill_chunk = PROMPT;
        let vocab = model.cfg.vocab;
        let recs = vec![prompt(PROMPT, vocab), prompt(9, vocab), prompt(61, vocab)];
        let want: Vec<Vec<f32>> = recs
            .iter()
            .map(|r| {
                let mut c = model.new_cache();
                model.forward(r, &mut c, Logits::All, None).unwrap()
            })
            .collect();
        // The streamed path reads the chunk from the checkpoint's config: write a copy whose
        // run uses small chunks by setting them through the options' config override.
        for chunk in [5, 12, 64] {
            let opts = StreamOptions {
                logits: Logits::All,
                prefill_chunk: Some(chunk),
                ..Default::default()
            };
            let got = forward_streamed(&ck, &recs, opts, None).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let d = max_abs(g, w);
                assert!(
                    d <= CHUNKED_MAX_ABS,
                    "{name} record {i} chunk {chunk}: max |diff| {d}"
                );
            }
        }
    }
}

/// A copy of `small` whose config allows `positions` positions.
fn with_positions(dir: &Path, positions: usize) {
    let src = data().join("small");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(positions);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

#[test]
fn prompts_past_the_context_are_refused() {
    let td = tempfile::tempdir().unwrap();
    with_positions(td.path(), 40);
    let ck = Checkpoint::open(td.path()).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.prefill_chunk = 16;
    let toks = prompt(41, model.cfg.vocab);
    let mut c = model.new_cache();
    let e = model
        .forward(&toks, &mut c, Logits::Last, None)
        .unwrap_err();
    assert!(matches!(e, ModelError::Context(_)), "{e}");
    assert!(e.to_string().contains("max_position_embeddings"), "{e}");
    assert_eq!(c.pos, 0, "refused before anything ran");
    // Exactly the context runs; one more decode step is refused.
    model
        .forward(&toks[..40], &mut c, Logits::Last, None)
        .unwrap();
    let e = model.forward(&[1], &mut c, Logits::Last, None).unwrap_err();
    assert!(matches!(e, ModelError::Context(_)), "{e}");
    let recs = vec![toks.clone()];
    let e = forward_streamed(&ck, &recs, StreamOptions::default(), None).unwrap_err();
    assert!(matches!(e, ModelError::Context(_)), "{e}");
}
