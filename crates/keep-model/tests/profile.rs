//! The forward profile (keep-kernels' `profile`, `keep run --profile`) on every family's
//! forward: profiling changes no logit bit, the parts of every step sum to its total and
//! within the time measured around the forward passes (no part counted twice), and each part
//! the family's forward has is present and non-zero. Models: the bundled model when it is in
//! the tree (also through `generate`, for the sampling part), and the test data's DeepSeek-V4.1,
//! V4.1-with-Engram, V4-Flash and Qwen3-MoE checkpoints.

use std::path::PathBuf;
use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_kernels::profile::{self, Part, Phase, Step};
use keep_model::generate::{argmax, generate, GenerateOptions, Prompt, SamplerConfig};
use keep_model::{Logits, Model};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Prefill of `prompt` in chunks of `chunk`, then `decode` greedy tokens one at a time: every
/// logit of every forward, and the profile's steps when `profiled` (with the nanoseconds
/// measured around all the forwards).
fn run(
    model: &Model,
    prompt: &[u32],
    decode: usize,
    profiled: bool,
) -> (Vec<Vec<f32>>, Vec<Step>, u64) {
    let mut cache = model.new_cache();
    let t0 = Instant::now();
    if profiled {
        profile::start();
        profile::set_phase(Phase::Prefill);
    }
    let mut out = vec![model
        .forward(prompt, &mut cache, Logits::All, None)
        .unwrap()];
    profile::set_phase(Phase::Decode);
    let v = model.cfg.vocab;
    let mut tok = argmax(&out[0][out[0].len() - v..]);
    for _ in 0..decode {
        let l = model
            .forward(&[tok], &mut cache, Logits::Last, None)
            .unwrap();
        tok = argmax(&l);
        out.push(l);
    }
    let steps = if profiled { profile::take() } else { vec![] };
    (out, steps, t0.elapsed().as_nanos() as u64)
}

fn bits(l: &[Vec<f32>]) -> Vec<Vec<u32>> {
    l.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Check one model: bit-identical logits, `chunks + decode` steps whose parts sum to their
/// totals and within the measured time, and every part of `expect` non-zero in time (and in
/// bytes for those of `read`).
fn check(dir: &std::path::Path, chunk: usize, expect: &[Part], read: &[Part]) {
    let ck = Checkpoint::open(dir).unwrap();
    let mut model = Model::load(&ck).unwrap();
    model.opts.prefill_chunk = chunk;
    let v = model.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 37 + 5) % v).collect();
    let decode = 5;
    let (plain, none, _) = run(&model, &prompt, decode, false);
    assert!(none.is_empty());
    let (profiled, steps, outer) = run(&model, &prompt, decode, true);
    assert_eq!(
        bits(&plain),
        bits(&profiled),
        "{}: profiling changed a logit",
        dir.display()
    );
    let chunks = prompt.len().div_ceil(chunk);
    assert_eq!(steps.len(), chunks + decode, "{}", dir.display());
    assert!(steps[..chunks].iter().all(|s| s.phase == Phase::Prefill));
    assert!(steps[chunks..]
        .iter()
        .all(|s| s.phase == Phase::Decode && s.tokens == 1));
    let mut sum = Step::default();
    for s in &steps {
        // Exclusive parts: never more than the step's wall time (equal, by construction).
        assert!(s.parts_ns() <= s.total_ns, "{s:?}");
        for p in 0..profile::PARTS {
            sum.ns[p] += s.ns[p];
            sum.bytes[p] += s.bytes[p];
            assert!(s.wait_ns[p] <= s.ns[p], "a wait outside its part: {s:?}");
        }
        sum.total_ns += s.total_ns;
    }
    assert!(
        sum.parts_ns() <= outer,
        "{}: parts {} ns > {} ns measured around the forwards",
        dir.display(),
        sum.parts_ns(),
        outer
    );
    for &p in expect {
        assert!(
            sum.ns[p as usize] > 0,
            "{}: no time in {}",
            dir.display(),
            p.name()
        );
    }
    for &p in read {
        assert!(
            sum.bytes[p as usize] > 0,
            "{}: no bytes read in {}",
            dir.display(),
            p.name()
        );
    }
}

/// The parts every DeepSeek forward has.
const DEEPSEEK: [Part; 12] = [
    Part::AttnProj,
    Part::AttnScores,
    Part::Compressor,
    Part::Indexer,
    Part::HyperConn,
    Part::Sinkhorn,
    Part::Norm,
    Part::Router,
    Part::Experts,
    Part::SharedExpert,
    Part::Head,
    Part::IoWait,
];

/// The parts that read weights (or, for the scores, KV rows) in every family.
const READ: [Part; 6] = [
    Part::AttnProj,
    Part::AttnScores,
    Part::Router,
    Part::Experts,
    Part::Head,
    Part::Other,
];

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

#[test]
fn deepseek_v41_profile() {
    let mut read = READ.to_vec();
    read.extend([Part::HyperConn, Part::SharedExpert]);
    check(&data("small"), 4, &DEEPSEEK, &read);
}

#[test]
fn engram_profile() {
    let mut expect = DEEPSEEK.to_vec();
    expect.push(Part::Engram);
    let mut read = READ.to_vec();
    read.push(Part::Engram);
    check(&data("small-engram"), 4, &expect, &read);
}

#[test]
fn v4flash_profile() {
    check(&data("small-v4flash"), 4, &DEEPSEEK, &READ);
}

#[test]
fn qwen3_profile() {
    let expect = [
        Part::AttnProj,
        Part::AttnScores,
        Part::Norm,
        Part::Router,
        Part::Experts,
        // The dense MLP of an `mlp_only_layers` layer.
        Part::SharedExpert,
        Part::Head,
        Part::IoWait,
    ];
    check(&root().join("fixtures/qwen3-tiny-bf16"), 4, &expect, &READ);
}

/// The bundled model through `generate` (the sampling part and the phases as `keep run` sets
/// them): the same tokens with and without the profile, both kernels.
#[test]
fn bundled_model_profile_through_generate() {
    let dir = root().join("models/keep-tiny");
    if !dir.join("config.json").is_file() {
        eprintln!("models/keep-tiny is not here: skipped");
        return;
    }
    check(&dir, 16, &DEEPSEEK, &READ);
    let ck = Checkpoint::open(&dir).unwrap();
    for kernels in [keep_model::Kernels::Exact, keep_model::Kernels::Fast] {
        let mut model = Model::load(&ck).unwrap();
        model.opts.kernels = kernels;
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 31 + 7) % 4096).collect();
        let opts = GenerateOptions {
            max_tokens: 6,
            sampling: SamplerConfig {
                temperature: 0.8,
                top_p: 0.9,
                seed: 3,
            },
            tokenizer: None,
        };
        let mut gen = |profiled: bool| {
            let mut toks = vec![];
            if profiled {
                profile::start();
            }
            generate(&mut model, Prompt::Ids(&prompt), &opts, None, |p| {
                if let keep_model::Piece::Token(t) = p {
                    toks.push(t);
                }
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
            (toks, profile::take())
        };
        let (want, _) = gen(false);
        let (got, steps) = gen(true);
        assert_eq!(want, got, "{kernels:?}: profiling changed the tokens");
        // One prefill chunk, then one step per token fed back (the last token handed on is
        // fed back only when an end-of-sequence token stopped the generation after it).
        assert!(
            (want.len()..=want.len() + 1).contains(&steps.len()),
            "{kernels:?}: {} steps for {} tokens",
            steps.len(),
            want.len()
        );
        assert_eq!(steps[0].phase, Phase::Prefill);
        assert!(steps[1..].iter().all(|s| s.phase == Phase::Decode));
        assert!(steps.iter().all(|s| s.parts_ns() <= s.total_ns));
        assert!(steps.iter().all(|s| s.ns[Part::Sample as usize] > 0));
        assert!(steps.iter().all(|s| s.ns[Part::Output as usize] > 0));
        // The fast kernels round the routed experts' activations to bf16 (the bundled model's
        // experts are FP8-block) where the CPU has AVX-512 BF16: that time is its own part.
        if kernels == keep_model::Kernels::Fast && keep_kernels::bf16dot::bf_level().is_some() {
            let q: u64 = steps.iter().map(|s| s.ns[Part::ExpertQuant as usize]).sum();
            assert!(q > 0, "no time in the routed experts' activation rounding");
        }
    }
}
