//! IEEE binary16 (f16): conversion to and from `f32`, and a little-endian slice decoder.
//!
//! What it is: the half-precision format `S EEEEE MMMMMMMMMM` (bias 15; `E == 0`:
//! subnormal `(-1)^S M 2^-24`; `E == 31`: inf/NaN) via the `half` crate, with a
//! reference decoder written from the definition to check it on all 65,536 codes.
//! What it is not: arithmetic in f16, or I/O. Depends on `half` and [`crate::error`].

use crate::error::{check_len, Result};
use crate::minifloat::pow2;

/// Decode one f16 code to `f32` (exact; via `half`).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// Reference decoder from the definition: normal `(-1)^S (1024 + M) 2^(E-25)`,
/// subnormal `(-1)^S M 2^-24`, `E == 31`: `M == 0` inf else NaN.
pub fn f16_to_f32_ref(bits: u16) -> f32 {
    let s = (bits >> 15) & 1;
    let e = ((bits >> 10) & 0x1F) as i32;
    let m = (bits & 0x3FF) as i32;
    let mag = if e == 31 {
        if m == 0 {
            f32::INFINITY
        } else {
            f32::NAN
        }
    } else if e == 0 {
        m as f32 * pow2(-24)
    } else {
        (1024 + m) as f32 * pow2(e - 25)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// Encode `f32` to f16 with round-to-nearest-even (IEEE overflow to ±inf; NaN stays NaN). Via `half`.
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// Decode little-endian f16 bytes into `dst` (`src.len() == 2 * dst.len()`).
pub fn decode_f16_slice(src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_len("f16 bytes", dst.len().saturating_mul(2), src.len())?;
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
    Ok(())
}

/// Decode f16 codes (already as `u16`) into `dst` (`src.len() == dst.len()`).
pub fn decode_f16_u16_slice(src: &[u16], dst: &mut [f32]) -> Result<()> {
    check_len("f16 codes", dst.len(), src.len())?;
    for (d, &c) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(c);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;

    #[test]
    fn every_code_fast_vs_ref_and_roundtrip() {
        for c in 0..=u16::MAX {
            let fast = f16_to_f32(c);
            assert!(same(fast, f16_to_f32_ref(c)), "code {c:#06x}");
            if fast.is_nan() {
                assert!(f16_to_f32(f32_to_f16(fast)).is_nan());
            } else {
                assert_eq!(f32_to_f16(fast), c, "roundtrip {c:#06x}");
            }
        }
        assert_eq!(f16_to_f32(0x3C00), 1.0);
        assert_eq!(f16_to_f32(0x7BFF), 65504.0);
        assert_eq!(f16_to_f32(0x0001), pow2(-24));
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
    }

    #[test]
    fn slice_decoder_and_errors() {
        let codes: Vec<u16> = (0..=u16::MAX).step_by(5).collect();
        let bytes: Vec<u8> = codes.iter().flat_map(|c| c.to_le_bytes()).collect();
        let mut out = vec![0.0; codes.len()];
        decode_f16_slice(&bytes, &mut out).unwrap();
        for (c, o) in codes.iter().zip(&out) {
            assert!(same(*o, f16_to_f32_ref(*c)));
        }
        let mut out2 = vec![0.0; codes.len()];
        decode_f16_u16_slice(&codes, &mut out2).unwrap();
        assert!(out.iter().zip(&out2).all(|(a, b)| same(*a, *b)));
        assert!(decode_f16_slice(&bytes, &mut out[1..]).is_err());
    }
}
