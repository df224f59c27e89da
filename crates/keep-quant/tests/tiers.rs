//! Precision tiers in the model: an E8P2+E81 checkpoint loaded with a tier policy computes each
//! routed slot at its base rung (the codes alone) or its upper rung (codes plus residual). A
//! policy that never takes the upper rung gives exactly the logits of the E8P2 checkpoint coded
//! from the same weights (the base stage does not depend on the residual's presence); one that
//! always takes it gives exactly the untiered E8P2+E81 model's; a threshold between gives
//! something else, and the observer sees both rungs.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};

use keep_checkpoint::Checkpoint;
use keep_model::{
    CheckpointExperts, ExpertTiers, Logits, Model, ModelConfig, RouteObserver, RungEvent, Tiered,
    UpperChoice,
};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;

mod common;
use common::{bundled, imatrix};

/// Upper rung for gate weights at or above `tau`; counts the slots asked about.
struct Threshold {
    tau: f32,
    asked: AtomicUsize,
}

impl ExpertTiers for Threshold {
    fn choose(&self, _layer: usize, _token: usize, _expert: usize, gate: f32) -> UpperChoice {
        self.asked.fetch_add(1, Ordering::Relaxed);
        if gate >= self.tau {
            UpperChoice::Use
        } else {
            UpperChoice::BaseAndWant
        }
    }
}

#[derive(Default)]
struct Rungs {
    base: usize,
    upper: usize,
}

impl RouteObserver for Rungs {
    fn on_rungs(&mut self, ev: &RungEvent) {
        assert_eq!(ev.upper.len(), ev.tokens * ev.top_k);
        self.upper += ev.upper.iter().filter(|&&u| u).count();
        self.base += ev.upper.iter().filter(|&&u| !u).count();
    }
}

fn forward(model: &Model, toks: &[u32], obs: Option<&mut dyn RouteObserver>) -> Vec<f32> {
    let mut cache = model.new_cache();
    model.forward(toks, &mut cache, Logits::All, obs).unwrap()
}

fn tiered<'a>(ck: &'a Checkpoint, tau: f32) -> Model<'a> {
    let cfg = ModelConfig::from_checkpoint(ck).unwrap();
    let source = CheckpointExperts::new(ck, &cfg).unwrap();
    let tiers = Threshold {
        tau,
        asked: AtomicUsize::new(0),
    };
    Model::load_with(ck, cfg, Box::new(Tiered { source, tiers })).unwrap()
}

#[test]
fn base_rung_slots_equal_the_base_checkpoint_and_upper_slots_the_full_one() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let sel = ExpertSelection::Only(
        (0..8)
            .map(|l| (l, (0..8).collect::<BTreeSet<_>>()))
            .collect(),
    );
    let mut dirs = vec![];
    for format in [QuantFormat::E8p2, QuantFormat::E8p2E81] {
        let out = tmp.path().join(format.label());
        let opts = QuantOptions {
            format,
            experts: sel.clone(),
            shard: (0, 1),
            force: false,
            mlx_bits: None,
        };
        quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap();
        dirs.push(out);
    }
    let toks: Vec<u32> = (0..20).map(|i| ((i * 53 + 7) % 4000) as u32).collect();
    let base_ck = Checkpoint::open(&dirs[0]).unwrap();
    let full_ck = Checkpoint::open(&dirs[1]).unwrap();
    let base = forward(&Model::load(&base_ck).unwrap(), &toks, None);
    let full = forward(&Model::load(&full_ck).unwrap(), &toks, None);
    assert_ne!(base, full, "the residual stage changes the logits");

    // τ above every gate weight: the base checkpoint's logits, bit for bit.
    let m = tiered(&full_ck, f32::INFINITY);
    let mut rungs = Rungs::default();
    assert_eq!(forward(&m, &toks, Some(&mut rungs)), base);
    assert_eq!(rungs.upper, 0);
    assert_eq!(rungs.base, toks.len() * m.cfg.top_k * m.cfg.n_layers);

    // τ = 0 (every gate weight is ≥ 0): the full checkpoint's logits, bit for bit.
    let m = tiered(&full_ck, 0.0);
    let mut rungs = Rungs::default();
    assert_eq!(forward(&m, &toks, Some(&mut rungs)), full);
    assert_eq!(rungs.base, 0);

    // A threshold inside the gate weights' range: both rungs, logits of neither.
    let m = tiered(&full_ck, 0.3);
    let mut rungs = Rungs::default();
    let mixed = forward(&m, &toks, Some(&mut rungs));
    assert!(
        rungs.base > 0 && rungs.upper > 0,
        "{} {}",
        rungs.base,
        rungs.upper
    );
    assert_ne!(mixed, base);
    assert_ne!(mixed, full);
}
