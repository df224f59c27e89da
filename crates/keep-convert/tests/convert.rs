//! synth → inspect → repack on real files: lossless repack, refusals that name the tensor, and
//! inspect's problem list.

use std::path::Path;

use keep_checkpoint::{Checkpoint, Dtype};
use keep_convert::inspect::inspect;
use keep_convert::presets::{preset, Storage};
use keep_convert::repack::{repack, RepackOptions, ResidentFormat};
use keep_convert::synth::{synth, SynthOptions};
use keep_convert::ConvertError;

fn make(dir: &Path, name: &str, storage: Option<Storage>, seed: u64) -> std::path::PathBuf {
    let (cfg, st) = preset(name).unwrap();
    let tag = storage.map_or(String::new(), |s| {
        format!("-{}x{}-{}", s.block.0, s.block.1, s.f32_scales)
    });
    let out = dir.join(format!("{name}-{seed}{tag}"));
    let opts = SynthOptions {
        seed,
        storage: storage.unwrap_or(st),
        force: false,
        max_shard_bytes: 1 << 20,
    };
    synth(&cfg, &out, &opts, &|_, _| {}).unwrap()
}

fn opts(resident: ResidentFormat) -> RepackOptions {
    RepackOptions {
        resident,
        verify: true,
        force: false,
        sync: false,
    }
}

#[test]
fn synth_is_deterministic_and_inspects_clean() {
    let d = tempfile::tempdir().unwrap();
    let a = make(d.path(), "tiny", None, 7);
    let b = {
        let (cfg, st) = preset("tiny").unwrap();
        let out = d.path().join("again");
        let o = SynthOptions {
            seed: 7,
            storage: st,
            force: false,
            max_shard_bytes: 1 << 20,
        };
        synth(&cfg, &out, &o, &|_, _| {}).unwrap()
    };
    let (ca, cb) = (Checkpoint::open(&a).unwrap(), Checkpoint::open(&b).unwrap());
    assert!(ca.shards().len() > 1, "tiny spans several 1 MiB shards");
    for t in ca.tensors() {
        assert_eq!(t.bytes, cb.tensor(t.name).unwrap().bytes, "{}", t.name);
    }
    let r = inspect(&ca);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.routed_experts, Some(16));
    assert_eq!(r.fp8_blocks.keys().collect::<Vec<_>>(), vec!["32x32 e8m0"]);
    let experts = &r.by_role_format["routed_expert"]["fp4 (mxfp4)"];
    assert!((experts.bits_per_weight - 4.25).abs() < 1e-9);
    // FP4 experts: 3 matrices × 16 experts × 8 layers.
    assert_eq!(experts.tensors, 3 * 16 * 8);
}

#[test]
fn repack_mxfp8_is_bit_exact_and_copies_the_rest() {
    let d = tempfile::tempdir().unwrap();
    for (name, storage) in [
        ("tiny", None),
        ("tiny-v4flash", None),
        (
            "tiny-v4flash",
            Some(Storage {
                block: (128, 128),
                f32_scales: true,
                hash_layers: 2,
            }),
        ),
    ] {
        let src = make(d.path(), name, storage, 1);
        let out = d.path().join(format!("{name}-mx-{}", storage.is_some()));
        let (_, rep) = repack(&src, &out, &opts(ResidentFormat::Mxfp8), &|_, _| {}).unwrap();
        assert!(rep.verified);
        let s = Checkpoint::open(&src).unwrap();
        let o = Checkpoint::open(&out).unwrap();
        // Every resident of every layer is repacked: 5 attention projections, the shared
        // expert's 3, and the indexer's wq_b in index-source layers (V4: the CSA layers).
        let cfg = s.config().unwrap();
        let idx = if cfg.model_type == "deepseek_v4" {
            (0..cfg.num_hidden_layers)
                .filter(|&l| cfg.compress_ratio(l) == 4)
                .count()
        } else {
            cfg.index_source_layer_ids.len()
        };
        // Each MTP module: its window-only block's 8 and `e_proj`, `h_proj`.
        let mtp = 10 * cfg.num_nextn_predict_layers;
        assert_eq!(rep.repacked.len(), 8 * cfg.num_hidden_layers + idx + mtp);
        for r in &rep.repacked {
            let w = o.tensor(&r.name).unwrap();
            let sc = o.tensor(r.created_scale.as_ref().unwrap()).unwrap();
            assert_eq!(
                w.bytes,
                s.tensor(&r.name).unwrap().bytes,
                "element bytes unchanged"
            );
            assert_eq!(sc.dtype, Dtype::F8_E8M0);
            assert_eq!(sc.shape, &[r.shape[0] as u64, (r.shape[1] / 32) as u64]);
        }
        for t in s.tensors() {
            if !rep
                .repacked
                .iter()
                .any(|r| r.name == t.name || r.source_scale == t.name)
            {
                assert_eq!(
                    t.bytes,
                    o.tensor(t.name).unwrap().bytes,
                    "{} copied",
                    t.name
                );
            }
        }
        assert!(keep_checkpoint::sums::verify_dir(&out).unwrap().passed());
        let q = &o.config().unwrap().quantization_config;
        assert_eq!(q.as_ref().unwrap().quant_method, "mxfp8");
        let r = inspect(&o);
        assert!(r.problems.is_empty() || name != "tiny", "{:?}", r.problems);
        assert_eq!(r.fp8_blocks.keys().collect::<Vec<_>>(), vec!["1x32 e8m0"]);
        // A second run into the same place is refused.
        let e = repack(&src, &out, &opts(ResidentFormat::Mxfp8), &|_, _| {}).unwrap_err();
        assert!(e.to_string().contains("--force"), "{e}");
    }
}

#[test]
fn repack_bf16_decodes_exactly() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny", None, 2);
    let out = d.path().join("bf16");
    let (_, rep) = repack(&src, &out, &opts(ResidentFormat::Bf16), &|_, _| {}).unwrap();
    let o = Checkpoint::open(&out).unwrap();
    for r in &rep.repacked {
        assert_eq!(o.tensor(&r.name).unwrap().dtype, Dtype::BF16);
        assert!(!o.contains(&r.source_scale));
    }
}

/// Rewrite one scale tensor of a copy of `src` with `f(bytes) -> (dtype, bytes)`.
fn tamper(src: &Path, dst: &Path, victim: &str, f: impl Fn(&[u8]) -> (Dtype, Vec<u8>)) {
    use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
    let ck = Checkpoint::open(src).unwrap();
    let mut metas = vec![];
    let mut datas = vec![];
    for t in ck.tensors() {
        let (dt, b) = if t.name == victim {
            f(t.bytes)
        } else {
            (t.dtype, t.bytes.to_vec())
        };
        metas.push(TensorMeta::new(t.name, dt, t.shape));
        datas.push((t.name.to_string(), b));
    }
    let mut w = CheckpointWriter::create(dst, metas, WriterOptions::default()).unwrap();
    for (n, b) in datas {
        w.write_tensor(&n, &b).unwrap();
    }
    w.copy_file("config.json", &src.join("config.json"))
        .unwrap();
    w.finish().unwrap();
}

#[test]
fn repack_refuses_what_would_round_and_leaves_nothing() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny", None, 3);
    let victim = "layers.2.attn.wkv.scale";
    type Tamper = Box<dyn Fn(&[u8]) -> (Dtype, Vec<u8>)>;
    let cases: Vec<(&str, Tamper, &str)> = vec![
        (
            "nan",
            Box::new(|b: &[u8]| {
                let mut v = b.to_vec();
                v[0] = 0xFF;
                (Dtype::F8_E8M0, v)
            }),
            "NaN",
        ),
        (
            "scale-inv",
            Box::new(|b: &[u8]| {
                let v: Vec<u8> = b
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &x)| {
                        let s = keep_format::e8m0::e8m0_to_f32(x) * if i == 1 { 1.5 } else { 1.0 };
                        s.to_le_bytes()
                    })
                    .collect();
                (Dtype::F32, v)
            }),
            "not an exact power of two",
        ),
    ];
    for (tag, f, want) in cases {
        let bad = d.path().join(format!("bad-{tag}"));
        tamper(&src, &bad, victim, f);
        let out = d.path().join(format!("out-{tag}"));
        let e = repack(&bad, &out, &opts(ResidentFormat::Mxfp8), &|_, _| {}).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, ConvertError::Refused { .. }), "{s}");
        assert!(
            s.contains("layers.2.attn.wkv.weight") && s.contains(want),
            "{s}"
        );
        assert!(!out.exists());
        let left = std::fs::read_dir(d.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains("keep-tmp")
            })
            .count();
        assert_eq!(left, 0);
    }
    // 16-wide blocks would let a 32-group straddle two blocks.
    let (cfg, _) = preset("tiny").unwrap();
    let straddle = d.path().join("straddle");
    let o = SynthOptions {
        seed: 0,
        storage: Storage {
            block: (16, 16),
            f32_scales: false,
            hash_layers: 0,
        },
        force: false,
        max_shard_bytes: 1 << 30,
    };
    synth(&cfg, &straddle, &o, &|_, _| {}).unwrap();
    let e = repack(
        &straddle,
        &d.path().join("s-out"),
        &opts(ResidentFormat::Mxfp8),
        &|_, _| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("straddle"), "{e}");
    // bf16 accepts the V3-style non-power-of-two scale only where the decode is exact: 1.5 × an
    // E4M3 value has at most 5 significant bits, so bf16 holds it.
    let inv = d.path().join("bad-scale-inv");
    repack(
        &inv,
        &d.path().join("inv-bf16"),
        &opts(ResidentFormat::Bf16),
        &|_, _| {},
    )
    .unwrap();
}

#[test]
fn inspect_lists_inconsistencies() {
    let d = tempfile::tempdir().unwrap();
    let src = make(d.path(), "tiny", None, 4);
    // Orphan a scale and drop a weight's scale by renaming the scale.
    let bad = d.path().join("bad");
    {
        use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
        let ck = Checkpoint::open(&src).unwrap();
        let rename = |n: &str| match n {
            "layers.0.attn.wq_a.scale" => "layers.0.attn.ghost.scale".to_string(),
            n => n.to_string(),
        };
        let skip = |n: &str| n.starts_with("layers.1.ffn.experts.15.");
        let metas = ck
            .tensors()
            .filter(|t| !skip(t.name))
            .map(|t| TensorMeta::new(rename(t.name), t.dtype, t.shape))
            .collect();
        let mut w = CheckpointWriter::create(&bad, metas, WriterOptions::default()).unwrap();
        for t in ck.tensors().filter(|t| !skip(t.name)) {
            w.write_tensor(&rename(t.name), t.bytes).unwrap();
        }
        w.copy_file("config.json", &src.join("config.json"))
            .unwrap();
        w.finish().unwrap();
    }
    let r = inspect(&Checkpoint::open(&bad).unwrap());
    let all = r.problems.join("\n");
    assert!(all.contains("layers.0.attn.wq_a.weight"), "{all}");
    assert!(
        all.contains("orphan scale `layers.0.attn.ghost.scale`"),
        "{all}"
    );
    assert!(all.contains("layer 1 has 15 routed experts"), "{all}");
}
