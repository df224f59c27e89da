//! `keep residency --draft-acceptance` predicts the drafter the checkpoint carries: DSpark on a
//! V4.1 checkpoint written by `keep synth --draft dspark` (one pass per window, its block's
//! tensors and the union of its own experts over the block's rows; `--draft-probe` times its
//! pass and projection), the MTP module on the bundled model (one pass per draft and one for
//! the fed pairs); `--drafter` names the other only where the checkpoint carries it, and
//! DSpark's K is at most its block.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn keep(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keep"))
        .args(args)
        .env("KEEP_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap()
}

fn ok(o: Output, what: &str) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{what}: {err}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// Routes of a greedy run of `model` without drafting.
fn record(model: &str, out: &Path, dir: &Path) {
    ok(
        keep(
            &[
                "run",
                model,
                "--prompt-tokens",
                "8",
                "--max-tokens",
                "24",
                "--temperature",
                "0",
                "--draft",
                "none",
                "--record-routes",
                out.to_str().unwrap(),
            ],
            dir,
        ),
        "record routes",
    );
}

fn residency(trace: &Path, model: &str, more: &[&str], dir: &Path) -> Output {
    let mut args = vec![
        "residency",
        trace.to_str().unwrap(),
        "--model",
        model,
        "--hot",
        "2,4",
        "--policy",
        "lru",
    ];
    args.extend_from_slice(more);
    keep(&args, dir)
}

fn json(o: Output, what: &str) -> serde_json::Value {
    serde_json::from_str(&ok(o, what)).unwrap()
}

/// A DSpark pass's bytes, counted from the checkpoint's `mtp.*` tensors by name: the markov
/// head once per block row, B of its embedding's rows, each stage's experts the union of B rows'
/// top-k (at most the stage's experts), every other tensor once.
fn dspark_pass(dir: &Path) -> u64 {
    let ck = keep_checkpoint::Checkpoint::open(dir).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let b = cfg["dspark_block_size"].as_u64().unwrap();
    let top_k = cfg["dspark_num_experts_per_tok"].as_u64().unwrap();
    let vocab = cfg["vocab_size"].as_u64().unwrap();
    let mut once = 0;
    let mut stages: BTreeMap<String, (u64, BTreeSet<String>)> = BTreeMap::new();
    for t in ck.tensors().filter(|t| t.name.starts_with("mtp.")) {
        let n = t.bytes.len() as u64;
        if let Some((stage, rest)) = t.name.split_once(".ffn.experts.") {
            let e = rest.split('.').next().unwrap().to_string();
            let s = stages.entry(stage.to_string()).or_default();
            if e == "0" {
                s.0 += n;
            }
            s.1.insert(e);
        } else if t.name.contains(".markov_head.head.") {
            once += b * n;
        } else if t.name.contains(".markov_head.embed.") {
            once += n * b / vocab;
        } else {
            once += n;
        }
    }
    assert_eq!(stages.len(), 3, "three DSpark stages with routed experts");
    once + stages
        .values()
        .map(|(e0, ids)| (b * top_k).min(ids.len() as u64) * e0)
        .sum::<u64>()
}

#[test]
fn residency_predicts_the_drafter_the_checkpoint_carries() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ds = d.join("tds");
    let ds_s = ds.to_str().unwrap();
    ok(
        keep(
            &[
                "synth", "--preset", "tiny", "--draft", "dspark", "--out", ds_s,
            ],
            d,
        ),
        "synth",
    );
    let trace = d.join("r.safetensors");
    record(ds_s, &trace, d);

    // DSpark by default on its checkpoint: one pass of its block per window.
    let v = json(
        residency(
            &trace,
            ds_s,
            &["--draft-acceptance", "0.6,0.4", "--json"],
            d,
        ),
        "dspark",
    );
    let spec = &v["drafting"]["spec"];
    assert_eq!(spec["drafter"], "dspark", "{spec}");
    assert_eq!(spec["k"], 2);
    let pass = dspark_pass(&ds);
    assert_eq!(spec["pass_bytes"].as_u64(), Some(pass), "{spec}");
    let all: u64 = keep_checkpoint::Checkpoint::open(&ds)
        .unwrap()
        .tensors()
        .filter(|t| t.name.starts_with("mtp."))
        .map(|t| t.bytes.len() as u64)
        .sum();
    assert!(pass > 0 && pass != all, "pass {pass} of {all} DSpark bytes");
    let text = ok(
        residency(&trace, ds_s, &["--draft-acceptance", "0.6,0.4"], d),
        "dspark text",
    );
    assert!(
        text.contains("drafting (dspark, K = 2")
            && text.contains(&format!("DSpark pass {pass} bytes")),
        "{text}"
    );

    // The probe times DSpark's pass and the projection of 1..=K + 1 kept rows.
    let v = json(
        residency(
            &trace,
            ds_s,
            &[
                "--draft-acceptance",
                "0.6,0.4",
                "--draft-probe",
                "--draft-probe-reps",
                "1",
                "--draft-probe-context",
                "8",
                "--json",
            ],
            d,
        ),
        "dspark probe",
    );
    let c = &v["drafting"]["spec"]["compute"];
    assert!(c["dspark_draft_s"].as_f64().unwrap() > 0.0, "{c}");
    assert_eq!(c["dspark_project_s"].as_array().unwrap().len(), 3, "{c}");
    assert_eq!(c["mtp_draft_s"].as_f64(), Some(0.0), "{c}");

    // MTP is refused on a checkpoint that carries DSpark only; K is at most the block (5).
    let o = residency(
        &trace,
        ds_s,
        &["--draft-acceptance", "0.6,0.4", "--drafter", "mtp"],
        d,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--drafter mtp"),
        "{err}"
    );
    let o = residency(
        &trace,
        ds_s,
        &["--draft-acceptance", "0.9,0.8,0.7,0.6,0.5,0.4"],
        d,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("blocks of 5"), "{err}");

    // The bundled model carries an MTP module: mtp by default, one pass per draft and one for
    // the fed pairs; --drafter dspark is refused on it.
    let tiny = bundled();
    let tiny_s = tiny.to_str().unwrap();
    let trace = d.join("m.safetensors");
    record(tiny_s, &trace, d);
    let v = json(
        residency(
            &trace,
            tiny_s,
            &[
                "--draft-acceptance",
                "0.6,0.4",
                "--draft-probe",
                "--draft-probe-reps",
                "1",
                "--draft-probe-context",
                "8",
                "--json",
            ],
            d,
        ),
        "mtp",
    );
    let spec = &v["drafting"]["spec"];
    assert_eq!(spec["drafter"], "mtp", "{spec}");
    assert!(spec["pass_bytes"].as_u64().unwrap() > 0, "{spec}");
    assert!(spec["compute"]["mtp_draft_s"].as_f64().unwrap() > 0.0);
    assert_eq!(spec["compute"]["dspark_draft_s"].as_f64(), Some(0.0));
    let o = residency(
        &trace,
        tiny_s,
        &["--draft-acceptance", "0.6", "--drafter", "dspark"],
        d,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("no DSpark drafter"),
        "{err}"
    );
}
