//! Calibration session files: one safetensors file per calibration group
//! (`{RUN}/{group}.safetensors`), written by `keep calibrate`, read by `keep finalize` (the
//! sums), `keep eval` (the teacher), `keep residency` and the runtime's warm start (the routes,
//! through [`crate::routes`]). Written atomically (temporary sibling, sync, rename) so a cut-off
//! file never looks complete.
//!
//! Tensors, data in name order: `imatrix.{L}.{key}` F32 `[cols]` (or `[groups, cols]` for the
//! grouped `attn.wo_a`) with `imatrix.{L}.{key}.count` I64 `[1]` (or `[groups]`);
//! `reap.{L}.{count,sum_g,sum_norm,sum_g_norm,max_f,min_f}` (and `reap.{L}.dist` on
//! hash-routed layers when gathered; [`crate::reap`]); `routes.{L}.experts` I16 `[T, top_k]`
//! and `routes.{L}.weights` F16 `[T, top_k]`; for the eval split `teacher.{i}.topk_ids` I32
//! `[T, K]`, `teacher.{i}.topk_logprobs` F32 `[T, K]`, `teacher.{i}.next_logprob` F32 `[T-1]`
//! (record `i` of the session's `records` list). `__metadata__` (keys in byte order):
//! `format` = `keep-calib-session`, `version` = `1`, `session`, `split`, `n_experts`, `top_k`,
//! `n_layers`, `layers`, `hidden`, `hash_layers`, `model_fingerprint`, `pack_fingerprint`,
//! `records`, `tokens`, `teacher_topk` (eval split), `complete` = `true`.
//!
//! `keep finalize`'s `imatrix.safetensors` (`format` = `keep-imatrix`) holds the same
//! `imatrix.*` tensors summed over the sessions ([`imatrix_tensors`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::tensor_file::Tensor;

use crate::reap::LayerReap;
use crate::st::StFile;
use crate::{ArtifactError, Result};

/// `format` of a session file.
pub const SESSION_FORMAT: &str = "keep-calib-session";
/// Session file version.
pub const SESSION_VERSION: &str = "1";
/// `format` of the summed imatrix `keep finalize` writes.
pub const IMATRIX_FORMAT: &str = "keep-imatrix";

/// Identity of a session, written into its metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionIdentity {
    pub session: String,
    pub split: String,
    pub model_fingerprint: String,
    pub pack_fingerprint: String,
    pub hash_layers: Vec<usize>,
}

/// Σ x² per column for one linear (one row of sums per group), with row counts.
#[derive(Debug, Clone, PartialEq)]
pub struct ImEntry {
    pub cols: usize,
    /// `[groups][cols]`.
    pub sums: Vec<Vec<f64>>,
    /// Rows seen, per group.
    pub counts: Vec<u64>,
}

impl ImEntry {
    /// No rows yet.
    pub fn new(cols: usize) -> ImEntry {
        ImEntry {
            cols,
            sums: vec![],
            counts: vec![],
        }
    }
    fn group(&mut self, g: usize) -> (&mut Vec<f64>, &mut u64) {
        while self.sums.len() <= g {
            self.sums.push(vec![0.0; self.cols]);
            self.counts.push(0);
        }
        (&mut self.sums[g], &mut self.counts[g])
    }
    /// Add `rows` rows of `x` (`[rows × cols]`) to group `g`.
    pub fn add_rows(&mut self, g: usize, x: &[f32], rows: usize) {
        let cols = self.cols;
        let (s, c) = self.group(g);
        for r in 0..rows {
            for (a, &v) in s.iter_mut().zip(&x[r * cols..(r + 1) * cols]) {
                let v = v as f64;
                *a += v * v;
            }
        }
        *c += rows as u64;
    }
    /// Add another entry's sums and counts (shapes must agree; checked by the caller).
    pub fn add(&mut self, o: &ImEntry) {
        for (g, (s, &c)) in o.sums.iter().zip(&o.counts).enumerate() {
            let (d, dc) = self.group(g);
            for (a, b) in d.iter_mut().zip(s) {
                *a += b;
            }
            *dc += c;
        }
    }
}

/// The first tokens of one layer's routing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerRoutes {
    pub experts: Vec<i16>,
    pub weights: Vec<half::f16>,
    pub tokens: usize,
}

/// Teacher outputs for one record.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherRecord {
    pub tokens: usize,
    pub k: usize,
    /// `[tokens × k]`, most likely first (ties by lower id).
    pub topk_ids: Vec<i32>,
    /// `[tokens × k]` natural-log probabilities.
    pub topk_logprobs: Vec<f32>,
    /// `[tokens - 1]`: log-prob of the true next token at each position.
    pub next_logprob: Vec<f32>,
}

/// Everything one session gathers.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionStats {
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// `(layer, key)` → entry; keys as linears are named in the checkpoint (`attn.wq_a`,
    /// `ffn.experts.3.w1`, …).
    pub imatrix: BTreeMap<(usize, String), ImEntry>,
    pub reap: Vec<LayerReap>,
    pub routes: Vec<LayerRoutes>,
    pub teacher: Vec<TeacherRecord>,
    /// Record ids in order.
    pub records: Vec<String>,
    pub tokens: u64,
}

impl SessionStats {
    /// Nothing gathered yet.
    pub fn new(n_layers: usize, n_experts: usize, top_k: usize, hidden: usize) -> SessionStats {
        SessionStats {
            n_layers,
            n_experts,
            top_k,
            hidden,
            imatrix: BTreeMap::new(),
            reap: (0..n_layers)
                .map(|_| LayerReap::new(n_experts, hidden))
                .collect(),
            routes: vec![LayerRoutes::default(); n_layers],
            teacher: vec![],
            records: vec![],
            tokens: 0,
        }
    }
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

/// The `imatrix.{L}.{key}` tensors (and their `.count`s) of `imatrix`.
pub fn imatrix_tensors(imatrix: &BTreeMap<(usize, String), ImEntry>) -> Vec<Tensor> {
    let mut out = vec![];
    for ((l, key), e) in imatrix {
        let name = format!("imatrix.{l}.{key}");
        let flat: Vec<f32> = e.sums.iter().flatten().map(|&v| v as f32).collect();
        let counts: Vec<i64> = e.counts.iter().map(|&c| c as i64).collect();
        // The grouped attn.wo_a is 2-D; everything else is one row.
        let grouped = key == "attn.wo_a";
        let shape = if grouped {
            vec![e.sums.len(), e.cols]
        } else {
            vec![e.cols]
        };
        out.push(Tensor::f32(name.clone(), &shape, &flat));
        out.push(Tensor::i64(
            format!("{name}.count"),
            &[counts.len()],
            &counts,
        ));
    }
    out
}

/// The tensors of a session file.
fn session_tensors(s: &SessionStats) -> Vec<Tensor> {
    let mut tensors = imatrix_tensors(&s.imatrix);
    tensors.extend(crate::reap::layer_tensors(&s.reap, false));
    for (l, r) in s.routes.iter().enumerate() {
        tensors.push(Tensor::i16(
            format!("routes.{l}.experts"),
            &[r.tokens, s.top_k],
            &r.experts,
        ));
        tensors.push(Tensor::f16(
            format!("routes.{l}.weights"),
            &[r.tokens, s.top_k],
            &r.weights,
        ));
    }
    for (i, t) in s.teacher.iter().enumerate() {
        tensors.push(Tensor::i32(
            format!("teacher.{i}.topk_ids"),
            &[t.tokens, t.k],
            &t.topk_ids,
        ));
        tensors.push(Tensor::f32(
            format!("teacher.{i}.topk_logprobs"),
            &[t.tokens, t.k],
            &t.topk_logprobs,
        ));
        tensors.push(Tensor::f32(
            format!("teacher.{i}.next_logprob"),
            &[t.next_logprob.len()],
            &t.next_logprob,
        ));
    }
    tensors
}

/// Write a session file atomically; an existing file at `path` (a session calibration redoes)
/// is replaced.
pub fn write_session(path: &Path, id: &SessionIdentity, s: &SessionStats) -> Result<()> {
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
    if let Some(t) = s.teacher.first() {
        m.insert("teacher_topk".into(), t.k.to_string());
    }
    m.insert("complete".into(), "true".into());
    crate::st::write(path, session_tensors(s), &m, true)
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

/// The first 12 characters of a fingerprint, as messages show it.
fn short(fp: &str) -> &str {
    fp.get(..12).unwrap_or(fp)
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
        return Err(ArtifactError::invalid(
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
            return Err(ArtifactError::Mismatch(format!(
                "{}: {k} {} differs from this run's {}: it belongs to another model or pack; use another --out",
                path.display(),
                short(got),
                short(want)
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
            return Err(ArtifactError::invalid(
                &path,
                format!("tensor `{}`: no layer", t.name),
            ));
        };
        let l: usize = l.parse().map_err(|_| {
            ArtifactError::invalid(&path, format!("tensor `{}`: bad layer", t.name))
        })?;
        let shape = f.shape(&t.name)?;
        let (groups, cols) = match shape.as_slice() {
            [c] => (1, *c),
            [g, c] => (*g, *c),
            _ => {
                return Err(ArtifactError::invalid(
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
            return Err(ArtifactError::invalid(
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
    let reap = (0..n_layers)
        .map(|l| crate::reap::read_layer(f, l, n_experts, hidden))
        .collect::<Result<Vec<_>>>()?;
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

/// The record ids of a session file (its `records` metadata), in order.
pub fn read_records(f: &StFile) -> Result<Vec<String>> {
    Ok(f.meta("records")?
        .split(',')
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect())
}

/// Teacher record `i` of a session file (`teacher.{i}.*`), its shapes checked against each
/// other.
pub fn read_teacher(f: &StFile, i: usize) -> Result<TeacherRecord> {
    let ids = format!("teacher.{i}.topk_ids");
    let shape = f.shape(&ids)?;
    let [tokens, k] = shape[..] else {
        return Err(ArtifactError::tensor(
            f.path(),
            &ids,
            format!("shape {shape:?} is not [tokens, k]"),
        ));
    };
    let topk_ids = f.i32s(&ids)?;
    let topk_logprobs = f.f32s(&format!("teacher.{i}.topk_logprobs"))?;
    let next_logprob = f.f32s(&format!("teacher.{i}.next_logprob"))?;
    if topk_logprobs.len() != topk_ids.len() || next_logprob.len() + 1 != tokens.max(1) {
        return Err(ArtifactError::tensor(
            f.path(),
            &ids,
            format!(
                "teacher.{i}: {} log-probs and {} next-token log-probs for {tokens} tokens × {k}",
                topk_logprobs.len(),
                next_logprob.len()
            ),
        ));
    }
    Ok(TeacherRecord {
        tokens,
        k,
        topk_ids,
        topk_logprobs,
        next_logprob,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (SessionIdentity, SessionStats) {
        let (nl, ne, k, hidden) = (3, 4, 2, 2);
        let mut s = SessionStats::new(nl, ne, k, hidden);
        let mut e = ImEntry::new(3);
        e.add_rows(0, &[1.0, 2.0, 3.0, -1.0, 0.5, 0.0], 2);
        s.imatrix.insert((0, "attn.wq_a".into()), e.clone());
        let mut g = ImEntry::new(3);
        g.add_rows(1, &[1.0, 1.0, 2.0], 1);
        s.imatrix.insert((2, "attn.wo_a".into()), g);
        s.imatrix.insert((1, "ffn.experts.3.w1".into()), e);
        s.reap[1].add_outputs(3, &[0.25], &[1.0, -2.0]);
        s.reap[2].add_candidate(0, 1, &[1], &[0.5, 0.5], &[1.0, 0.0]);
        s.routes[0] = LayerRoutes {
            experts: vec![0, 3, 1, 2],
            weights: [0.5f32, 0.5, 0.75, 0.25].map(half::f16::from_f32).to_vec(),
            tokens: 2,
        };
        s.teacher.push(TeacherRecord {
            tokens: 2,
            k: 2,
            topk_ids: vec![5, 1, 0, 2],
            topk_logprobs: vec![-0.1, -2.0, -0.3, -1.5],
            next_logprob: vec![-0.7],
        });
        s.records = vec!["r7".into()];
        s.tokens = 2;
        let id = SessionIdentity {
            session: "g0".into(),
            split: "eval".into(),
            model_fingerprint: "m".repeat(64),
            pack_fingerprint: "p".repeat(64),
            hash_layers: vec![2],
        };
        (id, s)
    }

    #[test]
    fn round_trip_of_a_session() {
        let d = tempfile::tempdir().unwrap();
        let (id, s) = sample();
        let p = session_path(d.path(), "g0");
        assert!(matches!(
            session_state(&p, &id).unwrap(),
            SessionState::Missing
        ));
        write_session(&p, &id, &s).unwrap();
        assert!(matches!(
            session_state(&p, &id).unwrap(),
            SessionState::Complete
        ));
        let f = StFile::open(&p).unwrap();
        assert_eq!(f.meta("format").unwrap(), SESSION_FORMAT);
        assert_eq!(f.meta("version").unwrap(), SESSION_VERSION);
        assert_eq!(f.meta("teacher_topk").unwrap(), "2");
        assert_eq!(f.meta("hash_layers").unwrap(), "2");
        let sums = read_sums(&f, 3, 4, 2).unwrap();
        assert_eq!(sums.session, "g0");
        assert_eq!(sums.tokens, 2);
        // Sums are stored as f32; these values are exact in f32.
        assert_eq!(sums.imatrix, s.imatrix);
        for (l, r) in sums.reap.iter().enumerate() {
            let mut want = s.reap[l].clone();
            let (mx, mn) = want.extremes_for_write();
            (want.max_f, want.min_f) = (mx, mn);
            assert_eq!(r.as_ref().unwrap(), &want, "layer {l}");
        }
        assert_eq!(read_records(&f).unwrap(), s.records);
        assert_eq!(read_teacher(&f, 0).unwrap(), s.teacher[0]);
        assert!(read_teacher(&f, 1).is_err());
        // The routes are a route trace too.
        let r = crate::routes::read_session(&p).unwrap();
        assert_eq!(r.layers[0].experts, vec![0u16, 3, 1, 2]);
        // Data in name order.
        let mut names: Vec<_> = f
            .tensors()
            .iter()
            .map(|t| (t.start, t.name.clone()))
            .collect();
        names.sort();
        assert!(names.windows(2).all(|w| w[0].1 < w[1].1), "{names:?}");
        // Another model's session is refused, not overwritten.
        let other = SessionIdentity {
            model_fingerprint: "x".repeat(64),
            ..id.clone()
        };
        let e = session_state(&p, &other).unwrap_err().to_string();
        assert!(e.contains("another model"), "{e}");
    }
}
