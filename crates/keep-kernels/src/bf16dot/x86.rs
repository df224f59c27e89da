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

/// The low and high bytes of the E4M3 magnitude → bf16 table, each 128 bytes in two
/// registers (for `vpermi2b`, which indexes 128 bytes by the low 7 bits of each byte).
#[inline(always)]
pub(super) unsafe fn byte_tables() -> [__m512i; 4] {
    static T: std::sync::LazyLock<[[u8; 128]; 2]> = std::sync::LazyLock::new(|| {
        let t = &*E4M3_BF16;
        [
            std::array::from_fn(|m| t[m] as u8),
            std::array::from_fn(|m| (t[m] >> 8) as u8),
        ]
    });
    let t = &*T;
    [
        _mm512_loadu_si512(t[0].as_ptr() as *const __m512i),
        _mm512_loadu_si512(t[0].as_ptr().add(64) as *const __m512i),
        _mm512_loadu_si512(t[1].as_ptr() as *const __m512i),
        _mm512_loadu_si512(t[1].as_ptr().add(64) as *const __m512i),
    ]
}

/// 64 E4M3 bytes at `p` → 64 bf16 in two registers (columns 0..32 and 32..64), by AVX-512
/// VBMI: the bytes reordered once (`vpermb`) so that the in-lane byte interleave below
/// yields natural order, the low and high bf16 bytes looked up (`vpermi2b` on the 7-bit
/// magnitude), the sign bit or-ed into the high byte, and the two interleaved
/// (`vpunpck{l,h}bw`). The same values as [`decode32`] (tested on every code).
#[inline(always)]
pub(super) unsafe fn decode64_vbmi(t: &[__m512i; 4], p: *const u8) -> [__m512i; 2] {
    // Byte 16L + e of the reordered vector is input byte 8L + e (e < 8) or 32 + 8L + (e − 8).
    let idx = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24, 55, 54, 53, 52, 51, 50, 49,
        48, 23, 22, 21, 20, 19, 18, 17, 16, 47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10,
        9, 8, 39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0,
    );
    let b = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(p as *const __m512i));
    let lo = _mm512_permutex2var_epi8(t[0], b, t[1]);
    let hi = _mm512_permutex2var_epi8(t[2], b, t[3]);
    // hi | (b & 0x80)
    let hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8(-128), 0xF8);
    [_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)]
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

/// Whether the CPU has AVX-512 VBMI (the faster E4M3 decode, [`decode64_vbmi`]).
pub(super) fn has_vbmi() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
}

/// E4M3 row `qp` (`nc` chunks) decoded to bf16 at `dst`.
#[inline(always)]
pub(super) unsafe fn decode_row<const VBMI: bool>(qp: *const u8, nc: usize, dst: *mut u16) {
    let mut c = 0;
    if VBMI {
        let bt = byte_tables();
        while c + 2 <= nc {
            let [v0, v1] = decode64_vbmi(&bt, qp.add(CHUNK * c));
            _mm512_storeu_si512(dst.add(CHUNK * c) as *mut __m512i, v0);
            _mm512_storeu_si512(dst.add(CHUNK * (c + 1)) as *mut __m512i, v1);
            c += 2;
        }
    }
    let t = tables();
    while c < nc {
        let v = decode32(&t, qp.add(CHUNK * c));
        _mm512_storeu_si512(dst.add(CHUNK * c) as *mut __m512i, v);
        c += 1;
    }
}

/// [`BfSrc::chunk_scales`] with MXFP8's E8M0 bytes 16 at a time (`2^(e−127)`: the exponent
/// field, byte 0 the subnormal 2^-127, 0xFF NaN; the same values, tested).
#[inline(always)]
pub(super) unsafe fn chunk_scales_avx512(
    src: &BfSrc,
    r: usize,
    cols: usize,
    dst: &mut [f32],
) -> bool {
    let BfSrc::Mxfp8 { scales, .. } = *src else {
        return src.chunk_scales(r, cols, dst);
    };
    let nc = cols / CHUNK;
    let e = scales.as_ptr().add(r * nc);
    let mut c = 0;
    while c + 16 <= nc {
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(e.add(c) as *const __m128i));
        let mut bits = _mm512_slli_epi32(v, 23);
        let k0 = _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512());
        let kf = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(0xFF));
        bits = _mm512_mask_mov_epi32(bits, k0, _mm512_set1_epi32(0x0040_0000));
        bits = _mm512_mask_mov_epi32(bits, kf, _mm512_set1_epi32(f32::NAN.to_bits() as i32));
        _mm512_storeu_si512(dst.as_mut_ptr().add(c) as *mut __m512i, bits);
        c += 16;
    }
    for (o, &b) in dst[c..nc].iter_mut().zip(&scales[r * nc + c..(r + 1) * nc]) {
        *o = crate::codec::e8m0_to_f32(b);
    }
    true
}

/// Rows `r0..r1` (see [`super::rows_at`]).
///
/// # Safety
/// The CPU has AVX-512 F/BW/BF16; `out` as in [`super::rows_at`]; `src` checked for the shape.
pub(super) unsafe fn rows_avx512bf16(
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    if has_vbmi() {
        rows_vbmi(src, a, r0, r1, out, ld)
    } else {
        rows_plain(src, a, r0, r1, out, ld)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vbmi,avx2,fma")]
unsafe fn rows_vbmi(src: &BfSrc, a: &Bf16Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    rows_impl::<true>(src, a, r0, r1, out, ld)
}

#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn rows_plain(src: &BfSrc, a: &Bf16Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    rows_impl::<false>(src, a, r0, r1, out, ld)
}

#[inline(always)]
unsafe fn rows_impl<const VBMI: bool>(
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let cols = a.cols;
    let nc = cols / CHUNK;
    if let (BfSrc::Bf16(b), 1) = (*src, a.m) {
        bf16_rows_m1(b.as_ptr() as *const u16, cols, a.x.as_ptr(), r0, r1, out);
        return;
    }
    let mut s = SCRATCH.with(|c| c.take());
    s.w.resize(cols, 0);
    s.s.resize(nc, 0.0);
    // The block row whose scales `s.s` holds (FP8-block rows of one block row share them).
    let mut have: Option<usize> = None;
    for r in r0..r1 {
        let key = src.scale_row(r);
        let scaled = if key.is_some() && key == have {
            true
        } else {
            have = key;
            chunk_scales_avx512(src, r, cols, &mut s.s)
        };
        if VBMI && a.m == 1 && scaled {
            if let BfSrc::Mxfp8 { q, .. } | BfSrc::Fp8Block { q, .. } = *src {
                let v = row_m1_fused(q.as_ptr().add(r * cols), a.x.as_ptr(), s.s.as_ptr(), nc);
                *out.add(r) = v;
                continue;
            }
        }
        let wp: *const u16 = match *src {
            BfSrc::Bf16(b) => b.as_ptr().add(2 * r * cols) as *const u16,
            BfSrc::Mxfp8 { q, .. } | BfSrc::Fp8Block { q, .. } => {
                decode_row::<VBMI>(q.as_ptr().add(r * cols), nc, s.w.as_mut_ptr());
                s.w.as_ptr()
            }
        };
        let sp = if scaled { Some(s.s.as_ptr()) } else { None };
        let mut i = 0;
        while i < a.m {
            let mr = (a.m - i).min(4);
            let o = out.add(i * ld + r);
            match mr {
                1 => rows_mr::<1>(wp, a, i, nc, sp, o, ld),
                2 => rows_mr::<2>(wp, a, i, nc, sp, o, ld),
                3 => rows_mr::<3>(wp, a, i, nc, sp, o, ld),
                _ => rows_mr::<4>(wp, a, i, nc, sp, o, ld),
            }
            i += mr;
        }
    }
    SCRATCH.with(|c| c.replace(s));
}

/// One weight row (bf16 at `wp`, `nc` chunks; `sp`: the chunk scales of a scaled row)
/// against the `MR` (1..=4) input rows `i..i + MR` of `a`, each chunk of weights loaded once
/// for all of them; every input row's four accumulator chains are exactly the contract's (so
/// the same bits as one row at a time, with `4·MR` independent chains in flight). Output `j`
/// goes to `out[j · ld]`.
///
/// # Safety
/// AVX-512 F/BW/BF16; `wp` holds `32·nc` bf16 and `sp` (when given) `nc` scales; `a` has rows
/// `i..i + MR`; `out` valid for writes at `j · ld` for `j < MR`.
// Not inlined: inside the row loop it made the M = 1 fused MXFP8 row beside it 20% slower.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma")]
unsafe fn rows_mr<const MR: usize>(
    wp: *const u16,
    a: &Bf16Acts,
    i: usize,
    nc: usize,
    sp: Option<*const f32>,
    out: *mut f32,
    ld: usize,
) {
    let cols = a.cols;
    let xp: [*const u16; MR] = std::array::from_fn(|j| a.x.as_ptr().add((i + j) * cols));
    let mut acc = [[_mm512_setzero_ps(); 4]; MR];
    let full = nc / 4 * 4;
    match sp {
        Some(sp) => {
            let mut c = 0;
            while c < full {
                for k in 0..4 {
                    let (w, sc) = (ld16(wp, c + k), _mm512_set1_ps(*sp.add(c + k)));
                    for j in 0..MR {
                        let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, ld16(xp[j], c + k));
                        acc[j][k] = _mm512_fmadd_ps(sc, blk, acc[j][k]);
                    }
                }
                c += 4;
            }
            for c in full..nc {
                let (w, sc) = (ld16(wp, c), _mm512_set1_ps(*sp.add(c)));
                for j in 0..MR {
                    let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, ld16(xp[j], c));
                    acc[j][c % 4] = _mm512_fmadd_ps(sc, blk, acc[j][c % 4]);
                }
            }
        }
        None => {
            let mut c = 0;
            while c < full {
                for k in 0..4 {
                    let w = ld16(wp, c + k);
                    for j in 0..MR {
                        acc[j][k] = _mm512_dpbf16_ps(acc[j][k], w, ld16(xp[j], c + k));
                    }
                }
                c += 4;
            }
            for c in full..nc {
                let w = ld16(wp, c);
                for j in 0..MR {
                    acc[j][c % 4] = _mm512_dpbf16_ps(acc[j][c % 4], w, ld16(xp[j], c));
                }
            }
        }
    }
    for j in 0..MR {
        *out.add(j * ld) = finish(acc[j]);
    }
}

/// Bytes ahead of the weights read that [`bf16_rows_m1`] and [`row_m1_fused`] ask the cache
/// for.
const PREFETCH: usize = 2048;

/// bf16 rows `r0..r1` of `w` (`cols` wide) against one input row `xp`, written to
/// `out[r]`: one row at a time, its four accumulator chains exactly the contract's unscaled
/// form. Consecutive rows are consecutive in memory, so the weights stream in order: on one
/// thread a 151,936×2048 matrix read 22–25 GB/s this way against 17 with four rows
/// interleaved (four streams a row apart), and a cache-resident 4096×2048 one 50 against 38
/// GB/s (`keep bench matmul --format bf16 --m 1 --threads 1`, the two built side by side and
/// run alternately). Each step of four chunks asks for the four cache lines [`PREFETCH`]
/// bytes ahead, as the exact bf16 kernel does: a matrix larger than the caches (a head) is
/// read faster that way, one that fits them as fast (`dev/matmul-two-builds.sh`, evidence
/// `bf16-m1-prefetch.json`).
///
/// # Safety
/// AVX-512 F/BW/BF16; `w` holds `r1` rows of `cols` (a multiple of 32) bf16, `xp` `cols`
/// bf16, `out` valid for writes at `r0..r1`.
#[inline(always)]
unsafe fn bf16_rows_m1(
    w: *const u16,
    cols: usize,
    xp: *const u16,
    r0: usize,
    r1: usize,
    out: *mut f32,
) {
    let nc = cols / CHUNK;
    let full = nc / 4 * 4;
    for r in r0..r1 {
        let wp = w.add(r * cols);
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut c = 0;
        while c < full {
            let p = wp.add(CHUNK * c) as *const i8;
            for l in 0..4 {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH + 64 * l));
            }
            for k in 0..4 {
                acc[k] = _mm512_dpbf16_ps(acc[k], ld16(wp, c + k), ld16(xp, c + k));
            }
            c += 4;
        }
        for c in full..nc {
            acc[c % 4] = _mm512_dpbf16_ps(acc[c % 4], ld16(wp, c), ld16(xp, c));
        }
        *out.add(r) = finish(acc);
    }
}

/// One input row against one scaled E4M3 row (`nc` chunks), decoded in registers 64 bytes
/// at a time ([`decode64_vbmi`]) and dotted at once, without the row buffer: the contract's
/// scaled form, operation for operation as the buffered loop (so the same bits).
///
/// # Safety
/// AVX-512 F/BW/BF16/VBMI; `qp` holds `32·nc` bytes, `xp` `32·nc` bf16, `sp` `nc` scales.
#[inline(always)]
unsafe fn row_m1_fused(qp: *const u8, xp: *const u16, sp: *const f32, nc: usize) -> f32 {
    let bt = byte_tables();
    let mut acc = [_mm512_setzero_ps(); 4];
    let full = nc / 4 * 4;
    let mut c = 0;
    while c < full {
        let ahead = qp.add(CHUNK * c) as *const i8;
        for l in 0..2 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(PREFETCH + 64 * l));
        }
        for h in [0, 2] {
            let [w0, w1] = decode64_vbmi(&bt, qp.add(CHUNK * (c + h)));
            for (k, w) in [(h, w0), (h + 1, w1)] {
                let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), bh(w), ld16(xp, c + k));
                acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(*sp.add(c + k)), blk, acc[k]);
            }
        }
        c += 4;
    }
    let t = tables();
    for c in full..nc {
        let w = decode32(&t, qp.add(CHUNK * c));
        let blk = _mm512_dpbf16_ps(_mm512_setzero_ps(), bh(w), ld16(xp, c));
        acc[c % 4] = _mm512_fmadd_ps(_mm512_set1_ps(*sp.add(c)), blk, acc[c % 4]);
    }
    finish(acc)
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

/// Both E4M3 row decoders and the vector chunk scales (for the tests).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VBMI; `qp` holds `nc` chunks, `dst` room for them.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma")]
pub(super) unsafe fn decode_row_test(vbmi: bool, qp: *const u8, nc: usize, dst: *mut u16) {
    if vbmi {
        decode_row::<true>(qp, nc, dst)
    } else {
        decode_row::<false>(qp, nc, dst)
    }
}

/// [`chunk_scales_avx512`] (for the tests).
///
/// # Safety
/// The CPU has AVX-512 F/BW.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
pub(super) unsafe fn chunk_scales_test(
    src: &BfSrc,
    r: usize,
    cols: usize,
    dst: &mut [f32],
) -> bool {
    chunk_scales_avx512(src, r, cols, dst)
}
