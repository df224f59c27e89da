//! Cache-blocked bf16 GEMM for prefill (AVX-512 BF16 `vdpbf16ps`), on [`super`]'s contract
//! bit for bit. Weight rows are taken [`GEMM_PANEL`] at a time: E4M3 rows are decoded to bf16
//! once (bf16 rows are read where they lie) with their chunk scales, and the panel stays in
//! L1/L2 while every activation row of the call streams past it. Inside a panel a register
//! tile of `MR` activation rows × `NR` weight rows loads each vector once for the whole tile;
//! each (activation row, weight row) pair keeps the contract's four accumulator sets, chunk
//! `c` into set `c mod 4`, and ends with the row kernel's reduction.
#![allow(clippy::incompatible_msrv)]
// Indexed loops mirror the contract's accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::x86::{bh, chunk_scales_avx512, decode_row, finish, has_vbmi};
use super::{Bf16Acts, BfSrc, CHUNK, GEMM_PANEL};

/// Activation rows per register tile.
const MR: usize = 3;
/// Weight rows per register tile.
const NR: usize = 2;

/// One thread's decoded panel.
#[derive(Default)]
struct Panel {
    /// `GEMM_PANEL × cols` bf16 weights (FP8 rows).
    w: Vec<u16>,
    /// `GEMM_PANEL × cols/32` chunk scales.
    s: Vec<f32>,
}

thread_local! {
    static PANEL: std::cell::RefCell<Panel> = std::cell::RefCell::new(Panel::default());
}

/// Rows `r0..r1` of the product (see [`super::rows_at`]).
///
/// # Safety
/// The CPU has AVX-512 F/BW/BF16; `out` as in [`super::rows_at`]; `src` checked for the shape.
pub(super) unsafe fn gemm_bf16(
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    if has_vbmi() {
        gemm_vbmi(src, a, r0, r1, out, ld)
    } else {
        gemm_plain(src, a, r0, r1, out, ld)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vbmi,avx2,fma")]
unsafe fn gemm_vbmi(src: &BfSrc, a: &Bf16Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    gemm_impl::<true>(src, a, r0, r1, out, ld)
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn gemm_plain(src: &BfSrc, a: &Bf16Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    gemm_impl::<false>(src, a, r0, r1, out, ld)
}

#[inline(always)]
unsafe fn gemm_impl<const VBMI: bool>(
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let cols = a.cols;
    let nc = cols / CHUNK;
    let mut p = PANEL.with(|c| c.take());
    p.w.resize(GEMM_PANEL * cols, 0);
    p.s.resize(GEMM_PANEL * nc, 0.0);
    let mut wp = [std::ptr::null::<u16>(); GEMM_PANEL];
    let mut p0 = r0;
    let mut scaled = false;
    while p0 < r1 {
        let np = GEMM_PANEL.min(r1 - p0);
        for k in 0..np {
            let r = p0 + k;
            wp[k] = match *src {
                BfSrc::Bf16(b) => b.as_ptr().add(2 * r * cols) as *const u16,
                BfSrc::Mxfp8 { q, .. } | BfSrc::Fp8Block { q, .. } => {
                    let dst = p.w.as_mut_ptr().add(k * cols);
                    decode_row::<VBMI>(q.as_ptr().add(r * cols), nc, dst);
                    dst
                }
            };
            scaled = chunk_scales_avx512(src, r, cols, &mut p.s[k * nc..(k + 1) * nc]);
        }
        let mut i = 0;
        while i < a.m {
            let mr = MR.min(a.m - i);
            let mut k = 0;
            while k < np {
                let nr = NR.min(np - k);
                let tile = Tile {
                    a,
                    w: &wp[k..k + nr],
                    s: p.s.as_ptr().add(k * nc),
                    scaled,
                    i,
                    row: p0 + k,
                    out,
                    ld,
                };
                match (mr, nr) {
                    (3, 2) => tile.run::<3, 2>(),
                    (2, 2) => tile.run::<2, 2>(),
                    (1, 2) => tile.run::<1, 2>(),
                    (3, _) => tile.run::<3, 1>(),
                    (2, _) => tile.run::<2, 1>(),
                    _ => tile.run::<1, 1>(),
                }
                k += nr;
            }
            i += mr;
        }
        p0 += np;
    }
    PANEL.with(|c| c.replace(p));
}

/// One register tile: activation rows `i..i+M` against the weight rows `w` (`N` of them).
struct Tile<'s> {
    a: &'s Bf16Acts,
    w: &'s [*const u16],
    /// Chunk scales of the tile's first weight row (the next follow every `cols/32`).
    s: *const f32,
    scaled: bool,
    i: usize,
    row: usize,
    out: *mut f32,
    ld: usize,
}

impl Tile<'_> {
    #[inline(always)]
    unsafe fn run<const M: usize, const N: usize>(&self) {
        let a = self.a;
        let cols = a.cols;
        let nc = cols / CHUNK;
        let mut x = [std::ptr::null::<u16>(); M];
        for j in 0..M {
            x[j] = a.x.as_ptr().add((self.i + j) * cols);
        }
        let mut acc = [[[_mm512_setzero_ps(); 4]; M]; N];
        let full = nc / 4 * 4;
        let mut c = 0;
        while c < full {
            for set in 0..4 {
                self.chunk::<M, N>(&x, c + set, set, &mut acc);
            }
            c += 4;
        }
        for set in 0..4 {
            if full + set < nc {
                self.chunk::<M, N>(&x, full + set, set, &mut acc);
            }
        }
        for r in 0..N {
            for j in 0..M {
                *self.out.add((self.i + j) * self.ld + self.row + r) = finish(acc[r][j]);
            }
        }
    }

    /// Chunk `c` into accumulator set `set` (`c mod 4`) of every pair of the tile.
    #[inline(always)]
    unsafe fn chunk<const M: usize, const N: usize>(
        &self,
        x: &[*const u16; M],
        c: usize,
        set: usize,
        acc: &mut [[[__m512; 4]; M]; N],
    ) {
        let nc = self.a.cols / CHUNK;
        let mut xv = [_mm512_setzero_si512(); M];
        for j in 0..M {
            xv[j] = _mm512_loadu_si512(x[j].add(CHUNK * c) as *const __m512i);
        }
        for r in 0..N {
            let wv = bh(_mm512_loadu_si512(
                self.w[r].add(CHUNK * c) as *const __m512i
            ));
            if self.scaled {
                let sv = _mm512_set1_ps(*self.s.add(r * nc + c));
                for j in 0..M {
                    let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv, bh(xv[j]));
                    acc[r][j][set] = _mm512_fmadd_ps(sv, blk, acc[r][j][set]);
                }
            } else {
                for j in 0..M {
                    acc[r][j][set] = _mm512_dpbf16_ps(acc[r][j][set], wv, bh(xv[j]));
                }
            }
        }
    }
}
