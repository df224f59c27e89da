//! The quantized checkpoint runs in keep's model: a few experts per layer of the bundled model
//! coded in each format (through `keep quant`'s library entry point), loaded by keep-model's
//! loader (which classifies the E8P tensors and attaches the residual stages), and its
//! next-token distributions compared with the source model's.

use std::collections::BTreeSet;
use std::path::Path;

use keep_checkpoint::{Checkpoint, Dtype};
use keep_model::{Logits, Model};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions};
use keep_quant::QuantFormat;

mod common;
use common::{bundled, imatrix};

/// Mean KL(source ‖ quantized) per position above which the coded experts are not computing
/// what they should: a quarter of the routed experts changed by a 2-bit code moves the bundled
/// model's distribution by far less (measured ~1e-3), while a wrong decode gives KL ≫ 0.1.
const KL_MAX: f64 = 0.05;

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    v.iter().map(|&x| x as f64 - z).collect()
}

fn logits(dir: &Path, toks: &[u32]) -> (Vec<f32>, usize) {
    let ck = Checkpoint::open(dir).unwrap();
    let model = Model::load(&ck).unwrap();
    let mut cache = model.new_cache();
    let v = model.cfg.vocab;
    (
        model.forward(toks, &mut cache, Logits::All, None).unwrap(),
        v,
    )
}

#[test]
fn quantized_experts_run_in_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let toks: Vec<u32> = (0..24).map(|i| ((i * 37 + 11) % 4000) as u32).collect();
    let (src, vocab) = logits(&bundled(), &toks);
    let sel = ExpertSelection::Only(
        (0..8)
            .map(|l| (l, (0..4).collect::<BTreeSet<_>>()))
            .collect(),
    );
    let mut kls = vec![];
    for format in QuantFormat::ALL {
        let out = tmp.path().join(format.label());
        let opts = QuantOptions {
            format,
            experts: sel.clone(),
            shard: (0, 1),
            force: false,
            mlx_bits: None,
        };
        quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap();
        let ck = Checkpoint::open(&out).unwrap();
        let v =
            keep_model::weights::weight(&ck, "layers.4.ffn.experts.3.w2", 256, 128, None).unwrap();
        assert_eq!(v.format_name(), format.label());
        let (q, _) = logits(&out, &toks);
        assert!(q.iter().all(|v| v.is_finite()));
        assert_ne!(q, src, "{format:?}: the coded experts change the logits");
        let mut kl = 0f64;
        for p in 0..toks.len() {
            let a = log_softmax(&src[p * vocab..(p + 1) * vocab]);
            let b = log_softmax(&q[p * vocab..(p + 1) * vocab]);
            kl += a
                .iter()
                .zip(&b)
                .map(|(x, y)| x.exp() * (x - y))
                .sum::<f64>();
        }
        kl /= toks.len() as f64;
        assert!(kl < KL_MAX, "{format:?}: KL {kl}");
        kls.push(kl);
    }
    // more bits, closer to the source
    assert!(kls[1] < kls[0] && kls[2] < kls[1], "{kls:?}");
}

#[test]
fn mlx_affine_experts_run_in_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let toks: Vec<u32> = (0..24).map(|i| ((i * 41 + 7) % 4000) as u32).collect();
    let (src, vocab) = logits(&bundled(), &toks);
    let sel = ExpertSelection::Only(
        (0..8)
            .map(|l| (l, (0..4).collect::<BTreeSet<_>>()))
            .collect(),
    );
    let srck = Checkpoint::open(&bundled()).unwrap();
    let sv =
        keep_model::weights::weight(&srck, "layers.4.ffn.experts.3.w2", 256, 128, None).unwrap();
    let mut kls = vec![];
    for bits in [2u32, 3, 4] {
        let out = tmp.path().join(format!("mlx{bits}"));
        let opts = QuantOptions {
            format: QuantFormat::E8p2,
            experts: sel.clone(),
            shard: (0, 1),
            force: false,
            mlx_bits: Some(bits),
        };
        let r = quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap();
        assert_eq!(r.method, format!("mlx{bits}"));
        assert_eq!(r.bits_per_weight, bits as f64 + 0.5);
        let ck = Checkpoint::open(&out).unwrap();
        let v =
            keep_model::weights::weight(&ck, "layers.4.ffn.experts.3.w2", 256, 128, None).unwrap();
        assert_eq!(v.format_name(), format!("mlx-affine{bits}"));
        // The stored bytes are keep-format's mx.quantize rule applied to the source rows.
        let t = ck.tensor("layers.4.ffn.experts.3.w2.weight").unwrap();
        assert_eq!(t.dtype, Dtype::U32);
        let mut row = vec![0f32; 128];
        let pb = 128 * bits as usize / 8;
        for r in [0usize, 17, 255] {
            sv.decode_row(r, &mut row);
            let mut p = vec![0u8; pb];
            let (mut s, mut b) = (vec![0u16; 2], vec![0u16; 2]);
            keep_format::mlx_affine::quantize_row_bf16(bits, &row, &mut p, &mut s, &mut b).unwrap();
            assert_eq!(p, t.bytes[r * pb..(r + 1) * pb], "bits {bits} row {r}");
        }
        // An expert outside the selection stays as shipped.
        let untouched = ck.tensor("layers.4.ffn.experts.9.w2.weight").unwrap();
        assert_eq!(untouched.dtype, Dtype::I8);
        let (q, _) = logits(&out, &toks);
        assert!(q.iter().all(|v| v.is_finite()));
        let mut kl = 0f64;
        for p in 0..toks.len() {
            let a = log_softmax(&src[p * vocab..(p + 1) * vocab]);
            let b = log_softmax(&q[p * vocab..(p + 1) * vocab]);
            kl += a
                .iter()
                .zip(&b)
                .map(|(x, y)| x.exp() * (x - y))
                .sum::<f64>();
        }
        kl /= toks.len() as f64;
        assert!(kl < KL_MAX, "mlx{bits}: KL {kl}");
        kls.push(kl);
    }
    assert!(kls[1] < kls[0] && kls[2] < kls[1], "{kls:?}");
}

/// The bundled model rewritten in 1 MiB shards, tokenizer files and config beside it.
fn resharded(out: &Path) {
    use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
    let ck = Checkpoint::open(&bundled()).unwrap();
    let metas = ck
        .tensors()
        .map(|t| TensorMeta::new(t.name, t.dtype, t.shape))
        .collect();
    let opts = WriterOptions {
        max_shard_bytes: 1 << 20,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, metas, opts).unwrap();
    for t in ck.tensors() {
        w.write_tensor(t.name, t.bytes).unwrap();
    }
    w.copy_file("config.json", &bundled().join("config.json"))
        .unwrap();
    for f in ck.aux_files().unwrap() {
        let n = f.file_name().unwrap().to_string_lossy().to_string();
        w.copy_file(&n, &f).unwrap();
    }
    w.finish().unwrap();
}

/// A source shard none of whose tensors quant changes is hard-linked into the output, not
/// copied: the output holds every tensor with the same bytes as a quant of the same model in
/// one shard, its `SHA256SUMS` verifies, and the linked files share the source's inodes.
#[test]
fn untouched_shards_are_linked_and_the_output_is_the_same() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    let src = tmp.path().join("sharded");
    resharded(&src);
    let opts = QuantOptions {
        format: QuantFormat::E8p2,
        experts: ExpertSelection::Only([(4, BTreeSet::from([3]))].into_iter().collect()),
        shard: (0, 1),
        force: false,
        mlx_bits: None,
    };
    let one = tmp.path().join("from-one-shard");
    let r1 = quantize(&bundled(), &im, &one, &opts, &|_, _| {}).unwrap();
    assert_eq!(r1.reused.linked_shards + r1.reused.copied_shards, 0);
    let many = tmp.path().join("from-many-shards");
    let r = quantize(&src, &im, &many, &opts, &|_, _| {}).unwrap();
    let n_src = Checkpoint::open(&src).unwrap().shards().len();
    assert!(
        r.reused.linked_shards > 0 && r.reused.linked_shards < n_src,
        "{:?} of {n_src} shards",
        r.reused
    );
    assert_eq!(r.reused.copied_shards, 0);
    let (a, b) = (
        Checkpoint::open(&one).unwrap(),
        Checkpoint::open(&many).unwrap(),
    );
    assert!(b.warnings().is_empty(), "{:?}", b.warnings());
    assert_eq!(a.len(), b.len());
    for t in a.tensors() {
        let u = b.tensor(t.name).unwrap();
        assert_eq!(
            (t.dtype, t.shape, t.bytes),
            (u.dtype, u.shape, u.bytes),
            "{}",
            t.name
        );
    }
    assert!(keep_checkpoint::sums::verify_dir(&many).unwrap().passed());
    let inodes = |dir: &Path| -> BTreeSet<u64> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().ino())
            .collect()
    };
    let shared = inodes(&src).intersection(&inodes(&many)).count();
    assert_eq!(shared, r.reused.linked_shards);
}
