//! E8M0 (OCP "UE8M0"): the unsigned power-of-two scale byte of MX and DeepSeek block formats.
//!
//! What it is: decoders (`_ref` from the definition, fast compile-time table),
//! the exact power-of-two → byte conversion, and the shared-exponent rule used
//! by DeepSeek V4 kernels and MLX >= 0.32.4. What it is not: a general float
//! format (there is no sign, no mantissa, no zero) or I/O. Depends on
//! `minifloat` (crate-private) and [`crate::error`].
//!
//! # Byte layout
//! `EEEEEEEE`, byte `b` in `0..=254` means `2^(b - 127)`; `0x7F` = 1.0;
//! `0x00` = 2^-127, which is a *subnormal* `f32` (bits `0x0040_0000`) and is decoded
//! exactly; `0xFF` is NaN. Note that MLX's CPU dequantizer builds the scale as a
//! bf16 `b << 7`, which agrees for 0..=254 (including 2^-127 as bf16 `0x0040`) but
//! yields +inf, not NaN, for `0xFF`; keep refuses `0xFF` where it matters
//! ([`check_e8m0_scales`]).

use crate::error::{FormatError, Result};
use crate::minifloat::pow2;

/// The byte for 1.0.
pub const E8M0_ONE: u8 = 0x7F;
/// The NaN byte.
pub const E8M0_NAN: u8 = 0xFF;
/// The largest finite scale byte (2^127).
pub const E8M0_MAX: u8 = 0xFE;
/// DeepSeek's floor on a block's absolute maximum before choosing its scale
/// (`amax.clamp(min=1e-4)` in its quantisation kernels), so all-zero blocks get a
/// finite, small scale instead of a degenerate one.
pub const DEEPSEEK_AMAX_FLOOR: f32 = 1e-4;

/// Reference decoder from the definition: `2^(b-127)`, `0xFF` → NaN.
pub fn e8m0_to_f32_ref(b: u8) -> f32 {
    if b == 0xFF {
        return f32::NAN;
    }
    // explicit halving/doubling from 1.0: exact for every exponent in range,
    // including the single subnormal 2^-127
    let mut v = 1.0f32;
    let k = b as i32 - 127;
    if k >= 0 {
        for _ in 0..k {
            v *= 2.0;
        }
    } else {
        for _ in 0..(-k) {
            v *= 0.5;
        }
    }
    v
}

const fn build_e8m0_lut() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut b = 0;
    while b < 255 {
        t[b] = pow2(b as i32 - 127);
        b += 1;
    }
    t[255] = f32::NAN;
    t
}

/// Every E8M0 byte decoded (index = byte). Built at compile time.
pub static E8M0_LUT: [f32; 256] = build_e8m0_lut();

/// Fast E8M0 decode (table lookup). Bit-identical to [`e8m0_to_f32_ref`] (NaN as NaN).
#[inline(always)]
pub fn e8m0_to_f32(b: u8) -> f32 {
    E8M0_LUT[b as usize]
}

/// `Some(b)` iff `x` is exactly `2^(b-127)` for some `b` in `0..=254`
/// (so `2^-127`, a subnormal, is accepted; smaller powers are not representable).
/// `None` for NaN, ±inf, zero, negative values and non-powers of two.
pub fn e8m0_from_pow2_f32(x: f32) -> Option<u8> {
    let bits = x.to_bits();
    if bits == 0x0040_0000 {
        return Some(0);
    }
    let exp = bits >> 23; // includes the sign bit: negative values land >= 256
    let frac = bits & 0x7F_FFFF;
    if frac == 0 && (1..=254).contains(&exp) {
        Some(exp as u8)
    } else {
        None
    }
}

/// `(significand, exponent)` with `x = sig * 2^(exp - 23)` and `sig` in `[2^23, 2^24)`,
/// for a positive finite `x` (subnormals normalised).
fn normalise(x: f32) -> (u32, i32) {
    let bits = x.to_bits();
    let e = (bits >> 23) as i32;
    let f = bits & 0x7F_FFFF;
    if e == 0 {
        // subnormal: f * 2^-149 = (f << s) * 2^(-149 - s)
        let s = f.leading_zeros() - 8;
        (f << s, -126 - s as i32)
    } else {
        (f | 0x80_0000, e - 127)
    }
}

/// The shared-exponent byte of the DeepSeek V4 / MLX >= 0.32.4 rule: the smallest
/// `b` in `0..=254` with `2^(b-127) * max_elem >= amax` (exact real arithmetic),
/// i.e. `ceil(log2(amax / max_elem)) + 127` clamped to `0..=254`. With this scale no
/// element needs saturating (`|x| / scale <= max_elem`) unless the clamp at 254 bites.
///
/// Computed exactly from the bit fields (no `log2`, no rounded division): writing
/// `amax = a * 2^ea`, `max_elem = m * 2^em` with `a, m` in `[1, 2)`, the answer is
/// `ea - em + (a > m) + 127`.
///
/// Edge cases (total; never panics):
/// * `amax <= 0` (incl. `-0.0`): `0` (every scale satisfies the inequality; callers
///   that want DeepSeek's behaviour floor `amax` at [`DEEPSEEK_AMAX_FLOOR`] first).
/// * `amax` NaN or +inf, or `max_elem` NaN/`<= 0` with `amax > 0`: `254` (no scale
///   suffices; the largest is returned).
/// * `max_elem` = +inf: `0`.
pub fn ceil_exponent(amax: f32, max_elem: f32) -> u8 {
    if amax.is_nan() || max_elem.is_nan() {
        return E8M0_MAX;
    }
    if amax <= 0.0 {
        return 0;
    }
    if max_elem <= 0.0 || amax == f32::INFINITY {
        return E8M0_MAX;
    }
    if max_elem == f32::INFINITY {
        return 0;
    }
    let (a, ea) = normalise(amax);
    let (m, em) = normalise(max_elem);
    let k = ea - em + i32::from(a > m) + 127;
    k.clamp(0, 254) as u8
}

/// Variant that rounds first: `ceil(log2(q))` of the `f32` quotient `q = amax / max_elem`
/// (ceil taken exactly on `q`'s bits), as kernels that compute `amax / 448` in float
/// and then take a bit-level ceil-log2 do.
///
/// It equals [`ceil_exponent`] whenever `q` is a normal `f32` (>= 2^-126): with
/// integer significands `A > M`, `A / M >= 1 + 1/M > 1 + 2^-24`, so a correctly
/// rounded quotient can never fall back onto the power of two below. The two can
/// differ only where the quotient is subnormal, i.e. at the very bottom of the
/// scale range (byte 0 vs 1, `amax` around `max_elem * 2^-127`). Tested.
pub fn ceil_exponent_of_quotient(amax: f32, max_elem: f32) -> u8 {
    let q = amax / max_elem;
    if q.is_nan() || q == f32::INFINITY {
        return E8M0_MAX;
    }
    if q <= 0.0 {
        return 0;
    }
    ceil_exponent(q, 1.0)
}

/// `Err(NanScale)` at the first `0xFF` byte: the check the lossless FP8-block → MXFP8
/// repack needs ("a NaN scale byte is refused, never rounded").
pub fn check_e8m0_scales(scales: &[u8]) -> Result<()> {
    match scales.iter().position(|&b| b == E8M0_NAN) {
        Some(index) => Err(FormatError::NanScale { index }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;
    use proptest::prelude::*;

    #[test]
    fn every_code_fast_vs_ref() {
        for b in 0..=255u8 {
            assert!(same(e8m0_to_f32(b), e8m0_to_f32_ref(b)), "{b:#04x}");
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(e8m0_to_f32(0x7F), 1.0);
        assert_eq!(e8m0_to_f32(0x80), 2.0);
        assert_eq!(e8m0_to_f32(0x7E), 0.5);
        assert_eq!(e8m0_to_f32(0xFE), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(0x01).to_bits(), 0x0080_0000); // 2^-126, smallest normal
        assert_eq!(e8m0_to_f32(0x00).to_bits(), 0x0040_0000); // 2^-127, subnormal
        assert_eq!(e8m0_to_f32(0x00) * 2.0, f32::MIN_POSITIVE);
        assert!(e8m0_to_f32(0xFF).is_nan());
    }

    #[test]
    fn from_pow2_inverts_decode() {
        for b in 0..=254u8 {
            assert_eq!(e8m0_from_pow2_f32(e8m0_to_f32(b)), Some(b));
            assert_eq!(e8m0_from_pow2_f32(-e8m0_to_f32(b)), None);
        }
        for x in [
            0.0f32,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            3.0,
            1.5,
            0.75,
            2f32.powi(-128),
            f32::from_bits(1),
            f32::from_bits(0x0040_0001),
            f32::from_bits(0x3F80_0001),
        ] {
            assert_eq!(e8m0_from_pow2_f32(x), None, "{x:e}");
        }
    }

    /// Brute force: smallest b with 2^(b-127)*max_elem >= amax, exactly in f64.
    fn brute(amax: f32, max_elem: f32) -> u8 {
        for b in 0..=254u8 {
            let s = e8m0_to_f32_ref(b) as f64;
            if s * max_elem as f64 >= amax as f64 {
                return b;
            }
        }
        254
    }

    #[test]
    fn ceil_exponent_matches_brute_force() {
        let maxes = [448.0f32, 6.0, 57344.0, 1.0, 3.0, 0.5, 127.0];
        let mut amaxes: Vec<f32> = Vec::new();
        for b in 0..=254u8 {
            let p = e8m0_to_f32(b);
            for m in maxes {
                let x = p * m; // exact products and neighbours
                if x.is_finite() && x > 0.0 {
                    amaxes.push(x);
                    amaxes.push(f32::from_bits(x.to_bits() + 1));
                    amaxes.push(f32::from_bits(x.to_bits() - 1));
                }
            }
            amaxes.push(p);
        }
        amaxes.extend([
            f32::from_bits(1),
            f32::from_bits(2),
            f32::from_bits(0x0040_0000),
            f32::from_bits(0x007F_FFFF),
            f32::MIN_POSITIVE,
            f32::MAX,
            DEEPSEEK_AMAX_FLOOR,
            1e-30,
        ]);
        for bits in (1u32..0x7F80_0000).step_by(99_991) {
            amaxes.push(f32::from_bits(bits));
        }
        for &a in &amaxes {
            for m in maxes {
                assert_eq!(ceil_exponent(a, m), brute(a, m), "amax={a:e} max={m}");
            }
            // subnormal max_elem too
            let m = f32::from_bits(0x0000_1234);
            assert_eq!(ceil_exponent(a, m), brute(a, m), "amax={a:e} max=subnormal");
        }
    }

    #[test]
    fn ceil_exponent_edges() {
        assert_eq!(ceil_exponent(0.0, 448.0), 0);
        assert_eq!(ceil_exponent(-0.0, 448.0), 0);
        assert_eq!(ceil_exponent(-5.0, 448.0), 0);
        assert_eq!(ceil_exponent(f32::NAN, 448.0), 254);
        assert_eq!(ceil_exponent(f32::INFINITY, 448.0), 254);
        assert_eq!(ceil_exponent(1.0, f32::NAN), 254);
        assert_eq!(ceil_exponent(1.0, 0.0), 254);
        assert_eq!(ceil_exponent(1.0, f32::INFINITY), 0);
        assert_eq!(ceil_exponent(448.0, 448.0), 127);
        assert_eq!(ceil_exponent(448.00003, 448.0), 128);
        assert_eq!(ceil_exponent(224.0, 448.0), 126);
        assert_eq!(ceil_exponent(6.0, 6.0), 127);
        assert_eq!(ceil_exponent(6.5, 6.0), 128);
        assert_eq!(ceil_exponent(f32::MAX, 1e-30), 254);
        // DeepSeek's floor: amax 1e-4 / 448 -> 2^-22 > 2.23e-7 >= 2^-23
        assert_eq!(ceil_exponent(DEEPSEEK_AMAX_FLOOR, 448.0), 127 - 22);
    }

    #[test]
    fn quotient_variant_agrees_except_subnormal_quotients() {
        for bits in (1u32..0x7F80_0000).step_by(7_919) {
            let a = f32::from_bits(bits);
            for m in [448.0f32, 6.0, 1.0, 57344.0, 3.0] {
                if a / m >= f32::MIN_POSITIVE {
                    assert_eq!(
                        ceil_exponent_of_quotient(a, m),
                        ceil_exponent(a, m),
                        "{a:e}/{m}"
                    );
                }
            }
        }
        // the one kind of difference: a subnormal quotient rounding onto 2^-127
        let a = f32::from_bits((448.0 * e8m0_to_f32(0)).to_bits() + 1);
        assert_eq!(ceil_exponent(a, 448.0), 1);
        assert_eq!(ceil_exponent_of_quotient(a, 448.0), 0);
        assert_eq!(ceil_exponent_of_quotient(0.0, 448.0), 0);
        assert_eq!(ceil_exponent_of_quotient(f32::MAX, 1e-30), 254);
    }

    #[test]
    fn nan_scale_check() {
        assert!(check_e8m0_scales(&[0, 1, 254]).is_ok());
        assert_eq!(
            check_e8m0_scales(&[0, 255]),
            Err(FormatError::NanScale { index: 1 })
        );
    }

    proptest! {
        #[test]
        fn ceil_exponent_prop(bits in 1u32..0x7F80_0000, mi in 0usize..4) {
            let a = f32::from_bits(bits);
            let m = [448.0f32, 6.0, 1.0, 57344.0][mi];
            prop_assert_eq!(ceil_exponent(a, m), brute(a, m));
        }
    }
}
