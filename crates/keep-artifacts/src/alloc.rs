//! Precision-tier allocations: which rung every routed expert is stored at under a byte budget.
//! Written by `keep alloc`, read by `keep quant --alloc` (the checkpoint it describes), `keep
//! eval --alloc` / `--tiers` and the runtime's tiers.
//!
//! JSON, `format` = `keep-alloc`, `version` = 1:
//! ```json
//! {"format": "keep-alloc", "version": 1,
//!  "model": "/path/to/model", "model_fingerprint": "…",
//!  "budget_bytes": 123456789, "bytes": 123400000,
//!  "rungs": [{"label": "pruned", "bytes_per_expert": 0},
//!            {"label": "e8p2", "bytes_per_expert": 24576}, …],
//!  "solver": "exact-mckp", "grain_bytes": 4096,
//!  "predicted_loss": 0.0123, "saliency": "reap",
//!  "layers": [{"layer": 0, "rungs": ["e8p2", "shipped", "pruned", …]}, …]}
//! ```
//! Rung labels are [`PRUNED`], `e8p2`, `e8p2+e81`, `e8p2+e8p2` (keep quant's method labels)
//! and [`SHIPPED`] (the expert as the model stores it). `bytes_per_expert` is one expert's
//! three projections at that rung, codes and scales included, from the model's real tensor
//! shapes; `bytes` is the sum over the allocation (at most `budget_bytes`); `predicted_loss` is
//! the solver's objective (Σ saliency × relative error of the chosen rung). `layers[i].rungs`
//! has one label per expert of that layer, each one of `rungs`' labels. Any other top-level
//! field is kept in [`Alloc::extra`]. [`Alloc::write`] validates and writes atomically.
//!
//! A [`LossModel`] (`keep-alloc-loss-model` v1, written by `keep alloc-fit`, read by `keep
//! alloc --loss-model`) calibrates the predicted loss on measured points: one multiplier per
//! rung, so that an allocation's predicted KL is Σ over its rungs of multiplier × Σ saliency ×
//! relative error (pruned: error 1). It keeps the points it was fitted on and the held-out
//! ones it was checked on, each with its per-rung terms, measured KL and prediction:
//! ```json
//! {"format": "keep-alloc-loss-model", "version": 1, "model_fingerprint": "…",
//!  "saliency": "reap-mass", "multipliers": {"pruned": 0.31, "e8p2": 0.12, …},
//!  "fitted": [{"alloc": "u-e8p2.json", "terms": {"e8p2": 0.06}, "kl": 0.0077,
//!              "predicted": 0.0075}, …],
//!  "held_out": […]}
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Result;

/// The rung of an expert that is removed.
pub const PRUNED: &str = "pruned";
/// The rung of an expert kept as the model stores it.
pub const SHIPPED: &str = "shipped";
/// The rung labels a file may use.
pub const LABELS: [&str; 5] = [PRUNED, "e8p2", "e8p2+e81", "e8p2+e8p2", SHIPPED];

/// One rung and what one expert costs at it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RungBytes {
    pub label: String,
    pub bytes_per_expert: u64,
}

/// One layer's rungs, one label per expert.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerAlloc {
    pub layer: usize,
    pub rungs: Vec<String>,
}

/// An allocation (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alloc {
    pub format: String,
    pub version: u32,
    pub model: String,
    pub model_fingerprint: String,
    pub budget_bytes: u64,
    pub bytes: u64,
    pub rungs: Vec<RungBytes>,
    pub solver: String,
    pub grain_bytes: u64,
    pub predicted_loss: f64,
    pub saliency: String,
    pub layers: Vec<LayerAlloc>,
    #[serde(default, flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// How an allocation file is named in errors.
const KIND: crate::json::Kind = crate::json::Kind {
    a: "an allocation",
    name: "allocation",
};

impl Alloc {
    /// The format tag.
    pub const FORMAT: &'static str = "keep-alloc";
    /// The version this crate reads and writes.
    pub const VERSION: u32 = 1;

    /// Read and validate an allocation file (a regular file of at most
    /// [`keep_checkpoint::small_file::MAX_SMALL_FILE`] bytes).
    pub fn read(path: &Path) -> Result<Alloc> {
        crate::json::read(path, KIND, Alloc::validate)
    }

    /// Parse and validate the text of an allocation; `path` only names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Alloc> {
        crate::json::parse(path, text, KIND, Alloc::validate)
    }

    /// Validate and write atomically (temporary sibling, fsync, rename); an existing `path` is
    /// refused unless `force`, a non-regular one always. Pretty JSON, no trailing newline.
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        crate::json::write(self, path, force, true, KIND, Alloc::validate)
    }

    /// Check the format tag, the rung labels, the layers (ascending, unique) and the byte sum.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::json::check_format(&self.format, self.version, Self::FORMAT, Self::VERSION)?;
        let mut costs = BTreeMap::new();
        for r in &self.rungs {
            if !LABELS.contains(&r.label.as_str()) {
                return Err(format!(
                    "unknown rung `{}` (known: {})",
                    r.label,
                    LABELS.join(", ")
                ));
            }
            if costs.insert(r.label.as_str(), r.bytes_per_expert).is_some() {
                return Err(format!("rung `{}` listed twice", r.label));
            }
        }
        if !self.predicted_loss.is_finite() || self.predicted_loss < 0.0 {
            return Err(format!("predicted_loss {} is not ≥ 0", self.predicted_loss));
        }
        let mut total = 0u64;
        let mut last: Option<usize> = None;
        for l in &self.layers {
            if last.is_some_and(|p| p >= l.layer) {
                return Err(format!("layer {} is out of order or repeated", l.layer));
            }
            last = Some(l.layer);
            if l.rungs.len() > keep_checkpoint::config::MAX_EXPERTS {
                return Err(format!("layer {} lists {} experts", l.layer, l.rungs.len()));
            }
            for (e, r) in l.rungs.iter().enumerate() {
                let c = costs.get(r.as_str()).ok_or_else(|| {
                    format!(
                        "layer {} expert {e}: rung `{r}` is not among the file's rungs",
                        l.layer
                    )
                })?;
                total = total.saturating_add(*c);
            }
        }
        if total != self.bytes {
            return Err(format!(
                "the experts' rungs add up to {total} bytes, the file says {}",
                self.bytes
            ));
        }
        if self.bytes > self.budget_bytes {
            return Err(format!(
                "{} bytes is over the budget of {} bytes",
                self.bytes, self.budget_bytes
            ));
        }
        Ok(())
    }

    /// The rung label of expert `expert` of `layer` (`None` for a layer or expert the file
    /// does not list).
    pub fn rung(&self, layer: usize, expert: usize) -> Option<&str> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .and_then(|l| l.rungs.get(expert))
            .map(String::as_str)
    }

    /// Experts per rung label over the whole allocation.
    pub fn mix(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for l in &self.layers {
            for r in &l.rungs {
                *m.entry(r.clone()).or_default() += 1;
            }
        }
        m
    }
}

/// One measured point of a [`LossModel`]: an allocation, its loss terms per rung (Σ saliency
/// × relative error over the experts at that rung), its measured KL and the fitted model's
/// prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossPoint {
    pub alloc: String,
    pub terms: BTreeMap<String, f64>,
    pub kl: f64,
    pub predicted: f64,
}

/// A loss model fitted on measured points (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LossModel {
    pub format: String,
    pub version: u32,
    pub model_fingerprint: String,
    pub saliency: String,
    /// KL per unit of saliency × relative error, per rung label.
    pub multipliers: BTreeMap<String, f64>,
    pub fitted: Vec<LossPoint>,
    pub held_out: Vec<LossPoint>,
    #[serde(default, flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// How a loss-model file is named in errors.
const LOSS_KIND: crate::json::Kind = crate::json::Kind {
    a: "a loss model",
    name: "loss model",
};

impl LossModel {
    /// The format tag.
    pub const FORMAT: &'static str = "keep-alloc-loss-model";
    /// The version this crate reads and writes.
    pub const VERSION: u32 = 1;

    /// Read and validate a loss-model file.
    pub fn read(path: &Path) -> Result<LossModel> {
        crate::json::read(path, LOSS_KIND, LossModel::validate)
    }

    /// Validate and write atomically (as [`Alloc::write`]).
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        crate::json::write(self, path, force, true, LOSS_KIND, LossModel::validate)
    }

    /// Check the format tag, the labels and that every number is finite and ≥ 0.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::json::check_format(&self.format, self.version, Self::FORMAT, Self::VERSION)?;
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        for (k, &v) in &self.multipliers {
            if !LABELS.contains(&k.as_str()) {
                return Err(format!("unknown rung `{k}` among the multipliers"));
            }
            if !ok(v) {
                return Err(format!("multiplier of `{k}` is {v}, not ≥ 0"));
            }
        }
        for p in self.fitted.iter().chain(&self.held_out) {
            if !ok(p.kl) || !ok(p.predicted) || !p.terms.values().all(|&v| ok(v)) {
                return Err(format!("point {}: a number that is not ≥ 0", p.alloc));
            }
            if let Some(k) = p.terms.keys().find(|k| !LABELS.contains(&k.as_str())) {
                return Err(format!("point {}: unknown rung `{k}`", p.alloc));
            }
        }
        if self.fitted.is_empty() {
            return Err("no fitted points".into());
        }
        Ok(())
    }

    /// The predicted KL of per-rung terms: Σ multiplier × term (a rung without a multiplier
    /// and a nonzero term is an error).
    pub fn predict(&self, terms: &BTreeMap<String, f64>) -> std::result::Result<f64, String> {
        let mut sum = 0.0;
        for (k, &t) in terms {
            if t == 0.0 {
                continue;
            }
            let m = self.multipliers.get(k).ok_or_else(|| {
                format!("the loss model has no multiplier for rung `{k}` (no fitted point used it)")
            })?;
            sum += m * t;
        }
        Ok(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Alloc {
        Alloc {
            format: Alloc::FORMAT.into(),
            version: Alloc::VERSION,
            model: "m".into(),
            model_fingerprint: "fp".into(),
            budget_bytes: 100,
            bytes: 40,
            rungs: vec![
                RungBytes {
                    label: PRUNED.into(),
                    bytes_per_expert: 0,
                },
                RungBytes {
                    label: "e8p2".into(),
                    bytes_per_expert: 10,
                },
                RungBytes {
                    label: SHIPPED.into(),
                    bytes_per_expert: 30,
                },
            ],
            solver: "exact-mckp".into(),
            grain_bytes: 1,
            predicted_loss: 0.5,
            saliency: "reap".into(),
            layers: vec![LayerAlloc {
                layer: 0,
                rungs: vec!["e8p2".into(), PRUNED.into(), SHIPPED.into()],
            }],
            extra: BTreeMap::new(),
        }
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        let a = sample();
        a.write(&p, false).unwrap();
        assert_eq!(Alloc::read(&p).unwrap(), a);
        assert!(a.write(&p, false).is_err(), "existing output refused");
        a.write(&p, true).unwrap();
        assert_eq!(a.rung(0, 2), Some(SHIPPED));
        assert_eq!(a.mix()["e8p2"], 1);

        let mut bad = a.clone();
        bad.bytes = 41;
        assert!(bad.validate().unwrap_err().contains("add up to 40"));
        let mut bad = a.clone();
        bad.budget_bytes = 39;
        assert!(bad.validate().unwrap_err().contains("over the budget"));
        let mut bad = a.clone();
        bad.layers[0].rungs[0] = "e8p2+e81".into();
        assert!(bad.validate().unwrap_err().contains("not among"));
        let mut bad = a.clone();
        bad.rungs[0].label = "fp3".into();
        assert!(bad.validate().unwrap_err().contains("unknown rung"));
        let text = String::from_utf8(serde_json::to_vec(&a).unwrap())
            .unwrap()
            .replace("keep-alloc", "keep-prune-plan");
        assert!(Alloc::parse(&p, &text).is_err());
    }

    #[test]
    fn loss_model_round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lm.json");
        let point = LossPoint {
            alloc: "a.json".into(),
            terms: BTreeMap::from([("e8p2".into(), 2.0), (PRUNED.into(), 1.0)]),
            kl: 0.5,
            predicted: 0.5,
        };
        let m = LossModel {
            format: LossModel::FORMAT.into(),
            version: LossModel::VERSION,
            model_fingerprint: "fp".into(),
            saliency: "reap-mass".into(),
            multipliers: BTreeMap::from([("e8p2".into(), 0.1), (PRUNED.into(), 0.3)]),
            fitted: vec![point.clone()],
            held_out: vec![],
            extra: BTreeMap::new(),
        };
        m.write(&p, false).unwrap();
        assert_eq!(LossModel::read(&p).unwrap(), m);
        assert!(m.write(&p, false).is_err(), "existing output refused");
        let got = m.predict(&point.terms).unwrap();
        assert!((got - 0.5).abs() < 1e-12, "{got}");
        let missing = BTreeMap::from([("e8p2+e81".to_string(), 1.0)]);
        assert!(m.predict(&missing).unwrap_err().contains("no multiplier"));
        let mut bad = m.clone();
        bad.multipliers.insert("e8p2".into(), -1.0);
        assert!(bad.validate().unwrap_err().contains("not ≥ 0"));
        let mut bad = m.clone();
        bad.fitted.clear();
        assert!(bad.validate().unwrap_err().contains("no fitted"));
        let mut bad = m.clone();
        bad.multipliers.insert("fp3".into(), 1.0);
        assert!(bad.validate().unwrap_err().contains("unknown rung"));
    }
}
