//! Remapping a hash-routed layer's `tid2eid` when the layer's experts are pruned.
//!
//! A hash-routed layer (`ffn.gate.tid2eid`, `[vocab × top_k]`) routes each token to fixed
//! expert ids. When the plan removes an expert that the table still names, every slot naming it
//! must name a kept expert instead. A [`HashRemap`] gives, per removed expert, the kept experts
//! in order of preference; [`remap_row`] replaces each removed id of a token's row by the first
//! candidate not already among the row's ids (so a token never sees one expert twice), leaving
//! kept ids in place. The result is in the original expert ids; prune then renumbers it.
//!
//! Policies (how `keep select` orders the candidates; [`RemapPolicy`]):
//! - `reap-next`: kept experts by the layer's REAP saliency (Σ g·‖f‖ / count, with the hash
//!   routing's gate weights), highest first — the token's next-best kept expert;
//! - `nearest`: kept experts by the mean squared Euclidean distance between their outputs and
//!   the removed expert's outputs (before the gate weight) on the calibration tokens routed to
//!   the removed expert, nearest first (a removed expert no calibration token reached falls back
//!   to the `reap-next` order);
//! - `frequency`: kept experts by calibration route count, highest first (a baseline).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How a plan orders the replacements of a hash layer's removed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemapPolicy {
    ReapNext,
    Nearest,
    Frequency,
}

impl RemapPolicy {
    /// Every policy, in documentation order.
    pub const ALL: [RemapPolicy; 3] = [
        RemapPolicy::ReapNext,
        RemapPolicy::Nearest,
        RemapPolicy::Frequency,
    ];

    /// The name in plans and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RemapPolicy::ReapNext => "reap-next",
            RemapPolicy::Nearest => "nearest",
            RemapPolicy::Frequency => "frequency",
        }
    }

    /// Parse a name (see [`RemapPolicy::name`]).
    pub fn parse(s: &str) -> Option<RemapPolicy> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }
}

/// The distance `nearest` ranks by, as recorded in plans.
pub const NEAREST_DISTANCE: &str = "mean squared L2 distance between the kept expert's and the removed expert's outputs (before the gate weight) over the calibration tokens tid2eid routes to the removed expert";

/// The remap of one pruned hash-routed layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HashRemap {
    /// The policy that ordered the candidates (`reap-next`, `nearest`, `frequency`).
    pub policy: String,
    /// What the policy ranked by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranked_by: Option<String>,
    /// Per removed expert (original id), kept experts (original ids) in order of preference.
    pub candidates: BTreeMap<usize, Vec<usize>>,
}

impl HashRemap {
    /// A remap giving every removed expert the same preference order `ranking` (kept experts,
    /// best first).
    pub fn uniform(
        policy: RemapPolicy,
        ranked_by: &str,
        n_experts: usize,
        survivors: &[usize],
        ranking: &[usize],
    ) -> HashRemap {
        HashRemap {
            policy: policy.name().into(),
            ranked_by: Some(ranked_by.into()),
            candidates: (0..n_experts)
                .filter(|e| survivors.binary_search(e).is_err())
                .map(|e| (e, ranking.to_vec()))
                .collect(),
        }
    }

    /// Check the remap against a layer's survivors (ascending) and `top_k`: every removed
    /// expert has candidates, at least `top_k` of them (so a row always finds a free one), all
    /// kept and distinct, and nothing else is listed.
    pub fn validate(
        &self,
        n_experts: usize,
        survivors: &[usize],
        top_k: usize,
    ) -> Result<(), String> {
        if RemapPolicy::parse(&self.policy).is_none() {
            return Err(format!(
                "unknown remap policy `{}` (reap-next, nearest, frequency)",
                self.policy
            ));
        }
        for e in 0..n_experts {
            let removed = survivors.binary_search(&e).is_err();
            match (removed, self.candidates.get(&e)) {
                (true, None) => return Err(format!("removed expert {e} has no replacement")),
                (false, Some(_)) => {
                    return Err(format!("expert {e} is kept but has replacements listed"))
                }
                (true, Some(c)) => {
                    if c.len() < top_k {
                        return Err(format!(
                            "removed expert {e} has {} replacements; a token names {top_k} experts, so at least {top_k} are needed",
                            c.len()
                        ));
                    }
                    let mut seen = std::collections::BTreeSet::new();
                    for &j in c {
                        if survivors.binary_search(&j).is_err() {
                            return Err(format!(
                                "removed expert {e} lists replacement {j}, which is not kept"
                            ));
                        }
                        if !seen.insert(j) {
                            return Err(format!("removed expert {e} lists replacement {j} twice"));
                        }
                    }
                }
                (false, None) => {}
            }
        }
        if let Some(&bad) = self.candidates.keys().find(|&&e| e >= n_experts) {
            return Err(format!(
                "replacements listed for expert {bad}, outside 0..{n_experts}"
            ));
        }
        Ok(())
    }
}

/// One token's row of expert ids with every removed id replaced (see the module doc).
/// `survivors` ascending; the remap must have been validated against them.
pub fn remap_row(row: &[u32], survivors: &[usize], remap: &HashRemap) -> Result<Vec<u32>, String> {
    let mut out = row.to_vec();
    for s in 0..row.len() {
        let e = row[s] as usize;
        if survivors.binary_search(&e).is_ok() {
            continue;
        }
        let cands = remap
            .candidates
            .get(&e)
            .ok_or_else(|| format!("removed expert {e} has no replacement"))?;
        let pick = cands
            .iter()
            .copied()
            .find(|&c| !out.contains(&(c as u32)))
            .ok_or_else(|| format!("no replacement of expert {e} is free in row {row:?}"))?;
        out[s] = pick as u32;
    }
    Ok(out)
}

/// A whole table (`[vocab × top_k]` original ids) remapped row by row.
pub fn remap_table(
    ids: &[u32],
    top_k: usize,
    survivors: &[usize],
    remap: &HashRemap,
) -> Result<Vec<u32>, String> {
    if top_k == 0 || !ids.len().is_multiple_of(top_k) {
        return Err(format!("{} ids are not rows of {top_k}", ids.len()));
    }
    let mut out = Vec::with_capacity(ids.len());
    for row in ids.chunks_exact(top_k) {
        out.extend(remap_row(row, survivors, remap)?);
    }
    Ok(out)
}

/// Per removed expert, the kept experts ranked by the layer's `score` (highest first, ties by
/// the lower id).
pub fn rank_desc(survivors: &[usize], score: &[f64]) -> Vec<usize> {
    let mut r = survivors.to_vec();
    r.sort_by(|&a, &b| {
        let (sa, sb) = (score.get(a).copied(), score.get(b).copied());
        sb.unwrap_or(f64::NEG_INFINITY)
            .total_cmp(&sa.unwrap_or(f64::NEG_INFINITY))
            .then(a.cmp(&b))
    });
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remap(cands: &[(usize, &[usize])]) -> HashRemap {
        HashRemap {
            policy: "nearest".into(),
            ranked_by: None,
            candidates: cands.iter().map(|(e, c)| (*e, c.to_vec())).collect(),
        }
    }

    #[test]
    fn rows_take_the_first_free_candidate() {
        // 6 experts, keep 0, 2, 4, 5; remove 1, 3.
        let surv = [0, 2, 4, 5];
        let r = remap(&[(1, &[2, 0, 4, 5]), (3, &[2, 5, 0, 4])]);
        r.validate(6, &surv, 2).unwrap();
        assert_eq!(remap_row(&[1, 4], &surv, &r).unwrap(), vec![2, 4]);
        // 2 is already in the row: the next candidate.
        assert_eq!(remap_row(&[2, 1], &surv, &r).unwrap(), vec![2, 0]);
        // Two removed ids wanting the same first choice: the second slot takes its next one.
        assert_eq!(remap_row(&[1, 3], &surv, &r).unwrap(), vec![2, 5]);
        assert_eq!(remap_row(&[0, 5], &surv, &r).unwrap(), vec![0, 5]);
        let t = remap_table(&[1, 4, 3, 1, 0, 2], 2, &surv, &r).unwrap();
        assert_eq!(t, vec![2, 4, 2, 0, 0, 2]);
        for row in t.chunks(2) {
            assert_ne!(row[0], row[1]);
            assert!(row.iter().all(|&j| surv.contains(&(j as usize))));
        }
    }

    #[test]
    fn validation_refuses_bad_remaps() {
        let surv = [0, 2, 4, 5];
        assert!(remap(&[(1, &[2, 0])]).validate(6, &surv, 2).is_err()); // 3 missing
        assert!(remap(&[(1, &[2, 0]), (3, &[2])])
            .validate(6, &surv, 2)
            .is_err()); // too few
        assert!(remap(&[(1, &[2, 1]), (3, &[2, 0])])
            .validate(6, &surv, 2)
            .is_err()); // not kept
        assert!(remap(&[(1, &[2, 2]), (3, &[2, 0])])
            .validate(6, &surv, 2)
            .is_err()); // twice
        assert!(remap(&[(1, &[2, 0]), (3, &[2, 0]), (4, &[0, 2])])
            .validate(6, &surv, 2)
            .is_err()); // kept listed
        let mut bad = remap(&[(1, &[2, 0]), (3, &[2, 0])]);
        bad.validate(6, &surv, 2).unwrap();
        bad.policy = "closest".into();
        assert!(bad.validate(6, &surv, 2).is_err());
    }

    #[test]
    fn ranking_is_by_score_then_id() {
        let score = [0.5, 9.0, 0.7, 0.0, 0.7, 0.1];
        assert_eq!(rank_desc(&[0, 2, 4, 5], &score), vec![2, 4, 0, 5]);
        let u = HashRemap::uniform(RemapPolicy::ReapNext, "reap", 6, &[0, 2, 4, 5], &[2, 4]);
        assert_eq!(u.candidates.keys().copied().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(RemapPolicy::parse("reap-next"), Some(RemapPolicy::ReapNext));
        assert_eq!(RemapPolicy::parse("x"), None);
    }
}
