//! Prune plans: which routed experts survive in each layer. Written by `keep select` (and by
//! `keep bench prune`'s half-experts plan), read by `keep prune`, by router-masked students in
//! `keep eval`, and by the prune equivalence tests.
//!
//! JSON, `format` = `keep-prune-plan`, `version` = 1:
//! ```json
//! {"format": "keep-prune-plan", "version": 1, "n_experts": 32, "keep": 16,
//!  "saliency": "reap", "layers": [{"layer": 0, "survivors": [0, 3, ...]},
//!  {"layer": 1, "survivors": null, "hash_routed": true}], "mtp_layers": []}
//! ```
//! A pruned hash-routed layer also carries `"hash_remap": {"policy": "nearest", "ranked_by":
//! "...", "candidates": {"5": [3, 0, ...], ...}}`: per removed expert, the kept experts in order
//! of preference (see [`crate::hashremap`]).
//! `survivors` are original expert ids in ascending order; an expert's new id is its index in
//! that list. `null` (or a missing layer) leaves the layer whole. Any other top-level field
//! (`model_fingerprint`, the selection's Jaccard figures, …) is kept in [`PrunePlan::extra`]
//! and written back unchanged. The file is `serde_json`'s pretty printing of the plan with no
//! trailing newline; [`PrunePlan::write`] validates before writing and writes atomically.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::hashremap::HashRemap;
use crate::{ArtifactError, Result};

/// One layer of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub layer: usize,
    /// Surviving original ids, ascending; `None` keeps the layer whole.
    pub survivors: Option<Vec<usize>>,
    /// Marked by `keep select` for hash-routed layers.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hash_routed: bool,
    /// A pruned hash-routed layer: what replaces each removed expert in `tid2eid`
    /// ([`crate::hashremap`]). Required when a hash-routed layer has survivors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash_remap: Option<HashRemap>,
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
    /// MTP layers the plan prunes too (others stay whole); each may keep its own count.
    #[serde(default)]
    pub mtp_layers: Vec<LayerPlan>,
    /// Anything else `keep select` records (fingerprints, Jaccard...).
    #[serde(default, flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

/// How a prune plan file is named in errors.
const KIND: crate::json::Kind = crate::json::Kind {
    a: "a prune plan",
    name: "prune plan",
};

impl PrunePlan {
    /// The format tag.
    pub const FORMAT: &'static str = "keep-prune-plan";
    /// The version this crate reads and writes.
    pub const VERSION: u32 = 1;

    /// An empty plan of the current format and version (every layer whole until `layers` is
    /// filled in).
    pub fn new(n_experts: usize, keep: usize, saliency: impl Into<String>) -> PrunePlan {
        PrunePlan {
            format: Self::FORMAT.into(),
            version: Self::VERSION,
            n_experts,
            keep,
            saliency: saliency.into(),
            layers: vec![],
            mtp_layers: vec![],
            extra: BTreeMap::new(),
        }
    }

    /// Read and validate a plan file (a regular file of at most
    /// [`keep_checkpoint::small_file::MAX_SMALL_FILE`] bytes).
    pub fn read(path: &Path) -> Result<PrunePlan> {
        crate::json::read(path, KIND, PrunePlan::validate)
    }

    /// Parse and validate the text of a plan; `path` only names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<PrunePlan> {
        crate::json::parse(path, text, KIND, PrunePlan::validate)
    }

    /// The bytes [`PrunePlan::write`] writes (pretty JSON, no trailing newline), after
    /// validating the plan.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        self.validate()
            .map_err(|e| ArtifactError::Config(format!("invalid prune plan: {e}")))?;
        serde_json::to_vec_pretty(self)
            .map_err(|e| ArtifactError::Config(format!("prune plan: {e}")))
    }

    /// Validate and write the plan to `path` atomically (temporary sibling, fsync, rename); an
    /// existing `path` is refused unless `force`, a non-regular one always.
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        let bytes = self.to_bytes()?;
        Ok(keep_checkpoint::atomic::write_file(path, &bytes, force)?)
    }

    /// Check the format tag, ranges (`n_experts` at most the config bound, so a router mask of
    /// that size is always small), order and uniqueness.
    pub fn validate(&self) -> std::result::Result<(), String> {
        crate::json::check_format(&self.format, self.version, Self::FORMAT, Self::VERSION)?;
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
        if let Some(l) = self.mtp_layers.iter().find(|l| l.hash_remap.is_some()) {
            return Err(format!("MTP layer {} has a hash_remap", l.layer));
        }
        for l in &self.layers {
            match (&l.survivors, &l.hash_remap) {
                (None, Some(_)) => {
                    return Err(format!(
                        "layer {} has a hash_remap but is left whole",
                        l.layer
                    ))
                }
                // (Survivors out of order or range are reported below.)
                (Some(s), Some(r))
                    if s.windows(2).all(|w| w[0] < w[1])
                        && s.iter().all(|&e| e < self.n_experts) =>
                {
                    r.validate(self.n_experts, s, 1)
                        .map_err(|e| format!("layer {}: hash_remap: {e}", l.layer))?;
                }
                _ => {}
            }
        }
        // An MTP module has its own router and its own expert count (`n_routed_experts_mtp`),
        // so only the decoder layers must keep exactly `keep`.
        let decoder = self.layers.iter().map(|l| (l, true));
        for (l, counted) in decoder.chain(self.mtp_layers.iter().map(|l| (l, false))) {
            if let Some(s) = &l.survivors {
                if counted && s.len() != self.keep {
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
                return Err(ArtifactError::Mismatch(
                    "the plan records no model_fingerprint: it cannot be checked against the model; make it with `keep select` for this model".into(),
                ))
            }
            Some(want) if want != have => {
                return Err(ArtifactError::Mismatch(format!(
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
                return Err(ArtifactError::Mismatch(format!(
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

    /// The remap of pruned hash-routed decoder layer `layer` (`None`: none recorded).
    pub fn hash_remap(&self, layer: usize) -> Option<&HashRemap> {
        self.layers
            .iter()
            .find(|l| l.layer == layer)
            .and_then(|l| l.hash_remap.as_ref())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PrunePlan {
        let mut p = PrunePlan::new(8, 3, "reap");
        p.layers = vec![
            LayerPlan {
                layer: 0,
                survivors: Some(vec![1, 4, 7]),
                hash_routed: false,
                hash_remap: None,
            },
            LayerPlan {
                layer: 1,
                survivors: None,
                hash_routed: true,
                hash_remap: None,
            },
            LayerPlan {
                layer: 2,
                survivors: Some(vec![0, 2, 5]),
                hash_routed: true,
                hash_remap: Some(crate::hashremap::HashRemap::uniform(
                    crate::hashremap::RemapPolicy::ReapNext,
                    "test",
                    8,
                    &[0, 2, 5],
                    &[5, 0, 2],
                )),
            },
        ];
        p.mtp_layers = vec![LayerPlan {
            layer: 0,
            survivors: Some(vec![0, 1, 2]),
            hash_routed: false,
            hash_remap: None,
        }];
        p.extra
            .insert("model_fingerprint".into(), "ab".repeat(32).into());
        p.extra
            .insert("mean_jaccard".into(), serde_json::json!(0.5));
        p
    }

    #[test]
    fn round_trip_keeps_every_field_and_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        let p = sample();
        p.write(&path, false).unwrap();
        let back = PrunePlan::read(&path).unwrap();
        assert_eq!(back, p);
        assert_eq!(std::fs::read(&path).unwrap(), back.to_bytes().unwrap());
        assert_eq!(back.survivors(0), Some(&[1, 4, 7][..]));
        assert_eq!(back.survivors(1), None);
        assert_eq!(back.mtp_survivors(0), Some(&[0, 1, 2][..]));
        assert_eq!(
            back.pruned_mask(0).unwrap(),
            vec![true, false, true, true, false, true, true, false]
        );
        assert_eq!(back.model_fingerprint(), Some("ab".repeat(32).as_str()));
        assert_eq!(back.hash_remap(2).unwrap().candidates[&1], vec![5, 0, 2]);
        assert!(back.hash_remap(0).is_none());
        // `hash_routed: false` and a missing remap are not written; `true` and a remap are.
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches("hash_routed").count(), 2);
        assert_eq!(text.matches("hash_remap").count(), 1);
        // A remap on a layer left whole, or naming a removed expert as a replacement, is invalid.
        let mut bad = p.clone();
        bad.layers[1].hash_remap = bad.layers[2].hash_remap.clone();
        assert!(bad.validate().unwrap_err().contains("left whole"));
        let mut bad = p.clone();
        bad.layers[2]
            .hash_remap
            .as_mut()
            .unwrap()
            .candidates
            .insert(1, vec![5, 3, 2]);
        assert!(bad.validate().unwrap_err().contains("not kept"));
        assert!(!text.ends_with('\n'));
    }

    #[test]
    fn existing_output_is_refused_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        std::fs::write(&path, b"old").unwrap();
        let err = sample().write(&path, false).unwrap_err();
        assert!(err.to_string().contains("exists"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        sample().write(&path, true).unwrap();
        assert_eq!(PrunePlan::read(&path).unwrap(), sample());
    }

    #[test]
    fn invalid_plans_are_refused_on_read_and_write() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plan.json");
        type Breaker = fn(&mut PrunePlan);
        let cases: Vec<(Breaker, &str)> = vec![
            (|p| p.format = "other".into(), "is not keep-prune-plan"),
            (|p| p.version = 2, "version 2"),
            (|p| p.keep = 9, "must be in 1..=n_experts"),
            (
                |p| p.layers[0].survivors = Some(vec![4, 1, 7]),
                "strictly ascending",
            ),
            (
                |p| p.layers[0].survivors = Some(vec![1, 4, 8]),
                "out of range",
            ),
            (|p| p.layers[0].survivors = Some(vec![1, 4]), "keeps 2"),
            (|p| p.layers[1].layer = 0, "twice"),
        ];
        for (break_it, want) in cases {
            let mut p = sample();
            break_it(&mut p);
            let err = p.write(&path, true).unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
            let text = serde_json::to_string_pretty(&p).unwrap();
            let err = PrunePlan::parse(&path, &text).unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
        }
        for bad in ["", "{", "[]", "{\"format\": 1}", "null"] {
            let err = PrunePlan::parse(&path, bad).unwrap_err().to_string();
            assert!(err.contains("not a prune plan"), "{err}");
        }
    }
}
