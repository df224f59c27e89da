//! `keep prune` on a checkpoint with an MTP module (`mtp.0.*`): the module's block has its own
//! router and experts, which a plan prunes by its own `mtp_layers` survivors or leaves whole
//! (config.json then records the module's count, `n_routed_experts_mtp`); either way the output
//! verifies, loads, and drafts (`keep run --draft mtp`, mapped and under a memory budget), with
//! greedy output identical to the unpruned-module run without drafts.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use keep_convert::presets::preset;
use keep_convert::synth::{synth, SynthOptions};

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

/// A small V4-Flash with one MTP module and no hash-routed layers (so that every decoder layer
/// can be pruned to one count).
fn model(dir: &Path) -> PathBuf {
    let (mut cfg, mut st) = preset("tiny-v4flash").unwrap();
    assert_eq!(cfg.num_nextn_predict_layers, 1);
    cfg.num_hash_layers = 0;
    cfg.raw["num_hash_layers"] = 0.into();
    st.hash_layers = 0;
    let out = dir.join("src");
    let o = SynthOptions {
        seed: 3,
        storage: st,
        force: false,
        max_shard_bytes: 1 << 20,
    };
    synth(&cfg, &out, &o, &|_, _| {}).unwrap()
}

/// A plan keeping the even experts of every decoder layer, and `mtp` of the MTP module.
fn plan(src: &Path, out: &Path, mtp: Option<Vec<usize>>) {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let n = cfg["n_routed_experts"].as_u64().unwrap() as usize;
    let layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    let keep: Vec<usize> = (0..n).step_by(2).collect();
    let p = serde_json::json!({
        "format": "keep-prune-plan", "version": 1, "n_experts": n, "keep": keep.len(),
        "saliency": "test",
        "layers": (0..layers).map(|l| serde_json::json!({"layer": l, "survivors": keep}))
            .collect::<Vec<_>>(),
        "mtp_layers": mtp.map(|s| vec![serde_json::json!({"layer": 0, "survivors": s})])
            .unwrap_or_default(),
        "model_fingerprint": keep_checkpoint::fingerprint::model_fingerprint(src).unwrap(),
    });
    std::fs::write(out, serde_json::to_vec(&p).unwrap()).unwrap();
}

/// The generated token ids of a greedy run (stdout, one id per piece without a tokenizer).
fn run(cache: &Path, m: &Path, extra: &[&str]) -> (String, String) {
    let o = keep(cache)
        .arg("run")
        .arg(m)
        .args([
            "--prompt-tokens",
            "12",
            "--max-tokens",
            "16",
            "--temperature",
            "0",
        ])
        .args(extra)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        o.status.success(),
        "keep run {extra:?} on {}: {err}",
        m.display()
    );
    (String::from_utf8_lossy(&o.stdout).to_string(), err)
}

#[test]
fn pruned_checkpoints_with_an_mtp_module_verify_load_and_draft() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let src = model(d.path());
    for (name, mtp, want) in [
        ("whole", None, serde_json::json!([16])),
        (
            "own",
            Some(vec![1, 2, 5, 7, 11, 12]),
            serde_json::json!([6]),
        ),
        (
            "same",
            Some((1..16).step_by(2).collect()),
            serde_json::Value::Null,
        ),
    ] {
        let pf = d.path().join(format!("plan-{name}.json"));
        plan(&src, &pf, mtp);
        let out = d.path().join(name);
        keep(&cache)
            .args(["prune", "--plan"])
            .arg(&pf)
            .arg(&src)
            .arg(&out)
            .assert()
            .success();
        keep(&cache).arg("verify").arg(&out).assert().success();
        keep(&cache).arg("inspect").arg(&out).assert().success();
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["n_routed_experts"], 8, "{name}");
        assert_eq!(cfg["n_routed_experts_mtp"], want, "{name}");
        // Drafting never changes greedy output; the module's experts load in its own count.
        let (plain, _) = run(&cache, &out, &["--draft", "none"]);
        let (drafted, err) = run(&cache, &out, &["--draft", "mtp", "--draft-tokens", "3"]);
        assert!(err.contains("draft: K = 3"), "{name}: {err}");
        assert_eq!(plain, drafted, "{name}");
        let (budgeted, err) = run(
            &cache,
            &out,
            &[
                "--draft",
                "mtp",
                "--draft-tokens",
                "3",
                "--memory-budget",
                "64MiB",
            ],
        );
        assert!(err.contains("draft: K = 3"), "{name}: {err}");
        assert_eq!(plain, budgeted, "{name} under a budget");
    }
}
