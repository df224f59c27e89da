//! The weighted E8P12 search of [`super::nearest_e8p_weighted`] run on [`LANES`] groups of 8
//! at once, one group per SIMD lane, bit for bit the same codes.
//!
//! What it is: the same staged search (unconstrained point, the dynamic program over
//! (parity owed, norm units left), the norm-12 scan) with the per-coordinate tables laid out
//! lane-major (`[coordinate][digit][lane]`), so the arithmetic of every stage is the same
//! sequence of f32 operations per lane as the one-group search and the compiler turns the
//! lane loops into vector instructions. Data-dependent steps (the pattern-table lookups, the
//! dynamic program's traceback) stay per lane. The kernels are compiled three times from one
//! source: for AVX-512, for AVX2 and for the baseline target, chosen at run time by
//! `keep_kernels::cpu::level()` (capped by `KEEP_SIMD`); [`Level::Scalar`] runs the one-group
//! search group by group. Rust never fuses a multiply and an add, so every level gives the
//! same codes (tested by forcing each). What it is not: a different search (no result
//! changes), scales or rows ([`crate::fit`]).

// lane-major tables are indexed in step with each other (coordinate, digit, lane): index
// loops read best here and are what the compiler vectorizes
#![allow(clippy::needless_range_loop)]

use keep_kernels::cpu::Level;

use super::{DIGIT_UNITS, MAGS, NORM12_FIRST, PATTERN_DIGITS, PATTERN_INDEX, UNITS};

/// Groups searched together: one AVX-512 register of f32.
pub const LANES: usize = 16;

type F = [f32; LANES];
type U = [u32; LANES];

/// No code: the unconstrained point's pattern is outside the grid.
const NONE: u32 = u32::MAX;

/// One shift's tables for a block of lanes (see `Shift` in the parent module).
struct Block {
    cost: [[F; 3]; 8],
    pen: [[F; 3]; 8],
    neg: U,
    negpar: U,
    p: u32,
}

/// The dynamic program's values `suf[k][q][b]` per lane.
type Suf = [[[F; UNITS + 1]; 2]; 9];

#[inline(always)]
fn new_block(x: &[F; 8], w: &[F; 8], p: u32) -> Block {
    let sigma = if p == 0 { 0.25f32 } else { -0.25 };
    let mut s = Block {
        cost: [[[0.0; LANES]; 3]; 8],
        pen: [[[0.0; LANES]; 3]; 8],
        neg: [0; LANES],
        negpar: [0; LANES],
        p,
    };
    for i in 0..8 {
        for l in 0..LANES {
            let z = x[i][l] - sigma;
            let az = z.abs();
            s.neg[l] |= ((z < 0.0) as u32) << i;
            for d in 0..3 {
                let e = az - MAGS[d];
                s.cost[i][d][l] = w[i][l] * e * e;
                s.pen[i][d][l] = 4.0 * w[i][l] * MAGS[d] * az;
            }
        }
    }
    for l in 0..LANES {
        s.negpar[l] = s.neg[l].count_ones() & 1;
    }
    s
}

/// The unconstrained nearest point per lane (`Shift::relaxed`): its cost and its code, or
/// [`NONE`] when its pattern is outside the grid.
#[inline(always)]
fn relaxed(s: &Block) -> (F, U) {
    let mut dig = [[0u32; LANES]; 8];
    let mut tot = [0f32; LANES];
    let mut par = s.negpar;
    for i in 0..8 {
        let c = &s.cost[i];
        for l in 0..LANES {
            let (c0, c1, c2) = (c[0][l], c[1][l], c[2][l]);
            let (d, cd) = if c0 <= c1 {
                if c0 <= c2 {
                    (0, c0)
                } else {
                    (2, c2)
                }
            } else if c1 <= c2 {
                (1, c1)
            } else {
                (2, c2)
            };
            dig[i][l] = d;
            tot[l] += cd;
            par[l] ^= d & 1;
        }
    }
    // the cheapest parity fix, for every lane (applied where the parity is wrong)
    let mut best = [f32::INFINITY; LANES];
    let mut hi = [0u32; LANES];
    let mut hd = [0u32; LANES];
    let mut hf = [0u32; LANES];
    for i in 0..8 {
        let c = &s.cost[i];
        let pn = &s.pen[i];
        for l in 0..LANES {
            let d = dig[i][l];
            let (c0, c1, c2) = (c[0][l], c[1][l], c[2][l]);
            let cd = if d == 0 {
                c0
            } else if d == 1 {
                c1
            } else {
                c2
            };
            let f = if d == 0 {
                pn[0][l]
            } else if d == 1 {
                pn[1][l]
            } else {
                pn[2][l]
            };
            if f < best[l] {
                best[l] = f;
                hi[l] = i as u32;
                hd[l] = d;
                hf[l] = 1;
            }
            let (alt, ad) = if d == 1 {
                if c0 <= c2 {
                    (c0, 0)
                } else {
                    (c2, 2)
                }
            } else {
                (c1, 1)
            };
            if alt - cd < best[l] {
                best[l] = alt - cd;
                hi[l] = i as u32;
                hd[l] = ad;
                hf[l] = 0;
            }
        }
    }
    let mut code = [NONE; LANES];
    for l in 0..LANES {
        let mut flip = 0u32;
        let mut key = 0usize;
        if par[l] == 1 {
            tot[l] += best[l];
            if hf[l] == 1 {
                flip = 1 << hi[l];
            } else {
                dig[hi[l] as usize][l] = hd[l];
            }
        }
        for dg in &dig {
            key = key * 3 + dg[l] as usize;
        }
        let g = PATTERN_INDEX[key];
        if g != u16::MAX {
            let odd = PATTERN_DIGITS[g as usize].1 as u32;
            let t = s.neg[l] ^ (odd << 7) ^ flip;
            code[l] = ((g as u32) << 8) | (t ^ s.p);
        }
    }
    (tot, code)
}

/// The dynamic program's table for every lane (`Shift::bounds`).
#[inline(always)]
fn bounds(s: &Block, suf: &mut Suf) {
    suf[8] = [
        [[0.0; LANES]; UNITS + 1],
        [[f32::INFINITY; LANES]; UNITS + 1],
    ];
    for i in (0..8).rev() {
        let mut nx = [[[f32::INFINITY; LANES]; UNITS + 4]; 2];
        for q in 0..2 {
            nx[q][3..].copy_from_slice(&suf[i + 1][q]);
        }
        let mut cur = [[[f32::INFINITY; LANES]; UNITS + 1]; 2];
        for d in 0..3 {
            let u = DIGIT_UNITS[d];
            let plain = &s.cost[i][d];
            let mut flipped = [0f32; LANES];
            for l in 0..LANES {
                flipped[l] = plain[l] + s.pen[i][d][l];
            }
            let p = d & 1;
            for q in 0..2 {
                let (same, other) = (&nx[q ^ p], &nx[q ^ p ^ 1]);
                for b in 0..=UNITS {
                    let (sm, ot) = (&same[b + 3 - u], &other[b + 3 - u]);
                    let c = &mut cur[q][b];
                    for l in 0..LANES {
                        let v = (plain[l] + sm[l]).min(flipped[l] + ot[l]);
                        c[l] = c[l].min(v);
                    }
                }
            }
        }
        suf[i] = cur;
    }
}

/// The nearest norm-≤10 codeword of lane `l` by the traceback (`Shift::best_norm10`).
fn best_norm10(s: &Block, suf: &Suf, l: usize) -> (f32, u16) {
    let np = s.negpar[l] as usize;
    let total = suf[0][np][4][l];
    let (mut q, mut b) = (np, 4usize);
    let mut key = 0usize;
    let mut flips = 0u32;
    for i in 0..8 {
        let mut pick = (f32::INFINITY, 0usize, 0usize);
        for d in 0..3 {
            let u = DIGIT_UNITS[d];
            if u > b {
                continue;
            }
            for flip in 0..2 {
                let c = s.cost[i][d][l] + if flip == 1 { s.pen[i][d][l] } else { 0.0 };
                let v = c + suf[i + 1][q ^ (d & 1) ^ flip][b - u][l];
                if v < pick.0 {
                    pick = (v, d, flip);
                }
            }
        }
        let (_, d, flip) = pick;
        key = key * 3 + d;
        flips |= (flip as u32) << i;
        q ^= (d & 1) ^ flip;
        b -= DIGIT_UNITS[d];
    }
    let g = PATTERN_INDEX[key];
    let odd = PATTERN_DIGITS[g as usize].1 as u32;
    let t = s.neg[l] ^ (odd << 7) ^ flips;
    (total, (g << 8) | (t ^ s.p) as u16)
}

/// Patterns the norm-12 scan evaluates side by side (the 29 norm-12 patterns, padded).
const P12: usize = 32;

/// The norm-12 patterns as masks: bit `k` of `ONE12[i]` is set when pattern
/// `NORM12_FIRST + k` has digit 1 (3/2) at coordinate `i` (their digits are 0 or 1), and
/// `ODD12` has bit `k` set when its coordinate sum is odd.
static MASKS12: std::sync::LazyLock<([u32; 8], u32)> = std::sync::LazyLock::new(|| {
    let mut one = [0u32; 8];
    let mut odd = 0u32;
    for (k, (dg, o)) in PATTERN_DIGITS.iter().skip(NORM12_FIRST).enumerate() {
        for i in 0..8 {
            one[i] |= ((dg[i] == 1) as u32) << k;
        }
        odd |= (*o as u32) << k;
    }
    (one, odd)
});

/// The nearest norm-12 codeword of lane `l` (`Shift::best_norm12`): the same sums in the
/// same order, every pattern at once (one pattern per lane), then the first strictly
/// smallest in pattern order.
#[inline(always)]
fn best_norm12(s: &Block, masks: &([u32; 8], u32), l: usize) -> (f32, u16) {
    let (one, odd) = masks;
    let n12 = PATTERN_DIGITS.len() - NORM12_FIRST;
    let mut tot = [0f32; P12];
    let mut m = [f32::INFINITY; P12];
    let mut fl = [0u32; P12];
    for i in 0..8 {
        let (c0, c1) = (s.cost[i][0][l], s.cost[i][1][l]);
        let (p0, p1) = (s.pen[i][0][l], s.pen[i][1][l]);
        for k in 0..P12 {
            let is1 = (one[i] >> k) & 1 == 1;
            tot[k] += if is1 { c1 } else { c0 };
            let v = if is1 { p1 } else { p0 };
            if v < m[k] {
                m[k] = v;
                fl[k] = 1 << i;
            }
        }
    }
    let np = s.negpar[l];
    let mut best = (f32::INFINITY, 0u16);
    for k in 0..n12 {
        let o = (odd >> k) & 1;
        let (t, flip) = if np ^ o == 1 {
            (tot[k] + m[k], fl[k])
        } else {
            (tot[k], 0)
        };
        if t < best.0 {
            let sb = s.neg[l] ^ (o << 7) ^ flip;
            best = (t, (((NORM12_FIRST + k) as u16) << 8) | (sb ^ s.p) as u16);
        }
    }
    best
}

/// One block: `x`, `w` hold `8 · LANES` values (group-major), `out` `LANES` codes.
#[inline(always)]
fn block(x: &[f32], w: &[f32], out: &mut [u16]) {
    let mut xs = [[0f32; LANES]; 8];
    let mut ws = [[0f32; LANES]; 8];
    for l in 0..LANES {
        for i in 0..8 {
            xs[i][l] = x[8 * l + i];
            ws[i][l] = w[8 * l + i];
        }
    }
    let sh = [new_block(&xs, &ws, 0), new_block(&xs, &ws, 1)];
    let masks = &*MASKS12;
    let r = [relaxed(&sh[0]), relaxed(&sh[1])];
    let mut bv = [f32::INFINITY; LANES];
    let mut bc = [0u16; LANES];
    for (v, c) in &r {
        for l in 0..LANES {
            if c[l] != NONE && v[l] < bv[l] {
                bv[l] = v[l];
                bc[l] = c[l] as u16;
            }
        }
    }
    let mut suf: Suf = [[[[0.0; LANES]; UNITS + 1]; 2]; 9];
    for (s, (v, c)) in sh.iter().zip(&r) {
        let need: [bool; LANES] =
            std::array::from_fn(|l| !(c[l] != NONE || v[l] >= bv[l] || v[l].is_nan()));
        if !need.iter().any(|&n| n) {
            continue;
        }
        bounds(s, &mut suf);
        for l in 0..LANES {
            if !need[l] {
                continue;
            }
            let np = s.negpar[l] as usize;
            if suf[0][np][4][l] < bv[l] {
                let (t, code) = best_norm10(s, &suf, l);
                if t < bv[l] {
                    bv[l] = t;
                    bc[l] = code;
                }
            }
            if suf[0][np][UNITS][l] < bv[l] {
                let (t, code) = best_norm12(s, masks, l);
                if t < bv[l] {
                    bv[l] = t;
                    bc[l] = code;
                }
            }
        }
    }
    out[..LANES].copy_from_slice(&bc);
}

/// Every whole block of `x`, `w` (`n · 8` values) into `out` (`n` codes, `n` a multiple of
/// [`LANES`]).
#[inline(always)]
fn blocks(x: &[f32], w: &[f32], out: &mut [u16]) {
    for ((xb, wb), ob) in x
        .chunks_exact(8 * LANES)
        .zip(w.chunks_exact(8 * LANES))
        .zip(out.chunks_exact_mut(LANES))
    {
        block(xb, wb, ob);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn blocks_avx512(x: &[f32], w: &[f32], out: &mut [u16]) {
    blocks(x, w, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn blocks_avx2(x: &[f32], w: &[f32], out: &mut [u16]) {
    blocks(x, w, out)
}

/// The code path a level runs (what the CPU supports, at most `level`).
fn run_blocks(level: Level, x: &[f32], w: &[f32], out: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    {
        let cpu = keep_kernels::cpu::detected();
        if level >= Level::Avx512 && cpu >= Level::Avx512 {
            // SAFETY: the CPU has AVX-512 F/BW/VL/DQ, AVX2 and FMA (detected above)
            return unsafe { blocks_avx512(x, w, out) };
        }
        if level >= Level::Avx2 && cpu >= Level::Avx2 {
            // SAFETY: the CPU has AVX2 and FMA (detected above)
            return unsafe { blocks_avx2(x, w, out) };
        }
    }
    let _ = level;
    blocks(x, w, out)
}

/// [`super::nearest_e8p_weighted`] of every group: `out[g]` is the code of
/// `x[8g..8g+8]` under weights `w[8g..8g+8]`. Groups past the shortest of `x.len() / 8`,
/// `w.len() / 8` and `out.len()` are left as they are. Runs at `keep_kernels::cpu::level()`.
pub fn nearest_e8p_weighted_many(x: &[f32], w: &[f32], out: &mut [u16]) {
    nearest_e8p_weighted_many_at(keep_kernels::cpu::level(), x, w, out)
}

/// [`nearest_e8p_weighted_many`] at a given level (capped by what the CPU supports):
/// [`Level::Scalar`] runs the one-group search group by group, every other level the lane
/// kernels compiled for it (NEON and levels the CPU lacks: the baseline build). The codes do
/// not depend on the level.
pub fn nearest_e8p_weighted_many_at(level: Level, x: &[f32], w: &[f32], out: &mut [u16]) {
    let n = out.len().min(x.len() / 8).min(w.len() / 8);
    if level == Level::Scalar {
        for (g, o) in out[..n].iter_mut().enumerate() {
            let xg: [f32; 8] = std::array::from_fn(|i| x[8 * g + i]);
            let wg: [f32; 8] = std::array::from_fn(|i| w[8 * g + i]);
            *o = super::nearest_e8p_weighted(xg, wg);
        }
        return;
    }
    let whole = n / LANES * LANES;
    run_blocks(level, &x[..8 * whole], &w[..8 * whole], &mut out[..whole]);
    let rest = n - whole;
    if rest > 0 {
        // the tail, padded with zero groups whose codes are dropped
        let mut xb = [0f32; 8 * LANES];
        let mut wb = [0f32; 8 * LANES];
        let mut ob = [0u16; LANES];
        xb[..8 * rest].copy_from_slice(&x[8 * whole..8 * n]);
        wb[..8 * rest].copy_from_slice(&w[8 * whole..8 * n]);
        run_blocks(level, &xb, &wb, &mut ob);
        out[whole..n].copy_from_slice(&ob[..rest]);
    }
}
