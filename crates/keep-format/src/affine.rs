//! MLX affine 8-bit quantization (`mx.quantize(w, mode="affine", bits=8, group_size=64)`).
//!
//! What it is: row decoders (`_ref` and a fast, autovectorisable path) and a row quantizer
//! that follows MLX's CPU `affine_quantize` rule, for 8-bit codes in groups of 64 columns
//! with a scale and a bias per group (bf16, f16 or f32, as raw little-endian bytes, `u16`
//! codes or `f32`). What it is not: 2/3/4/5/6-bit packing, other group sizes (the `_gs`
//! functions take one, but only 8-bit), a GEMV kernel, or I/O. Depends on [`crate::bf16`],
//! [`crate::f16`] and [`crate::error`].
//!
//! # Layout (one row of `cols` elements, `cols % 64 == 0`)
//! * `q`: `cols` bytes. MLX stores `uint32 [rows, cols/4]` words with element 0 in the
//!   lowest bits, i.e. exactly these bytes little-endian.
//! * `scales`, `biases`: `cols/64` values each; group `g` covers columns `64g..64g+64`.
//!
//! # Decode
//! `w[i] = scale[i/64] * (q[i] as f32) + bias[i/64]`, evaluated in `f32` as a multiply then
//! an add (two roundings, no FMA), scale and bias first widened exactly to `f32`. MLX's
//! `mx.dequantize` returns the scales' dtype (bf16) by default, i.e. this value rounded
//! once more; compare with `dtype=mx.float32` or at one bf16 ulp.
//!
//! # Quantize (MLX's rule, read from `mlx/backend/cpu/quantized.cpp`, `quantize<T, U>`)
//! Per group, in `f32`: `min`, `max` (NaN ignored); `s = max((max - min) / 255, 1e-7)`;
//! the *edge* is whichever of `min`/`max` has the larger magnitude (`max` on a tie), and
//! `s` is negated when the edge is `max`; `q0 = rint(edge / s)`; if `q0 != 0` then
//! `s = edge / q0`, `bias = edge`, else `bias = 0`; `q = clamp(rint((w - bias) / s), 0, 255)`
//! with `rint` = round half to even. So the edge value is reproduced exactly and the scale
//! may be negative. The codes are computed with the `f32` scale/bias; the stored scale and
//! bias are then rounded to their dtype (as MLX does). Decode is what matters for keep:
//! any encoder's output is decoded by the formula above.

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::error::{check_aligned, check_len, Result};
use crate::f16::f16_to_f32;

/// MLX's default (and keep's) group size for affine-8.
pub const AFFINE_GROUP: usize = 64;
/// MLX's lower bound on `(max - min) / 255`.
pub const AFFINE_EPS: f32 = 1e-7;
/// A per-group parameter vector (scales or biases) in one of the dtypes MLX writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamSlice<'a> {
    /// bf16 codes.
    Bf16(&'a [u16]),
    /// bf16, little-endian bytes (2 per value), as read from a safetensors buffer.
    Bf16Le(&'a [u8]),
    /// IEEE f16 codes.
    F16(&'a [u16]),
    /// f16, little-endian bytes (2 per value).
    F16Le(&'a [u8]),
    /// f32 values.
    F32(&'a [f32]),
}

impl ParamSlice<'_> {
    /// Number of values (bytes / 2 for the `*Le` variants, rounded down).
    pub fn len(&self) -> usize {
        match self {
            ParamSlice::Bf16(s) | ParamSlice::F16(s) => s.len(),
            ParamSlice::Bf16Le(b) | ParamSlice::F16Le(b) => b.len() / 2,
            ParamSlice::F32(s) => s.len(),
        }
    }

    /// `true` when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of stored bytes that do not form a whole value (0 or 1).
    fn stray_bytes(&self) -> usize {
        match self {
            ParamSlice::Bf16Le(b) | ParamSlice::F16Le(b) => b.len() % 2,
            _ => 0,
        }
    }

    /// Value `i` widened exactly to `f32`. `i` must be `< len()` (callers check).
    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ParamSlice::Bf16(s) => bf16_to_f32(s[i]),
            ParamSlice::Bf16Le(b) => bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            ParamSlice::F16(s) => f16_to_f32(s[i]),
            ParamSlice::F16Le(b) => f16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
            ParamSlice::F32(s) => s[i],
        }
    }
}

fn check_affine(
    q: usize,
    scales: ParamSlice,
    biases: ParamSlice,
    cols: usize,
    gs: usize,
) -> Result<()> {
    if gs == 0 {
        return Err(crate::FormatError::InvalidBlock { rows: 1, cols: 0 });
    }
    check_aligned("affine8 row", cols, gs)?;
    check_len("affine8 codes", cols, q)?;
    check_len("affine8 scales", cols / gs, scales.len())?;
    check_len("affine8 biases", cols / gs, biases.len())?;
    check_len("affine8 scale bytes (odd count)", 0, scales.stray_bytes())?;
    check_len("affine8 bias bytes (odd count)", 0, biases.stray_bytes())
}

/// Reference affine-8 row decode (group 64): `dst[i] = scale[i/64] * q[i] + bias[i/64]`.
/// `cols = dst.len()`; needs `cols % 64 == 0`, `q.len() == cols`, `cols/64` scales and biases.
pub fn decode_affine8_row_ref(
    q: &[u8],
    scales: ParamSlice,
    biases: ParamSlice,
    dst: &mut [f32],
) -> Result<()> {
    decode_affine8_row_ref_gs(q, AFFINE_GROUP, scales, biases, dst)
}

/// Fast affine-8 row decode (group 64); bit-identical to [`decode_affine8_row_ref`].
pub fn decode_affine8_row(
    q: &[u8],
    scales: ParamSlice,
    biases: ParamSlice,
    dst: &mut [f32],
) -> Result<()> {
    decode_affine8_row_gs(q, AFFINE_GROUP, scales, biases, dst)
}

/// [`decode_affine8_row_ref`] with an explicit group size (MLX allows 32, 64, 128).
pub fn decode_affine8_row_ref_gs(
    q: &[u8],
    group_size: usize,
    scales: ParamSlice,
    biases: ParamSlice,
    dst: &mut [f32],
) -> Result<()> {
    check_affine(q.len(), scales, biases, dst.len(), group_size)?;
    for (i, d) in dst.iter_mut().enumerate() {
        let g = i / group_size;
        let prod = scales.get(g) * f32::from(q[i]);
        *d = prod + biases.get(g);
    }
    Ok(())
}

/// [`decode_affine8_row`] with an explicit group size.
pub fn decode_affine8_row_gs(
    q: &[u8],
    group_size: usize,
    scales: ParamSlice,
    biases: ParamSlice,
    dst: &mut [f32],
) -> Result<()> {
    check_affine(q.len(), scales, biases, dst.len(), group_size)?;
    for (g, (d, qg)) in dst
        .chunks_exact_mut(group_size)
        .zip(q.chunks_exact(group_size))
        .enumerate()
    {
        let (s, b) = (scales.get(g), biases.get(g));
        for (o, &c) in d.iter_mut().zip(qg) {
            *o = s * f32::from(c) + b;
        }
    }
    Ok(())
}

/// MLX's per-group rule (see the module doc) for `n = 2^bits − 1` steps: returns
/// `(scale, bias)` in `f32` and writes the codes to `q`. The 8-bit layout here and MLX's 2/3/4-bit
/// packing ([`crate::mlx_affine`]) share it.
pub fn quantize_group_bits(bits: u32, w: &[f32], q: &mut [u8]) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
    for &x in w {
        w_max = w_max.max(x);
        w_min = w_min.min(x);
    }
    let mask = w_min.abs() > w_max.abs();
    let mut scale = ((w_max - w_min) / n_bins).max(AFFINE_EPS);
    if !mask {
        scale = -scale;
    }
    let edge = if mask { w_min } else { w_max };
    let q0 = (edge / scale).round_ties_even();
    let mut bias = 0.0;
    if q0 != 0.0 {
        scale = edge / q0;
        bias = edge;
    }
    for (o, &x) in q.iter_mut().zip(w) {
        let v = ((x - bias) / scale).round_ties_even();
        // NaN -> 0 via the saturating float-to-int cast
        *o = v.clamp(0.0, n_bins) as u8;
    }
    (scale, bias)
}

/// The 8-bit rule.
fn quantize_group(w: &[f32], q: &mut [u8]) -> (f32, f32) {
    quantize_group_bits(8, w, q)
}

/// Quantize one row with MLX's affine rule (group 64), scales and biases as `f32`
/// (before any rounding to a storage dtype). `cols = src.len()`, `cols % 64 == 0`.
pub fn quantize_affine8_row(
    src: &[f32],
    q: &mut [u8],
    scales: &mut [f32],
    biases: &mut [f32],
) -> Result<()> {
    check_aligned("affine8 row", src.len(), AFFINE_GROUP)?;
    check_len("affine8 codes", src.len(), q.len())?;
    check_len("affine8 scales", src.len() / AFFINE_GROUP, scales.len())?;
    check_len("affine8 biases", src.len() / AFFINE_GROUP, biases.len())?;
    for (((w, qg), s), b) in src
        .chunks_exact(AFFINE_GROUP)
        .zip(q.chunks_exact_mut(AFFINE_GROUP))
        .zip(scales.iter_mut())
        .zip(biases.iter_mut())
    {
        (*s, *b) = quantize_group(w, qg);
    }
    Ok(())
}

/// As [`quantize_affine8_row`], storing scales and biases as bf16 codes (round to nearest
/// even), which is what `mx.quantize` of a bf16 weight returns. The codes are computed with
/// the unrounded `f32` scale/bias, as MLX does.
pub fn quantize_affine8_row_bf16(
    src: &[f32],
    q: &mut [u8],
    scales: &mut [u16],
    biases: &mut [u16],
) -> Result<()> {
    check_aligned("affine8 row", src.len(), AFFINE_GROUP)?;
    check_len("affine8 codes", src.len(), q.len())?;
    check_len("affine8 scales", src.len() / AFFINE_GROUP, scales.len())?;
    check_len("affine8 biases", src.len() / AFFINE_GROUP, biases.len())?;
    for (((w, qg), s), b) in src
        .chunks_exact(AFFINE_GROUP)
        .zip(q.chunks_exact_mut(AFFINE_GROUP))
        .zip(scales.iter_mut())
        .zip(biases.iter_mut())
    {
        let (sf, bf) = quantize_group(w, qg);
        *s = f32_to_bf16(sf);
        *b = f32_to_bf16(bf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;
    use crate::FormatError;

    /// 32 bits of keep-rng's generator.
    fn draw32(r: &mut keep_rng::Rng) -> u32 {
        keep_rng::RngCore::next_u32(r)
    }

    #[test]
    fn ref_vs_fast_every_code_all_param_kinds() {
        let mut seed = keep_rng::rng(9);
        let q: Vec<u8> = (0..=255u8).cycle().take(1024).collect();
        for _ in 0..50 {
            let s16: Vec<u16> = (0..16).map(|_| draw32(&mut seed) as u16).collect();
            let b16: Vec<u16> = (0..16).map(|_| draw32(&mut seed) as u16).collect();
            let s8: Vec<u8> = s16.iter().flat_map(|v| v.to_le_bytes()).collect();
            let b8: Vec<u8> = b16.iter().flat_map(|v| v.to_le_bytes()).collect();
            let s32: Vec<f32> = (0..16).map(|_| f32::from_bits(draw32(&mut seed))).collect();
            let b32: Vec<f32> = (0..16).map(|_| f32::from_bits(draw32(&mut seed))).collect();
            let kinds = [
                (ParamSlice::Bf16(&s16), ParamSlice::Bf16(&b16)),
                (ParamSlice::Bf16Le(&s8), ParamSlice::Bf16Le(&b8)),
                (ParamSlice::F16(&s16), ParamSlice::F16(&b16)),
                (ParamSlice::F16Le(&s8), ParamSlice::F16Le(&b8)),
                (ParamSlice::F32(&s32), ParamSlice::F32(&b32)),
            ];
            for (s, b) in kinds {
                let mut x = vec![0.0; 1024];
                let mut y = vec![0.0; 1024];
                decode_affine8_row_ref(&q, s, b, &mut x).unwrap();
                decode_affine8_row(&q, s, b, &mut y).unwrap();
                assert!(x.iter().zip(&y).all(|(a, c)| same(*a, *c)));
            }
            // byte and u16 forms agree
            let mut x = vec![0.0; 1024];
            let mut y = vec![0.0; 1024];
            decode_affine8_row(&q, ParamSlice::Bf16(&s16), ParamSlice::Bf16(&b16), &mut x).unwrap();
            decode_affine8_row(&q, ParamSlice::Bf16Le(&s8), ParamSlice::Bf16Le(&b8), &mut y)
                .unwrap();
            assert!(x.iter().zip(&y).all(|(a, c)| same(*a, *c)));
        }
        let mut d = vec![0.0; 128];
        let q2: Vec<u8> = (0..128).map(|i| i as u8).collect();
        decode_affine8_row_gs(
            &q2,
            32,
            ParamSlice::F32(&[1.0, 2.0, 0.5, -1.0]),
            ParamSlice::F32(&[0.0, 1.0, 0.0, 3.0]),
            &mut d,
        )
        .unwrap();
        assert_eq!((d[1], d[33], d[64], d[127]), (1.0, 67.0, 32.0, 3.0 - 127.0));
    }

    #[test]
    fn errors_not_panics() {
        let mut d = vec![0.0; 128];
        let s = [0u16; 2];
        assert!(matches!(
            decode_affine8_row(
                &[0; 128],
                ParamSlice::Bf16(&s),
                ParamSlice::Bf16(&s[..1]),
                &mut d
            ),
            Err(FormatError::LengthMismatch {
                what: "affine8 biases",
                expected: 2,
                got: 1
            })
        ));
        assert!(decode_affine8_row_ref(
            &[0; 127],
            ParamSlice::Bf16(&s),
            ParamSlice::Bf16(&s),
            &mut d
        )
        .is_err());
        assert!(matches!(
            decode_affine8_row(
                &[0; 96],
                ParamSlice::Bf16(&s),
                ParamSlice::Bf16(&s),
                &mut d[..96]
            ),
            Err(FormatError::Unaligned {
                cols: 96,
                multiple: 64,
                ..
            })
        ));
        assert!(decode_affine8_row(
            &[0; 128],
            ParamSlice::Bf16Le(&[0; 5]),
            ParamSlice::Bf16(&s),
            &mut d
        )
        .is_err());
        assert!(decode_affine8_row_gs(
            &[0; 128],
            0,
            ParamSlice::Bf16(&s),
            ParamSlice::Bf16(&s),
            &mut d
        )
        .is_err());
        assert!(quantize_affine8_row(&d, &mut [0; 128], &mut [0.0; 1], &mut [0.0; 2]).is_err());
        assert!(
            quantize_affine8_row_bf16(&d[..100], &mut [0; 100], &mut [0; 1], &mut [0; 1]).is_err()
        );
    }

    #[test]
    fn quantize_follows_mlx_rule_and_bounds() {
        // a hand-worked group: 0..63 -> edge is max (63), scale negative
        let w: Vec<f32> = (0..64).map(|j| j as f32).collect();
        let (mut q, mut s, mut b) = (vec![0u8; 64], [0.0f32], [0.0f32]);
        quantize_affine8_row(&w, &mut q, &mut s, &mut b).unwrap();
        assert_eq!(b[0], 63.0);
        assert_eq!(s[0], 63.0 / -255.0);
        assert_eq!((q[63], q[0]), (0, 255));
        // edge = min when |min| > |max|
        let w2: Vec<f32> = (0..64).map(|j| -(j as f32)).collect();
        quantize_affine8_row(&w2, &mut q, &mut s, &mut b).unwrap();
        assert_eq!(b[0], -63.0);
        assert!(s[0] > 0.0);
        // constant group
        quantize_affine8_row(&[0.0; 64], &mut q, &mut s, &mut b).unwrap();
        assert_eq!((b[0], q[0]), (0.0, 0));

        let mut seed = keep_rng::rng(4);
        for trial in 0..200 {
            let cols = 64 * (1 + trial % 4);
            let off = (trial % 20) as i32 - 10;
            let w: Vec<f32> = (0..cols)
                .map(|_| {
                    ((draw32(&mut seed) >> 8) as f32 / (1u32 << 24) as f32 - 0.3) * 2f32.powi(off)
                })
                .collect();
            let mut q = vec![0u8; cols];
            let mut s = vec![0.0f32; cols / 64];
            let mut b = vec![0.0f32; cols / 64];
            quantize_affine8_row(&w, &mut q, &mut s, &mut b).unwrap();
            let mut d = vec![0.0; cols];
            decode_affine8_row(&q, ParamSlice::F32(&s), ParamSlice::F32(&b), &mut d).unwrap();
            for i in 0..cols {
                // half a step, plus the clamp at the far end after MLX adjusts the scale to hit the edge
                let bound = s[i / 64].abs() * 1.5;
                assert!(
                    (w[i] - d[i]).abs() <= bound,
                    "w={} d={} s={}",
                    w[i],
                    d[i],
                    s[i / 64]
                );
            }
            // the edge value is reproduced exactly in f32
            for g in 0..cols / 64 {
                let grp = &w[64 * g..64 * g + 64];
                assert!(grp.contains(&b[g]));
            }
            // bf16 variant: same codes, rounded parameters
            let mut q2 = vec![0u8; cols];
            let mut s2 = vec![0u16; cols / 64];
            let mut b2 = vec![0u16; cols / 64];
            quantize_affine8_row_bf16(&w, &mut q2, &mut s2, &mut b2).unwrap();
            assert_eq!(q, q2);
            assert!(s.iter().zip(&s2).all(|(a, c)| f32_to_bf16(*a) == *c));
        }
    }
}
