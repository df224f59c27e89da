//! keep-model's DSpark drafter against a committed reference (no Python needed):
//! `fixtures/dspark/model` is a random small DSpark module under the published tensor names
//! (`tools/oracle/dspark_synth.py`: hidden 22, 4 heads of 10 in 2 groups, 3 streams, 5 experts
//! with 2 active, Markov rank 6, vocabulary 41, a 6-row window, three stages), and
//! `fixtures/dspark/{inputs,expected}.safetensors` are `tools/oracle/dspark_ref.py fixture`'s
//! inputs (9 context rows of target features at positions 17..=25, the first token) and its
//! outputs (the projected window, every stage's streams and pre-mix, the collapsed and normed
//! rows, base and Markov-corrected logits, confidence logits, greedy draft tokens).

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::{DSpark, ModelConfig};
use safetensors::SafeTensors;

/// Largest |difference| from the reference, relative to the largest |reference value| of the
/// tensor (at least 1): keep and torch sum in different f32 orders, and torch rotates with a
/// complex multiply where keep uses sin/cos (achieved: under 2e-6).
const MAX_REL_DIFF: f32 = 1e-5;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/dspark")
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn i32s(st: &SafeTensors, name: &str) -> Vec<i32> {
    st.tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    let d = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        d <= MAX_REL_DIFF * scale,
        "{what}: max |diff| {d} against max |value| {scale}"
    );
}

#[test]
fn dspark_block_matches_the_reference() {
    let ck = Checkpoint::open(&fixtures().join("model")).unwrap();
    let cfg = ModelConfig::from_deepseek(ck.require_config().unwrap()).unwrap();
    let ds = DSpark::load(&ck, &cfg)
        .unwrap()
        .expect("the config declares DSpark");
    assert_eq!(ds.block_size(), 5);

    let inputs = std::fs::read(fixtures().join("inputs.safetensors")).unwrap();
    let inputs = SafeTensors::deserialize(&inputs).unwrap();
    let expected = std::fs::read(fixtures().join("expected.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&expected).unwrap();

    let features = f32s(&inputs, "target_hidden");
    let rows = features.len() / (cfg.dim * ds.keys.target_layer_ids.len());
    let first = i32s(&inputs, "first_token")[0] as u32;
    let start = i32s(&inputs, "start_pos")[0] as usize;
    let context = ds.project(&features, rows).unwrap();
    // The reference keeps the window's rows only.
    let window = rows.min(cfg.window);
    assert_close(
        "main_x",
        &context[(rows - window) * cfg.dim..],
        &f32s(&want, "main_x"),
    );

    let block = ds.draft(&context, rows, start + rows - 1, first).unwrap();
    for (k, s) in block.stages.iter().enumerate() {
        assert_close(
            &format!("stage{k}.streams"),
            &s.x,
            &f32s(&want, &format!("stage{k}.streams")),
        );
        assert_close(
            &format!("stage{k}.pre_mix"),
            &s.pre_mix,
            &f32s(&want, &format!("stage{k}.pre_mix")),
        );
    }
    assert_close("hidden", &block.hidden, &f32s(&want, "hidden"));
    assert_close("normed", &block.normed, &f32s(&want, "normed"));
    assert_close(
        "base_logits",
        &block.base_logits,
        &f32s(&want, "base_logits"),
    );
    assert_close(
        "draft_logits",
        &block.draft_logits,
        &f32s(&want, "draft_logits"),
    );
    assert_close("confidence", &block.confidence, &f32s(&want, "confidence"));
    let tokens: Vec<u32> = i32s(&want, "draft_tokens")
        .iter()
        .map(|&t| t as u32)
        .collect();
    assert_eq!(block.tokens, tokens, "greedy draft tokens");
}

#[test]
fn dspark_inputs_are_checked() {
    let ck = Checkpoint::open(&fixtures().join("model")).unwrap();
    let cfg = ModelConfig::from_deepseek(ck.require_config().unwrap()).unwrap();
    let ds = DSpark::load(&ck, &cfg).unwrap().unwrap();
    let d = cfg.dim;
    // Features of the wrong width, a context longer than the positions before the anchor, and
    // a first token outside the vocabulary are refused, not run.
    assert!(ds.project(&vec![0.0; 2 * d], 1).is_err());
    assert_eq!(ds.project(&vec![0.0; 3 * d], 1).unwrap().len(), d);
    let ctx = vec![0.5f32; 4 * d];
    let e = ds.draft(&ctx, 4, 2, 1).unwrap_err();
    assert!(e.to_string().contains("DSpark context"), "{e}");
    let e = ds.draft(&ctx, 4, 10, cfg.vocab as u32).unwrap_err();
    assert!(e.to_string().contains(&cfg.vocab.to_string()), "{e}");
}
