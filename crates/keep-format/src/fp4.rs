//! FP4 E2M1 (OCP MX "float4_e2m1fn"): element decoders, encoders and nibble packing.
//!
//! What it is: the 4-bit element format of MXFP4 and DeepSeek's routed experts,
//! with a `_ref` decoder from the bit fields, compile-time tables (per nibble and
//! per packed byte), nearest-even and MLX-compatible encoders, and packed-slice
//! decode/encode. What it is not: block scaling (see [`crate::mx`]) or I/O.
//! Depends on `minifloat` (crate-private), [`crate::fp8`] (shared bit assembly) and [`crate::error`].
//!
//! # Nibble layout: `S EE M`, bias 1
//! * `E > 0`: `(-1)^S * (1 + M/2) * 2^(E-1)`; `E == 0`: `(-1)^S * M * 0.5`.
//! * codes 0..=7 → 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..=15 → the same negated (8 = -0.0).
//! * No NaN, no infinity.
//!
//! # Packing
//! Element `2j` is in the **low** nibble of byte `j`, element `2j+1` in the high
//! nibble (DeepSeek, NeMo and MLX agree).

use crate::error::{check_len, Result};
use crate::fp8::small_float_bits;
use crate::minifloat::{pow2, round_code};

/// Largest E2M1 magnitude (code 7).
pub const E2M1_MAX: f32 = 6.0;

/// Reference decoder from the definition (only the low 4 bits of `nibble` are used).
pub fn e2m1_to_f32_ref(nibble: u8) -> f32 {
    let s = (nibble >> 3) & 1;
    let e = ((nibble >> 1) & 0x3) as i32;
    let m = (nibble & 1) as i32;
    let mag = if e == 0 {
        m as f32 * 0.5
    } else {
        (1.0 + m as f32 / 2.0) * pow2(e - 1)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

const fn build_e2m1_lut() -> [f32; 16] {
    let mut t = [0.0f32; 16];
    let mut c = 0;
    while c < 16 {
        t[c] = f32::from_bits(small_float_bits(c as u32, 2, 1, 1));
        c += 1;
    }
    t
}

const fn build_e2m1_pair_lut() -> [[f32; 2]; 256] {
    let one = build_e2m1_lut();
    let mut t = [[0.0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [one[b & 0xF], one[b >> 4]];
        b += 1;
    }
    t
}

/// Every E2M1 nibble decoded (index = nibble). Built at compile time.
pub static E2M1_LUT: [f32; 16] = build_e2m1_lut();
/// Every packed byte decoded to its two elements `[low nibble, high nibble]`.
pub static E2M1_PAIR_LUT: [[f32; 2]; 256] = build_e2m1_pair_lut();

/// Fast E2M1 decode (table lookup; only the low 4 bits are used).
#[inline(always)]
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    E2M1_LUT[(nibble & 0xF) as usize]
}

/// Encode to E2M1, OCP / DeepSeek rule: round to nearest, ties to the even code
/// (0.25 → 0, 0.75 → 1.0, 1.25 → 1.0, 1.75 → 2, 2.5 → 2, 3.5 → 4, 5 → 4);
/// `|x| > 6` (and ±inf) saturates to ±6; the sign of zero is kept; NaN → `0x7`
/// (+6, as MLX; E2M1 has no NaN).
#[inline]
pub fn f32_to_e2m1(x: f32) -> u8 {
    let b = x.to_bits();
    let sign = ((b >> 28) & 0x8) as u8;
    let a = b & 0x7FFF_FFFF;
    if a > 0x7F80_0000 {
        return 0x7;
    }
    let code = round_code(a, 1, 0);
    sign | (if code > 7 { 7 } else { code as u8 })
}

/// Encode to E2M1 the way the keep reference notes record MLX 0.32.4 doing it:
/// round to nearest, **ties toward the smaller magnitude** (0.25 → 0, 0.75 → 0.5,
/// 1.25 → 1, 1.75 → 1.5, 2.5 → 2, 3.5 → 3, 5 → 4); saturate at ±6; sign of zero
/// kept; NaN → `0x7`. Differs from [`f32_to_e2m1`] only on exact ties.
/// Compare decoded values across encoders, never bytes.
#[inline]
pub fn f32_to_e2m1_mlx(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let sign = if x.is_sign_negative() { 0x8 } else { 0x0 };
    let a = x.abs();
    let code = if a > 5.0 {
        7
    } else if a > 3.5 {
        6
    } else if a > 2.5 {
        5
    } else if a > 1.75 {
        4
    } else if a > 1.25 {
        3
    } else if a > 0.75 {
        2
    } else if a > 0.25 {
        1
    } else {
        0
    };
    sign | code
}

/// Decode packed E2M1 (`dst.len() == 2 * src.len()`; element `2j` from the low nibble of byte `j`).
pub fn decode_e2m1_packed(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("e2m1 elements", src.len().saturating_mul(2), dst.len())?;
    for (d, &b) in dst.chunks_exact_mut(2).zip(src) {
        let p = E2M1_PAIR_LUT[b as usize];
        d[0] = p[0];
        d[1] = p[1];
    }
    Ok(())
}

/// Reference packed decode via [`e2m1_to_f32_ref`], nibble by nibble.
pub fn decode_e2m1_packed_ref(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("e2m1 elements", src.len().saturating_mul(2), dst.len())?;
    for (j, &b) in src.iter().enumerate() {
        dst[2 * j] = e2m1_to_f32_ref(b & 0xF);
        dst[2 * j + 1] = e2m1_to_f32_ref(b >> 4);
    }
    Ok(())
}

/// Pack nibbles (values 0..=15; higher bits ignored) two per byte, low nibble first
/// (`nibbles.len() == 2 * dst.len()`).
pub fn pack_nibbles(nibbles: &[u8], dst: &mut [u8]) -> Result<()> {
    check_len("e2m1 nibbles", dst.len().saturating_mul(2), nibbles.len())?;
    for (d, p) in dst.iter_mut().zip(nibbles.chunks_exact(2)) {
        *d = (p[0] & 0xF) | ((p[1] & 0xF) << 4);
    }
    Ok(())
}

/// Encode `src` with [`f32_to_e2m1`] and pack (`src.len() == 2 * dst.len()`).
pub fn encode_e2m1_packed(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_len("e2m1 elements", dst.len().saturating_mul(2), src.len())?;
    for (d, p) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32_to_e2m1(p[0]) | (f32_to_e2m1(p[1]) << 4);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_nearest, same};
    use proptest::prelude::*;

    fn table() -> Vec<(u8, f32)> {
        (0..16u8).map(|c| (c, e2m1_to_f32(c))).collect()
    }

    #[test]
    fn every_code_fast_vs_ref_and_table() {
        let expect = [0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for c in 0..16u8 {
            assert!(same(e2m1_to_f32(c), e2m1_to_f32_ref(c)), "{c}");
            let e = if c < 8 {
                expect[c as usize]
            } else {
                -expect[(c - 8) as usize]
            };
            assert!(same(e2m1_to_f32(c), e), "{c}");
            assert_eq!(f32_to_e2m1(e2m1_to_f32(c)), c);
            assert_eq!(f32_to_e2m1_mlx(e2m1_to_f32(c)), c);
        }
        assert_eq!(e2m1_to_f32(8).to_bits(), 0x8000_0000);
        for b in 0..=255u8 {
            assert!(same(E2M1_PAIR_LUT[b as usize][0], e2m1_to_f32_ref(b & 0xF)));
            assert!(same(E2M1_PAIR_LUT[b as usize][1], e2m1_to_f32_ref(b >> 4)));
        }
    }

    #[test]
    fn ties() {
        let even = [
            (0.25f32, 0.0f32),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
        ];
        let mlx = [
            (0.25f32, 0.0f32),
            (0.75, 0.5),
            (1.25, 1.0),
            (1.75, 1.5),
            (2.5, 2.0),
            (3.5, 3.0),
            (5.0, 4.0),
        ];
        for ((x, e), (_, m)) in even.iter().zip(&mlx) {
            assert_eq!(e2m1_to_f32(f32_to_e2m1(*x)), *e, "{x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1(-*x)), -*e, "-{x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1_mlx(*x)), *m, "mlx {x}");
            assert_eq!(e2m1_to_f32(f32_to_e2m1_mlx(-*x)), -*m, "mlx -{x}");
        }
        for x in [6.0f32, 6.5, 7.0, 100.0, f32::INFINITY] {
            assert_eq!(f32_to_e2m1(x), 7);
            assert_eq!(f32_to_e2m1(-x), 15);
            assert_eq!(f32_to_e2m1_mlx(x), 7);
            assert_eq!(f32_to_e2m1_mlx(-x), 15);
        }
        assert_eq!(f32_to_e2m1(f32::NAN), 7);
        assert_eq!(f32_to_e2m1(-0.0), 8);
        assert_eq!(f32_to_e2m1(-0.1), 8);
        assert_eq!(f32_to_e2m1_mlx(-0.1), 8);
    }

    #[test]
    fn nearest_sweep() {
        let t = table();
        for bits in (0u32..0x40C0_0001).step_by(1_009) {
            let x = f32::from_bits(bits);
            for y in [x, -x] {
                assert_nearest(y, f32_to_e2m1(y), &t);
                // MLX variant: nearest too, only the tie direction differs
                let m = e2m1_to_f32(f32_to_e2m1_mlx(y));
                let n = e2m1_to_f32(f32_to_e2m1(y));
                assert_eq!((y - m).abs(), (y - n).abs(), "{y}");
            }
        }
    }

    #[test]
    fn packing() {
        let src: Vec<u8> = (0..=255).collect();
        let mut a = vec![0.0; 512];
        let mut b = vec![0.0; 512];
        decode_e2m1_packed(&src, &mut a).unwrap();
        decode_e2m1_packed_ref(&src, &mut b).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| same(*x, *y)));
        // element 2j is the low nibble
        let mut d = [0.0; 2];
        decode_e2m1_packed(&[0x71], &mut d).unwrap();
        assert_eq!(d, [0.5, 6.0]);
        let mut enc = vec![0u8; 256];
        encode_e2m1_packed(&a, &mut enc).unwrap();
        assert_eq!(enc, src);
        let nibbles: Vec<u8> = src.iter().flat_map(|b| [b & 0xF, b >> 4]).collect();
        let mut packed = vec![0u8; 256];
        pack_nibbles(&nibbles, &mut packed).unwrap();
        assert_eq!(packed, src);
        assert!(decode_e2m1_packed(&src, &mut a[1..]).is_err());
        assert!(decode_e2m1_packed_ref(&src, &mut a[1..]).is_err());
        assert!(encode_e2m1_packed(&b[1..], &mut enc).is_err());
        assert!(pack_nibbles(&nibbles[1..], &mut packed).is_err());
    }

    proptest! {
        #[test]
        fn e2m1_nearest(x in -6.0f32..=6.0) {
            assert_nearest(x, f32_to_e2m1(x), &table());
        }
    }
}
