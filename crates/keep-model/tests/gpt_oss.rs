//! keep's gpt-oss forward against transformers 5.23's `GptOssForCausalLM` through the committed
//! fixture `fixtures/gpt-oss` (3 layers: sliding window 5, full, sliding; 4 query heads over 2
//! KV heads with random sinks and q/k/v/o biases; 4 MXFP4 experts top-2 with router and expert
//! biases, scales large enough that the SwiGLU clamp bites; YaRN RoPE with `truncate: false`),
//! written with its reference outputs by
//! `tools/oracle/gpt_oss_conformance.py --fixture fixtures/gpt-oss`: logits of one prefill
//! (top-1 agreement, mean KL, largest difference), the routed experts of every (token, layer)
//! pair, decode logits (one token at a time with keep's cache) equal to prefill logits bit for
//! bit, a chunked prefill equal to one pass; and the checkpoint check's refusal of missing and
//! mismatched tensors, naming each.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::Checkpoint;
use keep_model::config::Family;
use keep_model::generate::argmax;
use keep_model::observer::RouteRecorder;
use keep_model::{Logits, Model};
use safetensors::SafeTensors;

/// Top-1 agreement over all positions: every one (random weights leave no near-ties here).
const MIN_TOP1: f64 = 1.0;
/// Mean KL(reference ‖ keep) ceiling, nats per position: f32 summation order only (the
/// conformance suite's bar is 1e-4).
const MAX_MEAN_KL: f64 = 1e-8;
/// Largest logit difference: f32 rounding of the same arithmetic.
const MAX_ABS_DIFF: f32 = 1e-3;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gpt-oss")
}

struct Tensors(HashMap<String, Vec<u8>>);

impl Tensors {
    fn load(path: &Path) -> Tensors {
        let bytes = std::fs::read(path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        Tensors(
            st.tensors()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.data().to_vec()))
                .collect(),
        )
    }
    fn i32s(&self, k: &str) -> Vec<i32> {
        self.0[k]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn f32s(&self, k: &str) -> Vec<f32> {
        self.0[k]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

fn kl(a: &[f32], b: &[f32]) -> f64 {
    let lse = |v: &[f32]| {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (la, lb) = (lse(a), lse(b));
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            let (pa, pb) = (x as f64 - la, y as f64 - lb);
            pa.exp() * (pa - pb)
        })
        .sum()
}

#[test]
fn mxfp4_checkpoint_matches_transformers() {
    let dir = fixture();
    let ck = Checkpoint::open(&dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    assert_eq!(model.cfg.family, Family::GptOss);
    let r = Tensors::load(&dir.join("reference.safetensors"));
    let tokens: Vec<u32> = r.i32s("tokens").iter().map(|&v| v as u32).collect();
    let want = r.f32s("logits");
    let (t, v, k, nl) = (
        tokens.len(),
        model.cfg.vocab,
        model.cfg.top_k,
        model.cfg.n_layers,
    );
    let c = model.cfg.raw.gpt_oss.clone().unwrap();
    assert!(
        c.sliding_window.unwrap() < t,
        "the window is shorter than the sequence"
    );

    // One prefill: logits and routes.
    let mut rec = RouteRecorder::default();
    let got = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, Some(&mut rec))
        .unwrap();
    assert_eq!(got.len(), t * v);
    let (mut agree, mut kl_sum, mut diff) = (0usize, 0f64, 0f32);
    for i in 0..t {
        let (a, b) = (&want[i * v..(i + 1) * v], &got[i * v..(i + 1) * v]);
        agree += usize::from(argmax(a) == argmax(b));
        kl_sum += kl(a, b);
        diff = a.iter().zip(b).fold(diff, |m, (x, y)| m.max((x - y).abs()));
    }
    let (top1, mean_kl) = (agree as f64 / t as f64, kl_sum / t as f64);
    assert!(top1 >= MIN_TOP1, "top-1 agreement {top1}");
    assert!(mean_kl <= MAX_MEAN_KL, "mean KL {mean_kl:e}");
    assert!(diff <= MAX_ABS_DIFF, "max |diff| {diff:e}");
    let ref_routes = r.i32s("routes");
    let mut mine = vec![-1i32; nl * t * k];
    for (layer, start, ex) in &rec.calls {
        for (j, row) in ex.chunks_exact(k).enumerate() {
            let mut row: Vec<i32> = row.iter().map(|&e| e as i32).collect();
            row.sort_unstable();
            let o = (layer * t + start + j) * k;
            mine[o..o + k].copy_from_slice(&row);
        }
    }
    assert_eq!(mine, ref_routes, "routed experts");

    // Decode with keep's cache, one token at a time: the prefill's logits bit for bit.
    let mut cache = model.new_cache();
    for (i, &tok) in tokens.iter().enumerate() {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        let p = &got[i * v..(i + 1) * v];
        assert!(
            l.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()),
            "decode logits differ from prefill at position {i}"
        );
    }

    // The sliding layers (0 and 2) hold the last window − 1 positions, the full layer all.
    let w = c.sliding_window.unwrap();
    let kw = c.num_key_value_heads * c.head_dim;
    for (l, held) in [(0, w - 1), (1, t), (2, w - 1)] {
        let kv = &cache.layers[l].kv_rows;
        assert_eq!(
            (kv.rows, kv.k.len() / kw, kv.v.len() / kw),
            (t, held, held),
            "layer {l}"
        );
    }

    // The cache reserved for the context (chunks of 5: a prefill, then decode) never grows.
    model.opts.prefill_chunk = 5;
    let mut cache = keep_model::Cache::for_context(&model.cfg, t + 3, model.opts.chunk());
    let reserved = cache.capacity_bytes();
    assert!(reserved as u64 <= model.cfg.cache_bytes(t + 3, model.opts.chunk()));
    model
        .forward(&tokens, &mut cache, Logits::Last, None)
        .unwrap();
    for &tok in &tokens[..3] {
        model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
    }
    assert_eq!(cache.capacity_bytes(), reserved, "the cache grew");

    // A prefill in chunks of 5 equals one pass.
    let chunked = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert!(got
        .iter()
        .zip(&chunked)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// The fixture's tensors with `edit` applied, written with its config to a new directory.
fn edited(
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let dir = fixture();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView)> = ts
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let out = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(views, None, &out.path().join("model.safetensors")).unwrap();
    std::fs::copy(dir.join("config.json"), out.path().join("config.json")).unwrap();
    out
}

#[test]
fn missing_and_mismatched_tensors_are_refused_by_name() {
    let sinks = "model.layers.1.self_attn.sinks";
    let scales = "model.layers.0.mlp.experts.down_proj_scales";
    let d = edited(|ts| {
        ts.retain(|t| t.0 != sinks);
        let s = ts.iter_mut().find(|t| t.0 == scales).unwrap();
        // One expert fewer than the config's.
        let per = s.3.len() / s.2[0];
        s.2[0] -= 1;
        s.3.truncate(s.3.len() - per);
    });
    let ck = Checkpoint::open(d.path()).unwrap();
    let e = Model::load(&ck).err().expect("refused").to_string();
    assert!(e.contains(sinks) && e.contains("missing"), "{e}");
    assert!(e.contains(scales) && e.contains("expected U8"), "{e}");
}
