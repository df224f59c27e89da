//! The budgeted runtime on a gpt-oss checkpoint (`fixtures/gpt-oss`: each layer's experts in
//! OpenAI's MXFP4 stacks, `gate_up_proj_*` with gate and up rows interleaved and `down_proj_*`):
//! the expert store reads each expert as its slices of the stacks, unconverted, and a budget of
//! top-k slots per layer decodes the same logits as the whole model, bit for bit.

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_runtime::{BudgetPlan, BudgetedModel, Policy, RuntimeOptions};

fn fixture() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gpt-oss")
}

#[test]
fn budgeted_decode_equals_the_whole_model() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let model = Model::load(&ck).unwrap();
    let cfg = model.cfg.clone();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 13 + 5) % 67).collect();
    // The least budget: top-k slots per layer (2 of 4 experts), so experts are read again.
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    // One expert's slot holds its gate-up and down slices: 64x64 + 64x32 FP4 weights with
    // one scale byte per 32.
    assert!(slot >= 64 * 96 / 2 + 64 * 96 / 32, "slot {slot}");
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    let mut opts = RuntimeOptions::new(min);
    opts.policy = Policy::Lru;
    let mut bm = BudgetedModel::load(&ck, &opts).unwrap();
    let (mut c1, mut c2) = (model.new_cache(), bm.new_cache());
    let want = model.forward(&prompt, &mut c1, Logits::All, None).unwrap();
    let got = bm.forward(&prompt, &mut c2, Logits::All, None).unwrap();
    assert!(want
        .iter()
        .zip(&got)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    let mut tok = argmax(&want[want.len() - cfg.vocab..]);
    for _ in 0..6 {
        let a = model.forward(&[tok], &mut c1, Logits::Last, None).unwrap();
        let b = bm.forward(&[tok], &mut c2, Logits::Last, None).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        tok = argmax(&a);
    }
}
