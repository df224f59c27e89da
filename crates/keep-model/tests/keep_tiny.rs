//! keep-model against the bundled model's mlx-lm fixtures (`fixtures/keep-tiny`, made by
//! `tools/oracle/make_fixtures.py` from `models/keep-tiny`): held-out logits (top-1 agreement and
//! mean KL), routed experts of every (token, layer) pair, and 32 greedy tokens per prompt.
//! Skipped, saying so, while the model or its fixtures are not in the tree.
//! `KEEP_TINY_MODEL` and `KEEP_TINY_FIXTURES` point the checks at another model directory and
//! its fixtures.

use std::collections::HashMap;
use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::observer::RouteRecorder;
use keep_model::{Logits, Model};
use safetensors::SafeTensors;

/// Top-1 agreement over all held-out positions: every one (achieved).
const MIN_TOP1: f64 = 1.0;
/// Mean KL(reference ‖ keep) ceiling, nats per position: f32 summation order only (achieved
/// 9.2e-13 over 129 positions).
const MAX_MEAN_KL: f64 = 1e-11;
/// Largest |logit difference| at the held-out positions (achieved 2.1e-5).
const MAX_ABS_DIFF: f32 = 1e-4;
/// Same routed experts on every (token, layer) pair (achieved).
const MIN_ROUTES: f64 = 1.0;
/// Largest |gate weight difference| of the chosen experts (achieved 6.6e-7 over 2,048 pairs).
const MAX_ROUTE_WEIGHT_DIFF: f32 = 4e-6;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Tensors(HashMap<String, (Vec<usize>, Vec<u8>)>);

impl Tensors {
    fn load(path: &std::path::Path) -> Tensors {
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
    fn shape(&self, k: &str) -> &[usize] {
        &self.0[k].0
    }
}

fn setup() -> Option<(Checkpoint, PathBuf)> {
    // KEEP_TINY_MODEL / KEEP_TINY_FIXTURES point the same checks at another model and its
    // make_fixtures.py output.
    let model = std::env::var_os("KEEP_TINY_MODEL")
        .map(PathBuf::from)
        .unwrap_or(root().join("models/keep-tiny"));
    let fx = std::env::var_os("KEEP_TINY_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or(root().join("fixtures/keep-tiny"));
    if !model.join("config.json").is_file() || !fx.join("logits.safetensors").is_file() {
        eprintln!("SKIPPED: models/keep-tiny or fixtures/keep-tiny is not in the tree yet");
        return None;
    }
    Some((Checkpoint::open(&model).unwrap(), fx))
}

fn kl_top1(a: &[f32], b: &[f32]) -> (f64, bool) {
    let lse = |v: &[f32]| {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (la, lb) = (lse(a), lse(b));
    let kl = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| {
            let (pa, pb) = (x as f64 - la, y as f64 - lb);
            pa.exp() * (pa - pb)
        })
        .sum();
    (kl, argmax(a) == argmax(b))
}

#[test]
fn keep_tiny_logits_match_fixtures() {
    let Some((ck, fx)) = setup() else { return };
    let model = Model::load(&ck).unwrap();
    let t = Tensors::load(&fx.join("logits.safetensors"));
    let vocab = model.cfg.vocab;
    let (mut n, mut agree, mut kl_sum, mut maxd) = (0usize, 0usize, 0f64, 0f32);
    let mut i = 0;
    while t.0.contains_key(&format!("seq{i}.tokens")) {
        let tokens: Vec<u32> = t
            .i32s(&format!("seq{i}.tokens"))
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let pos = t.i32s(&format!("seq{i}.positions"));
        let want = t.f32s(&format!("seq{i}.logits"));
        assert_eq!(t.shape(&format!("seq{i}.logits")), &[pos.len(), vocab]);
        let got = model
            .forward(&tokens, &mut model.new_cache(), Logits::All, None)
            .unwrap();
        for (r, &p) in pos.iter().enumerate() {
            let p = p as usize;
            let (kl, same) = kl_top1(
                &want[r * vocab..(r + 1) * vocab],
                &got[p * vocab..(p + 1) * vocab],
            );
            kl_sum += kl;
            agree += same as usize;
            maxd = want[r * vocab..(r + 1) * vocab]
                .iter()
                .zip(&got[p * vocab..(p + 1) * vocab])
                .fold(maxd, |m, (a, b)| m.max((a - b).abs()));
            n += 1;
        }
        i += 1;
    }
    let (top1, kl) = (agree as f64 / n as f64, kl_sum / n as f64);
    eprintln!(
        "keep-tiny: {n} positions, top-1 agreement {top1}, mean KL {kl:e}, max|diff| {maxd:e}"
    );
    assert!(n > 0);
    assert!(top1 >= MIN_TOP1, "top-1 agreement {top1}");
    assert!(kl <= MAX_MEAN_KL, "mean KL {kl:e}");
    assert!(maxd <= MAX_ABS_DIFF, "max |logit diff| {maxd:e}");
}

#[test]
fn keep_tiny_routes_match_fixtures() {
    let Some((ck, fx)) = setup() else { return };
    let model = Model::load(&ck).unwrap();
    let t = Tensors::load(&fx.join("routes.safetensors"));
    let tokens: Vec<u32> = t.i32s("tokens").into_iter().map(|v| v as u32).collect();
    let mut rec = RouteRecorder::default();
    model
        .forward(
            &tokens,
            &mut model.new_cache(),
            Logits::None,
            Some(&mut rec),
        )
        .unwrap();
    let k = model.cfg.top_k;
    let (mut same, mut total, mut wd) = (0usize, 0usize, 0f32);
    // A long prompt runs in chunks: each call covers the tokens from its start position.
    for ((layer, start, ex), w) in rec.calls.iter().zip(&rec.weights) {
        let want = t.i32s(&format!("layer{layer}.experts"));
        let want_w = t.f32s(&format!("layer{layer}.weights"));
        for c in 0..ex.len() / k {
            let i = start + c;
            let mut mine: Vec<(i32, f32)> =
                (c * k..(c + 1) * k).map(|j| (ex[j] as i32, w[j])).collect();
            mine.sort_by_key(|p| p.0);
            let ids: Vec<i32> = mine.iter().map(|p| p.0).collect();
            let ok = ids[..] == want[i * k..(i + 1) * k];
            same += ok as usize;
            total += 1;
            if ok {
                for (j, (_, wt)) in mine.iter().enumerate() {
                    wd = wd.max((wt - want_w[i * k + j]).abs());
                }
            }
        }
    }
    let frac = same as f64 / total as f64;
    eprintln!(
        "keep-tiny: routes agree on {same} of {total} (token, layer) pairs, max|weight diff| {wd:e}"
    );
    assert!(wd <= MAX_ROUTE_WEIGHT_DIFF, "max |gate weight diff| {wd:e}");
    assert_eq!(total, tokens.len() * model.cfg.n_layers);
    assert!(frac >= MIN_ROUTES, "route agreement {frac}");
}

#[test]
fn keep_tiny_greedy_matches_fixtures() {
    let Some((ck, fx)) = setup() else { return };
    let model = Model::load(&ck).unwrap();
    let t = Tensors::load(&fx.join("greedy.safetensors"));
    let mut j = 0;
    while t.0.contains_key(&format!("prompt{j}")) {
        let prompt: Vec<u32> = t
            .i32s(&format!("prompt{j}"))
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let want: Vec<u32> = t
            .i32s(&format!("greedy{j}"))
            .into_iter()
            .map(|v| v as u32)
            .collect();
        let mut cache = model.new_cache();
        let mut last = model
            .forward(&prompt, &mut cache, Logits::Last, None)
            .unwrap();
        let mut got = vec![];
        for _ in 0..want.len() {
            let tok = argmax(&last);
            got.push(tok);
            last = model
                .forward(&[tok], &mut cache, Logits::Last, None)
                .unwrap();
        }
        assert_eq!(got, want, "greedy tokens of prompt {j}");
        j += 1;
    }
    assert!(j > 0);
}
