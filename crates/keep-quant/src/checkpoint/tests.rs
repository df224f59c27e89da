//! End-to-end tests of the quantized checkpoint on the bundled model: a few experts per
//! layer (the plan selection), a synthetic imatrix, refusal naming a tensor without an
//! imatrix, shards joined, and the written codes decoding to the reported errors.

use super::*;
use crate::fit::{column_weights, dequantize_ref};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// An imatrix file for the bundled model: entries `1 + (j % 7)` for every routed expert
/// projection, leaving out `skip` (a key).
fn write_imatrix(dir: &Path, skip: Option<&str>) -> PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut metas = vec![];
    let mut data = vec![];
    for l in 0..cfg.num_hidden_layers {
        for e in 0..cfg.experts_in_layer(l) {
            for p in PARTS {
                let name = format!("imatrix.{l}.ffn.experts.{e}.{p}");
                if Some(name.as_str()) == skip {
                    continue;
                }
                let cols = if p == "w2" {
                    cfg.moe_intermediate_size
                } else {
                    cfg.hidden_size
                };
                let v: Vec<f32> = (0..cols).map(|j| 1.0 + (j % 7) as f32).collect();
                metas.push(TensorMeta::new(name, Dtype::F32, &[cols as u64]));
                data.push(f32_bytes(&v));
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
    for (m, d) in metas.iter().zip(&data) {
        w.write_tensor(&m.name, d).unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}

/// Two experts in every layer, so the test stays small.
fn few_experts() -> ExpertSelection {
    ExpertSelection::Only((0..8).map(|l| (l, BTreeSet::from([1, 30]))).collect())
}

#[test]
fn quantize_refuse_shard_join_and_decode() {
    let tmp = tempfile::tempdir().unwrap();
    let im = write_imatrix(tmp.path(), Some("imatrix.3.ffn.experts.30.w2"));
    let out = tmp.path().join("q");
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: few_experts(),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let err = quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("layers.3.ffn.experts.30.w2.weight")
            && msg.contains("imatrix.3.ffn.experts.30.w2"),
        "{msg}"
    );
    assert!(!out.exists());

    let im = write_imatrix(&tmp.path().join("full"), None);
    // shard 1/2 first: odd layers only, nothing joined yet
    let r = quantize(
        &bundled(),
        &im,
        &out,
        &QuantOptions {
            shard: (1, 2),
            ..opts.clone()
        },
        &|_, _| {},
    )
    .unwrap();
    assert_eq!(r.layers_fitted, vec![1, 3, 5, 7]);
    assert_eq!(r.layers_missing, vec![0, 2, 4, 6]);
    assert!(!r.joined && !out.exists());
    // rerun of the same shard: resumed, nothing redone
    let r = quantize(
        &bundled(),
        &im,
        &out,
        &QuantOptions {
            shard: (1, 2),
            ..opts.clone()
        },
        &|_, _| {},
    )
    .unwrap();
    assert!(r.layers_fitted.is_empty());
    // the other shard joins
    let r = quantize(
        &bundled(),
        &im,
        &out,
        &QuantOptions {
            shard: (0, 2),
            ..opts.clone()
        },
        &|_, _| {},
    )
    .unwrap();
    assert!(r.joined && r.layers_missing.is_empty());
    assert_eq!(r.tensors.len(), 8 * 2 * 3);
    assert_eq!(r.experts.len(), 16);
    assert!(!parts_dir(&out).exists());
    // an existing output is refused without force
    assert!(quantize(&bundled(), &im, &out, &opts, &|_, _| {}).is_err());

    let q = Checkpoint::open(&out).unwrap();
    let src = Checkpoint::open(&bundled()).unwrap();
    let cfg = q.require_config().unwrap();
    let entry = &cfg.raw_with(&[])[CONFIG_KEY];
    assert_eq!(entry["method"], "e8p2+e81");
    assert_eq!(entry["tensors"]["layers.2.ffn.experts.30.w1"], "e8p2+e81");
    // an unselected expert is byte-identical, a selected one is coded
    let a = q.tensor("layers.2.ffn.experts.0.w1.weight").unwrap();
    assert_eq!(
        a.bytes,
        src.tensor("layers.2.ffn.experts.0.w1.weight")
            .unwrap()
            .bytes
    );
    let c = q.tensor("layers.2.ffn.experts.1.w2.weight").unwrap();
    assert_eq!((c.dtype, c.shape), (Dtype::U16, &[256u64, 16][..]));
    let rc = q.tensor("layers.2.ffn.experts.1.w2.resid.weight").unwrap();
    assert_eq!((rc.dtype, rc.shape), (Dtype::U8, &[256u64, 16][..]));
    // decode the stored tensors and recompute the reported error
    let t = r
        .tensors
        .iter()
        .find(|t| t.name == "layers.2.ffn.experts.1.w2.weight")
        .unwrap();
    let rd = |n: &str| -> Vec<f32> {
        q.tensor(n)
            .unwrap()
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let f = FittedMatrix {
        rows: 256,
        cols: 128,
        codes: c
            .bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect(),
        scales: rd("layers.2.ffn.experts.1.w2.scale"),
        residual: Some(crate::fit::ResidualStage {
            codes: ResidualCodes::E81(rc.bytes.to_vec()),
            scales: rd("layers.2.ffn.experts.1.w2.resid.scale"),
        }),
        errors: Default::default(),
        group: 128,
    };
    let w = src.tensor("layers.2.ffn.experts.1.w2.weight").unwrap();
    let s = layout::scale_of(&src, "layers.2.ffn.experts.1.w2.weight");
    let orig = decode_source(w, s, 256, 128).unwrap();
    let imv: Vec<f32> = (0..128).map(|j| 1.0 + (j % 7) as f32).collect();
    let h = column_weights(&imv).unwrap();
    let mean = imv.iter().map(|&v| v as f64).sum::<f64>() / 128.0;
    let hat = dequantize_ref(&f);
    let err: f64 = orig
        .iter()
        .zip(&hat)
        .enumerate()
        .map(|(j, (&a, &b))| h[j % 128] as f64 * mean * (a as f64 - b).powi(2))
        .sum();
    let reported = t.error["e8p2+e81"];
    assert!((err - reported).abs() <= 1e-9 * err, "{err} vs {reported}");
    assert!(t.rel_error["e8p2+e81"] < t.rel_error["e8p2"]);
    assert!(q.dir().join(REPORT_FILE).is_file());
}

/// A copy of the bundled model (config, shard, sums) under `dir`.
fn copy_bundled(dir: &Path) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(bundled()).unwrap().flatten() {
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    m
}

/// The tensors of the joined output whose name ends with `suffix`.
fn count_suffix(out: &Path, suffix: &str) -> usize {
    let q = Checkpoint::open(out).unwrap();
    q.tensors().filter(|t| t.name.ends_with(suffix)).count()
}

#[test]
fn parts_of_other_arguments_are_refused_by_name_and_cleared_by_force() {
    let tmp = tempfile::tempdir().unwrap();
    let im = write_imatrix(tmp.path(), None);
    let out = tmp.path().join("q");
    let e8p = QuantOptions {
        format: QuantFormat::E8p2E8p2,
        experts: few_experts(),
        shard: (1, 2),
        force: false,
        mlx_bits: None,
    };
    // A killed e8p2+e8p2 run: the odd layers' parts are there.
    let r = quantize(&bundled(), &im, &out, &e8p, &|_, _| {}).unwrap();
    assert!(!r.joined && !r.layers_fitted.is_empty());
    // A later mlx4 run is refused naming the format, and the parts stay as they were.
    let mlx4 = QuantOptions {
        mlx_bits: Some(4),
        format: QuantFormat::E8p2,
        shard: (0, 1),
        ..e8p.clone()
    };
    let msg = quantize(&bundled(), &im, &out, &mlx4, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("--format e8p2+e8p2")
            && msg.contains("--format mlx4")
            && msg.contains("--force"),
        "{msg}"
    );
    assert!(!out.exists());
    // So is a shard with other incoherence settings, naming them.
    let msg = quantize_with(
        &bundled(),
        &im,
        &out,
        &QuantOptions {
            shard: (0, 2),
            ..e8p.clone()
        },
        Some(crate::incoherence::IncoherenceOptions {
            mode: crate::incoherence::Mode::Output,
            seed: 7,
        }),
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("--incoherence off") && msg.contains("--incoherence out"),
        "{msg}"
    );
    // And parts from another source checkpoint, naming the fingerprint.
    let other = copy_bundled(tmp.path());
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(other.join("config.json")).unwrap()).unwrap();
    cfg["keep_note"] = "another model".into();
    std::fs::write(other.join("config.json"), cfg.to_string()).unwrap();
    let msg = quantize(
        &other,
        &im,
        &out,
        &QuantOptions {
            shard: (0, 2),
            ..e8p.clone()
        },
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("fingerprint"), "{msg}");
    // --force discards them: the output is mlx4 through and through.
    let r = quantize(
        &bundled(),
        &im,
        &out,
        &QuantOptions {
            force: true,
            ..mlx4.clone()
        },
        &|_, _| {},
    )
    .unwrap();
    assert!(r.joined);
    assert_eq!(r.method, "mlx4");
    assert_eq!(r.layers_fitted.len(), 8, "every layer refitted");
    assert_eq!(count_suffix(&out, ".resid.weight"), 0);
    assert_eq!(count_suffix(&out, ".biases"), 8 * 2 * 3);
    assert!(!parts_dir(&out).exists());
}

#[test]
fn a_non_finite_weight_is_never_stored_as_a_part() {
    let tmp = tempfile::tempdir().unwrap();
    let im = write_imatrix(tmp.path(), None);
    let model = copy_bundled(tmp.path());
    // An E8M0 scale of 0xFF is NaN: the first row of expert 1's w1 in layer 2 decodes to NaN.
    let shard = model.join("model.safetensors");
    let name = "layers.2.ffn.experts.1.w1.scale";
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = 8 + n + head[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[off] = 0xFF;
    std::fs::write(&shard, &bytes).unwrap();
    let out = tmp.path().join("q");
    let opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: few_experts(),
        shard: (0, 1),
        force: false,
        mlx_bits: Some(4),
    };
    for force in [false, true] {
        let msg = quantize(
            &model,
            &im,
            &out,
            &QuantOptions {
                force,
                ..opts.clone()
            },
            &|_, _| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("layers.2.ffn.experts.1.w1.weight") && msg.contains("non-finite"),
            "{msg}"
        );
        assert!(!out.exists());
        let stored: Vec<_> = std::fs::read_dir(parts_dir(&out))
            .map(|rd| rd.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            !stored.iter().any(|n| n.to_string_lossy() == "layer-00002"),
            "{stored:?}"
        );
    }
}

#[test]
fn concurrent_writers_with_other_arguments_never_mix() {
    let tmp = tempfile::tempdir().unwrap();
    let im = write_imatrix(tmp.path(), None);
    let out = tmp.path().join("q");
    let base = QuantOptions {
        format: QuantFormat::E8p2E8p2,
        experts: few_experts(),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let runs = [
        base.clone(),
        QuantOptions {
            mlx_bits: Some(4),
            ..base.clone()
        },
    ];
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = runs
            .iter()
            .map(|o| s.spawn(|| quantize(&bundled(), &im, &out, o, &|_, _| {})))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let joined: Vec<_> = results
        .iter()
        .filter_map(|r| r.as_ref().ok().filter(|r| r.joined))
        .collect();
    assert!(joined.len() <= 1, "both joined");
    if out.exists() {
        let mlx = count_suffix(&out, ".biases");
        let resid = count_suffix(&out, ".resid.weight");
        assert!(
            (mlx == 48 && resid == 0) || (mlx == 0 && resid == 48),
            "mixed output: {mlx} MLX weights, {resid} E8P residuals"
        );
    }
}

/// A checkpoint joined from shards is the same bytes, every file and its `quant-report.json`
/// included, as one made in one call: the report keeps the call's run record (where, which
/// layers, how long) out of the file.
#[test]
fn sharded_and_whole_outputs_are_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let im = write_imatrix(&tmp.path().join("full"), None);
    let opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: few_experts(),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let whole = tmp.path().join("whole");
    let r = quantize(&bundled(), &im, &whole, &opts, &|_, _| {}).unwrap();
    assert!(r.joined && r.fit_seconds > 0.0 && !r.layers_fitted.is_empty());
    let sharded = tmp.path().join("sharded");
    for i in [1, 0] {
        let o = QuantOptions {
            shard: (i, 2),
            ..opts.clone()
        };
        quantize(&bundled(), &im, &sharded, &o, &|_, _| {}).unwrap();
    }
    let names = |d: &std::path::Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(&whole), names(&sharded));
    for n in names(&whole) {
        assert!(
            std::fs::read(whole.join(&n)).unwrap() == std::fs::read(sharded.join(&n)).unwrap(),
            "{n} differs between the whole and the sharded output"
        );
    }
    // The stored report still reads, without its run record.
    let text = std::fs::read_to_string(whole.join(REPORT_FILE)).unwrap();
    let back: QuantReport = serde_json::from_str(&text).unwrap();
    assert!(back.joined && back.output.is_empty() && back.fit_seconds == 0.0);
}
