//! `Kernels::Fast` reaches the dense projections and the head, not only the routed experts:
//! on the committed `small` checkpoint (FP8-block attention and shared expert, a bf16 head),
//! what the model computes under the fast kernels is, bit for bit, the fast kernel's product
//! of the same inputs, and under the exact kernels the exact product.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_kernels::{matmul_with, ops, WeightView};
use keep_model::layer::Streams;
use keep_model::observer::{LinearInputEvent, RouteObserver};
use keep_model::{Kernels, Logits, Model};

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// Where two results first differ (`None`: the same bits).
fn first_diff(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .enumerate()
        .find(|(_, (p, q))| p.to_bits() != q.to_bits())
        .map(|(i, (p, q))| (i, *p, *q))
}

fn product(k: Kernels, x: &[f32], m: usize, w: &WeightView) -> Vec<f32> {
    let mut y = vec![0f32; m * w.rows];
    matmul_with(k, x, m, w, &mut y).unwrap();
    y
}

/// Whether the fast kernels differ from the exact ones for FP8 and bf16 weights on this CPU
/// (AVX-512 BF16); without it both modes run the exact kernels and the bits agree anyway.
fn bf16_fast_here() -> bool {
    keep_kernels::bf16dot::bf_level().is_some()
}

/// Layer 0's shared-expert inputs, as the model hands them to the observer.
#[derive(Default)]
struct SharedInputs {
    w1: Vec<f32>,
    w2: Vec<f32>,
}

impl RouteObserver for SharedInputs {
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        if ev.layer == 0 {
            match ev.name {
                "ffn.shared_experts.w1" => self.w1 = ev.x.to_vec(),
                "ffn.shared_experts.w2" => self.w2 = ev.x.to_vec(),
                _ => {}
            }
        }
    }
}

#[test]
fn shared_expert_runs_on_the_chosen_kernels() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let tokens = [3u32, 17, 250, 9, 41];
    let t = tokens.len();
    for k in [Kernels::Exact, Kernels::Fast] {
        model.opts.kernels = k;
        let mut obs = SharedInputs::default();
        model
            .forward(
                &tokens,
                &mut model.new_cache(),
                Logits::Last,
                Some(&mut obs),
            )
            .unwrap();
        let [w1, _, w3] = &model.layers[0].shared;
        assert!(
            matches!(w1.kind, keep_kernels::WeightKind::Fp8Block { .. }),
            "the fixture's shared expert is FP8-block: {}",
            w1.format_name()
        );
        // The input of w2 is swiglu(x·w1ᵀ, x·w3ᵀ): recompute it from the input of w1.
        let want = |kk: Kernels| -> Vec<f32> {
            let (g, u) = (product(kk, &obs.w1, t, w1), product(kk, &obs.w1, t, w3));
            g.iter()
                .zip(&u)
                .map(|(&g, &u)| ops::swiglu_clamped(g, u, model.cfg.swiglu_limit))
                .collect()
        };
        let d = first_diff(&obs.w2, &want(k));
        assert!(d.is_none(), "{}: the shared expert's w1/w3 {d:?}", k.name());
        if k == Kernels::Fast && bf16_fast_here() {
            let d = first_diff(&obs.w2, &want(Kernels::Exact));
            assert!(d.is_some(), "fast mode ran the exact kernels");
        }
    }
}

#[test]
fn head_runs_on_the_chosen_kernels() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let (hc, d) = (model.cfg.hc, model.cfg.dim);
    assert!(model.globals.hc_head.is_none(), "V4.1 collapses by pre_mix");
    // Two rows; stream 0 carries the row (pre_mix 1), the others are weighted by 0.
    let t = 2;
    let x: Vec<f32> = (0..t * hc * d)
        .map(|i| ((i * 2_654_435_761usize % 1000) as f32 - 500.0) / 250.0)
        .collect();
    let mut pre_mix = vec![0f32; t * hc];
    for i in 0..t {
        pre_mix[i * hc] = 1.0;
    }
    let s = Streams {
        t,
        x: x.clone(),
        pre_mix,
        tokens: vec![1; t],
    };
    let mut h: Vec<f32> = (0..t)
        .flat_map(|i| x[i * hc * d..i * hc * d + d].to_vec())
        .collect();
    ops::rms_norm(&mut h, d, Some(&model.globals.norm), model.cfg.eps);
    for k in [Kernels::Exact, Kernels::Fast] {
        model.opts.kernels = k;
        let got = model
            .globals
            .finish(&model.cfg, model.opts.kernels, &s, Logits::All)
            .unwrap();
        let d = first_diff(&got, &product(k, &h, t, &model.globals.head));
        assert!(d.is_none(), "{}: the head {d:?}", k.name());
        if k == Kernels::Fast && bf16_fast_here() {
            let d = first_diff(&got, &product(Kernels::Exact, &h, t, &model.globals.head));
            assert!(d.is_some(), "fast mode ran the exact head");
        }
    }
}
