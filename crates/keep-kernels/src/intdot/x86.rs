//! x86-64 integer dot products of [`super`]'s contract: AVX-512 (`vpdpbusd` with VNNI, else
//! `vpmaddubsw` + `vpmaddwd`) and AVX2 (`vpmaddubsw` + `vpmaddwd`). Signed × signed int8 runs
//! on these unsigned × signed instructions as `|w| · (q · sign(w))` (exact: |q| ≤ 127, and a
//! pair of products stays within i16 since |w| ≤ 128: 2 · 128 · 127 = 32,512; `vpabsb` of
//! −128 is the byte 0x80, read as 128 unsigned). A 512-bit accumulator holds two of the
//! contract's 8-lane accumulators (blocks `b` and `b+1`), a 256-bit one holds one; blocks past
//! the last whole group of four run the contract in scalar code on the same accumulators.
//!
//! MXFP4 weights are decoded in registers (nibbles widened to 16 bits, then a 16-entry
//! `vpshufb` table); E8P rows are first decoded into a row buffer, which then serves every
//! input row (AVX-512: eight codes per step in registers, stored as `w + 128` bytes and then
//! treated as an affine-8 row; AVX2: one load per code from the 512 KiB table); affine-8
//! bytes are read as stored (`q − 128` is one xor in registers, and VNNI multiplies `q`
//! itself as unsigned bytes from the activations' `−128·Σx`). Row factors (E8M0, bf16 scales, `128·s + b`) are computed 16
//! blocks at a time.
#![allow(clippy::incompatible_msrv)]
// Indexed loops mirror the contract's lane and accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{IntSrc, Q8Acts, Scratch, MXFP4_I8, QBLOCK, SCRATCH};
use crate::affine::AFFINE8_GROUP;
use crate::codec::bf16_at;

/// Where a row's integer weights come from.
#[derive(Clone, Copy)]
pub(super) enum Row {
    /// Packed E2M1 bytes of the row.
    Mx4(*const u8),
    /// Decoded int8 weights of the row.
    Buf(*const i8),
    /// Affine-8 bytes `q` of the row as stored (or an E8P row decoded to `w + 128`, the same
    /// form): the integer weight `q − 128` is one xor in
    /// registers, and the VNNI level multiplies `q` itself as unsigned bytes, starting from
    /// the activations' `−128·Σq` ([`Q8Acts::nsum4`]).
    U8(*const u8),
}

impl Row {
    /// Weights `k..k+64` (AVX-512).
    #[inline(always)]
    pub(super) unsafe fn w64(self, k: usize) -> __m512i {
        match self {
            Row::Mx4(p) => {
                let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(k / 2) as *const __m256i));
                let t = _mm512_or_si512(
                    _mm512_and_si512(v, _mm512_set1_epi16(0x000F)),
                    _mm512_and_si512(_mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x0F00)),
                );
                let lut =
                    _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_I8.as_ptr() as *const __m128i));
                _mm512_shuffle_epi8(lut, t)
            }
            Row::Buf(p) => _mm512_loadu_si512(p.add(k) as *const __m512i),
            Row::U8(p) => _mm512_xor_si512(
                _mm512_loadu_si512(p.add(k) as *const __m512i),
                _mm512_set1_epi8(-128),
            ),
        }
    }

    /// Weights `k..k+32` (AVX2).
    #[inline(always)]
    unsafe fn w32(self, k: usize) -> __m256i {
        match self {
            Row::Mx4(p) => {
                let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(k / 2) as *const __m128i));
                let t = _mm256_or_si256(
                    _mm256_and_si256(v, _mm256_set1_epi16(0x000F)),
                    _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x0F00)),
                );
                let l = _mm_loadu_si128(MXFP4_I8.as_ptr() as *const __m128i);
                _mm256_shuffle_epi8(_mm256_set_m128i(l, l), t)
            }
            Row::Buf(p) => _mm256_loadu_si256(p.add(k) as *const __m256i),
            Row::U8(p) => _mm256_xor_si256(
                _mm256_loadu_si256(p.add(k) as *const __m256i),
                _mm256_set1_epi8(-128),
            ),
        }
    }

    /// Weight `k` (scalar tails).
    #[inline(always)]
    unsafe fn w1(self, k: usize) -> i8 {
        match self {
            Row::Mx4(p) => {
                let b = *p.add(k / 2);
                MXFP4_I8[if k.is_multiple_of(2) { b & 0xF } else { b >> 4 } as usize]
            }
            Row::Buf(p) => *p.add(k),
            Row::U8(p) => (*p.add(k) ^ 0x80) as i8,
        }
    }
}

/// The contract's steps 1–2 for blocks `b0..b1` in scalar code (the tails).
#[inline(always)]
pub(super) unsafe fn tail_blocks(
    row: Row,
    q: *const i8,
    c: impl Fn(usize) -> f32,
    acc: &mut [[f32; 8]; 4],
    b0: usize,
    b1: usize,
) {
    for b in b0..b1 {
        let cb = c(b);
        for g in 0..8 {
            let o = QBLOCK * b + 4 * g;
            let mut p = 0i32;
            for e in 0..4 {
                p += row.w1(o + e) as i32 * *q.add(o + e) as i32;
            }
            acc[b % 4][g] = cb.mul_add(p as f32, acc[b % 4][g]);
        }
    }
}

/// `IntSrc::block_factors` 16 blocks at a time (the same values: E8M0 bytes by the
/// exponent field with the three special bytes, bf16 scales widened), scalar for the rest.
///
/// # Safety
/// AVX-512 F/BW; `src` holds row `r` of `cols`.
#[inline(always)]
pub(super) unsafe fn block_factors_avx512(src: &IntSrc, r: usize, cols: usize, dst: &mut [f32]) {
    let nb = cols / QBLOCK;
    let dst = &mut dst[..nb];
    let mut b = 0;
    match *src {
        IntSrc::Mxfp4 { scales, .. } => {
            let e = scales.as_ptr().add(r * nb);
            while b + 16 <= nb {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(e.add(b) as *const __m128i));
                let mut bits = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
                let k0 = _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512());
                let k1 = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(1));
                let kf = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(0xFF));
                bits = _mm512_mask_mov_epi32(bits, k0, _mm512_set1_epi32(0x0020_0000));
                bits = _mm512_mask_mov_epi32(bits, k1, _mm512_set1_epi32(0x0040_0000));
                bits =
                    _mm512_mask_mov_epi32(bits, kf, _mm512_set1_epi32(f32::NAN.to_bits() as i32));
                _mm512_storeu_si512(dst.as_mut_ptr().add(b) as *mut __m512i, bits);
                b += 16;
            }
            for (o, &v) in dst[b..].iter_mut().zip(&scales[r * nb + b..(r + 1) * nb]) {
                *o = super::e8m0_half(v);
            }
        }
        IntSrc::Affine8 { scales, .. } => {
            let sp = (scales.as_ptr() as *const u16).add(r * (cols / AFFINE8_GROUP));
            while b + 16 <= nb {
                _mm512_storeu_ps(dst.as_mut_ptr().add(b), groups16(sp.add(b / 2)));
                b += 16;
            }
            let ng = cols / AFFINE8_GROUP;
            for (bb, o) in dst.iter_mut().enumerate().skip(b) {
                *o = bf16_at(scales, r * ng + bb * QBLOCK / AFFINE8_GROUP);
            }
        }
        IntSrc::E8p { .. } => dst.iter_mut().for_each(|o| *o = 1.0),
    }
}

/// 8 bf16 group values at `p` as f32, each twice (16 blocks of 32 in 8 groups of 64).
#[inline(always)]
unsafe fn groups16(p: *const u16) -> __m512 {
    let g = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)),
        16,
    ));
    let idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(g))
}

/// `IntSrc::bias_blocks` (affine-8) 16 blocks at a time: `128·s + b` in f32 (the product is
/// exact, so this is the scalar code's value), scalar for the rest.
///
/// # Safety
/// AVX-512 F; `src` holds row `r` of `cols`.
#[inline(always)]
pub(super) unsafe fn bias_blocks_avx512(src: &IntSrc, r: usize, cols: usize, dst: &mut [f32]) {
    let IntSrc::Affine8 { scales, biases, .. } = *src else {
        return;
    };
    let nb = cols / QBLOCK;
    let ng = cols / AFFINE8_GROUP;
    let sp = (scales.as_ptr() as *const u16).add(r * ng);
    let bp = (biases.as_ptr() as *const u16).add(r * ng);
    let mut b = 0;
    while b + 16 <= nb {
        let v = _mm512_add_ps(
            _mm512_mul_ps(_mm512_set1_ps(128.0), groups16(sp.add(b / 2))),
            groups16(bp.add(b / 2)),
        );
        _mm512_storeu_ps(dst.as_mut_ptr().add(b), v);
        b += 16;
    }
    for (bb, o) in dst[..nb].iter_mut().enumerate().skip(b) {
        let g = r * ng + bb * QBLOCK / AFFINE8_GROUP;
        *o = 128.0 * bf16_at(scales, g) + bf16_at(biases, g);
    }
}

/// E8P codes `codes[..kc]` decoded to `4 · codeword` int8 at `dst` (the same bytes as
/// [`super::E8P_I8`], tested on every code; `BIASED`: each byte xor 0x80, i.e. the weight
/// plus 128 as an unsigned byte, the form affine-8 rows are stored in, so the row takes the
/// same `vpdpbusd` path from the activations' `−128·Σq`), eight codes (64 weights) per step: the base
/// patterns gathered from the 2 KiB [`super::E8P_BASE4`] (one `vpgatherqq`), the eight sign
/// bytes narrowed into one 64-bit mask (`vpmovwb`) whose parity fix and shift signs come from
/// [`super::e8p_sign_masks`], then one masked negate and one ±1 add. Codes past the last
/// group of eight go through the same masks in scalar code.
///
/// # Safety
/// AVX-512 F/BW/VL; `codes` holds `kc` codes and `dst` room for `8·kc` bytes.
#[inline(always)]
pub(super) unsafe fn decode_e8p_avx512<const BIASED: bool>(
    codes: *const u16,
    kc: usize,
    dst: *mut i8,
) {
    let t = super::E8P_BASE4.as_ptr() as *const i64;
    // The ±1 shift, plus 128 (mod 256) when biased.
    let bias: i8 = if BIASED { -128 } else { 0 };
    let (one, mone) = (
        _mm512_set1_epi8(1i8.wrapping_add(bias)),
        _mm512_set1_epi8((-1i8).wrapping_add(bias)),
    );
    let zero = _mm512_setzero_si512();
    let mut c = 0;
    while c + 8 <= kc {
        let v = _mm_loadu_si128(codes.add(c) as *const __m128i);
        let idx = _mm512_srli_epi64(_mm512_cvtepu16_epi64(v), 8);
        // One gather (8 loads from L1); eight scalar loads and inserts measured slower.
        let base = _mm512_i64gather_epi64::<8>(idx, t);
        let s = _mm_cvtsi128_si64(_mm_cvtepi16_epi8(v)) as u64;
        let (neg, odd) = super::e8p_sign_masks(s);
        let w = _mm512_mask_sub_epi8(base, neg, zero, base);
        let sh = _mm512_mask_blend_epi8(odd, one, mone);
        _mm512_storeu_si512(dst.add(8 * c) as *mut __m512i, _mm512_add_epi8(w, sh));
        c += 8;
    }
    while c < kc {
        let code = *codes.add(c);
        let (neg, odd) = super::e8p_sign_masks(code as u8 as u64);
        let base = super::E8P_BASE4[(code >> 8) as usize].to_le_bytes();
        for i in 0..8 {
            let b = base[i] as i8;
            let w = if (neg >> i) & 1 == 1 { -b } else { b };
            *dst.add(8 * c + i) = (w + if odd & 1 == 1 { -1 } else { 1 }).wrapping_add(bias);
        }
        c += 1;
    }
}

/// [`decode_e8p_avx512`] (for the tests).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL; as [`decode_e8p_avx512`].
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(super) unsafe fn decode_e8p_test(biased: bool, codes: &[u16], dst: &mut [i8]) {
    assert!(dst.len() >= 8 * codes.len());
    if biased {
        decode_e8p_avx512::<true>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
    } else {
        decode_e8p_avx512::<false>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
    }
}

/// Prepare row `r`: the weight source and the block factors in `s.f` (`AVX512`: the
/// vector row factors and E8P decoder; the AVX2 level uses the scalar ones, since AVX-512
/// code must not run inside it).
#[inline(always)]
unsafe fn prep_row<const AVX512: bool>(
    src: &IntSrc,
    r: usize,
    cols: usize,
    s: &mut Scratch,
) -> Row {
    if AVX512 {
        block_factors_avx512(src, r, cols, &mut s.f);
    } else {
        src.block_factors(r, cols, &mut s.f);
    }
    match *src {
        IntSrc::Mxfp4 { packed, .. } => Row::Mx4(packed.as_ptr().add(r * cols / 2)),
        IntSrc::Affine8 { q, .. } => Row::U8(q.as_ptr().add(r * cols)),
        IntSrc::E8p { codes, .. } if AVX512 => {
            // Stored as `w + 128` bytes: on VNNI the row multiplies them as they lie.
            let kc = cols / 8;
            decode_e8p_avx512::<true>(codes.as_ptr().add(r * kc), kc, s.w.as_mut_ptr());
            Row::U8(s.w.as_ptr() as *const u8)
        }
        IntSrc::E8p { .. } => {
            src.decode_row_fast(r, cols, &mut s.w);
            Row::Buf(s.w.as_ptr())
        }
    }
}

#[inline(always)]
pub(super) unsafe fn hsum256(b: __m256) -> f32 {
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// Product of 64 int8 `|w|` with `q · sign(w)`: 16 i32 sums of four.
#[inline(always)]
unsafe fn dot64<const VNNI: bool>(aw: __m512i, neg: __mmask64, q: __m512i) -> __m512i {
    let sq = _mm512_mask_sub_epi8(q, neg, _mm512_setzero_si512(), q);
    if VNNI {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sq)
    } else {
        _mm512_madd_epi16(_mm512_maddubs_epi16(aw, sq), _mm512_set1_epi16(1))
    }
}

#[inline(always)]
unsafe fn rows_avx512_impl<const VNNI: bool>(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    {
        // Taken out of the thread-local for the call (no closure: closures do not inherit
        // the enclosing function's target features).
        let mut taken = SCRATCH.with(|c| c.take());
        let s = &mut taken;
        s.w.resize(cols, 0);
        s.f.resize(nb, 0.0);
        for r in r0..r1 {
            let row = prep_row::<true>(src, r, cols, s);
            let post = src.post(r);
            let f = s.f.as_ptr();
            let mut i = 0;
            while i < a.m {
                let mr = (a.m - i).min(4);
                // E8P rows have block factor 1: their coefficients are the activations'
                // block scales as they lie (`Q8Acts::dx`), no multiply or permute.
                let unit = matches!(src, IntSrc::E8p { .. });
                match (VNNI && matches!(row, Row::U8(_)), unit) {
                    (false, false) => {
                        group_mr::<VNNI, false, false>(mr, row, a, f, i, post, r, out, ld)
                    }
                    (false, true) => {
                        group_mr::<VNNI, false, true>(mr, row, a, f, i, post, r, out, ld)
                    }
                    (true, false) => {
                        group_mr::<VNNI, true, false>(mr, row, a, f, i, post, r, out, ld)
                    }
                    (true, true) => {
                        group_mr::<VNNI, true, true>(mr, row, a, f, i, post, r, out, ld)
                    }
                }
                i += mr;
            }
            if matches!(src, IntSrc::Affine8 { .. }) {
                bias_rows_avx512(src, a, r, out, ld);
            }
        }
        SCRATCH.with(|c| c.replace(taken));
    }
}

/// Step 5 of the contract for weight row `r` (affine-8), added to every activation row's
/// result, one 512-bit FMA per 16 blocks.
#[inline(always)]
unsafe fn bias_rows_avx512(src: &IntSrc, a: &Q8Acts, r: usize, out: *mut f32, ld: usize) {
    let nb = a.cols / QBLOCK;
    let mut bb = super::BIAS.with(|c| c.take());
    bb.resize(nb, 0.0);
    bias_blocks_avx512(src, r, a.cols, &mut bb);
    for i in 0..a.m {
        *out.add(i * ld + r) += bias_avx512(bb.as_ptr(), a.ds.as_ptr().add(i * nb), nb);
    }
    super::BIAS.with(|c| c.replace(bb));
}

/// [`group512`] for `mr` (1..=4) input rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group_mr<const VNNI: bool, const DIRECT: bool, const UNIT: bool>(
    mr: usize,
    row: Row,
    a: &Q8Acts,
    f: *const f32,
    i: usize,
    post: Option<f32>,
    r: usize,
    out: *mut f32,
    ld: usize,
) {
    match mr {
        4 => group512::<VNNI, 4, DIRECT, UNIT>(row, a, f, i, post, r, out, ld),
        3 => group512::<VNNI, 3, DIRECT, UNIT>(row, a, f, i, post, r, out, ld),
        2 => group512::<VNNI, 2, DIRECT, UNIT>(row, a, f, i, post, r, out, ld),
        _ => group512::<VNNI, 1, DIRECT, UNIT>(row, a, f, i, post, r, out, ld),
    }
}

/// Input rows `i..i+MR` against one weight row (`DIRECT`: an affine-8 row on the VNNI level,
/// `Σ q·x` from the stored bytes started at the activations' `−128·Σx`, which is exactly
/// the contract's `Σ (q − 128)·x`; `UNIT`: every block factor is 1, so `c_b = 1 · d_b` is
/// `d_b` and is loaded from [`Q8Acts::dx`] as it lies).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group512<const VNNI: bool, const MR: usize, const DIRECT: bool, const UNIT: bool>(
    row: Row,
    a: &Q8Acts,
    f: *const f32,
    i: usize,
    post: Option<f32>,
    r: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let full = nb / 4 * 4;
    let q: [*const i8; MR] = std::array::from_fn(|j| a.q.as_ptr().add((i + j) * cols));
    let d: [*const f32; MR] = std::array::from_fn(|j| a.d.as_ptr().add((i + j) * nb));
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let idx_a = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    let idx_b = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    let mut b = 0;
    while b < full {
        let k = b * QBLOCK;
        let (w0, w1) = match (DIRECT, row) {
            (true, Row::U8(p)) => (
                _mm512_loadu_si512(p.add(k) as *const __m512i),
                _mm512_loadu_si512(p.add(k + 64) as *const __m512i),
            ),
            _ => (row.w64(k), row.w64(k + 64)),
        };
        let (a0, a1) = (_mm512_abs_epi8(w0), _mm512_abs_epi8(w1));
        let (n0, n1) = (_mm512_movepi8_mask(w0), _mm512_movepi8_mask(w1));
        let f4 = _mm_loadu_ps(f.add(b));
        for j in 0..MR {
            let qa = _mm512_loadu_si512(q[j].add(k) as *const __m512i);
            let qb = _mm512_loadu_si512(q[j].add(k + 64) as *const __m512i);
            let (p0, p1) = if DIRECT {
                let ns = a.nsum4.as_ptr().add((i + j) * cols / 4 + k / 4);
                (
                    _mm512_dpbusd_epi32(_mm512_loadu_si512(ns as *const __m512i), w0, qa),
                    _mm512_dpbusd_epi32(_mm512_loadu_si512(ns.add(16) as *const __m512i), w1, qb),
                )
            } else {
                (dot64::<VNNI>(a0, n0, qa), dot64::<VNNI>(a1, n1, qb))
            };
            let (ca, cb) = if UNIT {
                let dx = a.dx.as_ptr().add((i + j) * cols / 4 + k / 4);
                (_mm512_loadu_ps(dx), _mm512_loadu_ps(dx.add(16)))
            } else {
                let c4 = _mm512_castps128_ps512(_mm_mul_ps(f4, _mm_loadu_ps(d[j].add(b))));
                (
                    _mm512_permutexvar_ps(idx_a, c4),
                    _mm512_permutexvar_ps(idx_b, c4),
                )
            };
            acc[j][0] = _mm512_fmadd_ps(ca, _mm512_cvtepi32_ps(p0), acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(cb, _mm512_cvtepi32_ps(p1), acc[j][1]);
        }
        b += 4;
    }
    for j in 0..MR {
        let mut v = [[0f32; 8]; 4];
        let (lo0, hi0) = (
            _mm512_castps512_ps256(acc[j][0]),
            _mm512_extractf32x8_ps(acc[j][0], 1),
        );
        let (lo1, hi1) = (
            _mm512_castps512_ps256(acc[j][1]),
            _mm512_extractf32x8_ps(acc[j][1], 1),
        );
        let s = if full == nb {
            // u = (acc0 + acc2) + (acc1 + acc3), then the 8-lane tree.
            hsum256(_mm256_add_ps(
                _mm256_add_ps(lo0, lo1),
                _mm256_add_ps(hi0, hi1),
            ))
        } else {
            _mm256_storeu_ps(v[0].as_mut_ptr(), lo0);
            _mm256_storeu_ps(v[1].as_mut_ptr(), hi0);
            _mm256_storeu_ps(v[2].as_mut_ptr(), lo1);
            _mm256_storeu_ps(v[3].as_mut_ptr(), hi1);
            let dj = d[j];
            tail_blocks(row, q[j], |bb| *f.add(bb) * *dj.add(bb), &mut v, full, nb);
            super::finish_ref(&v)
        };
        *out.add((i + j) * ld + r) = post.map_or(s, |p| s * p);
    }
}

/// AVX-512 rows `r0..r1` (`VNNI`: `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ (and VNNI when `VNNI`); `out` as in `super::rows_scalar`.
pub(super) unsafe fn rows_avx512<const VNNI: bool>(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    if VNNI {
        vnni(src, a, r0, r1, out, ld)
    } else {
        bw(src, a, r0, r1, out, ld)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")]
unsafe fn vnni(src: &IntSrc, a: &Q8Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    rows_avx512_impl::<true>(src, a, r0, r1, out, ld)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn bw(src: &IntSrc, a: &Q8Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    rows_avx512_impl::<false>(src, a, r0, r1, out, ld)
}

/// AVX2 rows `r0..r1`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `out` as in `super::rows_scalar`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows_avx2(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    {
        // Taken out of the thread-local for the call (no closure: closures do not inherit
        // the enclosing function's target features).
        let mut taken = SCRATCH.with(|c| c.take());
        let s = &mut taken;
        s.w.resize(cols, 0);
        s.f.resize(nb, 0.0);
        for r in r0..r1 {
            let row = prep_row::<false>(src, r, cols, s);
            let post = src.post(r);
            let f = s.f.as_ptr();
            let mut i = 0;
            while i < a.m {
                let mr = (a.m - i).min(2);
                match mr {
                    2 => group256::<2>(row, a, f, i, post, r, out, ld),
                    _ => group256::<1>(row, a, f, i, post, r, out, ld),
                }
                i += mr;
            }
            super::add_bias_terms(src, a, r, out, ld);
        }
        SCRATCH.with(|c| c.replace(taken));
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group256<const MR: usize>(
    row: Row,
    a: &Q8Acts,
    f: *const f32,
    i: usize,
    post: Option<f32>,
    r: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let full = nb / 4 * 4;
    let q: [*const i8; MR] = std::array::from_fn(|j| a.q.as_ptr().add((i + j) * cols));
    let d: [*const f32; MR] = std::array::from_fn(|j| a.d.as_ptr().add((i + j) * nb));
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    let ones = _mm256_set1_epi16(1);
    let mut b = 0;
    while b < full {
        for h in 0..4 {
            let k = (b + h) * QBLOCK;
            let w = row.w32(k);
            let aw = _mm256_abs_epi8(w);
            let fb = *f.add(b + h);
            for j in 0..MR {
                let sq = _mm256_sign_epi8(_mm256_loadu_si256(q[j].add(k) as *const __m256i), w);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sq), ones);
                let c = _mm256_set1_ps(fb * *d[j].add(b + h));
                acc[j][h] = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(p), acc[j][h]);
            }
        }
        b += 4;
    }
    for j in 0..MR {
        let s = if full == nb {
            hsum256(_mm256_add_ps(
                _mm256_add_ps(acc[j][0], acc[j][2]),
                _mm256_add_ps(acc[j][1], acc[j][3]),
            ))
        } else {
            let mut v = [[0f32; 8]; 4];
            for (h, vh) in v.iter_mut().enumerate() {
                _mm256_storeu_ps(vh.as_mut_ptr(), acc[j][h]);
            }
            let dj = d[j];
            tail_blocks(row, q[j], |bb| *f.add(bb) * *dj.add(bb), &mut v, full, nb);
            super::finish_ref(&v)
        };
        *out.add((i + j) * ld + r) = post.map_or(s, |p| s * p);
    }
}

/// Step 5 of the contract (sixteen FMA lanes over the blocks, then the fixed tree).
///
/// # Safety
/// AVX-512 F; `bb` and `ds` hold `nb` floats.
#[inline(always)]
pub(super) unsafe fn bias_avx512(bb: *const f32, ds: *const f32, nb: usize) -> f32 {
    let mut l = _mm512_setzero_ps();
    let mut b = 0;
    while b + 16 <= nb {
        l = _mm512_fmadd_ps(_mm512_loadu_ps(bb.add(b)), _mm512_loadu_ps(ds.add(b)), l);
        b += 16;
    }
    if b < nb {
        let k: __mmask16 = (1u32 << (nb - b)) as u16 - 1;
        let x = _mm512_maskz_loadu_ps(k, bb.add(b));
        let y = _mm512_maskz_loadu_ps(k, ds.add(b));
        l = _mm512_mask3_fmadd_ps(x, y, l, k);
    }
    let v = _mm256_add_ps(
        _mm512_castps512_ps256(l),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l), 1)),
    );
    hsum256(v)
}
