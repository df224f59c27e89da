//! E81B: QuIP#'s 1-bit E8 codebook for residual stages (8 bits per 8 weights).
//!
//! What it is: the 256 codewords (built at compile time from their definition), a `_ref`
//! decoder written from the definition, a table decoder tested against it on all 256 codes,
//! scaled row decoders, and the exhaustive nearest-codeword search that the fitting code's
//! structured search is tested against. What it is not: fitting codes to weights (keep-quant),
//! arithmetic on activations, I/O. Depends on [`crate::error`] only.
//!
//! # The codebook ([`E81_GRID`], half-units: entry `v` means `v / 2`)
//! QuIP#'s `get_e81bgrid()` (`quip-sharp` `lib/codebook/latticee8_padded12_rvq3bit.py`), in
//! its order:
//! * codes `0..113`: the E8 points with integer coordinates and `‖x‖² ≤ 2` — the origin and
//!   the 112 roots `±e_i ± e_j` — in ascending lexicographic order (coordinate 0 most
//!   significant);
//! * codes `113..241`: the 128 half-integer roots `(±½)^8` with an even number of minus signs,
//!   in ascending lexicographic order;
//! * codes `241..256`: `+2e_0 … +2e_7`, then `−2e_0 … −2e_6` (QuIP# leaves out `−2e_7` so that
//!   the book has exactly 256 entries).
//!
//! A residual stage stores one byte per 8 weights, `code`, and decodes as
//! `scale · E81_GRID[code] / 2`.

use crate::error::{check_len, mul, Result};

/// Weights per code.
pub const E81_DIM: usize = 8;

/// Codewords in the book.
pub const E81_LEN: usize = 256;

/// Code of the origin.
pub const E81_ORIGIN: u8 = 56;

const fn build_grid() -> [[i8; 8]; 256] {
    let mut g = [[0i8; 8]; 256];
    let mut n = 0;
    // Integer points: every v ∈ {−1, 0, 1}^8 in lexicographic order (base-3 digits, digit
    // d ↦ d − 1, coordinate 0 most significant) with ‖v‖² ≤ 2 and an even sum.
    let mut idx = 0u32;
    while idx < 6561 {
        let mut v = [0i8; 8];
        let mut rest = idx;
        let mut i = 8;
        let (mut sq, mut sum) = (0i32, 0i32);
        while i > 0 {
            i -= 1;
            let d = (rest % 3) as i32 - 1;
            v[i] = (2 * d) as i8;
            sq += d * d;
            sum += d;
            rest /= 3;
        }
        if sq <= 2 && sum.rem_euclid(2) == 0 {
            g[n] = v;
            n += 1;
        }
        idx += 1;
    }
    assert!(n == 113);
    // Half-integer points: (±½)^8 in lexicographic order (−½ before +½) with an even sum,
    // i.e. an even number of minus signs.
    let mut b = 0u32;
    while b < 256 {
        let mut v = [0i8; 8];
        let mut minus = 0;
        let mut i = 0;
        while i < 8 {
            // bit (7 − i) of b set means coordinate i is +½ (so 0 sorts first)
            if (b >> (7 - i)) & 1 == 1 {
                v[i] = 1;
            } else {
                v[i] = -1;
                minus += 1;
            }
            i += 1;
        }
        if minus % 2 == 0 {
            g[n] = v;
            n += 1;
        }
        b += 1;
    }
    assert!(n == 241);
    let mut i = 0;
    while i < 8 {
        g[n][i] = 4;
        n += 1;
        i += 1;
    }
    i = 0;
    while i < 7 {
        g[n][i] = -4;
        n += 1;
        i += 1;
    }
    assert!(n == E81_LEN);
    g
}

/// The codebook in half-units (`x_i = E81_GRID[code][i] / 2`); see the module docs.
pub static E81_GRID: [[i8; 8]; 256] = build_grid();

const fn build_f32() -> [[f32; 8]; 256] {
    let mut t = [[0.0f32; 8]; 256];
    let mut c = 0;
    while c < 256 {
        let mut i = 0;
        while i < 8 {
            t[c][i] = E81_GRID[c][i] as f32 * 0.5;
            i += 1;
        }
        c += 1;
    }
    t
}

static E81_F32: [[f32; 8]; 256] = build_f32();

/// Reference decode from the definition: half-units halved, one coordinate at a time.
pub fn decode_e81_ref(code: u8) -> [f32; 8] {
    let v = E81_GRID[code as usize];
    let mut out = [0.0f32; 8];
    for i in 0..8 {
        out[i] = v[i] as f32 / 2.0;
    }
    out
}

/// Table decode, identical to [`decode_e81_ref`] on every code.
#[inline(always)]
pub fn decode_e81(code: u8) -> [f32; 8] {
    E81_F32[code as usize]
}

/// Reference scaled row decode: `dst[8j + i] = scale * decode_e81_ref(codes[j])[i]`.
pub fn decode_e81_row_ref(codes: &[u8], scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len(
        "e81 weights",
        mul("e81 weights", codes.len(), E81_DIM)?,
        dst.len(),
    )?;
    for (j, &c) in codes.iter().enumerate() {
        let w = decode_e81_ref(c);
        for i in 0..E81_DIM {
            dst[E81_DIM * j + i] = scale * w[i];
        }
    }
    Ok(())
}

/// Fast scaled row decode, bit-identical to [`decode_e81_row_ref`].
pub fn decode_e81_row(codes: &[u8], scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len(
        "e81 weights",
        mul("e81 weights", codes.len(), E81_DIM)?,
        dst.len(),
    )?;
    for (d, &c) in dst.chunks_exact_mut(E81_DIM).zip(codes) {
        for (o, v) in d.iter_mut().zip(decode_e81(c)) {
            *o = scale * v;
        }
    }
    Ok(())
}

/// The nearest codeword to `x` under the weighted squared error `Σ w_i (x_i − c_i)²` by
/// exhaustive search over all 256 codes (f64; on a tie the smallest code wins; code 0 when
/// every distance is NaN). The reference for faster searches.
pub fn nearest_e81_brute(x: [f32; 8], w: [f32; 8]) -> u8 {
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for code in 0..=255u8 {
        let c = decode_e81(code);
        let mut d = 0.0f64;
        for i in 0..E81_DIM {
            let e = x[i] as f64 - c[i] as f64;
            d += w[i] as f64 * e * e;
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
    use crate::testutil::same;
    use std::collections::BTreeSet;

    #[test]
    fn codebook_matches_definition() {
        let all: BTreeSet<[i8; 8]> = E81_GRID.iter().copied().collect();
        assert_eq!(all.len(), 256, "codewords are distinct");
        let mut norms = std::collections::BTreeMap::new();
        for (c, v) in E81_GRID.iter().enumerate() {
            // E8 membership in half-units: all even or all odd, sum ≡ 0 (mod 4)
            let even = v.iter().all(|x| x.rem_euclid(2) == 0);
            let odd = v.iter().all(|x| x.rem_euclid(2) == 1);
            assert!(even || odd, "{c}");
            assert_eq!(
                v.iter().map(|&x| x as i32).sum::<i32>().rem_euclid(4),
                0,
                "{c}"
            );
            let sq: i32 = v.iter().map(|&x| x as i32 * x as i32).sum();
            *norms.entry(sq / 4).or_insert(0) += 1;
        }
        assert_eq!(norms, [(0, 1), (2, 240), (4, 15)].into());
        assert_eq!(E81_GRID[E81_ORIGIN as usize], [0; 8]);
        // QuIP#'s order: first entry (−1,−1,0,…,0), first half-integer entry all −½, last −2e_6
        assert_eq!(E81_GRID[0], [-2, -2, 0, 0, 0, 0, 0, 0]);
        assert_eq!(E81_GRID[113], [-1; 8]);
        assert_eq!(E81_GRID[241], [4, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(E81_GRID[255], [0, 0, 0, 0, 0, 0, -4, 0]);
        assert!(!all.contains(&[0, 0, 0, 0, 0, 0, 0, -4]));
        // lexicographic within each block
        assert!(E81_GRID[..113].windows(2).all(|p| p[0] < p[1]));
        assert!(E81_GRID[113..241].windows(2).all(|p| p[0] < p[1]));
    }

    #[test]
    fn decode_fast_vs_ref_and_rows() {
        for c in 0..=255u8 {
            let (f, r) = (decode_e81(c), decode_e81_ref(c));
            assert!(f.iter().zip(&r).all(|(a, b)| same(*a, *b)), "{c}");
        }
        let codes: Vec<u8> = (0..=255).collect();
        let (mut a, mut b) = (vec![0.0; 2048], vec![1.0; 2048]);
        for s in [1.0f32, -0.37, 3.1e-3] {
            decode_e81_row(&codes, s, &mut a).unwrap();
            decode_e81_row_ref(&codes, s, &mut b).unwrap();
            assert!(a.iter().zip(&b).all(|(x, y)| same(*x, *y)));
        }
        assert!(decode_e81_row(&codes[1..], 1.0, &mut a).is_err());
    }

    #[test]
    fn brute_recovers_codewords() {
        for c in 0..=255u8 {
            assert_eq!(nearest_e81_brute(decode_e81(c), [1.0; 8]), c);
        }
        assert_eq!(nearest_e81_brute([f32::NAN; 8], [1.0; 8]), 0);
    }
}
