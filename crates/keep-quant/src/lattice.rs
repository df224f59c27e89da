//! Nearest-codeword searches for the E8P12 codebook (2 bits per weight) and the E81B residual
//! codebook (1 bit per weight), under a plain or a per-coordinate weighted squared error.
//!
//! What it is:
//! * [`nearest_e8`]: Conway & Sloane's E8 decoder (IEEE Trans. Inf. Theory 28(2), 1982): D8 by
//!   rounding every coordinate and, when the sum is odd, re-rounding the coordinate with the
//!   largest rounding error the other way; `E8 = D8 ∪ (D8 + ½)`, so decode `x` and `x − ½` and
//!   keep the closer.
//! * [`nearest_e8p`] (plain error): every E8P codeword `c` has `c − ¼ ∈ E8`, so the E8 point
//!   nearest `x − ¼` plus ¼ is the nearest codeword whenever it is one; its code comes from
//!   the pattern table ([`e8p_code_of`]). Points whose pattern is outside the 256-entry grid
//!   fall back to the pattern scan.
//! * [`nearest_e8p_weighted`]: the exact nearest codeword under `Σ w_i (x_i − c_i)²` by a scan
//!   of the 256 patterns for each of the two shifts: with `z = x ∓ ¼`, each coordinate takes the
//!   sign of `z_i`; when the sign byte's parity comes out wrong the coordinate whose flip costs
//!   least (`4 w_i m_i |z_i|`) is flipped. Weighted error has no lattice structure to decode
//!   with, but the pattern scan is exact for any non-negative weights.
//! * [`nearest_e81_weighted`]: the exact nearest E81B codeword under the weighted error in
//!   O(8): the origin, the best `±e_i ± e_j` (the two best coordinates), the best `(±½)^8` with
//!   the parity fix, and the best `±2e_i` (no `−2e_7`).
//!
//! Each is tested against the exhaustive references in keep-format (`nearest_e8p`,
//! [`nearest_e8p_brute_weighted`], `nearest_e81_brute`) on random and adversarial vectors.
//! What it is not: scales, rows, threading (see [`crate::fit`]). No I/O, never panics.

use std::sync::LazyLock;

use keep_format::e81::{decode_e81, E81_GRID};
use keep_format::e8p::{decode_e8p, E8P_GRID};

/// Squared distance in f64 (plain when `w` is `None`): what the tests and the fitting report.
pub fn dist(x: &[f32; 8], c: &[f32; 8], w: Option<&[f32; 8]>) -> f64 {
    let mut d = 0.0f64;
    for i in 0..8 {
        let e = x[i] as f64 - c[i] as f64;
        d += w.map_or(1.0, |w| w[i] as f64) * e * e;
    }
    d
}

/// The D8 point nearest `x` (ties of the rounding go away from zero).
fn nearest_d8(x: &[f64; 8]) -> [f64; 8] {
    let mut f = x.map(f64::round);
    let sum: f64 = f.iter().sum();
    if sum.rem_euclid(2.0) != 0.0 {
        // re-round the coordinate farthest from its rounding, the other way
        let mut k = 0;
        let mut worst = -1.0f64;
        for i in 0..8 {
            let e = (x[i] - f[i]).abs();
            if e > worst {
                worst = e;
                k = i;
            }
        }
        f[k] += if x[k] >= f[k] { 1.0 } else { -1.0 };
    }
    f
}

/// The E8 point nearest `x` (Conway & Sloane): the closer of the D8 point nearest `x` and
/// the D8 + ½ point nearest `x` (ties to D8).
pub fn nearest_e8(x: [f64; 8]) -> [f64; 8] {
    let a = nearest_d8(&x);
    let b = nearest_d8(&x.map(|v| v - 0.5)).map(|v| v + 0.5);
    let d = |p: &[f64; 8]| -> f64 { (0..8).map(|i| (x[i] - p[i]) * (x[i] - p[i])).sum() };
    if d(&b) < d(&a) {
        b
    } else {
        a
    }
}

/// Grid index of every absolute pattern, keyed by base-3 digits `(2|v_i| − 1) / 2`
/// (coordinate 0 most significant); `u16::MAX` where the pattern is not in the grid.
static PATTERN_INDEX: LazyLock<Vec<u16>> = LazyLock::new(|| {
    let mut t = vec![u16::MAX; 6561];
    for (g, a) in E8P_GRID.iter().enumerate() {
        let key = a.iter().fold(0usize, |k, &v| k * 3 + (v as usize - 1) / 2);
        t[key] = g as u16;
    }
    t
});

/// Per grid pattern: its digits (0, 1, 2 for ½, 3/2, 5/2) and whether its coordinate sum is
/// odd (then its base pattern has coordinate 7 negated).
static PATTERN_DIGITS: LazyLock<Vec<([u8; 8], bool)>> = LazyLock::new(|| {
    E8P_GRID
        .iter()
        .map(|a| {
            let odd = (a.iter().map(|&v| v as u32).sum::<u32>() / 2) % 2 == 1;
            (a.map(|v| (v - 1) / 2), odd)
        })
        .collect()
});

/// The code of the E8P codeword `y + ¼`, for an E8 point `y`, if it is a codeword.
pub fn e8p_code_of(y: [f64; 8]) -> Option<u16> {
    let h = y.map(|v| v * 2.0);
    if h.iter()
        .any(|v| !v.is_finite() || v.fract() != 0.0 || v.abs() > 16.0)
    {
        return None;
    }
    let h = h.map(|v| v as i32);
    let odd = h.iter().all(|v| v.rem_euclid(2) == 1);
    let even = h.iter().all(|v| v.rem_euclid(2) == 0);
    // p = 0: y ∈ D8 + ½ is the signed pattern v itself; p = 1: y ∈ D8 and v = y + ½.
    let (p, v) = if odd {
        (0u8, h)
    } else if even {
        (1u8, h.map(|v| v + 1))
    } else {
        return None;
    };
    let mut key = 0usize;
    let mut neg = 0u8;
    for (i, &c) in v.iter().enumerate() {
        let a = c.unsigned_abs();
        if !matches!(a, 1 | 3 | 5) {
            return None;
        }
        key = key * 3 + (a as usize - 1) / 2;
        neg |= ((c < 0) as u8) << i;
    }
    let g = PATTERN_INDEX[key];
    if g == u16::MAX {
        return None;
    }
    let t = neg ^ ((PATTERN_DIGITS[g as usize].1 as u8) << 7);
    if !t.count_ones().is_multiple_of(2) || v.iter().sum::<i32>().rem_euclid(4) != 0 {
        return None;
    }
    Some((g << 8) | (t ^ p) as u16)
}

/// The nearest E8P codeword to `x` under the plain squared error: E8 decoding of `x − ¼`,
/// then the pattern table; the pattern scan where the E8 point's pattern is not in the grid.
pub fn nearest_e8p(x: [f32; 8]) -> u16 {
    let y = nearest_e8(x.map(|v| v as f64 - 0.25));
    match e8p_code_of(y) {
        Some(c) => c,
        None => nearest_e8p_weighted(x, [1.0; 8]),
    }
}

const MAGS: [f32; 3] = [0.5, 1.5, 2.5];

/// The nearest E8P codeword to `x` under `Σ w_i (x_i − c_i)²` (weights ≥ 0), exact, by the
/// pattern scan described in the module docs. Non-finite input gives code 0.
pub fn nearest_e8p_weighted(x: [f32; 8], w: [f32; 8]) -> u16 {
    let pats = &*PATTERN_DIGITS;
    let mut best_d = f32::INFINITY;
    let mut best = 0u16;
    for p in 0..2u8 {
        let sigma = if p == 0 { 0.25f32 } else { -0.25 };
        let mut cost = [[0f32; 8]; 3];
        let mut pen = [[0f32; 8]; 3];
        let mut neg = 0u8;
        for i in 0..8 {
            let z = x[i] - sigma;
            let az = z.abs();
            neg |= ((z < 0.0) as u8) << i;
            for d in 0..3 {
                let e = az - MAGS[d];
                cost[d][i] = w[i] * e * e;
                pen[d][i] = 4.0 * w[i] * MAGS[d] * az;
            }
        }
        let negpar = (neg.count_ones() & 1) as u8;
        for (g, (dg, odd)) in pats.iter().enumerate() {
            let mut tot = 0f32;
            for i in 0..8 {
                tot += cost[dg[i] as usize][i];
            }
            if tot >= best_d {
                continue;
            }
            let mut flip = 0u8;
            if negpar ^ (*odd as u8) == 1 {
                let mut k = 0;
                let mut m = f32::INFINITY;
                for i in 0..8 {
                    let v = pen[dg[i] as usize][i];
                    if v < m {
                        m = v;
                        k = i;
                    }
                }
                tot += m;
                flip = 1 << k;
            }
            if tot < best_d {
                best_d = tot;
                let t = neg ^ ((*odd as u8) << 7) ^ flip;
                best = ((g as u16) << 8) | (t ^ p) as u16;
            }
        }
    }
    best
}

/// The nearest E8P codeword under the weighted error by exhaustive search over all 65,536
/// codes (f64; ties to the smallest code): the reference for [`nearest_e8p_weighted`].
pub fn nearest_e8p_brute_weighted(x: [f32; 8], w: [f32; 8]) -> u16 {
    let mut best = 0u16;
    let mut best_d = f64::INFINITY;
    for code in 0..=u16::MAX {
        let d = dist(&x, &decode_e8p(code), Some(&w));
        if d < best_d {
            best_d = d;
            best = code;
        }
    }
    best
}

/// E81B code of `±e_i ± e_j` (`i < j`), indexed `[i][j][neg_i][neg_j]`.
static E81_PAIRS: LazyLock<[[[[u8; 2]; 2]; 8]; 8]> = LazyLock::new(|| {
    let mut t = [[[[0u8; 2]; 2]; 8]; 8];
    for (c, v) in E81_GRID.iter().enumerate().take(113) {
        let nz: Vec<usize> = (0..8).filter(|&i| v[i] != 0).collect();
        if let [i, j] = nz[..] {
            t[i][j][(v[i] < 0) as usize][(v[j] < 0) as usize] = c as u8;
        }
    }
    t
});

/// First code of the half-integer roots; the root with sign bits `b` (bit `7 − i` set when
/// coordinate `i` is +½) has code `E81_HALF + b / 2`.
const E81_HALF: usize = 113;
/// Codes of `+2e_i` (`E81_PLUS2 + i`) and `−2e_i` (`E81_MINUS2 + i`, `i < 7`).
const E81_PLUS2: usize = 241;
const E81_MINUS2: usize = 249;

/// The nearest E81B codeword to `x` under `Σ w_i (x_i − c_i)²` (weights ≥ 0), exact, in
/// O(8): the best of each family (see the module docs), compared by their gain over the
/// origin. Non-finite input gives the origin's code or another finite code, never a panic.
pub fn nearest_e81_weighted(x: [f32; 8], w: [f32; 8]) -> u8 {
    let origin = keep_format::e81::E81_ORIGIN;
    let (mut best_gain, mut best) = (0f32, origin);
    // ±e_i ± e_j: gain 2 w_i |x_i| − w_i per coordinate, signs of x
    let g1: [f32; 8] = std::array::from_fn(|i| 2.0 * w[i] * x[i].abs() - w[i]);
    let (mut i1, mut i2) = (usize::MAX, usize::MAX);
    for i in 0..8 {
        if i1 == usize::MAX || g1[i] > g1[i1] {
            i2 = i1;
            i1 = i;
        } else if i2 == usize::MAX || g1[i] > g1[i2] {
            i2 = i;
        }
    }
    let (i, j) = (i1.min(i2), i1.max(i2));
    let gain = g1[i] + g1[j];
    if gain > best_gain {
        best_gain = gain;
        best = E81_PAIRS[i][j][(x[i] < 0.0) as usize][(x[j] < 0.0) as usize];
    }
    // (±½)^8 with an even number of minus signs: gain w_i |x_i| − w_i / 4 per coordinate
    let mut gain = 0f32;
    let mut minus = 0u32;
    let mut bits = 0usize;
    let (mut k, mut kl) = (0usize, f32::INFINITY);
    for i in 0..8 {
        gain += w[i] * x[i].abs() - 0.25 * w[i];
        if x[i] < 0.0 {
            minus += 1;
        } else {
            bits |= 1 << (7 - i);
        }
        let loss = 2.0 * w[i] * x[i].abs();
        if loss < kl {
            kl = loss;
            k = i;
        }
    }
    if minus % 2 == 1 {
        gain -= kl;
        bits ^= 1 << (7 - k);
    }
    if gain > best_gain {
        best_gain = gain;
        best = (E81_HALF + bits / 2) as u8;
    }
    // ±2e_i (no −2e_7): gain 4 w_i |x_i| − 4 w_i, or 4 w_7 x_7 − 4 w_7 for coordinate 7
    for i in 0..8 {
        let (gain, code) = if x[i] < 0.0 && i < 7 {
            (-4.0 * w[i] * x[i] - 4.0 * w[i], E81_MINUS2 + i)
        } else {
            (4.0 * w[i] * x[i] - 4.0 * w[i], E81_PLUS2 + i)
        };
        if gain > best_gain {
            best_gain = gain;
            best = code as u8;
        }
    }
    best
}

/// Decode helper for tests and the fitting: E81B codeword as f32.
pub fn e81_point(code: u8) -> [f32; 8] {
    decode_e81(code)
}

#[cfg(test)]
mod tests;
