//! x86-64 affine-4 row kernels of [`super`]'s contract (M = 1..32, and every M on the levels
//! without the GEMM): 64 weights per step are widened from 32 packed bytes in registers
//! (`vpmovzxbw`, then `(v | v << 4) & 0x0F0F` puts element `2k` in the low byte and `2k+1` in
//! the high byte of word `k`, MLX's order), and, being unsigned bytes in [0, 15], they are
//! the unsigned operand of `vpdpbusd` (AVX-512 VNNI) or `vpmaddubsw` + `vpmaddwd` (AVX-512 BW,
//! AVX2; a pair of products is at most 2 · 15 · 127, far inside i16) against the int8
//! activations as they lie. Each decoded vector serves up to four (AVX2: two) activation
//! rows. Block factors are the bf16 scales, the bias term `β_b = b` is added by the shared
//! step-5 code, and blocks past the last whole group of four run the contract in scalar
//! code, so every result is the scalar level's bits. At M = 1 on the VNNI levels a row takes
//! [`row_m1`] instead: 64 packed bytes per step split by `and`/shift and interleaved in
//! registers against the activations in [`Q8Acts::qmx4`]'s order, the block coefficients and
//! the bias term computed in the row (no per-row buffers), the same bits.
#![allow(clippy::incompatible_msrv)]
// Indexed loops mirror the contract's lane and accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::x86::{
    bias_blocks_avx512, bias_lanes, bias_rows_avx512, block_factors_avx512, finish_m1, finish_row,
    m1_acc, reduce8, tail_blocks, Row,
};
use super::{IntSrc, Q8Acts, QBLOCK, SCRATCH};
use crate::affine::AFFINE8_GROUP;

/// Weights `2k, 2k+1` of the 32 packed bytes at `p` as 64 bytes in order (AVX-512 BW).
#[inline(always)]
unsafe fn nib64(p: *const u8) -> __m512i {
    let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p as *const __m256i));
    // (A | B) & C: ternary-logic table 0xA8.
    _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(v, 4), _mm512_set1_epi16(0x0F0F), 0xA8)
}

/// Weights of the 16 packed bytes at `p` as 32 bytes in order (AVX2).
#[inline(always)]
unsafe fn nib32(p: *const u8) -> __m256i {
    let v = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
    _mm256_and_si256(
        _mm256_or_si256(v, _mm256_slli_epi16(v, 4)),
        _mm256_set1_epi16(0x0F0F),
    )
}

/// A row's packed nibbles (`cols / 2` bytes at `p`) decoded to int8 at `w` (the GEMM's
/// panel rows; the same values as [`super::nibbles::decode_nibbles`]).
///
/// # Safety
/// AVX-512 F/BW; `p` holds `cols / 2` bytes and `w` at least `cols`.
#[inline(always)]
pub(super) unsafe fn decode_row_avx512(p: *const u8, cols: usize, w: &mut [i8]) {
    let mut c = 0;
    while c + 64 <= cols {
        _mm512_storeu_si512(w.as_mut_ptr().add(c) as *mut __m512i, nib64(p.add(c / 2)));
        c += 64;
    }
    let rest = std::slice::from_raw_parts(p.add(c / 2), (cols - c) / 2);
    super::nibbles::decode_nibbles(rest, &mut w[c..cols]);
}

/// Per thread: the row's tail blocks decoded to int8 at their column positions.
#[inline(always)]
unsafe fn tail_row(packed: &[u8], r: usize, cols: usize, full: usize, w: &mut [i8]) -> Row {
    let c0 = full * QBLOCK;
    if c0 < cols {
        super::nibbles::decode_nibbles(
            &packed[(r * cols + c0) / 2..(r + 1) * cols / 2],
            &mut w[c0..cols],
        );
    }
    Row::Buf(w.as_ptr())
}

/// 16 i32 sums of four `w · q` (`w` unsigned bytes, `q` signed).
#[inline(always)]
unsafe fn dot64<const VNNI: bool>(w: __m512i, q: __m512i) -> __m512i {
    if VNNI {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q)
    } else {
        _mm512_madd_epi16(_mm512_maddubs_epi16(w, q), _mm512_set1_epi16(1))
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
    let IntSrc::Affine4 {
        q: packed,
        scales,
        biases,
    } = *src
    else {
        return super::rows_scalar(src, a, r0, r1, out, ld);
    };
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let full = nb / 4 * 4;
    // Taken out of the thread-local for the call (no closure: closures do not inherit the
    // enclosing function's target features).
    let mut taken = SCRATCH.with(|c| c.take());
    let s = &mut taken;
    s.w.resize(cols, 0);
    s.f.resize(nb, 0.0);
    // M = 1 (`qmx4` is filled for every one-row `Q8Acts`; checked since the reads are
    // unchecked): nibbles interleaved in registers, no row buffer, the bias term in the row.
    if VNNI && a.m == 1 && a.qmx4.len() == cols {
        let (sp, bp) = (scales.as_ptr() as *const u16, biases.as_ptr() as *const u16);
        let ng = cols / AFFINE8_GROUP;
        let mut r = r0;
        // Four rows at a time (every block in a whole group of four): their sums and bias
        // terms reduced together, the same tree as one by one.
        while full == nb && r + 4 <= r1 {
            let mut x = [_mm256_setzero_ps(); 8];
            for j in 0..4 {
                let (lo, hi) = row_m1_acc(
                    packed.as_ptr().add((r + j) * cols / 2),
                    sp.add((r + j) * ng),
                    a,
                    nb,
                );
                x[j] = m1_lanes(lo, hi);
                x[4 + j] = bias_m1_lanes(bp.add((r + j) * ng), a.ds.as_ptr(), nb);
            }
            let v = reduce8(x);
            for j in 0..4 {
                *out.add(r + j) = v[j] + v[4 + j];
            }
            r += 4;
        }
        for r in r..r1 {
            let tail = tail_row(packed, r, cols, full, &mut s.w);
            let v = row_m1(
                packed.as_ptr().add(r * cols / 2),
                sp.add(r * ng),
                tail,
                a,
                nb,
            );
            *out.add(r) = v + bias_m1(bp.add(r * ng), a.ds.as_ptr(), nb);
        }
        SCRATCH.with(|c| c.replace(taken));
        return;
    }
    // Rows whose blocks are all in whole groups of four (every real shape) add the bias term
    // in the group and reduce four rows' sums and bias terms together (`reduce8`).
    let fused = full == nb;
    if fused {
        s.bb.resize(nb, 0.0);
    }
    for r in r0..r1 {
        block_factors_avx512(src, r, cols, &mut s.f);
        let tail = tail_row(packed, r, cols, full, &mut s.w);
        let wp = packed.as_ptr().add(r * cols / 2);
        let f = s.f.as_ptr();
        let bb = if fused {
            bias_blocks_avx512(src, r, cols, &mut s.bb);
            Some(s.bb.as_ptr())
        } else {
            None
        };
        let mut i = 0;
        while i < a.m {
            let mr = (a.m - i).min(4);
            match mr {
                4 => group512::<VNNI, 4>(wp, tail, a, f, bb, i, r, out, ld),
                3 => group512::<VNNI, 3>(wp, tail, a, f, bb, i, r, out, ld),
                2 => group512::<VNNI, 2>(wp, tail, a, f, bb, i, r, out, ld),
                _ => group512::<VNNI, 1>(wp, tail, a, f, bb, i, r, out, ld),
            }
            i += mr;
        }
        if !fused {
            bias_rows_avx512(src, a, r, out, ld);
        }
    }
    SCRATCH.with(|c| c.replace(taken));
}

/// Bytes ahead of the step's weights that the M = 1 row kernel prefetches (into L1): a model's
/// rows are streamed once from memory, and with the hardware prefetcher alone the loop waits
/// on them.
const PREFETCH_AHEAD: usize = 2048;

/// One affine-4 weight row (`nb` blocks: packed nibbles at `wp`, bf16 group scales at `sp`,
/// the tail blocks decoded in `tail`) against one activation row at M = 1, four blocks (64
/// packed bytes) per step: the low and high nibbles (`and`, shift) interleaved back into
/// column order within each 128-bit lane (`vpunpck{l,h}bw`: register 0 holds the first 16
/// weights of each of the four blocks, register 1 the last 16), multiplied as unsigned bytes
/// with [`Q8Acts::qmx4`] (the activations in that order) by `vpdpbusd`, so each 32-bit lane
/// is exactly the contract's `p[b][g]`; then one FMA per register with the coefficients
/// `c_b = s_g · d_b` spread four lanes each. Lane `4l + g` of the two accumulators is the
/// contract's `acc[l][g]` and `acc[l][g + 4]`, and the blocks past the last whole step run the
/// contract in scalar code on them, so the value (before the bias term) is the contract's bit
/// for bit.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI; `wp` holds `16·nb` bytes and `sp` `nb / 2` scales; `a` is one row of
/// `32·nb` with `qmx4` filled.
#[inline(always)]
unsafe fn row_m1(wp: *const u8, sp: *const u16, tail: Row, a: &Q8Acts, nb: usize) -> f32 {
    let full = nb / 4 * 4;
    let (lo, hi) = row_m1_acc(wp, sp, a, nb);
    if full == nb {
        return finish_m1(lo, hi);
    }
    let d = a.d.as_ptr();
    let mut acc = m1_acc(lo, hi);
    let f = |bb: usize| f32::from_bits((*sp.add(bb * QBLOCK / AFFINE8_GROUP) as u32) << 16);
    tail_blocks(
        tail,
        a.q.as_ptr(),
        |bb| f(bb) * *d.add(bb),
        &mut acc,
        full,
        nb,
    );
    super::finish_ref(&acc)
}

/// [`row_m1`]'s two accumulators over the row's whole groups of four blocks.
///
/// # Safety
/// As [`row_m1`].
#[inline(always)]
unsafe fn row_m1_acc(wp: *const u8, sp: *const u16, a: &Q8Acts, nb: usize) -> (__m512, __m512) {
    let full = nb / 4 * 4;
    let nib = _mm512_set1_epi8(0x0F);
    let (qp, d) = (a.qmx4.as_ptr(), a.d.as_ptr());
    let base = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let idx: [__m512i; 4] =
        std::array::from_fn(|j| _mm512_add_epi32(base, _mm512_set1_epi32(4 * j as i32)));
    let (mut lo, mut hi) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut b = 0;
    while b < full {
        // Up to 16 blocks' coefficients: their (up to 8) group scales widened, each twice,
        // times the activation scales (lanes past the row are not read from memory).
        let n = (full - b).min(16);
        let kb: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
        let f16 = groups_masked(sp.add(b / 2), n);
        let c16 = _mm512_mul_ps(f16, _mm512_maskz_loadu_ps(kb, d.add(b)));
        for j in 0..n / 4 {
            let bb = b + 4 * j;
            // A prefetch never faults, so the rows' end needs no check.
            _mm_prefetch::<_MM_HINT_T0>(
                wp.wrapping_add(bb * QBLOCK / 2 + PREFETCH_AHEAD) as *const i8
            );
            let v = _mm512_loadu_si512(wp.add(bb * QBLOCK / 2) as *const __m512i);
            let wl = _mm512_and_si512(v, nib);
            let wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            let o = bb * QBLOCK;
            let p0 = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                _mm512_unpacklo_epi8(wl, wh),
                _mm512_loadu_si512(qp.add(o) as *const __m512i),
            );
            let p1 = _mm512_dpbusd_epi32(
                _mm512_setzero_si512(),
                _mm512_unpackhi_epi8(wl, wh),
                _mm512_loadu_si512(qp.add(o + 64) as *const __m512i),
            );
            let cv = _mm512_permutexvar_ps(idx[j], c16);
            lo = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(p0), lo);
            hi = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(p1), hi);
        }
        b += 16;
    }
    (lo, hi)
}

/// [`finish_m1`]'s first steps: each register halved to four lanes (`lo` gives `u[0..4]`,
/// `hi` `u[4..8]`), the two side by side, so that the fixed tree of [`reduce8`] finishes it
/// in [`finish_m1`]'s order.
#[inline(always)]
unsafe fn m1_lanes(lo: __m512, hi: __m512) -> __m256 {
    let half = |x: __m512| {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(x),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
        );
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
    };
    _mm256_set_m128(half(hi), half(lo))
}

/// Up to 16 blocks' group values (bf16 at `p`, one per two blocks) as f32, each twice; lanes
/// past `n` blocks are zero and not read from memory.
#[inline(always)]
unsafe fn groups_masked(p: *const u16, n: usize) -> __m512 {
    let kg: __mmask8 = ((1u16 << n.min(16).div_ceil(2)) - 1) as u8;
    let g = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(kg, p as *const i16)),
        16,
    ));
    let spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(g))
}

/// Step 5 of the contract for one affine-4 row at M = 1: `β_b = b_g` (bf16 at `bp`) times the
/// activations' `e_b` ([`Q8Acts::ds`]), sixteen lanes, one FMA per 16 blocks (the last
/// masked), reduced in the contract's order: the same bits as `bias_rows_avx512`.
///
/// # Safety
/// AVX-512 F/BW/VL; `bp` holds `nb / 2` values and `ds` `nb`.
#[inline(always)]
unsafe fn bias_m1(bp: *const u16, ds: *const f32, nb: usize) -> f32 {
    super::x86::hsum256(bias_m1_lanes(bp, ds, nb))
}

/// [`bias_m1`]'s sixteen lanes folded to eight (before the fixed tree).
///
/// # Safety
/// As [`bias_m1`].
#[inline(always)]
unsafe fn bias_m1_lanes(bp: *const u16, ds: *const f32, nb: usize) -> __m256 {
    let mut l = _mm512_setzero_ps();
    let mut b = 0;
    while b < nb {
        let n = (nb - b).min(16);
        let k: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
        let e = _mm512_maskz_loadu_ps(k, ds.add(b));
        l = _mm512_mask3_fmadd_ps(groups_masked(bp.add(b / 2), n), e, l, k);
        b += 16;
    }
    _mm256_add_ps(
        _mm512_castps512_ps256(l),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l), 1)),
    )
}

/// Activation rows `i..i+MR` against weight row `r` (packed nibbles at `wp`): steps 1–4 of
/// the contract; with `bb` (the row's `β_b`, every block in a whole group of four) step 5
/// too, the sums and bias terms of the rows reduced together ([`reduce8`]), otherwise the
/// bias term is added by the caller.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group512<const VNNI: bool, const MR: usize>(
    wp: *const u8,
    tail: Row,
    a: &Q8Acts,
    f: *const f32,
    bb: Option<*const f32>,
    i: usize,
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
        let w0 = nib64(wp.add(k / 2));
        let w1 = nib64(wp.add(k / 2 + 32));
        let f4 = _mm_loadu_ps(f.add(b));
        for j in 0..MR {
            let qa = _mm512_loadu_si512(q[j].add(k) as *const __m512i);
            let qb = _mm512_loadu_si512(q[j].add(k + 64) as *const __m512i);
            let (p0, p1) = (dot64::<VNNI>(w0, qa), dot64::<VNNI>(w1, qb));
            let c4 = _mm512_castps128_ps512(_mm_mul_ps(f4, _mm_loadu_ps(d[j].add(b))));
            let (ca, cb) = (
                _mm512_permutexvar_ps(idx_a, c4),
                _mm512_permutexvar_ps(idx_b, c4),
            );
            acc[j][0] = _mm512_fmadd_ps(ca, _mm512_cvtepi32_ps(p0), acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(cb, _mm512_cvtepi32_ps(p1), acc[j][1]);
        }
        b += 4;
    }
    if let Some(bb) = bb {
        // Per row: `u = (acc0 + acc2) + (acc1 + acc3)` (acc[j][0] holds the contract's acc[0]
        // in its low half and acc[1], acc[j][1] acc[2] and acc[3]) and the bias lanes
        // `v = L[..8] + L[8..]`; rows past MR are zeros, reduced and not stored.
        let mut x = [_mm256_setzero_ps(); 8];
        for j in 0..MR {
            let s = _mm512_add_ps(acc[j][0], acc[j][1]);
            x[j] = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
            x[4 + j] = bias_lanes(bb, a.ds.as_ptr().add((i + j) * nb), nb);
        }
        let v = reduce8(x);
        for j in 0..MR {
            *out.add((i + j) * ld + r) = v[j] + v[4 + j];
        }
        return;
    }
    for j in 0..MR {
        // acc[j][0] holds the contract's acc[0] (low half) and acc[1], acc[j][1] acc[2], acc[3].
        let u = [
            _mm512_castps512_ps256(acc[j][0]),
            _mm512_extractf32x8_ps(acc[j][0], 1),
            _mm512_castps512_ps256(acc[j][1]),
            _mm512_extractf32x8_ps(acc[j][1], 1),
        ];
        let dj = d[j];
        let s = finish_row(u, tail, q[j], |bb| *f.add(bb) * *dj.add(bb), full, nb);
        *out.add((i + j) * ld + r) = s;
    }
}

/// AVX-512 VNNI rows `r0..r1` (`vpdpbusd`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ/VNNI; `out` as in `super::rows_scalar`; `src` holds at
/// least `r1` rows of `a.cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")]
pub(super) unsafe fn rows_vnni(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    rows_avx512_impl::<true>(src, a, r0, r1, out, ld)
}

/// AVX-512 BW rows `r0..r1` (`vpmaddubsw` + `vpmaddwd`).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ; otherwise as [`rows_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(super) unsafe fn rows_bw(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    rows_avx512_impl::<false>(src, a, r0, r1, out, ld)
}

/// AVX2 rows `r0..r1` (`vpmaddubsw` + `vpmaddwd`; block factors and the bias term by the
/// scalar code, since AVX-512 code must not run here).
///
/// # Safety
/// The CPU has AVX2 and FMA; otherwise as [`rows_vnni`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows_avx2(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let IntSrc::Affine4 { q: packed, .. } = *src else {
        return super::rows_scalar(src, a, r0, r1, out, ld);
    };
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let full = nb / 4 * 4;
    let mut taken = SCRATCH.with(|c| c.take());
    let s = &mut taken;
    s.w.resize(cols, 0);
    s.f.resize(nb, 0.0);
    for r in r0..r1 {
        src.block_factors(r, cols, &mut s.f);
        let tail = tail_row(packed, r, cols, full, &mut s.w);
        let wp = packed.as_ptr().add(r * cols / 2);
        let f = s.f.as_ptr();
        let mut i = 0;
        while i < a.m {
            let mr = (a.m - i).min(2);
            match mr {
                2 => group256::<2>(wp, tail, a, f, i, r, out, ld),
                _ => group256::<1>(wp, tail, a, f, i, r, out, ld),
            }
            i += mr;
        }
        super::add_bias_terms(src, a, r, out, ld);
    }
    SCRATCH.with(|c| c.replace(taken));
}

/// [`group512`] on 256-bit registers (one 8-lane accumulator per block of a group of four).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn group256<const MR: usize>(
    wp: *const u8,
    tail: Row,
    a: &Q8Acts,
    f: *const f32,
    i: usize,
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
            let w = nib32(wp.add(k / 2));
            let fb = *f.add(b + h);
            for j in 0..MR {
                let qv = _mm256_loadu_si256(q[j].add(k) as *const __m256i);
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, qv), ones);
                let c = _mm256_set1_ps(fb * *d[j].add(b + h));
                acc[j][h] = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(p), acc[j][h]);
            }
        }
        b += 4;
    }
    for j in 0..MR {
        let dj = d[j];
        let s = finish_row(acc[j], tail, q[j], |bb| *f.add(bb) * *dj.add(bb), full, nb);
        *out.add((i + j) * ld + r) = s;
    }
}
