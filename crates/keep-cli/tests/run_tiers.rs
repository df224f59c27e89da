//! `keep run --tiers` with shipped upper stages: the bundled model quantized to E8P2+E81 under
//! an allocation of `e8p2` (even experts: their residual codes are their upper stage) and
//! `e8p2+e81` (odd experts: their upper stage is their shipped expert in the original, the
//! bundled model). Without --upper-from the run is refused naming it; with another checkpoint
//! than the allocation's model it is refused naming the fingerprint; with the original it runs
//! and serves slots at the upper rung. `keep residency --upper-from` makes the same checks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use keep_artifacts::alloc::{Alloc, LayerAlloc, RungBytes};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions, PARTS};
use keep_quant::QuantFormat;

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// An imatrix of ones for every routed expert projection of the bundled model.
fn imatrix(dir: &Path) -> PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut metas = vec![];
    for l in 0..cfg.num_hidden_layers {
        for e in 0..cfg.experts_in_layer(l) {
            for p in PARTS {
                let cols = if p == "w2" {
                    cfg.moe_intermediate_size
                } else {
                    cfg.hidden_size
                };
                metas.push(TensorMeta::new(
                    format!("imatrix.{l}.ffn.experts.{e}.{p}"),
                    Dtype::F32,
                    &[cols as u64],
                ));
            }
        }
    }
    let out = dir.join("im");
    let mut w = CheckpointWriter::create(
        &out,
        metas.clone(),
        WriterOptions {
            shard_metadata: BTreeMap::from([("format".into(), "keep-imatrix".into())]),
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for m in &metas {
        let ones: Vec<u8> = (0..m.shape[0]).flat_map(|_| 1f32.to_le_bytes()).collect();
        w.write_tensor(&m.name, &ones).unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}

/// An allocation of the bundled model: expert `e` of every layer at `rung(e)`.
fn alloc(path: &Path, rung: &dyn Fn(usize) -> &'static str) -> PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
    let c = ck.require_config().unwrap();
    let n: u64 = (0..c.num_hidden_layers)
        .map(|l| c.experts_in_layer(l) as u64)
        .sum();
    let a = Alloc {
        format: Alloc::FORMAT.into(),
        version: Alloc::VERSION,
        model: bundled().display().to_string(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(&bundled()).unwrap(),
        // Every rung one byte an expert.
        budget_bytes: n,
        bytes: n,
        rungs: ["e8p2", "e8p2+e81"]
            .iter()
            .map(|l| RungBytes {
                label: l.to_string(),
                bytes_per_expert: 1,
            })
            .collect(),
        solver: "test".into(),
        grain_bytes: 1,
        predicted_loss: 0.0,
        saliency: "reap".into(),
        layers: (0..c.num_hidden_layers)
            .map(|l| LayerAlloc {
                layer: l,
                rungs: (0..c.experts_in_layer(l))
                    .map(|e| rung(e).to_string())
                    .collect(),
            })
            .collect(),
        extra: Default::default(),
    };
    a.write(path, false).unwrap();
    path.to_path_buf()
}

fn keep_run(model: &Path, args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_keep"))
        .arg("run")
        .arg(model)
        .args([
            "--memory-budget",
            "1GiB",
            "--tau",
            "0",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--draft",
            "none",
        ])
        .args(args)
        .env("KEEP_CACHE_DIR", dir.join("cache"))
        .output()
        .unwrap()
}

#[test]
fn run_tiers_reads_shipped_stages_from_upper_from_and_refuses_without_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let q = dir.join("q");
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: ExpertSelection::All,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    quantize(&bundled(), &imatrix(dir), &q, &opts, &|_, _| {}).unwrap();
    let mixed = alloc(&dir.join("mixed.json"), &|e| {
        if e % 2 == 0 {
            "e8p2"
        } else {
            "e8p2+e81"
        }
    });
    let mixed = mixed.to_str().unwrap();

    // Odd experts' upper rung is shipped: refused without the original, naming --upper-from.
    let o = keep_run(&q, &["--tiers", mixed], dir);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("--upper-from") && err.contains("128 experts"),
        "{err}"
    );

    // Another checkpoint than the allocation's model: refused, naming the fingerprint.
    let o = keep_run(
        &q,
        &["--tiers", mixed, "--upper-from", q.to_str().unwrap()],
        dir,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("fingerprint") && err.contains("--upper-from"),
        "{err}"
    );

    // The original: every expert has an upper stage (128 residual, 128 shipped) and the run
    // serves slots at the upper rung.
    let stats = dir.join("stats.json");
    let original = bundled();
    let o = keep_run(
        &q,
        &[
            "--tiers",
            mixed,
            "--upper-from",
            original.to_str().unwrap(),
            "--stats-json",
            stats.to_str().unwrap(),
        ],
        dir,
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("256 of 256 experts have an upper stage (128 their residual codes, 128 their shipped expert"),
        "{err}"
    );
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let t = &s["decode_cache"]["tiers"];
    assert!(t["upper"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["failed"].as_u64(), Some(0), "{t}");

    // An allocation without shipped upper rungs needs no original.
    let e8p2 = alloc(&dir.join("e8p2.json"), &|_| "e8p2");
    let o = keep_run(&q, &["--tiers", e8p2.to_str().unwrap()], dir);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // keep residency makes the same checks of --upper-from before it sizes anything.
    let residency = |run: &str, upper: &Path| {
        Command::new(env!("CARGO_BIN_EXE_keep"))
            .args(["residency", run, "--model"])
            .arg(&q)
            .args(["--tau", "0.1", "--alloc", mixed, "--upper-from"])
            .arg(upper)
            .output()
            .unwrap()
    };
    let run = dir.join("routes");
    let o = Command::new(env!("CARGO_BIN_EXE_keep"))
        .arg("residency")
        .arg(&run)
        .args([
            "--make-synthetic",
            "layers=8,experts=32,top_k=4,tokens=64,sessions=2",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = residency(run.to_str().unwrap(), &q);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("fingerprint") && err.contains("--upper-from"),
        "{err}"
    );
    let o = residency(run.to_str().unwrap(), &original);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
