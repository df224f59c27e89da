//! The sidecar fit against the runtime: on the bundled model, half its experts pruned in two
//! layers, the fraction of the removed experts' contribution a fitted sidecar explains, taken
//! through the model's own application path (the student's forward with the sidecars installed,
//! the MoE block's output with its sidecar against the same block without), is the fraction the
//! fit reports from its sums, on its fitting rows and on its validation rows; and a layer keeps
//! its sidecar exactly where that validation share is positive and the validation KL falls.

use std::path::{Path, PathBuf};

use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_calib::pack::{Pack, Split};
use keep_calib::sidecar::{fit, FitRecords, Ridge, SidecarOptions};
use keep_checkpoint::Checkpoint;
use keep_model::layer::LayerWeights;
use keep_model::observer::{LinearInputEvent, RouteObserver};
use keep_model::{CheckpointExperts, ExpertSource, Logits, Model, ModelConfig};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Keep 16 scattered experts of 32 in layers 0 and 1; the rest whole.
fn plan(model: &Path) -> PrunePlan {
    let mut p = PrunePlan::new(32, 16, "test");
    p.layers = (0..8)
        .map(|l| LayerPlan {
            layer: l,
            survivors: (l < 2).then(|| (0..32).filter(|e| (e * 7 + l * 3) % 32 < 16).collect()),
            hash_routed: false,
            hash_remap: None,
        })
        .collect();
    p.bind_to(model).unwrap();
    p
}

/// Whole records of the bundled pack's calibration groups: `take` groups from `skip` on, up to
/// `cap` tokens.
fn records(skip: usize, take: usize, cap: usize) -> Vec<Vec<u32>> {
    let pack = Pack::open(&root().join("models/keep-tiny-pack")).unwrap();
    let mut out = vec![];
    let mut n = 0;
    for g in pack.groups(Split::Calibration).iter().skip(skip).take(take) {
        for r in pack.records_of(&g.id) {
            if n < cap {
                n += r.tokens.len();
                out.push(r.tokens.clone());
            }
        }
    }
    out
}

struct MoeInput {
    layer: usize,
    x: Vec<f32>,
}

impl RouteObserver for MoeInput {
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        if ev.layer == self.layer && ev.name == "ffn.gate" && ev.expert.is_none() {
            self.x.extend_from_slice(&ev.x[..ev.rows * ev.cols]);
        }
    }
}

/// `1 − Σ‖teacher − (pruned + sidecar)‖² / Σ‖teacher − pruned‖²` of layer `l` over `recs`, all
/// through the runtime: the student (masks and the fitted sidecars of every layer installed)
/// runs the records, and its layer `l` gives the MoE output with and without its sidecar. The
/// layers before `l` carry the kept sidecars (`kept`), layer `l` its fitted map `map`.
fn runtime_explained(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    plan: &PrunePlan,
    kept: &[Option<keep_model::Sidecar>],
    map: &keep_model::Sidecar,
    l: usize,
    recs: &[Vec<u32>],
) -> f64 {
    let mut student = Model::load(ck).unwrap();
    for k in 0..cfg.n_layers {
        student.set_router_mask(k, plan.pruned_mask(k)).unwrap();
    }
    for (lw, sc) in student.layers.iter_mut().zip(kept).take(l) {
        lw.sidecar = sc.clone();
    }
    student.layers[l].sidecar = Some(map.clone());
    let teacher = LayerWeights::load(ck, cfg, l).unwrap();
    let experts = CheckpointExperts::new(ck, cfg).unwrap();
    let src = &experts as &dyn ExpertSource;
    let mask = plan.pruned_mask(l);
    let (mut resid, mut base) = (0f64, 0f64);
    for r in recs {
        let mut obs = MoeInput {
            layer: l,
            x: vec![],
        };
        let mut cache = student.new_cache();
        student
            .forward(r, &mut cache, Logits::Last, Some(&mut obs))
            .unwrap();
        let t = teacher.moe_output(cfg, src, None, &obs.x, r).unwrap();
        let with = student.layers[l]
            .moe_output(cfg, src, mask.as_deref(), &obs.x, r)
            .unwrap();
        let sc = student.layers[l].sidecar.take();
        let without = student.layers[l]
            .moe_output(cfg, src, mask.as_deref(), &obs.x, r)
            .unwrap();
        student.layers[l].sidecar = sc;
        for ((t, w), p) in t.iter().zip(&with).zip(&without) {
            resid += ((t - w) as f64).powi(2);
            base += ((t - p) as f64).powi(2);
        }
    }
    1.0 - resid / base
}

#[test]
fn the_fit_scores_what_the_runtime_applies() {
    let model = root().join("models/keep-tiny");
    let ck = Checkpoint::open(&model).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let plan = plan(&model);
    let recs = FitRecords {
        fit: records(0, 3, 1500),
        validation: records(10, 2, 600),
    };
    let opts = SidecarOptions {
        rank: 16,
        ridge: Ridge::Relative(1e-2),
    };
    let f = fit(&model, &plan, &recs, &opts, &mut |_, _, _| {}).unwrap();
    assert_eq!(f.layers.len(), 2, "two layers pruned");
    assert!(f.sidecars[2..].iter().all(Option::is_none));
    for lf in &f.layers {
        let l = lf.layer;
        let val = lf.explained_validation.expect("validation records given");
        eprintln!(
            "layer {l}: explained on the fit rows {:.4}, on the validation rows {val:.4}",
            lf.explained
        );
        // A sidecar is kept exactly where it explains some of the validation rows and lowers
        // the validation KL.
        let kl = match (lf.validation_kl_without, lf.validation_kl_with) {
            (Some(a), Some(b)) => {
                assert!(
                    val > 0.0,
                    "layer {l}: the KL is measured only for a candidate"
                );
                b < a
            }
            _ => false,
        };
        assert_eq!(lf.kept, val > 0.0 && kl, "layer {l}: {lf:?}");
        assert_eq!(f.sidecars[l].is_some(), lf.kept, "layer {l}");
        let map = f.fitted[l].as_ref().expect("every pruned layer is fitted");
        let train = runtime_explained(&ck, &cfg, &plan, &f.sidecars, map, l, &recs.fit);
        let held = runtime_explained(&ck, &cfg, &plan, &f.sidecars, map, l, &recs.validation);
        assert!(
            (train - lf.explained).abs() < 1e-3,
            "layer {l}: the runtime explains {train} of the fit rows, the fit says {}",
            lf.explained
        );
        assert!(
            (held - val).abs() < 1e-3,
            "layer {l}: the runtime explains {held} of the validation rows, the fit says {val}"
        );
    }
}
