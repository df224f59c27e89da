//! Recording routes during a run (`keep run --record-routes FILE`) as a `keep-routes` session
//! (the format, its reader and its atomic writer are keep-artifacts' `routes`), and reading
//! warm-start scores: `reap.{L}.score` F64 `[n_experts]` from `reap-stats.safetensors` (`keep
//! finalize`; keep-artifacts' `reap::ReapScores` reader), or route frequencies counted from a route file. Hash-routed layers are marked in
//! the file (`hash_layers`), and `keep residency` counts their reads as prefetched.

use std::collections::BTreeMap;
use std::path::Path;

use keep_artifacts::reap::ReapScores;
use keep_artifacts::routes::{self, SessionRecorder};
use keep_model::{RouteEvent, RouteObserver};

use crate::{Result, RuntimeError};

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
    /// Experts routed per token (0 before the first route).
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Every recorded layer with its experts, token-major (`top_k` per token).
    pub fn layer_routes(&self) -> impl Iterator<Item = (usize, &[u32])> {
        self.layers.iter().map(|(&l, (e, _))| (l, e.as_slice()))
    }

    /// Write the log to `path` as a `keep-routes` session `session` (keep-artifacts' writer;
    /// refused if it exists unless `force`).
    pub fn write(&self, path: &Path, session: &str, n_experts: usize, force: bool) -> Result<()> {
        let mut rec = SessionRecorder::new(session, n_experts, self.top_k.max(1))
            .hash_layers(&self.hash_layers);
        for (&l, (ex, ws)) in &self.layers {
            rec.push(l, ex, ws)?;
        }
        routes::write_session(path, &rec.finish(), &BTreeMap::new(), force)?;
        Ok(())
    }
}

/// Warm-start scores per layer (`[layer][expert]`) from `reap-stats.safetensors`
/// (`reap.{L}.score` F64), a `keep-routes` file (route counts per expert) or a
/// `keep-route-profile` JSON file (its decayed scores).
pub fn warm_scores(path: &Path, n_layers: usize, n_experts: usize) -> Result<Vec<Vec<f64>>> {
    let file_err = |msg: String| RuntimeError::File {
        path: path.to_path_buf(),
        msg,
    };
    let mut out = vec![vec![0f64; n_experts]; n_layers];
    let mut found = false;
    if keep_artifacts::route_profile::RouteProfile::is_profile_file(path) {
        let p = keep_artifacts::route_profile::RouteProfile::read(path)?;
        if p.n_experts != n_experts {
            return Err(file_err(format!(
                "the route profile has {} experts per layer for a model of {n_experts}",
                p.n_experts
            )));
        }
        for (o, v) in out.iter_mut().zip(p.warm_scores()) {
            *o = v;
        }
        return Ok(out);
    }
    if ReapScores::is_reap_file(path)? {
        let file = ReapScores::read(path)?;
        if file.n_experts != n_experts {
            return Err(file_err(format!(
                "`reap.0.score` and the other layers' scores have {} entries for a model of {n_experts} experts",
                file.n_experts
            )));
        }
        for (o, v) in out.iter_mut().zip(file.scores) {
            *o = v;
        }
        found = true;
    }
    if !found && routes::has_routes(path)? {
        for lr in routes::read_session(path)?.layers {
            let Some(o) = out.get_mut(lr.layer) else {
                continue;
            };
            for &e in &lr.experts {
                if let Some(x) = o.get_mut(e as usize) {
                    *x += 1.0;
                }
            }
            found = true;
        }
    }
    if !found {
        return Err(file_err(
            "is neither REAP statistics (`keep-reap-stats`, from keep finalize) nor a route file (`routes.{L}.experts` I16, from --record-routes)".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use keep_checkpoint::ShardFile;

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
    fn route_profile_as_warm_start() {
        use keep_artifacts::route_profile::RouteProfile;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("plan.profile.json");
        let mut prof = RouteProfile::new("fp", 2, 3, 4.0);
        prof.fold([(1usize, &[2u32, 0][..])], 2).unwrap();
        prof.write(&p, false).unwrap();
        let w = warm_scores(&p, 2, 3).unwrap();
        assert_eq!(w, prof.warm_scores());
        assert!(w[1][2] > 0.0 && w[0][2] == 0.0);
        let e = warm_scores(&p, 2, 4).unwrap_err().to_string();
        assert!(e.contains("route profile"), "{e}");
    }

    #[test]
    fn reap_scores_as_warm_start() {
        use keep_artifacts::reap::{LayerReap, ReapStats};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("reap-stats.safetensors");
        let scores = vec![vec![0.0; 3], vec![0.5, 2.0, 1.0]];
        ReapStats {
            n_layers: 2,
            n_experts: 3,
            top_k: 1,
            hidden: 1,
            hash_layers: vec![],
            model_fingerprint: String::new(),
            pack_fingerprint: String::new(),
            split: "calib".into(),
            sessions: 1,
            tokens: 0,
            layers: vec![LayerReap::new(3, 1); 2],
            scores: scores.clone(),
        }
        .write(&p, false)
        .unwrap();
        let w = warm_scores(&p, 2, 3).unwrap();
        assert_eq!(w, scores);
        // A model with more layers keeps zeros where the statistics have none.
        let w = warm_scores(&p, 3, 3).unwrap();
        assert_eq!(w[2], vec![0.0; 3]);
        // The wrong expert count is refused, naming the tensor.
        let e = warm_scores(&p, 2, 4).unwrap_err().to_string();
        assert!(e.contains("reap.0.score"), "{e}");
        // A safetensors file that is neither is refused, saying what it should be.
        let other = dir.path().join("other.safetensors");
        keep_checkpoint::tensor_file::write(
            &other,
            &[keep_checkpoint::tensor_file::Tensor::f64(
                "reap.1.score",
                &[3],
                &[1.0; 3],
            )],
            &[],
            keep_checkpoint::tensor_file::KeyOrder::Listed,
            false,
        )
        .unwrap();
        let e = warm_scores(&other, 2, 3).unwrap_err().to_string();
        assert!(e.contains("keep-reap-stats"), "{e}");
    }
}
