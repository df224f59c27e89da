//! REAP statistics: per MoE layer and routed expert, the sums REAP's saliency is made of, and
//! the saliency itself. Session files of a calibration run carry the sums per group
//! (`reap.{L}.*` without `score`); `keep finalize` sums them into `reap-stats.safetensors`,
//! which `keep select`, `keep eval`'s plans, `keep residency --warm-start reap` and
//! `keep run --warm-start` read.
//!
//! `reap-stats.safetensors`, `format` = `keep-reap-stats`, `version` = `1`; `__metadata__` also
//! holds `n_layers`, `n_experts`, `top_k`, `hidden`, `hash_layers` (comma list),
//! `model_fingerprint`, `pack_fingerprint`, `split`, `sessions`, `tokens`. Tensors per layer L
//! (every layer `0..n_layers`), data in name order:
//!
//! | name | dtype, shape | what |
//! |---|---|---|
//! | `reap.{L}.score` | F64 `[E]` | Σ g·‖f‖₂ / count (0 for never-routed experts) |
//! | `reap.{L}.count` | I64 `[E]` | routes to each expert |
//! | `reap.{L}.sum_g`, `sum_norm`, `sum_g_norm` | F64 `[E]` | Σ g, Σ ‖f‖₂, Σ g·‖f‖₂ |
//! | `reap.{L}.max_f`, `min_f` | F32 `[E, hidden]` | per output channel extremes of f (0 if never routed) |
//! | `reap.{L}.dist` | F64 `[E, E]` | hash-routed layers, when gathered: [`LayerReap::dist`] |
//!
//! Two readers share the checks: [`ReapStats::read`] reads everything (selection needs the
//! extremes), [`ReapScores::read`] only the `score` tensors (a warm start of a large model need
//! not copy `[E, hidden]` arrays it does not use).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::tensor_file::Tensor;
use keep_checkpoint::Dtype;

use crate::st::StFile;
use crate::{ArtifactError, Result};

/// `format` of the finalized statistics.
pub const FORMAT: &str = "keep-reap-stats";
/// `version` of the finalized statistics.
pub const VERSION: &str = "1";
/// The file name `keep finalize` writes in a run directory.
pub const FILE: &str = "reap-stats.safetensors";

/// REAP sums of one MoE layer (accumulated by calibration, summed by finalize).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReap {
    pub n_experts: usize,
    pub hidden: usize,
    pub count: Vec<u64>,
    pub sum_g: Vec<f64>,
    pub sum_norm: Vec<f64>,
    pub sum_g_norm: Vec<f64>,
    /// `[n_experts × hidden]`; meaningful where `count > 0` (written as 0 elsewhere).
    pub max_f: Vec<f32>,
    pub min_f: Vec<f32>,
    /// Hash-routed layers: `[n_experts × n_experts]`, entry `(r, j)` = Σ over the routes to
    /// expert `r` of ‖f_r(x) − f_j(x)‖² (f64); empty when not gathered.
    pub dist: Vec<f64>,
}

impl LayerReap {
    /// Empty sums (extremes at ∓∞ until an expert is seen).
    pub fn new(n_experts: usize, hidden: usize) -> LayerReap {
        LayerReap {
            n_experts,
            hidden,
            count: vec![0; n_experts],
            sum_g: vec![0.0; n_experts],
            sum_norm: vec![0.0; n_experts],
            sum_g_norm: vec![0.0; n_experts],
            max_f: vec![f32::NEG_INFINITY; n_experts * hidden],
            min_f: vec![f32::INFINITY; n_experts * hidden],
            dist: vec![],
        }
    }
    /// Add the candidate outputs of expert `j` (`[tokens × hidden]`) against the routed outputs
    /// (`[tokens × top_k × hidden]`, experts `chosen`) to [`LayerReap::dist`].
    pub fn add_candidate(
        &mut self,
        j: usize,
        top_k: usize,
        chosen: &[u32],
        routed: &[f32],
        outputs: &[f32],
    ) {
        let (d, e) = (self.hidden, self.n_experts);
        let t = outputs.len() / d.max(1);
        if j >= e || chosen.len() != t * top_k || routed.len() != t * top_k * d {
            return;
        }
        if self.dist.is_empty() {
            self.dist = vec![0.0; e * e];
        }
        for i in 0..t {
            let y = &outputs[i * d..(i + 1) * d];
            for s in 0..top_k {
                let r = chosen[i * top_k + s] as usize;
                if r >= e {
                    continue;
                }
                let f = &routed[(i * top_k + s) * d..(i * top_k + s + 1) * d];
                let sq: f64 = f
                    .iter()
                    .zip(y)
                    .map(|(&a, &b)| {
                        let v = a as f64 - b as f64;
                        v * v
                    })
                    .sum();
                self.dist[r * e + j] += sq;
            }
        }
    }
    /// Mean squared distance from removed expert `r` to every expert (`None` when `r` was
    /// never routed or no distances were gathered).
    pub fn mean_dist(&self, r: usize) -> Option<Vec<f64>> {
        let e = self.n_experts;
        if self.dist.len() != e * e || r >= e || self.count[r] == 0 {
            return None;
        }
        let c = self.count[r] as f64;
        Some(
            self.dist[r * e..(r + 1) * e]
                .iter()
                .map(|&v| v / c)
                .collect(),
        )
    }
    /// ‖f‖₂ of one output row, accumulated in f64.
    pub fn norm(row: &[f32]) -> f64 {
        row.iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>()
            .sqrt()
    }
    /// Add one expert's outputs for its routed rows.
    pub fn add_outputs(&mut self, e: usize, weights: &[f32], outputs: &[f32]) {
        let d = self.hidden;
        for (r, &g) in weights.iter().enumerate() {
            let row = &outputs[r * d..(r + 1) * d];
            let n = Self::norm(row);
            let g = g as f64;
            self.sum_g_norm[e] += g * n;
            self.sum_g[e] += g;
            self.sum_norm[e] += n;
            self.count[e] += 1;
            let mx = &mut self.max_f[e * d..(e + 1) * d];
            for (m, &v) in mx.iter_mut().zip(row) {
                if v > *m {
                    *m = v;
                }
            }
            let mn = &mut self.min_f[e * d..(e + 1) * d];
            for (m, &v) in mn.iter_mut().zip(row) {
                if v < *m {
                    *m = v;
                }
            }
        }
    }
    /// Add another layer's sums (max/min only where the other saw the expert).
    pub fn add(&mut self, o: &LayerReap) {
        let d = self.hidden;
        if !o.dist.is_empty() {
            if self.dist.is_empty() {
                self.dist = vec![0.0; o.dist.len()];
            }
            for (a, b) in self.dist.iter_mut().zip(&o.dist) {
                *a += b;
            }
        }
        for e in 0..self.n_experts {
            self.sum_g_norm[e] += o.sum_g_norm[e];
            self.sum_g[e] += o.sum_g[e];
            self.sum_norm[e] += o.sum_norm[e];
            if o.count[e] > 0 {
                for c in e * d..(e + 1) * d {
                    self.max_f[c] = self.max_f[c].max(o.max_f[c]);
                    self.min_f[c] = self.min_f[c].min(o.min_f[c]);
                }
            }
            self.count[e] += o.count[e];
        }
    }
    /// REAP saliency Σ g·‖f‖ / count (0 for never-routed experts).
    pub fn score(&self) -> Vec<f64> {
        (0..self.n_experts)
            .map(|e| {
                if self.count[e] == 0 {
                    0.0
                } else {
                    self.sum_g_norm[e] / self.count[e] as f64
                }
            })
            .collect()
    }
    /// max |f| per expert over channels (0 for never-routed experts).
    pub fn max_abs(&self) -> Vec<f64> {
        let d = self.hidden;
        (0..self.n_experts)
            .map(|e| {
                if self.count[e] == 0 {
                    return 0.0;
                }
                let mx = self.max_f[e * d..(e + 1) * d]
                    .iter()
                    .fold(0f32, |a, &b| a.max(b.abs()));
                let mn = self.min_f[e * d..(e + 1) * d]
                    .iter()
                    .fold(0f32, |a, &b| a.max(b.abs()));
                mx.max(mn) as f64
            })
            .collect()
    }
    /// max_f / min_f with never-routed experts' rows set to 0 (for writing).
    pub fn extremes_for_write(&self) -> (Vec<f32>, Vec<f32>) {
        let d = self.hidden;
        let mut mx = self.max_f.clone();
        let mut mn = self.min_f.clone();
        for e in 0..self.n_experts {
            if self.count[e] == 0 {
                mx[e * d..(e + 1) * d].fill(0.0);
                mn[e * d..(e + 1) * d].fill(0.0);
            }
        }
        (mx, mn)
    }
}

/// The `reap.{L}.*` tensors of `layers` (layer `L` = index), with `reap.{L}.score` when
/// `with_score` (finalized statistics; session files carry the sums only).
pub fn layer_tensors(layers: &[LayerReap], with_score: bool) -> Vec<Tensor> {
    let mut out = vec![];
    for (l, r) in layers.iter().enumerate() {
        let e = r.n_experts;
        let counts: Vec<i64> = r.count.iter().map(|&c| c as i64).collect();
        out.push(Tensor::i64(format!("reap.{l}.count"), &[e], &counts));
        out.push(Tensor::f64(format!("reap.{l}.sum_g"), &[e], &r.sum_g));
        out.push(Tensor::f64(format!("reap.{l}.sum_norm"), &[e], &r.sum_norm));
        out.push(Tensor::f64(
            format!("reap.{l}.sum_g_norm"),
            &[e],
            &r.sum_g_norm,
        ));
        let (mx, mn) = r.extremes_for_write();
        out.push(Tensor::f32(format!("reap.{l}.max_f"), &[e, r.hidden], &mx));
        out.push(Tensor::f32(format!("reap.{l}.min_f"), &[e, r.hidden], &mn));
        if !r.dist.is_empty() {
            out.push(Tensor::f64(format!("reap.{l}.dist"), &[e, e], &r.dist));
        }
        if with_score {
            out.push(Tensor::f64(format!("reap.{l}.score"), &[e], &r.score()));
        }
    }
    out
}

/// The sums of layer `l` in `f` (a session file or finalized statistics), shapes checked
/// against `n_experts` and `hidden`; `None` when any of the six arrays is absent.
pub fn read_layer(
    f: &StFile,
    l: usize,
    n_experts: usize,
    hidden: usize,
) -> Result<Option<LayerReap>> {
    let names = ["count", "sum_g", "sum_norm", "sum_g_norm", "max_f", "min_f"]
        .map(|s| format!("reap.{l}.{s}"));
    if names.iter().any(|n| !f.has(n)) {
        return Ok(None);
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
        || Some(r.max_f.len()) != n_experts.checked_mul(hidden)
        || Some(r.min_f.len()) != n_experts.checked_mul(hidden)
        || count.iter().any(|&c| c < 0)
    {
        return Err(ArtifactError::invalid(
            f.path(),
            format!("reap.{l}.*: shapes do not match n_experts = {n_experts}, hidden = {hidden}"),
        ));
    }
    r.count = count.iter().map(|&c| c as u64).collect();
    let dn = format!("reap.{l}.dist");
    if f.has(&dn) {
        r.dist = f.f64s(&dn)?;
        if Some(r.dist.len()) != n_experts.checked_mul(n_experts) {
            return Err(ArtifactError::invalid(
                f.path(),
                format!("{dn}: {} entries, expected {n_experts}²", r.dist.len()),
            ));
        }
    }
    Ok(Some(r))
}

/// `path` itself, or `path/reap-stats.safetensors` when `path` is a (run) directory.
pub fn locate(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join(FILE)
    } else {
        path.to_path_buf()
    }
}

/// Open finalized statistics: the file must exist (else the error says to run `keep
/// finalize`) and carry this format and version.
fn open_checked(path: &Path) -> Result<StFile> {
    let p = locate(path);
    if !p.exists() {
        return Err(ArtifactError::invalid(
            &p,
            "no REAP statistics here: run `keep finalize RUN` first",
        ));
    }
    let f = StFile::open(&p)?;
    if f.meta("format")? != FORMAT || f.meta("version")? != VERSION {
        return Err(ArtifactError::invalid(&p, "not keep-reap-stats version 1"));
    }
    Ok(f)
}

fn read_score(f: &StFile, l: usize, n_experts: usize) -> Result<Vec<f64>> {
    let name = format!("reap.{l}.score");
    let t = f.info(&name).ok_or_else(|| {
        ArtifactError::tensor(f.path(), &name, format!("missing (layer {l} has no score)"))
    })?;
    if t.dtype != Dtype::F64 || t.shape != [n_experts as u64] {
        return Err(ArtifactError::tensor(
            f.path(),
            &name,
            format!(
                "expected F64 [{n_experts}], found {} {:?}",
                t.dtype, t.shape
            ),
        ));
    }
    let v = f.f64s(&name)?;
    if let Some(i) = v.iter().position(|x| x.is_nan()) {
        return Err(ArtifactError::tensor(
            f.path(),
            &name,
            format!("score of expert {i} is NaN"),
        ));
    }
    Ok(v)
}

/// Finalized REAP statistics (`reap-stats.safetensors`).
#[derive(Debug, Clone, PartialEq)]
pub struct ReapStats {
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub hash_layers: Vec<usize>,
    pub model_fingerprint: String,
    pub pack_fingerprint: String,
    /// The pack split the sessions ran on (`calib` or `eval`).
    pub split: String,
    /// Sessions summed.
    pub sessions: usize,
    /// Calibration tokens summed.
    pub tokens: u64,
    /// Per layer, `0..n_layers`.
    pub layers: Vec<LayerReap>,
    /// `reap.{L}.score` per layer (as written: [`LayerReap::score`] of the sums).
    pub scores: Vec<Vec<f64>>,
}

impl ReapStats {
    /// Read finalized statistics (a run directory or the file itself), every shape checked.
    pub fn read(path: &Path) -> Result<ReapStats> {
        let f = open_checked(path)?;
        let nl = f.meta_usize("n_layers")?;
        let ne = f.meta_usize("n_experts")?;
        let hidden = f.meta_usize("hidden")?;
        let top_k = f.meta_usize("top_k")?;
        let hash_layers = f.meta_list("hash_layers")?;
        let mut layers = vec![];
        let mut scores = vec![];
        for l in 0..nl {
            let r = read_layer(&f, l, ne, hidden)?.ok_or_else(|| {
                ArtifactError::invalid(f.path(), format!("layer {l} has no reap arrays"))
            })?;
            layers.push(r);
            scores.push(read_score(&f, l, ne)?);
        }
        let tokens = f.meta("tokens")?;
        let tokens = tokens.parse().map_err(|_| {
            ArtifactError::invalid(
                f.path(),
                format!("metadata `tokens` = `{tokens}` is not a whole number"),
            )
        })?;
        Ok(ReapStats {
            n_layers: nl,
            n_experts: ne,
            top_k,
            hidden,
            hash_layers,
            model_fingerprint: f.meta("model_fingerprint")?.to_string(),
            pack_fingerprint: f.meta("pack_fingerprint")?.to_string(),
            split: f.metadata().get("split").cloned().unwrap_or_default(),
            sessions: f
                .metadata()
                .get("sessions")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0),
            tokens,
            layers,
            scores,
        })
    }

    /// The `__metadata__` this file is written with.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let comma = self
            .hash_layers
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(",");
        BTreeMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("version".into(), VERSION.into()),
            ("n_layers".into(), self.n_layers.to_string()),
            ("n_experts".into(), self.n_experts.to_string()),
            ("top_k".into(), self.top_k.to_string()),
            ("hidden".into(), self.hidden.to_string()),
            ("hash_layers".into(), comma),
            ("model_fingerprint".into(), self.model_fingerprint.clone()),
            ("pack_fingerprint".into(), self.pack_fingerprint.clone()),
            ("split".into(), self.split.clone()),
            ("sessions".into(), self.sessions.to_string()),
            ("tokens".into(), self.tokens.to_string()),
        ])
    }

    /// Write the statistics to `path` atomically (an existing `path` only with `force`).
    /// Refuses layers whose shapes disagree with `n_experts` and `hidden`, or scores that are
    /// not one per expert.
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        if self.layers.len() != self.n_layers || self.scores.len() != self.n_layers {
            return Err(ArtifactError::Config(format!(
                "REAP statistics of {} layers hold {} layers of sums and {} of scores",
                self.n_layers,
                self.layers.len(),
                self.scores.len()
            )));
        }
        for (l, (r, s)) in self.layers.iter().zip(&self.scores).enumerate() {
            let eh = self.n_experts.checked_mul(self.hidden);
            if r.n_experts != self.n_experts
                || r.hidden != self.hidden
                || r.count.len() != self.n_experts
                || r.sum_g.len() != self.n_experts
                || r.sum_norm.len() != self.n_experts
                || r.sum_g_norm.len() != self.n_experts
                || Some(r.max_f.len()) != eh
                || Some(r.min_f.len()) != eh
                || (!r.dist.is_empty()
                    && Some(r.dist.len()) != self.n_experts.checked_mul(self.n_experts))
                || s.len() != self.n_experts
            {
                return Err(ArtifactError::Config(format!(
                    "REAP statistics: layer {l} does not have n_experts = {}, hidden = {}",
                    self.n_experts, self.hidden
                )));
            }
        }
        let mut tensors = layer_tensors(&self.layers, false);
        for (l, s) in self.scores.iter().enumerate() {
            tensors.push(Tensor::f64(format!("reap.{l}.score"), &[s.len()], s));
        }
        crate::st::write(path, tensors, &self.metadata(), force)
    }
}

/// Only the saliencies of finalized statistics: `reap.{L}.score` for every layer, F64,
/// `n_experts` each, none NaN.
#[derive(Debug, Clone, PartialEq)]
pub struct ReapScores {
    /// The file read.
    pub path: PathBuf,
    pub n_experts: usize,
    /// Per layer, `0..n_layers`.
    pub scores: Vec<Vec<f64>>,
}

impl ReapScores {
    /// Read the scores of finalized statistics (a run directory or the file itself).
    pub fn read(path: &Path) -> Result<ReapScores> {
        let f = open_checked(path)?;
        let nl = f.meta_usize("n_layers")?;
        let ne = f.meta_usize("n_experts")?;
        let scores = (0..nl)
            .map(|l| read_score(&f, l, ne))
            .collect::<Result<Vec<_>>>()?;
        Ok(ReapScores {
            path: f.path().to_path_buf(),
            n_experts: ne,
            scores,
        })
    }

    /// Whether the file at `path` says it is finalized REAP statistics (reads the header only).
    pub fn is_reap_file(path: &Path) -> Result<bool> {
        let (h, _) = keep_checkpoint::safetensors::read_header(path)?;
        Ok(h.metadata.get("format").map(String::as_str) == Some(FORMAT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Statistics of `layers` layers, `ne` experts, `hidden` channels with distinct values.
    pub(crate) fn sample(layers: usize, ne: usize, hidden: usize) -> ReapStats {
        let mut ls = vec![];
        for l in 0..layers {
            let mut r = LayerReap::new(ne, hidden);
            for e in 0..ne {
                if (e + l) % 3 == 2 {
                    continue; // never routed
                }
                let out: Vec<f32> = (0..2 * hidden)
                    .map(|i| (i as f32 - 1.5) * (e + 1) as f32 * 0.25 + l as f32)
                    .collect();
                r.add_outputs(e, &[0.5, 0.125 * (e + 1) as f32], &out);
            }
            ls.push(r);
        }
        ReapStats {
            n_layers: layers,
            n_experts: ne,
            top_k: 2,
            hidden,
            hash_layers: vec![0],
            model_fingerprint: "m".repeat(64),
            pack_fingerprint: "p".repeat(64),
            split: "calib".into(),
            sessions: 3,
            tokens: 41,
            scores: ls.iter().map(LayerReap::score).collect(),
            layers: ls,
        }
    }

    #[test]
    fn round_trip_of_the_whole_file_and_of_the_scores() {
        let d = tempfile::tempdir().unwrap();
        // 11 layers: `reap.10.*` sorts before `reap.2.*`.
        let s = sample(11, 5, 3);
        let p = d.path().join(FILE);
        s.write(&p, false).unwrap();
        let mut back = ReapStats::read(d.path()).unwrap();
        // Never-routed experts' extremes are written as 0.
        let mut want = s.clone();
        for r in &mut want.layers {
            let (mx, mn) = r.extremes_for_write();
            r.max_f = mx;
            r.min_f = mn;
        }
        assert_eq!(back, want);
        let sc = ReapScores::read(&p).unwrap();
        assert_eq!(sc.scores, s.scores);
        assert_eq!(sc.n_experts, 5);
        assert!(ReapScores::is_reap_file(&p).unwrap());
        // Data in name order; a rewrite is byte-identical.
        let f = StFile::open(&p).unwrap();
        let mut names: Vec<&str> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        names.sort_by_key(|n| f.info(n).unwrap().start);
        assert!(names.windows(2).all(|w| w[0] < w[1]), "{names:?}");
        let p2 = d.path().join("again.safetensors");
        back.sessions = s.sessions;
        back.write(&p2, false).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&p2).unwrap());
        // Existing output refused without force.
        let e = s.write(&p, false).unwrap_err().to_string();
        assert!(e.contains("already exists"), "{e}");
        s.write(&p, true).unwrap();
    }

    #[test]
    fn bad_files_are_refused_naming_what_is_wrong() {
        let d = tempfile::tempdir().unwrap();
        let e = ReapStats::read(d.path()).unwrap_err().to_string();
        assert!(e.contains(FILE) && e.contains("keep finalize"), "{e}");
        let p = d.path().join(FILE);
        let s = sample(2, 4, 2);
        // Another format.
        let mut m = s.metadata();
        m.insert("format".into(), "keep-imatrix".into());
        let t = layer_tensors(&s.layers, true);
        crate::st::write(&p, t, &m, true).unwrap();
        for e in [
            ReapStats::read(&p).unwrap_err().to_string(),
            ReapScores::read(&p).unwrap_err().to_string(),
        ] {
            assert!(e.contains("not keep-reap-stats"), "{e}");
        }
        // A missing layer, a wrong shape, a NaN score.
        let m = s.metadata();
        let mut t = layer_tensors(&s.layers, true);
        t.retain(|t| t.name() != "reap.1.score");
        crate::st::write(&p, t, &m, true).unwrap();
        let e = ReapScores::read(&p).unwrap_err().to_string();
        assert!(e.contains("reap.1.score") && e.contains("missing"), "{e}");
        let mut t = layer_tensors(&s.layers, true);
        for x in &mut t {
            if x.name() == "reap.0.score" {
                *x = Tensor::f64("reap.0.score", &[3], &[1.0, 2.0, 3.0]);
            }
        }
        crate::st::write(&p, t, &m, true).unwrap();
        let e = ReapScores::read(&p).unwrap_err().to_string();
        assert!(e.contains("reap.0.score") && e.contains("F64 [4]"), "{e}");
        let mut t = layer_tensors(&s.layers, true);
        for x in &mut t {
            if x.name() == "reap.1.score" {
                *x = Tensor::f64("reap.1.score", &[4], &[1.0, f64::NAN, 3.0, 0.0]);
            }
        }
        crate::st::write(&p, t, &m, true).unwrap();
        let e = ReapStats::read(&p).unwrap_err().to_string();
        assert!(e.contains("expert 1 is NaN"), "{e}");
        // Sums whose shapes disagree with the metadata.
        let mut m2 = m.clone();
        m2.insert("hidden".into(), "3".into());
        let t = layer_tensors(&s.layers, true);
        crate::st::write(&p, t, &m2, true).unwrap();
        let e = ReapStats::read(&p).unwrap_err().to_string();
        assert!(e.contains("shapes do not match"), "{e}");
        // The writer refuses inconsistent statistics.
        let mut bad = s.clone();
        bad.scores[1].pop();
        assert!(bad.write(&d.path().join("x"), false).is_err());
    }
}
