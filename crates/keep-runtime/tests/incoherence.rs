//! Incoherence processing under a memory budget: a tiny synthetic model whose routed experts
//! are all stored rotated (`keep quant --incoherence on`) runs from the expert store's slots
//! with the transforms undone, and its logits are exactly those of the whole model in memory;
//! the transforms matter (without them the logits differ).

mod common;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{CheckpointExperts, ExpertRht, ExpertSource, Logits, Model};
use keep_quant::checkpoint::{quantize_with, ExpertSelection, QuantOptions};
use keep_quant::incoherence::{IncoherenceOptions, Mode};
use keep_quant::QuantFormat;
use keep_runtime::{BudgetPlan, BudgetedModel, RuntimeOptions};

fn run(m: &mut BudgetedModel, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let v = m.cfg().vocab;
    let mut out = m.forward(prompt, &mut cache, Logits::All, None).unwrap();
    let mut tok = argmax(&out[out.len() - v..]);
    for _ in 0..steps {
        let l = m.forward(&[tok], &mut cache, Logits::Last, None).unwrap();
        tok = argmax(&l);
        out.extend(l);
    }
    out.iter().map(|x| x.to_bits()).collect()
}

fn run_plain(m: &Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let v = m.cfg.vocab;
    let mut out = m.forward(prompt, &mut cache, Logits::All, None).unwrap();
    let mut tok = argmax(&out[out.len() - v..]);
    for _ in 0..steps {
        let l = m.forward(&[tok], &mut cache, Logits::Last, None).unwrap();
        tok = argmax(&l);
        out.extend(l);
    }
    out.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn rotated_experts_under_a_budget_equal_the_model_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let src = common::synth_tiny(dir.path(), "tiny", Some(16), None);
    let im = common::flat_imatrix(&src, dir.path());
    let q = dir.path().join("q");
    let opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: ExpertSelection::All,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let inc = IncoherenceOptions {
        mode: Mode::Both,
        seed: 3,
    };
    quantize_with(&src, &im, &q, &opts, Some(inc), &|_, _| {}).unwrap();
    let ck = Checkpoint::open(&q).unwrap();
    let plain = Model::load(&ck).unwrap();
    let cfg = plain.cfg.clone();
    let prompt = common::prompt(16, cfg.vocab);
    let want = run_plain(&plain, &prompt, 6);

    // the same codes computed without their transforms give other logits
    let experts = CheckpointExperts::new(&ck, &cfg).unwrap();
    assert_ne!(experts.expert(0, 0).unwrap().rht, ExpertRht::default());
    struct Bare<'a>(CheckpointExperts<'a>);
    impl ExpertSource for Bare<'_> {
        fn expert(
            &self,
            layer: usize,
            expert: usize,
        ) -> keep_model::Result<keep_model::ExpertWeights<'_>> {
            let mut w = self.0.expert(layer, expert)?;
            w.rht = ExpertRht::default();
            Ok(w)
        }
    }
    let bare = Model::load_with(&ck, cfg.clone(), Box::new(Bare(experts))).unwrap();
    assert_ne!(run_plain(&bare, &prompt, 6), want);

    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    let mut m = BudgetedModel::load(&ck, &RuntimeOptions::new(min)).unwrap();
    assert_eq!(run(&mut m, &prompt, 6), want);
}
