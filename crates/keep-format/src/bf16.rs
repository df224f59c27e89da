//! bfloat16: conversion to and from `f32`, and a little-endian slice decoder.
//!
//! What it is: the bf16 format (the top 16 bits of an IEEE binary32:
//! `S EEEEEEEE MMMMMMM`, bias 127) with a reference decoder, round-to-nearest-even
//! encoder and a byte-slice decoder. What it is not: arithmetic in bf16, or I/O.
//! Depends on [`crate::error`]; `half` is used only in tests as a cross-check.
//!
//! Decode: `f32::from_bits((b as u32) << 16)` is exact for every code (NaNs stay
//! NaN with the same payload bits, ±0 and ±inf map to themselves).

use crate::error::{check_len, Result};

/// Decode one bf16 code to `f32` (exact; every code, NaN payloads preserved).
#[inline]
pub const fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Reference decoder written from the definition `(-1)^S * 2^(E-127) * (1 + M/128)`
/// (`E == 0`: `(-1)^S * 2^-126 * M/128`; `E == 255`: inf/NaN). Used to test
/// [`bf16_to_f32`].
pub fn bf16_to_f32_ref(bits: u16) -> f32 {
    let s = (bits >> 15) & 1;
    let e = ((bits >> 7) & 0xFF) as i32;
    let m = (bits & 0x7F) as i32;
    let mag = if e == 0xFF {
        if m == 0 {
            f32::INFINITY
        } else {
            // keep the payload: NaN with the same mantissa bits
            return f32::from_bits((bits as u32) << 16);
        }
    } else if e == 0 {
        m as f32 * crate::minifloat::pow2(-126 - 7)
    } else {
        (128 + m) as f32 * crate::minifloat::pow2(e - 127 - 7)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// Encode `f32` to bf16 with round-to-nearest, ties to even. NaN stays NaN
/// (sign and top payload bits kept, quiet bit forced on, so a NaN whose payload
/// lives only in the low 16 bits cannot become infinity). Overflow rounds to ±inf
/// as IEEE requires.
#[inline]
pub const fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if (b & 0x7FFF_FFFF) > 0x7F80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    let lsb = (b >> 16) & 1;
    // adding 0x7FFF + lsb rounds half to even; cannot overflow past inf's bits
    ((b + 0x7FFF + lsb) >> 16) as u16
}

/// Decode little-endian bf16 bytes into `dst` (`src.len() == 2 * dst.len()`).
pub fn decode_bf16_slice(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("bf16 bytes", dst.len().saturating_mul(2), src.len())?;
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
    }
    Ok(())
}

/// Decode bf16 codes (already as `u16`) into `dst` (`src.len() == dst.len()`).
pub fn decode_bf16_u16_slice(src: &[u16], dst: &mut [f32]) -> Result<()> {
    check_len("bf16 codes", dst.len(), src.len())?;
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(c);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;

    #[test]
    fn every_code_fast_vs_ref_vs_half() {
        for c in 0..=u16::MAX {
            let fast = bf16_to_f32(c);
            assert!(same(fast, bf16_to_f32_ref(c)), "code {c:#06x}");
            assert!(
                same(fast, half::bf16::from_bits(c).to_f32()),
                "half {c:#06x}"
            );
            // every non-NaN code round-trips exactly
            if !fast.is_nan() {
                assert_eq!(f32_to_bf16(fast), c, "roundtrip {c:#06x}");
            } else {
                assert!(bf16_to_f32(f32_to_bf16(fast)).is_nan());
            }
        }
    }

    #[test]
    fn encoder_matches_half_on_neighbourhoods() {
        // every bf16 code, and f32 values just around each half-way point
        for c in 0..=u16::MAX {
            let base = (c as u32) << 16;
            for off in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                let x = f32::from_bits(base | off);
                let ours = f32_to_bf16(x);
                let theirs = half::bf16::from_f32(x).to_bits();
                if x.is_nan() {
                    assert!(bf16_to_f32(ours).is_nan());
                } else {
                    assert_eq!(ours, theirs, "x bits {:#010x}", x.to_bits());
                }
            }
        }
    }

    #[test]
    fn slice_decoder() {
        let codes: Vec<u16> = (0..=u16::MAX).step_by(7).collect();
        let bytes: Vec<u8> = codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        let mut out = vec![0.0; codes.len()];
        decode_bf16_slice(&bytes, &mut out).unwrap();
        for (c, o) in codes.iter().zip(&out) {
            assert!(same(*o, bf16_to_f32_ref(*c)));
        }
        let mut out2 = vec![0.0; codes.len()];
        decode_bf16_u16_slice(&codes, &mut out2).unwrap();
        assert!(out.iter().zip(&out2).all(|(a, b)| same(*a, *b)));
        assert!(matches!(
            decode_bf16_slice(&bytes[1..], &mut out),
            Err(crate::FormatError::LengthMismatch { .. })
        ));
    }
}
