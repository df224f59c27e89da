//! Cache-blocked integer GEMM for prefill (AVX-512 VNNI), on [`super`]'s contract bit for
//! bit. Weight rows are taken [`GEMM_PANEL`] at a time: each is decoded once to int8 (with
//! its block factors, the exact `−128·Σw` of every four columns and, for affine-8 and
//! affine-4, its per-block bias coefficients) into a per-thread panel that stays in L1/L2
//! while every activation row of the call streams past it. Inside a panel a register tile of `MR`
//! activation rows × `NR` weight rows loads each activation vector once for `NR` weight rows
//! and each weight vector once for `MR` activation rows.
//!
//! The activations enter `vpdpbusd` as unsigned bytes `q + 128` (a xor of the sign bit) and
//! the weights as signed bytes, so no per-pair sign trick is needed: `Σ (q+128)·w` started at
//! `−128·Σw` is exactly `Σ q·w` (|terms| ≤ 4·255·128, far inside i32). The float part (the
//! block coefficient `f_b · d_b`, one FMA per block into the contract's four 8-lane
//! accumulators, the fixed reduction tree, the scalar tail blocks, the row factor and the
//! affine-8 bias term) is the row kernels' own, so each result equals theirs.
#![allow(clippy::incompatible_msrv)]
// Indexed loops mirror the contract's accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::x86::{bias_avx512, bias_lanes, reduce8, tail_blocks, Row};
use super::{IntSrc, Q8Acts, GEMM_PANEL, MXFP4_I8, QBLOCK};

/// Activation rows per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
const NR: usize = 2;

/// One thread's decoded panel.
#[derive(Default)]
struct Panel {
    /// `GEMM_PANEL × cols` int8 weights.
    w: Vec<i8>,
    /// `GEMM_PANEL × cols/4` values `−128 · Σ` of four weights.
    corr: Vec<i32>,
    /// `GEMM_PANEL × nb` block factors.
    f: Vec<f32>,
    /// `GEMM_PANEL × nb` affine-8 `β_b`.
    beta: Vec<f32>,
}

thread_local! {
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
}

/// Rows `r0..r1` of the product (see [`super::rows_at`]).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ/VNNI; `out` as in `super::rows_scalar`; `src` holds at
/// least `r1` rows of `a.cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")]
pub(super) unsafe fn gemm_vnni(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let affine = matches!(src, IntSrc::Affine8 { .. });
    let mut p = PANEL.with(|c| c.take());
    p.w.resize(GEMM_PANEL * cols, 0);
    p.corr.resize(GEMM_PANEL * cols / 4, 0);
    p.f.resize(GEMM_PANEL * nb, 0.0);
    if src.has_bias() {
        p.beta.resize(GEMM_PANEL * nb, 0.0);
    }
    let mut p0 = r0;
    while p0 < r1 {
        let np = GEMM_PANEL.min(r1 - p0);
        for k in 0..np {
            if affine {
                super::x86::block_factors_avx512(src, p0 + k, cols, &mut p.f[k * nb..(k + 1) * nb]);
                super::x86::bias_blocks_avx512(
                    src,
                    p0 + k,
                    cols,
                    &mut p.beta[k * nb..(k + 1) * nb],
                );
            } else {
                decode_row(src, p0 + k, cols, &mut p, k);
            }
        }
        let mut i = 0;
        while i < a.m {
            let mr = MR.min(a.m - i);
            let mut k = 0;
            while k < np {
                let nr = NR.min(np - k);
                let t = Tile {
                    src,
                    a,
                    p: &p,
                    i,
                    k,
                    row: p0 + k,
                    out,
                    ld,
                };
                match (mr, nr, affine) {
                    (4, 2, false) => t.run::<4, 2, false>(),
                    (3, 2, false) => t.run::<3, 2, false>(),
                    (2, 2, false) => t.run::<2, 2, false>(),
                    (1, 2, false) => t.run::<1, 2, false>(),
                    (4, _, false) => t.run::<4, 1, false>(),
                    (3, _, false) => t.run::<3, 1, false>(),
                    (2, _, false) => t.run::<2, 1, false>(),
                    (_, _, false) => t.run::<1, 1, false>(),
                    (4, 2, true) => t.run::<4, 2, true>(),
                    (3, 2, true) => t.run::<3, 2, true>(),
                    (2, 2, true) => t.run::<2, 2, true>(),
                    (1, 2, true) => t.run::<1, 2, true>(),
                    (4, _, true) => t.run::<4, 1, true>(),
                    (3, _, true) => t.run::<3, 1, true>(),
                    (2, _, true) => t.run::<2, 1, true>(),
                    (_, _, true) => t.run::<1, 1, true>(),
                }
                k += nr;
            }
            i += mr;
        }
        p0 += np;
    }
    PANEL.with(|c| c.replace(p));
}

/// Decode weight row `r` into panel slot `k`.
#[inline(always)]
unsafe fn decode_row(src: &IntSrc, r: usize, cols: usize, p: &mut Panel, k: usize) {
    let nb = cols / QBLOCK;
    let w = &mut p.w[k * cols..(k + 1) * cols];
    match *src {
        IntSrc::Mxfp4 { packed, .. } => {
            let row = Row::Mx4(packed.as_ptr().add(r * cols / 2));
            let mut c = 0;
            while c + 64 <= cols {
                _mm512_storeu_si512(w.as_mut_ptr().add(c) as *mut __m512i, row.w64(c));
                c += 64;
            }
            let bytes = &packed[r * cols / 2..(r + 1) * cols / 2];
            while c < cols {
                let b = bytes[c / 2];
                w[c] = MXFP4_I8[(b & 0xF) as usize];
                w[c + 1] = MXFP4_I8[(b >> 4) as usize];
                c += 2;
            }
        }
        IntSrc::E8p { codes, .. } => {
            let kc = cols / 8;
            super::x86::decode_e8p_avx512::<false>(codes.as_ptr().add(r * kc), kc, w.as_mut_ptr())
        }
        IntSrc::Affine4 { q, .. } => {
            super::affine4_x86::decode_row_avx512(q.as_ptr().add(r * cols / 2), cols, w)
        }
        _ => src.decode_row_fast(r, cols, w),
    }
    super::x86::block_factors_avx512(src, r, cols, &mut p.f[k * nb..(k + 1) * nb]);
    if src.has_bias() {
        super::x86::bias_blocks_avx512(src, r, cols, &mut p.beta[k * nb..(k + 1) * nb]);
    }
    // −128·Σ of every four weights, for the columns the vector loop covers.
    let full = nb / 4 * 4;
    let ones = _mm512_set1_epi8(-128);
    let corr = p.corr.as_mut_ptr().add(k * cols / 4);
    let mut c = 0;
    while c < full * QBLOCK {
        let wv = _mm512_loadu_si512(w.as_ptr().add(c) as *const __m512i);
        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, wv);
        _mm512_storeu_si512(
            corr.add(c / 4) as *mut __m512i,
            _mm512_sub_epi32(_mm512_setzero_si512(), s),
        );
        c += 64;
    }
}

/// One register tile: activation rows `i..i+M` against panel slots `k..k+N`.
struct Tile<'s, 'a> {
    src: &'s IntSrc<'a>,
    a: &'s Q8Acts,
    p: &'s Panel,
    i: usize,
    k: usize,
    row: usize,
    out: *mut f32,
    ld: usize,
}

impl Tile<'_, '_> {
    /// `AFF`: affine-8, whose stored bytes `q` are the unsigned operand as they lie (the
    /// integer weight `q − 128` never materialises), the activations the signed one, and
    /// the sums start at the activations' `−128·Σx` ([`Q8Acts::nsum4`]); otherwise the
    /// decoded panel is the signed operand, the activations enter as `q + 128` and the sums
    /// start at the panel's `−128·Σw`.
    #[inline(always)]
    unsafe fn run<const M: usize, const N: usize, const AFF: bool>(&self) {
        let a = self.a;
        let (cols, nb) = (a.cols, a.cols / QBLOCK);
        let full = nb / 4 * 4;
        let q: [*const i8; M] = std::array::from_fn(|j| a.q.as_ptr().add((self.i + j) * cols));
        let d: [*const f32; M] = std::array::from_fn(|j| a.d.as_ptr().add((self.i + j) * nb));
        let mut w = [std::ptr::null::<i8>(); N];
        for r in 0..N {
            w[r] = match (AFF, *self.src) {
                (true, IntSrc::Affine8 { q, .. }) => {
                    q.as_ptr().add((self.row + r) * cols) as *const i8
                }
                _ => self.p.w.as_ptr().add((self.k + r) * cols),
            };
        }
        let ns: [*const i32; M] =
            std::array::from_fn(|j| a.nsum4.as_ptr().add((self.i + j) * cols / 4));
        let cr: [*const i32; N] =
            std::array::from_fn(|r| self.p.corr.as_ptr().add((self.k + r) * cols / 4));
        let f: [*const f32; N] = std::array::from_fn(|r| self.p.f.as_ptr().add((self.k + r) * nb));
        let idx = [
            _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
            _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
        ];
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [[[_mm512_setzero_ps(); 2]; M]; N];
        let mut b = 0;
        while b < full {
            for h in 0..2 {
                let c = b * QBLOCK + 64 * h;
                // Plain loops, no closures: closures do not inherit the target features.
                let mut xu = [_mm512_setzero_si512(); M];
                let mut dv = [_mm512_setzero_ps(); M];
                let mut nv = [_mm512_setzero_si512(); M];
                for j in 0..M {
                    let xv = _mm512_loadu_si512(q[j].add(c) as *const __m512i);
                    if AFF {
                        xu[j] = xv;
                        nv[j] = _mm512_loadu_si512(ns[j].add(c / 4) as *const __m512i);
                    } else {
                        xu[j] = _mm512_xor_si512(xv, flip);
                    }
                    dv[j] = _mm512_permutexvar_ps(
                        idx[h],
                        _mm512_castps128_ps512(_mm_loadu_ps(d[j].add(b))),
                    );
                }
                for r in 0..N {
                    let wv = _mm512_loadu_si512(w[r].add(c) as *const __m512i);
                    let cv = if AFF {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_loadu_si512(cr[r].add(c / 4) as *const __m512i)
                    };
                    let fv = _mm512_permutexvar_ps(
                        idx[h],
                        _mm512_castps128_ps512(_mm_loadu_ps(f[r].add(b))),
                    );
                    for j in 0..M {
                        let s = if AFF {
                            _mm512_dpbusd_epi32(nv[j], wv, xu[j])
                        } else {
                            _mm512_dpbusd_epi32(cv, xu[j], wv)
                        };
                        acc[r][j][h] = _mm512_fmadd_ps(
                            _mm512_mul_ps(fv, dv[j]),
                            _mm512_cvtepi32_ps(s),
                            acc[r][j][h],
                        );
                    }
                }
            }
            b += 4;
        }
        let bias = !self.p.beta.is_empty() && self.src.has_bias();
        if full == nb {
            // Every pair's eight-lane sum `(acc0 + acc2) + (acc1 + acc3)` and, with a bias
            // term, its bias lanes, reduced eight at a time (the same bits as one by one).
            let mut xs = [_mm256_setzero_ps(); 2 * MR * NR];
            let mut n = 0;
            for r in 0..N {
                for j in 0..M {
                    let s = _mm512_add_ps(acc[r][j][0], acc[r][j][1]);
                    xs[n] = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
                    n += 1;
                }
            }
            if bias {
                for r in 0..N {
                    let bb = self.p.beta.as_ptr().add((self.k + r) * nb);
                    for j in 0..M {
                        xs[n] = bias_lanes(bb, a.ds.as_ptr().add((self.i + j) * nb), nb);
                        n += 1;
                    }
                }
            }
            let mut red = [0f32; 2 * MR * NR];
            let mut c = 0;
            while c < n {
                let v = reduce8(std::array::from_fn(|e| xs[c + e]));
                red[c..c + 8].copy_from_slice(&v);
                c += 8;
            }
            for r in 0..N {
                let row = self.row + r;
                let post = self.src.post(row);
                for j in 0..M {
                    let mut s = post.map_or(red[r * M + j], |p| red[r * M + j] * p);
                    if bias {
                        s += red[M * N + r * M + j];
                    }
                    *self.out.add((self.i + j) * self.ld + row) = s;
                }
            }
            return;
        }
        for r in 0..N {
            let row = self.row + r;
            let post = self.src.post(row);
            for j in 0..M {
                let (lo0, hi0) = (
                    _mm512_castps512_ps256(acc[r][j][0]),
                    _mm512_extractf32x8_ps(acc[r][j][0], 1),
                );
                let (lo1, hi1) = (
                    _mm512_castps512_ps256(acc[r][j][1]),
                    _mm512_extractf32x8_ps(acc[r][j][1], 1),
                );
                let s = {
                    let mut v = [[0f32; 8]; 4];
                    _mm256_storeu_ps(v[0].as_mut_ptr(), lo0);
                    _mm256_storeu_ps(v[1].as_mut_ptr(), hi0);
                    _mm256_storeu_ps(v[2].as_mut_ptr(), lo1);
                    _mm256_storeu_ps(v[3].as_mut_ptr(), hi1);
                    let (fr, dj) = (f[r], d[j]);
                    tail_blocks(
                        if AFF {
                            Row::U8(w[r] as *const u8)
                        } else {
                            Row::Buf(w[r])
                        },
                        q[j],
                        |bb| *fr.add(bb) * *dj.add(bb),
                        &mut v,
                        full,
                        nb,
                    );
                    super::finish_ref(&v)
                };
                let mut s = post.map_or(s, |p| s * p);
                if bias {
                    let bb = self.p.beta.as_ptr().add((self.k + r) * nb);
                    s += bias_avx512(bb, a.ds.as_ptr().add((self.i + j) * nb), nb);
                }
                *self.out.add((self.i + j) * self.ld + row) = s;
            }
        }
    }
}
