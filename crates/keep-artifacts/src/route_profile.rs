//! Route profiles: the runtime's persistent record of which routed experts a model uses, kept
//! across runs beside a fit plan so that the next run warm-starts its expert slots from it.
//!
//! JSON, `format` = `keep-route-profile`, `version` = 1: `model_fingerprint`, `n_layers`,
//! `n_experts`, `half_life` (tokens), `tokens` and `runs` folded in so far, and per layer
//! `counts` (every use ever seen) and `scores` (uses decayed by `half_life` tokens: a use `t`
//! tokens before the end of the latest run weighs `0.5^(t / half_life)`), so the warm start
//! follows what the model has been asked lately. Its size is bounded by layers × experts, never
//! by how long the model ran: raw traces are not kept. [`RouteProfile::fold`] adds one run's
//! routes; [`RouteProfile::read`] / [`RouteProfile::write`] are the one reader and the atomic
//! writer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Result;

/// The format tag.
pub const FORMAT: &str = "keep-route-profile";
/// The version this crate reads and writes.
pub const VERSION: u32 = 1;
/// Default half-life of the decayed scores, in tokens: long enough that one short run does
/// not erase what earlier runs learned.
pub const DEFAULT_HALF_LIFE: f64 = 4096.0;
/// Largest layer and expert counts a profile may hold (far above any published MoE; bounds
/// the file).
pub const MAX_LAYERS: usize = 1024;
pub const MAX_EXPERTS: usize = 65_536;

/// One layer's counts and decayed scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerProfile {
    pub counts: Vec<u64>,
    pub scores: Vec<f64>,
}

/// A route profile (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteProfile {
    pub format: String,
    pub version: u32,
    pub model_fingerprint: String,
    pub n_layers: usize,
    pub n_experts: usize,
    pub half_life: f64,
    pub tokens: u64,
    pub runs: u64,
    pub layers: Vec<LayerProfile>,
}

/// How a route profile file is named in errors.
const KIND: crate::json::Kind = crate::json::Kind {
    a: "a route profile",
    name: "route profile",
};

impl RouteProfile {
    /// An empty profile.
    pub fn new(
        model_fingerprint: impl Into<String>,
        n_layers: usize,
        n_experts: usize,
        half_life: f64,
    ) -> RouteProfile {
        RouteProfile {
            format: FORMAT.into(),
            version: VERSION,
            model_fingerprint: model_fingerprint.into(),
            n_layers,
            n_experts,
            half_life,
            tokens: 0,
            runs: 0,
            layers: vec![
                LayerProfile {
                    counts: vec![0; n_experts],
                    scores: vec![0.0; n_experts],
                };
                n_layers
            ],
        }
    }

    /// Check the format tag, the bounds and the shapes.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::json::check_format(&self.format, self.version, FORMAT, VERSION)?;
        if self.n_layers > MAX_LAYERS || self.n_experts > MAX_EXPERTS || self.n_experts == 0 {
            return Err(format!(
                "{} layers of {} experts is outside 0..={MAX_LAYERS} layers of 1..={MAX_EXPERTS} experts",
                self.n_layers, self.n_experts
            ));
        }
        if !(self.half_life.is_finite() && self.half_life > 0.0) {
            return Err(format!("half_life {} is not positive", self.half_life));
        }
        if self.layers.len() != self.n_layers {
            return Err(format!(
                "{} layers listed for n_layers = {}",
                self.layers.len(),
                self.n_layers
            ));
        }
        for (l, lp) in self.layers.iter().enumerate() {
            if lp.counts.len() != self.n_experts || lp.scores.len() != self.n_experts {
                return Err(format!(
                    "layer {l} has {} counts and {} scores for {} experts",
                    lp.counts.len(),
                    lp.scores.len(),
                    self.n_experts
                ));
            }
            if lp.scores.iter().any(|s| !s.is_finite() || *s < 0.0) {
                return Err(format!("layer {l} has a negative or non-finite score"));
            }
        }
        Ok(())
    }

    /// Fold one run's routes in: per layer, the experts routed at each token, token-major
    /// (`top_k` per token). Older scores decay by the layer's tokens of this run; each use at
    /// token `t` of `T` adds `0.5^((T − 1 − t) / half_life)`. Layers or experts outside the
    /// profile are an error.
    pub fn fold<'a>(
        &mut self,
        routes: impl IntoIterator<Item = (usize, &'a [u32])>,
        top_k: usize,
    ) -> std::result::Result<(), String> {
        if top_k == 0 {
            return Err("top_k is 0".into());
        }
        let step = 0.5f64.powf(1.0 / self.half_life);
        let mut most = 0u64;
        for (layer, experts) in routes {
            let n_experts = self.n_experts;
            let lp = self.layers.get_mut(layer).ok_or_else(|| {
                format!("layer {layer} is outside the profile's {}", self.n_layers)
            })?;
            let t_len = experts.len() / top_k;
            most = most.max(t_len as u64);
            let old = step.powf(t_len as f64);
            for s in lp.scores.iter_mut() {
                *s *= old;
            }
            for (i, &e) in experts.iter().enumerate() {
                let e = e as usize;
                if e >= n_experts {
                    return Err(format!(
                        "layer {layer} routes to expert {e} of a profile of {n_experts}"
                    ));
                }
                let t = i / top_k;
                lp.counts[e] += 1;
                lp.scores[e] += step.powf((t_len.saturating_sub(1 + t)) as f64);
            }
        }
        self.tokens += most;
        self.runs += 1;
        Ok(())
    }

    /// The warm-start scores per layer (`[layer][expert]`, the decayed scores).
    pub fn warm_scores(&self) -> Vec<Vec<f64>> {
        self.layers.iter().map(|l| l.scores.clone()).collect()
    }

    /// Whether `path` holds a route profile (a JSON file whose `format` is this one), without
    /// reading more than the file's first bytes.
    pub fn is_profile_file(path: &Path) -> bool {
        use std::io::Read;
        let mut head = [0u8; 256];
        let n = std::fs::File::open(path)
            .and_then(|mut f| f.read(&mut head))
            .unwrap_or(0);
        let s = String::from_utf8_lossy(&head[..n]);
        s.trim_start().starts_with('{') && s.contains(FORMAT)
    }

    /// Read and validate a profile.
    pub fn read(path: &Path) -> Result<RouteProfile> {
        crate::json::read(path, KIND, RouteProfile::validate)
    }

    /// Validate and write atomically (a profile is replaced on every run, so `force` is the
    /// caller's choice).
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        crate::json::write(self, path, force, false, KIND, RouteProfile::validate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sums of a few powers of two: exact in f64 up to rounding of `powf`.
    const SCORE_TOL: f64 = 1e-12;

    #[test]
    fn fold_decays_and_round_trips() {
        let mut p = RouteProfile::new("fp", 2, 4, 1.0);
        // Layer 0: token 0 uses {0, 1}, token 1 uses {1, 2}; half-life 1 token.
        p.fold([(0usize, &[0u32, 1, 1, 2][..])], 2).unwrap();
        assert_eq!(p.layers[0].counts, vec![1, 2, 1, 0]);
        let s = &p.layers[0].scores;
        assert!((s[0] - 0.5).abs() < SCORE_TOL);
        assert!((s[1] - 1.5).abs() < SCORE_TOL);
        assert!((s[2] - 1.0).abs() < SCORE_TOL);
        assert_eq!(p.tokens, 2);
        // A second run of one token halves the old scores.
        p.fold([(0usize, &[3u32, 0][..])], 2).unwrap();
        let s = &p.layers[0].scores;
        assert!((s[0] - 1.25).abs() < SCORE_TOL);
        assert!((s[3] - 1.0).abs() < SCORE_TOL);
        assert_eq!(p.runs, 2);

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("profile.json");
        p.write(&f, false).unwrap();
        assert!(RouteProfile::is_profile_file(&f));
        assert_eq!(RouteProfile::read(&f).unwrap(), p);
        assert!(p.write(&f, false).is_err());
        p.write(&f, true).unwrap();

        assert!(p.fold([(5usize, &[0u32, 1][..])], 2).is_err());
        assert!(p.fold([(0usize, &[9u32, 1][..])], 2).is_err());
        let mut bad = p.clone();
        bad.layers[1].scores.pop();
        assert!(bad.validate().is_err());
    }
}
