//! Compute beside expert reads: a MoE layer multiplies the experts already in memory first,
//! then its shared expert while the others are read, then each missed expert as it lands. A
//! source that says half the experts are still being read gives the logits of the model in
//! memory bit for bit, and the shared expert's inputs are seen between routed experts' (the
//! work moved into the wait); under the smallest budget the runtime gives the same logits too.

mod common;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::observer::{LinearInputEvent, RouteObserver};
use keep_model::{CheckpointExperts, ExpertSource, ExpertWeights, Logits, Model};
use keep_runtime::{BudgetPlan, BudgetedModel, RuntimeOptions};

/// Experts whose ids are odd are "being read": not ready until asked for.
struct HalfRead<'a>(CheckpointExperts<'a>);

impl ExpertSource for HalfRead<'_> {
    fn expert(&self, layer: usize, expert: usize) -> keep_model::Result<ExpertWeights<'_>> {
        self.0.expert(layer, expert)
    }
    fn ready(&self, _layer: usize, experts: &[usize]) -> Vec<bool> {
        experts.iter().map(|e| e % 2 == 0).collect()
    }
}

/// The names of linear inputs, in the order the forward multiplies them.
#[derive(Default)]
struct Order(Vec<(usize, &'static str, Option<usize>)>);

impl RouteObserver for Order {
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        self.0.push((ev.layer, ev.name, ev.expert));
    }
}

fn run_plain(m: &Model, prompt: &[u32], steps: usize, obs: &mut Order) -> Vec<u32> {
    let mut cache = m.new_cache();
    let v = m.cfg.vocab;
    let mut out = m
        .forward(prompt, &mut cache, Logits::All, Some(&mut *obs))
        .unwrap();
    let mut tok = argmax(&out[out.len() - v..]);
    for _ in 0..steps {
        let l = m
            .forward(&[tok], &mut cache, Logits::Last, Some(&mut *obs))
            .unwrap();
        tok = argmax(&l);
        out.extend(l);
    }
    out.iter().map(|x| x.to_bits()).collect()
}

fn run_budgeted(m: &mut BudgetedModel, prompt: &[u32], steps: usize) -> Vec<u32> {
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

/// Whether some layer's shared expert is multiplied after one of its routed experts and
/// before another, in one forward call of that layer.
fn shared_between_routed(order: &[(usize, &'static str, Option<usize>)]) -> bool {
    let mut seen_routed = false;
    let mut shared_after_routed = false;
    for &(_, name, _) in order {
        match name {
            "ffn.gate" => (seen_routed, shared_after_routed) = (false, false),
            "ffn.experts.w1" if shared_after_routed => return true,
            "ffn.experts.w1" => seen_routed = true,
            "ffn.shared_experts.w1" if seen_routed => shared_after_routed = true,
            _ => {}
        }
    }
    false
}

#[test]
fn experts_in_memory_first_then_shared_then_misses_change_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let src = common::synth_tiny(dir.path(), "tiny", Some(16), None);
    let ck = Checkpoint::open(&src).unwrap();
    let plain = Model::load(&ck).unwrap();
    let cfg = plain.cfg.clone();
    let prompt = common::prompt(12, cfg.vocab);
    let mut order_plain = Order::default();
    let want = run_plain(&plain, &prompt, 6, &mut order_plain);
    // In memory, every expert is ready: routed experts first, the shared expert after them.
    assert!(!shared_between_routed(&order_plain.0));

    let experts = HalfRead(CheckpointExperts::new(&ck, &cfg).unwrap());
    let half = Model::load_with(&ck, cfg.clone(), Box::new(experts)).unwrap();
    let mut order = Order::default();
    let got = run_plain(&half, &prompt, 6, &mut order);
    assert!(
        got == want,
        "the logits changed when experts came in another order"
    );
    assert!(
        shared_between_routed(&order.0),
        "the shared expert did not run while routed experts were being read"
    );

    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let (residents, slot) = (probe.plan().fixed(), probe.plan().slot_bytes);
    drop(probe);
    let min = BudgetPlan::minimum(residents, slot, cfg.n_layers, cfg.top_k);
    let mut m = BudgetedModel::load(&ck, &RuntimeOptions::new(min)).unwrap();
    let got = run_budgeted(&mut m, &prompt, 6);
    assert!(got == want, "the logits under the smallest budget differ");
}
