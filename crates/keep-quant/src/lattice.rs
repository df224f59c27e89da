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
//! * [`nearest_e8p_weighted_scan`]: the exact nearest codeword under `Σ w_i (x_i − c_i)²`
//!   by a scan of the 256 patterns for each of the two shifts: with `z = x ∓ ¼`, each
//!   coordinate takes the sign of `z_i`; when the sign byte's parity comes out wrong the
//!   coordinate whose flip costs least (`4 w_i m_i |z_i|`) is flipped. Weighted error has no
//!   lattice structure to decode with, but the pattern scan is exact for any non-negative
//!   weights.
//! * [`nearest_e8p_weighted`]: the same minimum with far less work. Per shift, the cost of
//!   each coordinate's three magnitudes (and of flipping its sign) separates over the
//!   coordinates; only the pattern's membership in the grid and the sign parity couple them.
//!   (1) The unconstrained nearest point (each coordinate's cheapest magnitude, then the
//!   cheapest parity fix: one sign flip or one magnitude of the other parity) is the answer
//!   when its pattern is in the grid (about two thirds of the shift searches on fit-like
//!   inputs). (2) Otherwise a dynamic program over the coordinates with state (parity owed,
//!   norm units left) gives the exact nearest point among all patterns of `‖x‖² ≤ 10`
//!   (they are exactly the digit vectors within 4 units: the grid's first 227) and a lower
//!   bound for `‖x‖² = 12`; (3) the 29 norm-12 patterns are scanned only when that bound can
//!   still win. A shift whose unconstrained cost cannot beat the best so far is skipped.
//! * [`nearest_e81_weighted`]: the exact nearest E81B codeword under the weighted error in
//!   O(8): the origin, the best `±e_i ± e_j` (the two best coordinates), the best `(±½)^8` with
//!   the parity fix, and the best `±2e_i` (no `−2e_7`).
//!
//! * [`nearest_e8p_weighted_many`]: [`nearest_e8p_weighted`] on many groups at once, one
//!   group per SIMD lane (AVX-512, AVX2 or the baseline build, chosen at run time), the same
//!   codes bit for bit.
//!
//! Each is tested against the exhaustive references in keep-format (`nearest_e8p`,
//! [`nearest_e8p_brute_weighted`], `nearest_e81_brute`) and the fast weighted search against the scan on random and adversarial vectors.
//! What it is not: scales, rows, threading (see [`crate::fit`]). No I/O, never panics.

use std::sync::LazyLock;

use keep_format::e81::{decode_e81, E81_GRID};
use keep_format::e8p::{decode_e8p, E8P_GRID};

mod batch;
pub use batch::{nearest_e8p_weighted_many, nearest_e8p_weighted_many_at, LANES};

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

/// Norm units of a digit: `((2d + 1)² − 1) / 8`, so a pattern's `‖x‖² = 2 + 2 · Σ units`.
const DIGIT_UNITS: [usize; 3] = [0, 1, 3];
/// The most units any grid pattern has: `‖x‖² ≤ 12` (the norm-12 patterns have five 3/2).
const UNITS: usize = 5;

/// One shift's search state: per coordinate the cost of each digit and the extra cost of
/// flipping its sign; `suf[k][q][b]` is a lower bound on what coordinates `k..8` add when the
/// parity of their digit sum plus sign flips must be `q` and their norm units
/// ([`DIGIT_UNITS`]) are at most `b` (flips are not limited to one there, so it is a
/// relaxation of the codebook and a valid bound).
struct Shift {
    cost: [[f32; 3]; 8],
    pen: [[f32; 3]; 8],
    suf: [[[f32; UNITS + 1]; 2]; 9],
    /// Parity of the sign byte (the number of negative `z_i`).
    negpar: u8,
    neg: u8,
    p: u8,
}

// per-coordinate tables are indexed in step with each other: index loops read best here
#[allow(clippy::needless_range_loop)]
impl Shift {
    fn new(x: &[f32; 8], w: &[f32; 8], p: u8) -> Shift {
        let sigma = if p == 0 { 0.25f32 } else { -0.25 };
        let mut s = Shift {
            cost: [[0.0; 3]; 8],
            pen: [[0.0; 3]; 8],
            suf: [[[0.0; UNITS + 1]; 2]; 9],
            negpar: 0,
            neg: 0,
            p,
        };
        for i in 0..8 {
            let z = x[i] - sigma;
            let az = z.abs();
            s.neg |= ((z < 0.0) as u8) << i;
            for d in 0..3 {
                let e = az - MAGS[d];
                s.cost[i][d] = w[i] * e * e;
                s.pen[i][d] = 4.0 * w[i] * MAGS[d] * az;
            }
        }
        s.negpar = (s.neg.count_ones() & 1) as u8;
        s
    }

    /// The unconstrained nearest point: every coordinate's cheapest magnitude, then the
    /// cheapest parity fix (one sign flip, or one coordinate moved to its cheapest magnitude
    /// of the other parity). Its cost is a lower bound for this shift, and it is the answer
    /// when its pattern is in the grid. Returns (cost, code if in the grid).
    fn relaxed(&self) -> (f32, Option<u16>) {
        let mut digits = [0u8; 8];
        let mut tot = 0f32;
        let mut par = self.negpar;
        for i in 0..8 {
            let c = &self.cost[i];
            let d = if c[0] <= c[1] {
                if c[0] <= c[2] {
                    0
                } else {
                    2
                }
            } else if c[1] <= c[2] {
                1
            } else {
                2
            };
            digits[i] = d;
            tot += c[d as usize];
            par ^= d & 1;
        }
        let mut flip = 0u8;
        if par == 1 {
            let (mut best, mut how) = (f32::INFINITY, (0usize, 0u8, false));
            for i in 0..8 {
                let d = digits[i] as usize;
                let c = &self.cost[i];
                let f = self.pen[i][d];
                if f < best {
                    best = f;
                    how = (i, d as u8, true);
                }
                // the other parity: digit 1 from 0 or 2, digits 0 or 2 from 1
                let (alt, ad) = if d == 1 {
                    if c[0] <= c[2] {
                        (c[0], 0)
                    } else {
                        (c[2], 2)
                    }
                } else {
                    (c[1], 1)
                };
                if alt - c[d] < best {
                    best = alt - c[d];
                    how = (i, ad, false);
                }
            }
            tot += best;
            if how.2 {
                flip = 1 << how.0;
            } else {
                digits[how.0] = how.1;
            }
        }
        let key = digits.iter().fold(0usize, |k, &d| k * 3 + d as usize);
        let g = PATTERN_INDEX[key];
        if g == u16::MAX {
            return (tot, None);
        }
        let odd = PATTERN_DIGITS[g as usize].1;
        let t = self.neg ^ ((odd as u8) << 7) ^ flip;
        (tot, Some((g << 8) | (t ^ self.p) as u16))
    }

    /// Fill the suffix table (the dynamic program's values).
    fn bounds(&mut self) {
        let s = self;
        s.suf[8] = [[0.0; UNITS + 1], [f32::INFINITY; UNITS + 1]];
        for i in (0..8).rev() {
            // the next coordinate's values, padded with 3 infinities below zero units so that
            // `nx[q][b + 3 − u]` is "at most b − u units" or impossible, without branches
            let mut nx = [[f32::INFINITY; UNITS + 4]; 2];
            for q in 0..2 {
                nx[q][3..].copy_from_slice(&s.suf[i + 1][q]);
            }
            let mut cur = [[f32::INFINITY; UNITS + 1]; 2];
            for d in 0..3 {
                let u = DIGIT_UNITS[d];
                let plain = s.cost[i][d];
                let flipped = plain + s.pen[i][d];
                let p = d & 1;
                for q in 0..2 {
                    let (same, other) = (&nx[q ^ p], &nx[q ^ p ^ 1]);
                    for b in 0..=UNITS {
                        let v = (plain + same[b + 3 - u]).min(flipped + other[b + 3 - u]);
                        cur[q][b] = cur[q][b].min(v);
                    }
                }
            }
            s.suf[i] = cur;
        }
    }
}

/// First grid index of the norm-12 patterns (five 3/2 and three ½; units 5).
const NORM12_FIRST: usize = 227;

// per-coordinate tables are indexed in step with each other: index loops read best here
#[allow(clippy::needless_range_loop)]
impl Shift {
    /// The nearest codeword among the patterns of norm ≤ 10 (every digit vector with at most
    /// 4 units is one) from the suffix bounds, and its cost; needs [`Shift::bounds`].
    fn best_norm10(&self, digits: &[([u8; 8], bool)]) -> (f32, u16) {
        let total = self.suf[0][self.negpar as usize][4];
        let (mut q, mut b) = (self.negpar as usize, 4usize);
        let mut dg = [0u8; 8];
        let mut flips = 0u8;
        for i in 0..8 {
            // the option that attains suf[i][q][b]
            let mut pick = (f32::INFINITY, 0usize, 0usize);
            for d in 0..3 {
                let u = DIGIT_UNITS[d];
                if u > b {
                    continue;
                }
                for flip in 0..2 {
                    let c = self.cost[i][d] + if flip == 1 { self.pen[i][d] } else { 0.0 };
                    let v = c + self.suf[i + 1][q ^ (d & 1) ^ flip][b - u];
                    if v < pick.0 {
                        pick = (v, d, flip);
                    }
                }
            }
            let (_, d, flip) = pick;
            dg[i] = d as u8;
            flips |= (flip as u8) << i;
            q ^= (d & 1) ^ flip;
            b -= DIGIT_UNITS[d];
        }
        let key = dg.iter().fold(0usize, |k, &d| k * 3 + d as usize);
        let g = PATTERN_INDEX[key];
        // every digit vector within 4 units is in the grid; the parity is met by construction
        let odd = digits[g as usize].1;
        let t = self.neg ^ ((odd as u8) << 7) ^ flips;
        (total, (g << 8) | (t ^ self.p) as u16)
    }

    /// The nearest codeword among the 29 norm-12 patterns, by scanning them.
    fn best_norm12(&self, digits: &[([u8; 8], bool)]) -> (f32, u16) {
        let mut best = (f32::INFINITY, 0u16);
        for (g, (dg, odd)) in digits.iter().enumerate().skip(NORM12_FIRST) {
            let mut tot = 0f32;
            for i in 0..8 {
                tot += self.cost[i][dg[i] as usize];
            }
            let mut flip = 0u8;
            if self.negpar ^ (*odd as u8) == 1 {
                let mut m = f32::INFINITY;
                for i in 0..8 {
                    let v = self.pen[i][dg[i] as usize];
                    if v < m {
                        m = v;
                        flip = 1 << i;
                    }
                }
                tot += m;
            }
            if tot < best.0 {
                let t = self.neg ^ ((*odd as u8) << 7) ^ flip;
                best = (tot, ((g as u16) << 8) | (t ^ self.p) as u16);
            }
        }
        best
    }
}

/// The nearest E8P codeword to `x` under `Σ w_i (x_i − c_i)²` (weights ≥ 0), exact (the
/// same minimum as [`nearest_e8p_weighted_scan`]), by the staged search in the module docs.
/// Non-finite input gives a valid code, never a panic.
pub fn nearest_e8p_weighted(x: [f32; 8], w: [f32; 8]) -> u16 {
    let mut sh = [Shift::new(&x, &w, 0), Shift::new(&x, &w, 1)];
    let r = [sh[0].relaxed(), sh[1].relaxed()];
    // the best in-grid unconstrained point is the incumbent; a shift whose unconstrained
    // point is out of the grid but cheaper is searched
    let mut best = (f32::INFINITY, 0u16);
    for (v, c) in r {
        if let Some(c) = c {
            if v < best.0 {
                best = (v, c);
            }
        }
    }
    let digits = &*PATTERN_DIGITS;
    for (s, (v, c)) in sh.iter_mut().zip(r) {
        if c.is_some() || v >= best.0 || v.is_nan() {
            continue;
        }
        s.bounds();
        let neg = s.negpar as usize;
        if s.suf[0][neg][4] < best.0 {
            let cand = s.best_norm10(digits);
            if cand.0 < best.0 {
                best = cand;
            }
        }
        if s.suf[0][neg][UNITS] < best.0 {
            let cand = s.best_norm12(digits);
            if cand.0 < best.0 {
                best = cand;
            }
        }
    }
    best.1
}

/// The nearest E8P codeword to `x` under `Σ w_i (x_i − c_i)²` (weights ≥ 0), exact, by the
/// pattern scan described in the module docs (all 512 shift/pattern pairs): the reference
/// for the pruned search [`nearest_e8p_weighted`]. Non-finite input gives code 0.
pub fn nearest_e8p_weighted_scan(x: [f32; 8], w: [f32; 8]) -> u16 {
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
