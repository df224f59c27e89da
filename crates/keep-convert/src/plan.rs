//! The pruning plan: which routed experts survive in each layer (written by `keep select`,
//! read by `keep prune` and by router-masked students).
//!
//! JSON, `format` = `keep-prune-plan`, `version` = 1:
//! ```json
//! {"format": "keep-prune-plan", "version": 1, "n_experts": 32, "keep": 16,
//!  "saliency": "reap", "layers": [{"layer": 0, "survivors": [0, 3, ...]},
//!  {"layer": 1, "survivors": null, "hash_routed": true}], "mtp_layers": []}
//! ```
//! `survivors` are original expert ids in ascending order; an expert's new id is its index in
//! that list. `null` (or a missing layer) leaves the layer whole.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{ConvertError, Result};

/// One layer of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub layer: usize,
    /// Surviving original ids, ascending; `None` keeps the layer whole.
    pub survivors: Option<Vec<usize>>,
    /// Marked by `keep select` for hash-routed layers it left whole.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hash_routed: bool,
}

/// A pruning plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrunePlan {
    pub format: String,
    pub version: u32,
    /// Experts per layer in the model the plan was made for.
    pub n_experts: usize,
    /// Survivors per pruned layer.
    pub keep: usize,
    /// How the survivors were chosen (informational).
    #[serde(default)]
    pub saliency: String,
    pub layers: Vec<LayerPlan>,
    /// MTP layers the plan prunes too (others stay whole).
    #[serde(default)]
    pub mtp_layers: Vec<LayerPlan>,
    /// Anything else `keep select` records (fingerprints, Jaccard...).
    #[serde(default, flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl PrunePlan {
    /// The format tag.
    pub const FORMAT: &'static str = "keep-prune-plan";

    /// Read and validate a plan file.
    pub fn read(path: &Path) -> Result<PrunePlan> {
        let text = keep_checkpoint::small_file::read_text(
            path,
            keep_checkpoint::small_file::MAX_SMALL_FILE,
        )?;
        let plan: PrunePlan = serde_json::from_str(&text).map_err(|e| {
            ConvertError::Invalid(format!("{}: not a prune plan: {e}", path.display()))
        })?;
        plan.validate()
            .map_err(|e| ConvertError::Invalid(format!("{}: {e}", path.display())))?;
        Ok(plan)
    }

    /// Check the format tag, ranges (`n_experts` at most the config bound, so a router mask of
    /// that size is always small), order and uniqueness.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.format != Self::FORMAT || self.version != 1 {
            return Err(format!(
                "format `{}` version {} is not {} version 1",
                self.format,
                self.version,
                Self::FORMAT
            ));
        }
        if self.n_experts > keep_checkpoint::config::MAX_EXPERTS {
            return Err(format!(
                "n_experts = {} is more than any model keep reads ({})",
                self.n_experts,
                keep_checkpoint::config::MAX_EXPERTS
            ));
        }
        if self.n_experts == 0 || self.keep == 0 || self.keep > self.n_experts {
            return Err(format!(
                "keep = {} must be in 1..=n_experts ({})",
                self.keep, self.n_experts
            ));
        }
        for (what, ls) in [("layers", &self.layers), ("mtp_layers", &self.mtp_layers)] {
            let mut seen = std::collections::BTreeSet::new();
            if let Some(l) = ls.iter().find(|l| !seen.insert(l.layer)) {
                return Err(format!("{what} lists layer {} twice", l.layer));
            }
        }
        for l in self.layers.iter().chain(&self.mtp_layers) {
            if let Some(s) = &l.survivors {
                if s.len() != self.keep {
                    return Err(format!(
                        "layer {} keeps {} experts but the plan's keep is {}",
                        l.layer,
                        s.len(),
                        self.keep
                    ));
                }
                if s.is_empty() {
                    return Err(format!("layer {} keeps no experts", l.layer));
                }
                if s.windows(2).any(|w| w[0] >= w[1]) {
                    return Err(format!(
                        "layer {}: survivors must be strictly ascending",
                        l.layer
                    ));
                }
                if let Some(&bad) = s.iter().find(|&&e| e >= self.n_experts) {
                    return Err(format!(
                        "layer {}: expert {bad} is out of range (n_experts = {})",
                        l.layer, self.n_experts
                    ));
                }
            }
        }
        Ok(())
    }

    /// The fingerprint of the model the plan was made for (`model_fingerprint`, recorded by
    /// `keep select`; [`keep_checkpoint::fingerprint::model_fingerprint`]).
    pub fn model_fingerprint(&self) -> Option<&str> {
        self.extra.get("model_fingerprint").and_then(|v| v.as_str())
    }

    /// Record that the plan is for the model in `dir`.
    pub fn bind_to(&mut self, dir: &Path) -> Result<()> {
        let fp = keep_checkpoint::fingerprint::model_fingerprint(dir)?;
        self.extra.insert("model_fingerprint".into(), fp.into());
        Ok(())
    }

    /// Check that the plan was made for the model in `dir` (its fingerprint) and that every
    /// layer it names exists there (`n_layers` decoder layers, `n_mtp` MTP layers).
    pub fn check_model(&self, dir: &Path, n_layers: usize, n_mtp: usize) -> Result<()> {
        let have = keep_checkpoint::fingerprint::model_fingerprint(dir)?;
        match self.model_fingerprint() {
            None => {
                return Err(ConvertError::Invalid(
                    "the plan records no model_fingerprint: it cannot be checked against the model; make it with `keep select` for this model".into(),
                ))
            }
            Some(want) if want != have => {
                return Err(ConvertError::Invalid(format!(
                    "the plan was made for the model with fingerprint {}, but {} has fingerprint {}: make a plan for this model",
                    want.get(..12).unwrap_or(want),
                    dir.display(),
                    have.get(..12).unwrap_or(&have)
                )))
            }
            Some(_) => {}
        }
        for (what, ls, n) in [
            ("layer", &self.layers, n_layers),
            ("MTP layer", &self.mtp_layers, n_mtp),
        ] {
            if let Some(l) = ls.iter().find(|l| l.layer >= n) {
                return Err(ConvertError::Invalid(format!(
                    "the plan names {what} {} but {} has {n}",
                    l.layer,
                    dir.display()
                )));
            }
        }
        Ok(())
    }

    /// Survivors of decoder layer `layer` (`None` = whole).
    pub fn survivors(&self, layer: usize) -> Option<&[usize]> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .and_then(|l| l.survivors.as_deref())
    }

    /// Survivors of MTP layer `n` (`None` = whole).
    pub fn mtp_survivors(&self, n: usize) -> Option<&[usize]> {
        self.mtp_layers
            .iter()
            .find(|l| l.layer == n)
            .and_then(|l| l.survivors.as_deref())
    }

    /// The router mask of decoder layer `layer` for a router-masked student, in keep-model's
    /// convention: `true` marks a pruned expert (never chosen; the gate weights renormalise
    /// over the survivors). `None` when the plan leaves the layer whole.
    pub fn pruned_mask(&self, layer: usize) -> Option<Vec<bool>> {
        self.survivors(layer).map(|s| {
            let mut m = vec![true; self.n_experts];
            for &e in s {
                m[e] = false;
            }
            m
        })
    }
}
