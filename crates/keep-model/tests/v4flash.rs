//! keep-model's DeepSeek-V4-Flash forward against a committed transformers fixture (no Python
//! needed): `tests/data/small-v4flash` (four layers: window-only, CSA, HCA, CSA; the first two
//! hash-routed; 128×128 E8M0 FP8 blocks; YaRN) and transformers 5.23's logits, routes and greedy
//! tokens on it (`small-v4flash-ref.safetensors`); plus decode = prefill and streamed = whole.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::observer::RouteRecorder;
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{Logits, Model};
use safetensors::SafeTensors;

/// Top-1 agreement with the reference: every position (achieved).
const MIN_TOP1: f64 = 1.0;
/// Mean KL(reference ‖ keep) ceiling in nats per position: keep and transformers sum in
/// different f32 orders, nothing else (achieved 1.7e-13).
const MAX_MEAN_KL: f64 = 1e-11;
/// Largest |logit difference| from the reference (achieved 3.6e-6).
const MAX_ABS_DIFF: f32 = 4e-5;
/// Largest |gate weight difference| of the chosen experts, hash layers included (achieved
/// 2.4e-7).
const MAX_ROUTE_WEIGHT_DIFF: f32 = 2e-6;
/// Decode vs prefill: every row is computed the same way whatever the batch (any difference is
/// a bug).
const DECODE_VS_PREFILL_MAX_ABS: f32 = 0.0;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

struct Ref {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    vocab: usize,
    routes: (Vec<i32>, [usize; 3]),
    /// Gate weights of `routes`' experts, same order.
    route_weights: Vec<f32>,
    greedy: Vec<u32>,
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn load_ref() -> Ref {
    let bytes = std::fs::read(data().join("small-v4flash-ref.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let l = st.tensor("logits").unwrap();
    let r = st.tensor("routes").unwrap();
    let s = r.shape();
    Ref {
        tokens: i32s(st.tensor("tokens").unwrap().data())
            .into_iter()
            .map(|v| v as u32)
            .collect(),
        vocab: l.shape()[1],
        logits: l
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        routes: (i32s(r.data()), [s[0], s[1], s[2]]),
        route_weights: st
            .tensor("route_weights")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        greedy: i32s(st.tensor("greedy").unwrap().data())
            .into_iter()
            .map(|v| v as u32)
            .collect(),
    }
}

/// (top-1 agreement, mean KL(ref‖keep)) over rows of `vocab`.
fn agreement(a: &[f32], b: &[f32], vocab: usize) -> (f64, f64) {
    let rows = a.len() / vocab;
    let (mut top1, mut kl) = (0usize, 0f64);
    let lse = |v: &[f32]| {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    for r in 0..rows {
        let (x, y) = (
            &a[r * vocab..(r + 1) * vocab],
            &b[r * vocab..(r + 1) * vocab],
        );
        if keep_model::generate::argmax(x) == keep_model::generate::argmax(y) {
            top1 += 1;
        }
        let (lx, ly) = (lse(x), lse(y));
        for i in 0..vocab {
            let (px, py) = (x[i] as f64 - lx, y[i] as f64 - ly);
            kl += px.exp() * (px - py);
        }
    }
    (top1 as f64 / rows as f64, kl / rows as f64)
}

#[test]
fn small_v4flash_matches_transformers() {
    let ck = Checkpoint::open(&data().join("small-v4flash")).unwrap();
    let model = Model::load(&ck).unwrap();
    assert_eq!(model.cfg.hash_layers, 2);
    let r = load_ref();
    let mut cache = model.new_cache();
    let mut rec = RouteRecorder::default();
    let logits = model
        .forward(&r.tokens, &mut cache, Logits::All, Some(&mut rec))
        .unwrap();
    let (top1, kl) = agreement(&r.logits, &logits, r.vocab);
    let maxd = r
        .logits
        .iter()
        .zip(&logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("top1 {top1} mean KL {kl:e} max|diff| {maxd:e}");
    assert!(top1 >= MIN_TOP1, "top-1 agreement {top1}");
    assert!(kl <= MAX_MEAN_KL, "mean KL {kl:e}");
    assert!(maxd <= MAX_ABS_DIFF, "max |logit diff| {maxd:e}");

    // Routes: hash layers give tid2eid[token], the others the top-k; all equal the reference,
    // and so do their gate weights (within the summation-order noise).
    let (want, [l, t, k]) = &r.routes;
    let mut mine = vec![-1i32; l * t * k];
    let mut weights = vec![f32::NAN; l * t * k];
    for ((layer, start, ex), w) in rec.calls.iter().zip(&rec.weights) {
        for i in 0..ex.len() / k {
            let mut row: Vec<(i32, f32)> =
                (i * k..(i + 1) * k).map(|j| (ex[j] as i32, w[j])).collect();
            row.sort_by_key(|p| p.0);
            let o = (layer * t + start + i) * k;
            for (j, (e, wt)) in row.into_iter().enumerate() {
                mine[o + j] = e;
                weights[o + j] = wt;
            }
        }
    }
    assert_eq!(&mine, want);
    let wd = r
        .route_weights
        .iter()
        .zip(&weights)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("max|weight diff| {wd:e}");
    assert!(wd <= MAX_ROUTE_WEIGHT_DIFF, "max |gate weight diff| {wd:e}");

    // Greedy decoding through keep's cache gives the reference's tokens.
    let mut cache = model.new_cache();
    let mut last = model
        .forward(&r.tokens, &mut cache, Logits::Last, None)
        .unwrap();
    let mut mine = vec![];
    for _ in 0..r.greedy.len() {
        let tok = keep_model::generate::argmax(&last);
        mine.push(tok);
        last = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
    }
    assert_eq!(mine, r.greedy);
}

#[test]
fn v4flash_decode_equals_prefill_and_streamed_equals_whole() {
    let ck = Checkpoint::open(&data().join("small-v4flash")).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = load_ref();
    let mut cache = model.new_cache();
    let all = model
        .forward(&r.tokens, &mut cache, Logits::All, None)
        .unwrap();
    // Odd chunks cross CSA and HCA window boundaries in the middle.
    let mut cache = model.new_cache();
    let mut dec = vec![];
    let mut pos = 0;
    for n in [5, 1, 7, 1, 1, 13, 36] {
        dec.extend(
            model
                .forward(&r.tokens[pos..pos + n], &mut cache, Logits::All, None)
                .unwrap(),
        );
        pos += n;
    }
    assert_eq!(pos, r.tokens.len());
    let maxd = all
        .iter()
        .zip(&dec)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(maxd <= DECODE_VS_PREFILL_MAX_ABS, "max |diff| {maxd}");

    let recs = vec![r.tokens.clone(), r.tokens[3..30].to_vec()];
    let opts = StreamOptions {
        logits: Logits::All,
        ..Default::default()
    };
    let streamed = forward_streamed(&ck, &recs, opts, None).unwrap();
    assert_eq!(streamed[0], all);
    let mut cache = model.new_cache();
    let part = model
        .forward(&recs[1], &mut cache, Logits::All, None)
        .unwrap();
    assert_eq!(streamed[1], part);
}
