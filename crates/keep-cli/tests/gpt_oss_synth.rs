//! `keep synth --family gpt_oss` on a small config (3 layers, sliding and full alternating, 8
//! experts top-2 in OpenAI's MXFP4 stacks, sinks, YaRN): the checkpoint passes the layout check
//! and runs.

use std::path::Path;

use assert_cmd::Command;
use predicates::prelude::*;

const CONFIG: &str = r#"{"architectures":["GptOssForCausalLM"],"model_type":"gpt_oss",
  "vocab_size":512,"hidden_size":128,"intermediate_size":64,"num_hidden_layers":3,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"num_local_experts":8,
  "num_experts_per_tok":2,"sliding_window":4,"rope_theta":150000.0,
  "max_position_embeddings":4096,"rms_norm_eps":1e-5,"swiglu_limit":7.0,
  "attention_bias":true,"tie_word_embeddings":false,"bos_token_id":0,"eos_token_id":1,
  "rope_scaling":{"rope_type":"yarn","factor":32.0,"original_max_position_embeddings":4096,
  "beta_fast":32.0,"beta_slow":1.0,"truncate":false}}"#;

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

#[test]
fn a_synthesised_gpt_oss_checkpoint_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let out = w.join("g");
    keep(&cache)
        .args(["synth", "--family", "gpt_oss", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&out)
        .assert()
        .success()
        .stdout(predicate::str::contains("gpt_oss, 3 layers"));
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["quantization_config"]["quant_method"], "mxfp4");
    assert_eq!(
        c["layer_types"],
        serde_json::json!(["sliding_attention", "full_attention", "sliding_attention"])
    );
    keep(&cache)
        .arg("inspect")
        .arg(&out)
        .assert()
        .success()
        .stdout(predicate::str::contains("no problems found"));
    keep(&cache)
        .arg("run")
        .arg(&out)
        .args(["--prompt-tokens", "8", "--max-tokens", "4"])
        .assert()
        .success();
    keep(&cache)
        .args([
            "synth", "--family", "gpt_oss", "--format", "fp8", "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(w.join("no"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("mxfp4"));
}
