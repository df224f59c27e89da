//! `keep synth --draft dspark` writes a V4.1 checkpoint with a DSpark drafter that `keep inspect`
//! reports without unknown tensors; `keep run --draft dspark` on it prints what `--draft none`
//! prints (greedy) with the drafting stats, `--draft auto` picks DSpark, and `--draft dspark`
//! on a checkpoint without the drafter is refused naming what is missing; `--draft-confidence`
//! keeps the output and is refused without a DSpark drafter.

use std::path::Path;
use std::process::{Command, Output};

fn keep(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keep"))
        .args(args)
        .env("KEEP_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn synth_inspect_and_run_with_dspark() {
    let dir = tempfile::tempdir().unwrap();
    let ds = dir.path().join("tds");
    let ds = ds.to_str().unwrap();
    let o = keep(
        &[
            "synth", "--preset", "tiny", "--draft", "dspark", "--out", ds,
        ],
        dir.path(),
    );
    assert!(o.status.success(), "{:?}", text(&o));

    let o = keep(&["inspect", ds], dir.path());
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("mtp_proj"), "{out}");
    assert!(
        !out.to_lowercase().contains("unknown") && !err.to_lowercase().contains("unknown"),
        "{out}\n{err}"
    );

    let run_with = |draft: &str, more: &[&str]| {
        let mut args = vec![
            "run",
            ds,
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--draft",
            draft,
        ];
        args.extend_from_slice(more);
        let o = keep(&args, dir.path());
        let (out, err) = text(&o);
        assert!(o.status.success(), "--draft {draft}: {err}");
        (out, err)
    };
    let run = |draft: &str| run_with(draft, &[]);
    let (none, _) = run("none");
    let (dspark, err) = run("dspark");
    assert_eq!(dspark, none, "--draft dspark changed the greedy output");
    assert!(err.contains("draft: K = 5"), "{err}");
    assert!(err.contains("acceptance by position"), "{err}");
    let (floor, _) = run_with("dspark", &["--draft-confidence", "0.2"]);
    assert_eq!(floor, none, "--draft-confidence changed the greedy output");
    let (auto, err) = run("auto");
    assert_eq!(auto, none);
    assert!(
        err.contains("draft: K = 5"),
        "--draft auto did not pick DSpark: {err}"
    );

    let plain = dir.path().join("plain");
    let plain = plain.to_str().unwrap();
    let o = keep(&["synth", "--preset", "tiny", "--out", plain], dir.path());
    assert!(o.status.success(), "{:?}", text(&o));
    let o = keep(
        &[
            "run",
            plain,
            "--prompt-tokens",
            "4",
            "--max-tokens",
            "4",
            "--draft",
            "dspark",
        ],
        dir.path(),
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.contains("--draft dspark") && err.contains("no DSpark drafter"),
        "{err}"
    );
    let o = keep(
        &[
            "run",
            plain,
            "--prompt-tokens",
            "4",
            "--max-tokens",
            "4",
            "--draft-confidence",
            "0.5",
        ],
        dir.path(),
    );
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--draft-confidence"), "{err}");
}
