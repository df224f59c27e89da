//! keep's Qwen3-MoE forward against mlx-lm 0.32.2's `qwen3_moe` through committed fixtures
//! (`fixtures/qwen3-tiny-bf16`, `fixtures/qwen3-tiny-fp8`, and `fixtures/qwen3-tiny-mlx4` —
//! mlx-lm's own 4-bit quantization, experts stacked in `switch_mlp` —, written with their
//! reference outputs by `tools/oracle/qwen3_ref.py fixtures`): logits of one prefill (top-1 agreement, mean KL),
//! the routed experts of every (token, MoE layer) pair, greedy tokens decoded one at a time
//! with keep's cache against the reference's, decode logits equal to prefill logits bit for bit,
//! a chunked prefill equal to one pass, and a router mask that removes experts.

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
/// Mean KL(reference ‖ keep) ceiling, nats per position: f32 summation order and MLX's own
/// RoPE/softmax arithmetic only (the conformance suite's bar is 1e-4).
const MAX_MEAN_KL: f64 = 1e-8;
/// Same routed experts on every (token, MoE layer) pair.
const MIN_ROUTES: f64 = 1.0;
/// Renormalised gate weights sum to 1 up to f32 rounding of a few terms.
const WEIGHT_SUM_TOL: f32 = 1e-6;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

struct Tensors(HashMap<String, (Vec<usize>, Vec<u8>)>);

impl Tensors {
    fn load(path: &Path) -> Tensors {
        let bytes = std::fs::read(path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        Tensors(
            st.tensors()
                .into_iter()
                .map(|(k, v)| (k.to_string(), (v.shape().to_vec(), v.data().to_vec())))
                .collect(),
        )
    }
    fn i32s(&self, k: &str) -> Vec<i32> {
        self.0[k]
            .1
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn f32s(&self, k: &str) -> Vec<f32> {
        self.0[k]
            .1
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

fn check_fixture(name: &str) {
    let dir = fixture(name);
    let ck = Checkpoint::open(&dir).unwrap();
    let model = Model::load(&ck).unwrap();
    assert_eq!(model.cfg.family, Family::Qwen3Moe);
    let r = Tensors::load(&dir.join("ref.safetensors"));
    let tokens: Vec<u32> = r.i32s("tokens").iter().map(|&v| v as u32).collect();
    let want = r.f32s("logits");
    let (t, v, k, nl) = (
        tokens.len(),
        model.cfg.vocab,
        model.cfg.top_k,
        model.cfg.n_layers,
    );

    // One prefill: logits and routes.
    let mut rec = RouteRecorder::default();
    let got = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, Some(&mut rec))
        .unwrap();
    assert_eq!(got.len(), t * v);
    let (mut agree, mut kl_sum) = (0usize, 0f64);
    for i in 0..t {
        let (a, b) = (&want[i * v..(i + 1) * v], &got[i * v..(i + 1) * v]);
        agree += usize::from(argmax(a) == argmax(b));
        kl_sum += kl(a, b);
    }
    let (top1, mean_kl) = (agree as f64 / t as f64, kl_sum / t as f64);
    assert!(top1 >= MIN_TOP1, "{name}: top-1 agreement {top1}");
    assert!(mean_kl <= MAX_MEAN_KL, "{name}: mean KL {mean_kl:e}");
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
    let (mut same, mut pairs) = (0usize, 0usize);
    for (a, b) in ref_routes.chunks_exact(k).zip(mine.chunks_exact(k)) {
        if a[0] >= 0 {
            pairs += 1;
            same += usize::from(a == b);
        } else {
            assert!(b[0] < 0, "{name}: a dense layer routed");
        }
    }
    assert!(pairs > 0);
    assert!(
        same as f64 / pairs as f64 >= MIN_ROUTES,
        "{name}: routes {same}/{pairs}"
    );

    // Greedy decode with keep's cache, one token at a time, against the reference's tokens;
    // the decode logits of the prompt equal the prefill's bit for bit.
    let greedy: Vec<u32> = r.i32s("greedy").iter().map(|&v| v as u32).collect();
    let mut cache = model.new_cache();
    let mut seq = tokens.clone();
    seq.extend_from_slice(&greedy[..greedy.len() - 1]);
    let mut mine_greedy = vec![];
    for (i, &tok) in seq.iter().enumerate() {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        if i < t {
            let p = &got[i * v..(i + 1) * v];
            assert!(
                l.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: decode logits differ from prefill at position {i}"
            );
        }
        if i + 1 >= t {
            mine_greedy.push(argmax(&l) as u32);
        }
    }
    assert_eq!(mine_greedy, greedy, "{name}: greedy tokens");
}

#[test]
fn bf16_checkpoint_matches_mlx_lm() {
    check_fixture("qwen3-tiny-bf16");
}

#[test]
fn fp8_block_checkpoint_matches_mlx_lm() {
    check_fixture("qwen3-tiny-fp8");
}

#[test]
fn chunked_prefill_equals_one_pass_and_masks_remove_experts() {
    let dir = fixture("qwen3-tiny-bf16");
    let ck = Checkpoint::open(&dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let tokens: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 128).collect();
    let one = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    model.opts.prefill_chunk = 7;
    let chunked = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert!(one
        .iter()
        .zip(&chunked)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    // Remove experts 0..3 of layer 0: they are never chosen, and the gate weights of a token
    // still sum to 1 (norm_topk_prob).
    let mut mask = vec![false; model.cfg.n_experts];
    mask[..3].iter_mut().for_each(|m| *m = true);
    model.set_router_mask(0, Some(mask)).unwrap();
    let mut rec = RouteRecorder::default();
    model
        .forward(
            &tokens,
            &mut model.new_cache(),
            Logits::Last,
            Some(&mut rec),
        )
        .unwrap();
    for ((_, _, ex), ws) in rec.calls.iter().zip(&rec.weights) {
        assert!(ex.iter().all(|&e| e >= 3));
        for w in ws.chunks_exact(model.cfg.top_k) {
            assert!((w.iter().sum::<f32>() - 1.0).abs() < WEIGHT_SUM_TOL);
        }
    }
    // Only layer 0 routes (layer 1 is dense): one route call per chunk of 7.
    assert_eq!(rec.calls.len(), tokens.len().div_ceil(7));
    assert!(rec.calls.iter().all(|(l, ..)| *l == 0));
}

#[test]
fn mlx_affine_checkpoint_matches_mlx_lm() {
    check_fixture("qwen3-tiny-mlx4");
}

/// The fast kernels' bar against the teacher (as for the other fast formats): mean KL in nats.
const FAST_MAX_MEAN_KL: f64 = 1e-3;
/// The fast kernels' bar against the teacher: top-1 agreement.
const FAST_MIN_TOP1: f64 = 0.99;
/// Largest |exact − fast| logit as a fraction of the largest |logit| (measured 0.24%: int8
/// activations). This fixture's logits reach ~120, so its softmax is nearly one-hot and KL
/// sees only errors that move the argmax (the fast kernels without the bias term: KL 10.6,
/// logits off by 136); this bound sees smaller ones.
const FAST_MAX_REL_DEV: f32 = 0.01;

/// mlx-community 4-bit weights on the integer kernels (`Kernels::Fast`: nibbles into the
/// integer dot products, int8 activations): they ran (logits differ from the exact ones),
/// they score within the fast bar against mlx-lm's logits, and decode equals prefill bit for
/// bit within the fast mode.
#[test]
fn mlx4_fast_kernels_score_within_the_fast_bar() {
    let dir = fixture("qwen3-tiny-mlx4");
    let ck = Checkpoint::open(&dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let r = Tensors::load(&dir.join("ref.safetensors"));
    let tokens: Vec<u32> = r.i32s("tokens").iter().map(|&v| v as u32).collect();
    let want = r.f32s("logits");
    let (t, v) = (tokens.len(), model.cfg.vocab);
    let exact = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    model.opts.kernels = keep_model::Kernels::Fast;
    let fast = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert_ne!(exact, fast, "the fast kernels did not run");
    let (mut agree, mut kl_sum) = (0usize, 0f64);
    for i in 0..t {
        let (a, b) = (&want[i * v..(i + 1) * v], &fast[i * v..(i + 1) * v]);
        agree += usize::from(argmax(a) == argmax(b));
        kl_sum += kl(a, b);
    }
    let (top1, mean_kl) = (agree as f64 / t as f64, kl_sum / t as f64);
    let dmax = exact
        .iter()
        .zip(&fast)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let spread = exact.iter().fold(0f32, |m, a| m.max(a.abs()));
    eprintln!("mlx4 fast vs mlx-lm: mean KL {mean_kl:.3e}, top-1 {top1}, max |exact - fast| {dmax:e}, max |logit| {spread}");
    assert!(mean_kl <= FAST_MAX_MEAN_KL, "fast mean KL {mean_kl:e}");
    assert!(top1 >= FAST_MIN_TOP1, "fast top-1 {top1}");
    assert!(
        dmax <= FAST_MAX_REL_DEV * spread,
        "fast deviates by {dmax} of {spread}"
    );
    let mut cache = model.new_cache();
    for (i, &tok) in tokens.iter().enumerate() {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        let p = &fast[i * v..(i + 1) * v];
        assert!(
            l.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()),
            "fast decode logits differ from prefill at position {i}"
        );
    }
}

#[test]
fn stacked_experts_are_slices_of_the_mapping() {
    use keep_checkpoint::layout::{expert_matrix, ExpertMatrix};
    use keep_checkpoint::naming::ExpertMat;
    use keep_checkpoint::qwen3::stacked_tensor;
    let ck = Checkpoint::open(&fixture("qwen3-tiny-mlx4")).unwrap();
    let cfg = ck.config().unwrap().clone();
    let n = cfg.n_routed_experts;
    for mat in ExpertMat::ALL {
        let stacked = ck.get(&stacked_tensor(0, mat, "weight")).unwrap();
        let per = stacked.bytes.len() / n;
        let mut seen = 0;
        for e in 0..n {
            let ExpertMatrix {
                weight,
                scale,
                biases,
                ..
            } = expert_matrix(&ck, &cfg, 0, e, mat).unwrap();
            // The e-th slice of the mapped stacked tensor, at its own file offset: no copy.
            assert_eq!(weight.bytes.as_ptr(), stacked.bytes[e * per..].as_ptr());
            assert_eq!(weight.bytes.len(), per);
            assert_eq!(weight.file_offset, stacked.file_offset + (e * per) as u64);
            assert_eq!(weight.shape, &stacked.shape[1..]);
            seen += usize::from(scale.is_some() && biases.is_some());
        }
        // gate/up (128 inputs) are MLX affine; down (64 inputs) too: every slice has both.
        assert_eq!(seen, n, "{mat:?}");
    }
    // A slice past the stack, or of a tensor that is not stacked, is refused by name.
    let e = expert_matrix(&ck, &cfg, 0, n, ExpertMat::W1).unwrap_err();
    assert!(e.contains("switch_mlp.gate_proj.weight"), "{e}");
    let flat = ck.get("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert!(keep_checkpoint::layout::expert_slice(flat, 0, n).is_err());
}

#[test]
fn streamed_forward_equals_the_whole_model_mlx4() {
    use keep_model::streamed::{forward_streamed, StreamOptions};
    let ck = Checkpoint::open(&fixture("qwen3-tiny-mlx4")).unwrap();
    let model = Model::load(&ck).unwrap();
    let records: Vec<Vec<u32>> = vec![(0..13u32).map(|i| (i * 5 + 2) % 128).collect()];
    let opts = StreamOptions {
        release_pages: false,
        prefill_chunk: Some(4),
        ..Default::default()
    };
    let streamed = forward_streamed(&ck, &records, opts, None).unwrap();
    let whole = model
        .forward(&records[0], &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert!(whole
        .iter()
        .zip(&streamed[0])
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn streamed_forward_equals_the_whole_model() {
    use keep_model::streamed::{forward_streamed, StreamOptions};
    let ck = Checkpoint::open(&fixture("qwen3-tiny-fp8")).unwrap();
    let model = Model::load(&ck).unwrap();
    let records: Vec<Vec<u32>> = vec![
        (0..19u32).map(|i| (i * 11 + 3) % 128).collect(),
        (0..5u32).map(|i| (i * 7 + 1) % 128).collect(),
    ];
    let opts = StreamOptions {
        release_pages: false,
        prefill_chunk: Some(4),
        ..Default::default()
    };
    let mut rec = RouteRecorder::default();
    let streamed = forward_streamed(&ck, &records, opts, Some(&mut rec)).unwrap();
    for (r, s) in records.iter().zip(&streamed) {
        let whole = model
            .forward(r, &mut model.new_cache(), Logits::All, None)
            .unwrap();
        assert!(whole.iter().zip(s).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    // Layer 0 routes every record in chunks of 4; layer 1 is dense.
    assert_eq!(rec.calls.len(), 19usize.div_ceil(4) + 5usize.div_ceil(4));
}
