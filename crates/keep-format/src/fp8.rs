//! FP8 element formats: E4M3FN (OCP "fn": no infinity) and E5M2 (IEEE-like).
//!
//! What it is: per-code decoders (a `_ref` written from the bit-field definition,
//! a fast 256-entry table built at compile time by an independent `const fn`),
//! round-to-nearest-even encoders, and byte-slice decoders. What it is not:
//! block scaling (see [`crate::fp8block`], [`crate::mx`]) or I/O. Depends on
//! `minifloat` (crate-private) and [`crate::error`].
//!
//! # E4M3FN byte layout: `S EEEE MMM`, bias 7
//! * `E` in 1..=15 (except `E=15, M=7`): `(-1)^S * (1 + M/8) * 2^(E-7)`; max `0x7E` = 448.
//! * `E == 0`: subnormal `(-1)^S * M * 2^-9` (`0x01` = 2^-9, `0x80` = -0.0).
//! * `0x7F`, `0xFF`: NaN. There is no infinity.
//!
//! # E5M2 byte layout: `S EEEEE MM`, bias 15
//! * `E` in 1..=30: `(-1)^S * (1 + M/4) * 2^(E-15)`; max `0x7B` = 57344.
//! * `E == 0`: subnormal `(-1)^S * M * 2^-16`.
//! * `E == 31`: `M == 0` is ±inf (`0x7C`), otherwise NaN.

use crate::error::{check_len, Result};
use crate::minifloat::{pow2, round_code};

/// Largest finite E4M3FN magnitude (code `0x7E`).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 magnitude (code `0x7B`).
pub const E5M2_MAX: f32 = 57344.0;
/// The NaN code [`f32_to_e4m3`] produces.
pub const E4M3_NAN: u8 = 0x7F;

// ---------------------------------------------------------------- reference

/// E4M3FN reference decoder, straight from the definition (not table-based).
pub fn e4m3_to_f32_ref(code: u8) -> f32 {
    let s = code >> 7;
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 0x7) as i32;
    let mag = if e == 15 && m == 7 {
        f32::NAN
    } else if e == 0 {
        m as f32 * pow2(-9)
    } else {
        (1.0 + m as f32 / 8.0) * pow2(e - 7)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// E5M2 reference decoder, straight from the definition (not table-based).
pub fn e5m2_to_f32_ref(code: u8) -> f32 {
    let s = code >> 7;
    let e = ((code >> 2) & 0x1F) as i32;
    let m = (code & 0x3) as i32;
    let mag = if e == 31 {
        if m == 0 {
            f32::INFINITY
        } else {
            f32::NAN
        }
    } else if e == 0 {
        m as f32 * pow2(-16)
    } else {
        (1.0 + m as f32 / 4.0) * pow2(e - 15)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

// ---------------------------------------------------------------- tables

/// `f32` bits of a finite small-float code with `eb` exponent bits, `mb` mantissa
/// bits and bias `bias`, assembled directly (an implementation independent of the
/// `_ref` arithmetic). Does not handle inf/NaN; callers do.
pub(crate) const fn small_float_bits(code: u32, eb: u32, mb: u32, bias: i32) -> u32 {
    let sign = ((code >> (eb + mb)) & 1) << 31;
    let e = ((code >> mb) & ((1 << eb) - 1)) as i32;
    let m = code & ((1 << mb) - 1);
    if e == 0 {
        if m == 0 {
            return sign;
        }
        // value = m * 2^(1 - bias - mb); normalise m = 2^p * (1.f)
        let p = 31 - m.leading_zeros();
        let exp = p as i32 + 1 - bias - mb as i32 + 127;
        let frac = (m - (1 << p)) << (23 - p);
        sign | ((exp as u32) << 23) | frac
    } else {
        sign | (((e - bias + 127) as u32) << 23) | (m << (23 - mb))
    }
}

const fn build_e4m3_lut() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = if (c & 0x7F) == 0x7F {
            f32::from_bits(0x7FC0_0000 | (((c as u32) >> 7) << 31))
        } else {
            f32::from_bits(small_float_bits(c as u32, 4, 3, 7))
        };
        c += 1;
    }
    t
}

const fn build_e5m2_lut() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut c = 0;
    while c < 256 {
        let sign = ((c as u32) >> 7) << 31;
        t[c] = if (c & 0x7C) == 0x7C {
            if (c & 3) == 0 {
                f32::from_bits(sign | 0x7F80_0000)
            } else {
                f32::from_bits(sign | 0x7FC0_0000)
            }
        } else {
            f32::from_bits(small_float_bits(c as u32, 5, 2, 15))
        };
        c += 1;
    }
    t
}

/// Every E4M3FN code decoded (index = code). Built at compile time.
pub static E4M3_LUT: [f32; 256] = build_e4m3_lut();
/// Every E5M2 code decoded (index = code). Built at compile time.
pub static E5M2_LUT: [f32; 256] = build_e5m2_lut();

// ---------------------------------------------------------------- fast decode

/// Fast E4M3FN decode (table lookup). Bit-identical to [`e4m3_to_f32_ref`] (NaN as NaN).
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_LUT[code as usize]
}

/// Fast E5M2 decode (table lookup). Bit-identical to [`e5m2_to_f32_ref`] (NaN as NaN).
#[inline(always)]
pub fn e5m2_to_f32(code: u8) -> f32 {
    E5M2_LUT[code as usize]
}

/// Decode E4M3FN bytes into `dst` (`src.len() == dst.len()`).
pub fn decode_e4m3_slice(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("e4m3 bytes", dst.len(), src.len())?;
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = E4M3_LUT[c as usize];
    }
    Ok(())
}

/// Decode E5M2 bytes into `dst` (`src.len() == dst.len()`).
pub fn decode_e5m2_slice(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("e5m2 bytes", dst.len(), src.len())?;
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = E5M2_LUT[c as usize];
    }
    Ok(())
}

// ---------------------------------------------------------------- encoders

/// Encode `f32` to E4M3FN: round to nearest, ties to even code; `|x| > 448`
/// (including ±inf) saturates to ±448 (`0x7E`/`0xFE`), which is what DeepSeek's
/// clamp-to-±448-before-cast produces; NaN gives `0x7F`. The sign of zero is kept
/// (`-0.0` and negative values that round to zero give `0x80`).
///
/// Note: `ml_dtypes` (no clamp) turns `|x| >= 464` into NaN instead; MLX saturates.
#[inline]
pub fn f32_to_e4m3(x: f32) -> u8 {
    let b = x.to_bits();
    let sign = ((b >> 24) & 0x80) as u8;
    let a = b & 0x7FFF_FFFF;
    if a > 0x7F80_0000 {
        return E4M3_NAN;
    }
    let code = round_code(a, 3, -6);
    sign | (if code > 0x7E { 0x7E } else { code as u8 })
}

/// Encode `f32` to E5M2 with IEEE semantics: round to nearest, ties to even;
/// results past the largest finite value (`>= 61440` in magnitude) become ±inf
/// (`0x7C`/`0xFC`); NaN gives `0x7E` (or `0xFE` for a negative NaN).
#[inline]
pub fn f32_to_e5m2(x: f32) -> u8 {
    let b = x.to_bits();
    let sign = ((b >> 24) & 0x80) as u8;
    let a = b & 0x7FFF_FFFF;
    if a > 0x7F80_0000 {
        return sign | 0x7E;
    }
    if a == 0x7F80_0000 {
        return sign | 0x7C;
    }
    let code = round_code(a, 2, -14);
    sign | (if code > 0x7C { 0x7C } else { code as u8 })
}

/// Encode a slice to E4M3FN with [`f32_to_e4m3`] (`src.len() == dst.len()`).
pub fn encode_e4m3_slice(src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_len("e4m3 bytes", src.len(), dst.len())?;
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = f32_to_e4m3(x);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_nearest, same};
    use proptest::prelude::*;

    #[test]
    fn every_code_fast_vs_ref() {
        for c in 0..=255u8 {
            assert!(same(e4m3_to_f32(c), e4m3_to_f32_ref(c)), "e4m3 {c:#04x}");
            assert!(same(e5m2_to_f32(c), e5m2_to_f32_ref(c)), "e5m2 {c:#04x}");
        }
        let codes: Vec<u8> = (0..=255).collect();
        let mut out = vec![0.0; 256];
        decode_e4m3_slice(&codes, &mut out).unwrap();
        assert!((0..256).all(|c| same(out[c], e4m3_to_f32_ref(c as u8))));
        decode_e5m2_slice(&codes, &mut out).unwrap();
        assert!((0..256).all(|c| same(out[c], e5m2_to_f32_ref(c as u8))));
    }

    #[test]
    fn known_values() {
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x08), pow2(-6));
        assert_eq!(e4m3_to_f32(0x01), pow2(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * pow2(-9));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(e4m3_to_f32(0x00).to_bits(), 0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!((0..=255u8).filter(|&c| e4m3_to_f32(c).is_nan()).count(), 2);
        assert!((0..=255u8).all(|c| !e4m3_to_f32(c).is_infinite()));

        assert_eq!(e5m2_to_f32(0x7C), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0xFC), f32::NEG_INFINITY);
        assert_eq!(e5m2_to_f32(0x7B), 57344.0);
        assert_eq!(e5m2_to_f32(0x3C), 1.0);
        assert_eq!(e5m2_to_f32(0x01), pow2(-16));
        assert_eq!(e5m2_to_f32(0x04), pow2(-14));
        assert!(e5m2_to_f32(0x7D).is_nan() && e5m2_to_f32(0x7E).is_nan());
        assert!(e5m2_to_f32(0x7F).is_nan() && e5m2_to_f32(0xFF).is_nan());
        assert_eq!((0..=255u8).filter(|&c| e5m2_to_f32(c).is_nan()).count(), 6);
    }

    #[test]
    fn roundtrip_every_code() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3(v), E4M3_NAN);
            } else {
                assert_eq!(f32_to_e4m3(v), c, "e4m3 {c:#04x}");
            }
            let v = e5m2_to_f32(c);
            if v.is_nan() {
                assert!(e5m2_to_f32(f32_to_e5m2(v)).is_nan());
            } else {
                assert_eq!(f32_to_e5m2(v), c, "e5m2 {c:#04x}");
            }
        }
    }

    #[test]
    fn saturation_and_specials() {
        for x in [
            448.0f32,
            449.0,
            463.9,
            464.0,
            465.0,
            1e30,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(f32_to_e4m3(x), 0x7E, "{x}");
            assert_eq!(f32_to_e4m3(-x), 0xFE, "-{x}");
        }
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0x7F);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(-1e-30), 0x80);
        assert_eq!(f32_to_e4m3(pow2(-10)), 0x00); // tie between 0 and 2^-9 -> even (0)
        assert_eq!(f32_to_e4m3(pow2(-10) * 3.0), 0x02); // tie 1 vs 2 (x 2^-9) -> 2
        assert_eq!(f32_to_e4m3(f32::from_bits(1)), 0x00);

        assert_eq!(f32_to_e5m2(57344.0), 0x7B);
        assert_eq!(f32_to_e5m2(61439.996), 0x7B);
        assert_eq!(f32_to_e5m2(61440.0), 0x7C);
        assert_eq!(f32_to_e5m2(-1e9), 0xFC);
        assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7C);
        assert!(e5m2_to_f32(f32_to_e5m2(f32::NAN)).is_nan());
        assert_eq!(f32_to_e5m2(-0.0), 0x80);
    }

    fn finite_table(lut: &[f32; 256]) -> Vec<(u8, f32)> {
        (0..=255u8)
            .map(|c| (c, lut[c as usize]))
            .filter(|(_, v)| v.is_finite())
            .collect()
    }

    #[test]
    fn encoders_round_to_nearest_even_sweep() {
        let t4 = finite_table(&E4M3_LUT);
        let t5 = finite_table(&E5M2_LUT);
        // a sweep of f32 bit patterns across the whole ranges (both signs)
        for bits in (0u32..0x4800_0000).step_by(16411) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                if x.abs() <= E4M3_MAX {
                    assert_nearest(x, f32_to_e4m3(x), &t4);
                }
                if x.abs() <= E5M2_MAX {
                    assert_nearest(x, f32_to_e5m2(x), &t5);
                }
            }
        }
        // every midpoint between neighbouring codes, and one ulp either side
        type Enc = fn(f32) -> u8;
        for (t, enc) in [(&t4, f32_to_e4m3 as Enc), (&t5, f32_to_e5m2 as Enc)] {
            let mut vals: Vec<f32> = t.iter().map(|&(_, v)| v).filter(|v| *v >= 0.0).collect();
            vals.sort_by(f32::total_cmp);
            vals.dedup();
            for w in vals.windows(2) {
                let mid = (w[0] + w[1]) / 2.0; // exact: a few bits only
                for x in [
                    mid,
                    f32::from_bits(mid.to_bits() - 1),
                    f32::from_bits(mid.to_bits() + 1),
                ] {
                    for y in [x, -x] {
                        assert_nearest(y, enc(y), t);
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn e4m3_nearest(x in -E4M3_MAX..=E4M3_MAX) {
            assert_nearest(x, f32_to_e4m3(x), &finite_table(&E4M3_LUT));
        }

        #[test]
        fn e5m2_nearest(x in -E5M2_MAX..=E5M2_MAX) {
            assert_nearest(x, f32_to_e5m2(x), &finite_table(&E5M2_LUT));
        }

        #[test]
        fn e4m3_small_nearest(x in -0.02f32..0.02) {
            assert_nearest(x, f32_to_e4m3(x), &finite_table(&E4M3_LUT));
        }
    }
}
