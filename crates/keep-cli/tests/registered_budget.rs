//! Every format of keep-format's registry streams under `--memory-budget`: a DeepSeek-V3-family
//! checkpoint whose routed experts are in the format (`keep synth --experts NAME`: INT4 group 32
//! as Kimi-K2-Thinking's, NVFP4 with its per-tensor global scale) runs under the least budget
//! keep accepts with the same greedy tokens as mapped whole, its experts read from the store
//! (every part the entry's kernels read, in the slot), and the plan's expert bytes are those
//! parts' bytes.

use std::path::Path;

use assert_cmd::Command;
use keep_checkpoint::Checkpoint;

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

const RUN: [&str; 6] = [
    "--prompt-tokens",
    "8",
    "--max-tokens",
    "6",
    "--temperature",
    "0",
];

/// The greedy tokens of `keep run MODEL` (the line of token ids it prints).
fn tokens(cache: &Path, model: &Path, extra: &[&str]) -> String {
    let out = keep(cache)
        .arg("run")
        .arg(model)
        .args(RUN)
        .args(extra)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    String::from_utf8(out)
        .unwrap()
        .lines()
        .find(|l| l.chars().next().is_some_and(|c| c.is_ascii_digit()))
        .unwrap_or_default()
        .to_string()
}

/// The least `--memory-budget` keep accepts: the one a budget of one byte is refused naming.
fn least_budget(cache: &Path, model: &Path) -> String {
    let refused = keep(cache)
        .arg("run")
        .arg(model)
        .args(RUN)
        .args(["--memory-budget", "1"])
        .assert()
        .failure()
        .get_output()
        .stderr
        .clone();
    let refused = String::from_utf8(refused).unwrap();
    refused
        .split("give a budget ≥ ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no least budget named: {refused}"))
        .to_string()
}

#[test]
fn every_registered_format_runs_under_the_least_budget_as_mapped() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let names: Vec<&str> = keep_format::registry::REGISTRY
        .iter()
        .map(|f| f.name)
        .collect();
    assert!(
        names.contains(&"int4-g32") && names.contains(&"nvfp4"),
        "{names:?}"
    );
    for f in keep_format::registry::REGISTRY {
        let q = w.join(f.name);
        keep(&cache)
            .args(["synth", "--family", "deepseek_v3", "--experts", f.name])
            .arg("--config")
            .arg(&cfg)
            .arg("--out")
            .arg(&q)
            .assert()
            .success();
        // One routed expert's matrices: every part the kernels read, by the entry.
        let ck = Checkpoint::open(&q).unwrap();
        let c = ck.config().unwrap().clone();
        let expert: u64 = keep_checkpoint::naming::ExpertMat::ALL
            .iter()
            .map(|&m| {
                let em = keep_checkpoint::layout::expert_matrix(&ck, &c, 1, 0, m).unwrap();
                let computed = f.computed().count();
                assert_eq!(
                    1 + usize::from(em.scale.is_some()) + em.further.len(),
                    computed,
                    "{}: the matrix carries every part the kernels read",
                    f.name
                );
                em.bytes()
            })
            .sum();
        drop(ck);

        let whole = tokens(&cache, &q, &[]);
        assert!(!whole.is_empty(), "{}: no tokens", f.name);
        let least = least_budget(&cache, &q);
        let stats = w.join(format!("{}.stats.json", f.name));
        let budget = tokens(
            &cache,
            &q,
            &[
                "--memory-budget",
                &least,
                "--stats-json",
                stats.to_str().unwrap(),
            ],
        );
        assert_eq!(
            budget, whole,
            "{}: greedy tokens under --memory-budget {least} vs mapped",
            f.name
        );
        let s = keep_artifacts::run_stats::read(&stats).unwrap();
        let p = s.plan.expect("a budgeted run has a plan");
        assert_eq!(
            p.expert_bytes, expert,
            "{}: the store reads every part the kernels read",
            f.name
        );
        let read: u64 = [&s.prefill_cache, &s.decode_cache]
            .iter()
            .filter_map(|c| c.as_ref())
            .map(|c| c.experts_read)
            .sum();
        let misses: u64 = [&s.prefill_cache, &s.decode_cache]
            .iter()
            .filter_map(|c| c.as_ref())
            .map(|c| c.misses)
            .sum();
        assert!(
            read > 0 && misses > 0,
            "{}: no expert was read from the store ({read} read, {misses} misses)",
            f.name
        );
        eprintln!(
            "{}: least budget {least}, {read} experts read from the store, tokens {budget}",
            f.name
        );
    }
}
