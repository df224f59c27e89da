//! keep-model against committed mlx-lm fixtures (no Python needed): a random published-format
//! checkpoint (`tests/data/small`, every compress-ratio kind, a candidate-source layer, YaRN) and
//! its reference logits, routes and greedy tokens; plus the model's own invariants: decode equals
//! prefill, layer streaming equals the whole model, observers and empty router masks change
//! nothing. `tests/data/small-engram` is the same shape with Engram layers 1 and 4, checked
//! against the published Engram module (transcribed in `tools/oracle/engram_ref.py`) on top of
//! mlx-lm.

use std::path::{Path, PathBuf};

use keep_checkpoint::Checkpoint;
use keep_model::observer::{
    ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver, RouteRecorder,
};
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{Kernels, Logits, Model};
use safetensors::SafeTensors;

/// Top-1 agreement with the reference: every position (achieved on every fixture).
const MIN_TOP1: f64 = 1.0;
/// Mean KL(reference ‖ keep) ceiling in nats per position: keep and mlx-lm sum in different
/// f32 orders, nothing else (achieved 6.3e-13 on small, 1.4e-13 on both Engram fixtures).
const MAX_MEAN_KL: f64 = 1e-11;
/// Largest |logit difference| from the reference: the same f32 summation-order noise
/// (achieved 2.0e-5 on small, 3.0e-6 and 3.2e-6 on the Engram fixtures).
const MAX_ABS_DIFF: f32 = 1e-4;
/// A model missing a component (its Engram layers, its token map) is at least this far off in
/// mean KL (measured 0.32 with raw ids in place of the token map).
const WRONG_MIN_MEAN_KL: f64 = 1e-2;
/// Routed experts: every (token, layer) pair equal (achieved on every fixture).
const MIN_ROUTES: f64 = 1.0;
/// Largest |gate weight difference| of the chosen experts: f32 summation order of the router
/// (achieved 3.3e-7 on small, 2.4e-7 and 1.8e-7 on the Engram fixtures).
const MAX_ROUTE_WEIGHT_DIFF: f32 = 2e-6;
/// Decode vs prefill: every kernel computes a row the same way whatever the batch, and the
/// attention/compressor/indexer are per-row, so one token at a time is bit-identical to one
/// prefill (0 is the tolerance: any difference is a bug).
const DECODE_VS_PREFILL_MAX_ABS: f32 = 0.0;

pub fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

pub struct Ref {
    pub tokens: Vec<u32>,
    pub logits: Vec<f32>,
    pub vocab: usize,
    pub routes: Option<(Vec<i32>, [usize; 3])>,
    /// Gate weights of `routes`' experts, same order.
    pub route_weights: Option<Vec<f32>>,
    pub greedy: Option<Vec<u32>>,
}

fn i32s(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn load_ref(path: &Path) -> Ref {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens = i32s(st.tensor("tokens").unwrap().data())
        .into_iter()
        .map(|v| v as u32)
        .collect();
    let l = st.tensor("logits").unwrap();
    let vocab = l.shape()[1];
    let logits = l
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let routes = st.tensor("routes").ok().map(|r| {
        let s = r.shape();
        (i32s(r.data()), [s[0], s[1], s[2]])
    });
    let route_weights = st.tensor("route_weights").ok().map(|w| {
        w.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    });
    let greedy = st
        .tensor("greedy")
        .ok()
        .map(|g| i32s(g.data()).into_iter().map(|v| v as u32).collect());
    Ref {
        tokens,
        logits,
        vocab,
        routes,
        route_weights,
        greedy,
    }
}

/// (top-1 agreement, mean KL(ref‖keep), max |diff|) over rows of `vocab`.
pub fn agreement(reference: &[f32], keep: &[f32], vocab: usize) -> (f64, f64, f32) {
    let rows = reference.len() / vocab;
    let (mut top1, mut kl, mut maxd) = (0usize, 0f64, 0f32);
    for r in 0..rows {
        let a = &reference[r * vocab..(r + 1) * vocab];
        let b = &keep[r * vocab..(r + 1) * vocab];
        let am = keep_model::generate::argmax(a);
        if am == keep_model::generate::argmax(b) {
            top1 += 1;
        }
        let lse = |v: &[f32]| {
            let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
        };
        let (la, lb) = (lse(a), lse(b));
        for i in 0..vocab {
            let pa = a[i] as f64 - la;
            let pb = b[i] as f64 - lb;
            kl += pa.exp() * (pa - pb);
            maxd = maxd.max((a[i] - b[i]).abs());
        }
    }
    (top1 as f64 / rows as f64, kl / rows as f64, maxd)
}

/// Each (layer, token)'s experts sorted ascending, with their gate weights in the same order.
fn sorted_routes(rec: &RouteRecorder, layers: usize, t: usize, k: usize) -> (Vec<i32>, Vec<f32>) {
    let mut routes = vec![-1i32; layers * t * k];
    let mut weights = vec![f32::NAN; layers * t * k];
    for ((layer, start, ex), w) in rec.calls.iter().zip(&rec.weights) {
        for i in 0..ex.len() / k {
            let mut r: Vec<(i32, f32)> =
                (i * k..(i + 1) * k).map(|j| (ex[j] as i32, w[j])).collect();
            r.sort_by_key(|p| p.0);
            let o = (layer * t + start + i) * k;
            for (j, (e, wt)) in r.into_iter().enumerate() {
                routes[o + j] = e;
                weights[o + j] = wt;
            }
        }
    }
    (routes, weights)
}

/// One prefill of the fixture's tokens against its reference: top-1, mean KL, max |Δ| of the
/// logits, and, when the fixture has them, the routes and their gate weights, each against its
/// pinned tolerance.
fn check_fixture(what: &str, model: &Model, r: &Ref) {
    let mut rec = RouteRecorder::default();
    let logits = model
        .forward(
            &r.tokens,
            &mut model.new_cache(),
            Logits::All,
            Some(&mut rec),
        )
        .unwrap();
    let (top1, kl, maxd) = agreement(&r.logits, &logits, r.vocab);
    eprintln!("{what}: top1 {top1} mean KL {kl:e} max|diff| {maxd:e}");
    assert!(top1 >= MIN_TOP1, "{what}: top-1 agreement {top1}");
    assert!(kl <= MAX_MEAN_KL, "{what}: mean KL {kl:e}");
    assert!(maxd <= MAX_ABS_DIFF, "{what}: max |logit diff| {maxd:e}");
    if let Some((ref_routes, [l, t, k])) = &r.routes {
        let (mine, w) = sorted_routes(&rec, *l, *t, *k);
        let same = (0..l * t)
            .filter(|&p| ref_routes[p * k..(p + 1) * k] == mine[p * k..(p + 1) * k])
            .count();
        let frac = same as f64 / (l * t) as f64;
        assert!(frac >= MIN_ROUTES, "{what}: route agreement {frac}");
        let ref_w = r
            .route_weights
            .as_ref()
            .expect("route_weights beside routes");
        let wd = ref_w
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{what}: routes {frac} max|weight diff| {wd:e}");
        assert!(
            wd <= MAX_ROUTE_WEIGHT_DIFF,
            "{what}: max |gate weight diff| {wd:e}"
        );
    }
}

#[test]
fn small_checkpoint_matches_mlx_lm() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = load_ref(&data().join("small-ref.safetensors"));
    check_fixture("small", &model, &r);

    // Greedy decoding through the cache gives the reference's tokens.
    let greedy = r.greedy.unwrap();
    let mut cache = model.new_cache();
    let mut last = model
        .forward(&r.tokens, &mut cache, Logits::Last, None)
        .unwrap();
    let mut mine = vec![];
    for _ in 0..greedy.len() {
        let tok = keep_model::generate::argmax(&last);
        mine.push(tok);
        last = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
    }
    assert_eq!(mine, greedy);
}

#[test]
fn decode_equals_prefill() {
    decode_equals_prefill_on(Kernels::Exact);
}

/// The fast kernels quantize each activation row on its own and compute each output row the
/// same way whatever the batch, so decode equals prefill bit for bit in that mode too.
#[test]
fn decode_equals_prefill_fast_kernels() {
    decode_equals_prefill_on(Kernels::Fast);
}

/// The fast kernels run (their logits differ from the exact ones) and stay close to them.
#[test]
fn fast_kernels_are_close_to_exact() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let r = load_ref(&data().join("small-ref.safetensors"));
    let mut model = Model::load(&ck).unwrap();
    let exact = model
        .forward(&r.tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    model.opts.kernels = Kernels::Fast;
    let fast = model
        .forward(&r.tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert_ne!(exact, fast, "the fast kernels did not run");
    let kl = mean_kl(&exact, &fast, r.vocab);
    assert!(kl <= FAST_MAX_MEAN_KL, "fast vs exact mean KL {kl}");
}

/// Mean KL(exact ‖ fast) ceiling on the random small checkpoint (measured 0.015): int8
/// activations (about 2^-8 of each block's largest value) on the routed experts, amplified by
/// random weights whose top-k routing flips on small changes; a wrong kernel gives KL of order
/// 1 or more. The trained model's number is measured by `keep eval --kernels fast`.
const FAST_MAX_MEAN_KL: f64 = 0.05;

/// Mean over positions of KL(softmax(p) ‖ softmax(q)) in nats.
fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let lsm = |v: &[f32]| {
        let m = v.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let z = v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        v.iter().map(|&x| x as f64 - z).collect::<Vec<f64>>()
    };
    let n = p.len() / vocab;
    let mut s = 0.0;
    for i in 0..n {
        let (a, b) = (
            lsm(&p[i * vocab..(i + 1) * vocab]),
            lsm(&q[i * vocab..(i + 1) * vocab]),
        );
        s += a
            .iter()
            .zip(&b)
            .map(|(x, y)| x.exp() * (x - y))
            .sum::<f64>();
    }
    s / n.max(1) as f64
}

fn decode_equals_prefill_on(kernels: Kernels) {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.kernels = kernels;
    let r = load_ref(&data().join("small-ref.safetensors"));
    let mut c1 = model.new_cache();
    let all = model
        .forward(&r.tokens, &mut c1, Logits::All, None)
        .unwrap();
    // One at a time, and in uneven chunks (3, 1, 7, ...).
    let mut c2 = model.new_cache();
    let mut one = vec![];
    for &t in &r.tokens {
        one.extend(model.forward(&[t], &mut c2, Logits::All, None).unwrap());
    }
    let mut c3 = model.new_cache();
    let mut chunked = vec![];
    let mut i = 0;
    for n in [3usize, 1, 7, 13, 2, 5].iter().cycle() {
        if i >= r.tokens.len() {
            break;
        }
        let e = (i + n).min(r.tokens.len());
        chunked.extend(
            model
                .forward(&r.tokens[i..e], &mut c3, Logits::All, None)
                .unwrap(),
        );
        i = e;
    }
    for other in [&one, &chunked] {
        let maxd = all
            .iter()
            .zip(other.iter())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            maxd <= DECODE_VS_PREFILL_MAX_ABS,
            "decode vs prefill max |diff| {maxd}"
        );
    }
}

#[test]
fn streamed_equals_whole_model() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = load_ref(&data().join("small-ref.safetensors"));
    let records = vec![
        r.tokens.clone(),
        r.tokens[5..40].to_vec(),
        vec![],
        r.tokens[..1].to_vec(),
    ];
    let mut rec_s = RouteRecorder::default();
    let streamed = forward_streamed(
        &ck,
        &records,
        StreamOptions {
            logits: Logits::All,
            ..Default::default()
        },
        Some(&mut rec_s),
    )
    .unwrap();
    for (rec, got) in records.iter().zip(&streamed) {
        let mut cache = model.new_cache();
        let want = model.forward(rec, &mut cache, Logits::All, None).unwrap();
        assert_eq!(want.len(), got.len());
        assert!(
            want.iter()
                .zip(got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "streamed differs"
        );
    }
    assert_eq!(rec_s.calls.len(), model.cfg.n_layers * 3);
}

#[derive(Default)]
struct Everything {
    routes: usize,
    outputs: usize,
    linears: usize,
}

impl RouteObserver for Everything {
    fn wants_expert_outputs(&self) -> bool {
        true
    }
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        assert_eq!(ev.experts.len(), ev.tokens * ev.top_k);
        self.routes += 1;
    }
    fn on_expert_output(&mut self, ev: &ExpertOutputEvent) {
        assert_eq!(ev.outputs.len() % ev.token_rows.len(), 0);
        self.outputs += ev.token_rows.len();
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        assert_eq!(ev.x.len(), ev.rows * ev.cols);
        self.linears += 1;
    }
}

#[test]
fn observers_and_empty_masks_change_nothing() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let r = load_ref(&data().join("small-ref.safetensors"));
    let plain = model
        .forward(&r.tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    let mut obs = Everything::default();
    let seen = model
        .forward(
            &r.tokens,
            &mut model.new_cache(),
            Logits::All,
            Some(&mut obs),
        )
        .unwrap();
    assert_eq!(plain, seen);
    let cfg = &model.cfg;
    assert_eq!(obs.routes, cfg.n_layers);
    assert_eq!(obs.outputs, cfg.n_layers * r.tokens.len() * cfg.top_k);
    assert!(obs.linears > cfg.n_layers * 8);
    let n = cfg.n_experts;
    for l in 0..cfg.n_layers {
        model.set_router_mask(l, Some(vec![false; n])).unwrap();
    }
    let masked = model
        .forward(&r.tokens, &mut model.new_cache(), Logits::All, None)
        .unwrap();
    assert_eq!(plain, masked);
}

#[test]
fn router_mask_excludes_experts() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let r = load_ref(&data().join("small-ref.safetensors"));
    let n = model.cfg.n_experts;
    let dead: Vec<bool> = (0..n).map(|e| e % 3 == 0).collect();
    model.set_router_mask(2, Some(dead.clone())).unwrap();
    let mut rec = RouteRecorder::default();
    model
        .forward(
            &r.tokens,
            &mut model.new_cache(),
            Logits::Last,
            Some(&mut rec),
        )
        .unwrap();
    let (_, _, ex) = rec.calls.iter().find(|c| c.0 == 2).unwrap();
    assert!(ex.iter().all(|&e| !dead[e as usize]));
    // Too few survivors is refused.
    assert!(model.set_router_mask(2, Some(vec![true; n])).is_err());
}

#[test]
fn bad_inputs_are_errors() {
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let model = Model::load(&ck).unwrap();
    let e = model
        .forward(&[100_000], &mut model.new_cache(), Logits::Last, None)
        .unwrap_err();
    assert!(e.to_string().contains("100000"), "{e}");
}

/// Fast matmul vs the scalar reference on every weight of the small checkpoint as the model
/// resolved it (FP8 32×32 blocks, FP4 experts, bf16, f32), including each wo_a group slice.
#[test]
fn every_checkpoint_weight_fast_equals_ref() {
    /// f32 accumulation (fast) vs f64 (reference), relative to Σ|x·w| of the row.
    const REL_TOL: f32 = 1e-5;
    let ck = Checkpoint::open(&data().join("small")).unwrap();
    let model = Model::load(&ck).unwrap();
    let experts = keep_model::CheckpointExperts::new(&ck, &model.cfg).unwrap();
    let mut views = vec![model.globals.head];
    for lw in &model.layers {
        views.extend([
            lw.wq_a,
            lw.wq_b,
            lw.wkv,
            lw.wo_a,
            lw.wo_b,
            lw.gate,
            lw.hc_attn.fn_,
        ]);
        views.extend(lw.shared);
        let g = model.cfg.o_groups;
        let ol = model.cfg.o_lora;
        for gi in 0..g {
            views.push(lw.wo_a.slice_rows(gi * ol, (gi + 1) * ol).unwrap());
        }
        use keep_model::ExpertSource;
        let e = experts.expert(lw.layer, model.cfg.n_experts - 1).unwrap();
        views.extend([e.w1, e.w2, e.w3]);
    }
    for (vi, w) in views.iter().enumerate() {
        for m in [1usize, 5] {
            let x: Vec<f32> = (0..m * w.cols)
                .map(|i| ((i * 7919 + vi) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut a = vec![0f32; m * w.rows];
            let mut b = vec![0f32; m * w.rows];
            keep_kernels::matmul_ref(&x, m, w, &mut a).unwrap();
            keep_kernels::matmul(&x, m, w, &mut b).unwrap();
            for i in 0..m {
                for r in 0..w.rows {
                    let mag: f32 = (0..w.cols)
                        .map(|c| (x[i * w.cols + c] * w.get_ref(r, c)).abs())
                        .sum::<f32>()
                        + 1e-30;
                    let (p, q) = (a[i * w.rows + r], b[i * w.rows + r]);
                    assert!(
                        (p - q).abs() <= REL_TOL * mag,
                        "view {vi} ({}) {p} vs {q}",
                        w.format_name()
                    );
                }
            }
        }
    }
}

/// Each entry: (a prefetch rather than a read, slot, row ids).
type RowLog = std::sync::Arc<std::sync::Mutex<Vec<(bool, usize, Vec<u64>)>>>;

/// An `EngramRows` that records what it is told and asked, and serves rows from the tables.
struct CountingRows<'a> {
    inner: keep_model::TableRows<'a>,
    log: RowLog,
}

impl keep_model::EngramRows for CountingRows<'_> {
    fn rows(&self, slot: usize, ids: &[u64], out: &mut [f32]) -> keep_model::Result<()> {
        self.log.lock().unwrap().push((false, slot, ids.to_vec()));
        self.inner.rows(slot, ids, out)
    }
    fn prefetch(&self, slot: usize, ids: &[u64]) {
        self.log.lock().unwrap().push((true, slot, ids.to_vec()));
    }
}

#[test]
fn small_engram_checkpoint_matches_reference() {
    let ck = Checkpoint::open(&data().join("small-engram")).unwrap();
    let model = Model::load(&ck).unwrap();
    assert_eq!(model.cfg.engram.as_ref().unwrap().layer_ids, vec![1, 4]);
    let r = load_ref(&data().join("small-engram-ref.safetensors"));
    check_fixture("engram", &model, &r);
    let greedy = r.greedy.unwrap();
    let mut cache = model.new_cache();
    let mut last = model
        .forward(&r.tokens, &mut cache, Logits::Last, None)
        .unwrap();
    let mut mine = vec![];
    for _ in 0..greedy.len() {
        let tok = keep_model::generate::argmax(&last);
        mine.push(tok);
        last = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
    }
    assert_eq!(mine, greedy);
}

#[test]
fn engram_changes_the_logits() {
    // Without its Engram layers the same checkpoint must disagree with the reference: the
    // fixture exercises the Engram path rather than passing around it.
    let ck = Checkpoint::open(&data().join("small-engram")).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.engram = None;
    let r = load_ref(&data().join("small-engram-ref.safetensors"));
    let mut cache = model.new_cache();
    let logits = model
        .forward(&r.tokens, &mut cache, Logits::All, None)
        .unwrap();
    let (_, kl, _) = agreement(&r.logits, &logits, r.vocab);
    assert!(kl > WRONG_MIN_MEAN_KL, "mean KL without Engram only {kl}");
}

#[test]
fn engram_decode_and_streaming_equal_prefill() {
    let ck = Checkpoint::open(&data().join("small-engram")).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = load_ref(&data().join("small-engram-ref.safetensors"));
    let mut c1 = model.new_cache();
    let all = model
        .forward(&r.tokens, &mut c1, Logits::All, None)
        .unwrap();
    let mut c2 = model.new_cache();
    let mut chunked = vec![];
    let mut i = 0;
    for n in [1usize, 3, 1, 7, 2].iter().cycle() {
        if i >= r.tokens.len() {
            break;
        }
        let e = (i + n).min(r.tokens.len());
        chunked.extend(
            model
                .forward(&r.tokens[i..e], &mut c2, Logits::All, None)
                .unwrap(),
        );
        i = e;
    }
    let maxd = all
        .iter()
        .zip(&chunked)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        maxd <= DECODE_VS_PREFILL_MAX_ABS,
        "decode vs prefill {maxd}"
    );
    let records = vec![r.tokens.clone(), r.tokens[3..20].to_vec()];
    let streamed = forward_streamed(&ck, &records, StreamOptions::default(), None).unwrap();
    for (rec, got) in records.iter().zip(&streamed) {
        let mut cache = model.new_cache();
        let want = model.forward(rec, &mut cache, Logits::All, None).unwrap();
        assert!(
            want.iter()
                .zip(got)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "streamed differs"
        );
    }
}

#[test]
fn engram_rows_are_announced_before_they_are_read() {
    let ck = Checkpoint::open(&data().join("small-engram")).unwrap();
    let plain = Model::load(&ck).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let lay = model.cfg.engram.clone().unwrap();
    let log = RowLog::default();
    model.engram.as_mut().unwrap().rows = Box::new(CountingRows {
        inner: keep_model::TableRows::load(&ck, &lay).unwrap(),
        log: log.clone(),
    });
    let r = load_ref(&data().join("small-engram-ref.safetensors"));
    let (mut c1, mut c2) = (plain.new_cache(), model.new_cache());
    for part in [&r.tokens[..9], &r.tokens[9..10]] {
        log.lock().unwrap().clear();
        let want = plain.forward(part, &mut c1, Logits::All, None).unwrap();
        let got = model.forward(part, &mut c2, Logits::All, None).unwrap();
        assert_eq!(
            want, got,
            "the same rows through another source, the same logits"
        );
        let log = log.lock().unwrap();
        let n = lay.layer_ids.len();
        assert_eq!(log.len(), 2 * n, "{log:?}");
        for slot in 0..n {
            let (pre, ps, pids) = &log[slot];
            let (read, rs, rids) = &log[n + slot];
            assert!(*pre && !*read && *ps == slot && *rs == slot);
            assert_eq!(pids, rids, "prefetched ids are the ids read");
            assert_eq!(rids.len(), part.len() * lay.cols());
        }
    }
}

/// `tests/data/small-engram` with a compressed Engram vocabulary: its config with
/// `engram_compressed_vocab_size` = 2690 (the size the bundled keep-tiny tokenizer compresses to)
/// and that tokenizer copied in; `small-engram-tokmap-ref.safetensors` is the reference on it.
fn compressed_engram_checkpoint(dir: &Path, compressed: usize) {
    let src = data().join("small-engram");
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let tiny = data().join("../../../../models/keep-tiny");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["engram_compressed_vocab_size"] = serde_json::json!(compressed);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

#[test]
fn compressed_engram_vocabulary_matches_reference() {
    let td = tempfile::tempdir().unwrap();
    compressed_engram_checkpoint(td.path(), 2690);
    let ck = Checkpoint::open(td.path()).unwrap();
    let model = Model::load(&ck).unwrap();
    let layout = model.cfg.engram.as_ref().unwrap();
    let map = layout
        .token_map
        .as_ref()
        .expect("map built from tokenizer.json");
    // The byte-level tokens 'A' (33) and 'a' (65) share a compressed id; 'A' and 'B' do not.
    assert_eq!(map[33], map[65]);
    assert_ne!(map[33], map[34]);
    // The hash runs over compressed ids: swapping a token for one that normalises alike leaves
    // every row id unchanged, swapping it for another changes them.
    let rows = |t: &[u32]| layout.hash(&mut Vec::new(), t).unwrap();
    assert_eq!(rows(&[7, 33, 90, 12]), rows(&[7, 65, 90, 12]));
    assert_ne!(rows(&[7, 33, 90, 12]), rows(&[7, 34, 90, 12]));

    let r = load_ref(&data().join("small-engram-tokmap-ref.safetensors"));
    check_fixture("compressed engram", &model, &r);
    let greedy = r.greedy.unwrap();
    let mut cache = model.new_cache();
    let mut last = model
        .forward(&r.tokens, &mut cache, Logits::Last, None)
        .unwrap();
    let mut mine = vec![];
    for _ in 0..greedy.len() {
        let tok = keep_model::generate::argmax(&last);
        mine.push(tok);
        last = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
    }
    assert_eq!(mine, greedy);

    // With raw ids in place of the map (same multipliers) the reference disagrees: the fixture
    // checks the map, not only the rest of the model.
    let mut raw = model;
    let ids: Vec<u32> = (0..raw.cfg.vocab as u32).collect();
    raw.engram
        .as_mut()
        .unwrap()
        .layout
        .set_token_map(ids)
        .unwrap();
    let mut cache = raw.new_cache();
    let logits = raw
        .forward(&r.tokens, &mut cache, Logits::All, None)
        .unwrap();
    let (_, kl, _) = agreement(&r.logits, &logits, r.vocab);
    assert!(kl > WRONG_MIN_MEAN_KL, "mean KL with raw ids only {kl}");
}

#[test]
fn compressed_engram_vocabulary_is_refused_without_its_tokenizer_or_size() {
    // A size other than the tokenizer's: refused with both numbers.
    let td = tempfile::tempdir().unwrap();
    compressed_engram_checkpoint(td.path(), 2000);
    let ck = Checkpoint::open(td.path()).unwrap();
    let err = Model::load(&ck).err().expect("refused").to_string();
    assert!(
        err.contains("engram_compressed_vocab_size")
            && err.contains("2000")
            && err.contains("2690"),
        "{err}"
    );
    // No tokenizer.json: refused at load, naming the file.
    std::fs::remove_file(td.path().join("tokenizer.json")).unwrap();
    let ck = Checkpoint::open(td.path()).unwrap();
    let err = Model::load(&ck).err().expect("refused").to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}
