//! AVX2+FMA(+F16C) decode-and-dot: each format's 16-column chunk is decoded into two 8-lane
//! registers (exact f32 weight values, the same as `WeightView::decode_row`) and multiply-added
//! into accumulator pair `chunk mod 4` of the input row (the order of `simd::dot`, so results
//! are bit-identical to the other levels).

use std::arch::x86_64::*;

use super::{affine_groups, affine_param, e8m0_x256, scale_x256, Src};
use crate::codec::e8m0_to_f32;
use crate::rows::block_scale;
use crate::weight::BlockScales;

/// Decodes 16 consecutive weights of row `r` starting at column `k` (`k % 16 == 0`).
trait Dec {
    /// Decoding is a plain load (f32): rows of M > 1 read the weights directly rather than
    /// through [`block_buf`]'s buffer.
    const PLAIN: bool = false;
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256);
    /// Ask the cache for the weight bytes of row `r`'s 64 columns from `k` on, [`PREFETCH`]
    /// bytes ahead (the M = 1 loop, once per 64 columns; nothing by default).
    #[inline(always)]
    unsafe fn prefetch(&self, _r: usize, _k: usize) {}
}

/// Bytes ahead of the weights read that [`Dec::prefetch`] asks for (as the AVX-512 kernels
/// do): rows larger than the caches stream from memory, and the hardware prefetcher alone
/// leaves the loop waiting on them.
const PREFETCH: usize = 2048;

/// [`PREFETCH`] bytes ahead of `bytes` bytes at `p`, one request per cache line.
#[inline(always)]
unsafe fn prefetch_lines(p: *const u8, bytes: usize) {
    let mut o = 0;
    while o < bytes {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + o) as *const i8);
        o += 64;
    }
}

#[inline(always)]
unsafe fn hsum(a0: __m256, a1: __m256) -> f32 {
    let b = _mm256_add_ps(a0, a1);
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// 16 E4M3FN bytes → two registers of f32 values times 2^-8, exactly, through fp16 (see
/// the AVX-512 path's `e4m3_x2m8`: same bits, F16C conversion, NaN codes patched in).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn e4m3_x2m8(p: *const u8) -> (__m256, __m256) {
    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
    let mag = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
    let h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
        _mm256_slli_epi16(mag, 7),
    );
    let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    let hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    let nan = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F));
    if _mm256_testz_si256(nan, nan) == 1 {
        return (lo, hi);
    }
    let n = _mm256_set1_ps(f32::NAN);
    let ml = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(nan)));
    let mh = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(nan, 1)));
    (_mm256_blendv_ps(lo, n, ml), _mm256_blendv_ps(hi, n, mh))
}

/// `v · s` for a pair from [`e4m3_x2m8`] (one multiply by `s·2^8` when exact and finite).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn times(v: (__m256, __m256), t: f32) -> (__m256, __m256) {
    let t = _mm256_set1_ps(t);
    (_mm256_mul_ps(v.0, t), _mm256_mul_ps(v.1, t))
}

/// `v · s` for a pair from [`e4m3_x2m8`]: see `scale_x256`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn times_scale(v: (__m256, __m256), s: f32) -> (__m256, __m256) {
    match scale_x256(s) {
        Some(t) => {
            let t = _mm256_set1_ps(t);
            (_mm256_mul_ps(v.0, t), _mm256_mul_ps(v.1, t))
        }
        None => {
            let (a, b) = (_mm256_set1_ps(256.0), _mm256_set1_ps(s));
            (
                _mm256_mul_ps(_mm256_mul_ps(v.0, a), b),
                _mm256_mul_ps(_mm256_mul_ps(v.1, a), b),
            )
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

struct F32D(*const f32, usize);
impl Dec for F32D {
    const PLAIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let p = self.0.add(r * self.1 + k);
        (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }
}

struct Bf16D(*const u8, usize);
impl Dec for Bf16D {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let p = self.0.add((r * self.1 + k) * 2) as *const __m128i;
        let a = _mm256_cvtepu16_epi32(_mm_loadu_si128(p));
        let b = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(1)));
        (
            _mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
        )
    }
    #[inline(always)]
    unsafe fn prefetch(&self, r: usize, k: usize) {
        prefetch_lines(self.0.wrapping_add((r * self.1 + k) * 2), 128);
    }
}

struct Mxfp8D(*const u8, *const u8, usize);
impl Dec for Mxfp8D {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let i = r * self.2 + k;
        let b = *self.1.add(i / 32);
        let v = e4m3_x2m8(self.0.add(i));
        match e8m0_x256(b) {
            Some(t) => times(v, t),
            None => times_scale(v, e8m0_to_f32(b)),
        }
    }
    #[inline(always)]
    unsafe fn prefetch(&self, r: usize, k: usize) {
        prefetch_lines(self.0.wrapping_add(r * self.2 + k), 64);
    }
}

struct Mxfp4D(*const u8, *const u8, usize);
impl Dec for Mxfp4D {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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
    #[inline(always)]
    unsafe fn prefetch(&self, r: usize, k: usize) {
        prefetch_lines(self.0.wrapping_add((r * self.2 + k) / 2), 32);
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
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let gc = self.cols.div_ceil(self.bc);
        let s = block_scale(self.scales, ((self.row0 + r) / self.br) * gc + k / self.bc);
        times_scale(e4m3_x2m8(self.q.add(r * self.cols + k)), s)
    }
    #[inline(always)]
    unsafe fn prefetch(&self, r: usize, k: usize) {
        prefetch_lines(self.q.wrapping_add(r * self.cols + k), 64);
    }
}

struct Affine8D<'a>(*const u8, &'a [u8], &'a [u8], usize);
impl Dec for Affine8D<'_> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
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

/// MLX affine 4-bit: codes `(ptr, scales, biases, cols)`, two per byte (element 2k in the low
/// nibble), split into 16 bytes in column order and widened.
struct MlxAffine4D<'a>(*const u8, &'a [u8], &'a [u8], usize);
impl Dec for MlxAffine4D<'_> {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> (__m256, __m256) {
        let g = r * affine_groups(self.3) + k / 64;
        let s = _mm256_set1_ps(affine_param(self.1, g));
        let b = _mm256_set1_ps(affine_param(self.2, g));
        let v = _mm_loadl_epi64(self.0.add((r * self.3 + k) / 2) as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(v, m);
        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
        let c = _mm_unpacklo_epi8(lo, hi);
        // A multiply then an add (two roundings), as the definition says.
        let d = |v: __m128i| {
            _mm256_add_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s),
                b,
            )
        };
        (d(c), d(_mm_srli_si128(c, 8)))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
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
    let full64 = cols / 64 * 64;
    let xp = x.as_ptr().add(i * cols);
    // Four accumulator pairs (16 lanes each) per input row; chunk c goes to pair c mod 4.
    let z = _mm256_setzero_ps();
    let mut lo = [[z; 4]; MR];
    let mut hi = [[z; 4]; MR];
    let mut k = 0;
    while k < full64 {
        d.prefetch(r, k);
        for q in 0..4 {
            let (w0, w1) = d.dec(r, k + 16 * q);
            for j in 0..MR {
                let p = xp.add(j * cols + k + 16 * q);
                lo[j][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p), w0, lo[j][q]);
                hi[j][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), w1, hi[j][q]);
            }
        }
        k += 64;
    }
    let mut q = 0;
    while k < full {
        let (w0, w1) = d.dec(r, k);
        for j in 0..MR {
            let p = xp.add(j * cols + k);
            lo[j][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p), w0, lo[j][q]);
            hi[j][q] = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8)), w1, hi[j][q]);
        }
        q += 1;
        k += 16;
    }
    for j in 0..MR {
        let mut tail = 0f32;
        for c in full..cols {
            tail = x[(i + j) * cols + c].mul_add(src.get(r, c, cols), tail);
        }
        let l = _mm256_add_ps(
            _mm256_add_ps(lo[j][0], lo[j][1]),
            _mm256_add_ps(lo[j][2], lo[j][3]),
        );
        let h = _mm256_add_ps(
            _mm256_add_ps(hi[j][0], hi[j][1]),
            _mm256_add_ps(hi[j][2], hi[j][3]),
        );
        *out.add((i + j) * ld + r) = hsum(l, h) + tail;
    }
}

/// Columns per [`block_buf`] step: 1 KiB of decoded weights, with up to four input rows'
/// 1 KiB slices, stays in L1.
const CHUNK: usize = 256;

/// [`block`] for `MR` (2..=4) input rows with each 16-column chunk decoded once: the weights
/// of `CHUNK` columns are decoded into a buffer, then each input row multiply-adds them into
/// its own eight accumulators (kept in memory between steps; eight per row fill half the
/// ymm registers, so the rows take turns). Chunk `c` still goes to pair `c mod 4` of each row
/// in column order (`CHUNK` is a multiple of 64): the same FMAs in the same order as
/// [`block`], bit for bit.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn block_buf<D: Dec, const MR: usize>(
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
    let z = _mm256_setzero_ps();
    // acc[j][q] = (lo, hi) of pair q of input row j.
    let mut acc = [[(z, z); 4]; MR];
    let mut buf = [z; CHUNK / 8];
    let mut k0 = 0;
    while k0 < full {
        let n = (full - k0).min(CHUNK);
        let mut k = 0;
        while k < n {
            let (w0, w1) = d.dec(r, k0 + k);
            buf[k / 8] = w0;
            buf[k / 8 + 1] = w1;
            k += 16;
        }
        let n64 = n / 64 * 64;
        for j in 0..MR {
            let mut a = acc[j];
            let p = xp.add(j * cols + k0);
            let mut k = 0;
            while k < n64 {
                for q in 0..4 {
                    let kk = k + 16 * q;
                    a[q].0 = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(kk)), buf[kk / 8], a[q].0);
                    a[q].1 =
                        _mm256_fmadd_ps(_mm256_loadu_ps(p.add(kk + 8)), buf[kk / 8 + 1], a[q].1);
                }
                k += 64;
            }
            let mut q = 0;
            while k < n {
                a[q].0 = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(k)), buf[k / 8], a[q].0);
                a[q].1 = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(k + 8)), buf[k / 8 + 1], a[q].1);
                q += 1;
                k += 16;
            }
            acc[j] = a;
        }
        k0 += CHUNK;
    }
    for j in 0..MR {
        let mut tail = 0f32;
        for c in full..cols {
            tail = x[(i + j) * cols + c].mul_add(src.get(r, c, cols), tail);
        }
        let a = &acc[j];
        let l = _mm256_add_ps(_mm256_add_ps(a[0].0, a[1].0), _mm256_add_ps(a[2].0, a[3].0));
        let h = _mm256_add_ps(_mm256_add_ps(a[0].1, a[1].1), _mm256_add_ps(a[2].1, a[3].1));
        *out.add((i + j) * ld + r) = hsum(l, h) + tail;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
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
            // Up to four input rows per decoded chunk (through a buffer: eight accumulator
            // registers per input row fill half the 16 ymm registers).
            let mr = if D::PLAIN { 1 } else { (m - i).min(4) };
            match mr {
                1 => block::<D, 1>(d, src, cols, x, i, r, out, ld),
                2 => block_buf::<D, 2>(d, src, cols, x, i, r, out, ld),
                3 => block_buf::<D, 3>(d, src, cols, x, i, r, out, ld),
                _ => block_buf::<D, 4>(d, src, cols, x, i, r, out, ld),
            }
            i += mr;
        }
    }
}

/// Rows `r0..r1` of `out[i*ld + r] = x[i] · W[r]`.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `src` holds at least `r1` rows of `cols` (its lengths checked by
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
        // never taken: `simd_ok` sends E8P to the scalar path
        Src::E8p { .. } | Src::Registered(_) => {
            super::rows_scalar(src, cols, x, m, r0, r1, out, ld)
        }
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
        Src::MlxAffine {
            bits: 4,
            q,
            scales,
            biases,
        } => rows_g(
            &MlxAffine4D(q.as_ptr(), scales, biases, cols),
            src,
            cols,
            x,
            m,
            r0,
            r1,
            out,
            ld,
        ),
        // never taken: `simd_ok` sends 2- and 3-bit codes to the scalar path
        Src::MlxAffine { .. } => super::rows_scalar(src, cols, x, m, r0, r1, out, ld),
    }
}
