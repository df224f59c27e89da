//! `keep fit` end to end on the bundled model: a plan for a memory that holds everything, `keep
//! run --plan` applying it and folding its routes into the plan's route profile, `keep fit
//! --check` comparing measured with predicted, and the refusals (too little memory, a plan
//! with flags it sets itself, an existing plan without --force).

use assert_cmd::Command;
use predicates::prelude::*;

fn keep(cache: &std::path::Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

#[test]
fn fit_run_plan_and_check() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let plan = dir.path().join("plan.json");
    let fit_args = [
        "fit",
        "--memory",
        "1GiB",
        "--context",
        "64",
        "--probe-tokens",
        "4",
        "--out",
    ];
    keep(&cache)
        .args(fit_args)
        .arg(&plan)
        .assert()
        .success()
        .stdout(predicate::str::contains("in memory").and(predicate::str::contains("wrote")));
    let text = std::fs::read_to_string(&plan).unwrap();
    assert!(text.contains("\"format\": \"keep-fit-plan\""), "{text}");
    // An existing plan is refused without --force.
    keep(&cache)
        .args(fit_args)
        .arg(&plan)
        .assert()
        .failure()
        .stderr(predicate::str::contains("--force"));

    keep(&cache)
        .args(["run", "--plan"])
        .arg(&plan)
        .args([
            "--prompt-tokens",
            "4",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ])
        .assert()
        .success()
        .stderr(predicate::str::contains("route profile: "));
    assert!(dir.path().join("plan.profile.json").is_file());
    keep(&cache)
        .args(["run", "--plan"])
        .arg(&plan)
        .args(["--memory-budget", "1GiB"])
        .assert()
        .failure();

    let out = keep(&cache)
        .args(["fit", "--probe-tokens", "4", "--json", "--check"])
        .arg(&plan)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["format"], "keep-fit-check");
    assert!(v["measured_tps"].as_f64().unwrap() > 0.0);
    assert!(v["predicted_tps"].as_f64().unwrap() > 0.0);

    keep(&cache)
        .args(["fit", "--memory", "4096", "--context", "64", "--out"])
        .arg(dir.path().join("small.json"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("budget").or(predicate::str::contains("fits")));
}
