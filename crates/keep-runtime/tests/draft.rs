//! Speculative decoding with the MTP module keeps greedy output identical to decoding without
//! it, token for token, on synthetic checkpoints of both families written by `keep synth` with
//! `mtp.0.*` (V4.1 with its shared compressors and indexer, V4-Flash with CSA/HCA and hash
//! routing; sliding window 16, so rollbacks cross the window and compressor groups). Two
//! drafters run: the module itself (random weights: nearly every draft is rejected, so the
//! rollback path runs every step) and the module with its tokens overridden by the reference
//! continuation for a varying number of leading drafts (so every count of accepted drafts,
//! all-accepted included, is exercised on the real caches).

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
    let prompt = common::prompt(9, Model::load(&ck).unwrap().cfg.vocab);
    let steps = keep_model::mtp::MAX_BACKLOG + 20;
    let want = drafts_after(&ck, &prompt, steps, 0..0);
    // held back for a few tokens, and for more than the backlog holds (it runs when full)
    for pause in [3..10, 2..steps] {
        let got = drafts_after(&ck, &prompt, steps, pause.clone());
        assert!(
            got == want,
            "paused for tokens {pause:?}: the drafts differ from a drafter fed every token"
        );
    }
}
