//! keep-model's MTP module against a committed reference (no Python needed):
//! `tests/data/small-v4flash-mtp` (two layers: window-only hash-routed, CSA; `mtp.0.*` as
//! `keep synth` writes it; 128×128 E8M0 FP8 blocks) and `tools/oracle/mtp_ref.py`'s logits on it
//! (`small-v4flash-mtp-ref.safetensors`: transformers 5.23's decoder layer for the block, the
//! wrapper transcribed from DeepSeek's `inference/model.py`); plus the module run row by row
//! with its cache equals one pass over all rows bit for bit.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::{Logits, Model, Mtp};
use safetensors::SafeTensors;

/// Largest |logit difference| from the reference: keep and torch sum in different f32 orders
/// (achieved 2.1e-6).
const MAX_ABS_DIFF: f32 = 2e-5;
/// Row by row vs one pass: every row is computed the same way whatever the batch.
const DECODE_VS_PREFILL_MAX_ABS: f32 = 0.0;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

fn f32s(t: &safetensors::tensor::TensorView) -> Vec<f32> {
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn mtp_logits_match_the_reference() {
    let ck = Checkpoint::open(&data().join("small-v4flash-mtp")).unwrap();
    let model = Model::load(&ck).unwrap();
    let mtp = Mtp::load(&ck, &model.cfg)
        .unwrap()
        .expect("mtp.0.* present");
    let bytes = std::fs::read(data().join("small-v4flash-mtp-ref.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens: Vec<u32> = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect();
    let want = f32s(&st.tensor("mtp_logits").unwrap());
    let got = mtp.prefill_logits(&model, &tokens).unwrap();
    assert_eq!(got.len(), want.len());
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d <= MAX_ABS_DIFF, "max |diff| {d}");

    // Row by row through the module's cache (as drafting feeds it) equals the one pass.
    let mut cache = model.new_cache();
    let (_, s) = model
        .forward_streams(&tokens, &mut cache, Logits::None, None)
        .unwrap();
    let mut mc = mtp.new_cache();
    let vocab = model.cfg.vocab;
    for i in 0..tokens.len() - 1 {
        let (row, _) = mtp
            .forward(
                &s.rows(i, i + 1),
                &tokens[i + 1..i + 2],
                &mut mc,
                Logits::Last,
            )
            .unwrap();
        let d = row
            .iter()
            .zip(&got[i * vocab..(i + 1) * vocab])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= DECODE_VS_PREFILL_MAX_ABS, "row {i}: max |diff| {d}");
    }
}

#[test]
fn a_checkpoint_without_mtp_has_no_module() {
    let ck = Checkpoint::open(&data().join("small-v4flash")).unwrap();
    let model = Model::load(&ck).unwrap();
    assert!(Mtp::load(&ck, &model.cfg).unwrap().is_none());
    assert!(!keep_model::mtp::present(&ck));
}
