//! AVX2+FMA decode-and-dot: each format's 16-column chunk is decoded into two 8-lane registers
//! (exact f32 weight values, the same as `WeightView::decode_row`), and multiply-added into two
//! accumulators per input row, up to four input rows per decoded chunk. The reduction and the
//! tail are those of `matmul`'s AVX2 `dot1`, so results are bit-identical to it.

use std::arch::x86_64::*;

use super::{affine_groups, affine_param, block_scale, Src};
use crate::codec::e8m0_to_f32;
use crate::weight::BlockScales;

/// Decodes 16 consecutive weights of row `r` starting at column `k` (`k % 16 == 0`).
trait Dec {
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256);
}

#[inline(always)]
unsafe fn hsum(a0: __m256, a1: __m256) -> f32 {
    let b = _mm256_add_ps(a0, a1);
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// E4M3FN in the low byte of each 32-bit lane → f32 (as `weight::e4m3_bits`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn e4m3(v: __m256i) -> __m256 {
    let sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    let e = _mm256_and_si256(_mm256_srli_epi32(v, 3), _mm256_set1_epi32(0xF));
    let m = _mm256_and_si256(v, _mm256_set1_epi32(7));
    let normal = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
        _mm256_slli_epi32(m, 20),
    );
    let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.0 / 512.0));
    let is0 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    let mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is0);
    let val = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
    let nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(v, _mm256_set1_epi32(0x7F)),
        _mm256_set1_epi32(0x7F),
    ));
    _mm256_blendv_ps(val, _mm256_set1_ps(f32::NAN), nan)
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

struct F32D(*const f32, usize);
impl Dec for F32D {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let p = self.0.add(r * self.1 + k);
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
}

struct Bf16D(*const u8, usize);
impl Dec for Bf16D {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let p = self.0.add((r * self.1 + k) * 2) as *const __m128i;
        let a = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
        let b = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(1)));
        (
            _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
        )
    }
}

struct Mxfp8D(*const u8, *const u8, usize);
impl Dec for Mxfp8D {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let i = r * self.2 + k;
        let s = _mm256_set1_ps(e8m0_to_f32(*self.1.add(i / 32)));
        let p = self.0.add(i);
        (
            _mm256_mul_ps(e4m3(bytes8(p)), s),
            _mm256_mul_ps(e4m3(bytes8(p.add(8))), s),
        )
    }
}

struct Mxfp4D(*const u8, *const u8, usize);
impl Dec for Mxfp4D {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let i = r * self.2 + k;
        let s = _mm256_set1_ps(e8m0_to_f32(*self.1.add(i / 32)));
        let p = self.0.add(i / 2);
        let table = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let nib = |w: u32| {
            let idx = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts),
                _mm256_set1_epi32(0xF),
            );
            let mag = _mm256_permutevar8x32_ps(table, idx);
            let sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
            _mm256_mul_ps(_mm256_or_ps(mag, _mm256_castsi256_ps(sign)), s)
        };
        let w0 = (p as *const u32).read_unaligned();
        let w1 = (p.add(4) as *const u32).read_unaligned();
        (nib(u32::from_le(w0)), nib(u32::from_le(w1)))
    }
}

struct Fp8BlockD<'a> {
    q: *const u8,
    scales: BlockScales<'a>,
    br: usize,
    bc: usize,
    row0: usize,
    cols: usize,
}
impl Dec for Fp8BlockD<'_> {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let gc = self.cols.div_ceil(self.bc);
        let s = _mm256_set1_ps(block_scale(
            self.scales,
            ((self.row0 + r) / self.br) * gc + k / self.bc,
        ));
        let p = self.q.add(r * self.cols + k);
        (
            _mm256_mul_ps(e4m3(bytes8(p)), s),
            _mm256_mul_ps(e4m3(bytes8(p.add(8))), s),
        )
    }
}

struct Affine8D<'a>(*const u8, &'a [u8], &'a [u8], usize);
impl Dec for Affine8D<'_> {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let g = r * affine_groups(self.3) + k / 64;
        let s = _mm256_set1_ps(affine_param(self.1, g));
        let b = _mm256_set1_ps(affine_param(self.2, g));
        let p = self.0.add(r * self.3 + k);
        // A multiply then an add (two roundings), as the definition says.
        let d = |v: __m256i| _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), s), b);
        (d(bytes8(p)), d(bytes8(p.add(8))))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block<D: Dec, const MR: usize>(
    d: &D,
    src: &Src,
    cols: usize,
    x: &[f32],
    i: usize,
    r: usize,
    out: *mut f32,
    ld: usize,
) {
    let full = cols / 16 * 16;
    let xp = x.as_ptr().add(i * cols);
    let mut a0 = [_mm256_setzero_ps(); MR];
    let mut a1 = [_mm256_setzero_ps(); MR];
    let mut k = 0;
    while k < full {
        let (w0, w1) = d.dec(r, k);
        for j in 0..MR {
            let p = xp.add(j * cols + k);
            a0[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p), w0, a0[j]);
            a1[j] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), w1, a1[j]);
        }
        k += 16;
    }
    for j in 0..MR {
        let mut tail = 0f32;
        for c in full..cols {
            tail = x[(i + j) * cols + c].mul_add(src.get(r, c, cols), tail);
        }
        *out.add((i + j) * ld + r) = hsum(a0[j], a1[j]) + tail;
    }
}

#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_g<D: Dec>(
    d: &D,
    src: &Src,
    cols: usize,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    for r in r0..r1 {
        let mut i = 0;
        while i < m {
            match m - i {
                1 => block::<D, 1>(d, src, cols, x, i, r, out, ld),
                2 => block::<D, 2>(d, src, cols, x, i, r, out, ld),
                3 => block::<D, 3>(d, src, cols, x, i, r, out, ld),
                _ => block::<D, 4>(d, src, cols, x, i, r, out, ld),
            }
            i += (m - i).min(4);
        }
    }
}

/// Rows `r0..r1` of `out[i*ld + r] = x[i] · W[r]`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `src` holds at least `r1` rows of `cols` (its lengths checked by
/// the view that made it); `x` has `m*cols` elements; `out` is valid for those writes and
/// nobody else writes them. FP8-block sources need `block_cols % 16 == 0` or
/// `block_cols >= cols`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows(
    src: &Src,
    cols: usize,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    match *src {
        Src::F32(b) => rows_g(
            &F32D(b.as_ptr() as *const f32, cols),
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
        Src::Bf16(b) => rows_g(&Bf16D(b.as_ptr(), cols), src, cols, x, m, r0, r1, out, ld),
        Src::Mxfp8 { q, scales } => rows_g(
            &Mxfp8D(q.as_ptr(), scales.as_ptr(), cols),
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
        Src::Mxfp4 { packed, scales } => rows_g(
            &Mxfp4D(packed.as_ptr(), scales.as_ptr(), cols),
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
        Src::Fp8Block {
            q,
            scales,
            block_rows,
            block_cols,
            row0,
        } => rows_g(
            &Fp8BlockD {
                q: q.as_ptr(),
                scales,
                br: block_rows,
                bc: block_cols,
                row0,
                cols,
            },
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
        Src::Affine8 { q, scales, biases } => rows_g(
            &Affine8D(q.as_ptr(), scales, biases, cols),
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
    }
}
