//! A [`Session`] on the bundled model (`models/keep-tiny`, or `KEEP_TINY_DIR`) runs what the
//! model built directly runs, and its run options stay its own: on the exact kernels its logits
//! and greedy tokens are the directly built model's bit for bit, mapped and under a budget; a
//! session on the fast kernels opened beside it on the same checkpoint runs the fast kernels
//! (other logits) while both sessions read one config, the checkpoint's. Skips (with a note)
//! when the model is not in the tree.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Generate, Kernels, Model, ModelConfig};
use keep_runtime::{LoadFor, RuntimeOptions, Session, SessionSpec};

fn model_dir() -> Option<PathBuf> {
    let p = std::env::var_os("KEEP_TINY_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
        });
    p.join("config.json").is_file().then_some(p)
}

/// Greedy decoding of `steps` tokens after `prompt`: every step's logits and the tokens.
fn greedy(m: &mut impl Generate, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = m.new_cache();
    let (mut logits, mut tokens) = (vec![], vec![]);
    let mut l = m.forward_last(prompt, &mut cache, None).unwrap();
    for _ in 0..steps {
        let t = argmax(&l) as u32;
        tokens.push(t);
        logits.push(l);
        l = m.forward_last(&[t], &mut cache, None).unwrap();
    }
    (logits, tokens)
}

const PROMPT: usize = 24;
const STEPS: usize = 8;

#[test]
fn a_session_runs_what_the_model_built_directly_runs_and_keeps_its_options() {
    let Some(dir) = model_dir() else {
        eprintln!("models/keep-tiny is not here: skipped");
        return;
    };
    let ck = Checkpoint::open(&dir).unwrap();
    let mut direct = Model::load(&ck).unwrap();
    let v = direct.cfg.vocab as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 131 + 7) % v).collect();
    let (want, want_tokens) = greedy(&mut direct, &prompt, STEPS);

    // A fast session opened first on the same checkpoint, and kept open: its kernels must not
    // reach the exact session's model.
    let fast = Session::open(SessionSpec::new(&dir, Kernels::Fast)).unwrap();
    let exact = Session::open(SessionSpec::new(&dir, Kernels::Exact)).unwrap();
    let (mut fm, _) = fast.load(LoadFor::default()).unwrap();
    let (mut em, _) = exact.load(LoadFor::default()).unwrap();
    let (fast_logits, _) = greedy(&mut fm, &prompt, STEPS);
    let (got, got_tokens) = greedy(&mut em, &prompt, STEPS);
    assert_eq!(
        got_tokens, want_tokens,
        "exact session: other greedy tokens"
    );
    assert!(
        got == want,
        "exact session: logits differ from the model built directly"
    );
    assert!(
        fast_logits != want,
        "fast session: the exact kernels' logits bit for bit (its kernels were not used)"
    );
    // Both sessions read the checkpoint's config, whatever their options.
    let cfg = format!("{:?}", ModelConfig::from_checkpoint(&ck).unwrap());
    assert_eq!(format!("{:?}", fast.cfg()), cfg);
    assert_eq!(format!("{:?}", em.cfg()), cfg);

    // Under a budget (room for every expert: nothing is evicted), the same tokens and logits.
    let budgeted = Session::open(SessionSpec {
        budget: Some(RuntimeOptions::new(u64::MAX / 4)),
        ..SessionSpec::new(&dir, Kernels::Exact)
    })
    .unwrap();
    let (mut bm, _) = budgeted
        .load(LoadFor {
            context: Some(PROMPT + STEPS),
            ..LoadFor::default()
        })
        .unwrap();
    assert!(bm.budgeted().is_some());
    let (got, got_tokens) = greedy(&mut bm, &prompt, STEPS);
    assert_eq!(
        got_tokens, want_tokens,
        "budgeted session: other greedy tokens"
    );
    assert!(
        got == want,
        "budgeted session: logits differ from the model built directly"
    );
}
