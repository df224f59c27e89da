//! AVX-512 BF16 level of [`super`]'s contract: E4M3 rows decoded to bf16 32 at a time (bytes
//! widened to 16 bits, magnitudes from a 128-entry table held in four registers by two
//! `vpermi2w` and a blend on bit 6, the sign bit shifted in), then one `vdpbf16ps` per chunk
//! of 32 columns and input row; bf16 rows are read as stored.
#![allow(clippy::incompatible_msrv)]
// Indexed loops mirror the contract's accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{Bf16Acts, BfSrc, CHUNK, E4M3_BF16, SCRATCH};

/// The four 32-entry quarters of the E4M3 magnitude → bf16 table.
#[inline(always)]
pub(super) unsafe fn tables() -> [__m512i; 4] {
    let t = &*E4M3_BF16;
    std::array::from_fn(|k| _mm512_loadu_si512(t.as_ptr().add(32 * k) as *const __m512i))
}

/// 32 E4M3 bytes at `p` → 32 bf16.
#[inline(always)]
pub(super) unsafe fn decode32(t: &[__m512i; 4], p: *const u8) -> __m512i {
    let b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
    let lo = _mm512_permutex2var_epi16(t[0], b, t[1]);
    let hi = _mm512_permutex2var_epi16(t[2], b, t[3]);
    let sel = _mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40));
    let mag = _mm512_mask_mov_epi16(lo, sel, hi);
    let sign = _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8);
    _mm512_or_si512(mag, sign)
}

/// The contract's final reduction.
#[inline(always)]
pub(super) unsafe fn finish(a: [__m512; 4]) -> f32 {
    let acc = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    let u = _mm256_add_ps(_mm512_castps512_ps256(acc), hi);
    let v = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    let t = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)))
}

/// Chunk `c` of a bf16 row (a function, not a closure: closures do not inherit the caller's
/// target features).
#[inline(always)]
unsafe fn ld16(p: *const u16, c: usize) -> __m512bh {
    bh(_mm512_loadu_si512(p.add(CHUNK * c) as *const __m512i))
}

#[inline(always)]
pub(super) unsafe fn bh(v: __m512i) -> __m512bh {
    std::mem::transmute::<__m512i, __m512bh>(v)
}

/// Rows `r0..r1` (see [`super::rows_at`]).
///
/// # Safety
/// The CPU has AVX-512 F/BW/BF16; `out` as in [`super::rows_at`]; `src` checked for the shape.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
pub(super) unsafe fn rows_avx512bf16(
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let cols = a.cols;
    let nc = cols / CHUNK;
    let t = tables();
    let mut s = SCRATCH.with(|c| c.take());
    s.w.resize(cols, 0);
    s.s.resize(nc, 0.0);
    for r in r0..r1 {
        let wp: *const u16 = match *src {
            BfSrc::Bf16(b) => b.as_ptr().add(2 * r * cols) as *const u16,
            BfSrc::Mxfp8 { q, .. } | BfSrc::Fp8Block { q, .. } => {
                let qp = q.as_ptr().add(r * cols);
                for c in 0..nc {
                    let v = decode32(&t, qp.add(CHUNK * c));
                    _mm512_storeu_si512(s.w.as_mut_ptr().add(CHUNK * c) as *mut __m512i, v);
                }
                s.w.as_ptr()
            }
        };
        let scaled = src.chunk_scales(r, cols, &mut s.s);
        for i in 0..a.m {
            let xp = a.x.as_ptr().add(i * cols);
            let mut acc = [_mm512_setzero_ps(); 4];
            let full = nc / 4 * 4;
            if scaled {
                let sp = s.s.as_ptr();
                let mut c = 0;
                while c < full {
                    for k in 0..4 {
                        let blk =
                            _mm512_dpbf16_ps(_mm512_setzero_ps(), ld16(wp, c + k), ld16(xp, c + k));
                        acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(*sp.add(c + k)), blk, acc[k]);
                    }
                    c += 4;
                }
                for c in full..nc {
                    let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), ld16(wp, c), ld16(xp, c));
                    acc[c % 4] = _mm512_fmadd_ps(_mm512_set1_ps(*sp.add(c)), blk, acc[c % 4]);
                }
            } else {
                let mut c = 0;
                while c < full {
                    for k in 0..4 {
                        acc[k] = _mm512_dpbf16_ps(acc[k], ld16(wp, c + k), ld16(xp, c + k));
                    }
                    c += 4;
                }
                for c in full..nc {
                    acc[c % 4] = _mm512_dpbf16_ps(acc[c % 4], ld16(wp, c), ld16(xp, c));
                }
            }
            *out.add(i * ld + r) = finish(acc);
        }
    }
    SCRATCH.with(|c| c.replace(s));
}

/// One `vdpbf16ps` on 16 lanes (for the tests of [`super::dpbf16_ref`]).
///
/// # Safety
/// The CPU has AVX-512 F/BF16.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn dpbf16_hw(acc: [f32; 16], a: [u16; 32], b: [u16; 32]) -> [f32; 16] {
    let r = _mm512_dpbf16_ps(
        _mm512_loadu_ps(acc.as_ptr()),
        bh(_mm512_loadu_si512(a.as_ptr() as *const __m512i)),
        bh(_mm512_loadu_si512(b.as_ptr() as *const __m512i)),
    );
    let mut o = [0f32; 16];
    _mm512_storeu_ps(o.as_mut_ptr(), r);
    o
}
