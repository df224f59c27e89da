//! keep's DeepSeek-V3 forward against transformers 5.23's `DeepseekV3ForCausalLM` through the
//! committed fixture `fixtures/deepseek-v3` (2 layers, the first dense; multi-head latent
//! attention with `q_lora_rank`, YaRN with `mscale_all_dim`; 8 experts in 2 groups, one shared
//! expert, a correction bias; bf16), written with its reference outputs by
//! `tools/oracle/deepseek_v3_conformance.py --fixture fixtures/deepseek-v3`: logits of one
//! prefill (top-1 agreement, mean KL, largest difference), the routed experts of every (token,
//! MoE layer) pair, decode logits (one token at a time with keep's compressed KV cache) equal to
//! prefill logits bit for bit, and a chunked prefill equal to one pass.

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
/// Mean KL(reference ‖ keep) ceiling, nats per position: f32 summation order and the absorbed
/// attention's order of products only (the conformance suite's bar is 1e-4).
const MAX_MEAN_KL: f64 = 1e-8;
/// Largest logit difference: f32 rounding of the same arithmetic.
const MAX_ABS_DIFF: f32 = 1e-3;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepseek-v3")
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
fn bf16_checkpoint_matches_transformers() {
    let dir = fixture();
    let ck = Checkpoint::open(&dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    assert_eq!(model.cfg.family, Family::DeepseekV3);
    let r = Tensors::load(&dir.join("reference.safetensors"));
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
    assert!(ref_routes.iter().any(|&e| e >= 0), "the fixture routes");
    assert_eq!(mine, ref_routes, "routed experts (-1: the dense layer)");

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
    // The cache holds the compressed KV: kv_lora_rank + qk_rope_head_dim values a position.
    let c = model.cfg.raw.deepseek_v3.clone().unwrap();
    assert_eq!(
        cache.layers[0].kv_rows.k.len() + cache.layers[0].kv_rows.v.len(),
        t * (c.kv_lora_rank + c.qk_rope_head_dim)
    );

    // A prefill in chunks of 5 equals one pass.
    model.opts.prefill_chunk = 5;
    let chunked = model
        .forward(&tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert!(got
        .iter()
        .zip(&chunked)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}
