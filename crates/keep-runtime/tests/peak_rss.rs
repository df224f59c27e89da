//! Peak RSS of a budgeted run, measured in a child process of its own (this test binary re-run
//! with one ignored test selected), from `/proc/self/status` `VmHWM`: it stays within the budget
//! plus [`TEST_OVERHEAD`], while the same prompt through the plain mmap model — which touches
//! every routed expert it uses — goes well past it. Linux only (procfs).

mod common;

use std::process::Command;

use keep_checkpoint::Checkpoint;
use keep_model::{Logits, Model};
use keep_runtime::{peak_rss_bytes, BudgetPlan, BudgetedModel, RuntimeOptions};

/// What a small model's run adds beyond the budget: the test binary and its libraries (~10 MiB),
/// the allocator, thread stacks (8 I/O threads), activations and KV cache of a 64-token run.
/// Real models add more activations (see `FIXED_OVERHEAD`, documented in the README).
const TEST_OVERHEAD: u64 = 64 << 20;

fn child(which: &str, model: &std::path::Path, budget: u64) -> u64 {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "--exact",
            "rss_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KEEP_RSS_CHILD", which)
        .env("KEEP_RSS_MODEL", model)
        .env("KEEP_RSS_BUDGET", budget.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "child failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.split_once("peak_rss=").map(|x| x.1))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no peak_rss in the child's output: {text}"))
}

#[test]
fn peak_rss_within_budget_plus_overhead() {
    if peak_rss_bytes().is_none() {
        eprintln!("no /proc/self/status here: skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 96 experts of width 1024 in 8 layers: ~160 MB of routed experts.
    let path = common::synth_tiny(dir.path(), "wide", Some(96), Some(1024));
    let ck = Checkpoint::open(&path).unwrap();
    let probe = BudgetedModel::load(&ck, &RuntimeOptions::new(u64::MAX / 4)).unwrap();
    let p = probe.plan().clone();
    let experts = probe.cache().store().total_bytes();
    drop(probe);
    let budget = BudgetPlan::minimum(p.fixed(), p.slot_bytes, p.n_layers, p.top_k + 4);
    assert!(
        budget + TEST_OVERHEAD < experts,
        "the test must be able to tell"
    );
    let with = child("budget", &path, budget);
    let plain = child("plain", &path, budget);
    eprintln!(
        "budget {budget}, experts {experts}: peak RSS {with} with the budget, {plain} through mmap"
    );
    assert!(
        with <= budget + TEST_OVERHEAD,
        "peak RSS {with} > budget {budget} + overhead {TEST_OVERHEAD}"
    );
    assert!(
        plain > with + experts / 2,
        "the mmap run should touch the experts ({plain} vs {with})"
    );
}

/// The child: one run (prefill 48 + decode 16) and its peak RSS.
#[test]
#[ignore]
fn rss_child() {
    let (Ok(which), Ok(model), Ok(budget)) = (
        std::env::var("KEEP_RSS_CHILD"),
        std::env::var("KEEP_RSS_MODEL"),
        std::env::var("KEEP_RSS_BUDGET"),
    ) else {
        return;
    };
    let ck = Checkpoint::open(std::path::Path::new(&model)).unwrap();
    let budget: u64 = budget.parse().unwrap();
    let mut tok = 0u32;
    match which.as_str() {
        "budget" => {
            let mut m = BudgetedModel::load(&ck, &RuntimeOptions::new(budget)).unwrap();
            let mut cache = m.new_cache();
            let prompt = common::prompt(48, m.cfg().vocab);
            m.forward(&prompt, &mut cache, Logits::None, None).unwrap();
            for _ in 0..16 {
                let l = m.forward(&[tok], &mut cache, Logits::Last, None).unwrap();
                tok = keep_model::generate::argmax(&l);
            }
        }
        _ => {
            let m = Model::load(&ck).unwrap();
            let mut cache = m.new_cache();
            let prompt = common::prompt(48, m.cfg.vocab);
            m.forward(&prompt, &mut cache, Logits::None, None).unwrap();
            for _ in 0..16 {
                let l = m.forward(&[tok], &mut cache, Logits::Last, None).unwrap();
                tok = keep_model::generate::argmax(&l);
            }
        }
    }
    println!("peak_rss={}", peak_rss_bytes().unwrap_or(0));
}
