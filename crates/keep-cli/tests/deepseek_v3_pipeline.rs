//! The pipeline on a small random DeepSeek-V3 checkpoint (`keep synth --family deepseek_v3`, FP8
//! 128×128 blocks, 3 layers with the first dense, 16 experts in 4 groups, top-2 groups, top-4,
//! a 4096-token vocabulary so the bundled tokenizer's packs fit): inspect, repack (FP8 residents
//! to MXFP8, the same logits bit for bit; a block scale that is not a power of two refused by
//! tensor), pack, calibrate
//! (layer-streamed), finalize, residency over the run's routes, select with `--groups 4` (the same number kept in every router
//! group), prune (8 of 16: experts renumbered, router rows and `e_score_correction_bias`
//! sliced, `n_routed_experts` 8 with `n_group` / `topk_group` kept); the pruned model equals the
//! masked one under eval and runs, whole and under the least --memory-budget it accepts with the
//! same greedy tokens; `keep quant` codes its routed experts (E8P, the family's
//! tensor names) and the result is scored and runs; a plan that unbalances the groups is
//! refused; a plan that keeps every expert gives the same logits bit for bit.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use predicates::prelude::*;

const CONFIG: &str = r#"{"architectures":["DeepseekV3ForCausalLM"],"model_type":"deepseek_v3",
  "vocab_size":4096,"hidden_size":256,"intermediate_size":320,"moe_intermediate_size":64,
  "num_hidden_layers":3,"num_attention_heads":4,"n_routed_experts":16,"n_shared_experts":1,
  "q_lora_rank":96,"kv_lora_rank":64,"qk_nope_head_dim":32,"qk_rope_head_dim":16,
  "v_head_dim":32,"n_group":4,"topk_group":2,"num_experts_per_tok":4,
  "first_k_dense_replace":1,"routed_scaling_factor":2.5,"max_position_embeddings":4096,
  "rope_theta":10000,"bos_token_id":0,"eos_token_id":1,
  "rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":1024,
  "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}}"#;

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

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
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

/// `keep select RUN --keep N [extra] --out PLAN`.
fn select(cache: &Path, run: &Path, keep_n: &str, extra: &[&str], plan: &Path) {
    keep(cache)
        .arg("select")
        .arg(run)
        .args(["--keep", keep_n, "--no-plot"])
        .args(extra)
        .arg("--out")
        .arg(plan)
        .assert()
        .success();
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
fn deepseek_v3_through_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let src = w.join("src");
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--format",
            "fp8",
            "--seed",
            "5",
            "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(&src)
        .assert()
        .success();
    let report = stdout(keep(&cache).arg("inspect").arg(&src));
    assert!(report.contains("no problems found"), "{report}");

    // FP8 residents (128×128 float32 `weight_scale_inv`, powers of two) → MXFP8: the same
    // logits bit for bit.
    let mx = w.join("mx");
    let out = stdout(keep(&cache).arg("repack").arg(&src).arg(&mx).args([
        "--resident-format",
        "mxfp8",
        "--verify",
    ]));
    assert!(out.contains("24 residents repacked"), "{out}");
    assert_eq!(
        logits(&cache, &src, &w.join("repack-a.safetensors")),
        logits(&cache, &mx, &w.join("repack-b.safetensors"))
    );
    let ck = keep_checkpoint::Checkpoint::open(&mx).unwrap();
    let s = ck
        .get("model.layers.1.self_attn.q_a_proj.weight_scale_inv")
        .unwrap();
    assert_eq!(s.dtype, keep_checkpoint::Dtype::F8_E8M0, "{}", s.name);
    // DeepSeek's own scales are any float32: one that is not a power of two has no E8M0 byte,
    // and the repack is refused naming the weight (nothing written).
    let bad = w.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, bad.join(f.file_name().unwrap())).unwrap();
    }
    let name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv";
    let shard = std::fs::read_dir(&bad)
        .unwrap()
        .map(|f| f.unwrap().path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "safetensors")
                && std::fs::read(p)
                    .unwrap()
                    .windows(name.len())
                    .any(|w| w == name.as_bytes())
        })
        .unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let at = 8 + n + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[at..at + 4].copy_from_slice(&1.5f32.to_le_bytes());
    std::fs::write(&shard, bytes).unwrap();
    let _ = std::fs::remove_file(bad.join("SHA256SUMS"));
    keep(&cache)
        .arg("repack")
        .arg(&bad)
        .arg(w.join("bad-mx"))
        .args(["--resident-format", "mxfp8"])
        .assert()
        .failure()
        .stderr(
            predicate::str::contains("`model.layers.1.self_attn.q_a_proj.weight`")
                .and(predicate::str::contains("not an exact power of two")),
        );
    assert!(!w.join("bad-mx").exists());

    // Pack, calibrate (layer-streamed: the dense layer, then the MoE layers), finalize.
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
    // Residency replays the run's routes with the experts' bytes (the dense layer has none).
    let rep = stdout(
        keep(&cache)
            .arg("residency")
            .arg(&run)
            .args(["--hot", "4,8", "--model"])
            .arg(&src),
    );
    assert!(
        rep.contains("verdict") && !rep.contains("expert 0 B"),
        "{rep}"
    );

    // A plan blind to the router's groups leaves them uneven: refused, naming the way out.
    let blind = w.join("blind.json");
    select(&cache, &run, "8", &[], &blind);
    let b = json(&blind);
    let uneven = b["layers"].as_array().unwrap().iter().any(|l| {
        l["survivors"].as_array().is_some_and(|s| {
            (0..4).any(|g| s.iter().filter(|e| e.as_u64().unwrap() / 4 == g).count() != 2)
        })
    });
    assert!(uneven, "{b}");
    keep(&cache)
        .arg("prune")
        .arg(&src)
        .arg(w.join("no"))
        .arg("--plan")
        .arg(&blind)
        .assert()
        .failure()
        .stderr(predicate::str::contains("keep select --groups 4"));

    // Select 2 of 4 in every group and prune.
    let plan = w.join("plan.json");
    select(&cache, &run, "8", &["--groups", "4"], &plan);
    let p = json(&plan);
    assert!(p["layers"][0]["survivors"].is_null(), "the dense layer");
    for l in 1..3 {
        let s: Vec<u64> = p["layers"][l]["survivors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_u64().unwrap())
            .collect();
        for g in 0..4 {
            assert_eq!(s.iter().filter(|&&e| e / 4 == g).count(), 2, "{s:?}");
        }
    }
    let pruned = w.join("pruned");
    keep(&cache)
        .arg("prune")
        .arg(&src)
        .arg(&pruned)
        .arg("--plan")
        .arg(&plan)
        .assert()
        .success();
    keep(&cache).arg("verify").arg(&pruned).assert().success();
    let pc = json(&pruned.join("config.json"));
    assert_eq!(
        (&pc["n_routed_experts"], &pc["n_group"], &pc["topk_group"]),
        (&8.into(), &4.into(), &2.into())
    );
    let ck = keep_checkpoint::Checkpoint::open(&pruned).unwrap();
    for l in 1..3 {
        let bias = ck
            .get(&format!(
                "model.layers.{l}.mlp.gate.e_score_correction_bias"
            ))
            .unwrap();
        assert_eq!(bias.shape, [8]);
        assert_eq!(
            ck.get(&format!("model.layers.{l}.mlp.gate.weight"))
                .unwrap()
                .shape,
            [8, 256]
        );
        assert!(ck
            .get(&format!("model.layers.{l}.mlp.experts.7.down_proj.weight"))
            .is_some());
        assert!(ck
            .get(&format!("model.layers.{l}.mlp.experts.8.down_proj.weight"))
            .is_none());
    }
    let report = stdout(keep(&cache).arg("inspect").arg(&pruned));
    assert!(report.contains("no problems found"), "{report}");
    assert!(report.contains("8 in each of 2 layers"), "{report}");

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
    // Whole and under the least budget (8 experts a layer, top-4 slots: the dense layer has
    // none): the same greedy tokens.
    let (whole_run, budget_run) = whole_and_least_budget(&cache, &pruned);
    assert!(!whole_run.is_empty());
    assert_eq!(whole_run, budget_run);

    // Quantize the pruned model's routed experts to E8P (its own calibration's imatrix; the
    // dense layer left as it is), and score it against the same teacher.
    let prun = w.join("prun");
    keep(&cache)
        .arg("calibrate")
        .arg(&pruned)
        .arg("--pack")
        .arg(&pack)
        .arg("--out")
        .arg(&prun)
        .assert()
        .success();
    keep(&cache).arg("finalize").arg(&prun).assert().success();
    let q = w.join("q");
    keep(&cache)
        .arg("quant")
        .arg(&pruned)
        .arg("--imatrix")
        .arg(&prun)
        .args(["--format", "e8p2", "--out"])
        .arg(&q)
        .assert()
        .success();
    keep(&cache).arg("verify").arg(&q).assert().success();
    let ck = keep_checkpoint::Checkpoint::open(&q).unwrap();
    let codes = ck
        .get("model.layers.1.mlp.experts.3.gate_proj.weight")
        .unwrap();
    assert_eq!(codes.dtype, keep_checkpoint::Dtype::U16, "E8P codes");
    assert!(ck
        .get("model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv")
        .is_none());
    assert!(ck
        .get("model.layers.0.mlp.gate_proj.weight_scale_inv")
        .is_some());
    let report = stdout(keep(&cache).arg("inspect").arg(&q));
    assert!(report.contains("no problems found"), "{report}");
    let scored = eval(&q, None);
    let kq: f64 = kl(&scored, "model").parse().unwrap();
    let kp: f64 = kl(&eval(&pruned, None), "model").parse().unwrap();
    // E8P costs little over pruning (0.045 against 0.043 nats); with the incoherence rotation
    // (`--incoherence auto`) not undone on the experts' outputs it is twice the pruned KL.
    assert!(
        kq.is_finite() && kq < kp * 1.5,
        "quantized KL {kq}, pruned {kp}"
    );
    keep(&cache)
        .arg("run")
        .arg(&q)
        .args(["--prompt-tokens", "8", "--max-tokens", "4"])
        .assert()
        .success();

    // Keeping every expert: the same logits bit for bit.
    let all = w.join("all.json");
    select(&cache, &run, "16", &["--groups", "4"], &all);
    let whole = w.join("whole");
    keep(&cache)
        .arg("prune")
        .arg(&src)
        .arg(&whole)
        .arg("--plan")
        .arg(&all)
        .assert()
        .success();
    assert_eq!(
        logits(&cache, &src, &w.join("a.safetensors")),
        logits(&cache, &whole, &w.join("b.safetensors"))
    );
}
