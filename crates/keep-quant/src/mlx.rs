//! MLX affine quantization of one matrix, as `keep quant --format mlx2|mlx3|mlx4|mlx8` writes
//! it: `mx.quantize(w, mode="affine", group_size=64, bits=B)` of the (bf16) weight, computed
//! by keep-format's [`keep_format::mlx_affine`] quantizer (bit-exact to MLX's), with the
//! imatrix-weighted reconstruction error the lattice formats report, so the two families sit
//! in one table.
//!
//! What it is not: a fit (MLX's rule ignores the imatrix: min/max per group of 64), the
//! checkpoint writing ([`crate::checkpoint`]) or the decode kernels (keep-kernels). Rows run in
//! parallel (rayon); the result does not depend on the thread count.

use rayon::prelude::*;

use keep_format::affine::ParamSlice;
use keep_format::bf16::f32_to_bf16;
use keep_format::mlx_affine::{decode_row, packed_row_bytes, quantize_row};

use crate::fit::column_weights;
use crate::{QuantError, Result};

/// MLX's group size, the one keep writes.
pub const MLX_GROUP: usize = 64;

/// One matrix in MLX's affine layout: packed codes `[rows, cols·bits/8]` bytes (MLX's
/// `uint32 [rows, cols·bits/32]` words, little-endian), bf16 scales and biases
/// `[rows, cols/64]`, and the imatrix-weighted squared error of its decode.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxMatrix {
    pub bits: u32,
    pub rows: usize,
    pub cols: usize,
    pub packed: Vec<u8>,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
    /// `Σ_r Σ_j h_j (w_rj − ŵ_rj)²` with ŵ the f32 decode of the stored (bf16) parameters.
    pub error: f64,
    /// `Σ_r Σ_j h_j w_rj²`.
    pub weight: f64,
}

/// Stored bits per weight at `bits` with bf16 scales and biases per 64 columns.
pub fn bits_per_weight(bits: u32) -> f64 {
    keep_format::mlx_affine::bits_per_weight(bits, MLX_GROUP)
}

/// Quantize a `[rows, cols]` f32 matrix (out × in) as `mx.quantize` does for a bf16 weight:
/// codes from the f32 scale and bias, the stored ones rounded to bf16 (so `w` should hold
/// bf16-representable values, as every source keep reads does once decoded). `imatrix`
/// (`cols` entries) weights the reported error only.
pub fn quantize_matrix(
    w: &[f32],
    rows: usize,
    cols: usize,
    imatrix: &[f32],
    bits: u32,
) -> Result<MlxMatrix> {
    let pb = packed_row_bytes(cols, bits).filter(|_| cols.is_multiple_of(MLX_GROUP));
    let Some(pb) = pb else {
        return Err(QuantError::Input(format!(
            "MLX affine {bits}-bit needs 2, 3, 4 or 8 bits and columns a multiple of {MLX_GROUP}, \
             got {cols} columns"
        )));
    };
    if w.len() != rows * cols || imatrix.len() != cols {
        return Err(QuantError::Input(format!(
            "matrix of {} values and imatrix of {} for [{rows}, {cols}]",
            w.len(),
            imatrix.len()
        )));
    }
    let h = column_weights(imatrix)?;
    let g = cols / MLX_GROUP;
    let per_row: Vec<_> = w
        .par_chunks_exact(cols)
        .map(|row| -> Result<_> {
            let mut p = vec![0u8; pb];
            let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
            quantize_row(bits, row, &mut p, &mut s, &mut b)
                .map_err(|e| QuantError::Input(e.to_string()))?;
            let s16: Vec<u16> = s.iter().map(|&v| f32_to_bf16(v)).collect();
            let b16: Vec<u16> = b.iter().map(|&v| f32_to_bf16(v)).collect();
            let mut d = vec![0f32; cols];
            decode_row(
                bits,
                &p,
                ParamSlice::Bf16(&s16),
                ParamSlice::Bf16(&b16),
                &mut d,
            )
            .map_err(|e| QuantError::Input(e.to_string()))?;
            let (mut err, mut wt) = (0f64, 0f64);
            for j in 0..cols {
                let (x, y) = (row[j] as f64, d[j] as f64);
                err += h[j] as f64 * (x - y) * (x - y);
                wt += h[j] as f64 * x * x;
            }
            Ok((p, s16, b16, err, wt))
        })
        .collect::<Result<_>>()?;
    let mut m = MlxMatrix {
        bits,
        rows,
        cols,
        packed: Vec::with_capacity(rows * pb),
        scales: Vec::with_capacity(rows * g),
        biases: Vec::with_capacity(rows * g),
        error: 0.0,
        weight: 0.0,
    };
    for (p, s, b, e, wt) in per_row {
        m.packed.extend(p);
        m.scales.extend(s);
        m.biases.extend(b);
        m.error += e;
        m.weight += wt;
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_matrix_decodes_within_the_rule_and_errors_shrink_with_bits() {
        let (rows, cols) = (6, 192);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let v = ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
                f32::from_bits(v.to_bits() & 0xFFFF_0000) // bf16-representable
            })
            .collect();
        let h = vec![1.0f32; cols];
        let mut last = f64::INFINITY;
        for bits in [2, 3, 4, 8] {
            let m = quantize_matrix(&w, rows, cols, &h, bits).unwrap();
            assert_eq!(m.packed.len(), rows * cols * bits as usize / 8);
            assert_eq!(m.scales.len(), rows * cols / 64);
            assert!(m.error < last, "bits {bits}: {} !< {last}", m.error);
            last = m.error;
            // The same bytes as keep-format's bf16 row quantizer.
            let mut p = vec![0u8; cols * bits as usize / 8];
            let (mut s, mut b) = (vec![0u16; 3], vec![0u16; 3]);
            keep_format::mlx_affine::quantize_row_bf16(
                bits,
                &w[cols..2 * cols],
                &mut p,
                &mut s,
                &mut b,
            )
            .unwrap();
            assert_eq!(p, m.packed[p.len()..2 * p.len()]);
            assert_eq!((s, b), (m.scales[3..6].to_vec(), m.biases[3..6].to_vec()));
        }
        assert!(quantize_matrix(&w, rows, 96, &h[..96], 4).is_err());
        assert!(quantize_matrix(&w, rows, cols, &h, 5).is_err());
        assert!(quantize_matrix(&w, rows, cols, &h[..10], 4).is_err());
        assert_eq!(bits_per_weight(3), 3.5);
    }
}
