//! Session files: one safetensors file per calibration group (`{RUN}/{group}.safetensors`),
//! written atomically (temporary sibling, sync, rename) so a cut-off file never looks complete.
//!
//! Tensors (see the crate doc for the full list): `imatrix.{L}.{key}` F32 `[cols]` (or
//! `[groups, cols]`) with `imatrix.{L}.{key}.count` I64 `[1]` (or `[groups]`);
//! `reap.{L}.{count,sum_g,sum_norm,sum_g_norm,max_f,min_f}` (and `reap.{L}.dist` on hash-routed
//! layers when gathered); `routes.{L}.experts` I16
//! `[T, top_k]` and `routes.{L}.weights` F16 `[T, top_k]`; for the eval split
//! `teacher.{i}.topk_ids` I32 `[T, K]`, `teacher.{i}.topk_logprobs` F32 `[T, K]`,
//! `teacher.{i}.next_logprob` F32 `[T-1]` (record `i` of the session's `records` list).
//! `__metadata__`: `format` = `keep-calib-session`, `version` = `1`, `session`, `split`,
//! `n_experts`, `top_k`, `n_layers`, `layers`, `hidden`, `hash_layers`, `model_fingerprint`,
//! `pack_fingerprint`, `records`, `tokens`, `complete` = `true`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::st::{write_atomic, StFile, Tensor};
use crate::stats::{ImEntry, LayerReap, SessionStats};
use crate::{CalibError, Result};

/// `format` of a session file.
pub const SESSION_FORMAT: &str = "keep-calib-session";
/// Session file version.
pub const SESSION_VERSION: &str = "1";

/// Identity of a session, written into its metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionIdentity {
    pub session: String,
    pub split: String,
    pub model_fingerprint: String,
    pub pack_fingerprint: String,
    pub hash_layers: Vec<usize>,
}

/// The file of a session in a run directory.
pub fn session_path(run: &Path, group: &str) -> PathBuf {
    run.join(format!("{group}.safetensors"))
}

fn comma(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn imatrix_tensors(prefix: &str, imatrix: &BTreeMap<(usize, String), ImEntry>) -> Vec<Tensor> {
    let mut out = vec![];
    for ((l, key), e) in imatrix {
        let name = format!("{prefix}.{l}.{key}");
        let flat: Vec<f32> = e.sums.iter().flatten().map(|&v| v as f32).collect();
        let counts: Vec<i64> = e.counts.iter().map(|&c| c as i64).collect();
        // The grouped attn.wo_a is 2-D; everything else is one row.
        let grouped = key == "attn.wo_a";
        let shape = if grouped {
            vec![e.sums.len(), e.cols]
        } else {
            vec![e.cols]
        };
        out.push(Tensor::f32(name.clone(), shape, &flat));
        out.push(Tensor::i64(
            format!("{name}.count"),
            vec![counts.len()],
            &counts,
        ));
    }
    out
}

/// The `reap.{L}.*` tensors of `reap`.
pub fn reap_tensors(reap: &[LayerReap], with_score: bool) -> Vec<Tensor> {
    let mut out = vec![];
    for (l, r) in reap.iter().enumerate() {
        let e = r.n_experts;
        let counts: Vec<i64> = r.count.iter().map(|&c| c as i64).collect();
        out.push(Tensor::i64(format!("reap.{l}.count"), vec![e], &counts));
        out.push(Tensor::f64(format!("reap.{l}.sum_g"), vec![e], &r.sum_g));
        out.push(Tensor::f64(
            format!("reap.{l}.sum_norm"),
            vec![e],
            &r.sum_norm,
        ));
        out.push(Tensor::f64(
            format!("reap.{l}.sum_g_norm"),
            vec![e],
            &r.sum_g_norm,
        ));
        let (mx, mn) = r.extremes_for_write();
        out.push(Tensor::f32(
            format!("reap.{l}.max_f"),
            vec![e, r.hidden],
            &mx,
        ));
        out.push(Tensor::f32(
            format!("reap.{l}.min_f"),
            vec![e, r.hidden],
            &mn,
        ));
        if !r.dist.is_empty() {
            out.push(Tensor::f64(format!("reap.{l}.dist"), vec![e, e], &r.dist));
        }
        if with_score {
            out.push(Tensor::f64(format!("reap.{l}.score"), vec![e], &r.score()));
        }
    }
    out
}

/// The imatrix tensors under a prefix (`imatrix`).
pub fn imatrix_tensors_of(imatrix: &BTreeMap<(usize, String), ImEntry>) -> Vec<Tensor> {
    imatrix_tensors("imatrix", imatrix)
}

/// Write a session file atomically.
pub fn write_session(path: &Path, id: &SessionIdentity, s: &SessionStats) -> Result<()> {
    let mut tensors = imatrix_tensors("imatrix", &s.imatrix);
    tensors.extend(reap_tensors(&s.reap, false));
    for (l, r) in s.routes.iter().enumerate() {
        tensors.push(Tensor::i16(
            format!("routes.{l}.experts"),
            vec![r.tokens, s.top_k],
            &r.experts,
        ));
        tensors.push(Tensor::f16(
            format!("routes.{l}.weights"),
            vec![r.tokens, s.top_k],
            &r.weights,
        ));
    }
    for (i, t) in s.teacher.iter().enumerate() {
        tensors.push(Tensor::i32(
            format!("teacher.{i}.topk_ids"),
            vec![t.tokens, t.k],
            &t.topk_ids,
        ));
        tensors.push(Tensor::f32(
            format!("teacher.{i}.topk_logprobs"),
            vec![t.tokens, t.k],
            &t.topk_logprobs,
        ));
        tensors.push(Tensor::f32(
            format!("teacher.{i}.next_logprob"),
            vec![t.next_logprob.len()],
            &t.next_logprob,
        ));
    }
    let layers: Vec<usize> = (0..s.n_layers).collect();
    let mut m = BTreeMap::new();
    m.insert("format".into(), SESSION_FORMAT.into());
    m.insert("version".into(), SESSION_VERSION.into());
    m.insert("session".into(), id.session.clone());
    m.insert("split".into(), id.split.clone());
    m.insert("n_experts".into(), s.n_experts.to_string());
    m.insert("top_k".into(), s.top_k.to_string());
    m.insert("n_layers".into(), s.n_layers.to_string());
    m.insert("layers".into(), comma(&layers));
    m.insert("hidden".into(), s.hidden.to_string());
    m.insert("hash_layers".into(), comma(&id.hash_layers));
    m.insert("model_fingerprint".into(), id.model_fingerprint.clone());
    m.insert("pack_fingerprint".into(), id.pack_fingerprint.clone());
    m.insert("records".into(), s.records.join(","));
    m.insert("tokens".into(), s.tokens.to_string());
    if !s.teacher.is_empty() {
        m.insert(
            "teacher_topk".into(),
            s.teacher.first().map(|t| t.k).unwrap_or(0).to_string(),
        );
    }
    m.insert("complete".into(), "true".into());
    // A session file in the run directory is replaced only when calibration redoes it.
    write_atomic(path, &tensors, &m, true)
}

/// What is at a session's path.
#[derive(Debug)]
pub enum SessionState {
    Missing,
    /// Complete and made from the same model and pack.
    Complete,
    /// Present but unreadable, cut off or not marked complete: to be redone.
    Partial(String),
}

/// Inspect a session file: complete (same fingerprints), partial (redo), or an error when it
/// is a complete session of another model or pack (never overwritten).
pub fn session_state(path: &Path, id: &SessionIdentity) -> Result<SessionState> {
    if !path.exists() {
        return Ok(SessionState::Missing);
    }
    let f = match StFile::open(path) {
        Ok(f) => f,
        Err(e) => return Ok(SessionState::Partial(e.to_string())),
    };
    let m = f.metadata();
    if m.get("format").map(String::as_str) != Some(SESSION_FORMAT) {
        return Err(CalibError::invalid(
            path,
            "is not a keep calibration session (format); move it out of the run directory",
        ));
    }
    if m.get("complete").map(String::as_str) != Some("true") {
        return Ok(SessionState::Partial("not marked complete".into()));
    }
    for (k, want) in [
        ("model_fingerprint", &id.model_fingerprint),
        ("pack_fingerprint", &id.pack_fingerprint),
    ] {
        let got = m.get(k).map(String::as_str).unwrap_or("");
        if got != want {
            return Err(CalibError::Mismatch(format!(
                "{}: {k} {} differs from this run's {}: it belongs to another model or pack; use another --out",
                path.display(),
                crate::fingerprint::short(got),
                crate::fingerprint::short(want)
            )));
        }
    }
    Ok(SessionState::Complete)
}

/// The imatrix and REAP arrays of a session file, for finalize.
#[derive(Debug)]
pub struct SessionSums {
    pub session: String,
    pub tokens: u64,
    pub imatrix: BTreeMap<(usize, String), ImEntry>,
    /// `None` for a layer without REAP arrays.
    pub reap: Vec<Option<LayerReap>>,
}

/// Read the imatrix and REAP arrays of a session file (shapes checked).
pub fn read_sums(
    f: &StFile,
    n_layers: usize,
    n_experts: usize,
    hidden: usize,
) -> Result<SessionSums> {
    let path = f.path().to_path_buf();
    let mut imatrix = BTreeMap::new();
    for t in f.tensors() {
        let Some(rest) = t.name.strip_prefix("imatrix.") else {
            continue;
        };
        if rest.ends_with(".count") {
            continue;
        }
        let Some((l, key)) = rest.split_once('.') else {
            return Err(CalibError::invalid(
                &path,
                format!("tensor `{}`: no layer", t.name),
            ));
        };
        let l: usize = l
            .parse()
            .map_err(|_| CalibError::invalid(&path, format!("tensor `{}`: bad layer", t.name)))?;
        let shape = f.shape(&t.name)?;
        let (groups, cols) = match shape.as_slice() {
            [c] => (1, *c),
            [g, c] => (*g, *c),
            _ => {
                return Err(CalibError::invalid(
                    &path,
                    format!(
                        "tensor `{}`: shape {shape:?} is not [cols] or [groups, cols]",
                        t.name
                    ),
                ))
            }
        };
        let v = f.f64s(&t.name)?;
        let cn = format!("{}.count", t.name);
        let c = f.i64s(&cn)?;
        if c.len() != groups || c.iter().any(|&x| x < 0) {
            return Err(CalibError::invalid(
                &path,
                format!(
                    "tensor `{cn}`: {} counts for {groups} groups (or a negative count)",
                    c.len()
                ),
            ));
        }
        imatrix.insert(
            (l, key.to_string()),
            ImEntry {
                cols,
                sums: v.chunks(cols.max(1)).map(|c| c.to_vec()).collect(),
                counts: c.iter().map(|&x| x as u64).collect(),
            },
        );
    }
    let mut reap = Vec::with_capacity(n_layers);
    for l in 0..n_layers {
        let names = ["count", "sum_g", "sum_norm", "sum_g_norm", "max_f", "min_f"]
            .map(|s| format!("reap.{l}.{s}"));
        if names.iter().any(|n| !f.has(n)) {
            reap.push(None);
            continue;
        }
        let mut r = LayerReap::new(n_experts, hidden);
        let count = f.i64s(&names[0])?;
        r.sum_g = f.f64s(&names[1])?;
        r.sum_norm = f.f64s(&names[2])?;
        r.sum_g_norm = f.f64s(&names[3])?;
        r.max_f = f.f32s(&names[4])?;
        r.min_f = f.f32s(&names[5])?;
        if count.len() != n_experts
            || r.sum_g.len() != n_experts
            || r.sum_norm.len() != n_experts
            || r.sum_g_norm.len() != n_experts
            || r.max_f.len() != n_experts * hidden
            || r.min_f.len() != n_experts * hidden
            || count.iter().any(|&c| c < 0)
        {
            return Err(CalibError::invalid(
                &path,
                format!(
                    "reap.{l}.*: shapes do not match n_experts = {n_experts}, hidden = {hidden}"
                ),
            ));
        }
        r.count = count.iter().map(|&c| c as u64).collect();
        let dn = format!("reap.{l}.dist");
        if f.has(&dn) {
            r.dist = f.f64s(&dn)?;
            if r.dist.len() != n_experts * n_experts {
                return Err(CalibError::invalid(
                    &path,
                    format!("{dn}: {} entries, expected {n_experts}²", r.dist.len()),
                ));
            }
        }
        reap.push(Some(r));
    }
    Ok(SessionSums {
        session: f.metadata().get("session").cloned().unwrap_or_default(),
        tokens: f
            .metadata()
            .get("tokens")
            .and_then(|t| t.parse().ok())
            .unwrap_or(0),
        imatrix,
        reap,
    })
}
