//! The rule that makes `--kernels fast` the default, tested on what it was decided on: the
//! bundled model (`models/keep-tiny`) scored on the fast kernels against its own exact-kernel
//! teacher over the bundled pack's held-out split — the computation of `keep calibrate --split
//! eval` then `keep eval --teacher RUN --kernels fast` — has mean KL(exact ‖ fast) at most
//! [`MAX_MEAN_KL`] and top-1 agreement at least [`MIN_TOP1`]. Through the binary, as a user
//! runs it (about a minute and a half in the debug profile).

use std::path::{Path, PathBuf};

use assert_cmd::Command;

/// The rule's KL bound (nats per position, the teacher's top-64 plus a tail bucket).
const MAX_MEAN_KL: f64 = 1e-3;
/// The rule's top-1 agreement bound.
const MIN_TOP1: f64 = 0.99;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

/// The routed experts' down projections take two-level int8 activations for this model: with
/// one level its top-1 agreement is 0.988.
#[test]
fn fast_kernels_meet_the_default_rule_on_the_bundled_model() {
    rule_holds("models/keep-tiny");
}

fn rule_holds(model: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let model = root().join(model);
    let teacher = dir.path().join("teacher");
    keep(&cache)
        .arg("calibrate")
        .arg(&model)
        .args(["--split", "eval", "--kernels", "exact", "--out"])
        .arg(&teacher)
        .assert()
        .success();
    let out = keep(&cache)
        .arg("eval")
        .arg(&model)
        .arg("--teacher")
        .arg(&teacher)
        .args(["--kernels", "fast", "--json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let report: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let students = report["students"].as_array().unwrap();
    let fast = students
        .iter()
        .find(|s| s["kernels"] == "fast" && s["plan"].is_null())
        .unwrap_or_else(|| panic!("no fast-kernel student of the model: {report}"));
    let (kl, top1) = (
        fast["mean_kl"].as_f64().unwrap(),
        fast["top1"].as_f64().unwrap(),
    );
    let positions = fast["positions"].as_u64().unwrap();
    eprintln!(
        "{}: fast vs exact over {positions} held-out positions: mean KL {kl:.3e}, top-1 {top1:.4}",
        model.display()
    );
    assert!(
        positions > 1000,
        "the held-out split is scored: {positions}"
    );
    assert!(
        kl <= MAX_MEAN_KL,
        "fast kernels: mean KL {kl:e} > {MAX_MEAN_KL:e}"
    );
    assert!(top1 >= MIN_TOP1, "fast kernels: top-1 {top1} < {MIN_TOP1}");
}
