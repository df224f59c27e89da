//! `keep synth --family deepseek_v3` on a small config (3 layers, the first dense; multi-head
//! latent attention with `q_lora_rank`, YaRN; 16 experts in 4 groups, a shared expert): the
//! checkpoint in each layout DeepSeek ships (bf16, FP8 128×128 blocks with float32
//! `weight_scale_inv`) passes the layout check, `keep inspect` names every tensor and finds no
//! problem, and it runs.

use std::path::Path;

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

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

#[test]
fn synthesised_deepseek_v3_checkpoints_load_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    for (format, layout) in [("bf16", "bf16"), ("fp8", "fp8-block 128x128 f32")] {
        let out = w.join(format);
        keep(&cache)
            .args([
                "synth",
                "--family",
                "deepseek_v3",
                "--format",
                format,
                "--config",
            ])
            .arg(&cfg)
            .arg("--out")
            .arg(&out)
            .assert()
            .success()
            .stdout(predicate::str::contains("deepseek_v3, 3 layers"));
        let c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(
            c["quantization_config"]["weight_block_size"].is_array(),
            format == "fp8"
        );
        keep(&cache)
            .arg("inspect")
            .arg(&out)
            .assert()
            .success()
            .stdout(predicate::str::contains("16 in each of 2 layers"))
            .stdout(predicate::str::contains(layout))
            // Every tensor named, the dense first layer expected without routed experts.
            .stdout(predicate::str::contains("no problems found"));
        keep(&cache)
            .arg("run")
            .arg(&out)
            .args(["--prompt-tokens", "8", "--max-tokens", "4"])
            .assert()
            .success();
    }
    // --layers keeps the first layers; a V4 flag is refused.
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--layers",
            "1",
            "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(w.join("one"))
        .assert()
        .success()
        .stdout(predicate::str::contains("1 layers"));
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--block",
            "32",
            "--preset",
            "kimi-k2",
        ])
        .arg("--out")
        .arg(w.join("no"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("--block"));
}
