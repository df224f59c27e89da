//! `keep run --memory-budget` keeps its promise on a model whose routed experts (158 MiB) exceed
//! the line it is held to: for each prompt length the binary is asked for the least budget that
//! holds the run (a budget of one byte is refused naming it), then run at exactly that budget,
//! and the child's peak resident set (from `wait4`'s rusage) stays within the budget plus
//! `FIXED_OVERHEAD`, while the same run without `--memory-budget` (the mmap model, which keeps
//! what it touches) goes past that line — so a run that ignored the budget would fail. A prompt
//! past the bundled model's context, and a long context in a budget too small for its cache,
//! are refused with exit 1 before anything is allocated. Linux only (`ru_maxrss` in KiB).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use keep_runtime::FIXED_OVERHEAD;

/// Prompt lengths run here (the full 16..16k table on the bundled model comes from
/// `dev/budget_vs_prompt.sh`); small enough to run in seconds on two cores.
const PROMPTS: [usize; 3] = [16, 200, 700];

struct Outcome {
    code: i32,
    stdout: String,
    stderr: String,
    peak_rss: u64,
}

/// Run `keep run ARGS` as a child with its own cache dir; its exit code, stderr and peak RSS.
fn keep_run(args: &[String], dir: &Path) -> Outcome {
    let err_path = dir.join(format!("stderr-{}", args.join("_").replace('/', "_")));
    let err = std::fs::File::create(&err_path).unwrap();
    let out_path = dir.join(format!("stdout-{}", args.join("_").replace('/', "_")));
    let out = std::fs::File::create(&out_path).unwrap();
    // Reaped by wait4 below (for its rusage), not by Child::wait.
    #[allow(clippy::zombie_processes)]
    let child = Command::new(env!("CARGO_BIN_EXE_keep"))
        .arg("run")
        .args(args)
        .env("KEEP_CACHE_DIR", dir.join("cache"))
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap();
    let mut status = 0i32;
    // SAFETY: a zeroed rusage is a valid value; wait4 fills it for our own child.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut ru) };
    assert_eq!(pid, child.id() as libc::pid_t, "wait4 failed");
    assert!(libc::WIFEXITED(status), "keep run was killed: {status}");
    Outcome {
        code: libc::WEXITSTATUS(status),
        stdout: std::fs::read_to_string(&out_path).unwrap(),
        stderr: std::fs::read_to_string(&err_path).unwrap(),
        peak_rss: ru.ru_maxrss as u64 * 1024,
    }
}

/// keep synth's tiny preset with 96 routed experts of width 1024 per layer (8 layers, 158 MiB
/// of routed experts, as keep-runtime's `peak_rss` test): experts larger than any budget here
/// plus the fixed overhead.
fn wide_model(dir: &Path) -> PathBuf {
    let (cfg, _) = keep_convert::presets::preset("tiny").unwrap();
    let mut raw = cfg.raw.clone();
    raw["n_routed_experts"] = 96.into();
    raw["moe_intermediate_size"] = 1024.into();
    let config = dir.join("wide.json");
    std::fs::write(&config, serde_json::to_vec(&raw).unwrap()).unwrap();
    let out = dir.join("wide");
    let st = Command::new(env!("CARGO_BIN_EXE_keep"))
        .args(["synth", "--seed", "7", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&out)
        .env("KEEP_CACHE_DIR", dir.join("cache"))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "keep synth failed");
    out
}

/// Bytes of `model`'s files (its routed experts are 158 MiB of them).
fn model_bytes(model: &Path) -> u64 {
    std::fs::read_dir(model)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn args(
    model: Option<&Path>,
    budget: Option<u64>,
    prompt: usize,
    max_tokens: usize,
) -> Vec<String> {
    let mut a: Vec<String> = model.map(|m| m.display().to_string()).into_iter().collect();
    if let Some(b) = budget {
        a.extend(["--memory-budget".to_string(), b.to_string()]);
    }
    a.extend([
        "--prompt-tokens".to_string(),
        prompt.to_string(),
        "--max-tokens".into(),
        max_tokens.to_string(),
        "--temperature".into(),
        "0".into(),
        // Without drafting: the bundled model's MTP module makes `--draft auto` the default,
        // which plans K more positions and the module; this file checks the plain budget.
        "--draft".into(),
        "none".into(),
    ]);
    a
}

/// The least budget the binary names when refusing `budget`.
fn needed(o: &Outcome) -> u64 {
    let at = o
        .stderr
        .find("at least ")
        .unwrap_or_else(|| panic!("no need named: {}", o.stderr));
    o.stderr[at + 9..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after `at least`: {}", o.stderr))
}

#[cfg(target_os = "linux")]
#[test]
fn peak_rss_stays_within_budget_plus_overhead() {
    let td = tempfile::tempdir().unwrap();
    let model = wide_model(td.path());
    let m = Some(model.as_path());
    let mut last_need = 0;
    for &p in &PROMPTS {
        let refused = keep_run(&args(m, Some(1), p, 8), td.path());
        assert_eq!(refused.code, 1, "{}", refused.stderr);
        let need = needed(&refused);
        assert!(
            refused
                .stderr
                .contains(&format!("context of {} tokens", p + 7)),
            "{}",
            refused.stderr
        );
        assert!(
            need > last_need,
            "a longer context needs more ({need} after {last_need})"
        );
        last_need = need;
        let line = need + FIXED_OVERHEAD;
        let experts = model_bytes(&model);
        assert!(
            line + (32 << 20) < experts,
            "the model ({experts} bytes) must exceed budget + overhead ({line}) to tell"
        );
        let ok = keep_run(&args(m, Some(need), p, 8), td.path());
        assert_eq!(ok.code, 0, "prompt {p} at budget {need}: {}", ok.stderr);
        let plain = keep_run(&args(m, None, p, 8), td.path());
        assert_eq!(
            plain.code, 0,
            "prompt {p} without a budget: {}",
            plain.stderr
        );
        eprintln!(
            "prompt {p}: budget {need}, peak RSS {} (overhead {}); without the budget {}",
            ok.peak_rss,
            ok.peak_rss as i64 - need as i64,
            plain.peak_rss
        );
        assert!(
            ok.peak_rss <= line,
            "prompt {p}: peak RSS {} > budget {need} + overhead {FIXED_OVERHEAD}",
            ok.peak_rss
        );
        assert!(
            plain.peak_rss > line,
            "prompt {p}: the run without a budget peaked at {}, within budget {need} + overhead {FIXED_OVERHEAD}: this check could not tell a run that ignored the budget",
            plain.peak_rss
        );
    }
}

#[cfg(target_os = "linux")]
#[test]
fn long_contexts_that_cannot_fit_are_refused() {
    let td = tempfile::tempdir().unwrap();
    // Past the bundled model's 4096 positions.
    let o = keep_run(&args(None, Some(3 << 20), 8000, 8), td.path());
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(o.stderr.contains("max_position_embeddings"), "{}", o.stderr);
    assert!(
        o.peak_rss < 64 << 20,
        "refused before allocating: {}",
        o.peak_rss
    );
    // Within the positions but not within 3 MiB: refused naming what the context takes.
    let o = keep_run(&args(None, Some(3 << 20), 4000, 8), td.path());
    assert_eq!(o.code, 1, "{}", o.stderr);
    assert!(
        o.stderr.contains("context of 4007 tokens takes"),
        "{}",
        o.stderr
    );
    assert!(needed(&o) > 3 << 20);
}

/// Engram tables larger than the budget are never resident, and the default row cache is cut to
/// what the budget leaves: `keep synth --engram-bytes 64MiB` (67 MiB of tables) runs at a
/// 48 MiB budget, writes the same greedy tokens as the run without a budget, and its peak
/// resident set stays within the budget plus `FIXED_OVERHEAD`.
#[cfg(target_os = "linux")]
#[test]
fn engram_tables_larger_than_the_budget_run_inside_it() {
    let td = tempfile::tempdir().unwrap();
    let model = td.path().join("eng");
    let st = Command::new(env!("CARGO_BIN_EXE_keep"))
        .args([
            "synth",
            "--preset",
            "tiny",
            "--engram-bytes",
            "64MiB",
            "--out",
        ])
        .arg(&model)
        .env("KEEP_CACHE_DIR", td.path().join("cache"))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "keep synth failed");
    let budget: u64 = 48 << 20;
    assert!(model_bytes(&model) > budget + (16 << 20));
    let m = Some(model.as_path());
    let plain = keep_run(&args(m, None, 24, 12), td.path());
    assert_eq!(plain.code, 0, "without a budget: {}", plain.stderr);
    let stats = td.path().join("stats.json");
    let mut a = args(m, Some(budget), 24, 12);
    a.extend(["--stats-json".to_string(), stats.display().to_string()]);
    let ok = keep_run(&a, td.path());
    assert_eq!(ok.code, 0, "at {budget}: {}", ok.stderr);
    assert!(!plain.stdout.trim().is_empty());
    assert_eq!(ok.stdout, plain.stdout, "the same greedy tokens");
    assert!(
        ok.peak_rss <= budget + FIXED_OVERHEAD,
        "peak RSS {} > budget {budget} + overhead {FIXED_OVERHEAD}",
        ok.peak_rss
    );
    let s = keep_artifacts::run_stats::read(&stats).unwrap();
    let p = s.plan.expect("a budgeted run has a plan");
    let cache = p.engram_cache_bytes.expect("the model has Engram layers");
    assert!(cache > 0 && cache < budget, "row cache {cache}");
    assert!(
        p.residents >= cache,
        "the row cache is counted in the budget"
    );
    let e = s.prefill_engram.expect("prefill Engram counters");
    assert!(e.misses > 0 && e.bytes_read >= e.useful_bytes, "{e:?}");
    // Reads are whole blocks of the device, said how it was found.
    assert!(
        e.block_bytes.is_power_of_two() && e.block_bytes <= 4096,
        "{e:?}"
    );
    assert!(e.bytes_read.is_multiple_of(e.block_bytes), "{e:?}");
    assert!(
        ["statx", "sysfs", "default"].contains(&e.block_source.as_str()),
        "{e:?}"
    );
}
