//! Engram rows from SSD against the mapped tables: on keep-model's committed Engram fixture, a
//! budgeted run whose Engram row cache holds a few rows (so rows are evicted, re-read and, when a
//! forward needs more rows than the cache holds, read directly) gives logits bit-identical to the
//! plain model, and the counters add up (with a cache that holds them, every requested row is a
//! hit or a miss; bytes read are whole blocks of the device, at least the useful bytes). With a compressed
//! Engram vocabulary (a tokenizer.json next to the config) the runtime builds the same token map
//! as the plain model and gives the same logits.

use std::path::PathBuf;

use keep_checkpoint::Checkpoint;
use keep_model::generate::argmax;
use keep_model::{Logits, Model};
use keep_runtime::{BudgetedModel, RuntimeOptions};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../keep-model/tests/data/small-engram")
}

fn greedy(
    mut fwd: impl FnMut(&[u32], Logits) -> Vec<f32>,
    prompt: &[u32],
    steps: usize,
    v: usize,
) -> Vec<Vec<f32>> {
    let mut out = vec![fwd(prompt, Logits::All)];
    let mut tok = argmax(&out[0][out[0].len() - v..]);
    for _ in 0..steps {
        let l = fwd(&[tok], Logits::Last);
        tok = argmax(&l);
        out.push(l);
    }
    out
}

#[test]
fn engram_rows_from_ssd_give_identical_logits() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let prompt: Vec<u32> = (0..37u32).map(|i| (i * 97 + 13) % v as u32).collect();
    let mut c = plain.new_cache();
    let want = greedy(
        |t, w| plain.forward(t, &mut c, w, None).unwrap(),
        &prompt,
        10,
        v,
    );
    // Row bytes are 32 + 1: 40 rows fit the 1,320-byte cache, fewer than one prefill's 148 per
    // slot, so rows are evicted before use and read again directly.
    for cache_bytes in [1_320u64, 1 << 20] {
        let mut opts = RuntimeOptions::new(64 << 20);
        opts.engram_cache = Some(cache_bytes);
        opts.io_threads = 3;
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        let mut c = m.new_cache();
        let got = greedy(
            |t, w| m.forward(t, &mut c, w, None).unwrap(),
            &prompt,
            10,
            v,
        );
        assert_eq!(want.len(), got.len());
        for (a, b) in want.iter().zip(&got) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "engram cache {cache_bytes}: logits differ"
            );
        }
        let s = m.engram().unwrap().stats();
        assert!(
            s.bytes_read >= s.useful_bytes && s.bytes_read.is_multiple_of(s.block_bytes),
            "{s:?}"
        );
        assert!(s.rows_requested > 0 && s.misses > 0, "{s:?}");
        if cache_bytes == 1_320 {
            assert!(
                s.sync_rows > 0,
                "the small cache takes the direct-read path: {s:?}"
            );
        }
        if cache_bytes == 1 << 20 {
            assert_eq!(s.sync_rows, 0, "{s:?}");
            assert_eq!(s.hits + s.misses, s.rows_requested, "{s:?}");
            assert!(
                s.hits > 0,
                "decode reuses rows of the prompt's n-grams: {s:?}"
            );
        }
    }
}

#[test]
fn the_default_row_cache_takes_what_the_budget_leaves() {
    // Unset, the row cache is cut to what the budget leaves after the residents, the context
    // and top-k slots per layer: at the least budget that holds those it is empty (every row
    // read when used) and the logits are still the plain model's; a larger budget gives it
    // part of the rest, never past the budget.
    let ck = Checkpoint::open(&fixture()).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let prompt: Vec<u32> = (0..19u32).map(|i| (i * 43 + 11) % v as u32).collect();
    let mut c = plain.new_cache();
    let want = greedy(
        |t, w| plain.forward(t, &mut c, w, None).unwrap(),
        &prompt,
        4,
        v,
    );
    let mut opts = RuntimeOptions::new(1);
    opts.context = Some(prompt.len() + 4);
    let need = match BudgetedModel::load(&ck, &opts) {
        Err(keep_runtime::RuntimeError::BudgetTooSmall { needed, held, .. }) => {
            assert!(held.is_empty(), "no row cache is named: {held}");
            needed
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a one-byte budget runs"),
    };
    for budget in [need, need + (64 << 10)] {
        opts.budget = budget;
        let mut m = BudgetedModel::load(&ck, &opts).unwrap();
        let e = m.engram().unwrap().cache_bytes();
        assert!(m.plan().planned() <= budget && m.plan().residents >= e);
        let mut c = m.new_cache();
        let got = greedy(|t, w| m.forward(t, &mut c, w, None).unwrap(), &prompt, 4, v);
        for (a, b) in want.iter().zip(&got) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "budget {budget}: logits differ"
            );
        }
        let s = m.engram().unwrap().stats();
        if budget == need {
            assert_eq!(e, 0);
            assert!(s.misses > 0 && s.sync_rows >= s.misses, "{s:?}");
        } else {
            assert!(e > 0, "the row cache gets part of what is left");
            assert_eq!(s.sync_rows, 0, "{s:?}");
        }
    }
}

#[test]
fn compressed_engram_vocabulary_runs_under_a_budget() {
    // The fixture with a compressed Engram vocabulary (the bundled keep-tiny tokenizer copied
    // in; it compresses to 2690 ids): the budgeted runtime builds the same token map as the
    // plain model and gives bit-identical logits.
    let td = tempfile::tempdir().unwrap();
    let src = fixture();
    std::fs::copy(
        src.join("model.safetensors"),
        td.path().join("model.safetensors"),
    )
    .unwrap();
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
    std::fs::copy(
        tiny.join("tokenizer.json"),
        td.path().join("tokenizer.json"),
    )
    .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["engram_compressed_vocab_size"] = serde_json::json!(2690);
    std::fs::write(td.path().join("config.json"), cfg.to_string()).unwrap();

    let ck = Checkpoint::open(td.path()).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let prompt: Vec<u32> = (0..29u32).map(|i| (i * 53 + 7) % v as u32).collect();
    let mut c = plain.new_cache();
    let want = greedy(
        |t, w| plain.forward(t, &mut c, w, None).unwrap(),
        &prompt,
        6,
        v,
    );
    let mut opts = RuntimeOptions::new(64 << 20);
    opts.engram_cache = Some(1 << 20);
    let mut m = BudgetedModel::load(&ck, &opts).unwrap();
    let map = &m.cfg().engram.as_ref().unwrap().token_map;
    assert_eq!(
        map.as_deref(),
        plain.cfg.engram.as_ref().unwrap().token_map.as_deref(),
        "the runtime builds the same token map"
    );
    assert!(map.is_some());
    let mut c = m.new_cache();
    let got = greedy(|t, w| m.forward(t, &mut c, w, None).unwrap(), &prompt, 6, v);
    assert_eq!(want.len(), got.len());
    for (a, b) in want.iter().zip(&got) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "logits differ"
        );
    }
}

#[test]
fn engram_use_counts_the_rows_the_runtime_reads() {
    // keep-model's `EngramUse` predicts from the token ids alone what the runtime's row store
    // reads: with a cache that holds every row, one prefill reads each distinct row once.
    let ck = Checkpoint::open(&fixture()).unwrap();
    let mut opts = RuntimeOptions::new(64 << 20);
    opts.engram_cache = Some(1 << 20);
    let mut m = BudgetedModel::load(&ck, &opts).unwrap();
    let v = m.cfg().vocab as u32;
    let prompt: Vec<u32> = (0..41u32).map(|i| (i * 31 + 5) % v).collect();
    let mut u = keep_model::engram::EngramUse::new(&ck, m.cfg())
        .unwrap()
        .expect("the fixture has engram layers");
    u.add(&prompt).unwrap();
    let r = u.report();
    let mut c = m.new_cache();
    m.forward(&prompt, &mut c, Logits::Last, None).unwrap();
    let s = m.engram().unwrap().stats();
    assert_eq!(s.misses, r.distinct_rows.iter().sum::<u64>(), "{s:?} {r:?}");
    assert_eq!(s.useful_bytes, r.distinct_bytes, "{s:?} {r:?}");
    assert_eq!(
        r.rows_gathered,
        (prompt.len() * r.rows_per_token * r.layers.len()) as u64
    );
    assert_eq!(r.tokens, prompt.len() as u64);
}

#[test]
fn tables_above_the_threshold_are_read_not_mapped() {
    // Without a budget, a model whose tables exceed the threshold reads its rows through the
    // store (same logits as the mapped tables); below it the tables stay mapped.
    let ck = Checkpoint::open(&fixture()).unwrap();
    let plain = Model::load(&ck).unwrap();
    let v = plain.cfg.vocab;
    let prompt: Vec<u32> = (0..23u32).map(|i| (i * 71 + 3) % v as u32).collect();
    let mut c = plain.new_cache();
    let want = greedy(
        |t, w| plain.forward(t, &mut c, w, None).unwrap(),
        &prompt,
        5,
        v,
    );
    let mut mapped = Model::load(&ck).unwrap();
    assert!(keep_runtime::engram_rows_above(&mut mapped, &ck, u64::MAX)
        .unwrap()
        .is_none());
    let mut m = Model::load(&ck).unwrap();
    let store = keep_runtime::engram_rows_above(&mut m, &ck, 0)
        .unwrap()
        .expect("tables above a zero threshold are read through the store");
    let mut c = m.new_cache();
    let got = greedy(|t, w| m.forward(t, &mut c, w, None).unwrap(), &prompt, 5, v);
    for (a, b) in want.iter().zip(&got) {
        assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
    let s = store.stats();
    assert!(s.misses > 0 && s.bytes_read >= s.useful_bytes, "{s:?}");
}
