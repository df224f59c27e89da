//! End-to-end tests of keep-calib on a tiny synthetic checkpoint made in-test (random weights,
//! 8 layers, 16 experts top-4, vocabulary 512) and a tiny pack of pseudo-random token records:
//! REAP against a direct recomputation, bit-identical forward with the collector attached,
//! resumption (complete skipped, truncated redone), shards, fingerprints, finalize refusals,
//! selection and the plan.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use keep_calib::calibrate::{calibrate, shard_groups, CalibrateOptions, RunManifest};
use keep_calib::finalize::{finalize, read_reap_stats, IMATRIX_FILE, REAP_FILE};
use keep_calib::pack::{
    build_pack, from_token_sources, write_pack, Document, Pack, PackOptions, Split,
};
use keep_calib::select::{
    jaccard, quantile, select, to_plan, top_ids, top_ids_in_groups, Keep, Saliency, SelectOptions,
};
use keep_calib::session::session_path;
use keep_calib::st::{write_atomic, StFile, Tensor};
use keep_calib::stats::{Collector, LayerReap, SessionStats};
use keep_calib::CalibError;
use keep_checkpoint::Checkpoint;
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::{ExpertOutputEvent, Logits, Model, ModelConfig, RouteEvent, RouteObserver};

/// Relative tolerance between a session/finalize REAP score and a direct recomputation:
/// finalize adds per-session f64 sums, a different association than one running sum over all
/// tokens, so the last bits may differ (each sum has < 10⁴ terms: error ≪ 1e-12).
const REAP_REL_TOL: f64 = 1e-12;

struct Fixture {
    _dir: tempfile::TempDir,
    model: PathBuf,
    model_b: PathBuf,
}

fn synth_model(out: &Path, seed: u64) {
    let (cfg, storage) = keep_convert::presets::preset("tiny").unwrap();
    let opts = keep_convert::synth::SynthOptions {
        seed,
        storage,
        force: false,
        max_shard_bytes: 4 << 30,
    };
    keep_convert::synth::synth(&cfg, out, &opts, &|_, _| {}).unwrap();
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tiny");
        synth_model(&model, 7);
        let model_b = dir.path().join("tiny-b");
        synth_model(&model_b, 8);
        Fixture {
            _dir: dir,
            model,
            model_b,
        }
    })
}

/// A deterministic pseudo-random token stream.
fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    use keep_rng::Draw;
    let mut r = keep_rng::rng(seed);
    (0..n).map(|_| r.below(vocab as usize) as u32).collect()
}

fn make_pack(dir: &Path, name: &str, seed: u64) -> Pack {
    let sources: Vec<(String, Vec<u32>)> = (0..6)
        .map(|i| {
            (
                format!("doc{i}.txt"),
                tokens(seed * 100 + i, 30 + 13 * i as usize, 512),
            )
        })
        .collect();
    let opts = PackOptions {
        max_tokens: 32,
        held_out_frac: 0.34,
        seed,
    };
    let (m, r) = from_token_sources(&sources, "0".repeat(64), 512, &opts).unwrap();
    let p = dir.join(name);
    write_pack(&p, &m, &r, false).unwrap();
    Pack::open(&p).unwrap()
}

fn opts(split: Split) -> CalibrateOptions {
    CalibrateOptions {
        split,
        chunk_tokens: 48,
        ..Default::default()
    }
}

fn run(
    model: &Path,
    pack: &Pack,
    out: &Path,
    o: &CalibrateOptions,
) -> keep_calib::Result<keep_calib::calibrate::CalibrateReport> {
    calibrate(model, pack, out, o, &mut |_| {})
}

/// Records expert outputs and gate weights, in event order.
#[derive(Default)]
struct Capture {
    /// (layer, expert, g, ‖f‖ recomputed here)
    rows: Vec<(usize, usize, f32, Vec<f32>)>,
    routes: Vec<(usize, Vec<u32>, Vec<f32>)>,
}

impl RouteObserver for Capture {
    fn wants_expert_outputs(&self) -> bool {
        true
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        self.routes
            .push((ev.layer, ev.experts.to_vec(), ev.weights.to_vec()));
    }
    fn on_expert_output(&mut self, ev: &ExpertOutputEvent) {
        let d = ev.outputs.len() / ev.weights.len().max(1);
        for (r, &g) in ev.weights.iter().enumerate() {
            self.rows.push((
                ev.layer,
                ev.expert,
                g,
                ev.outputs[r * d..(r + 1) * d].to_vec(),
            ));
        }
    }
}

fn rel_close(a: f64, b: f64) -> bool {
    (a - b).abs() <= REAP_REL_TOL * a.abs().max(b.abs()) || a == b
}

#[test]
fn reap_scores_equal_direct_recomputation() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 1);
    let out = dir.path().join("run");
    let rep = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    assert!(rep.sessions_run.len() >= 2);
    finalize(&out).unwrap();
    let stats = read_reap_stats(&out).unwrap();

    // Direct: every calibration record through the streamed forward with a plain observer.
    let ck = Checkpoint::open(&f.model).unwrap();
    let cfg = ModelConfig::from_deepseek(ck.require_config().unwrap()).unwrap();
    let mut cap = Capture::default();
    let recs: Vec<Vec<u32>> = pack
        .groups(Split::Calibration)
        .iter()
        .flat_map(|g| {
            pack.records_of(&g.id)
                .map(|r| r.tokens.clone())
                .collect::<Vec<_>>()
        })
        .collect();
    forward_streamed(&ck, &recs, StreamOptions::default(), Some(&mut cap)).unwrap();
    let (nl, ne) = (cfg.n_layers, cfg.n_experts);
    let mut sum = vec![vec![0f64; ne]; nl];
    let mut cnt = vec![vec![0u64; ne]; nl];
    for (l, e, g, row) in &cap.rows {
        let norm = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        sum[*l][*e] += *g as f64 * norm;
        cnt[*l][*e] += 1;
    }
    let mut routed = 0;
    for l in 0..nl {
        for e in 0..ne {
            assert_eq!(
                stats.layers[l].count[e], cnt[l][e],
                "count layer {l} expert {e}"
            );
            let direct = if cnt[l][e] == 0 {
                0.0
            } else {
                sum[l][e] / cnt[l][e] as f64
            };
            let got = stats.scores[l][e];
            assert!(
                rel_close(got, direct),
                "layer {l} expert {e}: {got} vs {direct}"
            );
            routed += cnt[l][e];
        }
        // g is the model's final gate weight: the weights the router reported.
        let tot: u64 = cnt[l].iter().sum();
        assert_eq!(
            tot as usize,
            recs.iter().map(|r| r.len()).sum::<usize>() * cfg.top_k
        );
    }
    assert!(routed > 0);
    // Route counts from on_route agree with REAP counts.
    let mut rc = vec![vec![0u64; ne]; nl];
    for (l, ex, _) in &cap.routes {
        for &e in ex {
            rc[*l][e as usize] += 1;
        }
    }
    assert_eq!(rc, cnt);
    // The imatrix of a routed expert counts exactly its routed tokens.
    let im = StFile::open(&out.join(IMATRIX_FILE)).unwrap();
    for (e, &n) in cnt[0].iter().enumerate().take(ne) {
        let c = im
            .i64s(&format!("imatrix.0.ffn.experts.{e}.w1.count"))
            .unwrap();
        assert_eq!(c[0] as u64, n);
        assert_eq!(
            im.f64s(&format!("imatrix.0.ffn.experts.{e}.w1"))
                .unwrap()
                .len(),
            cfg.dim
        );
    }
    assert!(im.has("imatrix.0.attn.wq_a") && im.has("imatrix.0.ffn.shared_experts.w2"));
    assert_eq!(im.shape("imatrix.0.attn.wo_a").unwrap()[0], cfg.o_groups);
}

#[test]
fn routes_in_sessions_are_the_first_tokens_of_routing() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 2);
    let out = dir.path().join("run");
    let mut o = opts(Split::Calibration);
    o.route_tokens = 40;
    run(&f.model, &pack, &out, &o).unwrap();
    let g = pack.groups(Split::Calibration)[0].id.clone();
    let recs: Vec<Vec<u32>> = pack.records_of(&g).map(|r| r.tokens.clone()).collect();
    let ck = Checkpoint::open(&f.model).unwrap();
    let mut cap = Capture::default();
    forward_streamed(&ck, &recs, StreamOptions::default(), Some(&mut cap)).unwrap();
    let s = StFile::open(&session_path(&out, &g)).unwrap();
    assert_eq!(s.meta("format").unwrap(), "keep-calib-session");
    assert_eq!(s.meta("complete").unwrap(), "true");
    assert_eq!(s.meta("n_experts").unwrap(), "16");
    assert_eq!(s.meta("top_k").unwrap(), "4");
    for l in 0..8 {
        let want: Vec<i16> = cap
            .routes
            .iter()
            .filter(|r| r.0 == l)
            .flat_map(|r| r.1.iter().map(|&e| e as i16))
            .take(40 * 4)
            .collect();
        let wantw: Vec<f32> = cap
            .routes
            .iter()
            .filter(|r| r.0 == l)
            .flat_map(|r| r.2.iter().map(|&w| half::f16::from_f32(w).to_f32()))
            .take(40 * 4)
            .collect();
        assert_eq!(
            s.shape(&format!("routes.{l}.experts")).unwrap(),
            vec![want.len() / 4, 4]
        );
        assert_eq!(s.i16s(&format!("routes.{l}.experts")).unwrap(), want);
        assert_eq!(s.f16s(&format!("routes.{l}.weights")).unwrap(), wantw);
    }
}

#[test]
fn forward_is_bit_identical_with_the_collector_attached() {
    let f = fixture();
    let ck = Checkpoint::open(&f.model).unwrap();
    let cfg = ModelConfig::from_deepseek(ck.require_config().unwrap()).unwrap();
    let recs = vec![tokens(5, 37, 512), tokens(6, 20, 512)];
    let plain = forward_streamed(&ck, &recs, StreamOptions::default(), None).unwrap();
    let mut col = Collector::new(
        SessionStats::new(cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.dim),
        2048,
    );
    let seen = forward_streamed(&ck, &recs, StreamOptions::default(), Some(&mut col)).unwrap();
    assert_eq!(plain, seen);
    assert!(col.stats.reap[0].count.iter().sum::<u64>() > 0);
    let model = Model::load(&ck).unwrap();
    let mut c1 = model.new_cache();
    let a = model.forward(&recs[0], &mut c1, Logits::All, None).unwrap();
    let mut c2 = model.new_cache();
    let b = model
        .forward(&recs[0], &mut c2, Logits::All, Some(&mut col))
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(a, plain[0]);
}

#[test]
fn complete_sessions_are_skipped_and_a_truncated_one_is_redone() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 3);
    let out = dir.path().join("run");
    let r1 = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    let n = r1.sessions_run.len();
    let r2 = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    assert!(r2.sessions_run.is_empty());
    assert_eq!(r2.sessions_skipped.len(), n);
    // Cut one session off mid-file.
    let victim = r1.sessions_run[0].clone();
    let p = session_path(&out, &victim);
    let full = std::fs::read(&p).unwrap();
    std::fs::write(&p, &full[..full.len() / 2]).unwrap();
    assert!(finalize(&out).is_err_and(|e| e.to_string().contains(&victim)));
    let r3 = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    assert_eq!(r3.sessions_run, vec![victim.clone()]);
    assert_eq!(r3.sessions_redone.len(), 1);
    assert_eq!(r3.sessions_skipped.len(), n - 1);
    // Deterministic: the redone file equals the first.
    assert!(std::fs::read(&p).unwrap() == full, "redone session differs");
    finalize(&out).unwrap();
}

#[test]
fn shards_partition_the_groups_and_sum_to_the_whole_run() {
    for n in 1..5 {
        let mut all: Vec<usize> = (0..n)
            .flat_map(|i| shard_groups(11, (i, n)).unwrap())
            .collect();
        all.sort();
        assert_eq!(all, (0..11).collect::<Vec<_>>());
    }
    assert!(matches!(
        shard_groups(3, (2, 2)),
        Err(CalibError::Options(_))
    ));
    assert!(matches!(
        shard_groups(3, (0, 0)),
        Err(CalibError::Options(_))
    ));

    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 4);
    let whole = dir.path().join("whole");
    run(&f.model, &pack, &whole, &opts(Split::Calibration)).unwrap();
    finalize(&whole).unwrap();
    let sharded = dir.path().join("sharded");
    let mut o = opts(Split::Calibration);
    o.shard = (5, 2);
    assert!(run(&f.model, &pack, &sharded, &o).is_err());
    o.shard = (0, 2);
    let a = run(&f.model, &pack, &sharded, &o).unwrap();
    // Half a run cannot be finalized.
    assert!(matches!(finalize(&sharded), Err(CalibError::Sessions(_))));
    o.shard = (1, 2);
    let b = run(&f.model, &pack, &sharded, &o).unwrap();
    assert!(a.sessions_run.iter().all(|s| !b.sessions_run.contains(s)));
    finalize(&sharded).unwrap();
    for file in [IMATRIX_FILE, REAP_FILE] {
        let same =
            std::fs::read(whole.join(file)).unwrap() == std::fs::read(sharded.join(file)).unwrap();
        assert!(same, "{file} differs between the sharded and the whole run");
    }
}

fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().to_string(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn another_model_or_pack_is_refused_and_nothing_is_overwritten() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 5);
    let other = make_pack(dir.path(), "other", 6);
    let out = dir.path().join("run");
    run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    let before = snapshot(&out);
    let e = run(&f.model, &other, &out, &opts(Split::Calibration)).unwrap_err();
    assert!(
        matches!(e, CalibError::Mismatch(_)) && e.to_string().contains("pack"),
        "{e}"
    );
    let e = run(&f.model_b, &pack, &out, &opts(Split::Calibration)).unwrap_err();
    assert!(
        matches!(e, CalibError::Mismatch(_)) && e.to_string().contains("model"),
        "{e}"
    );
    let e = run(&f.model, &pack, &out, &opts(Split::Eval)).unwrap_err();
    assert!(matches!(e, CalibError::Mismatch(_)), "{e}");
    assert!(before == snapshot(&out), "run directory changed");
    // A session of another model placed in this run is refused, not overwritten.
    let out_b = dir.path().join("run-b");
    run(&f.model_b, &pack, &out_b, &opts(Split::Calibration)).unwrap();
    let g = pack.groups(Split::Calibration)[0].id.clone();
    let foreign = std::fs::read(session_path(&out_b, &g)).unwrap();
    std::fs::write(session_path(&out, &g), &foreign).unwrap();
    let e = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap_err();
    assert!(matches!(e, CalibError::Mismatch(_)), "{e}");
    assert!(std::fs::read(session_path(&out, &g)).unwrap() == foreign);
}

#[test]
fn a_pack_tokenized_for_another_model_is_refused() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    // A copy of the model with a tokenizer.json the pack was not made with.
    let m = dir.path().join("model");
    std::fs::create_dir(&m).unwrap();
    for e in std::fs::read_dir(&f.model).unwrap().flatten() {
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    std::fs::write(m.join("tokenizer.json"), b"{}").unwrap();
    let pack = make_pack(dir.path(), "pack", 7);
    let out = dir.path().join("run");
    let e = run(&m, &pack, &out, &opts(Split::Calibration)).unwrap_err();
    assert!(
        matches!(e, CalibError::Mismatch(_)) && e.to_string().contains("tokenizer"),
        "{e}"
    );
    assert!(!out.exists());
    // A pack with a larger vocabulary than the model.
    let sources = vec![("a".to_string(), vec![600u32, 3, 4])];
    let (man, rec) =
        from_token_sources(&sources, "0".repeat(64), 1000, &PackOptions::default()).unwrap();
    write_pack(&dir.path().join("big"), &man, &rec, false).unwrap();
    let big = Pack::open(&dir.path().join("big")).unwrap();
    let e = run(&f.model, &big, &out, &opts(Split::Calibration)).unwrap_err();
    assert!(matches!(e, CalibError::Mismatch(_)), "{e}");
}

#[test]
fn finalize_refuses_sessions_without_reap_or_with_unequal_counts() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 8);
    let out = dir.path().join("run");
    let r = run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    let rewrite = |g: &str, edit: &dyn Fn(&mut Vec<Tensor>)| {
        let p = session_path(&out, g);
        let s = StFile::open(&p).unwrap();
        let mut ts: Vec<Tensor> = s
            .tensors()
            .iter()
            .map(|t| {
                let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
                Tensor::new(t.name.clone(), t.dtype, &shape, s.file.data(t).to_vec())
            })
            .collect();
        edit(&mut ts);
        let meta = s.metadata().clone();
        drop(s);
        write_atomic(&p, ts, &meta, true).unwrap();
    };
    let a = r.sessions_run[0].clone();
    rewrite(&a, &|ts| ts.retain(|t| !t.name().starts_with("reap.3.")));
    let e = finalize(&out).unwrap_err().to_string();
    assert!(e.contains("without REAP") && e.contains(&a), "{e}");
    assert!(!out.join(REAP_FILE).exists());
    std::fs::remove_file(session_path(&out, &a)).unwrap();
    run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    let b = r.sessions_run[1].clone();
    rewrite(&b, &|ts| {
        let t = ts.iter_mut().find(|t| t.name() == "reap.2.count").unwrap();
        t.data[0] = t.data[0].wrapping_add(1);
    });
    let e = finalize(&out).unwrap_err().to_string();
    assert!(
        e.contains("differ from their imatrix counts") && e.contains(&b),
        "{e}"
    );
    assert!(!out.join(IMATRIX_FILE).exists());
}

#[test]
fn eval_split_writes_teacher_log_probs() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 9);
    let out = dir.path().join("eval");
    let mut o = opts(Split::Eval);
    o.teacher_topk = 8;
    let r = run(&f.model, &pack, &out, &o).unwrap();
    let g = &r.sessions_run[0];
    let recs: Vec<Vec<u32>> = pack.records_of(g).map(|r| r.tokens.clone()).collect();
    let ck = Checkpoint::open(&f.model).unwrap();
    let logits = forward_streamed(&ck, &recs, StreamOptions::default(), None).unwrap();
    let s = StFile::open(&session_path(&out, g)).unwrap();
    let t = recs[0].len();
    assert_eq!(s.shape("teacher.0.topk_ids").unwrap(), vec![t, 8]);
    let ids = s.i16s("teacher.0.topk_ids").err();
    assert!(ids.is_some(), "ids are I32");
    let lp = s.f32s("teacher.0.topk_logprobs").unwrap();
    let next = s.f32s("teacher.0.next_logprob").unwrap();
    assert_eq!(next.len(), t - 1);
    let v = 512;
    for i in 0..t - 1 {
        let row = &logits[0][i * v..(i + 1) * v];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        let want = (row[recs[0][i + 1] as usize] as f64 - lse) as f32;
        assert_eq!(next[i], want);
        let best = (m - lse) as f32;
        assert_eq!(lp[i * 8], best);
        assert!(lp[i * 8..(i + 1) * 8].windows(2).all(|w| w[0] >= w[1]));
    }
    let m = RunManifest::read(&out).unwrap();
    assert_eq!(m.split, Split::Eval);
}

#[test]
fn select_writes_a_valid_uniform_plan() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let pack = make_pack(dir.path(), "pack", 10);
    let out = dir.path().join("run");
    run(&f.model, &pack, &out, &opts(Split::Calibration)).unwrap();
    finalize(&out).unwrap();
    let mut stats = read_reap_stats(&out).unwrap();
    let o = SelectOptions {
        keep: Keep::parse("50%").unwrap(),
        saliency: Saliency::Reap,
        shrink: None,
        protect_super_experts: false,
        hash_remap: None,
        groups: 1,
    };
    let sel = select(&stats, &o).unwrap();
    assert_eq!(sel.keep, 8);
    let plan = to_plan(&sel, &stats, &o);
    plan.validate().unwrap();
    let text = serde_json::to_string(&plan).unwrap();
    let back: keep_artifacts::plan::PrunePlan = serde_json::from_str(&text).unwrap();
    // (floats in the extra fields may differ in the last bit through JSON: compare the plan proper)
    assert_eq!(
        (&back.layers, back.keep, back.n_experts),
        (&plan.layers, plan.keep, plan.n_experts)
    );
    back.validate().unwrap();
    for l in &plan.layers {
        assert_eq!(l.survivors.as_ref().unwrap().len(), 8);
    }
    // Frequency against itself: Jaccard 1 everywhere.
    let fo = SelectOptions {
        saliency: Saliency::Frequency,
        ..o.clone()
    };
    let fsel = select(&stats, &fo).unwrap();
    assert_eq!(fsel.mean_jaccard, Some(1.0));
    assert_eq!(fsel.killed, Some(true));
    // Protected super-experts survive.
    let po = SelectOptions {
        protect_super_experts: true,
        ..o.clone()
    };
    let psel = select(&stats, &po).unwrap();
    for s in &psel.super_experts {
        assert!(psel.layers[s.layer]
            .survivors
            .as_ref()
            .unwrap()
            .contains(&s.expert));
    }
    // Hash-routed layers stay whole and are marked.
    stats.hash_layers = vec![0, 1];
    let hsel = select(&stats, &o).unwrap();
    let hplan = to_plan(&hsel, &stats, &o);
    assert!(hplan.layers[0].hash_routed && hplan.layers[0].survivors.is_none());
    assert!(hplan.layers[2].survivors.is_some());
    // Keep outside top_k..=E is refused; shrink with frequency is refused.
    assert!(select(
        &stats,
        &SelectOptions {
            keep: Keep::Count(3),
            ..o.clone()
        }
    )
    .is_err());
    assert!(select(
        &stats,
        &SelectOptions {
            keep: Keep::Count(17),
            ..o.clone()
        }
    )
    .is_err());
    assert!(select(
        &stats,
        &SelectOptions {
            shrink: Some(1.0),
            ..fo
        }
    )
    .is_err());
    // Plots.
    keep_calib::plot::plot(&sel, &dir.path().join("j.svg")).unwrap();
    let svg = std::fs::read_to_string(dir.path().join("j.svg")).unwrap();
    assert!(svg.contains("<svg"));
}

#[test]
fn jaccard_quantile_and_ranking() {
    assert_eq!(jaccard(&[1, 2, 3], &[1, 2, 3]), 1.0);
    assert_eq!(jaccard(&[1, 2], &[3, 4]), 0.0);
    assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
    assert_eq!(jaccard(&[], &[]), 1.0);
    assert_eq!(quantile(&[1.0, 2.0, 3.0, 4.0, 5.0], 0.5), 3.0);
    assert_eq!(quantile(&[0.0, 10.0], 0.995), 9.95);
    assert_eq!(top_ids(&[0.5, 0.9, 0.1, 0.9], 2, &[]), vec![1, 3]);
    assert_eq!(top_ids(&[0.5, 0.9, 0.1, 0.9], 2, &[2]), vec![1, 2]);
    assert_eq!(top_ids(&[0.0, 0.0, 0.0], 2, &[]), vec![0, 1]);
    // Two groups of three: the best two of each, forced ones first within their group.
    let s = [0.9, 0.8, 0.7, 0.1, 0.2, 0.3];
    assert_eq!(top_ids(&s, 4, &[]), vec![0, 1, 2, 5]);
    assert_eq!(top_ids_in_groups(&s, 4, &[], 2), vec![0, 1, 4, 5]);
    assert_eq!(top_ids_in_groups(&s, 4, &[3], 2), vec![0, 1, 3, 5]);
    assert_eq!(top_ids_in_groups(&s, 4, &[], 1), top_ids(&s, 4, &[]));
    assert_eq!(Keep::parse("50%"), Some(Keep::Percent(50.0)));
    assert_eq!(Keep::parse("12"), Some(Keep::Count(12)));
    assert_eq!(Keep::parse("x"), None);
    assert_eq!(Keep::Percent(50.0).resolve(16), 8);
    // REAP max |f| counts negative outliers.
    let mut r = LayerReap::new(2, 3);
    r.add_outputs(0, &[1.0], &[0.5, -9.0, 1.0]);
    r.add_outputs(1, &[1.0], &[2.0, 1.0, 1.0]);
    assert_eq!(r.max_abs(), vec![9.0, 2.0]);
}

#[test]
fn packs_from_text_with_the_trained_tokenizer() {
    let tok = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/train/tokenizer.json");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    for i in 0..8 {
        std::fs::write(
            src.join(format!("f{i}.py")),
            format!("def f{i}(x):\n    return x * {i} + sum(range({i}))\n").repeat(20),
        )
        .unwrap();
    }
    std::fs::write(src.join("sub/bin.dat"), [0xffu8, 0xfe, 0x00]).unwrap();
    std::fs::write(
        dir.path().join("extra.jsonl"),
        "{\"text\": \"import os\\nprint(os.getcwd())\\n\", \"group\": \"a\"}\n{\"text\": \"x = 1\\n\", \"group\": \"a\"}\n{\"text\": \"y = [i for i in range(9)]\\n\"}\n",
    )
    .unwrap();
    let c = keep_calib::pack::collect_documents(&[src.clone(), dir.path().join("extra.jsonl")])
        .unwrap();
    assert_eq!(c.skipped.len(), 1);
    assert_eq!(c.documents.len(), 11);
    let o = PackOptions {
        max_tokens: 64,
        held_out_frac: 0.25,
        seed: 3,
    };
    let (m, r) = build_pack(&tok, &c.documents, &o).unwrap();
    assert_eq!(m.groups.len(), 10, "two JSONL lines share group a");
    assert!(r
        .iter()
        .all(|r| r.tokens.len() <= 64 && r.tokens.len() >= 2));
    let eval: Vec<_> = m.groups.iter().filter(|g| g.split == Split::Eval).collect();
    assert!(!eval.is_empty() && eval.len() < m.groups.len());
    let out = dir.path().join("pack");
    write_pack(&out, &m, &r, false).unwrap();
    assert!(
        write_pack(&out, &m, &r, false).is_err(),
        "existing pack refused"
    );
    let p = Pack::open(&out).unwrap();
    assert_eq!(p.records, r);
    assert_eq!(
        p.manifest.tokenizer_sha256,
        keep_calib::fingerprint::file_sha256(&tok).unwrap()
    );
    // Same input, same pack; tampering is detected.
    let (m2, r2) = build_pack(&tok, &c.documents, &o).unwrap();
    assert_eq!((m2, r2), (m, r));
    let rf = out.join("records.jsonl");
    let mut t = std::fs::read(&rf).unwrap();
    t.truncate(t.len() - 10);
    std::fs::write(&rf, t).unwrap();
    assert!(Pack::open(&out).is_err());
    let _ = Document {
        source: String::new(),
        text: String::new(),
    };
}
