//! MXFP8 / MXFP4 rows (OCP Microscaling v1.0) in MLX's `mx.quantize(mode="mxfp8"|"mxfp4")` layout.
//!
//! What it is: row decoders (a `_ref` built from the element and scale `_ref`s, and a
//! fast path using the compile-time tables, one scale per 32 elements hoisted out of
//! the inner loop) and row quantizers using the ceil shared-exponent rule. What it is
//! not: a GEMV kernel, a multi-row tensor type, or I/O. Depends on [`crate::fp8`],
//! [`crate::fp4`], [`crate::e8m0`] and [`crate::error`].
//!
//! # Layout (one row of `cols` elements, `cols % 32 == 0`)
//! * MXFP8: `elems` = `cols` E4M3FN bytes, row-major. MLX's `uint32 [rows, cols/4]` words
//!   are exactly these bytes little-endian (element 0 in the lowest bits), so a DeepSeek
//!   `F8_E4M3 [rows, cols]` tensor is the same bytes.
//! * MXFP4: `packed` = `cols/2` bytes, element `2j` in the low nibble of byte `j`
//!   (MLX `uint32 [rows, cols/8]`, DeepSeek `I8 [rows, cols/2]`: same bytes).
//! * `scales` = `cols/32` E8M0 bytes; group `g` covers elements `32g..32g+32`.
//!
//! # Decode
//! `w[i] = e8m0(scales[i / 32]) * elem(i)`, computed as one `f32` multiply of the two
//! decoded `f32`s, which is what MLX's float32 dequantize does (it builds the scale as
//! bf16 `b << 7`, exact for every byte but `0xFF`, including 2^-127 as bf16 `0x0040`).
//! The product is exact unless it overflows: an E4M3 value has at most 4 significant
//! bits and magnitude >= 2^-9, so even times 2^-127 it lands at >= 2^-136 with room to
//! spare in f32's subnormal range (2^-149 granularity); E2M1 likewise. Large elements
//! under scale bytes above 246 (E4M3) / 252 (E2M1) overflow to ±inf, as in MLX. A `0xFF` scale decodes to
//! NaN here (MLX: inf); validate with [`crate::e8m0::check_e8m0_scales`] where it matters.
//!
//! # Quantize
//! Per 32-group: `amax = max |x|` (NaN ignored), scale byte `b = ceil_exponent(amax, max_elem)`
//! ([`crate::e8m0::ceil_exponent`]: the DeepSeek V4 / MLX >= 0.32.4 rule, never needs
//! saturation), element = encode(`x / 2^(b-127)`) with [`f32_to_e4m3`] / [`f32_to_e2m1`]
//! (nearest-even). No amax floor: an all-zero group gets byte 0 and zero elements.

use crate::e8m0::{ceil_exponent, e8m0_to_f32, e8m0_to_f32_ref, E8M0_LUT};
use crate::error::{check_aligned, check_len, Result};
use crate::fp4::{e2m1_to_f32_ref, f32_to_e2m1, E2M1_MAX, E2M1_PAIR_LUT};
use crate::fp8::{e4m3_to_f32_ref, f32_to_e4m3, E4M3_LUT, E4M3_MAX};

/// Elements per shared scale.
pub const MX_GROUP: usize = 32;

fn check_mxfp8(elems: usize, scales: usize, cols: usize) -> Result<()> {
    check_aligned("mxfp8 row", cols, MX_GROUP)?;
    check_len("mxfp8 elements", cols, elems)?;
    check_len("mxfp8 scales", cols / MX_GROUP, scales)
}

fn check_mxfp4(packed: usize, scales: usize, cols: usize) -> Result<()> {
    check_aligned("mxfp4 row", cols, MX_GROUP)?;
    check_len("mxfp4 packed bytes", cols / 2, packed)?;
    check_len("mxfp4 scales", cols / MX_GROUP, scales)
}

/// Reference MXFP8 row decode: `dst[i] = e8m0_ref(scales[i/32]) * e4m3_ref(elems[i])`.
/// `cols = dst.len()`; needs `cols % 32 == 0`, `elems.len() == cols`, `scales.len() == cols/32`.
pub fn decode_mxfp8_row_ref(elems: &[u8], scales: &[u8], dst: &mut [f32]) -> Result<()> {
    check_mxfp8(elems.len(), scales.len(), dst.len())?;
    for (i, d) in dst.iter_mut().enumerate() {
        *d = e8m0_to_f32_ref(scales[i / MX_GROUP]) * e4m3_to_f32_ref(elems[i]);
    }
    Ok(())
}

/// Fast MXFP8 row decode; bit-identical to [`decode_mxfp8_row_ref`].
pub fn decode_mxfp8_row(elems: &[u8], scales: &[u8], dst: &mut [f32]) -> Result<()> {
    check_mxfp8(elems.len(), scales.len(), dst.len())?;
    for ((d, q), &s) in dst
        .chunks_exact_mut(MX_GROUP)
        .zip(elems.chunks_exact(MX_GROUP))
        .zip(scales)
    {
        let sc = E8M0_LUT[s as usize];
        for (o, &c) in d.iter_mut().zip(q) {
            *o = sc * E4M3_LUT[c as usize];
        }
    }
    Ok(())
}

/// Reference MXFP4 row decode: `dst[i] = e8m0_ref(scales[i/32]) * e2m1_ref(nibble i)`.
/// `cols = dst.len()`; needs `cols % 32 == 0`, `packed.len() == cols/2`, `scales.len() == cols/32`.
pub fn decode_mxfp4_row_ref(packed: &[u8], scales: &[u8], dst: &mut [f32]) -> Result<()> {
    check_mxfp4(packed.len(), scales.len(), dst.len())?;
    for (i, d) in dst.iter_mut().enumerate() {
        let byte = packed[i / 2];
        let nibble = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
        *d = e8m0_to_f32_ref(scales[i / MX_GROUP]) * e2m1_to_f32_ref(nibble);
    }
    Ok(())
}

/// Fast MXFP4 row decode (one table lookup per byte); bit-identical to [`decode_mxfp4_row_ref`].
pub fn decode_mxfp4_row(packed: &[u8], scales: &[u8], dst: &mut [f32]) -> Result<()> {
    check_mxfp4(packed.len(), scales.len(), dst.len())?;
    for ((d, q), &s) in dst
        .chunks_exact_mut(MX_GROUP)
        .zip(packed.chunks_exact(MX_GROUP / 2))
        .zip(scales)
    {
        let sc = E8M0_LUT[s as usize];
        for (o, &b) in d.chunks_exact_mut(2).zip(q) {
            let p = E2M1_PAIR_LUT[b as usize];
            o[0] = sc * p[0];
            o[1] = sc * p[1];
        }
    }
    Ok(())
}

/// `max |x|` over a group, ignoring NaN (0 for an empty or all-NaN group).
#[inline]
pub(crate) fn amax(xs: &[f32]) -> f32 {
    xs.iter().fold(0.0f32, |m, &x| m.max(x.abs()))
}

/// Quantize one row to MXFP8 (ceil shared exponent, nearest-even E4M3 elements).
/// `cols = src.len()`; needs `cols % 32 == 0`, `elems.len() == cols`, `scales.len() == cols/32`.
pub fn quantize_mxfp8_row(src: &[f32], elems: &mut [u8], scales: &mut [u8]) -> Result<()> {
    check_mxfp8(elems.len(), scales.len(), src.len())?;
    for ((x, q), s) in src
        .chunks_exact(MX_GROUP)
        .zip(elems.chunks_exact_mut(MX_GROUP))
        .zip(scales.iter_mut())
    {
        let b = ceil_exponent(amax(x), E4M3_MAX);
        let scale = e8m0_to_f32(b);
        *s = b;
        for (o, &v) in q.iter_mut().zip(x) {
            *o = f32_to_e4m3(v / scale);
        }
    }
    Ok(())
}

/// Quantize one row to MXFP4 (ceil shared exponent, nearest-even E2M1 elements, packed
/// low nibble first). `cols = src.len()`; needs `cols % 32 == 0`, `packed.len() == cols/2`,
/// `scales.len() == cols/32`.
pub fn quantize_mxfp4_row(src: &[f32], packed: &mut [u8], scales: &mut [u8]) -> Result<()> {
    check_mxfp4(packed.len(), scales.len(), src.len())?;
    for ((x, q), s) in src
        .chunks_exact(MX_GROUP)
        .zip(packed.chunks_exact_mut(MX_GROUP / 2))
        .zip(scales.iter_mut())
    {
        let b = ceil_exponent(amax(x), E2M1_MAX);
        let scale = e8m0_to_f32(b);
        *s = b;
        for (o, p) in q.iter_mut().zip(x.chunks_exact(2)) {
            *o = f32_to_e2m1(p[0] / scale) | (f32_to_e2m1(p[1] / scale) << 4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;
    use crate::FormatError;
    use proptest::prelude::*;

    /// 32 bits of keep-rng's generator.
    fn draw32(r: &mut keep_rng::Rng) -> u32 {
        keep_rng::RngCore::next_u32(r)
    }

    #[test]
    fn fast_vs_ref_every_code_and_scale() {
        // cover all 256 element codes against all 256 scale bytes
        let elems: Vec<u8> = (0..=255u8).collect();
        let mut a = vec![0.0; 256];
        let mut b = vec![0.0; 256];
        for s0 in 0..=255u8 {
            let scales: Vec<u8> = (0..8u8)
                .map(|g| s0.wrapping_add(g.wrapping_mul(37)))
                .collect();
            decode_mxfp8_row(&elems, &scales, &mut a).unwrap();
            decode_mxfp8_row_ref(&elems, &scales, &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| same(*x, *y)), "scale {s0}");
            decode_mxfp4_row(&elems[..128], &scales, &mut a).unwrap();
            decode_mxfp4_row_ref(&elems[..128], &scales, &mut b).unwrap();
            assert!(
                a.iter().zip(&b).all(|(x, y)| same(*x, *y)),
                "fp4 scale {s0}"
            );
        }
    }

    #[test]
    fn products_are_exact() {
        // exact in f64 and representable in f32: check against f64 product
        for s in 0..=254u8 {
            for c in 0..=255u8 {
                let v = crate::fp8::e4m3_to_f32(c);
                if v.is_nan() {
                    continue;
                }
                let p = e8m0_to_f32(s) * v;
                if p.is_infinite() {
                    assert!(s > 246);
                    continue;
                }
                assert_eq!(p as f64, e8m0_to_f32(s) as f64 * v as f64, "{s} {c}");
            }
        }
        // 2^-127 * 2^-9
        let mut d = [0.0f32; 32];
        let mut e = [0u8; 32];
        e[0] = 0x01;
        decode_mxfp8_row(&e, &[0], &mut d).unwrap();
        assert_eq!(d[0], 2f64.powi(-136) as f32);
        assert_eq!(d[0].to_bits(), 1 << 13);
    }

    #[test]
    fn errors_not_panics() {
        let mut d = vec![0.0; 64];
        assert!(matches!(
            decode_mxfp8_row(&[0; 64], &[0; 1], &mut d),
            Err(FormatError::LengthMismatch {
                what: "mxfp8 scales",
                expected: 2,
                got: 1
            })
        ));
        assert!(decode_mxfp8_row(&[0; 63], &[0; 2], &mut d).is_err());
        assert!(decode_mxfp8_row_ref(&[0; 63], &[0; 2], &mut d).is_err());
        assert!(matches!(
            decode_mxfp8_row(&[0; 48], &[0; 1], &mut d[..48]),
            Err(FormatError::Unaligned {
                cols: 48,
                multiple: 32,
                ..
            })
        ));
        assert!(decode_mxfp4_row(&[0; 31], &[0; 2], &mut d).is_err());
        assert!(decode_mxfp4_row_ref(&[0; 32], &[0; 3], &mut d).is_err());
        assert!(quantize_mxfp8_row(&d, &mut [0; 63], &mut [0; 2]).is_err());
        assert!(quantize_mxfp4_row(&d, &mut [0; 32], &mut [0; 1]).is_err());
        assert!(quantize_mxfp4_row(&d[..40], &mut [0; 20], &mut [0; 1]).is_err());
        // empty rows are fine
        assert!(decode_mxfp8_row(&[], &[], &mut []).is_ok());
    }

    #[test]
    fn quantize_error_bounds_and_idempotence() {
        let mut seed = keep_rng::rng(7);
        for trial in 0..400 {
            let cols = 32 * (1 + trial % 5);
            // wide dynamic range, occasional zeros, an exponent offset per trial
            let off = (trial as i32 % 60) - 30;
            let src: Vec<f32> = (0..cols)
                .map(|_| {
                    let r = draw32(&mut seed);
                    if r.is_multiple_of(17) {
                        0.0
                    } else {
                        let m = (r >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0;
                        m * 2f32.powi(off + (r % 7) as i32)
                    }
                })
                .collect();
            let (mut e8, mut s8) = (vec![0u8; cols], vec![0u8; cols / 32]);
            let (mut e4, mut s4) = (vec![0u8; cols / 2], vec![0u8; cols / 32]);
            quantize_mxfp8_row(&src, &mut e8, &mut s8).unwrap();
            quantize_mxfp4_row(&src, &mut e4, &mut s4).unwrap();
            let mut d8 = vec![0.0; cols];
            let mut d4 = vec![0.0; cols];
            decode_mxfp8_row(&e8, &s8, &mut d8).unwrap();
            decode_mxfp4_row(&e4, &s4, &mut d4).unwrap();
            for i in 0..cols {
                let scale8 = e8m0_to_f32(s8[i / 32]);
                let scale4 = e8m0_to_f32(s4[i / 32]);
                let x = src[i];
                // E4M3: half-ulp is <= |x|/16 in normals, 2^-10 * scale in subnormals
                let b8 = (x.abs() / 16.0).max(scale8 * 2f32.powi(-10));
                assert!((x - d8[i]).abs() <= b8, "mxfp8 x={x} got {}", d8[i]);
                // E2M1: half-step is <= |x|/4 in normals, 0.25 * scale at the bottom
                let b4 = (x.abs() / 4.0).max(scale4 * 0.25);
                assert!((x - d4[i]).abs() <= b4, "mxfp4 x={x} got {}", d4[i]);
            }
            // the scale is the smallest that avoids saturation
            for g in 0..cols / 32 {
                let a = amax(&src[32 * g..32 * g + 32]);
                if a > 0.0 {
                    assert!(e8m0_to_f32(s8[g]) * 448.0 >= a);
                    assert!(s8[g] == 0 || e8m0_to_f32(s8[g] - 1) * 448.0 < a);
                }
            }
            // re-quantizing decoded values reproduces them exactly
            let (mut e8b, mut s8b) = (vec![0u8; cols], vec![0u8; cols / 32]);
            quantize_mxfp8_row(&d8, &mut e8b, &mut s8b).unwrap();
            let mut d8b = vec![0.0; cols];
            decode_mxfp8_row(&e8b, &s8b, &mut d8b).unwrap();
            assert!(d8.iter().zip(&d8b).all(|(a, b)| same(*a, *b)));
            let (mut e4b, mut s4b) = (vec![0u8; cols / 2], vec![0u8; cols / 32]);
            quantize_mxfp4_row(&d4, &mut e4b, &mut s4b).unwrap();
            let mut d4b = vec![0.0; cols];
            decode_mxfp4_row(&e4b, &s4b, &mut d4b).unwrap();
            assert!(d4.iter().zip(&d4b).all(|(a, b)| same(*a, *b)));
        }
    }

    #[test]
    fn zero_and_nan_groups() {
        let src = [0.0f32; 32];
        let (mut e, mut s) = ([0u8; 32], [9u8; 1]);
        quantize_mxfp8_row(&src, &mut e, &mut s).unwrap();
        assert_eq!((s[0], e), (0, [0u8; 32]));
        let mut src = [1.0f32; 32];
        src[3] = f32::NAN;
        quantize_mxfp8_row(&src, &mut e, &mut s).unwrap();
        assert_eq!(s[0], crate::e8m0::ceil_exponent(1.0, 448.0));
        assert_eq!(e[3], crate::fp8::E4M3_NAN);
    }

    proptest! {
        #[test]
        fn decode_quantize_decode_is_identity(
            elems in proptest::collection::vec(any::<u8>(), 64),
            scales in proptest::collection::vec(0u8..=246, 2),
        ) {
            // MXFP8 (NaN elements excluded)
            let elems8: Vec<u8> = elems.iter().map(|&c| if c & 0x7F == 0x7F { 0 } else { c }).collect();
            let mut d = vec![0.0; 64];
            decode_mxfp8_row(&elems8, &scales, &mut d).unwrap();
            let (mut e2, mut s2) = (vec![0u8; 64], vec![0u8; 2]);
            quantize_mxfp8_row(&d, &mut e2, &mut s2).unwrap();
            let mut d2 = vec![0.0; 64];
            decode_mxfp8_row(&e2, &s2, &mut d2).unwrap();
            prop_assert!(d.iter().zip(&d2).all(|(a, b)| same(*a, *b)));
            // MXFP4
            let mut d = vec![0.0; 64];
            decode_mxfp4_row(&elems[..32], &scales, &mut d).unwrap();
            let (mut e2, mut s2) = (vec![0u8; 32], vec![0u8; 2]);
            quantize_mxfp4_row(&d, &mut e2, &mut s2).unwrap();
            let mut d2 = vec![0.0; 64];
            decode_mxfp4_row(&e2, &s2, &mut d2).unwrap();
            prop_assert!(d.iter().zip(&d2).all(|(a, b)| same(*a, *b)));
        }
    }
}
