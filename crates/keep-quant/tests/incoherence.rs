//! Incoherence processing end to end: some experts of the bundled model quantized rotated
//! (`quantize_with`), their seeds read back from config.json, and the model computing the
//! rotated experts with their transforms undone — in both kernel modes — close to the source
//! model, while the same checkpoint with its marker removed (the rotated codes computed as if
//! they were plain) is far from it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::Checkpoint;
use keep_model::{CheckpointExperts, Kernels, Logits, Model, ModelConfig};
use keep_quant::checkpoint::{quantize_with, ExpertSelection, QuantOptions};
use keep_quant::incoherence::{IncoherenceOptions, Mode};
use keep_quant::QuantFormat;

mod common;
use common::bundled;

/// Mean KL(source ‖ quantized) per position above which rotated experts are not computing
/// what they should (as in `model_runs.rs`: a correct 2-bit code of a quarter of the experts
/// measures ~1e-3, a wrong one ≫ 0.1).
const KL_MAX: f64 = 0.05;
/// How much further from the source the marker-less copy must be: rotated codes computed
/// unrotated are unrelated weights.
const WRONG_FACTOR: f64 = 10.0;

/// A non-flat imatrix, so the rotated fit's flattening is exercised.
fn imatrix(dir: &Path) -> PathBuf {
    common::imatrix_with(dir, |j| 1.0 + (j % 7) as f32)
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    v.iter().map(|&x| x as f64 - z).collect()
}

fn logits(dir: &Path, toks: &[u32], kernels: Kernels) -> Vec<f32> {
    let ck = Checkpoint::open(dir).unwrap();
    let cfg = ModelConfig::from_checkpoint(&ck).unwrap();
    let experts = Box::new(CheckpointExperts::new(&ck, &cfg).unwrap());
    let model = Model::load_with(&ck, cfg, experts)
        .unwrap()
        .with_options(keep_model::RunOptions::with_kernels(kernels));
    let mut cache = model.new_cache();
    model.forward(toks, &mut cache, Logits::All, None).unwrap()
}

fn kl(src: &[f32], q: &[f32], n: usize) -> f64 {
    let v = src.len() / n;
    (0..n)
        .map(|p| {
            let a = log_softmax(&src[p * v..(p + 1) * v]);
            let b = log_softmax(&q[p * v..(p + 1) * v]);
            a.iter()
                .zip(&b)
                .map(|(x, y)| x.exp() * (x - y))
                .sum::<f64>()
        })
        .sum::<f64>()
        / n as f64
}

/// `src` with `keep_quantization.incoherence` removed from its config.
fn strip_marker(src: &Path, out: &Path) {
    let ck = Checkpoint::open(src).unwrap();
    let metas: Vec<TensorMeta> = ck
        .tensors()
        .map(|t| TensorMeta::new(t.name, t.dtype, t.shape))
        .collect();
    let mut w = CheckpointWriter::create(out, metas, WriterOptions::default()).unwrap();
    for t in ck.tensors() {
        w.write_tensor(t.name, t.bytes).unwrap();
    }
    let mut raw = ck.require_config().unwrap().raw.clone();
    raw["keep_quantization"]
        .as_object_mut()
        .unwrap()
        .remove("incoherence");
    w.add_file("config.json", raw.to_string().as_bytes())
        .unwrap();
    w.finish().unwrap();
}

#[test]
fn rotated_experts_run_in_both_kernel_modes_and_need_their_marker() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let toks: Vec<u32> = (0..24).map(|i| ((i * 37 + 11) % 4000) as u32).collect();
    let src = logits(&bundled(), &toks, Kernels::Exact);
    let sel = ExpertSelection::Only(
        (0..8)
            .map(|l| (l, (0..4).collect::<BTreeSet<_>>()))
            .collect(),
    );
    let out = tmp.path().join("rot");
    let opts = QuantOptions {
        format: QuantFormat::E8p2E81,
        experts: sel,
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let inc = IncoherenceOptions {
        mode: Mode::Both,
        seed: 99,
    };
    let r = quantize_with(&bundled(), &im, &out, &opts, Some(inc), &|_, _| {}).unwrap();
    assert_eq!(r.incoherent_tensors, 8 * 4 * 3);
    let ck = Checkpoint::open(&out).unwrap();
    let marker = keep_checkpoint::incoherence::read(ck.require_config().unwrap()).unwrap();
    assert_eq!(marker.len(), 8 * 4 * 3);
    let m = marker["layers.4.ffn.experts.3.w2"];
    assert_eq!((m.block_in, m.block_out), (128, 256));
    assert!(!marker.contains_key("layers.4.ffn.experts.9.w2"));
    drop(ck);

    let exact = logits(&out, &toks, Kernels::Exact);
    let fast = logits(&out, &toks, Kernels::Fast);
    let (ke, kf) = (kl(&src, &exact, toks.len()), kl(&src, &fast, toks.len()));
    assert!(ke < KL_MAX, "exact kernels: KL {ke}");
    assert!(kf < KL_MAX, "fast kernels: KL {kf}");

    let bare = tmp.path().join("bare");
    strip_marker(&out, &bare);
    let wrong = kl(&src, &logits(&bare, &toks, Kernels::Exact), toks.len());
    assert!(
        wrong > WRONG_FACTOR * ke,
        "without the marker KL {wrong}, with it {ke}"
    );
}

#[test]
fn a_resumed_run_with_other_incoherence_is_refused_and_mlx_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let sel = ExpertSelection::Only((0..8).map(|l| (l, BTreeSet::from([0usize]))).collect());
    let out = tmp.path().join("q");
    let mut opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: sel,
        shard: (0, 2),
        force: false,
        mlx_bits: None,
    };
    let inc = Some(IncoherenceOptions {
        mode: Mode::Output,
        seed: 1,
    });
    // even layers rotated (output side); the odd layers' shard without rotation is refused
    // naming the setting (the two would mix in one output), the same settings join
    let a = quantize_with(&bundled(), &im, &out, &opts, inc, &|_, _| {}).unwrap();
    assert!(!a.joined);
    opts.shard = (1, 2);
    let e = quantize_with(&bundled(), &im, &out, &opts, None, &|_, _| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--incoherence out") && e.contains("--incoherence off"),
        "{e}"
    );
    let b = quantize_with(&bundled(), &im, &out, &opts, inc, &|_, _| {}).unwrap();
    assert!(b.joined);
    assert_eq!(b.incoherent_tensors, 8 * 3);
    let ck = Checkpoint::open(&out).unwrap();
    let marker = keep_checkpoint::incoherence::read(ck.require_config().unwrap()).unwrap();
    assert_eq!(marker.len(), 8 * 3);
    assert!(marker.values().all(|m| m.block_in == 1));

    opts.mlx_bits = Some(4);
    opts.shard = (0, 1);
    let e = quantize_with(
        &bundled(),
        &im,
        &tmp.path().join("m"),
        &opts,
        inc,
        &|_, _| {},
    );
    assert!(e.is_err());
}
