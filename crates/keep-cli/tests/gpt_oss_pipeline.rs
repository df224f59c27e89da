//! The pipeline on a small random gpt-oss checkpoint (`keep synth --family gpt_oss`: 3 layers,
//! 8 experts top-2 in OpenAI's MXFP4 stacks, a 4096-token vocabulary so the bundled tokenizer's
//! packs fit): pack, calibrate (layer-streamed; the experts' inputs and outputs observed for the
//! imatrix and REAP), finalize, select, prune (4 of 8: every stack, its biases, the router and
//! its bias sliced on the expert axis, `num_local_experts` 4); the pruned model equals the
//! masked one under eval and runs; residency replays the run's routes with the experts' bytes
//! (their slices of the stacks); `keep quant` codes the experts (each expert's gate-up and down
//! matrices under its own name, the stacks dropped; with a plan only its survivors, the stacks
//! kept for the rest) and the result scores within a stated KL of the source and runs, whole and
//! under the least --memory-budget it accepts with the same greedy tokens; a plan that keeps
//! every expert gives the same logits bit for bit.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use predicates::prelude::*;

const CONFIG: &str = r#"{"architectures":["GptOssForCausalLM"],"model_type":"gpt_oss",
  "vocab_size":4096,"hidden_size":128,"intermediate_size":64,"num_hidden_layers":3,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"num_local_experts":8,
  "num_experts_per_tok":2,"sliding_window":4,"rope_theta":150000.0,
  "max_position_embeddings":4096,"rms_norm_eps":1e-5,"swiglu_limit":7.0,
  "attention_bias":true,"tie_word_embeddings":false,"bos_token_id":0,"eos_token_id":1,
  "rope_scaling":{"rope_type":"yarn","factor":32.0,"original_max_position_embeddings":4096,
  "beta_fast":32.0,"beta_slow":1.0,"truncate":false}}"#;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

fn stdout(c: &mut Command) -> String {
    String::from_utf8(c.assert().success().get_output().stdout.clone()).unwrap()
}

/// The logits of `keep logits` on fixed tokens, as bits.
fn logits(cache: &Path, model: &Path, out: &Path) -> Vec<u32> {
    keep(cache)
        .arg("logits")
        .arg(model)
        .args(["--tokens", "5,17,300,4000,9,9,1234,77", "--out"])
        .arg(out)
        .assert()
        .success();
    let f = keep_artifacts::logits::LogitsFile::read(out).unwrap();
    f.logits.iter().map(|x| x.to_bits()).collect()
}

/// `keep select RUN --keep N --out PLAN` then `keep prune SRC OUT --plan PLAN`.
fn select_prune(cache: &Path, run: &Path, src: &Path, keep_n: &str, plan: &Path, out: &Path) {
    keep(cache)
        .arg("select")
        .arg(run)
        .args(["--keep", keep_n, "--no-plot", "--out"])
        .arg(plan)
        .assert()
        .success();
    keep(cache)
        .arg("prune")
        .arg(src)
        .arg(out)
        .arg("--plan")
        .arg(plan)
        .assert()
        .success();
    keep(cache).arg("verify").arg(out).assert().success();
}

/// The KL column of `keep eval`'s row for `student`.
fn kl(report: &str, student: &str) -> String {
    let line = report
        .lines()
        .find(|l| l.trim_start().starts_with(student))
        .unwrap_or_else(|| panic!("{student} in {report}"));
    line.split_whitespace().nth(2).unwrap().to_string()
}

/// The greedy tokens of `keep run MODEL` on 8 prompt tokens, whole and under the least
/// `--memory-budget` it accepts (the one a budget of one byte is refused naming).
fn whole_and_least_budget(cache: &Path, model: &Path) -> (String, String) {
    let gen = |extra: &[&str]| -> String {
        let out = stdout(
            keep(cache)
                .arg("run")
                .arg(model)
                .args([
                    "--prompt-tokens",
                    "8",
                    "--max-tokens",
                    "6",
                    "--temperature",
                    "0",
                ])
                .args(extra),
        );
        out.lines()
            .find(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .unwrap_or_default()
            .to_string()
    };
    let refused = keep(cache)
        .arg("run")
        .arg(model)
        .args([
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "6",
            "--memory-budget",
            "1",
        ])
        .assert()
        .failure()
        .get_output()
        .stderr
        .clone();
    let refused = String::from_utf8(refused).unwrap();
    let least = refused
        .split("give a budget ≥ ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no least budget named: {refused}"))
        .to_string();
    (gen(&[]), gen(&["--memory-budget", &least]))
}

#[test]
fn gpt_oss_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let src = w.join("src");
    keep(&cache)
        .args(["synth", "--family", "gpt_oss", "--seed", "6", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&src)
        .assert()
        .success();
    let pack = w.join("pack");
    keep(&cache)
        .args(["pack", "--from"])
        .arg(root().join("ARCHITECTURE.md"))
        .arg(root().join("docs/v4flash.md"))
        .arg("--tokenizer")
        .arg(root().join("models/keep-tiny/tokenizer.json"))
        .arg("--out")
        .arg(&pack)
        .args(["--max-tokens", "128", "--held-out-frac", "0.3"])
        .assert()
        .success();
    let run = w.join("run");
    keep(&cache)
        .arg("calibrate")
        .arg(&src)
        .arg("--pack")
        .arg(&pack)
        .arg("--out")
        .arg(&run)
        .assert()
        .success();
    keep(&cache).arg("finalize").arg(&run).assert().success();
    // Residency replays the run's routes with each expert's bytes (its slices of the two
    // stacks: 128×128 + 128×64 FP4 with their E8M0 scales).
    let rep = stdout(
        keep(&cache)
            .arg("residency")
            .arg(&run)
            .args(["--hot", "2,4", "--model"])
            .arg(&src),
    );
    assert!(
        rep.contains("verdict") && rep.contains("expert 12.75 KiB"),
        "{rep}"
    );

    let (plan, pruned) = (w.join("plan.json"), w.join("pruned"));
    select_prune(&cache, &run, &src, "4", &plan, &pruned);
    let pc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pruned.join("config.json")).unwrap()).unwrap();
    assert_eq!(pc["num_local_experts"], 4);
    let ck = keep_checkpoint::Checkpoint::open(&pruned).unwrap();
    for (name, shape) in [
        ("mlp.router.weight", vec![4, 128]),
        ("mlp.router.bias", vec![4]),
        ("mlp.experts.gate_up_proj_bias", vec![4, 128]),
        ("mlp.experts.down_proj_bias", vec![4, 128]),
    ] {
        let t = ck.get(&format!("model.layers.2.{name}")).unwrap();
        assert_eq!(t.shape.to_vec(), shape, "{name}");
    }
    for stack in ["gate_up_proj", "down_proj"] {
        for part in ["blocks", "scales"] {
            let t = ck
                .get(&format!("model.layers.1.mlp.experts.{stack}_{part}"))
                .unwrap();
            assert_eq!(t.shape[0], 4, "{stack}_{part}");
        }
    }
    let report = stdout(keep(&cache).arg("inspect").arg(&pruned));
    assert!(report.contains("no problems found"), "{report}");
    assert!(report.contains("4 in each of 3 layers"), "{report}");

    // The plan as a router mask on the source scores exactly as the pruned checkpoint does.
    let ev = w.join("ev");
    keep(&cache)
        .arg("calibrate")
        .arg(&src)
        .arg("--pack")
        .arg(&pack)
        .args(["--split", "eval", "--out"])
        .arg(&ev)
        .assert()
        .success();
    let eval = |model: &Path, mask: Option<&Path>| {
        let mut c = keep(&cache);
        c.arg("eval")
            .arg(model)
            .arg("--teacher")
            .arg(&ev)
            .arg("--pack")
            .arg(&pack);
        if let Some(m) = mask {
            c.arg("--mask").arg(m);
        }
        stdout(&mut c)
    };
    assert_eq!(
        kl(&eval(&src, Some(&plan)), "plan.json"),
        kl(&eval(&pruned, None), "model")
    );
    keep(&cache)
        .arg("run")
        .arg(&pruned)
        .args(["--prompt-tokens", "8", "--max-tokens", "4"])
        .assert()
        .success();

    // Quantize every expert (E8P, and E8P with an E81 residual stage), weighted by the run's
    // imatrix (the gate-up and the down matrices' inputs).
    let quant = |extra: &[&str], out: &Path| {
        keep(&cache)
            .arg("quant")
            .arg(&src)
            .arg("--imatrix")
            .arg(&run)
            .args(extra)
            .arg("--out")
            .arg(out)
            .assert()
            .success();
        keep(&cache).arg("verify").arg(out).assert().success();
    };
    let (q2, q3) = (w.join("q2"), w.join("q3"));
    quant(&["--format", "e8p2"], &q2);
    quant(&["--format", "e8p2+e81"], &q3);
    let ck = keep_checkpoint::Checkpoint::open(&q2).unwrap();
    for (name, dtype, shape) in [
        (
            "3.gate_up_proj.weight",
            keep_checkpoint::Dtype::U16,
            [128u64, 16],
        ),
        (
            "3.gate_up_proj.scale",
            keep_checkpoint::Dtype::F32,
            [128, 1],
        ),
        ("3.down_proj.weight", keep_checkpoint::Dtype::U16, [128, 8]),
    ] {
        let t = ck
            .get(&format!("model.layers.1.mlp.experts.{name}"))
            .unwrap();
        assert_eq!(
            (t.dtype, t.shape.to_vec()),
            (dtype, shape.to_vec()),
            "{name}"
        );
    }
    assert!(ck
        .get("model.layers.1.mlp.experts.gate_up_proj_blocks")
        .is_none());
    assert!(ck
        .get("model.layers.1.mlp.experts.gate_up_proj_bias")
        .is_some());
    let report = stdout(keep(&cache).arg("inspect").arg(&q2));
    assert!(report.contains("no problems found"), "{report}");
    // KL to the source (the teacher) on the held-out split: measured 0.036 nats for E8P and
    // 0.017 with the residual stage; a wrong product (the incoherence rotation not undone, gate
    // and up rows mixed, a wrong imatrix) is far above the bound.
    let k2: f64 = kl(&eval(&q2, None), "model").parse().unwrap();
    let k3: f64 = kl(&eval(&q3, None), "model").parse().unwrap();
    assert!(k2 > 0.0 && k2 < 0.08, "E8P KL {k2}");
    assert!(k3 > 0.0 && k3 < k2, "E8P+E81 KL {k3}, E8P {k2}");
    // Whole and under the least budget (each coded expert read into its slots): the same
    // greedy tokens.
    let (whole_run, budget_run) = whole_and_least_budget(&cache, &q2);
    assert!(!whole_run.is_empty());
    assert_eq!(whole_run, budget_run);
    // Only the plan's survivors: the stacks stay for the experts left as shipped.
    let part = w.join("part");
    quant(
        &["--format", "e8p2", "--experts", plan.to_str().unwrap()],
        &part,
    );
    let ck = keep_checkpoint::Checkpoint::open(&part).unwrap();
    assert!(ck
        .get("model.layers.1.mlp.experts.down_proj_blocks")
        .is_some());
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    for e in 0..8u64 {
        let kept = p["layers"][1]["survivors"]
            .as_array()
            .unwrap()
            .contains(&e.into());
        let coded = ck
            .get(&format!("model.layers.1.mlp.experts.{e}.down_proj.weight"))
            .is_some();
        assert_eq!(kept, coded, "expert {e}");
    }
    let kp: f64 = kl(&eval(&part, None), "model").parse().unwrap();
    assert!(kp > 0.0 && kp < k2, "half coded KL {kp}, all {k2}");
    // A coded model is not coded again.
    keep(&cache)
        .arg("quant")
        .arg(&q2)
        .arg("--imatrix")
        .arg(&run)
        .arg("--out")
        .arg(w.join("again"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("does not replace"));

    // Keeping every expert: the same logits bit for bit.
    let (all, whole) = (w.join("all.json"), w.join("whole"));
    select_prune(&cache, &run, &src, "8", &all, &whole);
    assert_eq!(
        logits(&cache, &src, &w.join("a.safetensors")),
        logits(&cache, &whole, &w.join("b.safetensors"))
    );
}
