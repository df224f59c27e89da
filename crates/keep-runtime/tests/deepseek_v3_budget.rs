//! The budgeted runtime on a DeepSeek-V3 checkpoint (`fixtures/deepseek-v3`: a dense first
//! layer without routed experts, then an MoE layer with Hugging Face's expert names): the expert
//! store skips the dense layer, and a budget of top-k slots per layer decodes the same logits
//! as the whole model, bit for bit.

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_runtime::{BudgetPlan, BudgetedModel, Policy, RuntimeOptions};

fn fixture() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek-v3")
}

#[test]
fn budgeted_decode_equals_the_whole_model() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let model = Model::load(&ck).unwrap();
    let cfg = model.cfg.clone();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 13 + 5) % 67).collect();
    // The least budget: top-k slots per layer (2 of 8 experts), so experts are read again.
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
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
