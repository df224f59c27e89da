//! `keep sidecar`'s fit asks the model's family whether its layers apply sidecars: a checkpoint
//! of a family whose layers do not (every Hugging Face family) is refused up front with an
//! error that names the checkpoint, its `model_type` and the families that do, before any plan
//! check or forward; the committed DeepSeek-V3 and gpt-oss fixtures, with a plan that binds to
//! them and a calibration record, are refused so.

use std::path::{Path, PathBuf};

use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_calib::sidecar::{fit, FitRecords, Ridge, SidecarOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// A plan bound to `model` keeping `survivors` of `experts` in `layer` of `layers`.
fn plan(
    model: &Path,
    layers: usize,
    experts: usize,
    layer: usize,
    survivors: &[usize],
) -> PrunePlan {
    let mut p = PrunePlan::new(experts, survivors.len(), "test");
    p.layers = (0..layers)
        .map(|l| LayerPlan {
            layer: l,
            survivors: (l == layer).then(|| survivors.to_vec()),
            hash_routed: false,
            hash_remap: None,
        })
        .collect();
    p.bind_to(model).unwrap();
    p
}

fn refused(model: &Path, plan: &PrunePlan, model_type: &str) {
    let records = FitRecords {
        fit: vec![vec![1, 2, 3, 4]],
        validation: vec![vec![2, 3]],
    };
    let opts = SidecarOptions {
        rank: 2,
        ridge: Ridge::Relative(1e-3),
    };
    let err = match fit(model, plan, &records, &opts, &mut |_, _, _| {}) {
        Ok(_) => panic!("{} ({model_type}): sidecars fitted", model.display()),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&model.display().to_string())
            && err.contains(model_type)
            && err.contains("sidecars are fitted and applied on DeepSeek-V4.1 / V4 models"),
        "{err}"
    );
}

#[test]
fn deepseek_v3_is_refused() {
    let m = fixture("deepseek-v3");
    // Layer 0 is dense; layer 1 keeps two experts of each of its two groups of four.
    refused(&m, &plan(&m, 2, 8, 1, &[0, 1, 4, 5]), "deepseek_v3");
}

#[test]
fn gpt_oss_is_refused() {
    let m = fixture("gpt-oss");
    refused(&m, &plan(&m, 3, 4, 0, &[0, 2]), "gpt_oss");
}
