//! The expert store on mlx-lm's stacked `switch_mlp` layout (`fixtures/qwen3-tiny-mlx4`, MLX
//! affine 4-bit experts with `.scales` and `.biases`): each expert's slices of the stacked
//! weight, scales and biases read into a slot give the same matrices as the model's views of the
//! mapped checkpoint, row for row, and a budget far below the experts' size decodes the same
//! logits as the whole model.

use keep_checkpoint::Checkpoint;
use keep_model::experts::{CheckpointExperts, ExpertSource};
use keep_model::generate::argmax;
use keep_model::{Logits, Model, ModelConfig};
use keep_runtime::aligned::AlignedBuf;
use keep_runtime::{BudgetPlan, BudgetedModel, ExpertStore, Policy, RuntimeOptions};

fn fixture() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3-tiny-mlx4")
}

#[test]
fn slots_hold_the_stacked_slices_with_their_biases() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let store = ExpertStore::open(&ck, &cfg, false).unwrap();
    let mapped = CheckpointExperts::new(&ck, &cfg).unwrap();
    let mut slot = AlignedBuf::new(store.slot_bytes() as usize).unwrap();
    for e in 0..cfg.n_experts {
        let lay = store.layout(0, e).unwrap();
        // Weight, scales and biases of three matrices, each its slice of a stacked tensor.
        assert_eq!(lay.tensors.len(), 9);
        assert!(lay.biases.iter().all(Option::is_some));
        store.read_into(0, e, slot.as_mut_slice()).unwrap();
        let got = store.views(0, e, slot.as_slice()).unwrap();
        let want = mapped.expert(0, e).unwrap();
        for (g, w) in [(got.w1, want.w1), (got.w2, want.w2), (got.w3, want.w3)] {
            assert_eq!((g.rows, g.cols), (w.rows, w.cols));
            let (mut a, mut b) = (vec![0f32; g.cols], vec![0f32; w.cols]);
            for r in 0..g.rows {
                g.decode_row(r, &mut a);
                w.decode_row(r, &mut b);
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }
}

#[test]
fn budgeted_decode_equals_the_whole_model() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let model = Model::load(&ck).unwrap();
    let cfg = model.cfg.clone();
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 13 + 5) % 128).collect();
    // The least budget: top-k slots per layer (2 of 6 experts), so experts are read again.
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    let mut opts = RuntimeOptions::new(min);
    opts.policy = Policy::Lru;
    let mut bm = BudgetedModel::load(&ck, &opts).unwrap();
    assert_eq!(bm.plan().slots_per_layer, cfg.top_k);
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
