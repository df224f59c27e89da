//! The `keep` binary driven as a careless or hostile user would drive it: every verb's bad input
//! goes through here, and each case asserts the exit status, that the message says what is
//! wrong and names the user's path, and that the user's files survive byte for byte.
//!
//! Models are made by `keep synth --preset tiny` once per test process; the cache directory is
//! a temporary one (`KEEP_CACHE_DIR`), so the tests never touch the user's cache.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use assert_cmd::Command;
use predicates::prelude::*;

/// A scratch area shared by the tests of this process: a tiny synthetic model and a cache dir.
struct Scratch {
    _dir: tempfile::TempDir,
    root: PathBuf,
    model: PathBuf,
    cache: PathBuf,
}

fn scratch() -> &'static Scratch {
    static S: OnceLock<Scratch> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let cache = root.join("cache");
        std::fs::create_dir_all(&cache).unwrap();
        let model = root.join("tiny");
        Command::cargo_bin("keep")
            .unwrap()
            .env("KEEP_CACHE_DIR", &cache)
            .args(["synth", "--preset", "tiny", "--out"])
            .arg(&model)
            .assert()
            .success();
        Scratch {
            _dir: dir,
            root,
            model,
            cache,
        }
    })
}

/// The `keep` binary with the scratch cache.
fn keep() -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", &scratch().cache);
    c
}

/// A fresh directory for one test.
fn workdir(name: &str) -> PathBuf {
    let d = scratch().root.join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every file under `dir` with its bytes, sorted by path (to show a directory survived).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = vec![];
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// A copy of the scratch model (for tests that try to destroy it).
fn copy_model(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(&scratch().model).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

// ---------------------------------------------------------------------------------------------
// Single-file outputs: never replaced without --force, never replaced if not a regular file.

#[test]
fn logits_out_refuses_existing_file_without_force_and_replaces_with_it() {
    let w = workdir("logits-existing");
    let out = w.join("l.safetensors");
    std::fs::write(&out, b"precious").unwrap();
    keep()
        .arg("logits")
        .arg(&scratch().model)
        .args(["--tokens", "1,2,3", "--out"])
        .arg(&out)
        .assert()
        .code(1)
        .stderr(
            predicate::str::contains("already exists")
                .and(predicate::str::contains("l.safetensors")),
        );
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    keep()
        .arg("logits")
        .arg(&scratch().model)
        .args(["--tokens", "1,2,3", "--force", "--out"])
        .arg(&out)
        .assert()
        .success();
    assert_ne!(std::fs::read(&out).unwrap(), b"precious");
    // Nothing but the output is left in the directory (no temporaries).
    assert_eq!(std::fs::read_dir(&w).unwrap().count(), 1);
}

#[test]
fn single_file_outputs_refuse_non_regular_targets_even_with_force() {
    let w = workdir("non-regular");
    let fifo = w.join("fifo");
    mkfifo(&fifo);
    let dir = w.join("adir");
    std::fs::create_dir(&dir).unwrap();
    let target = w.join("target");
    std::fs::write(&target, b"linked").unwrap();
    let link = w.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    for (p, what) in [
        (&fifo, "a FIFO"),
        (&dir, "a directory"),
        (&link, "a symbolic link"),
    ] {
        keep()
            .arg("logits")
            .arg(&scratch().model)
            .args(["--tokens", "1,2", "--force", "--out"])
            .arg(p)
            .assert()
            .code(1)
            .stderr(
                predicate::str::contains(what).and(predicate::str::contains(p.to_str().unwrap())),
            );
        keep()
            .arg("run")
            .arg(&scratch().model)
            .args([
                "--prompt-tokens",
                "2",
                "--max-tokens",
                "1",
                "--force",
                "--stats-json",
            ])
            .arg(p)
            .assert()
            .code(1)
            .stderr(predicate::str::contains(what));
    }
    {
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo());
    }
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&target).unwrap(), b"linked");
    assert!(dir.is_dir());
}

#[test]
fn logits_never_overwrites_a_shard_of_the_model_it_reads() {
    let w = workdir("logits-shard");
    let m = w.join("m");
    copy_model(&m);
    let before = snapshot(&m);
    for force in [false, true] {
        let mut c = keep();
        c.arg("logits")
            .arg(&m)
            .args(["--tokens", "1,2,3", "--out"])
            .arg(m.join("model.safetensors"));
        if force {
            c.arg("--force");
        }
        c.assert()
            .code(1)
            .stderr(predicate::str::contains("model.safetensors"));
    }
    assert_eq!(snapshot(&m), before);
}

#[test]
fn run_stats_json_and_record_routes_refuse_existing_files() {
    let w = workdir("run-outputs");
    for flag in ["--stats-json", "--record-routes"] {
        let p = w.join(format!("{}.out", &flag[2..]));
        std::fs::write(&p, b"keep me").unwrap();
        keep()
            .arg("run")
            .arg(&scratch().model)
            .args(["--prompt-tokens", "2", "--max-tokens", "1", flag])
            .arg(&p)
            .assert()
            .code(1)
            .stderr(predicate::str::contains("already exists"));
        assert_eq!(std::fs::read(&p).unwrap(), b"keep me");
        keep()
            .arg("run")
            .arg(&scratch().model)
            .args(["--prompt-tokens", "2", "--max-tokens", "1", "--force", flag])
            .arg(&p)
            .assert()
            .success();
        assert_ne!(std::fs::read(&p).unwrap(), b"keep me");
    }
}

// ---------------------------------------------------------------------------------------------
// Directory outputs: never the input, inside it, around it, or in keep's cache.

#[test]
fn repack_refuses_an_output_that_is_or_contains_its_input() {
    let w = workdir("repack-overlap");
    let m = w.join("d").join("m");
    copy_model(&m);
    let before = snapshot(&w);
    let same = m.join("..").join("m");
    for (out, how) in [
        (&same, "is the input"),
        (&m, "is the input"),
        (&w.join("d"), "contains the input"),
        (&m.join("sub"), "lies inside the input"),
    ] {
        keep()
            .arg("repack")
            .arg(&m)
            .arg(out)
            .args(["--resident-format", "mxfp8", "--force"])
            .assert()
            .code(1)
            .stderr(predicate::str::contains(how));
    }
    assert_eq!(snapshot(&w), before);
}

#[test]
fn prune_refuses_its_own_input_and_keeps_cache() {
    let w = workdir("prune-overlap");
    let m = w.join("m");
    copy_model(&m);
    let before = snapshot(&m);
    let plan = w.join("plan.json");
    std::fs::write(&plan, b"{}").unwrap();
    keep()
        .args(["prune", "--force", "--plan"])
        .arg(&plan)
        .arg(&m)
        .arg(&m)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("is the input"));
    assert_eq!(snapshot(&m), before);
    // An output inside keep's cache (where the bundled model lives) is refused.
    let cached = scratch().cache.join("models").join("keep-tiny-x");
    keep()
        .args(["prune", "--force", "--plan"])
        .arg(&plan)
        .arg(&m)
        .arg(&cached)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("keep's cache"));
    assert!(!cached.exists());
}

#[test]
fn a_stranded_old_output_is_restored_by_the_next_writer() {
    let w = workdir("stranded");
    let out = w.join("out");
    // What an interrupted two-rename replace leaves: OUT gone, the old copy beside it.
    let old = w.join(".out.keep-old");
    std::fs::create_dir(&old).unwrap();
    std::fs::write(old.join("x"), b"old").unwrap();
    std::fs::write(
        old.join("SHA256SUMS"),
        "cba06b5736faf67e54b07b561eae94395e774c517a7d910a54369e1263ccfbd4  x\n",
    )
    .unwrap();
    keep()
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&out)
        .assert()
        .code(1)
        .stderr(
            predicate::str::contains("already exists")
                .and(predicate::str::contains(out.to_str().unwrap())),
        );
    assert_eq!(std::fs::read(out.join("x")).unwrap(), b"old");
    assert!(!old.exists());
    keep()
        .args(["synth", "--preset", "tiny", "--force", "--out"])
        .arg(&out)
        .assert()
        .success();
    assert!(out.join("SHA256SUMS").is_file());
    assert!(!out.join("x").exists());
    // Only the output is left in the directory.
    assert_eq!(std::fs::read_dir(&w).unwrap().count(), 1);
}

#[test]
fn force_replaces_only_what_keep_wrote() {
    let w = workdir("force-foreign");
    let m = w.join("m");
    copy_model(&m);
    // A directory of the user's: refused by every verb that writes a directory, naming it and
    // the file that is not keep's; nothing in it is touched.
    let mine = w.join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), b"keep me").unwrap();
    let plan = w.join("plan.json");
    std::fs::write(&plan, b"{}").unwrap();
    let text = w.join("text.txt");
    std::fs::write(&text, "Once upon a time there was a model.\n".repeat(20)).unwrap();
    let before = snapshot(&w);
    let verbs: Vec<Vec<std::ffi::OsString>> = vec![
        vec![
            "synth".into(),
            "--preset".into(),
            "tiny".into(),
            "--out".into(),
        ],
        vec![
            "repack".into(),
            m.clone().into(),
            "--resident-format".into(),
            "mxfp8".into(),
        ],
        vec![
            "prune".into(),
            "--plan".into(),
            plan.clone().into(),
            m.clone().into(),
        ],
        vec![
            "quant".into(),
            m.clone().into(),
            "--imatrix".into(),
            plan.clone().into(),
            "--out".into(),
        ],
        vec![
            "pack".into(),
            "--from".into(),
            text.clone().into(),
            "--out".into(),
        ],
    ];
    for v in &verbs {
        keep()
            .args(v)
            .arg(&mine)
            .arg("--force")
            .assert()
            .code(1)
            .stderr(
                predicate::str::contains(mine.to_str().unwrap())
                    .and(predicate::str::contains("notes.txt"))
                    .and(predicate::str::contains("only an output keep wrote")),
            );
    }
    assert_eq!(snapshot(&w), before);
    // A keep output (every file listed in its SHA256SUMS) is replaced, an empty directory used.
    let ours = w.join("ours");
    std::fs::create_dir(&ours).unwrap();
    for _ in 0..2 {
        keep()
            .args(["synth", "--preset", "tiny", "--force", "--out"])
            .arg(&ours)
            .assert()
            .success();
    }
    // ... but not once a file of the user's lies in it.
    std::fs::write(ours.join("mine.txt"), b"x").unwrap();
    keep()
        .args(["synth", "--preset", "tiny", "--force", "--out"])
        .arg(&ours)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("mine.txt"));
    assert!(ours.join("mine.txt").is_file());
    std::fs::remove_file(ours.join("mine.txt")).unwrap();
    // Run from inside a keep output, neither `.` nor its own path replaces the current
    // directory.
    let here = snapshot(&ours);
    for out in [
        Path::new(".").to_path_buf(),
        ours.clone(),
        Path::new("../ours").into(),
    ] {
        keep()
            .current_dir(&ours)
            .args(["synth", "--preset", "tiny", "--force", "--out"])
            .arg(&out)
            .assert()
            .code(1)
            .stderr(predicate::str::contains("current directory"));
    }
    keep()
        .current_dir(ours.join(".."))
        .args(["synth", "--preset", "tiny", "--force", "--out"])
        .arg(".")
        .assert()
        .code(1)
        .stderr(predicate::str::contains("current directory"));
    assert_eq!(snapshot(&ours), here);
}

/// The README's budget example runs on the bundled model, its budget holding the activations
/// of a pass as long as the prompt, not a whole 128-token chunk.
#[test]
fn the_readme_budget_example_runs() {
    keep()
        .args([
            "run",
            "--memory-budget",
            "12MiB",
            "--prompt",
            "Once upon a time",
        ])
        .assert()
        .success()
        .stderr(
            predicate::str::contains("-token pass")
                .and(predicate::str::contains("128-token pass").not()),
        );
}

/// A cache too large for the budget is named, not blamed on the weights.
#[test]
fn a_cache_too_large_for_the_budget_is_named() {
    let w = workdir("engram-cache");
    let m = w.join("eng");
    keep()
        .args([
            "synth",
            "--preset",
            "tiny",
            "--engram-bytes",
            "1MiB",
            "--out",
        ])
        .arg(&m)
        .assert()
        .success();
    keep()
        .arg("run")
        .arg(&m)
        .args(["--memory-budget", "64MiB", "--engram-cache", "1TiB"])
        .args(["--prompt-tokens", "2", "--max-tokens", "2"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains(
            "the Engram row cache (--engram-cache) takes 1099511627776 bytes",
        ));
}

#[test]
fn verify_fails_on_an_empty_or_partial_sha256sums() {
    let w = workdir("verify-partial");
    let m = w.join("m");
    copy_model(&m);
    keep().arg("verify").arg(&m).assert().success();
    let sums = std::fs::read_to_string(m.join("SHA256SUMS")).unwrap();
    // Empty: nothing is checked, so nothing passes.
    std::fs::write(m.join("SHA256SUMS"), "").unwrap();
    keep()
        .arg("verify")
        .arg(&m)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("lists no files"));
    // Partial: the shard is not listed (and could be anything).
    let partial: String = sums
        .lines()
        .filter(|l| !l.ends_with(".safetensors"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(m.join("SHA256SUMS"), partial).unwrap();
    keep().arg("verify").arg(&m).assert().code(1).stderr(
        predicate::str::contains("not listed in SHA256SUMS")
            .and(predicate::str::contains(".safetensors")),
    );
    // Whole again, plus a file nobody listed.
    std::fs::write(m.join("SHA256SUMS"), &sums).unwrap();
    std::fs::write(m.join("extra.safetensors"), b"x").unwrap();
    keep()
        .arg("verify")
        .arg(&m)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("extra.safetensors"));
}

#[test]
fn the_bundled_model_is_checked_against_digests_built_into_the_binary() {
    let cache = workdir("bundled-tamper");
    let keep_here = || {
        let mut c = Command::cargo_bin("keep").unwrap();
        c.env("KEEP_CACHE_DIR", &cache);
        c
    };
    let run = [
        "run",
        "--prompt-tokens",
        "2",
        "--max-tokens",
        "2",
        "--temperature",
        "0",
    ];
    keep_here().args(run).assert().success();
    let models = cache.join("models");
    let dir = std::fs::read_dir(&models)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("keep-tiny-")
                && !p.file_name().unwrap().to_string_lossy().contains("pack")
        })
        .unwrap();
    // Rewrite a file and its line in SHA256SUMS together: the sums beside it agree.
    let readme = dir.join("README.md");
    let mut text = std::fs::read(&readme).unwrap();
    text.extend_from_slice(b"\ntampered\n");
    std::fs::write(&readme, &text).unwrap();
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).unwrap();
    let new_hash = {
        use sha2::{Digest, Sha256};
        Sha256::digest(&text)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let sums: String = sums
        .lines()
        .map(|l| {
            if l.ends_with("  README.md") {
                format!("{new_hash}  README.md\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(dir.join("SHA256SUMS"), sums).unwrap();
    keep_here().arg("verify").arg(&dir).assert().success();
    keep_here().args(run).assert().code(1).stderr(
        predicate::str::contains("not the one built into this keep binary")
            .and(predicate::str::contains("README.md")),
    );
}

// ---------------------------------------------------------------------------------------------
// Flags that used to panic, abort or sample garbage: exit 1 with the reason.

#[test]
fn bad_flags_are_refused_with_the_reason() {
    let m = &scratch().model;
    let cases: &[(&[&str], &str)] = &[
        (&["--prompt-tokens", "0"], "--prompt-tokens"),
        (
            &["--prompt-tokens", "2", "--temperature", "nan"],
            "--temperature",
        ),
        (
            &["--prompt-tokens", "2", "--temperature", "inf"],
            "--temperature",
        ),
        (&["--prompt-tokens", "2", "--top-p", "nan"], "--top-p"),
        (
            &["--prompt-tokens", "2", "--io-threads", "100000"],
            "--io-threads",
        ),
        (
            &["--prompt-tokens", "2", "--io-threads", "0"],
            "--io-threads",
        ),
        (&["--prompt-tokens", "1000000000"], "--prompt-tokens"),
    ];
    for (args, what) in cases {
        keep()
            .arg("run")
            .arg(m)
            .args(*args)
            .args(["--max-tokens", "1"])
            .assert()
            .code(1)
            .stderr(predicate::str::contains(*what));
    }
}

// ---------------------------------------------------------------------------------------------
// Configs that used to divide by zero, abort on allocation, spin, or read forever: every verb
// that reads the model refuses them, naming the key.

/// A copy of the scratch model with `edit` applied to its config.json.
fn model_with_config(name: &str, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let w = workdir(name);
    let m = w.join("m");
    copy_model(&m);
    let p = m.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    m
}

#[test]
fn hostile_configs_are_refused_by_every_reader_naming_the_key() {
    let cases: Vec<(&str, serde_json::Value)> = vec![
        (
            "quantization_config",
            serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [0, 0]}}),
        ),
        (
            "compress_ratios",
            serde_json::json!({"compress_ratios": [0, 4, 4, 2, 2, 1, 1, 9223372036854775808u64]}),
        ),
        (
            "compress_ratios",
            serde_json::json!({"compress_ratios": [0, 4, 4, 2, 2, 1, 1, 2147483648u64]}),
        ),
        (
            "compress_ratios",
            serde_json::json!({"compress_ratios": [0, 3, 4, 2, 2, 1, 1, 1]}),
        ),
        (
            "n_routed_experts",
            serde_json::json!({"n_routed_experts": 4294967296u64}),
        ),
        (
            "hc_sinkhorn_iters",
            serde_json::json!({"hc_sinkhorn_iters": 1000000000}),
        ),
        ("sliding_window", serde_json::json!({"sliding_window": 0})),
        ("index_topk", serde_json::json!({"index_topk": 0})),
        (
            "max_position_embeddings",
            serde_json::json!({"max_position_embeddings": 0}),
        ),
        ("model_type", serde_json::json!({"model_type": "llama"})),
    ];
    for (i, (key, patch)) in cases.iter().enumerate() {
        let m = model_with_config(&format!("cfg-{i}"), |v| {
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
        });
        let out = m.parent().unwrap().join("out");
        let runs: Vec<Vec<std::ffi::OsString>> = vec![
            vec!["inspect".into(), m.clone().into()],
            vec![
                "run".into(),
                m.clone().into(),
                "--prompt-tokens".into(),
                "2".into(),
                "--max-tokens".into(),
                "1".into(),
            ],
            vec![
                "repack".into(),
                m.clone().into(),
                out.clone().into(),
                "--resident-format".into(),
                "mxfp8".into(),
            ],
        ];
        for args in runs {
            keep().args(&args).assert().code(1).stderr(
                predicate::str::contains(*key).and(predicate::str::contains("config.json")),
            );
        }
        assert!(!out.exists());
    }
}

#[test]
fn a_config_that_is_a_device_is_not_read() {
    let w = workdir("cfg-dev");
    let m = w.join("m");
    copy_model(&m);
    std::fs::remove_file(m.join("config.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", m.join("config.json")).unwrap();
    for verb in ["inspect", "run"] {
        keep()
            .arg(verb)
            .arg(&m)
            .args(if verb == "run" {
                &["--prompt-tokens", "2"][..]
            } else {
                &[][..]
            })
            .timeout(std::time::Duration::from_secs(120))
            .assert()
            .code(1)
            .stderr(predicate::str::contains("character device"));
    }
}

#[test]
fn synth_refuses_a_zero_block() {
    let w = workdir("synth-block");
    keep()
        .args(["synth", "--preset", "tiny", "--block", "0", "--out"])
        .arg(w.join("o"))
        .assert()
        .code(1)
        .stderr(predicate::str::contains("block"));
    assert!(!w.join("o").exists());
}

// ---------------------------------------------------------------------------------------------
// Non-finite numbers in the checkpoint stop the run with the place they appeared, not garbage.

/// Overwrite tensor `name` of `shard` with 0xFF bytes (NaN in bf16, f32, FP8 E4M3 and E8M0).
fn poison(shard: &Path, name: &str) {
    let mut b = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let off = &h[name]["data_offsets"];
    let (s, e) = (
        off[0].as_u64().unwrap() as usize,
        off[1].as_u64().unwrap() as usize,
    );
    b[8 + n + s..8 + n + e].fill(0xFF);
    std::fs::write(shard, b).unwrap();
}

#[test]
fn non_finite_weights_stop_run_and_logits_naming_where() {
    for (name, at) in [
        ("embed.weight", "the embedding"),
        ("layers.1.attn.wq_a.scale", "layer 1"),
    ] {
        let w = workdir(&format!("nan-{}", name.replace('.', "-")));
        let m = w.join("m");
        copy_model(&m);
        poison(&m.join("model.safetensors"), name);
        keep()
            .arg("inspect")
            .arg(&m)
            .assert()
            .success()
            .stdout(predicate::str::contains("non-finite").and(predicate::str::contains(name)));
        keep()
            .arg("run")
            .arg(&m)
            .args([
                "--prompt-tokens",
                "4",
                "--max-tokens",
                "2",
                "--temperature",
                "0",
            ])
            .assert()
            .code(1)
            .stderr(predicate::str::contains("non-finite").and(predicate::str::contains(at)));
        let out = w.join("l.safetensors");
        keep()
            .arg("logits")
            .arg(&m)
            .args(["--tokens", "0,1,2", "--out"])
            .arg(&out)
            .assert()
            .code(1)
            .stderr(predicate::str::contains("non-finite").and(predicate::str::contains(at)));
        assert!(!out.exists());
    }
}

// ---------------------------------------------------------------------------------------------
// Errors say what is wrong, once, about the user's path.

#[test]
fn errors_name_the_path_say_what_it_is_and_print_os_errors_once() {
    let w = workdir("errors");
    let missing = w.join("missing");
    let out = keep().arg("inspect").arg(&missing).assert().code(1);
    let err = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert!(err.contains(missing.to_str().unwrap()), "{err}");
    let fifo = w.join("fifo");
    mkfifo(&fifo);
    keep()
        .arg("inspect")
        .arg(&fifo)
        .assert()
        .code(1)
        .stderr(predicate::str::contains(
            "is a FIFO, not a checkpoint directory",
        ));
    // A shard that is a FIFO is named, not skipped (and not read forever).
    let m = w.join("m");
    copy_model(&m);
    mkfifo(&m.join("extra.safetensors"));
    keep()
        .arg("inspect")
        .arg(&m)
        .timeout(std::time::Duration::from_secs(120))
        .assert()
        .code(1)
        .stderr(
            predicate::str::contains("extra.safetensors").and(predicate::str::contains("a FIFO")),
        );
}

// ---------------------------------------------------------------------------------------------
// Plans carry the fingerprint of their model and every field is checked.

#[test]
fn prune_refuses_a_plan_made_for_another_model() {
    let w = workdir("plan-other");
    let a = &scratch().model;
    let b = w.join("b");
    keep()
        .args(["synth", "--preset", "tiny", "--seed", "9", "--out"])
        .arg(&b)
        .assert()
        .success();
    let plan = |fp: &str, layers: serde_json::Value| {
        serde_json::json!({
            "format": "keep-prune-plan", "version": 1, "n_experts": 16, "keep": 8,
            "saliency": "test", "layers": layers, "mtp_layers": [], "model_fingerprint": fp,
        })
    };
    let all: serde_json::Value = (0..8)
        .map(|l| serde_json::json!({"layer": l, "survivors": (0..8).collect::<Vec<_>>()}))
        .collect();
    let fa = keep_checkpoint::fingerprint::model_fingerprint(a).unwrap();
    let fb = keep_checkpoint::fingerprint::model_fingerprint(&b).unwrap();
    let mut dup = all.clone();
    dup.as_array_mut().unwrap().push(all[0].clone());
    let mut far = all.clone();
    far[7]["layer"] = 99.into();
    let cases = [
        (plan(&fa, all.clone()), "fingerprint"),
        (plan(&fb, dup), "twice"),
        (plan(&fb, far), "layer 99"),
    ];
    for (i, (p, what)) in cases.iter().enumerate() {
        let pf = w.join(format!("plan-{i}.json"));
        std::fs::write(&pf, serde_json::to_vec(p).unwrap()).unwrap();
        keep()
            .args(["prune", "--plan"])
            .arg(&pf)
            .arg(&b)
            .arg(w.join("out"))
            .assert()
            .code(1)
            .stderr(predicate::str::contains(*what));
        assert!(!w.join("out").exists());
    }
    let pf = w.join("plan-ok.json");
    std::fs::write(&pf, serde_json::to_vec(&plan(&fb, all)).unwrap()).unwrap();
    keep()
        .args(["prune", "--plan"])
        .arg(&pf)
        .arg(&b)
        .arg(w.join("out"))
        .assert()
        .success();
}

#[test]
fn plots_refuse_existing_files_without_force() {
    let w = workdir("plots");
    let p = w.join("p.svg");
    std::fs::write(&p, b"keep").unwrap();
    keep()
        .arg("residency")
        .arg(w.join("run"))
        .args(["--make-synthetic", "tokens=50", "--plot"])
        .arg(&p)
        .assert()
        .code(1)
        .stderr(predicate::str::contains("already exists"));
    assert_eq!(std::fs::read(&p).unwrap(), b"keep");
    assert!(!w.join("run").exists());
    keep()
        .arg("residency")
        .arg(w.join("run"))
        .args(["--make-synthetic", "tokens=50", "--force", "--plot"])
        .arg(&p)
        .assert()
        .success();
    assert!(std::fs::read(&p).unwrap().starts_with(b"<svg"));
}

#[test]
fn a_synthetic_trace_too_large_to_hold_is_refused_before_allocating() {
    // 10^10 tokens × 8 layers × top-6 routed slots would abort on allocation.
    let w = workdir("synthetic-huge");
    keep()
        .arg("residency")
        .arg(w.join("run"))
        .args(["--make-synthetic", "tokens=10000000000"])
        .assert()
        .code(1)
        .stderr(predicate::str::contains("routed slots"));
    assert!(!w.join("run").exists());
}

// ---------------------------------------------------------------------------------------------
// One layout classification and one check of the tensors against the config: `inspect` reports
// exactly what the loader of `run`/`logits` refuses, on the same malformed checkpoints.

/// Rewrite the safetensors header of `shard` (the data section is kept byte for byte; offsets
/// are relative to it, so renaming a tensor or changing its dtype or shape keeps it readable).
fn edit_header(shard: &Path, edit: impl Fn(&mut serde_json::Map<String, serde_json::Value>)) {
    let b = std::fs::read(shard).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    edit(h.as_object_mut().unwrap());
    let mut hb = serde_json::to_vec(&h).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&b[8 + n..]);
    std::fs::write(shard, out).unwrap();
}

/// Rename tensor `from` to `to` in `shard`.
fn rename_tensor(h: &mut serde_json::Map<String, serde_json::Value>, from: &str, to: &str) {
    let v = h.remove(from).unwrap_or_else(|| panic!("no tensor {from}"));
    h.insert(to.into(), v);
}

/// `keep inspect --json DIR` (exit 0) and the reasons it says the loader refuses the model.
fn inspect_refusals(m: &Path) -> (Vec<String>, Vec<String>) {
    let out = keep().args(["inspect", "--json"]).arg(m).assert().success();
    let r: serde_json::Value = serde_json::from_slice(&out.get_output().stdout).unwrap();
    let list = |k: &str| -> Vec<String> {
        r[k].as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_string())
            .collect()
    };
    (list("refused"), list("problems"))
}

#[test]
fn inspect_and_the_loader_refuse_the_same_malformed_checkpoints() {
    type Edit = Box<dyn Fn(&mut serde_json::Map<String, serde_json::Value>)>;
    type CfgEdit = Box<dyn Fn(&mut serde_json::Value)>;
    let none: CfgEdit = Box::new(|_| {});
    let cases: Vec<(&str, Edit, CfgEdit, &str)> = vec![
        (
            "no-embed",
            Box::new(|h| rename_tensor(h, "embed.weight", "embed.wexght")),
            Box::new(|_| {}),
            "`embed.weight` is missing",
        ),
        (
            "no-head",
            Box::new(|h| rename_tensor(h, "head.weight", "head.wexght")),
            Box::new(|_| {}),
            "`head.weight` is missing",
        ),
        (
            "no-router",
            Box::new(|h| rename_tensor(h, "layers.2.ffn.gate.weight", "layers.2.ffn.gate.wexght")),
            Box::new(|_| {}),
            "`layers.2.ffn.gate.weight` is missing",
        ),
        (
            "u8-scale",
            Box::new(|h| h["layers.1.attn.wq_a.scale"]["dtype"] = "U8".into()),
            Box::new(|_| {}),
            "U8",
        ),
        (
            "u8-expert-scale",
            Box::new(|h| h["layers.3.ffn.experts.5.w2.scale"]["dtype"] = "U8".into()),
            Box::new(|_| {}),
            "U8",
        ),
        (
            "scale-grid",
            Box::new(|h| {
                let s = &mut h["layers.0.attn.wkv.scale"]["shape"];
                let a = s[0].clone();
                s[0] = s[1].clone();
                s[1] = a;
            }),
            Box::new(|_| {}),
            "layers.0.attn.wkv.weight",
        ),
        (
            "f16-head",
            Box::new(|h| h["head.weight"]["dtype"] = "F16".into()),
            Box::new(|_| {}),
            "F16",
        ),
        (
            "fp8-no-scale",
            Box::new(|h| {
                rename_tensor(
                    h,
                    "layers.4.ffn.shared_experts.w1.scale",
                    "layers.4.ffn.shared_experts.w1.scxle",
                )
            }),
            Box::new(|_| {}),
            "without a scale",
        ),
        (
            "more-experts",
            Box::new(|_| {}),
            Box::new(|v| v["n_routed_experts"] = 32.into()),
            "n_routed_experts = 32",
        ),
        (
            "vocab",
            Box::new(|_| {}),
            Box::new(|v| v["vocab_size"] = (v["vocab_size"].as_u64().unwrap() + 1).into()),
            "`embed.weight`",
        ),
        (
            "hidden",
            Box::new(|_| {}),
            Box::new(|v| {
                v["moe_intermediate_size"] =
                    (v["moe_intermediate_size"].as_u64().unwrap() * 2).into()
            }),
            "ffn.shared_experts.w1.weight",
        ),
    ];
    for (name, edit, cfg, why) in cases.iter().chain(std::iter::once(&(
        "intact",
        Box::new(|_: &mut serde_json::Map<String, serde_json::Value>| {}) as Edit,
        none,
        "",
    ))) {
        let m = model_with_config(&format!("agree-{name}"), |v| cfg(v));
        edit_header(&m.join("model.safetensors"), |h| edit(h));
        let (refused, problems) = inspect_refusals(&m);
        let run = keep()
            .arg("run")
            .arg(&m)
            .args([
                "--prompt-tokens",
                "3",
                "--max-tokens",
                "1",
                "--temperature",
                "0",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr).to_string();
        if *name == "intact" {
            assert!(refused.is_empty(), "{refused:?}");
            assert!(problems.is_empty(), "{problems:?}");
            assert!(run.status.success(), "{err}");
            continue;
        }
        assert!(
            refused.iter().any(|r| r.contains(why)),
            "{name}: inspect's refusals {refused:?} do not say `{why}`"
        );
        assert!(!problems.is_empty(), "{name}: inspect found no problem");
        assert_eq!(
            run.status.code(),
            Some(1),
            "{name}: run was not refused: {err}"
        );
        assert!(
            err.contains(why),
            "{name}: run's error does not say `{why}`: {err}"
        );
        assert!(
            err.contains(m.to_str().unwrap()) || err.contains("config.json"),
            "{name}: run's error does not name the model: {err}"
        );
    }
}

#[test]
fn configs_no_reference_runs_are_refused_by_inspect_and_run_naming_the_key() {
    let cases: Vec<(&str, serde_json::Value)> = vec![
        ("scoring_func", serde_json::json!({"scoring_func": "relu"})),
        (
            "n_shared_experts",
            serde_json::json!({"n_shared_experts": 2}),
        ),
        ("o_groups", serde_json::json!({"o_groups": 7})),
        (
            "qk_rope_head_dim",
            serde_json::json!({"qk_rope_head_dim": 3}),
        ),
        ("num_hash_layers", serde_json::json!({"num_hash_layers": 2})),
        (
            "num_hash_layers",
            serde_json::json!({"model_type": "deepseek_v4", "num_hash_layers": 99}),
        ),
        (
            "compress_ratios",
            serde_json::json!({"model_type": "deepseek_v4", "compress_ratios": [0, 2, 4, 4, 4, 4, 4, 4]}),
        ),
        (
            "candidate_source_layer_id",
            serde_json::json!({"candidate_source_layer_id": 8}),
        ),
        (
            "engram_num_embeddings",
            serde_json::json!({"engram_layer_ids": [1], "engram_num_embeddings": []}),
        ),
        (
            "engram_max_ngram_size",
            serde_json::json!({"engram_layer_ids": [1], "engram_num_embeddings": [1000],
                "engram_max_ngram_size": 1, "engram_n_heads": 2, "engram_head_dim": 32,
                "engram_vocab_size": 100}),
        ),
        (
            "engram_pad_id",
            serde_json::json!({"engram_layer_ids": [1], "engram_num_embeddings": [1000],
                "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
                "engram_vocab_size": 100, "engram_pad_id": 1000000}),
        ),
        (
            "engram_layer_ids",
            serde_json::json!({"engram_layer_ids": [1, 1], "engram_num_embeddings": [1000, 1000],
                "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
                "engram_vocab_size": 100}),
        ),
    ];
    for (i, (key, patch)) in cases.iter().enumerate() {
        let m = model_with_config(&format!("cfg-ref-{i}"), |v| {
            for (k, x) in patch.as_object().unwrap() {
                v[k] = x.clone();
            }
        });
        for args in [
            vec!["inspect"],
            vec!["run", "--prompt-tokens", "2", "--max-tokens", "1"],
        ] {
            keep()
                .arg(args[0])
                .arg(&m)
                .args(&args[1..])
                .assert()
                .code(1)
                .stderr(
                    predicate::str::contains(*key).and(predicate::str::contains("config.json")),
                );
        }
    }
}

/// Run `keep ARGS`, expect exit 1, and return stderr after checking that it names `path`,
/// says `what`, prints no OS error twice and never names an internal temporary.
fn refused_naming(args: &[&std::ffi::OsStr], path: &Path, what: &str) -> String {
    let out = keep()
        .args(args)
        .timeout(std::time::Duration::from_secs(120))
        .assert()
        .code(1);
    let err = String::from_utf8_lossy(&out.get_output().stderr).to_string();
    assert!(
        err.contains(path.to_str().unwrap()),
        "does not name {path:?}: {err}"
    );
    assert!(err.contains(what), "does not say `{what}`: {err}");
    for os in err.match_indices("(os error").map(|(i, _)| &err[i..]) {
        let code = &os[..os.find(')').unwrap_or(os.len())];
        assert_eq!(
            err.matches(code).count(),
            1,
            "`{code}` printed twice: {err}"
        );
    }
    assert!(
        !err.contains(".keep-"),
        "names an internal temporary: {err}"
    );
    err
}

#[test]
fn bad_paths_are_named_with_what_they_are() {
    let w = workdir("bad-paths");
    let os = |p: &Path| p.as_os_str().to_owned();
    // A file given as a model directory.
    let file = w.join("model.txt");
    std::fs::write(&file, b"not a model").unwrap();
    for verb in ["inspect", "run", "logits", "repack"] {
        let mut args = vec![os(Path::new(verb)), os(&file)];
        if verb == "repack" {
            args.extend([
                os(&w.join("out")),
                "--resident-format".into(),
                "mxfp8".into(),
            ]);
        }
        if verb == "logits" {
            args.extend([
                "--tokens".into(),
                "1".into(),
                "--out".into(),
                os(&w.join("l")),
            ]);
        }
        let a: Vec<&std::ffi::OsStr> = args.iter().map(|s| s.as_os_str()).collect();
        refused_naming(&a, &file, "is a regular file, not a checkpoint directory");
    }
    assert!(!w.join("out").exists() && !w.join("l").exists());
    // An empty directory, and one that holds no shard.
    let empty = w.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for verb in ["inspect", "run"] {
        refused_naming(
            &[verb.as_ref(), empty.as_os_str()],
            &empty,
            "is an empty directory",
        );
    }
    let stray = w.join("stray");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::write(stray.join("notes.txt"), b"x").unwrap();
    refused_naming(
        &["inspect".as_ref(), stray.as_os_str()],
        &stray,
        "holds no *.safetensors shard (1 entry: notes.txt)",
    );
    // A dangling symbolic link, as the model and as its config.json.
    let link = w.join("link");
    std::os::unix::fs::symlink(w.join("gone"), &link).unwrap();
    for verb in ["inspect", "run"] {
        refused_naming(
            &[verb.as_ref(), link.as_os_str()],
            &link,
            "is a symbolic link to",
        );
    }
    let m = w.join("m");
    copy_model(&m);
    std::fs::remove_file(m.join("config.json")).unwrap();
    std::os::unix::fs::symlink(w.join("gone.json"), m.join("config.json")).unwrap();
    refused_naming(
        &["inspect".as_ref(), m.as_os_str()],
        &m.join("config.json"),
        "which does not exist",
    );
    // A config.json that is a FIFO or a directory: named, never waited on.
    std::fs::remove_file(m.join("config.json")).unwrap();
    mkfifo(&m.join("config.json"));
    refused_naming(
        &["inspect".as_ref(), m.as_os_str()],
        &m.join("config.json"),
        "is a FIFO, not a regular file",
    );
    std::fs::remove_file(m.join("config.json")).unwrap();
    std::fs::create_dir(m.join("config.json")).unwrap();
    refused_naming(
        &["run".as_ref(), m.as_os_str()],
        &m.join("config.json"),
        "is a directory, not a regular file",
    );
    // A directory given where a file is read (a prune plan), and a FIFO there.
    let plan_dir = w.join("plan");
    std::fs::create_dir_all(&plan_dir).unwrap();
    let out = w.join("pruned");
    refused_naming(
        &[
            "prune".as_ref(),
            "--plan".as_ref(),
            plan_dir.as_os_str(),
            scratch().model.as_os_str(),
            out.as_os_str(),
        ],
        &plan_dir,
        "is a directory, not a regular file",
    );
    let plan_fifo = w.join("plan.fifo");
    mkfifo(&plan_fifo);
    refused_naming(
        &[
            "prune".as_ref(),
            "--plan".as_ref(),
            plan_fifo.as_os_str(),
            scratch().model.as_os_str(),
            out.as_os_str(),
        ],
        &plan_fifo,
        "is a FIFO, not a regular file",
    );
    assert!(!out.exists());
    // A missing model: the OS error once, with the path.
    let gone = w.join("nothing-here");
    refused_naming(
        &["run".as_ref(), gone.as_os_str()],
        &gone,
        "No such file or directory",
    );
}

#[test]
fn threads_sizes_the_worker_pool_and_zero_is_refused() {
    let w = workdir("threads");
    let stats = w.join("stats.json");
    // 5: more threads than a test machine has cores, so the default could not give it.
    keep()
        .arg("run")
        .arg(&scratch().model)
        .args([
            "--prompt-tokens",
            "2",
            "--max-tokens",
            "2",
            "--threads",
            "5",
        ])
        .arg("--stats-json")
        .arg(&stats)
        .assert()
        .success();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(v["threads"], 5, "{v}");
    keep()
        .arg("logits")
        .arg(&scratch().model)
        .args(["--tokens", "1,2", "--threads", "0", "--out"])
        .arg(w.join("l.safetensors"))
        .assert()
        .code(2)
        .stderr(predicate::str::contains("--threads"));
}

/// `keep synth --threads N` sizes its pool, and the checkpoint is the same bytes on one thread
/// and on two (the shards' SHA256SUMS compared).
#[test]
fn synth_threads_flag_writes_the_same_bytes() {
    let w = workdir("synth-threads");
    let mut sums = vec![];
    for t in ["1", "2"] {
        let out = w.join(format!("t{t}"));
        keep()
            .args(["synth", "--preset", "tiny", "--threads", t, "--out"])
            .arg(&out)
            .assert()
            .success();
        sums.push(std::fs::read_to_string(out.join("SHA256SUMS")).unwrap());
    }
    assert_eq!(sums[0], sums[1]);
    keep()
        .args(["synth", "--preset", "tiny", "--threads", "0", "--out"])
        .arg(w.join("t0"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("--threads"));
}
