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
    // Too little memory says the least that works.
    keep(&cache)
        .args(["fit", "--memory", "0", "--context", "64", "--out"])
        .arg(dir.path().join("zero.json"))
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "the least memory that runs this model for a context of 64 positions is",
        ));
}

/// A plan `keep fit` writes for a budget is run whole by `keep run --plan` with no other flag
/// (its `draft: none` included: no MTP module or cache copy in its budget), and `keep fit
/// --check` runs the same; `--draft` cannot be given beside a plan.
#[test]
fn a_budgeted_plan_runs_as_fitted() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let plan = dir.path().join("plan.json");
    keep(&cache)
        .args([
            "fit",
            "--memory",
            "14MiB",
            "--context",
            "64",
            "--probe-tokens",
            "4",
            "--out",
        ])
        .arg(&plan)
        .assert()
        .success();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert!(v["budget"].as_u64().is_some(), "a budgeted plan: {v}");
    assert_eq!(v["draft"], "none");
    keep(&cache)
        .args(["run", "--plan"])
        .arg(&plan)
        .args(["--prompt", "Once upon a time", "--max-tokens", "8"])
        .assert()
        .success()
        .stderr(predicate::str::contains("route profile: "));
    keep(&cache)
        .args(["fit", "--probe-tokens", "4", "--check"])
        .arg(&plan)
        .assert()
        .success();
    keep(&cache)
        .args(["run", "--draft", "mtp", "--plan"])
        .arg(&plan)
        .assert()
        .failure()
        .stderr(predicate::str::contains("--draft"));
}

/// A plan is checked against the model it names, the files it writes stay beside it, and
/// concurrent runs of one plan each fold their routes into its profile.
#[test]
fn a_plan_is_trusted_no_further_than_it_can_be_checked() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let plan = dir.path().join("plan.json");
    keep(&cache)
        .args([
            "fit",
            "--memory",
            "1GiB",
            "--context",
            "64",
            "--probe-tokens",
            "4",
            "--out",
        ])
        .arg(&plan)
        .assert()
        .success();
    let text = std::fs::read_to_string(&plan).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let edited = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let mut w = v.clone();
        edit(&mut w);
        let p = dir.path().join(name);
        std::fs::write(&p, serde_json::to_string_pretty(&w).unwrap()).unwrap();
        p
    };
    let run = [
        "--prompt-tokens",
        "4",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ];
    // A zeroed fingerprint: the model is not the one the plan was fitted to.
    let zeroed = edited("zeroed.json", &|w| {
        w["model_fingerprint"] = "0".repeat(64).into()
    });
    keep(&cache)
        .args(["run", "--plan"])
        .arg(&zeroed)
        .args(run)
        .assert()
        .failure()
        .stderr(predicate::str::contains("fingerprint"));
    // A profile outside the plan's directory is refused, and nothing is created there.
    let elsewhere = tempfile::tempdir().unwrap();
    let outside = elsewhere.path().to_path_buf();
    for (name, profile) in [
        ("abs.json", outside.join("p.json").display().to_string()),
        ("up.json", "../p.json".to_string()),
    ] {
        let p = edited(name, &|w| w["profile"] = profile.clone().into());
        keep(&cache)
            .args(["run", "--plan"])
            .arg(&p)
            .args(run)
            .assert()
            .failure()
            .stderr(predicate::str::contains("outside the plan's directory"));
    }
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    assert!(!dir.path().parent().unwrap().join("p.json").exists());
    // Six runs at once: six updates in the profile.
    let bin = assert_cmd::cargo::cargo_bin("keep");
    let children: Vec<_> = (0..6)
        .map(|_| {
            std::process::Command::new(&bin)
                .env("KEEP_CACHE_DIR", &cache)
                .args(["run", "--plan"])
                .arg(&plan)
                .args(run)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let prof: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("plan.profile.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(prof["runs"], 6, "every run's routes folded in");
}

/// A plan fitted to a model named by a relative path runs from any directory.
#[test]
fn a_plan_names_its_model_wherever_it_is_run_from() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let m = dir.path().join("m");
    std::fs::create_dir(&m).unwrap();
    let bundled = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
    for e in std::fs::read_dir(bundled).unwrap().flatten() {
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    keep(&cache)
        .current_dir(dir.path())
        .args(["fit", "m", "--memory", "1GiB", "--context", "64"])
        .args(["--probe-tokens", "4", "--out", "plan.json"])
        .assert()
        .success();
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    keep(&cache)
        .current_dir(&other)
        .args(["run", "--plan", "../plan.json", "--prompt-tokens", "4"])
        .args(["--max-tokens", "4", "--temperature", "0"])
        .assert()
        .success();
}

/// A plan whose `draft` is `dspark` makes `keep run --plan` draft with the checkpoint's DSpark
/// drafter, a whole block per verify forward, with the output of the plan without drafting.
#[test]
fn a_dspark_plan_runs_drafting() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let model = dir.path().join("tds");
    keep(&cache)
        .args(["synth", "--preset", "tiny", "--draft", "dspark", "--out"])
        .arg(&model)
        .assert()
        .success();
    let plan = dir.path().join("plan.json");
    keep(&cache)
        .arg("fit")
        .arg(&model)
        .args([
            "--memory",
            "1GiB",
            "--context",
            "64",
            "--probe-tokens",
            "4",
            "--out",
        ])
        .arg(&plan)
        .assert()
        .success();
    let run = || {
        let o = keep(&cache)
            .args(["run", "--plan"])
            .arg(&plan)
            .args([
                "--prompt-tokens",
                "8",
                "--max-tokens",
                "24",
                "--temperature",
                "0",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{err}");
        (String::from_utf8_lossy(&o.stdout).into_owned(), err)
    };
    let (plain, err) = run();
    assert!(!err.contains("draft: K ="), "{err}");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    v["draft"] = "dspark".into();
    std::fs::write(&plan, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let (drafted, err) = run();
    assert!(err.contains("draft: K = 5"), "{err}");
    assert_eq!(drafted, plain, "drafting changed the greedy output");
}
