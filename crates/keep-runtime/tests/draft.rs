//! Speculative decoding with the MTP module keeps greedy output identical to decoding without
//! it, token for token, on synthetic checkpoints of both families written by `keep synth` with
//! `mtp.0.*` (V4.1 with its shared compressors and indexer, V4-Flash with CSA/HCA and hash
//! routing; sliding window 16, so rollbacks cross the window and compressor groups). Two
//! drafters run: the module itself (random weights: nearly every draft is rejected, so the
//! rollback path runs every step) and the module with its tokens overridden by the reference
//! continuation for a varying number of leading drafts (so every count of accepted drafts,
//! all-accepted included, is exercised on the real caches).
//!
//! The same holds for the DSpark drafter on a V4.1 checkpoint written with `keep synth --draft
//! dspark` (three stages, blocks of 5): drafted as it is, steered, mapped and under a memory
//! budget whose plan holds the drafter's tensors.

mod common;

use std::ops::ControlFlow;
use std::path::Path;

use keep_checkpoint::Checkpoint;
use keep_convert::presets;
use keep_convert::synth::{synth, SynthOptions};
use keep_model::generate::{generate, GenStats, Generate, GenerateOptions, Piece, Prompt};
use keep_model::{Cache, Model, ModelConfig, RouteObserver, SamplerConfig};

const GREEDY: SamplerConfig = SamplerConfig {
    temperature: 0.0,
    top_p: 1.0,
    seed: 0,
};

/// Tokens generated per run: several windows' worth of rollbacks.
const MAX_TOKENS: usize = 40;

fn synth_with_mtp(dir: &Path, preset: &str) -> std::path::PathBuf {
    let (mut cfg, storage) = presets::preset(preset).unwrap();
    cfg.num_nextn_predict_layers = 1;
    cfg.raw["num_nextn_predict_layers"] = 1.into();
    let opts = SynthOptions {
        seed: 11,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    synth(&cfg, &dir.join(preset), &opts, &|_, _| {}).unwrap()
}

fn run<G: Generate>(m: &mut G, prompt: &[u32]) -> (Vec<u32>, GenStats) {
    let mut got = vec![];
    let opts = GenerateOptions {
        max_tokens: MAX_TOKENS,
        sampling: GREEDY,
        tokenizer: None,
    };
    let s = generate(m, Prompt::Ids(prompt), &opts, None, |p| {
        if let Piece::Token(t) = p {
            got.push(t);
        }
        ControlFlow::Continue(())
    })
    .unwrap();
    (got, s)
}

/// The model with the MTP module's drafts replaced, for the first `good(step)` drafts of each
/// step, by the reference continuation (the rest stay as the module drafted them, or are made
/// wrong when they happen to be right).
struct Steered<'m, 'a> {
    model: &'m mut Model<'a>,
    reference: Vec<u32>,
    prompt: usize,
    fed: usize,
    step: usize,
}

impl Generate for Steered<'_, '_> {
    fn cfg(&self) -> &ModelConfig {
        &self.model.cfg
    }
    fn new_cache(&self) -> Cache {
        self.model.new_cache()
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        self.fed += tokens.len();
        Generate::forward_last(self.model, tokens, cache, obs)
    }
    fn draft_tokens(&self) -> usize {
        self.model.draft_tokens()
    }
    fn draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> keep_model::Result<Vec<(u32, Vec<f32>)>> {
        let mut d = self.model.draft(last, k, pick)?;
        // `last` is output token `g`; the reference drafts are the tokens after it.
        let g = self.fed - self.prompt;
        assert_eq!(last, self.reference[g]);
        let good = (self.step * 7 + 3) % (d.len() + 1);
        self.step += 1;
        let vocab = self.model.cfg.vocab as u32;
        for (i, x) in d.iter_mut().enumerate() {
            let want = self.reference.get(g + 1 + i).copied();
            x.0 = match want {
                Some(w) if i < good => w,
                Some(w) if x.0 == w => (w + 1) % vocab,
                _ => x.0,
            };
        }
        Ok(d)
    }
    fn forward_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        self.model.forward_verify(tokens, cache, obs)
    }
    fn accept_drafts(&mut self, cache: &mut Cache, keep: usize) -> keep_model::Result<()> {
        self.fed += keep;
        self.model.accept_drafts(cache, keep)
    }
}

fn synth_with_dspark(dir: &Path) -> std::path::PathBuf {
    let (mut cfg, storage) = presets::preset("tiny").unwrap();
    presets::with_dspark(&mut cfg);
    cfg.validate().unwrap();
    let opts = SynthOptions {
        seed: 13,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    synth(&cfg, &dir.join("tiny-dspark"), &opts, &|_, _| {}).unwrap()
}

/// Greedy generation with `m` (a drafter attached) and steered drafts equals `reference`; the
/// steered run accepts some drafts, rejects some, and keeps every draft at least once.
fn check_drafter(m: &mut Model<'_>, prompt: &[u32], reference: &[u32], what: &str) {
    let (got, s) = run(m, prompt);
    assert_eq!(got, reference, "{what}: the drafter changed the output");
    assert!(s.draft.verify_forwards > 0, "{what}: no verify forward");
    let mut steered = Steered {
        model: m,
        reference: reference.to_vec(),
        prompt: prompt.len(),
        fed: 0,
        step: 0,
    };
    let (got, s) = run(&mut steered, prompt);
    assert_eq!(got, reference, "{what}: steered drafts changed the output");
    let accepted: u64 = s.draft.accepted.iter().sum();
    assert!(accepted > 0, "{what}: no draft was accepted");
    assert!(s.draft.replays > 0, "{what}: no draft was rejected");
    assert!(
        s.draft.replays < s.draft.verify_forwards,
        "{what}: never all accepted"
    );
}

#[test]
fn greedy_dspark_drafting_is_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_dspark(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    assert!(keep_model::dspark::present(&ck));
    assert!(!keep_model::mtp::present(&ck));
    let mut model = Model::load(&ck).unwrap();
    let prompt = common::prompt(9, model.cfg.vocab);
    let (reference, _) = run(&mut model, &prompt);
    assert_eq!(reference.len(), MAX_TOKENS);
    for k in [1, 3, 5] {
        let mut m = Model::load(&ck).unwrap();
        assert!(m.attach_dspark(&ck, k).unwrap(), "no DSpark drafter");
        assert_eq!(m.draft_tokens(), k);
        check_drafter(&mut m, &prompt, &reference, &format!("DSpark K={k}"));
    }
    // An MTP attach on this checkpoint finds no MTP module.
    let mut m = Model::load(&ck).unwrap();
    assert!(!m.attach_mtp(&ck, 2).unwrap());
}

#[test]
fn greedy_dspark_drafting_is_identical_under_a_budget() {
    use keep_runtime::run::{DraftMode, RunModel};
    use keep_runtime::{BudgetedModel, RuntimeOptions};
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_dspark(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let prompt = common::prompt(9, model.cfg.vocab);
    let (reference, _) = run(&mut model, &prompt);
    let k = 5;
    // The plan of a drafting run holds every DSpark tensor (`mtp.*`) and a cache snapshot.
    let context = Some(prompt.len() + MAX_TOKENS + k);
    let plain = {
        let mut o = RuntimeOptions::new(u64::MAX / 4);
        o.context = context;
        BudgetedModel::load(&ck, &o).unwrap().plan().fixed()
    };
    let mut opts = RuntimeOptions::new(u64::MAX / 4);
    opts.context = context;
    opts.draft_tokens = k;
    let drafting = BudgetedModel::load(&ck, &opts).unwrap().plan().fixed();
    let dspark: u64 = ck
        .tensors()
        .filter(|t| t.name.starts_with("mtp."))
        .map(|t| t.bytes.len() as u64)
        .sum();
    assert!(dspark > 0);
    assert!(
        drafting >= plain + dspark,
        "the drafting plan ({drafting} B) does not hold the DSpark tensors ({dspark} B) beside the rest ({plain} B)"
    );
    // A budget of a few slots per layer: drafting through the slots keeps the output.
    let probe = BudgetedModel::load(&ck, &opts).unwrap();
    let slot = probe.plan().slot_bytes;
    drop(probe);
    opts.budget = drafting + 6 * slot * model.cfg.n_layers as u64;
    let mut m = RunModel::load(&ck, keep_kernels::Kernels::Exact, Some(&opts)).unwrap();
    assert_eq!(m.set_draft(&ck, DraftMode::DSpark, k).unwrap(), k);
    let (got, s) = run(&mut m, &prompt);
    assert_eq!(got, reference, "the budgeted DSpark run changed the output");
    assert!(s.draft.verify_forwards > 0);
    // `auto` picks DSpark on a checkpoint that carries it; `mtp` is refused.
    let mut m = RunModel::load(&ck, keep_kernels::Kernels::Exact, None).unwrap();
    assert_eq!(m.set_draft(&ck, DraftMode::Auto, k).unwrap(), k);
    assert!(m.set_draft(&ck, DraftMode::Mtp, 2).is_err());
}

#[test]
fn dspark_is_refused_without_a_drafter() {
    use keep_runtime::run::{DraftMode, RunModel};
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_mtp(dir.path(), "tiny");
    let ck = Checkpoint::open(&path).unwrap();
    let mut m = RunModel::load(&ck, keep_kernels::Kernels::Exact, None).unwrap();
    let e = m
        .set_draft(&ck, DraftMode::DSpark, 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no DSpark drafter"), "{e}");
    // auto keeps the MTP module.
    assert_eq!(m.set_draft(&ck, DraftMode::Auto, 2).unwrap(), 2);
}

fn check(preset: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_mtp(dir.path(), preset);
    let ck = Checkpoint::open(&path).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let prompt = common::prompt(9, model.cfg.vocab);
    let (reference, _) = run(&mut model, &prompt);
    assert_eq!(reference.len(), MAX_TOKENS);
    for k in [1, 2, 3, 5] {
        let mut m = Model::load(&ck).unwrap();
        assert!(m.attach_mtp(&ck, k).unwrap(), "{preset}: no MTP module");
        let (got, s) = run(&mut m, &prompt);
        assert_eq!(
            got, reference,
            "{preset} K={k}: the MTP drafter changed the output"
        );
        assert!(s.draft.verify_forwards > 0);
        let mut steered = Steered {
            model: &mut m,
            reference: reference.clone(),
            prompt: prompt.len(),
            fed: 0,
            step: 0,
        };
        let (got, s) = run(&mut steered, &prompt);
        assert_eq!(
            got, reference,
            "{preset} K={k}: steered drafts changed the output"
        );
        let accepted: u64 = s.draft.accepted.iter().sum();
        assert!(accepted > 0, "{preset} K={k}: no draft was accepted");
        assert!(s.draft.replays > 0, "{preset} K={k}: no draft was rejected");
        assert!(
            s.draft.replays < s.draft.verify_forwards,
            "{preset} K={k}: never all accepted"
        );
    }
}

#[test]
fn greedy_drafting_is_identical_on_v41() {
    check("tiny");
}

#[test]
fn greedy_drafting_is_identical_on_v4flash() {
    check("tiny-v4flash");
}

/// The drafts after `steps` greedy tokens, the drafter paused for tokens `pause` (its pairs
/// held back and run through the module when it drafts again): token ids and logits bits.
fn drafts_after(
    ck: &Checkpoint,
    prompt: &[u32],
    steps: usize,
    pause: std::ops::Range<usize>,
) -> Vec<(u32, Vec<u32>)> {
    let mut m = Model::load(ck).unwrap();
    assert!(m.attach_mtp(ck, 3).unwrap());
    let mut cache = m.new_cache();
    let mut logits = Generate::forward_last(&mut m, prompt, &mut cache, None).unwrap();
    for i in 0..steps {
        m.pause_drafting(pause.contains(&i));
        let tok = keep_model::generate::argmax(&logits);
        logits = Generate::forward_last(&mut m, &[tok], &mut cache, None).unwrap();
    }
    let last = keep_model::generate::argmax(&logits);
    let d = m
        .draft(last, 3, &mut |q| keep_model::generate::argmax(q))
        .unwrap();
    assert_eq!(d.len(), 3);
    d.into_iter()
        .map(|(t, q)| (t, q.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn a_paused_drafter_catches_up_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_mtp(dir.path(), "tiny");
    let ck = Checkpoint::open(&path).unwrap();
    let cfg = Model::load(&ck).unwrap().cfg;
    let prompt = common::prompt(9, cfg.vocab);
    let steps = 4 * cfg.window + 20;
    let want = drafts_after(&ck, &prompt, steps, 0..0);
    // Held back for a few tokens; for longer than two windows (only the last window's pairs
    // run, the block's window refilled from them), caught up by the draft or by a forward
    // fed after the pause.
    for pause in [3..10, 2..steps, 2..steps - 5, 30..steps] {
        let got = drafts_after(&ck, &prompt, steps, pause.clone());
        assert!(
            got == want,
            "paused for tokens {pause:?}: the drafts differ from a drafter fed every token"
        );
    }
}

/// The DSpark drafter's context rows follow the tokens the target kept: a draft after a
/// verify forward that kept a prefix equals the draft after feeding the same tokens as one
/// prompt, and after feeding them one at a time (the captured target states of each row do
/// not depend on the forward that ran it).
#[test]
fn dspark_context_follows_the_kept_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_dspark(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    let load = || {
        let mut m = Model::load(&ck).unwrap();
        assert!(m.attach_dspark(&ck, 5).unwrap());
        m
    };
    let vocab = load().cfg.vocab as u32;
    let prompt = common::prompt(9, vocab as usize);
    let more = [17u32, 23, 31, 40, 41];
    let greedy = &mut |l: &[f32]| keep_model::generate::argmax(l);
    let fed: Vec<u32> = prompt.iter().chain(&more[..3]).copied().collect();
    // One prompt.
    let mut a = load();
    let mut ca = a.new_cache();
    a.forward_drafting(&fed, &mut ca, keep_model::Logits::Last, None)
        .unwrap();
    let want = a.draft(more[3], 5, greedy).unwrap();
    assert_eq!(want.len(), 5);
    // A token at a time.
    let mut b = load();
    let mut cb = b.new_cache();
    for t in &fed {
        b.forward_drafting(&[*t], &mut cb, keep_model::Logits::Last, None)
            .unwrap();
    }
    assert_eq!(b.draft(more[3], 5, greedy).unwrap(), want, "token by token");
    // The prompt, then a verify forward of five rows keeping three.
    let mut c = load();
    let mut cc = c.new_cache();
    c.forward_drafting(&prompt, &mut cc, keep_model::Logits::Last, None)
        .unwrap();
    c.forward_verify(&more, &mut cc, None).unwrap();
    c.accept_drafts(&mut cc, 3).unwrap();
    assert_eq!(cc.pos, fed.len());
    assert_eq!(
        c.draft(more[3], 5, greedy).unwrap(),
        want,
        "after a rollback"
    );
    // And keeping all five continues from the last.
    let mut d = load();
    let mut cd = d.new_cache();
    d.forward_drafting(&prompt, &mut cd, keep_model::Logits::Last, None)
        .unwrap();
    d.forward_verify(&more, &mut cd, None).unwrap();
    d.accept_drafts(&mut cd, 5).unwrap();
    let all: Vec<u32> = prompt.iter().chain(&more).copied().collect();
    let mut e = load();
    let mut ce = e.new_cache();
    e.forward_drafting(&all, &mut ce, keep_model::Logits::Last, None)
        .unwrap();
    assert_eq!(
        d.draft(7, 5, greedy).unwrap(),
        e.draft(7, 5, greedy).unwrap(),
        "all kept"
    );
}

/// With a confidence floor the DSpark drafter proposes the leading part of its block (none
/// when even the first draft is below it) and greedy output is still the reference.
#[test]
fn dspark_confidence_floor_shortens_verify_windows() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth_with_dspark(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    let mut model = Model::load(&ck).unwrap();
    let prompt = common::prompt(9, model.cfg.vocab);
    let (reference, _) = run(&mut model, &prompt);
    let mut m = Model::load(&ck).unwrap();
    assert!(m.attach_dspark(&ck, 5).unwrap());
    let mut cache = m.new_cache();
    m.forward_drafting(&prompt, &mut cache, keep_model::Logits::Last, None)
        .unwrap();
    let greedy = &mut |l: &[f32]| keep_model::generate::argmax(l);
    let lasts: Vec<u32> = (0..40).map(|i| i * 11 % m.cfg.vocab as u32).collect();
    let whole: Vec<_> = lasts
        .iter()
        .map(|&t| m.draft(t, 5, greedy).unwrap())
        .collect();
    assert!(whole.iter().all(|d| d.len() == 5));
    for p in [0.05f32, 0.2] {
        m.set_dspark_confidence(Some(p));
        let mut lens = vec![];
        for (&t, w) in lasts.iter().zip(&whole) {
            let d = m.draft(t, 5, greedy).unwrap();
            assert_eq!(d[..], w[..d.len()], "floor {p}: not a prefix of the block");
            lens.push(d.len());
        }
        assert!(
            lens.iter().any(|&n| n < 5),
            "floor {p}: no block was shortened ({lens:?})"
        );
        let mut g = Model::load(&ck).unwrap();
        assert!(g.attach_dspark(&ck, 5).unwrap());
        g.set_dspark_confidence(Some(p));
        let (got, _) = run(&mut g, &prompt);
        assert_eq!(got, reference, "confidence floor {p} changed the output");
    }
}
