//! A DeepSeek-V4-Flash pruned with its hash-routed layers left whole (`keep select` without
//! `--hash-remap`): `keep prune` writes `n_routed_experts_per_layer` (16 in the two hash layers,
//! 8 in the others; the MTP module keeps its 16, `n_routed_experts_mtp`), and every verb reads
//! each layer's own count — verify, inspect, logits, eval (the pruned checkpoint scores exactly
//! what its plan's student scores), run mapped and under a memory budget (the expert store and
//! slot cache; the same greedy tokens), MTP drafting, residency over the recorded routes,
//! calibration of the pruned model and `keep quant` by its imatrix.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use keep_calib::pack::{from_token_sources, write_pack, PackOptions};

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

fn stdout(c: &mut Command) -> String {
    String::from_utf8(c.assert().success().get_output().stdout.clone()).unwrap()
}

fn json(c: &mut Command) -> serde_json::Value {
    serde_json::from_str(&stdout(c)).unwrap()
}

/// Token ids of keep-rng's fixed linear congruential stream, below `vocab`.
fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut r = keep_rng::lcg(seed.wrapping_mul(keep_rng::Lcg64::A) | 1);
    (0..n)
        .map(|_| ((keep_rng::RngCore::next_u64(&mut r) >> 33) as u32) % vocab)
        .collect()
}

/// A pack of random token ids (the model has no tokenizer): several groups, some held out.
fn make_pack(dir: &Path, vocab: usize) -> PathBuf {
    let sources: Vec<(String, Vec<u32>)> = (0..8)
        .map(|i| {
            (
                format!("doc{i}.txt"),
                tokens(70 + i, 60 + 7 * i as usize, vocab as u32),
            )
        })
        .collect();
    let opts = PackOptions {
        max_tokens: 32,
        held_out_frac: 0.4,
        seed: 1,
    };
    let (m, r) = from_token_sources(&sources, "0".repeat(64), vocab, &opts).unwrap();
    let p = dir.join("pack");
    write_pack(&p, &m, &r, false).unwrap();
    p
}

/// The first line of `keep run` output that holds token ids (the model has no tokenizer).
fn generated(out: &str) -> String {
    out.lines()
        .find(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn a_v4flash_pruned_with_whole_hash_layers_runs_in_every_verb() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let src = w.join("src");
    keep(&cache)
        .args(["synth", "--preset", "tiny-v4flash", "--seed", "5", "--out"])
        .arg(&src)
        .assert()
        .success();
    let pack = make_pack(w, 512);

    // Calibrate, select 8 of 16 (hash layers whole: no --hash-remap), prune.
    let run = w.join("run");
    let teacher = w.join("teacher");
    for (out, split) in [(&run, "calibration"), (&teacher, "eval")] {
        keep(&cache)
            .arg("calibrate")
            .arg(&src)
            .arg("--pack")
            .arg(&pack)
            .args(["--split", split, "--out"])
            .arg(out)
            .assert()
            .success();
    }
    keep(&cache).arg("finalize").arg(&run).assert().success();
    let plan = w.join("plan.json");
    keep(&cache)
        .arg("select")
        .arg(&run)
        .args(["--keep", "8", "--no-plot", "--out"])
        .arg(&plan)
        .assert()
        .success();
    let pruned = w.join("pruned");
    keep(&cache)
        .arg("prune")
        .arg(&src)
        .arg(&pruned)
        .arg("--plan")
        .arg(&plan)
        .assert()
        .success();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pruned.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["n_routed_experts"], 8);
    assert_eq!(
        cfg["n_routed_experts_per_layer"],
        serde_json::json!([16, 16, 8, 8, 8, 8])
    );
    assert_eq!(cfg["n_routed_experts_mtp"], serde_json::json!([16]));

    // Verify and inspect: each layer holds its own count and the loader accepts it.
    keep(&cache).arg("verify").arg(&pruned).assert().success();
    let rep = json(keep(&cache).arg("inspect").arg(&pruned).arg("--json"));
    assert_eq!(rep["refused"], serde_json::json!([]), "{rep}");
    assert_eq!(rep["problems"], serde_json::json!([]), "{rep}");
    let per = &rep["experts_per_layer"];
    for (l, n) in [("0", 16), ("1", 16), ("2", 8), ("5", 8), ("mtp.0", 16)] {
        assert_eq!(per[l], n, "layer {l}: {rep}");
    }
    keep(&cache)
        .arg("logits")
        .arg(&pruned)
        .args(["--tokens", "5,17,300,4,9,9,123,77", "--out"])
        .arg(w.join("logits.safetensors"))
        .assert()
        .success();

    // Eval: the plan as a router mask on the source scores exactly as the pruned checkpoint.
    let eval = |model: &Path, mask: Option<&Path>| {
        let mut c = keep(&cache);
        c.arg("eval")
            .arg(model)
            .arg("--teacher")
            .arg(&teacher)
            .arg("--pack")
            .arg(&pack)
            .arg("--json");
        if let Some(m) = mask {
            c.arg("--mask").arg(m);
        }
        json(&mut c)
    };
    let masked = eval(&src, Some(&plan));
    let whole = eval(&pruned, None);
    let student = |v: &serde_json::Value, label: &str| {
        v["students"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["label"] == label)
            .unwrap_or_else(|| panic!("{label} in {v}"))
            .clone()
    };
    let (a, b) = (student(&masked, "plan.json"), student(&whole, "model"));
    assert!(b["positions"].as_u64().unwrap() > 0, "{whole}");
    for k in ["mean_kl", "mean_dnll", "top1", "positions"] {
        assert_eq!(a[k], b[k], "{k}: masked {a} vs pruned {b}");
    }

    // Run mapped and under a memory budget (5 slots per layer: the hash layers' 16 experts
    // and the others' 8 are read into slots from the shards): the same greedy tokens; then
    // drafting with the MTP module, and residency over the recorded routes.
    let gen = |extra: &[&str]| -> (String, String) {
        let o = keep(&cache)
            .arg("run")
            .arg(&pruned)
            .args([
                "--prompt-tokens",
                "12",
                "--max-tokens",
                "8",
                "--temperature",
                "0",
            ])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "keep run {extra:?}: {err}");
        (generated(&String::from_utf8_lossy(&o.stdout)), err)
    };
    let routes = w.join("routes.safetensors");
    let (plain, _) = gen(&[
        "--draft",
        "none",
        "--record-routes",
        routes.to_str().unwrap(),
    ]);
    assert!(!plain.is_empty());
    let (budgeted, err) = gen(&["--draft", "none", "--memory-budget", "3700KiB"]);
    assert!(err.contains("6 slots/layer"), "{err}");
    assert!(err.contains("hash-routed layers"), "{err}");
    assert_eq!(plain, budgeted, "under a memory budget");
    let (drafted, err) = gen(&["--draft", "mtp", "--draft-tokens", "2"]);
    assert!(err.contains("draft: K = 2"), "{err}");
    assert_eq!(plain, drafted, "drafting with the whole MTP module");
    let res = stdout(
        keep(&cache)
            .arg("residency")
            .arg(&routes)
            .arg("--model")
            .arg(&pruned)
            .args(["--hot", "4,8"]),
    );
    assert!(res.contains("verdict"), "{res}");

    // The pruned model calibrates, and its experts quantize by that imatrix (each layer's
    // own count) into a checkpoint that runs.
    let run2 = w.join("run-pruned");
    keep(&cache)
        .arg("calibrate")
        .arg(&pruned)
        .arg("--pack")
        .arg(&pack)
        .arg("--out")
        .arg(&run2)
        .assert()
        .success();
    keep(&cache).arg("finalize").arg(&run2).assert().success();
    let q = w.join("quant");
    keep(&cache)
        .arg("quant")
        .arg(&pruned)
        .arg("--imatrix")
        .arg(&run2)
        .arg("--out")
        .arg(&q)
        .assert()
        .success();
    let rep = json(keep(&cache).arg("inspect").arg(&q).arg("--json"));
    assert_eq!(rep["refused"], serde_json::json!([]), "{rep}");
    keep(&cache)
        .arg("run")
        .arg(&q)
        .args([
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "4",
            "--draft",
            "none",
        ])
        .assert()
        .success();
}
