//! Shared bit-level helpers for the small float formats (crate-private).
//!
//! What it is: exact powers of two as `f32` built from bit fields, and one
//! round-to-nearest-even routine that maps an `f32` onto the code ordering of
//! any small binary float format (E4M3, E5M2, E2M1). What it is not: a public
//! API or a table; the per-format modules add saturation, NaN and sign policy.
//! Depends on nothing but `core`.

/// `2^k` as an exact `f32`, built from bit fields.
///
/// `k` in `-126..=127` gives a normal number, `-149..=-127` a subnormal one
/// (exact: a single mantissa bit). Below `-149` returns `0.0`, above `127`
/// returns `+inf` (the correctly rounded results).
#[inline]
pub(crate) const fn pow2(k: i32) -> f32 {
    if k > 127 {
        f32::INFINITY
    } else if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else if k >= -149 {
        f32::from_bits(1u32 << (k + 149))
    } else {
        0.0
    }
}

/// Round `|x|` (finite, not NaN) to nearest-even on the grid of a binary
/// float format with `m` mantissa bits and minimum normal exponent `emin`
/// (`emin = 1 - bias`), returning the *unsigned code* with an unbounded
/// exponent range: `code = ((e - emin) << m) + n`, where `e = max(floor(log2 |x|), emin)`
/// and `n = rne(|x| / 2^(e - m))`.
///
/// That one formula covers subnormals (`e == emin`, `n < 2^m`), normals
/// (`n` in `2^m..2^(m+1)` carries the implicit bit into the exponent field),
/// and the carry when rounding up to the next binade (`n == 2^(m+1)`). Ties
/// go to the even `n`, i.e. to the even code. The caller clamps codes past
/// the format's largest finite code (saturation or infinity).
///
/// The result is returned as `u64` so that huge inputs cannot overflow; any
/// code past the format's range only needs comparing against its maximum.
#[inline]
pub(crate) const fn round_code(x_abs_bits: u32, m: u32, emin: i32) -> u64 {
    let exp_field = ((x_abs_bits >> 23) & 0xFF) as i32;
    let frac = x_abs_bits & 0x7F_FFFF;
    // value = sig * 2^(e_unb - 23)
    let (sig, e_unb) = if exp_field == 0 {
        (frac as u64, -126)
    } else {
        ((frac | 0x80_0000) as u64, exp_field - 127)
    };
    if sig == 0 {
        return 0;
    }
    let e_t = if e_unb > emin { e_unb } else { emin };
    // quantum 2^(e_t - m); shift = log2(quantum / lsb) = (e_t - m) - (e_unb - 23)
    let shift = (e_t - m as i32) - (e_unb - 23);
    // shift >= 23 - m > 0 because e_t >= e_unb and m <= 22.
    let n = if shift >= 40 {
        // sig < 2^24, so sig / 2^shift < 2^-16: rounds to 0.
        0
    } else {
        let s = shift as u32;
        let q = sig >> s;
        let rem = sig & ((1u64 << s) - 1);
        let half = 1u64 << (s - 1);
        if rem > half || (rem == half && (q & 1) == 1) {
            q + 1
        } else {
            q
        }
    };
    (((e_t - emin) as u64) << m) + n
}
