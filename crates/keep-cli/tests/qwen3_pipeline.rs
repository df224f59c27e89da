//! The pipeline on a small random Qwen3-MoE checkpoint (`keep synth --family qwen3_moe`, 3
//! layers with the middle one dense, 16 experts top-4, a 4096-token vocabulary so the bundled
//! tokenizer's packs fit): inspect, repack of the FP8 layout to MXFP8 (logits unchanged bit for
//! bit), pack, calibrate, finalize, select (REAP), prune (8 of 16 experts, router rows sliced,
//! `num_experts` rewritten; the pruned model equals the masked one under eval), eval, run whole
//! and under the least --memory-budget it accepts (the same greedy tokens, with evictions),
//! residency over the recorded routes; `keep quant` codes the routed experts (the dense layer
//! left as it is), the result scores within a stated KL of the source and runs whole and under
//! a budget. mlx-lm's stacked layout is refused by `keep quant`, naming the stacked tensor.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use predicates::prelude::*;

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

const CONFIG: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
  "hidden_size":96,"num_hidden_layers":3,"intermediate_size":96,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":24,"num_experts":16,"num_experts_per_tok":4,
  "moe_intermediate_size":40,"decoder_sparse_step":1,"mlp_only_layers":[1],"rms_norm_eps":1e-6,
  "vocab_size":4096,"rope_theta":1000000.0,"tie_word_embeddings":false,
  "max_position_embeddings":2048,"norm_topk_prob":true,"bos_token_id":1,"eos_token_id":2}"#;

/// The logits file of `keep logits` on fixed tokens.
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

/// Pack two docs, calibrate and finalize `src`, select 8 experts by REAP and prune to them
/// (verified): the pack, the plan and the pruned checkpoint.
fn calibrate_select_prune(cache: &Path, w: &Path, src: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let pack = w.join("pack");
    keep(cache)
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
    keep(cache)
        .arg("calibrate")
        .arg(src)
        .arg("--pack")
        .arg(&pack)
        .arg("--out")
        .arg(&run)
        .assert()
        .success();
    keep(cache).arg("finalize").arg(&run).assert().success();
    let plan = w.join("plan.json");
    keep(cache)
        .arg("select")
        .arg(&run)
        .args(["--keep", "8", "--no-plot", "--out"])
        .arg(&plan)
        .assert()
        .success();
    let pruned = w.join("pruned");
    keep(cache)
        .arg("prune")
        .arg(src)
        .arg(&pruned)
        .arg("--plan")
        .arg(&plan)
        .assert()
        .success();
    keep(cache).arg("verify").arg(&pruned).assert().success();
    (pack, plan, pruned)
}

/// The plan as a router mask on `src` scores (KL against the eval-split teacher) exactly as the
/// pruned checkpoint does.
fn assert_masked_equals_pruned(
    cache: &Path,
    w: &Path,
    src: &Path,
    pack: &Path,
    plan: &Path,
    pruned: &Path,
) {
    let ev = w.join("ev");
    keep(cache)
        .arg("calibrate")
        .arg(src)
        .arg("--pack")
        .arg(pack)
        .args(["--split", "eval", "--out"])
        .arg(&ev)
        .assert()
        .success();
    let eval = |model: &Path, mask: Option<&Path>| {
        let mut c = keep(cache);
        c.arg("eval")
            .arg(model)
            .arg("--teacher")
            .arg(&ev)
            .arg("--pack")
            .arg(pack);
        if let Some(m) = mask {
            c.arg("--mask").arg(m);
        }
        stdout(&mut c)
    };
    let kl = |s: &str, student: &str| -> String {
        let line = s
            .lines()
            .find(|l| l.trim_start().starts_with(student))
            .unwrap_or_else(|| panic!("{student} in {s}"));
        line.split_whitespace().nth(2).unwrap().to_string()
    };
    assert_eq!(
        kl(&eval(src, Some(plan)), "plan.json"),
        kl(&eval(pruned, None), "model")
    );
}

/// `keep run` whole and under the least budget it accepts give the same greedy tokens; that
/// budget holds only top-k slots per MoE layer, fewer than the layer's experts, so the run
/// evicts (more misses than slots); residency replays the recorded routes.
fn assert_budget_equals_whole(cache: &Path, w: &Path, src: &Path, prompt_tokens: &str) {
    let args = |extra: &[&str]| -> Vec<String> {
        [
            "run",
            src.to_str().unwrap(),
            "--prompt-tokens",
            prompt_tokens,
            "--max-tokens",
            "6",
            "--temperature",
            "0",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
    };
    let gen = |extra: &[&str]| -> String {
        let out = stdout(keep(cache).args(args(extra)));
        out.lines()
            .find(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
            .unwrap_or_default()
            .to_string()
    };
    let routes = w.join("routes.safetensors");
    let plain = gen(&["--record-routes", routes.to_str().unwrap()]);
    assert!(!plain.is_empty());
    // The least budget: the one a budget of one byte is refused naming.
    let refused = keep(cache)
        .args(args(&["--memory-budget", "1"]))
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
    let stats = w.join("stats.json");
    assert_eq!(
        plain,
        gen(&[
            "--memory-budget",
            &least,
            "--stats-json",
            stats.to_str().unwrap()
        ])
    );
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    let plan = &s["plan"];
    let (slots, experts, layers) = (
        plan["slots_per_layer"].as_u64().unwrap(),
        plan["n_experts"].as_u64().unwrap(),
        plan["n_layers"].as_u64().unwrap(),
    );
    assert!(slots < experts, "{slots} slots hold all {experts} experts");
    let misses = s["prefill_cache"]["misses"].as_u64().unwrap()
        + s["decode_cache"]["misses"].as_u64().unwrap();
    assert!(
        misses > slots * layers,
        "{misses} misses fit in {slots} x {layers} slots: nothing was evicted"
    );
    let rep = stdout(
        keep(cache)
            .arg("residency")
            .arg(&routes)
            .arg("--model")
            .arg(src),
    );
    assert!(rep.contains("verdict"), "{rep}");
}

#[test]
fn qwen3_moe_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let src = w.join("src");
    keep(&cache)
        .args(["synth", "--format", "fp8", "--seed", "3", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&src)
        .assert()
        .success()
        .stdout(predicate::str::contains("qwen3_moe"));
    let report = stdout(keep(&cache).arg("inspect").arg(&src));
    assert!(report.contains("no problems found"), "{report}");
    assert!(report.contains("16 in each of 2 layers"), "{report}");

    // FP8 residents (128×128 bf16 power-of-two scales) → MXFP8: the same logits bit for bit.
    let mx = w.join("mx");
    keep(&cache)
        .arg("repack")
        .arg(&src)
        .arg(&mx)
        .args(["--resident-format", "mxfp8", "--verify"])
        .assert()
        .success();
    assert_eq!(
        logits(&cache, &src, &w.join("a.safetensors")),
        logits(&cache, &mx, &w.join("b.safetensors"))
    );

    // Calibrate, select, prune.
    let (pack, plan, pruned) = calibrate_select_prune(&cache, w, &src);
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&plan).unwrap()).unwrap();
    let layers = p["layers"].as_array().unwrap();
    assert!(layers.iter().any(|l| l["survivors"].is_array()));
    let pc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(pruned.join("config.json")).unwrap()).unwrap();
    assert_eq!(pc["num_experts"], 8);
    let report = stdout(keep(&cache).arg("inspect").arg(&pruned));
    assert!(report.contains("8 in each of 2 layers"), "{report}");

    // Eval: the plan as a router mask on the source scores as the pruned checkpoint does.
    assert_masked_equals_pruned(&cache, w, &src, &pack, &plan, &pruned);
    // Run whole and under the least budget (evicting): the same greedy tokens; residency
    // replays the routes.
    assert_budget_equals_whole(&cache, w, &src, "24");

    // Quantize the routed experts to E8P (the run's imatrix; the dense layer copied).
    let q = w.join("q");
    keep(&cache)
        .arg("quant")
        .arg(&src)
        .arg("--imatrix")
        .arg(w.join("run"))
        .args(["--format", "e8p2", "--out"])
        .arg(&q)
        .assert()
        .success();
    keep(&cache).arg("verify").arg(&q).assert().success();
    let ck = keep_checkpoint::Checkpoint::open(&q).unwrap();
    let codes = ck
        .get("model.layers.2.mlp.experts.5.up_proj.weight")
        .unwrap();
    assert_eq!(codes.dtype, keep_checkpoint::Dtype::U16, "E8P codes");
    assert!(ck
        .get("model.layers.2.mlp.experts.5.up_proj.weight_scale_inv")
        .is_none());
    assert!(ck
        .get("model.layers.1.mlp.up_proj.weight_scale_inv")
        .is_some());
    let report = stdout(keep(&cache).arg("inspect").arg(&q));
    assert!(report.contains("no problems found"), "{report}");
    // KL to the source on the held-out split: measured 0.013 nats; a wrong product (the
    // incoherence rotation not undone) is far above the bound.
    let scored = stdout(
        keep(&cache)
            .arg("eval")
            .arg(&q)
            .arg("--teacher")
            .arg(w.join("ev"))
            .arg("--pack")
            .arg(&pack),
    );
    let kq: f64 = scored
        .lines()
        .find(|l| l.trim_start().starts_with("model"))
        .and_then(|l| l.split_whitespace().nth(2))
        .unwrap_or_else(|| panic!("{scored}"))
        .parse()
        .unwrap();
    assert!(kq > 0.0 && kq < 0.04, "quantized KL {kq}");
    let qb = w.join("qb");
    std::fs::create_dir_all(&qb).unwrap();
    assert_budget_equals_whole(&cache, &qb, &q, "24");
}

/// mlx-lm's 4-bit layout (`keep synth --format mlx4`: experts stacked in `switch_mlp`, every
/// projection, the router and the embedding MLX affine with `.scales`/`.biases`).
const MLX_CONFIG: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
  "hidden_size":128,"num_hidden_layers":3,"intermediate_size":128,"num_attention_heads":4,
  "num_key_value_heads":2,"head_dim":32,"num_experts":16,"num_experts_per_tok":4,
  "moe_intermediate_size":64,"decoder_sparse_step":1,"mlp_only_layers":[1],"rms_norm_eps":1e-6,
  "vocab_size":4096,"rope_theta":1000000.0,"tie_word_embeddings":false,
  "max_position_embeddings":2048,"norm_topk_prob":true,"bos_token_id":1,"eos_token_id":2}"#;

#[test]
fn qwen3_moe_mlx4_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, MLX_CONFIG).unwrap();
    let src = w.join("src");
    keep(&cache)
        .args(["synth", "--format", "mlx4", "--seed", "4", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&src)
        .assert()
        .success();
    let report = stdout(keep(&cache).arg("inspect").arg(&src));
    assert!(report.contains("no problems found"), "{report}");
    assert!(report.contains("16 in each of 2 layers"), "{report}");
    assert!(report.contains("mlx-affine4"), "{report}");
    assert!(report.contains("mlx-affine8"), "{report}");

    // Prune slices the stacked experts, their scales and biases, and the quantized router.
    let (pack, plan, pruned) = calibrate_select_prune(&cache, w, &src);
    let report = stdout(keep(&cache).arg("inspect").arg(&pruned));
    assert!(report.contains("no problems found"), "{report}");
    assert!(report.contains("8 in each of 2 layers"), "{report}");
    let ck = keep_checkpoint::Checkpoint::open(&pruned).unwrap();
    let g = ck
        .get("model.layers.0.mlp.switch_mlp.gate_proj.biases")
        .unwrap();
    assert_eq!(g.shape, [8, 64, 2]);
    assert_eq!(
        ck.get("model.layers.0.mlp.gate.scales").unwrap().shape,
        [8, 2]
    );

    // The plan as a router mask on the source scores as the pruned checkpoint does.
    assert_masked_equals_pruned(&cache, w, &src, &pack, &plan, &pruned);
    // Whole and under a memory budget (the expert store reads each expert's slices of the
    // stacked weight, scales and biases): the same greedy tokens; residency replays the routes.
    assert_budget_equals_whole(&cache, w, &src, "16");
    // keep quant codes per-expert weights; the stacked ones are refused by name.
    keep(&cache)
        .arg("quant")
        .arg(&src)
        .arg("--imatrix")
        .arg(w.join("run"))
        .arg("--out")
        .arg(w.join("q"))
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "model.layers.0.mlp.switch_mlp.gate_proj.weight",
        ));
}
