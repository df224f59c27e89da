//! `keep eval --tasks` through the binary: the teacher and each student sample with the same
//! seeds (a student that is the teacher's own checkpoint writes the same completions and scores
//! the same), every completion is checked and the pass counts add up, the committed spec runs,
//! and a spec whose checks need python3 is refused up front, with a clear message, when there is
//! none.

use std::path::{Path, PathBuf};

use assert_cmd::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

const SPEC: &str = r#"{
  "format": "keep-tasks", "version": 1, "samples": 3, "max_tokens": 24,
  "temperature": 0.8, "top_p": 0.95, "seed": 7, "stop": ["\n\n\n", "\ndef "],
  "tasks": [
    {"name": "body", "prompt": "def read_lines(path):\n", "check": {"kind": "parses"}},
    {"name": "main", "prompt": "import os\nimport sys\n\n\ndef main(", "check": {"kind": "parses"}}
  ]
}"#;

#[test]
fn teacher_and_students_sample_with_the_same_seeds_and_every_sample_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, SPEC).unwrap();
    let model = root().join("models/keep-tiny");
    let out = keep(&cache)
        .args(["eval", "--kernels", "fast", "--json", "--tasks"])
        .arg(&spec)
        .arg(&model)
        .arg("--student")
        .arg(&model)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let r: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(r["format"], "keep-tasks-report");
    let models = r["models"].as_array().unwrap();
    assert_eq!(models.len(), 2);
    assert_eq!(
        (models[0]["role"].as_str(), models[1]["role"].as_str()),
        (Some("teacher"), Some("student"))
    );
    for m in models {
        let tasks = m["tasks"].as_array().unwrap();
        assert_eq!(tasks.len(), 2);
        let mut passed = 0;
        for t in tasks {
            let outcomes = t["outcomes"].as_array().unwrap();
            assert_eq!(outcomes.len(), 3);
            let p = outcomes.iter().filter(|o| o["pass"] == true).count();
            assert_eq!(t["passed"].as_u64().unwrap() as usize, p);
            passed += p;
            // Cut at the stop strings.
            for o in outcomes {
                let c = o["completion"].as_str().unwrap();
                assert!(!c.contains("\n\n\n") && !c.contains("\ndef "), "{c:?}");
            }
            let ci = t["ci95"].as_array().unwrap();
            let rate = t["rate"].as_f64().unwrap();
            assert!(ci[0].as_f64().unwrap() <= rate && rate <= ci[1].as_f64().unwrap());
        }
        assert_eq!(m["passed"].as_u64().unwrap() as usize, passed);
    }
    // The same checkpoint with the same seeds: the same completions, sample for sample.
    assert_eq!(models[0]["tasks"], models[1]["tasks"]);
    // Different seeds within a task give different samples (every seed is used).
    let texts: std::collections::HashSet<&str> = models[0]["tasks"][0]["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["completion"].as_str().unwrap())
        .collect();
    assert!(texts.len() > 1, "three seeds sampled one text: {texts:?}");
}

#[test]
fn the_committed_spec_runs_and_a_missing_python_is_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let spec = root().join("tasks/python-basics.json");
    let empty = dir.path().join("empty-bin");
    std::fs::create_dir(&empty).unwrap();
    let out = keep(&cache)
        .env("PATH", &empty)
        .args(["eval", "--tasks"])
        .arg(&spec)
        .arg(root().join("models/keep-tiny"))
        .assert()
        .failure()
        .get_output()
        .stderr
        .clone();
    let msg = String::from_utf8_lossy(&out);
    assert!(msg.contains("python3") && msg.contains("parses"), "{msg}");
    // With python3 where the user has it, the spec runs on the bundled model.
    if which_python3() {
        let out = keep(&cache)
            .args(["eval", "--kernels", "fast", "--tasks"])
            .arg(&spec)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let text = String::from_utf8_lossy(&out);
        for name in ["function-body", "imports-and-main", "add-runs", "all"] {
            assert!(text.contains(name), "{text}");
        }
    }
}

fn which_python3() -> bool {
    std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
