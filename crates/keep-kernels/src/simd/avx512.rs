//! AVX-512 decode-and-dot: each format's 16-column chunk is decoded into one 16-lane register
//! (exact f32 weight values) and multiply-added into accumulator `chunk mod 4` of each input
//! row, up to four input rows per decoded chunk. Lane `l` of an accumulator holds what the AVX2
//! path's register pair holds in lane `l` (columns `≡ l mod 16`), and the final reduction adds
//! the two 256-bit halves first, as the AVX2 `hsum` adds its pair: the order of `simd::dot`,
//! so results are bit-identical to the other levels.
//!
//! Needs Rust 1.89 (AVX-512 intrinsics were stabilised there); the workspace still declares
//! `rust-version = 1.85`, which should be raised to 1.89 (the lint is silenced here until then).
#![allow(clippy::incompatible_msrv)]

use std::arch::x86_64::*;

use super::{affine_groups, affine_param, block_scale, e8m0_x256, scale_x256, Src};
use crate::codec::e8m0_to_f32;
use crate::weight::BlockScales;

/// Decodes 16 consecutive weights of row `r` starting at column `k` (`k % 16 == 0`).
trait Dec {
    unsafe fn dec(&self, r: usize, k: usize) -> __m512;
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn hsum(a: __m512) -> f32 {
    let b = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// 16 E4M3FN bytes → f32 values times 2^-8, exactly: each byte becomes the fp16 with the
/// same sign, exponent field and mantissa (`(b & 0x80) << 8 | (b & 0x7F) << 7`, an fp16 of
/// value e4m3(b)·2^-8, subnormals included), widened by the hardware conversion (exact, and
/// no microcode assist for subnormal inputs). NaN codes (`0x7F`, `0xFF`) are patched in.
/// Callers multiply by `scale·2^8` ([`scale_x256`]), which rounds the exact product once,
/// exactly as `e4m3(b) · scale` does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn e4m3_x2m8(p: *const u8) -> __m512 {
    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
    let mag = _mm256_and_si256(v, _mm256_set1_epi16(0x7F));
    let h = _mm256_or_si256(
        _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
        _mm256_slli_epi16(mag, 7),
    );
    let f = _mm512_cvtph_ps(h);
    let nan = _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F));
    if nan == 0 {
        f
    } else {
        _mm512_mask_blend_ps(nan, f, _mm512_set1_ps(f32::NAN))
    }
}

/// `v · s` where `v` came from [`e4m3_x2m8`]: one multiply by `s·2^8` when that is exact and
/// finite, else `(v·2^8)·s` (both exact up to the single final rounding).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn times(v: __m512, t: f32) -> __m512 {
    _mm512_mul_ps(v, _mm512_set1_ps(t))
}

/// `v · s` where `v` came from [`e4m3_x2m8`]: see `scale_x256`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn times_scale(v: __m512, s: f32) -> __m512 {
    match scale_x256(s) {
        Some(t) => _mm512_mul_ps(v, _mm512_set1_ps(t)),
        None => _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(256.0)), _mm512_set1_ps(s)),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn bytes16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

struct F32D(*const f32, usize);
impl Dec for F32D {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        _mm512_loadu_ps(self.0.add(r * self.1 + k))
    }
}

struct Bf16D(*const u8, usize);
impl Dec for Bf16D {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let p = self.0.add((r * self.1 + k) * 2) as *const __m256i;
        _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(p)),
            16,
        ))
    }
}

struct Mxfp8D(*const u8, *const u8, usize);
impl Dec for Mxfp8D {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let i = r * self.2 + k;
        let b = *self.1.add(i / 32);
        let v = e4m3_x2m8(self.0.add(i));
        match e8m0_x256(b) {
            Some(t) => times(v, t),
            None => times_scale(v, e8m0_to_f32(b)),
        }
    }
}

struct Mxfp4D(*const u8, *const u8, usize);
impl Dec for Mxfp4D {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let i = r * self.2 + k;
        let s = _mm512_set1_ps(e8m0_to_f32(*self.1.add(i / 32)));
        // Byte j/2 to lane j, then the low nibble for even lanes, the high one for odd.
        let b = _mm_loadl_epi64(self.0.add(i / 2) as *const __m128i);
        let spread = _mm_shuffle_epi8(
            b,
            _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
        );
        let v = _mm512_cvtepu8_epi32(spread);
        let sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        let idx = _mm512_and_si512(_mm512_srlv_epi32(v, sh), _mm512_set1_epi32(0xF));
        let table = _mm512_setr_ps(
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        );
        _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), s)
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
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let gc = self.cols.div_ceil(self.bc);
        let s = block_scale(self.scales, ((self.row0 + r) / self.br) * gc + k / self.bc);
        times_scale(e4m3_x2m8(self.q.add(r * self.cols + k)), s)
    }
}

struct Affine8D<'a>(*const u8, &'a [u8], &'a [u8], usize);
impl Dec for Affine8D<'_> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let g = r * affine_groups(self.3) + k / 64;
        let s = _mm512_set1_ps(affine_param(self.1, g));
        let b = _mm512_set1_ps(affine_param(self.2, g));
        let v = bytes16(self.0.add(r * self.3 + k));
        // A multiply then an add (two roundings), as the definition says.
        _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), s), b)
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
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
    // Four accumulators per input row; chunk c (16 columns) goes to accumulator c mod 4.
    let z = _mm512_setzero_ps();
    let mut a = [[z; 4]; MR];
    let mut k = 0;
    while k < full64 {
        let w = [
            d.dec(r, k),
            d.dec(r, k + 16),
            d.dec(r, k + 32),
            d.dec(r, k + 48),
        ];
        for j in 0..MR {
            let p = xp.add(j * cols + k);
            for q in 0..4 {
                a[j][q] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(16 * q)), w[q], a[j][q]);
            }
        }
        k += 64;
    }
    let mut q = 0;
    while k < full {
        let w = d.dec(r, k);
        for j in 0..MR {
            a[j][q] = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(j * cols + k)), w, a[j][q]);
        }
        q += 1;
        k += 16;
    }
    for j in 0..MR {
        let mut tail = 0f32;
        for c in full..cols {
            tail = x[(i + j) * cols + c].mul_add(src.get(r, c, cols), tail);
        }
        let t = _mm512_add_ps(
            _mm512_add_ps(a[j][0], a[j][1]),
            _mm512_add_ps(a[j][2], a[j][3]),
        );
        *out.add((i + j) * ld + r) = hsum(t) + tail;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
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
/// The CPU has AVX-512 F/BW/VL/DQ, AVX2, FMA and F16C; `src` holds at least `r1` rows of `cols` (its lengths checked by
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
