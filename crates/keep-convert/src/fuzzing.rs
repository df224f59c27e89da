//! Entry point of the `plan` fuzz target (in `fuzz/`) and of the test that replays its committed
//! corpus: a prune plan file read with [`PrunePlan::read`] (size cap, JSON, validation), then
//! checked against a model directory and asked for every layer's survivors and router mask, as
//! `keep prune` and the router-masked students do. It must return, never panic or abort.

use keep_artifacts::plan::PrunePlan;

/// Targets of this crate.
pub const TARGETS: [&str; 1] = ["plan"];

/// Run the target named `target` on `data`.
pub fn run(target: &str, data: &[u8]) {
    if target != "plan" {
        return;
    }
    let Some(dir) = keep_checkpoint::fuzzing::write_scratch(&[
        ("plan.json", Some(data)),
        ("config.json", Some(b"{}")),
    ]) else {
        return;
    };
    let Ok(plan) = PrunePlan::read(&dir.join("plan.json")) else {
        return;
    };
    let _ = plan.model_fingerprint();
    let _ = plan.check_model(&dir, 64, 2);
    for l in plan
        .layers
        .iter()
        .chain(&plan.mtp_layers)
        .map(|l| l.layer)
        .take(64)
    {
        let _ = plan.survivors(l);
        let _ = plan.mtp_survivors(l);
        let _ = plan.pruned_mask(l).map(|m| m.len());
    }
    let _ = serde_json::to_string(&plan);
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_corpus_replays_without_panic() {
        let n = keep_checkpoint::fuzzing::replay_committed(
            env!("CARGO_MANIFEST_DIR"),
            &super::TARGETS,
            &super::run,
        );
        assert!(n >= 5, "expected a committed plan corpus, found {n}");
    }
}
