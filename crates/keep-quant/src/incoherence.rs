//! Incoherence processing (QuIP#'s): fit lattice codes to a weight rotated on both sides by
//! seeded random-sign Hadamard transforms, so that no single weight or input channel stands
//! out, and measure the fit in the original basis.
//!
//! What it is: for `W` `[rows, cols]` (out × in), the stored matrix is `W̃ = V_out·W·V_inᵀ`
//! with `V = H_B·S` (keep-kernels' [`Rht`]: ±1 signs from a seed, then block-diagonal
//! normalised Walsh–Hadamard over the largest power-of-two block dividing the size — every
//! expert width keep meets is a power of two, so `B` is the whole size; for other sizes the
//! block-diagonal form keeps the transform a plain FWHT per block, where QuIP#'s
//! known-small-Hadamard compositions (12, 20, 28, ...) would need a table per size, and its
//! loss, less mixing across blocks, only shows on widths no supported model has). A runtime
//! computes `y = V_outᵀ·W̃·(V_in·x)`.
//!
//! The imatrix: the fit's weighting is the diagonal `D` of the inputs' second moments in the
//! original basis. After the input rotation the exact quadratic form of the error is
//! `V_in·D·V_inᵀ`, which is not diagonal; the fit keeps its diagonal, `diag(V D Vᵀ)_k =
//! Σ_j V_kj² D_j`, which for a Hadamard block is the block's mean of `D` (every `V_kj² = 1/B`):
//! flat ([`rotated_imatrix`], checked against the explicit sum). So with `B` = the whole width
//! the rotated fit is unweighted — the imatrix no longer steers which columns round best — and
//! the off-diagonal part of the true objective is ignored. [`Mode::Output`] rotates the output
//! side only (`V_in = S_in`, signs alone, `B = 1`): the weighting then stays exact (a sign
//! flip leaves `D` diagonal) while rows still mix. The errors this module reports are always
//! the imatrix-weighted error of the decoded, un-rotated weights against the originals, so they
//! compare directly with an unrotated fit's.
//!
//! What it is not: the search or the per-row fit ([`crate::fit`]), the checkpoint
//! ([`crate::checkpoint`] writes their seeds into keep-checkpoint's `incoherence` marker).

use keep_checkpoint::incoherence::{Incoherence, TransformKind};
use keep_kernels::hadamard::{hadamard_block, Rht};

use crate::fit::{column_weights, dequantize, fit_matrix, FittedMatrix, QuantFormat, RungErrors};
use crate::{QuantError, Result};

/// Seed `keep quant --incoherence` uses unless given another.
pub const DEFAULT_SEED: u64 = 0x6b65_6570_5248_5431;

/// Which sides are rotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Both sides: `V_in` and `V_out` random-sign Hadamard (QuIP#).
    Both,
    /// Rows only: `V_out` random-sign Hadamard, `V_in` random signs alone (the imatrix
    /// weighting stays exact).
    Output,
}

impl Mode {
    /// `on` / `out`.
    pub fn label(self) -> &'static str {
        match self {
            Mode::Both => "on",
            Mode::Output => "out",
        }
    }
}

/// Incoherence options of a quantization run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncoherenceOptions {
    pub mode: Mode,
    /// Seed every tensor's two sign seeds are derived from (with the tensor's name).
    pub seed: u64,
}

fn mix(mut z: u64) -> u64 {
    // SplitMix64's finaliser: a bijection that spreads every input bit
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The transforms of weight `base` (`[rows, cols]`): `(V_in, V_out)`, seeds derived from
/// `opts.seed` and the name (FNV-1a), so that every tensor has its own signs.
pub fn transforms(
    opts: IncoherenceOptions,
    base: &str,
    rows: usize,
    cols: usize,
) -> Result<(Rht, Rht)> {
    let name = base.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let s = mix(opts.seed ^ mix(name));
    let block_in = match opts.mode {
        Mode::Both => hadamard_block(cols),
        Mode::Output => 1,
    };
    let kerr = |e: keep_kernels::KernelError| QuantError::Input(format!("{base}: {e}"));
    Ok((
        Rht::new(cols, block_in, mix(s ^ 1)).map_err(kerr)?,
        Rht::new(rows, hadamard_block(rows), mix(s ^ 2)).map_err(kerr)?,
    ))
}

/// The marker entry of a weight with transforms `(input, output)`.
pub fn marker(input: Rht, output: Rht) -> Incoherence {
    Incoherence {
        kind: TransformKind::Rht,
        seed_in: input.seed,
        block_in: input.block,
        seed_out: output.seed,
        block_out: output.block,
    }
}

fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; w.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = w[r * cols + c];
        }
    }
    t
}

fn sizes(w: &[f32], rows: usize, cols: usize, input: &Rht, output: &Rht) -> Result<()> {
    if w.len() != rows * cols || input.n != cols || output.n != rows {
        return Err(QuantError::Input(format!(
            "{} weights, transforms of {} and {} for a [{rows}, {cols}] matrix",
            w.len(),
            output.n,
            input.n
        )));
    }
    Ok(())
}

/// `W̃ = V_out·W·V_inᵀ`: each row `w_r ← V_in·w_r`, then each column `← V_out·column`.
pub fn rotate(w: &[f32], rows: usize, cols: usize, input: &Rht, output: &Rht) -> Result<Vec<f32>> {
    sizes(w, rows, cols, input, output)?;
    let mut a = w.to_vec();
    input.forward(&mut a)?;
    let mut t = transpose(&a, rows, cols);
    output.forward(&mut t)?;
    Ok(transpose(&t, cols, rows))
}

/// `W = V_outᵀ·W̃·V_in`, the inverse of [`rotate`].
pub fn unrotate(
    wt: &[f32],
    rows: usize,
    cols: usize,
    input: &Rht,
    output: &Rht,
) -> Result<Vec<f32>> {
    sizes(wt, rows, cols, input, output)?;
    let mut t = transpose(wt, rows, cols);
    output.inverse(&mut t)?;
    let mut a = transpose(&t, cols, rows);
    input.inverse(&mut a)?;
    Ok(a)
}

/// The imatrix in the rotated basis: `diag(V_in·D·V_inᵀ)`, i.e. each Hadamard block's mean
/// of `D` (see the module docs).
pub fn rotated_imatrix(h: &[f32], input: &Rht) -> Vec<f32> {
    let b = input.block.max(1);
    h.chunks(b)
        .flat_map(|blk| {
            let m = blk.iter().map(|&v| v as f64).sum::<f64>() / blk.len() as f64;
            std::iter::repeat_n(m as f32, blk.len())
        })
        .collect()
}

/// Reference for [`rotated_imatrix`]: `Σ_j V_kj² D_j` from the explicit columns `V·e_j`.
pub fn rotated_imatrix_ref(h: &[f32], input: &Rht) -> Vec<f64> {
    let n = h.len();
    let mut out = vec![0f64; n];
    for (j, &hj) in h.iter().enumerate() {
        let e: Vec<f64> = (0..n).map(|i| (i == j) as u8 as f64).collect();
        for (o, v) in out.iter_mut().zip(input.forward_ref(&e)) {
            *o += v * v * hj as f64;
        }
    }
    out
}

/// A fit of a rotated matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct IncoherentFit {
    /// Codes and scales of `W̃` (what the checkpoint stores); its `errors` are those of the
    /// rotated fit under the rotated imatrix.
    pub fit: FittedMatrix,
    pub input: Rht,
    pub output: Rht,
    /// The imatrix-weighted errors of the decoded, un-rotated weights against `w`, per rung,
    /// in the units [`crate::fit::fit_matrix`] reports.
    pub errors: RungErrors,
}

/// Imatrix-weighted squared error `Σ_r Σ_j h_j (w − ŵ)²` and `Σ h w²` in the imatrix's units
/// (the weighting [`crate::fit`] uses: [`column_weights`] times the imatrix's mean).
pub fn weighted_error(w: &[f32], hat: &[f32], cols: usize, imatrix: &[f32]) -> Result<(f64, f64)> {
    let h = column_weights(imatrix)?;
    let mean = imatrix.iter().map(|&v| v as f64).sum::<f64>() / cols.max(1) as f64;
    let unit = if mean > 0.0 { mean } else { 1.0 };
    let (mut err, mut wt) = (0f64, 0f64);
    for (k, (&a, &b)) in w.iter().zip(hat).enumerate() {
        let hj = h[k % cols] as f64;
        err += hj * (a as f64 - b as f64).powi(2);
        wt += hj * (a as f64).powi(2);
    }
    Ok((err * unit, wt * unit))
}

/// Fit `w` (`[rows, cols]`) in `format` after rotating it with `(input, output)`: the codes
/// are fitted to `W̃` under [`rotated_imatrix`], the errors measured in the original basis.
pub fn fit_incoherent(
    w: &[f32],
    rows: usize,
    cols: usize,
    imatrix: &[f32],
    format: QuantFormat,
    input: Rht,
    output: Rht,
) -> Result<IncoherentFit> {
    if imatrix.len() != cols {
        return Err(QuantError::Input(format!(
            "{} imatrix columns for a [{rows}, {cols}] matrix",
            imatrix.len()
        )));
    }
    if w.iter().any(|v| !v.is_finite()) {
        return Err(QuantError::Input("non-finite weight".into()));
    }
    let wt = rotate(w, rows, cols, &input, &output)?;
    let ht = rotated_imatrix(imatrix, &input);
    let fit = fit_matrix(&wt, rows, cols, &ht, format)?;
    let full_hat = unrotate(&dequantize(&fit), rows, cols, &input, &output)?;
    let (full, weight) = weighted_error(w, &full_hat, cols, imatrix)?;
    let base = match fit.residual {
        None => full,
        Some(_) => {
            let b = FittedMatrix {
                residual: None,
                ..fit.clone()
            };
            let hat = unrotate(&dequantize(&b), rows, cols, &input, &output)?;
            weighted_error(w, &hat, cols, imatrix)?.0
        }
    };
    Ok(IncoherentFit {
        errors: RungErrors {
            base,
            full: fit.residual.as_ref().map(|_| full),
            weight,
        },
        fit,
        input,
        output,
    })
}

#[cfg(test)]
mod tests;
