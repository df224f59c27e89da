//! `finalize`: sum a run's session files into `imatrix.safetensors` and
//! `reap-stats.safetensors`.
//!
//! Refuses (naming the sessions) when sessions of the run are missing or cut off, come from
//! another model or pack, lack REAP arrays for a layer, or have REAP route counts that differ
//! from their imatrix counts (`ffn.experts.{e}.w1` rows) — a silent under-score is never
//! written. Sums are taken in session-name order (f64), so the result does not depend on the
//! order the directory lists them.
//!
//! Outputs (both with `format`/`version` metadata, written atomically; existing ones are
//! replaced, since they are a pure function of the sessions):
//! - `imatrix.safetensors` (`format` = `keep-imatrix`): `imatrix.{L}.{key}` F32 `[cols]` (or
//!   `[groups, cols]` for `attn.wo_a`) and `imatrix.{L}.{key}.count` I64; every routed expert of
//!   every layer is present (zeros and count 0 for never-routed experts);
//! - `reap-stats.safetensors` (`format` = `keep-reap-stats`): `reap.{L}.score` F64 `[E]` =
//!   Σ g·‖f‖ / count (0 when never routed), `reap.{L}.count` I64, `reap.{L}.sum_g`,
//!   `reap.{L}.sum_norm`, `reap.{L}.sum_g_norm` F64 `[E]`, `reap.{L}.max_f`, `reap.{L}.min_f`
//!   F32 `[E, hidden]`, and on hash-routed layers `reap.{L}.dist` F64 `[E, E]` (summed output
//!   distances, see [`crate::stats::LayerReap::dist`]) when the sessions gathered them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::calibrate::RunManifest;
use crate::session::{imatrix_tensors_of, read_sums, session_path, IMATRIX_FORMAT, SESSION_FORMAT};
use crate::st::{write_atomic, StFile};
use crate::stats::{ImEntry, LayerReap};
use crate::{CalibError, Result};
pub use keep_artifacts::reap::ReapStats;

/// The imatrix output file name.
pub const IMATRIX_FILE: &str = "imatrix.safetensors";
/// The REAP output file name (keep-artifacts' `reap::FILE`).
pub const REAP_FILE: &str = keep_artifacts::reap::FILE;

/// What [`finalize`] wrote.
#[derive(Debug, Clone, Serialize)]
pub struct FinalizeReport {
    pub run: PathBuf,
    pub sessions: usize,
    pub tokens: u64,
    pub imatrix: PathBuf,
    pub reap: PathBuf,
    pub linears: usize,
}

fn comma(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Sum the sessions of `run` (see the module doc).
pub fn finalize(run: &Path) -> Result<FinalizeReport> {
    let m = RunManifest::read(run)?;
    let (ne, hidden, nl) = (m.n_experts, m.hidden, m.n_layers);
    let mut missing = vec![];
    let mut broken = vec![];
    let mut files = vec![];
    for s in &m.sessions {
        let p = session_path(run, s);
        if !p.exists() {
            missing.push(s.clone());
            continue;
        }
        match StFile::open(&p) {
            Ok(f) => {
                let md = f.metadata();
                let ok = md.get("format").map(String::as_str) == Some(SESSION_FORMAT)
                    && md.get("complete").map(String::as_str) == Some("true");
                if !ok {
                    broken.push(format!("{s} (not a complete session)"));
                } else if md.get("model_fingerprint") != Some(&m.model_fingerprint)
                    || md.get("pack_fingerprint") != Some(&m.pack_fingerprint)
                {
                    broken.push(format!("{s} (another model or pack)"));
                } else {
                    files.push(f);
                }
            }
            Err(e) => broken.push(format!("{s} ({e})")),
        }
    }
    if !missing.is_empty() || !broken.is_empty() {
        let mut msg = format!("{}: cannot finalize", run.display());
        if !missing.is_empty() {
            msg += &format!(
                "; {} sessions are missing: {} (run `keep calibrate` again with the same --out)",
                missing.len(),
                missing.join(", ")
            );
        }
        if !broken.is_empty() {
            msg += &format!(
                "; unusable sessions: {} (delete them and run `keep calibrate` again)",
                broken.join(", ")
            );
        }
        return Err(CalibError::Sessions(msg));
    }
    let mut no_reap = vec![];
    let mut count_diff = vec![];
    let mut imatrix: BTreeMap<(usize, String), ImEntry> = BTreeMap::new();
    let mut reap: Vec<LayerReap> = (0..nl).map(|_| LayerReap::new(ne, hidden)).collect();
    let mut tokens = 0;
    // Sessions carrying hash-layer output distances, per layer: all or none of them must.
    let mut with_dist = vec![0usize; nl];
    let mut summed = 0usize;
    for f in &files {
        let s = read_sums(f, nl, ne, hidden)?;
        let name = s.session.clone();
        let layers_without: Vec<usize> = (0..nl).filter(|&l| s.reap[l].is_none()).collect();
        if !layers_without.is_empty() {
            no_reap.push(format!("{name} (layers {})", comma(&layers_without)));
            continue;
        }
        let mut diffs = vec![];
        for l in 0..nl {
            let r = s.reap[l].as_ref().expect("checked above");
            for e in 0..ne {
                let ic = s
                    .imatrix
                    .get(&(l, format!("ffn.experts.{e}.w1")))
                    .map(|x| x.counts.iter().sum::<u64>())
                    .unwrap_or(0);
                if ic != r.count[e] {
                    diffs.push(format!(
                        "layer {l} expert {e}: REAP {} vs imatrix {ic}",
                        r.count[e]
                    ));
                }
            }
        }
        if !diffs.is_empty() {
            let n = diffs.len();
            diffs.truncate(3);
            count_diff.push(format!("{name} ({n} experts, e.g. {})", diffs.join("; ")));
            continue;
        }
        for (k, e) in &s.imatrix {
            match imatrix.get_mut(k) {
                Some(d) => {
                    if d.cols != e.cols {
                        return Err(CalibError::Sessions(format!(
                            "session {name}: imatrix.{}.{} has {} columns, other sessions {}",
                            k.0, k.1, e.cols, d.cols
                        )));
                    }
                    d.add(e);
                }
                None => {
                    imatrix.insert(k.clone(), e.clone());
                }
            }
        }
        for (l, r) in s.reap.iter().enumerate() {
            if let Some(r) = r {
                with_dist[l] += usize::from(!r.dist.is_empty());
                reap[l].add(r);
            }
        }
        summed += 1;
        tokens += s.tokens;
    }
    if no_reap.is_empty() && count_diff.is_empty() {
        if let Some(l) = (0..nl).find(|&l| with_dist[l] != 0 && with_dist[l] != summed) {
            return Err(CalibError::Sessions(format!(
                "layer {l}: {} of {summed} sessions carry hash-layer output distances \
                 (reap.{l}.dist); calibrate every session the same way",
                with_dist[l]
            )));
        }
    }
    if !no_reap.is_empty() || !count_diff.is_empty() {
        let mut msg = format!(
            "{}: refusing to finalize (scores would be wrong)",
            run.display()
        );
        if !no_reap.is_empty() {
            msg += &format!("; sessions without REAP arrays: {}", no_reap.join(", "));
        }
        if !count_diff.is_empty() {
            msg += &format!(
                "; sessions whose REAP route counts differ from their imatrix counts: {}",
                count_diff.join(", ")
            );
        }
        msg += "; delete those session files and run `keep calibrate` again";
        return Err(CalibError::Sessions(msg));
    }
    // Every routed expert present, zeros where never routed.
    for l in 0..nl {
        for w in ["w1", "w2", "w3"] {
            let cols = (0..ne).find_map(|e| {
                imatrix
                    .get(&(l, format!("ffn.experts.{e}.{w}")))
                    .map(|x| x.cols)
            });
            if let Some(cols) = cols {
                for e in 0..ne {
                    imatrix
                        .entry((l, format!("ffn.experts.{e}.{w}")))
                        .or_insert_with(|| ImEntry {
                            cols,
                            sums: vec![vec![0.0; cols]],
                            counts: vec![0],
                        });
                }
            }
        }
    }
    let stats = ReapStats {
        n_layers: nl,
        n_experts: ne,
        top_k: m.top_k,
        hidden,
        hash_layers: m.hash_layers.clone(),
        model_fingerprint: m.model_fingerprint.clone(),
        pack_fingerprint: m.pack_fingerprint.clone(),
        split: m.split.name().into(),
        sessions: files.len(),
        tokens,
        scores: reap.iter().map(LayerReap::score).collect(),
        layers: reap,
    };
    // The imatrix file carries the same description of the run, under its own format.
    let mut im_meta = stats.metadata();
    im_meta.insert("format".into(), IMATRIX_FORMAT.into());
    let ip = run.join(IMATRIX_FILE);
    // The run directory's own statistics: a rerun of finalize replaces them.
    write_atomic(&ip, imatrix_tensors_of(&imatrix), &im_meta, true)?;
    let rp = run.join(REAP_FILE);
    stats.write(&rp, true)?;
    Ok(FinalizeReport {
        run: run.to_path_buf(),
        sessions: files.len(),
        tokens,
        imatrix: ip,
        reap: rp,
        linears: imatrix.len(),
    })
}

/// Read `reap-stats.safetensors` (a run directory or the file itself): keep-artifacts'
/// [`ReapStats::read`].
pub fn read_reap_stats(path: &Path) -> Result<ReapStats> {
    Ok(ReapStats::read(path)?)
}
