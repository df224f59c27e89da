//! Fitting lattice codes to one weight matrix: per-row scales, imatrix-weighted rounding,
//! nested residual stages, and the weighted reconstruction error of every rung.
//!
//! What it is: [`fit_matrix`] codes a `[rows, cols]` f32 matrix (out × in) as E8P12 with one
//! f32 scale per output row, optionally followed by one residual stage (E81B or a second
//! E8P12) with its own per-row scale, and measures, per rung, the imatrix-weighted squared
//! error `Σ_r Σ_j h_j (w_rj − ŵ_rj)²` (h = the per-input-channel second moments). Each row's
//! scale starts at QuIP#'s `RMS / 1.03` (residual stages at `s₁ / 2.04` for E81B and
//! `s₁ / 3.45` for E8P12, QuIP#'s constants) and is then refitted: code at `s`, refit `s` by
//! weighted least squares for those codes, recode, keep the best pair. [`dequantize`] (f32,
//! what a runtime computes) and [`dequantize_ref`] (f64 from the reference decoders) decode a
//! fit back. What it is not: checkpoint reading or writing ([`crate::checkpoint`]), the search
//! itself ([`crate::lattice`]). Rows run in parallel (rayon); the result does not depend on
//! the thread count.

use rayon::prelude::*;

use keep_format::e81::{decode_e81, decode_e81_ref};
use keep_format::e8p::{decode_e8p, decode_e8p_ref, E8P_OPT_SCALE};

use crate::lattice::{nearest_e81_weighted, nearest_e8p_weighted_many};
use crate::{QuantError, Result};

/// QuIP#'s residual scale for the E81B stage (`x̂ = q₁ + q₂ / 2.04`): the starting point of
/// the refit.
pub const E81_RESID_SCALE: f32 = 2.04;
/// QuIP#'s residual scale for a second E8P12 stage (`x̂ = q₁ + q₂ / 3.45`).
pub const E8P_RESID_SCALE: f32 = 3.45;
/// Rounds of (code, refit scale) per stage; measured on the bundled model's experts, the
/// third round changes the weighted error by well under 0.1%.
pub const SCALE_ROUNDS: usize = 2;
/// Floor added to every imatrix entry, as a fraction of the mean, so that input channels the
/// calibration never saw still round to something sensible (their error weighs almost nothing).
pub const IMATRIX_FLOOR: f64 = 1e-3;

/// Code formats `keep quant` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantFormat {
    /// E8P12 codes (2 bits per weight) and a per-row f32 scale.
    E8p2,
    /// E8P12, then E81B (1 bit per weight) on the residual with its own per-row scale.
    E8p2E81,
    /// E8P12, then a second E8P12 on the residual with its own per-row scale.
    E8p2E8p2,
}

impl QuantFormat {
    /// Every format, in rung order.
    pub const ALL: [QuantFormat; 3] = [
        QuantFormat::E8p2,
        QuantFormat::E8p2E81,
        QuantFormat::E8p2E8p2,
    ];

    /// The name used on the command line and in checkpoints (`e8p2`, `e8p2+e81`, `e8p2+e8p2`).
    pub fn label(self) -> &'static str {
        match self {
            QuantFormat::E8p2 => "e8p2",
            QuantFormat::E8p2E81 => "e8p2+e81",
            QuantFormat::E8p2E8p2 => "e8p2+e8p2",
        }
    }

    /// Parse a label.
    pub fn parse(s: &str) -> Option<QuantFormat> {
        QuantFormat::ALL.into_iter().find(|f| f.label() == s)
    }

    /// The residual stage, if any.
    pub fn residual(self) -> Option<ResidualKind> {
        match self {
            QuantFormat::E8p2 => None,
            QuantFormat::E8p2E81 => Some(ResidualKind::E81),
            QuantFormat::E8p2E8p2 => Some(ResidualKind::E8p),
        }
    }

    /// Stored bits per weight for a `[rows, cols]` matrix, codes and f32 scales included.
    pub fn bits_per_weight(self, rows: usize, cols: usize) -> f64 {
        let (code_bits, scales) = match self.residual() {
            None => (2.0, 1.0),
            Some(ResidualKind::E81) => (3.0, 2.0),
            Some(ResidualKind::E8p) => (4.0, 2.0),
        };
        code_bits + scales * 32.0 * rows as f64 / (rows as f64 * cols as f64)
    }
}

/// The codebook of a residual stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ResidualKind {
    /// E81B, one byte per 8 weights.
    E81,
    /// E8P12, one 16-bit code per 8 weights.
    E8p,
}

/// Codes of a residual stage.
#[derive(Debug, Clone, PartialEq)]
pub enum ResidualCodes {
    E81(Vec<u8>),
    E8p(Vec<u16>),
}

/// A residual stage: codes `[rows, cols/8]` and one scale per row (or per group).
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualStage {
    pub codes: ResidualCodes,
    pub scales: Vec<f32>,
}

/// Imatrix-weighted squared errors of one matrix: the base rung (E8P12 alone) and, with a
/// residual stage, base + residual; `weight` is `Σ h_j w_rj²` (relative error = err / weight).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RungErrors {
    pub base: f64,
    pub full: Option<f64>,
    pub weight: f64,
}

/// A fitted matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct FittedMatrix {
    pub rows: usize,
    pub cols: usize,
    /// E8P12 codes `[rows, cols/8]` (keep's code layout, `keep_format::e8p`).
    pub codes: Vec<u16>,
    /// One scale per row (per group of [`FittedMatrix::group`] columns of each row when
    /// fitted with [`fit_matrix_grouped`], row-major).
    pub scales: Vec<f32>,
    pub residual: Option<ResidualStage>,
    pub errors: RungErrors,
    /// Columns per scale: `cols` for a scale per row.
    pub group: usize,
}

/// The per-column weights a fit uses: the imatrix plus [`IMATRIX_FLOOR`] of its mean; all
/// ones when the imatrix is all zero (an expert calibration never routed to).
pub fn column_weights(imatrix: &[f32]) -> Result<Vec<f32>> {
    if imatrix.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(QuantError::Input(
            "imatrix has a negative or non-finite entry".into(),
        ));
    }
    let mean = imatrix.iter().map(|&v| v as f64).sum::<f64>() / imatrix.len().max(1) as f64;
    if mean <= 0.0 {
        return Ok(vec![1.0; imatrix.len()]);
    }
    // normalised to mean ≈ 1 so f32 sums stay well scaled
    Ok(imatrix
        .iter()
        .map(|&v| ((v as f64 + IMATRIX_FLOOR * mean) / mean) as f32)
        .collect())
}

struct RowFit {
    codes: Vec<u16>,
    scale: f32,
    resid: Option<(Vec<u16>, f32)>,
    base: f64,
    full: f64,
    weight: f64,
}

fn group(v: &[f32], g: usize) -> [f32; 8] {
    std::array::from_fn(|i| v[8 * g + i])
}

/// [`nearest_e81_weighted`] of every group of 8 (it is O(8) already; no lanes).
fn nearest_e81_many(x: &[f32], h: &[f32], out: &mut [u16]) {
    for (g, o) in out.iter_mut().enumerate() {
        *o = nearest_e81_weighted(group(x, g), group(h, g)) as u16;
    }
}

/// Fit one stage (codes and scale) of `w` under weights `h`, from starting scale `s0`.
/// `nearest(x, h, codes)` codes every group of 8 of `x` (see
/// [`crate::lattice::nearest_e8p_weighted_many`]).
fn fit_stage(
    w: &[f32],
    h: &[f32],
    s0: f32,
    nearest: impl Fn(&[f32], &[f32], &mut [u16]),
    decode: impl Fn(u16) -> [f32; 8],
) -> (Vec<u16>, f32, Vec<f32>, f64) {
    let n = w.len() / 8;
    let mut best: Option<(Vec<u16>, f32, Vec<f32>, f64)> = None;
    let mut s = s0;
    let mut x = vec![0f32; w.len()];
    for _ in 0..SCALE_ROUNDS {
        if !(s.is_finite() && s != 0.0) {
            break;
        }
        let inv = 1.0 / s;
        for (xi, &wi) in x.iter_mut().zip(w) {
            *xi = wi * inv;
        }
        let mut codes = vec![0u16; n];
        nearest(&x, h, &mut codes);
        let mut q = vec![0f32; w.len()];
        for (g, &c) in codes.iter().enumerate() {
            q[8 * g..8 * g + 8].copy_from_slice(&decode(c));
        }
        // weighted least squares for the scale of these codes
        let (mut num, mut den) = (0f64, 0f64);
        for j in 0..w.len() {
            num += h[j] as f64 * w[j] as f64 * q[j] as f64;
            den += h[j] as f64 * q[j] as f64 * q[j] as f64;
        }
        let s_fit = if den > 0.0 { (num / den) as f32 } else { s };
        let err: f64 = (0..w.len())
            .map(|j| h[j] as f64 * (w[j] as f64 - s_fit as f64 * q[j] as f64).powi(2))
            .sum();
        if best.as_ref().is_none_or(|b| err < b.3) {
            best = Some((codes, s_fit, q, err));
        }
        s = s_fit;
    }
    match best {
        Some(b) => b,
        // all-zero row: scale 0, any codes decode to zero
        None => {
            let err = (0..w.len())
                .map(|j| h[j] as f64 * (w[j] as f64).powi(2))
                .sum();
            (vec![0; n], 0.0, vec![0.0; w.len()], err)
        }
    }
}

fn fit_row(w: &[f32], h: &[f32], format: QuantFormat) -> RowFit {
    let weight: f64 = (0..w.len())
        .map(|j| h[j] as f64 * (w[j] as f64).powi(2))
        .sum();
    let rms = ((w.iter().map(|&v| v as f64 * v as f64).sum::<f64>()) / w.len() as f64).sqrt();
    let s0 = (rms / E8P_OPT_SCALE as f64) as f32;
    let (codes, scale, q, base) = fit_stage(w, h, s0, nearest_e8p_weighted_many, decode_e8p);
    let mut full = base;
    let resid = format.residual().map(|kind| {
        let r: Vec<f32> = (0..w.len()).map(|j| w[j] - scale * q[j]).collect();
        let (codes, s2, q2, _) = match kind {
            ResidualKind::E81 => fit_stage(&r, h, scale / E81_RESID_SCALE, nearest_e81_many, |c| {
                decode_e81(c as u8)
            }),
            ResidualKind::E8p => fit_stage(
                &r,
                h,
                scale / E8P_RESID_SCALE,
                nearest_e8p_weighted_many,
                decode_e8p,
            ),
        };
        // the rung's error from the original weights in f64 (the stage fit saw `r` in f32)
        full = (0..w.len())
            .map(|j| {
                let hat = scale as f64 * q[j] as f64 + s2 as f64 * q2[j] as f64;
                h[j] as f64 * (w[j] as f64 - hat).powi(2)
            })
            .sum();
        (codes, s2)
    });
    RowFit {
        codes,
        scale,
        resid,
        base,
        full,
        weight,
    }
}

/// Fit `w` (`[rows, cols]`, row-major, out × in) in `format`, weighting column `j`'s error by
/// `imatrix[j]` (see [`column_weights`]). Refuses non-finite weights and shapes that are not
/// whole groups of 8 columns.
pub fn fit_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
    imatrix: &[f32],
    format: QuantFormat,
) -> Result<FittedMatrix> {
    fit_matrix_grouped(w, rows, cols, imatrix, format, cols)
}

/// [`fit_matrix`] with one scale (per stage) for every `group` consecutive columns of a row
/// instead of one per row: each group is fitted as a row of its own. `group` must be a
/// positive multiple of 8 dividing `cols`.
pub fn fit_matrix_grouped(
    w: &[f32],
    rows: usize,
    cols: usize,
    imatrix: &[f32],
    format: QuantFormat,
    group: usize,
) -> Result<FittedMatrix> {
    if !cols.is_multiple_of(8) || cols == 0 {
        return Err(QuantError::Input(format!(
            "{cols} columns is not a positive multiple of 8"
        )));
    }
    if w.len() != rows * cols || imatrix.len() != cols {
        return Err(QuantError::Input(format!(
            "{} weights and {} imatrix columns for a [{rows}, {cols}] matrix",
            w.len(),
            imatrix.len()
        )));
    }
    if w.iter().any(|v| !v.is_finite()) {
        return Err(QuantError::Input("non-finite weight".into()));
    }
    if group == 0 || !group.is_multiple_of(8) || !cols.is_multiple_of(group) {
        return Err(QuantError::Input(format!(
            "scale group {group} is not a positive multiple of 8 dividing {cols} columns"
        )));
    }
    let h = column_weights(imatrix)?;
    let per_row = cols / group;
    let fits: Vec<RowFit> = w
        .par_chunks_exact(group)
        .enumerate()
        .map(|(k, part)| {
            let c0 = (k % per_row) * group;
            fit_row(part, &h[c0..c0 + group], format)
        })
        .collect();
    let mut out = FittedMatrix {
        rows,
        cols,
        codes: Vec::with_capacity(rows * cols / 8),
        scales: Vec::with_capacity(rows * per_row),
        group,
        residual: format.residual().map(|k| ResidualStage {
            codes: match k {
                ResidualKind::E81 => ResidualCodes::E81(Vec::with_capacity(rows * cols / 8)),
                ResidualKind::E8p => ResidualCodes::E8p(Vec::with_capacity(rows * cols / 8)),
            },
            scales: Vec::with_capacity(rows * per_row),
        }),
        errors: RungErrors {
            base: 0.0,
            full: format.residual().map(|_| 0.0),
            weight: 0.0,
        },
    };
    // the imatrix normalisation is undone so that errors are in the imatrix's own units
    let mean = imatrix.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
    let unit = if mean > 0.0 { mean } else { 1.0 };
    for f in fits {
        out.codes.extend_from_slice(&f.codes);
        out.scales.push(f.scale);
        out.errors.base += f.base * unit;
        out.errors.weight += f.weight * unit;
        if let (Some(st), Some((c, s))) = (out.residual.as_mut(), f.resid) {
            match &mut st.codes {
                ResidualCodes::E81(v) => v.extend(c.iter().map(|&x| x as u8)),
                ResidualCodes::E8p(v) => v.extend_from_slice(&c),
            }
            st.scales.push(s);
            if let Some(e) = out.errors.full.as_mut() {
                *e += f.full * unit;
            }
        }
    }
    Ok(out)
}

/// Decode a fit to f32 the way a runtime does: `s₁ · q₁ (+ s₂ · q₂)`, each product in f32.
pub fn dequantize(f: &FittedMatrix) -> Vec<f32> {
    let kc = f.cols / 8;
    let gpr = f.cols / f.group.max(1);
    let mut out = vec![0f32; f.rows * f.cols];
    for r in 0..f.rows {
        for g in 0..kc {
            let si = r * gpr + 8 * g / f.group.max(1);
            let q = decode_e8p(f.codes[r * kc + g]);
            let q2 = f.residual.as_ref().map(|st| {
                let c = match &st.codes {
                    ResidualCodes::E81(v) => decode_e81(v[r * kc + g]),
                    ResidualCodes::E8p(v) => decode_e8p(v[r * kc + g]),
                };
                (c, st.scales[si])
            });
            for i in 0..8 {
                let mut v = f.scales[si] * q[i];
                if let Some((c, s)) = q2 {
                    v += s * c[i];
                }
                out[r * f.cols + 8 * g + i] = v;
            }
        }
    }
    out
}

/// Reference decode in f64 from the reference decoders: `s₁ · q₁ + s₂ · q₂`.
pub fn dequantize_ref(f: &FittedMatrix) -> Vec<f64> {
    let kc = f.cols / 8;
    let mut out = vec![0f64; f.rows * f.cols];
    for (j, o) in out.iter_mut().enumerate() {
        let (r, c) = (j / f.cols, j % f.cols);
        let k = r * kc + c / 8;
        let si = r * (f.cols / f.group.max(1)) + c / f.group.max(1);
        let mut v = f.scales[si] as f64 * decode_e8p_ref(f.codes[k])[c % 8] as f64;
        if let Some(st) = &f.residual {
            let q = match &st.codes {
                ResidualCodes::E81(v) => decode_e81_ref(v[k])[c % 8],
                ResidualCodes::E8p(v) => decode_e8p_ref(v[k])[c % 8],
            };
            v += st.scales[si] as f64 * q as f64;
        }
        *o = v;
    }
    out
}

#[cfg(test)]
mod tests;
