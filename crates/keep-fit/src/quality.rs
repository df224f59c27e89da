//! Quality from measured points: the mean KL(teacher ‖ student) of `keep eval --json` reports
//! (one per experts-kept count, on the plan's kernels), interpolated linearly in experts kept
//! between the two nearest measured counts and marked `interpolated`; a count outside the
//! measured range is `unknown` (never extrapolated).

use std::path::PathBuf;

use keep_artifacts::fit_plan::Predicted;
use serde_json::Value;

use crate::{FitError, Result};

/// One measured point.
#[derive(Debug, Clone, PartialEq)]
pub struct KlPoint {
    pub experts_kept: usize,
    pub experts_total: usize,
    pub kl: f64,
    /// The report and student it came from.
    pub source: String,
}

/// The measured points of the `keep eval --json` reports `files` for `kernels` (`fast` or
/// `exact`): the unmasked model on those kernels at every expert, each plan's student at its
/// experts kept. A report without any student on those kernels is an error naming it.
pub fn read_points(files: &[PathBuf], kernels: &str) -> Result<Vec<KlPoint>> {
    let mut pts: Vec<KlPoint> = vec![];
    for f in files {
        let text =
            keep_checkpoint::small_file::read_text(f, keep_checkpoint::small_file::MAX_SMALL_FILE)?;
        let v: Value = serde_json::from_str(&text).map_err(|e| FitError::File {
            path: f.clone(),
            msg: format!("not a `keep eval --json` report: {e}"),
        })?;
        let students = v["students"].as_array().ok_or_else(|| FitError::File {
            path: f.clone(),
            msg: "no `students` list: write it with `keep eval --json > FILE`".into(),
        })?;
        let before = pts.len();
        for s in students {
            if s["kernels"].as_str() != Some(kernels) {
                continue;
            }
            let (Some(k), Some(n), Some(kl)) = (
                s["experts_kept"].as_u64(),
                s["experts_total"].as_u64(),
                s["mean_kl"].as_f64(),
            ) else {
                continue;
            };
            let label = s["label"].as_str().unwrap_or("?");
            let p = KlPoint {
                experts_kept: k as usize,
                experts_total: n as usize,
                kl,
                source: format!("{} ({label})", f.display()),
            };
            // A later file's point at the same count replaces an earlier one.
            pts.retain(|q| q.experts_kept != p.experts_kept);
            pts.push(p);
        }
        if pts.len() == before && !students.is_empty() {
            return Err(FitError::File {
                path: f.clone(),
                msg: format!(
                    "no student on the {kernels} kernels: run `keep eval --kernels {kernels} --json`"
                ),
            });
        }
    }
    pts.sort_by_key(|p| p.experts_kept);
    Ok(pts)
}

/// The KL at `kept` experts from `points` (sorted by experts kept).
pub fn kl_at(points: &[KlPoint], kept: usize) -> Predicted {
    if let Some(p) = points.iter().find(|p| p.experts_kept == kept) {
        return Predicted {
            value: Some(p.kl),
            provenance: "measured".into(),
            source: p.source.clone(),
        };
    }
    let lo = points.iter().rev().find(|p| p.experts_kept < kept);
    let hi = points.iter().find(|p| p.experts_kept > kept);
    match (lo, hi) {
        (Some(a), Some(b)) => {
            let t = (kept - a.experts_kept) as f64 / (b.experts_kept - a.experts_kept) as f64;
            Predicted {
                value: Some(a.kl + t * (b.kl - a.kl)),
                provenance: "interpolated".into(),
                source: format!(
                    "linear in experts kept between {} ({:.5}) and {} ({:.5})",
                    a.experts_kept, a.kl, b.experts_kept, b.kl
                ),
            }
        }
        _ => Predicted {
            value: None,
            provenance: "unknown".into(),
            source: if points.is_empty() {
                "no KL measured: give `keep eval --json` reports with --eval".into()
            } else {
                format!("{kept} experts is outside the measured counts")
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interpolation of exact binary fractions.
    const KL_TOL: f64 = 1e-12;

    #[test]
    fn points_and_interpolation() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("eval.json");
        std::fs::write(
            &f,
            r#"{"students": [
              {"label": "model", "kernels": "exact", "experts_kept": 8, "experts_total": 8, "mean_kl": 0.0},
              {"label": "model --kernels fast", "kernels": "fast", "experts_kept": 8, "experts_total": 8, "mean_kl": 0.001},
              {"label": "p4", "kernels": "fast", "experts_kept": 4, "experts_total": 8, "mean_kl": 0.125}]}"#,
        )
        .unwrap();
        let p = read_points(std::slice::from_ref(&f), "fast").unwrap();
        assert_eq!(p.len(), 2);
        let m = kl_at(&p, 4);
        assert_eq!(m.provenance, "measured");
        assert_eq!(m.value, Some(0.125));
        let i = kl_at(&p, 6);
        assert_eq!(i.provenance, "interpolated");
        assert!((i.value.unwrap() - 0.063).abs() < KL_TOL);
        let u = kl_at(&p, 2);
        assert_eq!(u.provenance, "unknown");
        assert!(u.value.is_none());
        assert!(read_points(&[f], "bogus").is_err());
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{}").unwrap();
        assert!(read_points(&[bad], "fast").is_err());
    }
}
