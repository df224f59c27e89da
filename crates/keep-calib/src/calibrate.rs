//! `calibrate`: run the model layer-streamed over a pack split, one session per group, and
//! write one session file per group into a run directory.
//!
//! The run directory holds `run.json` ([`RunManifest`]: format `keep-calib-run`, version 1,
//! the model and pack fingerprints, the split, shapes and the full list of the split's
//! sessions) and the session files. A second `calibrate` into the same directory must come
//! from the same model, pack and split (else an error, nothing overwritten); complete sessions
//! are skipped, partial ones (unreadable, cut off, not marked complete) are redone. With
//! `shard = (i, n)` only the groups whose index in the split is ≡ i (mod n) are run, so `n`
//! processes (a Slurm array, a Kubernetes indexed Job) cover one run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_model::engram::{EngramUse, EngramUseReport};
use keep_model::streamed::{forward_streamed, StreamOptions};
use keep_model::Kernels;
use keep_model::{Logits, ModelConfig, RouteObserver};
use serde::{Deserialize, Serialize};

use crate::fingerprint::{file_sha256, model_fingerprint, short};
use crate::pack::{Pack, Split};
use crate::session::{session_path, session_state, write_session, SessionIdentity, SessionState};
use crate::stats::{teacher_of, Collector, SessionStats};
use crate::{CalibError, Result};

/// `format` of `run.json`.
pub const RUN_FORMAT: &str = "keep-calib-run";
/// Tokens of routing kept per layer per session.
pub const ROUTE_TOKENS: usize = 2048;
/// Teacher log-probs kept per position.
pub const TEACHER_TOPK: usize = 64;

/// `run.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunManifest {
    pub format: String,
    pub version: u32,
    pub model_fingerprint: String,
    pub pack_fingerprint: String,
    pub split: Split,
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub hash_layers: Vec<usize>,
    /// Every session (group id) of the split, in pack order.
    pub sessions: Vec<String>,
}

impl RunManifest {
    /// Read `run.json` from a run directory.
    pub fn read(run: &Path) -> Result<RunManifest> {
        let p = run.join("run.json");
        let b = std::fs::read(&p).map_err(|e| CalibError::io(&p, e))?;
        let m: RunManifest = serde_json::from_slice(&b)
            .map_err(|e| CalibError::invalid(&p, format!("not a keep calibration run: {e}")))?;
        if m.format != RUN_FORMAT || m.version != 1 {
            return Err(CalibError::invalid(
                &p,
                format!(
                    "format `{}` version {} is not {RUN_FORMAT} version 1",
                    m.format, m.version
                ),
            ));
        }
        Ok(m)
    }
}

/// Options of [`calibrate`].
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    pub split: Split,
    /// `(index, count)`, index in `0..count`.
    pub shard: (usize, usize),
    /// Records are run through the streamed forward in batches of at most this many tokens
    /// (a single longer record runs alone): each batch streams the layers once.
    pub chunk_tokens: usize,
    pub route_tokens: usize,
    pub teacher_topk: usize,
    /// Drop a finished layer's pages (see keep-model's streamed module).
    pub release_pages: bool,
    /// Which kernels the forward runs on (the teacher log-probs and imatrix come from them).
    pub kernels: Kernels,
    /// On hash-routed layers, run every expert on every token and gather expert-to-expert
    /// output distances (`reap.{L}.dist`, what the `nearest` remap policy ranks by). Costs
    /// `n_experts / top_k` times those layers' routed-expert work.
    pub hash_distances: bool,
}

impl Default for CalibrateOptions {
    fn default() -> Self {
        CalibrateOptions {
            split: Split::Calibration,
            shard: (0, 1),
            chunk_tokens: 8192,
            route_tokens: ROUTE_TOKENS,
            teacher_topk: TEACHER_TOPK,
            release_pages: true,
            kernels: Kernels::Exact,
            hash_distances: true,
        }
    }
}

/// Progress events.
#[derive(Debug, Clone)]
pub enum Progress<'a> {
    /// Sessions of this shard: to run and already complete.
    Start {
        sessions: usize,
        skipped: usize,
        tokens: u64,
        n_layers: usize,
    },
    /// A session starts (index among the ones to run).
    Session {
        index: usize,
        of: usize,
        group: &'a str,
        tokens: u64,
    },
    /// A layer finished for the current batch.
    Layer {
        layer: usize,
        n_layers: usize,
        batch_tokens: u64,
    },
    /// A batch of tokens finished.
    Tokens { done: u64 },
}

/// What [`calibrate`] did.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrateReport {
    pub run: PathBuf,
    pub split: Split,
    pub shard: (usize, usize),
    pub sessions_run: Vec<String>,
    pub sessions_skipped: Vec<String>,
    /// Sessions found partial and redone, with the reason.
    pub sessions_redone: Vec<(String, String)>,
    pub tokens: u64,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub model_fingerprint: String,
    pub pack_fingerprint: String,
    /// Engram table use of the sessions run (rows and bytes per token, distinct rows per
    /// layer); `None` for a model without Engram layers.
    pub engram: Option<EngramUseReport>,
}

/// Check that the pack was tokenized for this model: the model's `tokenizer.json` must hash
/// to the pack's tokenizer fingerprint; a model without one needs an equal vocabulary size.
pub fn check_pack_for_model(pack: &Pack, model_dir: &Path, vocab: usize) -> Result<()> {
    let tp = model_dir.join("tokenizer.json");
    if tp.is_file() {
        let fp = file_sha256(&tp)?;
        if fp != pack.manifest.tokenizer_sha256 {
            return Err(CalibError::Mismatch(format!(
                "the pack {} was tokenized with tokenizer {} but the model {} has tokenizer {}: rebuild the pack with `keep pack --model {}`",
                pack.dir.display(),
                short(&pack.manifest.tokenizer_sha256),
                model_dir.display(),
                short(&fp),
                model_dir.display()
            )));
        }
    }
    if pack.manifest.vocab_size > vocab {
        return Err(CalibError::Mismatch(format!(
            "the pack {} has vocabulary {} but the model {} has {}: rebuild the pack with this model's tokenizer",
            pack.dir.display(),
            pack.manifest.vocab_size,
            model_dir.display(),
            vocab
        )));
    }
    Ok(())
}

/// Groups (indices into the split's list) that shard `(i, n)` runs.
pub fn shard_groups(n_groups: usize, shard: (usize, usize)) -> Result<Vec<usize>> {
    let (i, n) = shard;
    if n == 0 || i >= n {
        return Err(CalibError::Options(format!(
            "--shard {i}/{n} is out of range: give I/N with 0 ≤ I < N"
        )));
    }
    Ok((0..n_groups).filter(|g| g % n == i).collect())
}

fn hash_layers(cfg: &ModelConfig) -> Vec<usize> {
    (0..cfg.raw.num_hash_layers.min(cfg.n_layers)).collect()
}

/// Create `run.json` or check that an existing one matches.
fn ensure_run(out: &Path, want: &RunManifest) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|e| CalibError::io(out, e))?;
    let p = out.join("run.json");
    if p.exists() {
        let have = RunManifest::read(out)?;
        if have.model_fingerprint != want.model_fingerprint {
            return Err(CalibError::Mismatch(format!(
                "{} was calibrated with model {} but this model is {}: use another --out",
                out.display(),
                short(&have.model_fingerprint),
                short(&want.model_fingerprint)
            )));
        }
        if have.pack_fingerprint != want.pack_fingerprint {
            return Err(CalibError::Mismatch(format!(
                "{} was calibrated with pack {} but this pack is {}: use another --out",
                out.display(),
                short(&have.pack_fingerprint),
                short(&want.pack_fingerprint)
            )));
        }
        if have.split != want.split {
            return Err(CalibError::Mismatch(format!(
                "{} holds the {} split, not {}: use another --out",
                out.display(),
                have.split.name(),
                want.split.name()
            )));
        }
        if have != *want {
            return Err(CalibError::Mismatch(format!(
                "{}: run.json disagrees with this model and pack (shapes or sessions): use another --out",
                out.display()
            )));
        }
        return Ok(());
    }
    let text =
        serde_json::to_string_pretty(want).map_err(|e| CalibError::Options(e.to_string()))?;
    crate::st::write_bytes_atomic(&p, text.as_bytes(), false)
}

/// Run calibration (see the module doc).
pub fn calibrate(
    model_dir: &Path,
    pack: &Pack,
    out: &Path,
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(Progress),
) -> Result<CalibrateReport> {
    let ck = Checkpoint::open(model_dir)?;
    let cfg = ModelConfig::from_checkpoint(&ck)?;
    check_pack_for_model(pack, model_dir, cfg.vocab)?;
    let groups = pack.groups(opts.split);
    if groups.is_empty() {
        return Err(CalibError::Options(format!(
            "the pack {} has no {} groups",
            pack.dir.display(),
            opts.split.name()
        )));
    }
    let mine = shard_groups(groups.len(), opts.shard)?;
    let mfp = model_fingerprint(model_dir)?;
    let manifest = RunManifest {
        format: RUN_FORMAT.into(),
        version: 1,
        model_fingerprint: mfp.clone(),
        pack_fingerprint: pack.fingerprint.clone(),
        split: opts.split,
        n_layers: cfg.n_layers,
        n_experts: cfg.n_experts,
        top_k: cfg.top_k,
        hidden: cfg.dim,
        hash_layers: hash_layers(&cfg),
        sessions: groups.iter().map(|g| g.id.clone()).collect(),
    };
    ensure_run(out, &manifest)?;
    crate::st::remove_stale_tmp(out);

    let mut report = CalibrateReport {
        run: out.to_path_buf(),
        split: opts.split,
        shard: opts.shard,
        sessions_run: vec![],
        sessions_skipped: vec![],
        sessions_redone: vec![],
        tokens: 0,
        seconds: 0.0,
        tokens_per_s: 0.0,
        model_fingerprint: mfp.clone(),
        pack_fingerprint: pack.fingerprint.clone(),
        engram: None,
    };
    let mut engram = EngramUse::new(&ck, &cfg)?;
    let mut todo = vec![];
    for &gi in &mine {
        let g = groups[gi];
        let id = SessionIdentity {
            session: g.id.clone(),
            split: opts.split.name().into(),
            model_fingerprint: mfp.clone(),
            pack_fingerprint: pack.fingerprint.clone(),
            hash_layers: manifest.hash_layers.clone(),
        };
        let path = session_path(out, &g.id);
        match session_state(&path, &id)? {
            SessionState::Complete => report.sessions_skipped.push(g.id.clone()),
            SessionState::Partial(why) => {
                report.sessions_redone.push((g.id.clone(), why));
                todo.push((g, id, path));
            }
            SessionState::Missing => todo.push((g, id, path)),
        }
    }
    let total_tokens: u64 = todo.iter().map(|(g, ..)| g.tokens as u64).sum();
    progress(Progress::Start {
        sessions: todo.len(),
        skipped: report.sessions_skipped.len(),
        tokens: total_tokens,
        n_layers: cfg.n_layers,
    });
    let t0 = Instant::now();
    let n_todo = todo.len();
    for (si, (g, id, path)) in todo.into_iter().enumerate() {
        progress(Progress::Session {
            index: si,
            of: n_todo,
            group: &g.id,
            tokens: g.tokens as u64,
        });
        let stats = run_session(&ck, &cfg, pack, &g.id, opts, &mut report.tokens, progress)?;
        if let Some(u) = engram.as_mut() {
            for r in pack.records_of(&g.id) {
                u.add(&r.tokens)?;
            }
        }
        write_session(&path, &id, &stats)?;
        report.sessions_run.push(g.id.clone());
    }
    report.seconds = t0.elapsed().as_secs_f64();
    report.engram = engram.map(|u| u.report());
    report.tokens_per_s = if report.seconds > 0.0 {
        report.tokens as f64 / report.seconds
    } else {
        0.0
    };
    Ok(report)
}

/// Run one group's records and return its statistics.
pub fn run_session(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    pack: &Pack,
    group: &str,
    opts: &CalibrateOptions,
    tokens_done: &mut u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<SessionStats> {
    let records: Vec<_> = pack.records_of(group).collect();
    let stats = SessionStats::new(cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.dim);
    let mut col = Collector::new(stats, opts.route_tokens);
    if opts.hash_distances && opts.split == Split::Calibration {
        col.distance_layers = hash_layers(cfg);
    }
    let mut batches: Vec<Vec<usize>> = vec![];
    let mut size = 0usize;
    for (i, r) in records.iter().enumerate() {
        if batches.is_empty() || (size + r.tokens.len() > opts.chunk_tokens.max(1) && size > 0) {
            batches.push(vec![]);
            size = 0;
        }
        size += r.tokens.len();
        batches.last_mut().expect("pushed").push(i);
    }
    let eval = opts.split == Split::Eval;
    for b in batches {
        let toks: Vec<Vec<u32>> = b.iter().map(|&i| records[i].tokens.clone()).collect();
        let bt: u64 = toks.iter().map(|t| t.len() as u64).sum();
        let n_layers = cfg.n_layers;
        let mut on_layer = |l: usize| {
            progress(Progress::Layer {
                layer: l,
                n_layers,
                batch_tokens: bt,
            })
        };
        let so = StreamOptions {
            logits: if eval { Logits::All } else { Logits::None },
            masks: vec![],
            hash_tables: vec![],
            on_layer: Some(&mut on_layer),
            release_pages: opts.release_pages,
            kernels: opts.kernels,
            prefill_chunk: None,
        };
        let logits = forward_streamed(ck, &toks, so, Some(&mut col as &mut dyn RouteObserver))?;
        if eval {
            for (lg, t) in logits.iter().zip(&toks) {
                col.stats
                    .teacher
                    .push(teacher_of(lg, cfg.vocab, t, opts.teacher_topk));
            }
        }
        for &i in &b {
            col.stats.records.push(records[i].id.clone());
        }
        col.stats.tokens += bt;
        *tokens_done += bt;
        progress(Progress::Tokens { done: *tokens_done });
    }
    Ok(col.stats)
}
