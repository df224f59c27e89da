//! E8P12 lattice codes (QuIP#'s "E8P", 2 bits per weight): one 16-bit code per 8 weights.
//!
//! What it is: the 256-pattern absolute grid (built at compile time from its definition),
//! the 16-bit code layout, a `_ref` decoder written step by step from the definition and a
//! fast table-plus-sign-bits decoder tested against it on all 65,536 codes, scaled row
//! decoders, and the exhaustive nearest-codeword search that later quantizer tests compare
//! against. What it is not: arithmetic on activations (the E8P matmul is keep-kernels'
//! `e8p`), fitting codes to real weights (incoherence transforms, LDLQ, scale search),
//! residual stages, threading, SIMD intrinsics or I/O. Depends on [`crate::error`] only.
//!
//! # The absolute grid: 256 patterns ([`E8P_GRID`])
//! Stored in half-units: entry `a[i]` means `|x_i| = a[i] / 2`, `a[i] ∈ {1, 3, 5}`.
//! * Indices `0..227`: every absolute-value pattern of a half-integer vector
//!   `x ∈ (Z + ½)^8` with even coordinate sum and `‖x‖² ≤ 10`, in ascending lexicographic
//!   order (coordinate 0 most significant). Every pattern of odd half-integers has a sign
//!   choice with even sum (flipping one sign changes the sum by an odd integer), so these
//!   are exactly the `a ∈ {1,3,5}^8` with `Σ a² ≤ 40`: 227 of them.
//! * Indices `227..256`: 29 of the 56 patterns with `‖x‖² = 12` (five entries 3/2, three
//!   entries ½), listed in [`E8P_NORM12_HALVES`] by the positions of their ½ entries. The
//!   choice and order are QuIP#'s (`quip-sharp` `lib/codebook/latticee8_padded12.py`,
//!   `get_norm12()`, the list as fixed in 79b752f on 2023-12-19 and unchanged at 1d8f873;
//!   the 2023-12-03 release 2ddaccf repeated one row, so it had only 28 distinct). The reference text names no
//!   rule for which 29; keeping QuIP#'s set keeps its measured quantisation numbers.
//!
//! Norms (‖x‖², count): 2 (1), 4 (8), 6 (28), 8 (64), 10 (126), 12 (29).
//! All 29 norm-12 patterns have an odd coordinate sum (9).
//!
//! # Base patterns ([`e8p_base`])
//! The base pattern `b` of grid entry `a` is `a / 2` with coordinate 7 negated when the
//! coordinate sum `Σ a[i] / 2` is odd ("sign fix"). Every base pattern therefore has an
//! even coordinate sum, i.e. lies in `D8 + ½ ⊂ E8`, and so does every sign flip of it
//! that negates an even number of coordinates.
//!
//! # The 16-bit code
//! ```text
//!  15            8 7             0
//! +---------------+---------------+
//! |  pattern  g   |  sign byte s  |     bit i of s belongs to coordinate i (0..8)
//! +---------------+---------------+
//! ```
//! Decode of `code = g << 8 | s` (what [`decode_e8p_ref`] does, step by step):
//! 1. `p = popcount(s) mod 2` (the shift bit);
//! 2. `t = s ^ p` (parity fix: bit 0 flipped when `p = 1`, so `t` has even popcount);
//! 3. `w[i] = b[i]` negated where bit `i` of `t` is set, `b` the base pattern of `g`;
//! 4. `w[i] += ¼` when `p = 0`, `w[i] -= ¼` when `p = 1`.
//!
//! So the code spends 8 bits on the pattern, 7 free sign bits (bits 1..=7) and one bit of
//! information (the byte's parity) on the shift; bit 0 carries "negate coordinate 0 XOR
//! shift is −¼". Every value is a multiple of ¼ with `|w[i]| ∈ [0.25, 2.75]`, computed
//! exactly in `f32`.
//!
//! # Properties (all tested on every code)
//! * `w − ¼·1 ∈ E8` (`E8 = D8 ∪ (D8 + ½)`, `D8` = integer vectors with even sum): for
//!   `p = 0`, `w − ¼ = y` is half-integer with even sum; for `p = 1`, `w − ¼ = y − ½` is
//!   integer with sum `Σy − 4`, even.
//! * All 65,536 codewords are distinct: the codebook is `(S + ¼) ∪ (S − ¼)` with
//!   `S = {y ∈ (Z+½)^8 : Σy even, |y| ∈ grid}` (256 · 128 points); the halves are
//!   disjoint because `y − y'` is an integer vector for `y, y' ∈ S` and `½·1` is not.
//!   The codebook is closed under negation.
//!
//! # Relation to QuIP#
//! The point set equals QuIP#'s E8P12 codebook and the pattern index `g` is QuIP#'s abs-grid
//! index (same lexicographic order, same 29 extras, sign fix also on coordinate 7). The sign
//! byte differs: QuIP# negates coordinate `i` by bit `[0, 4, 1, 5, 2, 6, 3, 7][i]`; keep uses
//! bit `i`. [`e8p_code_from_quip_sharp`] converts by permuting the low byte (parity and
//! bit 0 are unchanged); checked against QuIP#'s whole table once, and on 8 vectors in
//! the tests. QuIP#'s packed kernel layout is not used.
//!
//! # Scale
//! Weights are coded as `w / s` with `s = RMS(w) / `[`E8P_OPT_SCALE`] and decoded as
//! `s · codeword` (the reference notes: 1.03 minimises the MSE for unit Gaussian input).

use crate::error::{check_len, mul, Result};

/// Weights per code.
pub const E8P_DIM: usize = 8;

/// Patterns in the absolute grid (the high byte of a code).
pub const E8P_GRID_LEN: usize = 256;

/// Patterns with `‖x‖² ≤ 10` (grid indices `0..227`).
pub const E8P_NORM10_PATTERNS: usize = 227;

/// The ±shift added to every coordinate (`+` when the sign byte has even popcount).
pub const E8P_SHIFT: f32 = 0.25;

/// Largest decoded magnitude (`5/2 + 1/4`).
pub const E8P_MAX_ABS: f32 = 2.75;

/// Divide a row's RMS by this to get its E8P scale (QuIP#: minimises the MSE for unit
/// Gaussian input, about 0.0921 per coordinate).
pub const E8P_OPT_SCALE: f32 = 1.03;

/// The 29 norm-12 patterns (grid indices `227..256`, in this order): the positions of the
/// three entries ½; the other five entries are 3/2. QuIP#'s `get_norm12()` choice.
pub const E8P_NORM12_HALVES: [[u8; 3]; 29] = [
    [1, 2, 3],
    [0, 2, 3],
    [0, 1, 3],
    [0, 1, 2],
    [3, 6, 7],
    [3, 5, 7],
    [3, 4, 7],
    [3, 5, 6],
    [3, 4, 6],
    [3, 4, 5],
    [2, 6, 7],
    [2, 5, 7],
    [2, 4, 7],
    [2, 5, 6],
    [2, 4, 6],
    [2, 4, 5],
    [1, 6, 7],
    [1, 5, 7],
    [1, 4, 7],
    [1, 5, 6],
    [1, 4, 6],
    [0, 4, 5],
    [0, 6, 7],
    [0, 5, 7],
    [0, 4, 7],
    [0, 5, 6],
    [0, 4, 6],
    [0, 1, 4],
    [2, 3, 7],
];

const fn build_grid() -> [[u8; 8]; 256] {
    let mut g = [[0u8; 8]; 256];
    let mut n = 0;
    // Every a ∈ {1,3,5}^8 in ascending lexicographic order: base-3 digits of `idx`,
    // coordinate 0 the most significant, digit d ↦ 2d + 1.
    let mut idx = 0u32;
    while idx < 6561 {
        let mut a = [0u8; 8];
        let mut rest = idx;
        let mut i = 8;
        let mut sq = 0u32;
        while i > 0 {
            i -= 1;
            let v = 2 * (rest % 3) + 1;
            a[i] = v as u8;
            sq += v * v;
            rest /= 3;
        }
        if sq <= 40 {
            g[n] = a;
            n += 1;
        }
        idx += 1;
    }
    assert!(n == E8P_NORM10_PATTERNS);
    let mut j = 0;
    while j < E8P_NORM12_HALVES.len() {
        let mut a = [3u8; 8];
        let h = E8P_NORM12_HALVES[j];
        a[h[0] as usize] = 1;
        a[h[1] as usize] = 1;
        a[h[2] as usize] = 1;
        g[n] = a;
        n += 1;
        j += 1;
    }
    assert!(n == E8P_GRID_LEN);
    g
}

/// The absolute grid in half-units (`|x_i| = E8P_GRID[g][i] / 2`); see the module docs.
/// Built at compile time.
pub static E8P_GRID: [[u8; 8]; 256] = build_grid();

/// Whether grid pattern `a` (half-units) has an odd coordinate sum `Σ a[i] / 2`.
const fn odd_sum(a: &[u8; 8]) -> bool {
    let mut s = 0u32;
    let mut i = 0;
    while i < 8 {
        s += a[i] as u32;
        i += 1;
    }
    // Σ a is even (eight odd numbers); the coordinate sum Σ a / 2 is odd iff Σ a ≡ 2 (mod 4).
    s % 4 == 2
}

const fn build_base() -> [[f32; 8]; 256] {
    let mut t = [[0.0f32; 8]; 256];
    let mut g = 0;
    while g < 256 {
        let a = &E8P_GRID[g];
        let mut i = 0;
        while i < 8 {
            t[g][i] = a[i] as f32 * 0.5;
            i += 1;
        }
        if odd_sum(a) {
            t[g][7] = -t[g][7];
        }
        g += 1;
    }
    t
}

/// Base patterns as `f32` (grid entry halved, coordinate 7 negated for odd-sum patterns).
static E8P_BASE: [[f32; 8]; 256] = build_base();

/// The base pattern of grid entry `g`: `E8P_GRID[g] / 2` with coordinate 7 negated when
/// the coordinate sum is odd, so that it lies in `D8 + ½`.
pub fn e8p_base(g: u8) -> [f32; 8] {
    E8P_BASE[g as usize]
}

/// Assemble a code from its pattern index and sign byte (`g << 8 | s`).
pub const fn e8p_code(g: u8, s: u8) -> u16 {
    ((g as u16) << 8) | s as u16
}

/// QuIP#'s sign-bit order: QuIP# negates coordinate `i` by bit `QUIP_SIGN_BIT[i]`.
const QUIP_SIGN_BIT: [u8; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Convert a QuIP# E8P12 code (its unpacked 16-bit index, `quip-sharp` at 1d8f873:
/// `get_full_grid`) to the keep code of the same codeword: the pattern byte is kept and
/// the sign byte permuted (keep bit `i` = QuIP# bit `[0, 4, 1, 5, 2, 6, 3, 7][i]`).
/// QuIP#'s packed kernel words are a different, later layout and are not handled here.
pub const fn e8p_code_from_quip_sharp(code: u16) -> u16 {
    let s = code & 0xFF;
    let mut t = 0u16;
    let mut i = 0;
    while i < 8 {
        t |= ((s >> QUIP_SIGN_BIT[i]) & 1) << i;
        i += 1;
    }
    (code & 0xFF00) | t
}

/// Reference decode, step by step from the definition in the module docs: pattern `g`
/// from the high byte (half-units, sign fix on coordinate 7 for odd-sum patterns), sign
/// byte `s` from the low byte with bit 0 flipped when its popcount is odd, coordinate `i`
/// negated where bit `i` is set, then `+¼` (even popcount) or `−¼` (odd).
pub fn decode_e8p_ref(code: u16) -> [f32; 8] {
    let g = (code >> 8) as usize;
    let mut s = (code & 0xFF) as u8;
    let a = E8P_GRID[g];
    let p = s.count_ones() % 2;
    if p == 1 {
        s ^= 1;
    }
    let coord_sum: u32 = a.iter().map(|&v| v as u32).sum::<u32>() / 2;
    let mut out = [0.0f32; 8];
    for (i, o) in out.iter_mut().enumerate() {
        let mut v = a[i] as f32 / 2.0;
        if i == 7 && coord_sum % 2 == 1 {
            v = -v;
        }
        if (s >> i) & 1 == 1 {
            v = -v;
        }
        *o = if p == 0 { v + 0.25 } else { v - 0.25 };
    }
    out
}

const fn build_sign_xor() -> [[u32; 8]; 256] {
    let mut t = [[0u32; 8]; 256];
    let mut s = 0u32;
    while s < 256 {
        let p = s.count_ones() & 1;
        let f = s ^ p;
        let mut i = 0;
        while i < 8 {
            t[s as usize][i] = ((f >> i) & 1) << 31;
            i += 1;
        }
        s += 1;
    }
    t
}

const fn build_shift() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut s = 0u32;
    while s < 256 {
        t[s as usize] = if s.count_ones().is_multiple_of(2) {
            E8P_SHIFT
        } else {
            -E8P_SHIFT
        };
        s += 1;
    }
    t
}

/// Per sign byte `s`: the `f32` sign-bit masks of `t = s ^ parity(s)` (bit 31 of lane `i`
/// set where bit `i` of `t` is).
static E8P_SIGN_XOR: [[u32; 8]; 256] = build_sign_xor();
/// Per sign byte `s`: `+¼` for even popcount, `−¼` for odd.
static E8P_SHIFT_BY_SIGNS: [f32; 256] = build_shift();

/// Fast decode: one 32-byte row of the base-pattern table, one 32-byte row of sign masks
/// (parity fix already applied) XORed into the `f32` sign bits, and the shift from a
/// 256-entry table. Identical to [`decode_e8p_ref`] on every code.
#[inline(always)]
pub fn decode_e8p(code: u16) -> [f32; 8] {
    let base = &E8P_BASE[(code >> 8) as usize];
    let s = (code & 0xFF) as usize;
    let m = &E8P_SIGN_XOR[s];
    let shift = E8P_SHIFT_BY_SIGNS[s];
    let mut out = [0.0f32; 8];
    for i in 0..8 {
        out[i] = f32::from_bits(base[i].to_bits() ^ m[i]) + shift;
    }
    out
}

/// Reference scaled row decode: `dst[8j + i] = scale * decode_e8p_ref(codes[j])[i]` (one
/// `f32` multiply). Needs `dst.len() == 8 * codes.len()`.
pub fn decode_e8p_row_ref(codes: &[u16], scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len(
        "e8p weights",
        mul("e8p weights", codes.len(), E8P_DIM)?,
        dst.len(),
    )?;
    for (j, &c) in codes.iter().enumerate() {
        let w = decode_e8p_ref(c);
        for i in 0..E8P_DIM {
            dst[E8P_DIM * j + i] = scale * w[i];
        }
    }
    Ok(())
}

/// Fast scaled row decode, bit-identical to [`decode_e8p_row_ref`].
pub fn decode_e8p_row(codes: &[u16], scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len(
        "e8p weights",
        mul("e8p weights", codes.len(), E8P_DIM)?,
        dst.len(),
    )?;
    for (d, &c) in dst.chunks_exact_mut(E8P_DIM).zip(codes) {
        let w = decode_e8p(c);
        for (o, v) in d.iter_mut().zip(w) {
            *o = scale * v;
        }
    }
    Ok(())
}

/// The nearest codeword to `x` by exhaustive search over all 65,536 codes: the
/// reference quantiser (slow, about half a million multiply-adds per call; for tests and
/// for checking faster quantisers, not for coding weights). Distance is the squared
/// Euclidean distance computed in `f64`; on a tie the smallest code wins. If every
/// distance is NaN or +inf (a NaN or infinite coordinate in `x`) the result is code 0.
pub fn nearest_e8p(x: [f32; 8]) -> u16 {
    let mut best = 0u16;
    let mut best_d = f64::INFINITY;
    for code in 0..=u16::MAX {
        let w = decode_e8p(code);
        let mut d = 0.0f64;
        for i in 0..E8P_DIM {
            let e = x[i] as f64 - w[i] as f64;
            d += e * e;
        }
        if d < best_d {
            best_d = d;
            best = code;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::FormatError;
    use crate::testutil::same;
    use std::collections::{BTreeMap, BTreeSet, HashSet};

    use keep_rng::{Draw, RngCore};

    /// A decoded codeword in quarter-units (exact: every value is a multiple of ¼).
    fn quarters(w: [f32; 8]) -> [i32; 8] {
        let mut q = [0i32; 8];
        for (o, v) in q.iter_mut().zip(w) {
            let s = v * 4.0;
            assert_eq!(s, s.round(), "{w:?} is not on the quarter grid");
            *o = s as i32;
        }
        q
    }

    /// E8 membership of a vector given in quarter-units, from the definition
    /// `E8 = D8 ∪ (D8 + ½)`: all coordinates integers (≡ 0 mod 4 quarters) or all
    /// half-integers (≡ 2 mod 4), and the coordinate sum even (Σ ≡ 0 mod 8 quarters).
    fn in_e8(z: [i32; 8]) -> bool {
        let all_int = z.iter().all(|v| v.rem_euclid(4) == 0);
        let all_half = z.iter().all(|v| v.rem_euclid(4) == 2);
        (all_int || all_half) && z.iter().sum::<i32>().rem_euclid(8) == 0
    }

    /// The 227 norm ≤ 10 patterns straight from the lattice: enumerate every
    /// `x ∈ (Z + ½)^8` (half-units `v`, odd) with `‖x‖² ≤ 10` (`Σ v² ≤ 40`, so `|v| ≤ 5`)
    /// and even coordinate sum (`Σ v ≡ 0 mod 4`), take absolute values, sort, dedupe.
    fn lattice_patterns() -> (Vec<[u8; 8]>, usize) {
        fn rec(i: usize, v: &mut [i32; 8], sq: i32, out: &mut BTreeSet<[u8; 8]>, n: &mut usize) {
            if i == 8 {
                if v.iter().sum::<i32>().rem_euclid(4) == 0 {
                    *n += 1;
                    out.insert(v.map(|c| c.unsigned_abs() as u8));
                }
                return;
            }
            for c in [-7, -5, -3, -1, 1, 3, 5, 7] {
                if sq + c * c <= 40 {
                    v[i] = c;
                    rec(i + 1, v, sq + c * c, out, n);
                }
            }
        }
        let mut set = BTreeSet::new();
        let mut n = 0;
        rec(0, &mut [0; 8], 0, &mut set, &mut n);
        (set.into_iter().collect(), n)
    }

    #[test]
    fn grid_rebuilt_from_lattice_definition() {
        let (pats, vectors) = lattice_patterns();
        assert_eq!(pats.len(), E8P_NORM10_PATTERNS);
        // Each pattern appears with 128 even-sum sign choices.
        assert_eq!(vectors, E8P_NORM10_PATTERNS * 128);
        // BTreeSet order on [u8; 8] is ascending lexicographic, coordinate 0 first.
        assert_eq!(&E8P_GRID[..E8P_NORM10_PATTERNS], &pats[..]);
    }

    #[test]
    fn norm12_patterns_and_norm_counts() {
        let extra = &E8P_GRID[E8P_NORM10_PATTERNS..];
        assert_eq!(extra.len(), 29);
        let distinct: BTreeSet<_> = extra.iter().collect();
        assert_eq!(distinct.len(), 29);
        for a in extra {
            assert_eq!(a.iter().filter(|&&v| v == 1).count(), 3, "{a:?}");
            assert_eq!(a.iter().filter(|&&v| v == 3).count(), 5, "{a:?}");
        }
        let all: BTreeSet<_> = E8P_GRID.iter().collect();
        assert_eq!(all.len(), 256, "grid patterns must be distinct");
        // ‖x‖² = Σ a² / 4
        let mut hist = BTreeMap::new();
        for a in &E8P_GRID {
            let sq: u32 = a.iter().map(|&v| (v as u32) * (v as u32)).sum();
            assert_eq!(sq % 4, 0);
            *hist.entry(sq / 4).or_insert(0) += 1;
        }
        let expect: BTreeMap<u32, i32> =
            [(2, 1), (4, 8), (6, 28), (8, 64), (10, 126), (12, 29)].into();
        assert_eq!(hist, expect);
        for (g, a) in E8P_GRID.iter().enumerate() {
            let sq: u32 = a.iter().map(|&v| (v as u32) * (v as u32)).sum();
            assert_eq!(sq <= 40, g < E8P_NORM10_PATTERNS, "{g}");
        }
    }

    #[test]
    fn base_patterns_lie_in_d8_plus_half() {
        for g in 0..=255u8 {
            let b = e8p_base(g);
            let a = E8P_GRID[g as usize];
            for i in 0..8 {
                assert_eq!(b[i].abs() * 2.0, a[i] as f32);
                assert_eq!(b[i] < 0.0, i == 7 && odd_sum(&a), "{g} {i}");
            }
            // Quarter-units of b: half-integers, even sum.
            assert!(in_e8(quarters(b)), "{g}: {b:?}");
        }
        // All norm-12 patterns have odd coordinate sum (9).
        assert!(E8P_GRID[E8P_NORM10_PATTERNS..].iter().all(odd_sum));
    }

    #[test]
    fn all_codes_fast_vs_ref() {
        for code in 0..=u16::MAX {
            let f = decode_e8p(code);
            let r = decode_e8p_ref(code);
            for i in 0..8 {
                assert!(same(f[i], r[i]), "{code:#06x}[{i}]: {} vs {}", f[i], r[i]);
            }
        }
    }

    #[test]
    fn layout_examples() {
        // pattern 0 = all ½; even sign byte 0: +¼
        assert_eq!(decode_e8p(0x0000), [0.75; 8]);
        // s = 1: odd popcount → bit 0 flipped back to 0, shift −¼
        assert_eq!(decode_e8p(0x0001), [0.25; 8]);
        // s = 3: even → coordinates 0 and 1 negated, +¼
        assert_eq!(
            decode_e8p(0x0003),
            [-0.25, -0.25, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75]
        );
        // s = 0x80: odd → t = 0x81, coordinates 0 and 7 negated, −¼
        assert_eq!(
            decode_e8p(0x0080),
            [-0.75, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, -0.75]
        );
        // pattern 1 = (½,…,½,3/2), sum 5 odd → base has coordinate 7 negated
        assert_eq!(E8P_GRID[1], [1, 1, 1, 1, 1, 1, 1, 3]);
        assert_eq!(
            decode_e8p(e8p_code(1, 0)),
            [0.75, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75, -1.25]
        );
        assert_eq!(
            decode_e8p(e8p_code(1, 0x80)),
            [-0.75, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 1.25]
        );
        // last pattern: QuIP#'s [3,3,1,1,3,3,3,1]/2
        assert_eq!(E8P_GRID[255], [3, 3, 1, 1, 3, 3, 3, 1]);
        assert_eq!(E8P_GRID[227], [3, 1, 1, 1, 3, 3, 3, 3]);
        assert_eq!(E8P_GRID[226], [5, 3, 1, 1, 1, 1, 1, 1]);
        assert_eq!(e8p_code(0xAB, 0xCD), 0xABCD);
    }

    /// Codewords of QuIP#'s E8P12 (`quip-sharp` 1d8f873, `get_full_grid`, its decode
    /// logic re-run in plain Python; the whole table, 65,536 codes, matched keep's decode
    /// after [`e8p_code_from_quip_sharp`] when this was written).
    #[test]
    fn quip_sharp_vectors() {
        let v: [(u16, [f32; 8]); 8] = [
            (0x0000, [0.75, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75]),
            (0x0001, [0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25]),
            (0x0102, [-0.75, 0.25, -0.75, 0.25, 0.25, 0.25, 0.25, -1.75]),
            (
                0x3F5A,
                [0.75, -0.25, -1.25, 0.75, 0.75, -1.25, -0.25, -1.25],
            ),
            (0xE3C7, [1.25, 0.25, -0.75, 0.25, -1.75, -1.75, 1.25, 1.25]),
            (0xFF80, [-1.75, 1.25, 0.25, 0.25, 1.25, 1.25, 1.25, 0.25]),
            (0x8001, [0.25, 1.25, 1.25, 0.25, 0.25, 1.25, 0.25, -0.75]),
            (0x1234, [-0.75, -0.75, 0.25, -0.75, -1.75, 0.25, 0.25, 1.25]),
        ];
        for (q, w) in v {
            assert_eq!(decode_e8p_ref(e8p_code_from_quip_sharp(q)), w, "{q:#06x}");
        }
        // a bijection that keeps the pattern byte and the sign byte's parity
        let mut seen = HashSet::new();
        for q in 0..=u16::MAX {
            let k = e8p_code_from_quip_sharp(q);
            assert_eq!(k >> 8, q >> 8);
            assert_eq!((k & 0xFF).count_ones(), (q & 0xFF).count_ones());
            assert_eq!(k & 1, q & 1);
            assert!(seen.insert(k));
        }
    }

    #[test]
    fn all_codes_minus_quarter_in_e8_distinct_bounded() {
        let mut seen = HashSet::with_capacity(1 << 16);
        let mut plus = 0;
        let (mut lo, mut hi) = (f32::INFINITY, 0.0f32);
        for code in 0..=u16::MAX {
            let w = decode_e8p_ref(code);
            let q = quarters(w);
            // w − ¼ (and w + ¼: same coset, ½·1 ∈ E8) lie in E8
            assert!(in_e8(q.map(|v| v - 1)), "{code:#06x}: {w:?}");
            assert!(in_e8(q.map(|v| v + 1)), "{code:#06x}: {w:?}");
            // the shift is the sign byte's parity
            let p = (code & 0xFF).count_ones() % 2;
            let y = if p == 0 {
                q.map(|v| v - 1)
            } else {
                q.map(|v| v + 1)
            };
            plus += (p == 0) as u32;
            // |w ∓ ¼| is the code's grid pattern (half-units ×2 = quarters)
            let a = E8P_GRID[(code >> 8) as usize];
            for i in 0..8 {
                assert_eq!(y[i].unsigned_abs(), 2 * a[i] as u32, "{code:#06x}");
            }
            for v in w {
                lo = lo.min(v.abs());
                hi = hi.max(v.abs());
            }
            assert!(seen.insert(q), "{code:#06x} duplicates an earlier codeword");
        }
        assert_eq!(seen.len(), 1 << 16);
        assert_eq!(plus, 1 << 15);
        assert_eq!((lo, hi), (E8P_SHIFT, E8P_MAX_ABS));
        // closed under negation
        for q in &seen {
            assert!(seen.contains(&q.map(|v| -v)));
        }
    }

    #[test]
    fn rows_fast_vs_ref_and_errors() {
        let codes: Vec<u16> = (0..=u16::MAX).collect();
        let mut a = vec![0.0f32; codes.len() * 8];
        let mut b = vec![1.0f32; codes.len() * 8];
        for scale in [1.0f32, 0.0371, -3.5e-3] {
            decode_e8p_row(&codes, scale, &mut a).unwrap();
            decode_e8p_row_ref(&codes, scale, &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| same(*x, *y)), "{scale}");
        }
        assert!(matches!(
            decode_e8p_row(&codes[1..], 1.0, &mut a),
            Err(FormatError::LengthMismatch { .. })
        ));
        assert!(decode_e8p_row_ref(&codes, 1.0, &mut a[1..]).is_err());
        decode_e8p_row(&[], 1.0, &mut []).unwrap();
    }

    #[test]
    fn nearest_recovers_codewords() {
        let mut rng = keep_rng::rng(0x0123_4567_89AB_CDEF);
        let sample: Vec<u16> = [0u16, 1, 0x00FF, 0xFF00, 0xFFFF, 0xE300, 0xE2FF]
            .into_iter()
            .chain((0..24).map(|_| rng.next_u64() as u16))
            .collect();
        for &c in &sample {
            let w = decode_e8p(c);
            let q = nearest_e8p(w);
            // codewords are distinct, so the exact code comes back
            assert_eq!(q, c);
            assert_eq!(decode_e8p(q), w);
            // min distance of the codebook is √2 (E8's minimal norm 2), so a
            // perturbation with every |δ_i| ≤ 0.2 (‖δ‖ ≤ 0.57 < √2/2) keeps the code
            let mut y = w;
            for v in &mut y {
                *v += ((rng.unit() - 0.5) * 0.4) as f32;
            }
            assert_eq!(nearest_e8p(y), c, "{c:#06x} {y:?}");
        }
        // non-finite input: no panic, code 0
        assert_eq!(nearest_e8p([f32::NAN; 8]), 0);
        assert_eq!(nearest_e8p([f32::INFINITY, 0., 0., 0., 0., 0., 0., 0.]), 0);
    }

    /// The reference notes' figure: unit Gaussian input coded at scale `1/1.03` has an MSE
    /// of about 0.0921 per coordinate (12,000 vectors here gave 0.0919 ± 0.0006). 1,024
    /// vectors estimate it with a standard error of about 2%; the band is ±6%.
    #[test]
    fn gaussian_mse_at_opt_scale() {
        let mut rng = keep_rng::rng(0xD1B5_4A32_D192_ED03);
        let (mut se, mut cnt) = (0.0f64, 0usize);
        for _ in 0..1024 {
            let x: [f64; 8] = std::array::from_fn(|_| rng.gauss());
            let c = nearest_e8p(x.map(|v| (v * E8P_OPT_SCALE as f64) as f32));
            let w = decode_e8p(c);
            for i in 0..8 {
                let e = w[i] as f64 / E8P_OPT_SCALE as f64 - x[i];
                se += e * e;
                cnt += 1;
            }
        }
        let mse = se / cnt as f64;
        assert!((mse - 0.0921).abs() < 0.0921 * 0.06, "mse {mse}");
    }
}
