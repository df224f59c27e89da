//! Recording routes during a run (`keep run --record-routes FILE`) in the `keep-routes`
//! version 1 format that `keep residency` reads: per MoE layer `L`, `routes.{L}.experts` I16
//! `[T, top_k]` (the router's choices in its order) and `routes.{L}.weights` F16 `[T, top_k]`
//! (final gate weights); metadata `format`, `version`, `n_experts`, `top_k`, `n_layers`,
//! `layers`, `session`, `hash_layers` (hash-routed layers, which `keep residency` counts as
//! prefetched). Written to a temporary sibling and renamed into place.
//!
//! Also reading warm-start scores: `reap.{L}.score` F64 `[n_experts]` from
//! `reap-stats.safetensors` (`keep finalize`), or route frequencies counted from a route file.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use keep_checkpoint::{Dtype, ShardFile};
use keep_model::{RouteEvent, RouteObserver};

use crate::{Result, RuntimeError};

/// `format` metadata value of a route trace.
pub const ROUTES_FORMAT: &str = "keep-routes";
/// `version` metadata value.
pub const ROUTES_VERSION: &str = "1";

/// A [`RouteObserver`] that keeps every layer's routes of a session.
#[derive(Debug, Default, Clone)]
pub struct RouteLog {
    /// layer → (experts, weights), `[T × top_k]` each.
    layers: BTreeMap<usize, (Vec<u32>, Vec<f32>)>,
    top_k: usize,
    hash_layers: Vec<usize>,
}

impl RouteObserver for RouteLog {
    fn on_route(&mut self, ev: &RouteEvent) {
        self.top_k = ev.top_k;
        let e = self.layers.entry(ev.layer).or_default();
        e.0.extend_from_slice(ev.experts);
        e.1.extend_from_slice(ev.weights);
    }
}

impl RouteLog {
    /// An empty log.
    pub fn new() -> RouteLog {
        RouteLog::default()
    }

    /// Mark `layers` hash-routed in the written metadata.
    pub fn set_hash_layers(&mut self, layers: &[usize]) {
        self.hash_layers = layers.to_vec();
    }

    /// Tokens recorded (of the first layer).
    pub fn tokens(&self) -> usize {
        match (self.layers.values().next(), self.top_k) {
            (Some(l), k) if k > 0 => l.0.len() / k,
            _ => 0,
        }
    }

    /// The experts chosen in `layer` (`[T × top_k]`).
    pub fn experts(&self, layer: usize) -> Option<&[u32]> {
        self.layers.get(&layer).map(|l| &l.0[..])
    }

    /// Write the log to `path` (refused if it exists unless `force`).
    pub fn write(&self, path: &Path, session: &str, n_experts: usize, force: bool) -> Result<()> {
        let file_err = |msg: String| RuntimeError::File {
            path: path.to_path_buf(),
            msg,
        };
        keep_checkpoint::atomic::check_file_target(path, force)?;
        if n_experts > i16::MAX as usize + 1 {
            return Err(file_err(format!(
                "{n_experts} experts do not fit the I16 ids of keep-routes"
            )));
        }
        let k = self.top_k.max(1);
        let mut bufs: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![];
        for (l, (ex, ws)) in &self.layers {
            let t = ex.len() / k;
            let ids: Vec<u8> = ex.iter().flat_map(|&e| (e as i16).to_le_bytes()).collect();
            let w: Vec<u8> = ws
                .iter()
                .flat_map(|&w| half::f16::from_f32(w).to_bits().to_le_bytes())
                .collect();
            bufs.push((format!("routes.{l}.experts"), Dtype::I16, vec![t, k], ids));
            bufs.push((format!("routes.{l}.weights"), Dtype::F16, vec![t, k], w));
        }
        let mut views = vec![];
        for (name, dt, shape, data) in &bufs {
            let d = match dt {
                Dtype::I16 => safetensors::Dtype::I16,
                _ => safetensors::Dtype::F16,
            };
            let v = safetensors::tensor::TensorView::new(d, shape.clone(), data)
                .map_err(|e| file_err(e.to_string()))?;
            views.push((name.clone(), v));
        }
        let layers: Vec<String> = self.layers.keys().map(|l| l.to_string()).collect();
        let meta: HashMap<String, String> = [
            ("format", ROUTES_FORMAT.to_string()),
            ("version", ROUTES_VERSION.to_string()),
            ("n_experts", n_experts.to_string()),
            ("top_k", k.to_string()),
            ("n_layers", self.layers.len().to_string()),
            ("layers", layers.join(",")),
            ("session", session.to_string()),
            (
                "hash_layers",
                self.hash_layers
                    .iter()
                    .map(|l| l.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            ),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b))
        .collect();
        let bytes = safetensors::tensor::serialize(views, Some(meta))
            .map_err(|e| file_err(e.to_string()))?;
        Ok(keep_checkpoint::atomic::write_file(path, &bytes, force)?)
    }
}

/// Warm-start scores per layer (`[layer][expert]`) from `reap-stats.safetensors`
/// (`reap.{L}.score` F64) or a `keep-routes` file (route counts per expert).
pub fn warm_scores(path: &Path, n_layers: usize, n_experts: usize) -> Result<Vec<Vec<f64>>> {
    let file_err = |msg: String| RuntimeError::File {
        path: path.to_path_buf(),
        msg,
    };
    let sf = ShardFile::open(path)?;
    let mut out = vec![vec![0f64; n_experts]; n_layers];
    let mut found = false;
    for t in &sf.header().tensors {
        let parts: Vec<&str> = t.name.split('.').collect();
        let (kind, layer, what) = match parts.as_slice() {
            [k, l, w] => (*k, l.parse::<usize>().ok(), *w),
            _ => continue,
        };
        let Some(l) = layer.filter(|&l| l < n_layers) else {
            continue;
        };
        let data = sf.data(t);
        match (kind, what, t.dtype) {
            ("reap", "score", Dtype::F64) => {
                if t.numel() != n_experts as u64 {
                    return Err(file_err(format!(
                        "`{}` has {} scores for a model of {n_experts} experts",
                        t.name,
                        t.numel()
                    )));
                }
                for (e, c) in data.chunks_exact(8).enumerate() {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    out[l][e] = f64::from_le_bytes(b);
                }
                found = true;
            }
            ("routes", "experts", Dtype::I16) => {
                for c in data.chunks_exact(2) {
                    let e = i16::from_le_bytes([c[0], c[1]]);
                    if e >= 0 && (e as usize) < n_experts {
                        out[l][e as usize] += 1.0;
                    }
                }
                found = true;
            }
            _ => {}
        }
    }
    if !found {
        return Err(file_err(
            "has neither `reap.{L}.score` (F64, from keep finalize) nor `routes.{L}.experts` (I16, from --record-routes)".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read_as_warm_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RouteLog::new();
        for (layer, ex) in [(0usize, [1u32, 2]), (1, [3, 3]), (0, [1, 0])] {
            log.on_route(&RouteEvent {
                layer,
                start_pos: 0,
                tokens: 1,
                top_k: 2,
                experts: &ex,
                weights: &[0.5, 0.25],
                scores: &[],
            });
        }
        assert_eq!(log.tokens(), 2);
        let p = dir.path().join("r.safetensors");
        log.write(&p, "s1", 4, false).unwrap();
        assert!(log.write(&p, "s1", 4, false).is_err());
        let sf = ShardFile::open(&p).unwrap();
        let m = &sf.header().metadata;
        assert_eq!(m["format"], "keep-routes");
        assert_eq!(m["top_k"], "2");
        assert_eq!(m["n_layers"], "2");
        assert_eq!(m["layers"], "0,1");
        let w = warm_scores(&p, 2, 4).unwrap();
        assert_eq!(w[0], vec![1.0, 2.0, 1.0, 0.0]);
        assert_eq!(w[1], vec![0.0, 0.0, 0.0, 2.0]);
    }

    #[test]
    fn reap_scores_as_warm_start() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("reap-stats.safetensors");
        let s0: Vec<u8> = [0.5f64, 2.0, 1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let v =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![3], &s0).unwrap();
        safetensors::tensor::serialize_to_file(vec![("reap.1.score", v)], None, &p).unwrap();
        let w = warm_scores(&p, 2, 3).unwrap();
        assert_eq!(w[0], vec![0.0; 3]);
        assert_eq!(w[1], vec![0.5, 2.0, 1.0]);
        // The wrong expert count is refused, naming the tensor.
        let e = warm_scores(&p, 2, 4).unwrap_err().to_string();
        assert!(e.contains("reap.1.score"), "{e}");
    }
}
