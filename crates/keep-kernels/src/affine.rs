//! MLX affine-8 weights (`mx.quantize(w, mode="affine", bits=8, group_size=64)`) as a kernel
//! operand: [`Affine8View`], its scalar element decoder and `_ref` matmul, and the fast
//! `out[M×rows] = x[M×cols] · Wᵀ` ([`crate::simd::affine8_matmul`]).
//!
//! Layout (row-major, little-endian): `q` is `rows × cols` code bytes (MLX's `uint32 [rows,
//! cols/4]` words are exactly these bytes); `scales` and `biases` are `rows × cols/64` bf16
//! values (2 bytes each). Decode, as `keep_format::affine` defines it:
//! `w[i,j] = scale[i, j/64] · q[i,j] + bias[i, j/64]` in f32, a multiply then an add (two
//! roundings, never an FMA). The fast path computes exactly these values and dots them with
//! the kernels' fixed accumulation order, so it agrees with [`crate::simd::dot`] on a
//! decoded row bit for bit. This is the comparison point of the mxfp8-residents kill test.

use crate::codec::bf16_at;
use crate::{KernelError, Result};

/// Columns per affine group (MLX's default, the only one here).
pub const AFFINE8_GROUP: usize = 64;

/// A borrowed affine-8 weight `[rows, cols]` (out × in), group 64, bf16 scales and biases.
#[derive(Debug, Clone, Copy)]
pub struct Affine8View<'a> {
    pub rows: usize,
    pub cols: usize,
    /// `rows × cols` codes.
    pub q: &'a [u8],
    /// `rows × cols/64` bf16 scales, little-endian bytes.
    pub scales: &'a [u8],
    /// `rows × cols/64` bf16 biases, little-endian bytes.
    pub biases: &'a [u8],
}

impl<'a> Affine8View<'a> {
    /// Check the byte lengths against the shape (`cols % 64 == 0`).
    pub fn new(
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if !cols.is_multiple_of(AFFINE8_GROUP) {
            return Err(KernelError::Shape {
                what: "affine8 weight",
                msg: format!("{cols} columns is not a multiple of {AFFINE8_GROUP}"),
            });
        }
        let ng = rows * cols / AFFINE8_GROUP;
        for (what, expected, got) in [
            ("affine8 codes", rows * cols, q.len()),
            ("affine8 scales (bf16)", ng * 2, scales.len()),
            ("affine8 biases (bf16)", ng * 2, biases.len()),
        ] {
            if expected != got {
                return Err(KernelError::Bytes {
                    what,
                    rows,
                    cols,
                    expected,
                    got,
                });
            }
        }
        Ok(Affine8View {
            rows,
            cols,
            q,
            scales,
            biases,
        })
    }

    /// Rows `r0..r1` as a view of their own.
    pub fn slice_rows(&self, r0: usize, r1: usize) -> Result<Self> {
        if r0 > r1 || r1 > self.rows {
            return Err(KernelError::Shape {
                what: "affine8 row slice",
                msg: format!("{r0}..{r1} of {} rows", self.rows),
            });
        }
        let (c, g) = (self.cols, self.cols / AFFINE8_GROUP);
        Ok(Affine8View {
            rows: r1 - r0,
            cols: c,
            q: &self.q[r0 * c..r1 * c],
            scales: &self.scales[r0 * g * 2..r1 * g * 2],
            biases: &self.biases[r0 * g * 2..r1 * g * 2],
        })
    }

    /// Bytes one pass over the weight reads (codes, scales, biases).
    pub fn nbytes(&self) -> usize {
        self.q.len() + self.scales.len() + self.biases.len()
    }

    /// Element `(r, c)` from the definition (the scalar reference).
    pub fn get_ref(&self, r: usize, c: usize) -> f32 {
        let gi = r * (self.cols / AFFINE8_GROUP) + c / AFFINE8_GROUP;
        let prod = bf16_at(self.scales, gi) * f32::from(self.q[r * self.cols + c]);
        prod + bf16_at(self.biases, gi)
    }

    /// Decode row `r` into `dst[..cols]` (equal to `get_ref` element by element).
    pub fn decode_row(&self, r: usize, dst: &mut [f32]) {
        let g = self.cols / AFFINE8_GROUP;
        let row = &self.q[r * self.cols..(r + 1) * self.cols];
        for (j, (d, qc)) in dst[..self.cols]
            .chunks_exact_mut(AFFINE8_GROUP)
            .zip(row.chunks_exact(AFFINE8_GROUP))
            .enumerate()
        {
            let (s, b) = (
                bf16_at(self.scales, r * g + j),
                bf16_at(self.biases, r * g + j),
            );
            for (o, &c) in d.iter_mut().zip(qc) {
                *o = s * f32::from(c) + b;
            }
        }
    }
}

/// Scalar reference: f64 accumulation of `get_ref` elements.
pub fn affine8_matmul_ref(x: &[f32], m: usize, w: &Affine8View, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    for i in 0..m {
        for r in 0..w.rows {
            let mut s = 0f64;
            for c in 0..w.cols {
                s += x[i * w.cols + c] as f64 * w.get_ref(r, c) as f64;
            }
            out[i * w.rows + r] = s as f32;
        }
    }
    Ok(())
}

/// An affine-8 weight built from f32 values with MLX's rule (scales and biases rounded to
/// bf16, codes from the unrounded f32 parameters), for tests and benchmarks.
pub fn quantize_affine8(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(cols % AFFINE8_GROUP, 0);
    let mut q = vec![0u8; rows * cols];
    let mut s = Vec::with_capacity(rows * cols / AFFINE8_GROUP * 2);
    let mut b = Vec::with_capacity(rows * cols / AFFINE8_GROUP * 2);
    let bf = |v: f32| {
        // Round to nearest even bf16.
        let bits = v.to_bits();
        let r = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
        (r as u16).to_le_bytes()
    };
    for (wg, qg) in w
        .chunks_exact(AFFINE8_GROUP)
        .zip(q.chunks_exact_mut(AFFINE8_GROUP))
    {
        let (mn, mx) = wg
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                (a.min(x), b.max(x))
            });
        let mask = mn.abs() > mx.abs();
        let mut scale = ((mx - mn) / 255.0).max(1e-7);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { mn } else { mx };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for (o, &x) in qg.iter_mut().zip(wg) {
            *o = ((x - bias) / scale).round_ties_even().clamp(0.0, 255.0) as u8;
        }
        s.extend_from_slice(&bf(scale));
        b.extend_from_slice(&bf(bias));
    }
    (q, s, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 accumulation over `cols` terms against the f64 reference, relative to Σ|x·w|.
    const REL_TOL: f32 = 1e-5;

    fn rng(seed: &mut u64) -> f32 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        (*seed % 2_000_001) as f32 / 1_000_000.0 - 1.0
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn fast_matches_ref_and_decoded_dot() {
        let mut seed = 0x1234_5678_9abc_def1u64;
        for &(rows, cols) in &[(1, 64), (7, 128), (33, 192), (130, 640)] {
            let w: Vec<f32> = (0..rows * cols).map(|_| rng(&mut seed)).collect();
            let (q, s, b) = quantize_affine8(&w, rows, cols);
            let v = Affine8View::new(&q, &s, &b, rows, cols).unwrap();
            for &m in &[1usize, 2, 3, 4, 5, 9, 32] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng(&mut seed)).collect();
                let mut a = vec![0f32; m * rows];
                let mut f = vec![0f32; m * rows];
                affine8_matmul_ref(&x, m, &v, &mut a).unwrap();
                crate::simd::affine8_matmul(&x, m, &v, &mut f).unwrap();
                let mut row = vec![0f32; cols];
                for r in 0..rows {
                    v.decode_row(r, &mut row);
                    for c in 0..cols {
                        assert_eq!(row[c].to_bits(), v.get_ref(r, c).to_bits());
                    }
                    for i in 0..m {
                        let mag: f32 = (0..cols)
                            .map(|c| (x[i * cols + c] * row[c]).abs())
                            .sum::<f32>()
                            + 1e-30;
                        let (p, g) = (a[i * rows + r], f[i * rows + r]);
                        assert!((p - g).abs() <= REL_TOL * mag, "({i},{r}) {p} vs {g}");
                        let d = crate::simd::dot(&x[i * cols..(i + 1) * cols], &row);
                        assert_eq!(d.to_bits(), g.to_bits(), "bitwise vs dot ({i},{r})");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        assert!(Affine8View::new(&[0; 64], &[0; 2], &[0; 2], 1, 63).is_err());
        assert!(Affine8View::new(&[0; 64], &[0; 1], &[0; 2], 1, 64).is_err());
        let v = Affine8View::new(&[0; 64], &[0; 2], &[0; 2], 1, 64).unwrap();
        assert!(crate::simd::affine8_matmul(&[0.0; 3], 1, &v, &mut [0.0]).is_err());
    }
}
