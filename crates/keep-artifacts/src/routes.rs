//! The route-trace format (`keep-routes`, version 1): what the router chose, per token and MoE
//! layer, for one session — its reader, its atomic writer and an in-memory recorder.
//!
//! One safetensors file is one *session* (one calibration group, or one `keep run`). Tensors,
//! for every recorded MoE layer `L`:
//!
//! - `routes.{L}.experts` — `I16 [T, top_k]`: the chosen expert ids, in the router's order;
//! - `routes.{L}.weights` — `F16 [T, top_k]`: the final gate weights (after renormalisation and
//!   routed scaling). The reader also takes `BF16`/`F32`.
//!
//! `__metadata__`: `format` = `keep-routes`, `version` = `1`, `n_experts` (one number for every
//! layer, or a comma list in ascending layer order), `top_k`, `n_layers` (the number of recorded
//! layers), `layers` (their ids, comma list), `session` (an id), optionally
//! `model_fingerprint` and `hash_layers` (comma list of hash-routed layers). A calibration
//! session file (`format` = `keep-calib-session`) holds the same tensors beside others; the
//! reader accepts any safetensors file with `routes.*` tensors. A *run* is a directory: every
//! `*.safetensors` in it with `routes.*` tensors, sorted by file name, one session each (files
//! without routes, like `imatrix.safetensors` or `reap-stats.safetensors`, are skipped).
//!
//! Writers: build a [`Session`] with [`SessionRecorder`] (push each layer's
//! `[tokens × top_k]` experts and weights as the forward produces them) and write it with
//! [`write_session`]; a writer that puts routes into a file of its own (calibration) takes
//! [`session_tensors`] and [`session_metadata`] instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::tensor_file;
use keep_checkpoint::{Dtype, ShardFile, TensorMeta};

use crate::{ArtifactError, Result};

/// `format` metadata value of a route-trace file.
pub const FORMAT: &str = "keep-routes";
/// `format` metadata value of a calibration session file (which also holds routes).
pub const CALIB_FORMAT: &str = "keep-calib-session";
/// The version this crate reads and writes.
pub const VERSION: &str = "1";
/// Largest expert count the `I16` id tensor can hold.
pub const MAX_EXPERTS: usize = i16::MAX as usize + 1;

/// The routes of one MoE layer in one session.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRoutes {
    /// Decoder layer index.
    pub layer: usize,
    /// Experts chosen per token.
    pub top_k: usize,
    /// Routed experts of the layer (ids are `0..n_experts`).
    pub n_experts: usize,
    /// Whether the layer is hash-routed (replayed like any other; its misses are counted as
    /// prefetched, since the runtime reads them from the token ids ahead of the layer).
    pub hash: bool,
    /// Chosen expert ids, `[T × top_k]` row-major, in the router's order.
    pub experts: Vec<u16>,
    /// Gate weights, `[T × top_k]`, matching `experts`.
    pub weights: Vec<f32>,
}

impl LayerRoutes {
    /// Tokens recorded.
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.top_k).unwrap_or(0)
    }
}

/// One session: a calibration group or one `keep run`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Session {
    /// The `session` metadata value (or the file stem when absent).
    pub id: String,
    /// The `model_fingerprint` metadata value, if any.
    pub model_fingerprint: Option<String>,
    /// Recorded layers, ascending by layer index.
    pub layers: Vec<LayerRoutes>,
    /// The file it was read from (`None` for a session built in memory).
    pub source: Option<PathBuf>,
}

/// A run: its sessions in file-name order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RouteTrace {
    /// The directory or file read.
    pub path: PathBuf,
    pub sessions: Vec<Session>,
    /// `*.safetensors` files of the directory that hold no routes (skipped).
    pub skipped: Vec<PathBuf>,
}

impl RouteTrace {
    /// Recorded layer indices (the same in every session; checked by [`read_run`]).
    pub fn layers(&self) -> Vec<usize> {
        self.sessions
            .first()
            .map(|s| s.layers.iter().map(|l| l.layer).collect())
            .unwrap_or_default()
    }
    /// Total routed slots over all sessions and layers.
    pub fn slots(&self) -> u64 {
        self.sessions
            .iter()
            .flat_map(|s| &s.layers)
            .map(|l| l.experts.len() as u64)
            .sum()
    }
    /// Tokens over all sessions (of the first recorded layer).
    pub fn tokens(&self) -> u64 {
        self.sessions
            .iter()
            .filter_map(|s| s.layers.first())
            .map(|l| l.tokens() as u64)
            .sum()
    }
}

/// Builds a [`Session`] from the forward's route events, layer by layer and batch by batch.
#[derive(Debug, Clone)]
pub struct SessionRecorder {
    session: Session,
    n_experts: usize,
    top_k: usize,
    hash_layers: Vec<usize>,
}

impl SessionRecorder {
    /// A recorder for a model with `n_experts` routed experts per layer and `top_k` per token.
    pub fn new(id: impl Into<String>, n_experts: usize, top_k: usize) -> SessionRecorder {
        SessionRecorder {
            session: Session {
                id: id.into(),
                ..Session::default()
            },
            n_experts,
            top_k,
            hash_layers: vec![],
        }
    }
    /// Set the model fingerprint written to the metadata.
    pub fn fingerprint(mut self, fp: impl Into<String>) -> Self {
        self.session.model_fingerprint = Some(fp.into());
        self
    }
    /// Mark these layers hash-routed.
    pub fn hash_layers(mut self, layers: &[usize]) -> Self {
        self.hash_layers = layers.to_vec();
        self
    }
    /// Append `tokens × top_k` routes of `layer` (experts as the model gives them, `u32`).
    /// Errors (instead of recording) on a length that is not a whole number of tokens, or an
    /// id outside `0..n_experts`.
    pub fn push(&mut self, layer: usize, experts: &[u32], weights: &[f32]) -> Result<()> {
        let k = self.top_k;
        if k == 0 || experts.len() != weights.len() || !experts.len().is_multiple_of(k) {
            return Err(ArtifactError::Config(format!(
                "route recorder, layer {layer}: {} experts and {} weights are not whole tokens of top-{k}",
                experts.len(),
                weights.len()
            )));
        }
        if self.n_experts == 0 || self.n_experts > MAX_EXPERTS {
            return Err(ArtifactError::Config(format!(
                "route recorder: {} experts per layer cannot be stored as I16 ids",
                self.n_experts
            )));
        }
        if let Some(&bad) = experts.iter().find(|&&e| e as usize >= self.n_experts) {
            return Err(ArtifactError::Config(format!(
                "route recorder, layer {layer}: expert id {bad} ≥ {} experts",
                self.n_experts
            )));
        }
        let idx = match self
            .session
            .layers
            .binary_search_by_key(&layer, |l| l.layer)
        {
            Ok(i) => i,
            Err(i) => {
                self.session.layers.insert(
                    i,
                    LayerRoutes {
                        layer,
                        top_k: k,
                        n_experts: self.n_experts,
                        hash: self.hash_layers.contains(&layer),
                        experts: vec![],
                        weights: vec![],
                    },
                );
                i
            }
        };
        let l = &mut self.session.layers[idx];
        l.experts.extend(experts.iter().map(|&e| e as u16));
        l.weights.extend_from_slice(weights);
        Ok(())
    }
    /// The session recorded so far.
    pub fn session(&self) -> &Session {
        &self.session
    }
    /// Finish recording.
    pub fn finish(self) -> Session {
        self.session
    }
}

fn join_usizes(v: impl IntoIterator<Item = usize>) -> String {
    v.into_iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `__metadata__` keys of a route trace for `s` (format, version, n_experts, top_k,
/// n_layers, layers, session, model_fingerprint, hash_layers). Errors when the layers disagree
/// on top-k.
pub fn session_metadata(s: &Session) -> Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::new();
    m.insert("format".into(), FORMAT.into());
    m.insert("version".into(), VERSION.into());
    let ks: std::collections::BTreeSet<usize> = s.layers.iter().map(|l| l.top_k).collect();
    if ks.len() > 1 {
        return Err(ArtifactError::Config(format!(
            "session `{}`: layers disagree on top-k ({ks:?})",
            s.id
        )));
    }
    if let Some(k) = ks.first() {
        m.insert("top_k".into(), k.to_string());
    }
    let ns: std::collections::BTreeSet<usize> = s.layers.iter().map(|l| l.n_experts).collect();
    let n = if ns.len() == 1 {
        ns.first().map(|n| n.to_string()).unwrap_or_default()
    } else {
        join_usizes(s.layers.iter().map(|l| l.n_experts))
    };
    if !n.is_empty() {
        m.insert("n_experts".into(), n);
    }
    m.insert("n_layers".into(), s.layers.len().to_string());
    m.insert(
        "layers".into(),
        join_usizes(s.layers.iter().map(|l| l.layer)),
    );
    m.insert("session".into(), s.id.clone());
    if let Some(fp) = &s.model_fingerprint {
        m.insert("model_fingerprint".into(), fp.clone());
    }
    let hash: Vec<usize> = s
        .layers
        .iter()
        .filter(|l| l.hash)
        .map(|l| l.layer)
        .collect();
    if !hash.is_empty() {
        m.insert("hash_layers".into(), join_usizes(hash));
    }
    Ok(m)
}

/// The route tensors of `s` with their little-endian bytes, in the order a writer must take
/// them (`routes.{L}.experts` then `routes.{L}.weights`, ascending `L`). Errors on a layer
/// whose shapes disagree or whose ids do not fit.
pub fn session_tensors(s: &Session) -> Result<Vec<(TensorMeta, Vec<u8>)>> {
    let mut out = Vec::with_capacity(2 * s.layers.len());
    let mut prev: Option<usize> = None;
    for l in &s.layers {
        if prev.is_some_and(|p| p >= l.layer) {
            return Err(ArtifactError::Config(format!(
                "session `{}`: layers must be ascending and distinct (layer {} after {})",
                s.id,
                l.layer,
                prev.unwrap_or(0)
            )));
        }
        prev = Some(l.layer);
        let k = l.top_k;
        if k == 0 || l.experts.len() != l.weights.len() || !l.experts.len().is_multiple_of(k) {
            return Err(ArtifactError::Config(format!(
                "session `{}`, layer {}: {} experts and {} weights are not whole tokens of top-{k}",
                s.id,
                l.layer,
                l.experts.len(),
                l.weights.len()
            )));
        }
        if l.n_experts > MAX_EXPERTS || l.experts.iter().any(|&e| e as usize >= l.n_experts) {
            return Err(ArtifactError::Config(format!(
                "session `{}`, layer {}: expert ids must be < n_experts = {} (≤ {MAX_EXPERTS})",
                s.id, l.layer, l.n_experts
            )));
        }
        let shape = [l.tokens() as u64, k as u64];
        let ids: Vec<u8> = l
            .experts
            .iter()
            .flat_map(|&e| (e as i16).to_le_bytes())
            .collect();
        let ws: Vec<u8> = l
            .weights
            .iter()
            .flat_map(|&w| half::f16::from_f32(w).to_bits().to_le_bytes())
            .collect();
        out.push((
            TensorMeta::new(format!("routes.{}.experts", l.layer), Dtype::I16, &shape),
            ids,
        ));
        out.push((
            TensorMeta::new(format!("routes.{}.weights", l.layer), Dtype::F16, &shape),
            ws,
        ));
    }
    Ok(out)
}

/// Write `s` to the single file `path`, atomically: keep-checkpoint's single-file writer
/// (`tensor_file`) builds it in a hidden temporary sibling, syncs it, and renames it into place
/// only when complete.
/// `extra_metadata` is added to the header (it may not redefine the keys of
/// [`session_metadata`]). An existing `path` is refused unless `force`.
pub fn write_session(
    path: &Path,
    s: &Session,
    extra_metadata: &BTreeMap<String, String>,
    force: bool,
) -> Result<PathBuf> {
    keep_checkpoint::atomic::check_file_target(path, force)?;
    let mut meta = session_metadata(s)?;
    for (k, v) in extra_metadata {
        if meta.contains_key(k) {
            return Err(ArtifactError::Config(format!(
                "metadata key `{k}` is set by the trace writer and cannot be given as extra metadata"
            )));
        }
        meta.insert(k.clone(), v.clone());
    }
    let tensors: Vec<tensor_file::Tensor> = session_tensors(s)?
        .into_iter()
        .map(|(meta, data)| tensor_file::Tensor { meta, data })
        .collect();
    // Route traces have the checkpoint shards' header (every key in byte order).
    tensor_file::write(
        path,
        &tensors,
        &tensor_file::pairs(&meta),
        tensor_file::KeyOrder::Sorted,
        force,
    )?;
    Ok(path.to_path_buf())
}

fn meta_usize(path: &Path, meta: &BTreeMap<String, String>, key: &str) -> Result<Option<usize>> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| ArtifactError::Trace {
                path: path.to_path_buf(),
                msg: format!("metadata `{key}` = `{v}` is not a whole number"),
            }),
    }
}

fn meta_list(path: &Path, meta: &BTreeMap<String, String>, key: &str) -> Result<Vec<usize>> {
    match meta.get(key) {
        None => Ok(vec![]),
        Some(v) if v.trim().is_empty() => Ok(vec![]),
        Some(v) => v
            .split(',')
            .map(|x| x.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| ArtifactError::Trace {
                path: path.to_path_buf(),
                msg: format!("metadata `{key}` = `{v}` is not a comma list of whole numbers"),
            }),
    }
}

/// Whether a file's header names any `routes.*` tensor (cheap: reads the header only).
pub fn has_routes(path: &Path) -> Result<bool> {
    let (h, _) = keep_checkpoint::safetensors::read_header(path)?;
    Ok(h.tensors.iter().any(|t| t.name.starts_with("routes.")))
}

fn decode_weights(path: &Path, name: &str, dtype: Dtype, b: &[u8]) -> Result<Vec<f32>> {
    let v: Vec<f32> = match dtype {
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        d => {
            return Err(ArtifactError::tensor(
                path,
                name,
                format!("gate weights must be F16 (or BF16/F32), found {d}"),
            ))
        }
    };
    if let Some(i) = v.iter().position(|w| !w.is_finite() || *w < 0.0) {
        return Err(ArtifactError::tensor(
            path,
            name,
            format!(
                "gate weight {} at element {i} is not a finite non-negative number",
                v[i]
            ),
        ));
    }
    Ok(v)
}

/// Read one session file. Errors name the file and tensor: a missing `weights` or `experts`
/// partner, shapes that differ or are not `[T, top_k]`, ids that are negative or
/// `≥ n_experts`, weights that are not finite and non-negative, a `version` this reader does
/// not know. A file without `routes.*` tensors is an error here (a run skips such files).
pub fn read_session(path: &Path) -> Result<Session> {
    let f = ShardFile::open(path)?;
    let h = f.header();
    let meta = &h.metadata;
    let format = meta.get("format").map(String::as_str);
    if format == Some(FORMAT) {
        if let Some(v) = meta.get("version") {
            if v != VERSION {
                return Err(ArtifactError::Trace {
                    path: path.to_path_buf(),
                    msg: format!(
                        "route trace version {v} is not supported (this keep reads version {VERSION})"
                    ),
                });
            }
        }
    }
    let meta_k = meta_usize(path, meta, "top_k")?;
    let meta_n = meta_list(path, meta, "n_experts")?;
    let hash = meta_list(path, meta, "hash_layers")?;

    // Pair up routes.{L}.experts / routes.{L}.weights.
    let mut pairs: BTreeMap<usize, (Option<usize>, Option<usize>)> = BTreeMap::new();
    for (i, t) in h.tensors.iter().enumerate() {
        let Some(rest) = t.name.strip_prefix("routes.") else {
            continue;
        };
        let Some((layer, what)) = rest.split_once('.') else {
            continue;
        };
        let Ok(layer) = layer.parse::<usize>() else {
            return Err(ArtifactError::tensor(
                path,
                &t.name,
                "the layer in `routes.{layer}.*` is not a whole number",
            ));
        };
        match what {
            "experts" => pairs.entry(layer).or_default().0 = Some(i),
            "weights" => pairs.entry(layer).or_default().1 = Some(i),
            _ => {}
        }
    }
    if pairs.is_empty() {
        return Err(ArtifactError::Trace {
            path: path.to_path_buf(),
            msg: "holds no `routes.{layer}.experts` tensors: not a route trace".into(),
        });
    }
    if meta_n.len() > 1 && meta_n.len() != pairs.len() {
        return Err(ArtifactError::Trace {
            path: path.to_path_buf(),
            msg: format!(
                "metadata `n_experts` lists {} layers but the file records {}",
                meta_n.len(),
                pairs.len()
            ),
        });
    }
    let mut layers = Vec::with_capacity(pairs.len());
    for (li, (&layer, &(ei, wi))) in pairs.iter().enumerate() {
        let en = format!("routes.{layer}.experts");
        let wn = format!("routes.{layer}.weights");
        let Some(ei) = ei else {
            return Err(ArtifactError::tensor(
                path,
                &en,
                format!("missing (the file has `{wn}` but not its expert ids)"),
            ));
        };
        let Some(wi) = wi else {
            return Err(ArtifactError::tensor(
                path,
                &wn,
                format!("missing (the file has `{en}` but not its gate weights)"),
            ));
        };
        let et = &h.tensors[ei];
        let wt = &h.tensors[wi];
        if et.dtype != Dtype::I16 {
            return Err(ArtifactError::tensor(
                path,
                &en,
                format!("expert ids must be I16, found {}", et.dtype),
            ));
        }
        if et.shape.len() != 2 {
            return Err(ArtifactError::tensor(
                path,
                &en,
                format!("shape {:?} is not [tokens, top_k]", et.shape),
            ));
        }
        if wt.shape != et.shape {
            return Err(ArtifactError::tensor(
                path,
                &wn,
                format!("shape {:?} differs from `{en}` {:?}", wt.shape, et.shape),
            ));
        }
        let k = et.shape[1] as usize;
        if k == 0 {
            return Err(ArtifactError::tensor(path, &en, "top_k is 0"));
        }
        if let Some(mk) = meta_k {
            if mk != k {
                return Err(ArtifactError::tensor(
                    path,
                    &en,
                    format!("shape {:?} disagrees with metadata top_k = {mk}", et.shape),
                ));
            }
        }
        let ids: Vec<i16> = f
            .data(et)
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect();
        let n_experts = match meta_n.len() {
            0 => ids
                .iter()
                .map(|&e| e.max(0) as usize + 1)
                .max()
                .unwrap_or(1),
            1 => meta_n[0],
            _ => meta_n[li],
        };
        if n_experts == 0 || n_experts > MAX_EXPERTS {
            return Err(ArtifactError::tensor(
                path,
                &en,
                format!("n_experts = {n_experts} is not in 1..={MAX_EXPERTS}"),
            ));
        }
        if let Some(i) = ids.iter().position(|&e| e < 0 || e as usize >= n_experts) {
            return Err(ArtifactError::tensor(
                path,
                &en,
                format!(
                    "token {} slot {}: expert id {} is outside 0..{n_experts}",
                    i / k,
                    i % k,
                    ids[i]
                ),
            ));
        }
        let weights = decode_weights(path, &wn, wt.dtype, f.data(wt))?;
        layers.push(LayerRoutes {
            layer,
            top_k: k,
            n_experts,
            hash: hash.contains(&layer),
            experts: ids.into_iter().map(|e| e as u16).collect(),
            weights,
        });
    }
    let id = meta.get("session").cloned().unwrap_or_else(|| {
        path.file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default()
    });
    Ok(Session {
        id,
        model_fingerprint: meta.get("model_fingerprint").cloned(),
        layers,
        source: Some(path.to_path_buf()),
    })
}

/// Read a run: a directory of session files (sorted by name; files without routes skipped) or
/// one session file. Errors when nothing holds routes, or when sessions disagree on the
/// recorded layers, their expert counts or top-k.
pub fn read_run(path: &Path) -> Result<RouteTrace> {
    let mut trace = RouteTrace {
        path: path.to_path_buf(),
        ..RouteTrace::default()
    };
    if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|e| ArtifactError::io(path, e))?;
        let mut files: Vec<PathBuf> = rd
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.extension().is_some_and(|x| x == "safetensors")
                    && !p
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        for p in files {
            if has_routes(&p)? {
                trace.sessions.push(read_session(&p)?);
            } else {
                trace.skipped.push(p);
            }
        }
        if trace.sessions.is_empty() {
            return Err(ArtifactError::Trace {
                path: path.to_path_buf(),
                msg: "no *.safetensors file here holds `routes.*` tensors; record routes with \
                      `keep calibrate` or `keep run --record-routes`"
                    .into(),
            });
        }
    } else {
        trace.sessions.push(read_session(path)?);
    }
    check_consistent(&trace)?;
    Ok(trace)
}

/// Every session must record the same layers with the same expert counts and top-k.
pub fn check_consistent(t: &RouteTrace) -> Result<()> {
    let Some(first) = t.sessions.first() else {
        return Ok(());
    };
    let shape = |s: &Session| -> Vec<(usize, usize, usize)> {
        s.layers
            .iter()
            .map(|l| (l.layer, l.n_experts, l.top_k))
            .collect()
    };
    let want = shape(first);
    for s in &t.sessions[1..] {
        if shape(s) != want {
            let p = s.source.clone().unwrap_or_else(|| t.path.clone());
            return Err(ArtifactError::Inconsistent {
                path: p,
                msg: format!(
                    "session `{}` records (layer, n_experts, top_k) {:?}, but session `{}` records {:?}; \
                     replay sessions of one model together",
                    s.id,
                    shape(s),
                    first.id,
                    want
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: &str) -> Session {
        let mut r = SessionRecorder::new(id, 8, 2)
            .fingerprint("abc")
            .hash_layers(&[0]);
        r.push(3, &[1, 2, 7, 0], &[0.75, 0.25, 0.5, 0.5]).unwrap();
        r.push(0, &[5, 4], &[1.0, 0.125]).unwrap();
        r.push(3, &[6, 1], &[0.5, 0.5]).unwrap();
        r.finish()
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let s = sample("s0");
        let p = dir.path().join("a.safetensors");
        let extra = BTreeMap::from([("note".to_string(), "hi".to_string())]);
        write_session(&p, &s, &extra, false).unwrap();
        let back = read_session(&p).unwrap();
        assert_eq!(back.id, "s0");
        assert_eq!(back.model_fingerprint.as_deref(), Some("abc"));
        assert_eq!(back.layers.len(), 2);
        assert_eq!(back.layers[0].layer, 0);
        assert!(back.layers[0].hash);
        assert_eq!(back.layers[1].experts, vec![1, 2, 7, 0, 6, 1]);
        // Weights chosen exact in f16.
        assert_eq!(back.layers[1].weights, s.layers[1].weights);
        assert_eq!(back.layers[1].n_experts, 8);
        assert_eq!(back.layers[1].top_k, 2);
        let meta = ShardFile::open(&p).unwrap().header().metadata.clone();
        assert_eq!(meta["format"], FORMAT);
        assert_eq!(meta["version"], VERSION);
        assert_eq!(meta["layers"], "0,3");
        assert_eq!(meta["note"], "hi");
        // Refused without force, replaced with it; no temporaries left behind.
        assert!(write_session(&p, &s, &BTreeMap::new(), false).is_err());
        write_session(&p, &sample("s1"), &BTreeMap::new(), true).unwrap();
        assert_eq!(read_session(&p).unwrap().id, "s1");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn run_dir_sorted_and_skips_non_route_files() {
        let dir = tempfile::tempdir().unwrap();
        write_session(
            &dir.path().join("b.safetensors"),
            &sample("second"),
            &BTreeMap::new(),
            false,
        )
        .unwrap();
        write_session(
            &dir.path().join("a.safetensors"),
            &sample("first"),
            &BTreeMap::new(),
            false,
        )
        .unwrap();
        // A safetensors file without routes (like imatrix.safetensors).
        let other = dir.path().join("imatrix.safetensors");
        raw(
            &other,
            &[],
            vec![(
                TensorMeta::new("imatrix.0", Dtype::F32, &[1]),
                1f32.to_le_bytes().to_vec(),
            )],
        );
        let t = read_run(dir.path()).unwrap();
        let ids: Vec<_> = t.sessions.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["first", "second"]);
        assert_eq!(t.skipped, vec![other]);
        assert_eq!(t.layers(), vec![0, 3]);
        assert_eq!(t.tokens(), 2);
        assert_eq!(t.slots(), 2 * (2 + 6));
    }

    #[test]
    fn empty_dir_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_run(dir.path()).unwrap_err().to_string();
        assert!(e.contains("keep calibrate"), "{e}");
    }

    /// Write raw tensors with arbitrary metadata (for bad-input tests).
    fn raw(path: &Path, meta: &[(&str, &str)], tensors: Vec<(TensorMeta, Vec<u8>)>) {
        let meta: Vec<(String, String)> = meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let tensors: Vec<tensor_file::Tensor> = tensors
            .into_iter()
            .map(|(meta, data)| tensor_file::Tensor { meta, data })
            .collect();
        tensor_file::write(path, &tensors, &meta, tensor_file::KeyOrder::Sorted, true).unwrap();
    }

    fn ids(name: &str, shape: &[u64], v: &[i16]) -> (TensorMeta, Vec<u8>) {
        (
            TensorMeta::new(name, Dtype::I16, shape),
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )
    }
    fn ws(name: &str, shape: &[u64], v: &[f32]) -> (TensorMeta, Vec<u8>) {
        (
            TensorMeta::new(name, Dtype::F16, shape),
            v.iter()
                .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
                .collect(),
        )
    }

    fn err_of(meta: &[(&str, &str)], t: Vec<(TensorMeta, Vec<u8>)>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bad.safetensors");
        raw(&p, meta, t);
        let e = read_session(&p).unwrap_err().to_string();
        assert!(e.contains("bad.safetensors"), "names the file: {e}");
        e
    }

    #[test]
    fn bad_input_names_file_and_tensor() {
        let m = [("format", FORMAT), ("n_experts", "4"), ("top_k", "2")];
        // Missing weights.
        let e = err_of(&m, vec![ids("routes.1.experts", &[1, 2], &[0, 1])]);
        assert!(
            e.contains("routes.1.weights") && e.contains("missing"),
            "{e}"
        );
        // Missing experts.
        let e = err_of(&m, vec![ws("routes.1.weights", &[1, 2], &[0.5, 0.5])]);
        assert!(
            e.contains("routes.1.experts") && e.contains("missing"),
            "{e}"
        );
        // Mismatched shapes.
        let e = err_of(
            &m,
            vec![
                ids("routes.1.experts", &[2, 2], &[0, 1, 2, 3]),
                ws("routes.1.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        assert!(
            e.contains("routes.1.weights") && e.contains("differs"),
            "{e}"
        );
        // Id ≥ n_experts.
        let e = err_of(
            &m,
            vec![
                ids("routes.1.experts", &[1, 2], &[0, 4]),
                ws("routes.1.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        assert!(
            e.contains("routes.1.experts") && e.contains("expert id 4"),
            "{e}"
        );
        // Negative id.
        let e = err_of(
            &m,
            vec![
                ids("routes.1.experts", &[1, 2], &[-1, 0]),
                ws("routes.1.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        assert!(e.contains("expert id -1"), "{e}");
        // top_k disagrees with metadata.
        let e = err_of(
            &m,
            vec![
                ids("routes.1.experts", &[2, 1], &[0, 1]),
                ws("routes.1.weights", &[2, 1], &[0.5, 0.5]),
            ],
        );
        assert!(e.contains("top_k"), "{e}");
        // Wrong id dtype.
        let e = err_of(
            &m,
            vec![
                (
                    TensorMeta::new("routes.1.experts", Dtype::I32, &[1, 2]),
                    vec![0u8; 8],
                ),
                ws("routes.1.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        assert!(e.contains("must be I16"), "{e}");
        // NaN weight.
        let e = err_of(
            &m,
            vec![
                ids("routes.1.experts", &[1, 2], &[0, 1]),
                ws("routes.1.weights", &[1, 2], &[f32::NAN, 0.5]),
            ],
        );
        assert!(
            e.contains("routes.1.weights") && e.contains("finite"),
            "{e}"
        );
        // Unknown version.
        let e = err_of(
            &[("format", FORMAT), ("version", "9")],
            vec![
                ids("routes.1.experts", &[1, 2], &[0, 1]),
                ws("routes.1.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        assert!(e.contains("version 9"), "{e}");
    }

    #[test]
    fn calib_session_files_and_missing_metadata_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g0.safetensors");
        raw(
            &p,
            &[
                ("format", CALIB_FORMAT),
                ("hash_layers", ""),
                ("layers", "0,1,2"),
                ("split", "calib"),
            ],
            vec![
                (
                    TensorMeta::new("imatrix.0.attn", Dtype::F32, &[1]),
                    vec![0u8; 4],
                ),
                ids("routes.2.experts", &[1, 2], &[0, 5]),
                ws("routes.2.weights", &[1, 2], &[0.5, 0.5]),
            ],
        );
        let s = read_session(&p).unwrap();
        assert_eq!(s.id, "g0");
        assert_eq!(s.layers[0].n_experts, 6, "inferred from the largest id");
        assert_eq!(s.layers[0].top_k, 2);
    }

    #[test]
    fn sessions_must_agree() {
        let dir = tempfile::tempdir().unwrap();
        write_session(
            &dir.path().join("a.safetensors"),
            &sample("a"),
            &BTreeMap::new(),
            false,
        )
        .unwrap();
        let mut r = SessionRecorder::new("b", 16, 2);
        r.push(3, &[1, 2], &[0.5, 0.5]).unwrap();
        write_session(
            &dir.path().join("b.safetensors"),
            &r.finish(),
            &BTreeMap::new(),
            false,
        )
        .unwrap();
        let e = read_run(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("b.safetensors") && e.contains("session `b`"),
            "{e}"
        );
    }

    #[test]
    fn recorder_refuses_bad_pushes() {
        let mut r = SessionRecorder::new("x", 4, 2);
        assert!(r.push(0, &[1, 2, 3], &[0.1, 0.2, 0.3]).is_err());
        assert!(r.push(0, &[1, 4], &[0.1, 0.2]).is_err());
        assert!(r.push(0, &[1, 2], &[0.1]).is_err());
        assert!(r.session().layers.is_empty());
    }
}
