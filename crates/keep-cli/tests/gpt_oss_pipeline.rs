//! The pipeline on a small random gpt-oss checkpoint (`keep synth --family gpt_oss`: 3 layers,
//! 8 experts top-2 in OpenAI's MXFP4 stacks, a 4096-token vocabulary so the bundled tokenizer's
//! packs fit): pack, calibrate (layer-streamed; the experts' inputs and outputs observed for the
//! imatrix and REAP), finalize, select, prune (4 of 8: every stack, its biases, the router and
//! its bias sliced on the expert axis, `num_local_experts` 4); the pruned model equals the
//! masked one under eval and runs; a plan that keeps every expert gives the same logits bit for
//! bit.

use std::path::{Path, PathBuf};

use assert_cmd::Command;

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

    // Keeping every expert: the same logits bit for bit.
    let (all, whole) = (w.join("all.json"), w.join("whole"));
    select_prune(&cache, &run, &src, "8", &all, &whole);
    assert_eq!(
        logits(&cache, &src, &w.join("a.safetensors")),
        logits(&cache, &whole, &w.join("b.safetensors"))
    );
}
