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
//! treated as an affine-8 row; AVX2: one load per code from the 512 KiB table); E81 rows
//! likewise, one load per code from the 2 KiB table (stored as `w + 128` bytes on AVX-512,
//! as int8 on AVX2), or with VBMI 64 codes per step from nibble planes in registers;
//! affine-8
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
    /// Affine-8 bytes `q` of the row as stored (or an E8P or E81 row decoded to `w + 128`,
    /// the same form): the integer weight `q − 128` is one xor in
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

/// One output of a row kernel from its four 8-lane partial sums `u` (the contract's lane
/// groups, in order): the fixed tree `(u0 + u2) + (u1 + u3)` when every block was full, else the
/// lanes stored, the tail blocks `full..nb` added by the scalar contract, and its finish.
///
/// # Safety
/// AVX2; as [`tail_blocks`] for `row`, `q` and `c`.
#[inline(always)]
pub(super) unsafe fn finish_row(
    u: [__m256; 4],
    row: Row,
    q: *const i8,
    c: impl Fn(usize) -> f32,
    full: usize,
    nb: usize,
) -> f32 {
    if full == nb {
        hsum256(_mm256_add_ps(
            _mm256_add_ps(u[0], u[2]),
            _mm256_add_ps(u[1], u[3]),
        ))
    } else {
        let mut v = [[0f32; 8]; 4];
        for (vh, uh) in v.iter_mut().zip(u) {
            _mm256_storeu_ps(vh.as_mut_ptr(), uh);
        }
        tail_blocks(row, q, c, &mut v, full, nb);
        super::finish_ref(&v)
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
        IntSrc::Affine8 { scales, .. } | IntSrc::Affine4 { scales, .. } => {
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
        IntSrc::E8p { .. } | IntSrc::E81 { .. } => dst.iter_mut().for_each(|o| *o = 1.0),
        IntSrc::Registered(_) => src.block_factors(r, cols, dst),
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

/// `β_b = b_g` of row `r` for every block (each bf16 bias twice), 16 blocks at a time.
///
/// # Safety
/// AVX-512 F; `biases` holds row `r` of `cols / 64` bf16 values; `dst` at least `cols / 32`.
#[inline(always)]
unsafe fn bias_blocks_affine4_avx512(biases: &[u8], r: usize, cols: usize, dst: &mut [f32]) {
    let nb = cols / QBLOCK;
    let ng = cols / AFFINE8_GROUP;
    let bp = (biases.as_ptr() as *const u16).add(r * ng);
    let mut b = 0;
    while b + 16 <= nb {
        _mm512_storeu_ps(dst.as_mut_ptr().add(b), groups16(bp.add(b / 2)));
        b += 16;
    }
    for (bb, o) in dst[..nb].iter_mut().enumerate().skip(b) {
        *o = bf16_at(biases, r * ng + bb * QBLOCK / AFFINE8_GROUP);
    }
}

/// `IntSrc::bias_blocks` (affine-8) 16 blocks at a time: `128·s + b` in f32 (the product is
/// exact, so this is the scalar code's value), scalar for the rest.
///
/// # Safety
/// AVX-512 F; `src` holds row `r` of `cols`.
#[inline(always)]
pub(super) unsafe fn bias_blocks_avx512(src: &IntSrc, r: usize, cols: usize, dst: &mut [f32]) {
    let (scales, biases) = match *src {
        IntSrc::Affine8 { scales, biases, .. } => (scales, biases),
        IntSrc::Affine4 { biases, .. } => return bias_blocks_affine4_avx512(biases, r, cols, dst),
        _ => return,
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

/// Byte `j` of a 64-code group sits at byte `2j` (sign byte) and `2j + 1` (pattern) of the
/// two registers holding the codes.
const fn bytes_at(odd: u8) -> [u8; 64] {
    let mut a = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        a[j] = 2 * j as u8 + odd;
        j += 1;
    }
    a
}
static E8P_SIGN_BYTES: [u8; 64] = bytes_at(0);
static E8P_PATTERN_BYTES: [u8; 64] = bytes_at(1);

/// For output register `k` of a 64-code group (codes `8k..8k+8`): qword `c` takes plane
/// byte `8k + c` of the low magnitudes (byte 0) and of the high ones (byte 1, the second
/// `vpermi2b` table); the other bytes are never read.
static E8P_QWORD_IDX: [[u8; 64]; 8] = {
    let mut a = [[0u8; 64]; 8];
    let mut k = 0;
    while k < 8 {
        let mut c = 0;
        while c < 8 {
            a[k][8 * c] = (8 * k + c) as u8;
            a[k][8 * c + 1] = (64 + 8 * k + c) as u8;
            c += 1;
        }
        k += 1;
    }
    a
};

/// `vpmultishiftqb` controls: byte `i` of each qword starts at bit `2i` (coordinate `i`'s
/// magnitude index in the low two bits).
static E8P_SHIFTS: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        a[j] = 2 * (j % 8) as u8;
        j += 1;
    }
    a
};

/// `|4·base| + 1` by magnitude index (the low two bits of a `vpermb` index; 3 never occurs).
static E8P_MAG1: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        a[j] = [3, 7, 11, 0][j % 4];
        j += 1;
    }
    a
};

#[inline(always)]
unsafe fn ld64(p: *const u8) -> __m512i {
    _mm512_loadu_si512(p as *const __m512i)
}

/// A 256-byte table as four registers.
#[inline(always)]
unsafe fn plane_regs(t: &[u8; 256]) -> [__m512i; 4] {
    std::array::from_fn(|j| ld64(t.as_ptr().add(64 * j)))
}

/// `t[g]` for 64 bytes `g` (two `vpermi2b`, one per half of the table, and a blend on bit 7).
#[inline(always)]
unsafe fn lookup256(t: &[__m512i; 4], g: __m512i, hi: __mmask64) -> __m512i {
    let a = _mm512_permutex2var_epi8(t[0], g, t[1]);
    let b = _mm512_permutex2var_epi8(t[2], g, t[3]);
    _mm512_mask_blend_epi8(hi, a, b)
}

/// One group of up to 64 E8P codes, decoded without a gather (AVX-512 VBMI): the integer
/// weights `4 · codeword` of code `8k + c` are byte `8c + i` of `out[k]`, as `|w|` and a
/// mask of the negative ones, so callers pick the form they multiply (`w`, `w + 128`, or
/// `|w|` against sign-flipped activations).
///
/// The pattern bytes look up three planes ([`super::E8pPlanes`]): two bits of magnitude
/// index per coordinate (16 bits a code) and the sign fix of coordinate 7. The sign bytes'
/// parity `p` (SWAR, as [`super::e8p_sign_masks`]) gives the negation mask
/// `t = s ^ p ^ fix` (bit `i` set: coordinate `i` is negative) and `t ^ (p ? 0xFF : 0)`.
/// Per register: one `vpermi2b` gathers each code's 16 magnitude bits into its qword,
/// `vpmultishiftqb` moves coordinate `i`'s two bits to byte `i`, and `vpermb` maps them to
/// `a + 1` (`a = |4·base|` ∈ {2, 6, 10}). With `w = ±a + sh` (`sh` = +1 for even parity,
/// −1 for odd), `|w| = a + 1` when `t_i == p` and `a − 1` otherwise (one masked subtract of
/// 2), and `w < 0` exactly when `t_i` is set (`a ≥ 2 > 1`).
///
/// Returns the `|w|` registers and the negation masks; `n` (1..=64) codes are read from
/// `codes` (masked loads past `n`; registers past `⌈n/8⌉` are left zero).
#[inline(always)]
pub(super) unsafe fn e8p_group_vbmi(
    planes: &[[__m512i; 4]; 3],
    codes: *const u16,
    n: usize,
) -> ([__m512i; 8], [u64; 8]) {
    let (c0, c1) = if n == 64 {
        (ld64(codes as *const u8), ld64(codes.add(32) as *const u8))
    } else {
        let k0 = if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
        let k1 = if n > 32 { (1u32 << (n - 32)) - 1 } else { 0 };
        (
            _mm512_maskz_loadu_epi16(k0, codes as *const i16),
            _mm512_maskz_loadu_epi16(k1, codes.add(32) as *const i16),
        )
    };
    let g = _mm512_permutex2var_epi8(c0, ld64(E8P_PATTERN_BYTES.as_ptr()), c1);
    let s = _mm512_permutex2var_epi8(c0, ld64(E8P_SIGN_BYTES.as_ptr()), c1);
    let kh = _mm512_movepi8_mask(g);
    let lo = lookup256(&planes[0], g, kh);
    let hi = lookup256(&planes[1], g, kh);
    let fx = lookup256(&planes[2], g, kh);
    // Byte parity within 16-bit lanes: bits shifted in from the byte above reach only bits
    // 4..7, which the later steps never read into bit 0.
    let mut p = _mm512_xor_si512(s, _mm512_srli_epi16(s, 4));
    p = _mm512_xor_si512(p, _mm512_srli_epi16(p, 2));
    p = _mm512_and_si512(
        _mm512_xor_si512(p, _mm512_srli_epi16(p, 1)),
        _mm512_set1_epi8(1),
    );
    let t = _mm512_ternarylogic_epi32(s, p, fx, 0x96);
    let m1 = _mm512_xor_si512(t, _mm512_sub_epi8(_mm512_setzero_si512(), p));
    let tm: [u64; 8] = std::mem::transmute(t);
    let mm: [u64; 8] = std::mem::transmute(m1);
    let shifts = ld64(E8P_SHIFTS.as_ptr());
    let mag1 = ld64(E8P_MAG1.as_ptr());
    let two = _mm512_set1_epi8(2);
    let mut out = [_mm512_setzero_si512(); 8];
    for k in 0..n.div_ceil(8) {
        let q = _mm512_permutex2var_epi8(lo, ld64(E8P_QWORD_IDX[k].as_ptr()), hi);
        let i = _mm512_multishift_epi64_epi8(shifts, q);
        let a1 = _mm512_permutexvar_epi8(i, mag1);
        out[k] = _mm512_mask_sub_epi8(a1, mm[k], a1, two);
    }
    (out, tm)
}

/// The three plane tables of [`e8p_group_vbmi`] as registers.
#[inline(always)]
pub(super) unsafe fn e8p_planes_vbmi() -> [[__m512i; 4]; 3] {
    let pl = &*super::E8P_PLANES;
    [plane_regs(&pl.lo), plane_regs(&pl.hi), plane_regs(&pl.fix)]
}

/// E8P codes `codes[..kc]` decoded as [`decode_e8p_avx512`] does (the same bytes, tested on
/// every code), 64 codes per step by [`e8p_group_vbmi`] (no gather, no scalar tail).
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; `codes` holds `kc` codes and `dst` room for `8·kc` bytes.
#[inline(always)]
pub(super) unsafe fn decode_e8p_vbmi<const BIASED: bool>(
    codes: *const u16,
    kc: usize,
    dst: *mut i8,
) {
    let planes = e8p_planes_vbmi();
    let zero = _mm512_setzero_si512();
    let mut c = 0;
    while c < kc {
        let n = (kc - c).min(64);
        let (aw, neg) = e8p_group_vbmi(&planes, codes.add(c), n);
        for k in 0..n.div_ceil(8) {
            let mut w = _mm512_mask_sub_epi8(aw[k], neg[k], zero, aw[k]);
            if BIASED {
                w = _mm512_xor_si512(w, _mm512_set1_epi8(-128));
            }
            let d = dst.add(8 * (c + 8 * k)) as *mut __m512i;
            let left = n - 8 * k;
            if left >= 8 {
                _mm512_storeu_si512(d, w);
            } else {
                _mm512_mask_storeu_epi8(d as *mut i8, (1u64 << (8 * left)) - 1, w);
            }
        }
        c += 64;
    }
}

/// Bytes 0..4 of qword `c` of output register `k` of a 64-code E81 group: byte `8k + c` of
/// the first table and of the second (`vpermi2b` over two looked-up planes), twice; bytes
/// 4..8 are never read.
static E81_QWORD_IDX: [[u8; 64]; 8] = {
    let mut a = [[0u8; 64]; 8];
    let mut k = 0;
    while k < 8 {
        let mut c = 0;
        while c < 8 {
            let (lo, hi) = ((8 * k + c) as u8, (64 + 8 * k + c) as u8);
            a[k][8 * c] = lo;
            a[k][8 * c + 1] = hi;
            a[k][8 * c + 2] = lo;
            a[k][8 * c + 3] = hi;
            c += 1;
        }
        k += 1;
    }
    a
};

/// `vpmultishiftqb` controls: byte `i` of each qword starts at bit `4i` (coordinate `i`'s
/// nibble in the low four bits).
static E81_SHIFTS: [u8; 64] = {
    let mut a = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        a[j] = 4 * (j % 8) as u8;
        j += 1;
    }
    a
};

/// The integer weight of a nibble `n = w + 4` as a `vpermb` table (index = the low six
/// bits, of which only the nibble is meaningful): `n − 4`, or `n − 4 + 128` (`BIASED`).
const fn e81_nibble_values(biased: bool) -> [u8; 64] {
    let mut a = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        let w = (j % 16) as i32 - 4;
        a[j] = (if biased { w + 128 } else { w }) as u8;
        j += 1;
    }
    a
}
static E81_VALUES: [u8; 64] = e81_nibble_values(false);
static E81_VALUES_BIASED: [u8; 64] = e81_nibble_values(true);

/// E81 codes `codes[..kc]` decoded as [`decode_e81_biased`] does (`BIASED`; else the int8
/// weights themselves, [`super::E81_I8`]'s bytes), 64 codes per step without a table load
/// per code (AVX-512 VBMI): the four nibble planes ([`super::E81_PLANES`], in registers) are
/// looked up for 64 codes at once (two `vpermi2b` and a blend each); per output register of
/// eight codes, two `vpermi2b` and a blend put each code's four plane bytes in bytes 0..4 of
/// its qword, `vpmultishiftqb` moves coordinate `i`'s nibble to byte `i`, and `vpermb` maps
/// it to the weight. The last partial group is read and stored under masks.
///
/// # Safety
/// AVX-512 F/BW/VL/VBMI; `codes` holds `kc` codes and `dst` room for `8·kc` bytes.
#[inline(always)]
pub(super) unsafe fn decode_e81_vbmi<const BIASED: bool>(
    codes: *const u8,
    kc: usize,
    dst: *mut i8,
) {
    let planes: [[__m512i; 4]; 4] = std::array::from_fn(|p| plane_regs(&super::E81_PLANES[p]));
    let shifts = ld64(E81_SHIFTS.as_ptr());
    let values = ld64(if BIASED {
        E81_VALUES_BIASED.as_ptr()
    } else {
        E81_VALUES.as_ptr()
    });
    // Bytes 2 and 3 of every qword come from the second pair of planes.
    let upper: __mmask64 = 0x0C0C_0C0C_0C0C_0C0C;
    let mut c = 0;
    while c < kc {
        let n = (kc - c).min(64);
        let g = if n == 64 {
            ld64(codes.add(c))
        } else {
            _mm512_maskz_loadu_epi8((1u64 << n) - 1, codes.add(c) as *const i8)
        };
        let kh = _mm512_movepi8_mask(g);
        let l: [__m512i; 4] = std::array::from_fn(|p| lookup256(&planes[p], g, kh));
        for k in 0..n.div_ceil(8) {
            let idx = ld64(E81_QWORD_IDX[k].as_ptr());
            let q = _mm512_mask_blend_epi8(
                upper,
                _mm512_permutex2var_epi8(l[0], idx, l[1]),
                _mm512_permutex2var_epi8(l[2], idx, l[3]),
            );
            let w = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(shifts, q), values);
            let d = dst.add(8 * (c + 8 * k)) as *mut __m512i;
            let left = n - 8 * k;
            if left >= 8 {
                _mm512_storeu_si512(d, w);
            } else {
                _mm512_mask_storeu_epi8(d as *mut i8, (1u64 << (8 * left)) - 1, w);
            }
        }
        c += 64;
    }
}

/// One E8P weight row (`kc` codes) against one activation row at M = 1, decoded in
/// registers by [`e8p_group_vbmi`] and dotted at once, without the row buffer: `|w|` against
/// the activations negated where `w < 0` (`vpdpbusd`, exact), the block coefficient `d_b`
/// from [`Q8Acts::dx`], one FMA per two blocks into the contract's accumulators (block `b`
/// in register `(b / 2) mod 2`, lanes `8·(b mod 2)..`), so the value is the contract's bit
/// for bit. A last register holding one block (4 codes) takes lanes 0..8 only.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/VBMI; `codes` holds `kc` codes (`kc % 4 == 0`), `q` `8·kc` int8 and
/// `dx` `2·kc` floats.
#[inline(always)]
unsafe fn e8p_row_m1_vbmi(
    planes: &[[__m512i; 4]; 3],
    codes: *const u16,
    kc: usize,
    q: *const i8,
    dx: *const f32,
) -> f32 {
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut c = 0;
    while c + 64 <= kc {
        let (aw, neg) = e8p_group_vbmi(planes, codes.add(c), 64);
        for k in 0..8 {
            let o = 8 * (c + 8 * k);
            let qv = _mm512_loadu_si512(q.add(o) as *const __m512i);
            let sq = _mm512_mask_sub_epi8(qv, neg[k], zero, qv);
            let p = _mm512_dpbusd_epi32(zero, aw[k], sq);
            acc[k & 1] = _mm512_fmadd_ps(
                _mm512_loadu_ps(dx.add(o / 4)),
                _mm512_cvtepi32_ps(p),
                acc[k & 1],
            );
        }
        c += 64;
    }
    if c < kc {
        let n = kc - c;
        let (aw, neg) = e8p_group_vbmi(planes, codes.add(c), n);
        for k in 0..n.div_ceil(8) {
            let o = 8 * (c + 8 * k);
            // A whole register is two blocks; a last one of 4 codes is one.
            let (kb, kf): (__mmask64, __mmask16) = if n - 8 * k >= 8 {
                (u64::MAX, 0xFFFF)
            } else {
                (u32::MAX as u64, 0x00FF)
            };
            let qv = _mm512_maskz_loadu_epi8(kb, q.add(o));
            let sq = _mm512_mask_sub_epi8(qv, neg[k], zero, qv);
            let p = _mm512_dpbusd_epi32(zero, aw[k], sq);
            let cv = _mm512_maskz_loadu_ps(kf, dx.add(o / 4));
            acc[k & 1] = _mm512_mask3_fmadd_ps(cv, _mm512_cvtepi32_ps(p), acc[k & 1], kf);
        }
    }
    // u = (acc0 + acc2) + (acc1 + acc3), then the 8-lane tree (as `group512`).
    let (lo0, hi0) = (
        _mm512_castps512_ps256(acc[0]),
        _mm512_extractf32x8_ps(acc[0], 1),
    );
    let (lo1, hi1) = (
        _mm512_castps512_ps256(acc[1]),
        _mm512_extractf32x8_ps(acc[1], 1),
    );
    hsum256(_mm256_add_ps(
        _mm256_add_ps(lo0, lo1),
        _mm256_add_ps(hi0, hi1),
    ))
}

/// `2·e2m1 + 12` for the 16 codes (unsigned bytes in 0..=24).
static MXFP4_U12: [u8; 16] = {
    let mut a = [0u8; 16];
    let mut j = 0;
    while j < 16 {
        a[j] = (MXFP4_I8[j] + 12) as u8;
        j += 1;
    }
    a
};

/// Bytes ahead of the weights read that the M = 1 row kernels ([`mx4_rows`], and the AVX2
/// rows of MXFP4) ask the cache for, as the exact kernels and the bf16 row kernel do.
const PREFETCH: usize = 2048;

/// Weight rows the MXFP4 row kernels take against each group of four activation rows before
/// moving on (see [`rows_avx512_impl`]).
const MX4_PANEL: usize = 8;

/// The block factors of `n` (1..=16) blocks: the E8M0 bytes at `e` as
/// [`block_factors_avx512`] reads them (lanes past `n` are not read from memory).
#[inline(always)]
unsafe fn mx4_fac16(e: *const u8, n: usize) -> __m512 {
    let k: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
    let v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, e as *const i8));
    let mut bits = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    let k0 = _mm512_cmpeq_epi32_mask(v, _mm512_setzero_si512());
    let k1 = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(1));
    let kf = _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32(0xFF));
    bits = _mm512_mask_mov_epi32(bits, k0, _mm512_set1_epi32(0x0020_0000));
    bits = _mm512_mask_mov_epi32(bits, k1, _mm512_set1_epi32(0x0040_0000));
    bits = _mm512_mask_mov_epi32(bits, kf, _mm512_set1_epi32(f32::NAN.to_bits() as i32));
    _mm512_castsi512_ps(bits)
}

/// One MXFP4 weight row (`nb` blocks: packed bytes at `p`, E8M0 bytes at `e`) against the
/// `MR` (1..=4) activation rows `i..i + MR` of `a`, four blocks (64 packed bytes) per step: the
/// low and high nibbles (`and`, shift) looked up as `w + 12` (two `vpshufb`), interleaved
/// back into column order within each 128-bit lane (`vpunpck{l,h}bw`: register 0 holds the
/// first 16 weights of each of the four blocks, register 1 the last 16) once for all `MR`
/// rows, multiplied as unsigned bytes with each row's [`Q8Acts::qmx4`] (the activations in
/// that order) by `vpdpbusd` starting from its [`Q8Acts::n12mx4`] (`−12·Σq`), so each 32-bit
/// lane is exactly the contract's `p[b][g]` (register 0: `g` < 4, register 1: `g` ≥ 4, block
/// `b + lane/4`); then one FMA per register with the row's block coefficients spread four
/// lanes each. Lane `4l + g` of a row's two accumulators is the contract's `acc[l][g]` and
/// `acc[l][g + 4]` (`b mod 4 = l`, since steps start at multiples of four), and the blocks
/// past the last whole step run the contract in scalar code on them, so each value is the
/// contract's bit for bit. Output `j` goes to `out[(i + j) · ld]`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI; `p` holds `16·nb` bytes and `e` `nb`; `a` has rows `i..i + MR` of
/// `32·nb` with `qmx4` and `n12mx4` filled; `out` as in `super::rows_scalar`.
#[inline(always)]
unsafe fn mx4_rows<const MR: usize>(
    p: *const u8,
    e: *const u8,
    a: &Q8Acts,
    i: usize,
    nb: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, full) = (nb * QBLOCK, nb / 4 * 4);
    let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(MXFP4_U12.as_ptr() as *const __m128i));
    let nib = _mm512_set1_epi8(0x0F);
    let qp: [*const i8; MR] = std::array::from_fn(|j| a.qmx4.as_ptr().add((i + j) * cols));
    let np: [*const i32; MR] = std::array::from_fn(|j| a.n12mx4.as_ptr().add((i + j) * cols / 4));
    let d: [*const f32; MR] = std::array::from_fn(|j| a.d.as_ptr().add((i + j) * nb));
    let base = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let idx: [__m512i; 4] =
        std::array::from_fn(|j| _mm512_add_epi32(base, _mm512_set1_epi32(4 * j as i32)));
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    let mut b = 0;
    while b < full {
        // The four cache lines of weights this step reads, PREFETCH bytes ahead.
        let ahead = p.add(b * QBLOCK / 2) as *const i8;
        for l in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(PREFETCH + 64 * l));
        }
        let n = (nb - b).min(16);
        let f16 = mx4_fac16(e.add(b), n);
        let k: __mmask16 = if n >= 16 { 0xFFFF } else { (1u16 << n) - 1 };
        let c16: [__m512; MR] =
            std::array::from_fn(|j| _mm512_mul_ps(f16, _mm512_maskz_loadu_ps(k, d[j].add(b))));
        for s in 0..((full - b) / 4).min(4) {
            let bb = b + 4 * s;
            let v = _mm512_loadu_si512(p.add(bb * QBLOCK / 2) as *const __m512i);
            let wl = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, nib));
            let wh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
            let (w0, w1) = (_mm512_unpacklo_epi8(wl, wh), _mm512_unpackhi_epi8(wl, wh));
            let o = bb * QBLOCK;
            for j in 0..MR {
                let p0 = _mm512_dpbusd_epi32(
                    _mm512_loadu_si512(np[j].add(o / 4) as *const __m512i),
                    w0,
                    _mm512_loadu_si512(qp[j].add(o) as *const __m512i),
                );
                let p1 = _mm512_dpbusd_epi32(
                    _mm512_loadu_si512(np[j].add(o / 4 + 16) as *const __m512i),
                    w1,
                    _mm512_loadu_si512(qp[j].add(o + 64) as *const __m512i),
                );
                let cv = _mm512_permutexvar_ps(idx[s], c16[j]);
                lo[j] = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(p0), lo[j]);
                hi[j] = _mm512_fmadd_ps(cv, _mm512_cvtepi32_ps(p1), hi[j]);
            }
        }
        b += 16;
    }
    for j in 0..MR {
        let v = if full == nb {
            finish_m1(lo[j], hi[j])
        } else {
            let mut acc = m1_acc(lo[j], hi[j]);
            let dj = d[j];
            tail_blocks(
                Row::Mx4(p),
                a.q.as_ptr().add((i + j) * cols),
                |bb| super::e8m0_half(*e.add(bb)) * *dj.add(bb),
                &mut acc,
                full,
                nb,
            );
            super::finish_ref(&acc)
        };
        *out.add((i + j) * ld) = v;
    }
}

/// The contract's accumulators from the M = 1 kernels' two registers: lane `4l + g` of `lo`
/// is `acc[l][g]`, of `hi` `acc[l][g + 4]`.
#[inline(always)]
pub(super) unsafe fn m1_acc(lo: __m512, hi: __m512) -> [[f32; 8]; 4] {
    let lv: [f32; 16] = std::mem::transmute(lo);
    let hv: [f32; 16] = std::mem::transmute(hi);
    let mut acc = [[0f32; 8]; 4];
    for l in 0..4 {
        for g in 0..4 {
            acc[l][g] = lv[4 * l + g];
            acc[l][g + 4] = hv[4 * l + g];
        }
    }
    acc
}

/// Steps 3–4 of the contract ([`super::finish_ref`]) on the M = 1 kernels' two registers (as
/// [`m1_acc`] lays them out), in registers and in the same order, so the same bits:
/// `u[g] = (acc[0][g] + acc[2][g]) + (acc[1][g] + acc[3][g])` is the 512 → 256 → 128 halving
/// of each register (`lo` gives `u[0..4]`, `hi` `u[4..8]`), then `v[k] = u[k] + u[k + 4]`,
/// and the result `(v0 + v2) + (v1 + v3)`.
#[inline(always)]
pub(super) unsafe fn finish_m1(lo: __m512, hi: __m512) -> f32 {
    let half = |x: __m512| {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(x),
            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)),
        );
        _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1))
    };
    let v = _mm_add_ps(half(lo), half(hi));
    let w = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)))
}

/// Sixteen activations times `id`, rounded to nearest even, clamped to ±127 (NaN → 0), as
/// int8 (a function, not a closure: closures do not inherit the target features).
#[inline(always)]
unsafe fn q16(v: __m512, id: __m512) -> __m128i {
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(v, id),
    );
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t, t);
    let t = _mm512_min_ps(
        _mm512_max_ps(t, _mm512_set1_ps(-super::QMAX)),
        _mm512_set1_ps(super::QMAX),
    );
    let t = _mm512_mask_mov_ps(t, nan, _mm512_setzero_ps());
    _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(t))
}

/// [`super::quantize_block`] for every block of 32 in `x`, 16 lanes at a time, the same
/// bits: the block maximum of `|x|` (exact in any order), `127 / amax` and `amax / 127` as
/// scalar divisions, `x · (127 / amax)` rounded to nearest even (`vrndscaleps`), clamped to
/// ±127 with NaN read as 0 (Rust's `clamp` then `as i8`), non-finite blocks 0 with `d` NaN.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL; `q` holds `x.len()` bytes and `d` `x.len() / 32` floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
pub(super) unsafe fn quantize_blocks_avx512(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    let nb = x.len() / QBLOCK;
    assert!(q.len() >= nb * QBLOCK && d.len() >= nb);
    let inf = _mm512_set1_ps(f32::INFINITY);
    for b in 0..nb {
        let p = x.as_ptr().add(b * QBLOCK);
        let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let (a0, a1) = (_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        // |v| < inf is false for infinities and NaN.
        let fin =
            _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a0, inf) & _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a1, inf);
        let qo = q.as_mut_ptr().add(b * QBLOCK) as *mut __m256i;
        if fin != 0xFFFF {
            _mm256_storeu_si256(qo, _mm256_setzero_si256());
            d[b] = f32::NAN;
            continue;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        if amax == 0.0 {
            _mm256_storeu_si256(qo, _mm256_setzero_si256());
            d[b] = 0.0;
            continue;
        }
        let id = _mm512_set1_ps(super::QMAX / amax);
        _mm256_storeu_si256(qo, _mm256_set_m128i(q16(v1, id), q16(v0, id)));
        d[b] = amax / super::QMAX;
    }
}

/// [`decode_e8p_vbmi`] (for the tests and the timing breakdown).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VBMI; as [`decode_e8p_vbmi`].
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma")]
pub(super) unsafe fn decode_e8p_vbmi_test(biased: bool, codes: &[u16], dst: &mut [i8]) {
    assert!(dst.len() >= 8 * codes.len());
    if biased {
        decode_e8p_vbmi::<true>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
    } else {
        decode_e8p_vbmi::<false>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
    }
}

/// [`decode_e81_vbmi`] (for the tests).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VBMI; as [`decode_e81_vbmi`].
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma")]
pub(super) unsafe fn decode_e81_vbmi_test(biased: bool, codes: &[u8], dst: &mut [i8]) {
    assert!(dst.len() >= 8 * codes.len());
    if biased {
        decode_e81_vbmi::<true>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
    } else {
        decode_e81_vbmi::<false>(codes.as_ptr(), codes.len(), dst.as_mut_ptr())
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
unsafe fn prep_row<const AVX512: bool, const VBMI: bool>(
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
            if VBMI {
                decode_e8p_vbmi::<true>(codes.as_ptr().add(r * kc), kc, s.w.as_mut_ptr());
            } else {
                decode_e8p_avx512::<true>(codes.as_ptr().add(r * kc), kc, s.w.as_mut_ptr());
            }
            Row::U8(s.w.as_ptr() as *const u8)
        }
        IntSrc::E81 { codes, .. } if AVX512 => {
            // The same `w + 128` form: 64 codes per step from the nibble planes (VBMI), else
            // one 8-byte load from the 2 KiB table per code.
            let kc = cols / 8;
            let row = &codes[r * kc..(r + 1) * kc];
            if VBMI {
                decode_e81_vbmi::<true>(row.as_ptr(), kc, s.w.as_mut_ptr());
            } else {
                decode_e81_biased(row, &mut s.w[..cols]);
            }
            Row::U8(s.w.as_ptr() as *const u8)
        }
        IntSrc::E8p { .. }
        | IntSrc::E81 { .. }
        | IntSrc::Affine4 { .. }
        | IntSrc::Registered(_) => {
            src.decode_row_fast(r, cols, &mut s.w);
            Row::Buf(s.w.as_ptr())
        }
    }
}

/// E81 codes to the row's integer weights as `w + 128` bytes (the affine-8 form the AVX-512
/// row kernels take as [`Row::U8`]): [`super::E81_I8`] with every byte's sign bit flipped.
#[inline(always)]
pub(super) fn decode_e81_biased(codes: &[u8], dst: &mut [i8]) {
    for (d8, &c) in dst.chunks_exact_mut(8).zip(codes) {
        let v = super::E81_I8[c as usize] ^ 0x8080_8080_8080_8080;
        d8.copy_from_slice(&v.to_le_bytes().map(|b| b as i8));
    }
}

#[inline(always)]
pub(super) unsafe fn hsum256(b: __m256) -> f32 {
    let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
    let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
    let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
    _mm_cvtss_f32(e)
}

/// Eight vectors reduced at once, each by the contract's tree
/// `((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7))` (the additions [`hsum256`] makes, so the
/// same bits as eight calls of it), in transposed form: the 128-bit halves added pairwise,
/// then the 64-bit pairs, then the neighbours.
///
/// # Safety
/// AVX (the caller's target features).
#[inline(always)]
pub(super) unsafe fn reduce8(x: [__m256; 8]) -> [f32; 8] {
    // [a0+a4, a1+a5, a2+a6, a3+a7 | b0+b4, ...] for the pairs (a, b) = (x0, x1), ...
    let half = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps(a, b, 0x20),
            _mm256_permute2f128_ps(a, b, 0x31),
        )
    };
    let (s01, s23, s45, s67) = (
        half(x[0], x[1]),
        half(x[2], x[3]),
        half(x[4], x[5]),
        half(x[6], x[7]),
    );
    // [(a0+a4)+(a2+a6), (a1+a5)+(a3+a7)] of a and c in the low lane, b and d in the high.
    let pairs = |p: __m256, q: __m256| {
        _mm256_add_ps(_mm256_shuffle_ps(p, q, 0x44), _mm256_shuffle_ps(p, q, 0xEE))
    };
    let (t0, t1) = (pairs(s01, s23), pairs(s45, s67));
    // [x0, x2, x4, x6 | x1, x3, x5, x7] reduced.
    let red = _mm256_add_ps(
        _mm256_shuffle_ps(t0, t1, 0x88),
        _mm256_shuffle_ps(t0, t1, 0xDD),
    );
    let mut v = [0f32; 8];
    _mm256_storeu_ps(v.as_mut_ptr(), red);
    [v[0], v[4], v[1], v[5], v[2], v[6], v[3], v[7]]
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
unsafe fn rows_avx512_impl<const VNNI: bool, const VBMI: bool>(
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
        if let (true, true, 1, IntSrc::E8p { codes, scales }) = (VNNI, VBMI, a.m, *src) {
            // M = 1: decoded in registers straight into the dot (no row buffer).
            let planes = e8p_planes_vbmi();
            let kc = cols / 8;
            for r in r0..r1 {
                let v = e8p_row_m1_vbmi(
                    &planes,
                    codes.as_ptr().add(r * kc),
                    kc,
                    a.q.as_ptr(),
                    a.dx.as_ptr(),
                );
                *out.add(r) = v * (scales[r] * 0.25);
            }
            SCRATCH.with(|c| c.replace(taken));
            return;
        }
        // (`qmx4` is filled for every `Q8Acts` below the GEMM's rows; checked since the
        // reads are unchecked.)
        if let (true, IntSrc::Mxfp4 { packed, scales }, true) = (
            VNNI,
            *src,
            a.qmx4.len() == a.m * cols && a.n12mx4.len() == a.m * cols / 4,
        ) {
            // Nibbles to `w + 12` bytes in registers once per weight row and group of up to
            // four activation rows, one `vpdpbusd` per two blocks and activation row; a panel
            // of MX4_PANEL weight rows meets every group before the next panel, so a group's
            // activations are read from L1 by every row of the panel.
            let mut rp = r0;
            while rp < r1 {
                let re = (rp + MX4_PANEL).min(r1);
                let mut i = 0;
                while i < a.m {
                    let mr = (a.m - i).min(4);
                    for r in rp..re {
                        let (p, e) = (
                            packed.as_ptr().add(r * cols / 2),
                            scales.as_ptr().add(r * nb),
                        );
                        let o = out.add(r);
                        match mr {
                            1 => mx4_rows::<1>(p, e, a, i, nb, o, ld),
                            2 => mx4_rows::<2>(p, e, a, i, nb, o, ld),
                            3 => mx4_rows::<3>(p, e, a, i, nb, o, ld),
                            _ => mx4_rows::<4>(p, e, a, i, nb, o, ld),
                        }
                    }
                    i += mr;
                }
                rp = re;
            }
            SCRATCH.with(|c| c.replace(taken));
            return;
        }
        for r in r0..r1 {
            let row = prep_row::<true, VBMI>(src, r, cols, s);
            let post = src.post(r);
            let f = s.f.as_ptr();
            let mut i = 0;
            while i < a.m {
                let mr = (a.m - i).min(4);
                // E8P rows have block factor 1: their coefficients are the activations'
                // block scales as they lie (`Q8Acts::dx`), no multiply or permute.
                let unit = matches!(src, IntSrc::E8p { .. } | IntSrc::E81 { .. });
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
            if src.has_bias() {
                bias_rows_avx512(src, a, r, out, ld);
            }
        }
        SCRATCH.with(|c| c.replace(taken));
    }
}

/// Step 5 of the contract for weight row `r` (affine-8), added to every activation row's
/// result, one 512-bit FMA per 16 blocks.
#[inline(always)]
pub(super) unsafe fn bias_rows_avx512(
    src: &IntSrc,
    a: &Q8Acts,
    r: usize,
    out: *mut f32,
    ld: usize,
) {
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
        let u = [
            _mm512_castps512_ps256(acc[j][0]),
            _mm512_extractf32x8_ps(acc[j][0], 1),
            _mm512_castps512_ps256(acc[j][1]),
            _mm512_extractf32x8_ps(acc[j][1], 1),
        ];
        let dj = d[j];
        let s = finish_row(u, row, q[j], |bb| *f.add(bb) * *dj.add(bb), full, nb);
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
    rows_avx512_impl::<true, false>(src, a, r0, r1, out, ld)
}

/// AVX-512 VNNI rows `r0..r1` with the VBMI E8P decoder.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ/VNNI/VBMI; `out` as in `super::rows_scalar`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma")]
pub(super) unsafe fn rows_avx512_vbmi(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    rows_avx512_impl::<true, true>(src, a, r0, r1, out, ld)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn bw(src: &IntSrc, a: &Q8Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    rows_avx512_impl::<false, false>(src, a, r0, r1, out, ld)
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
            let row = prep_row::<false, false>(src, r, cols, s);
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
        if let Row::Mx4(p) = row {
            // This step's cache line of packed weights, PREFETCH bytes ahead.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(b * QBLOCK / 2 + PREFETCH) as *const i8);
        }
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
        let dj = d[j];
        let s = finish_row(acc[j], row, q[j], |bb| *f.add(bb) * *dj.add(bb), full, nb);
        *out.add((i + j) * ld + r) = post.map_or(s, |p| s * p);
    }
}

/// Step 5 of the contract (sixteen FMA lanes over the blocks, then the fixed tree).
///
/// # Safety
/// AVX-512 F; `bb` and `ds` hold `nb` floats.
#[inline(always)]
pub(super) unsafe fn bias_avx512(bb: *const f32, ds: *const f32, nb: usize) -> f32 {
    hsum256(bias_lanes(bb, ds, nb))
}

/// Step 5's sixteen lanes for one row folded to eight (`v[j] = L[j] + L[j+8]`; the fixed
/// tree of [`hsum256`] or [`reduce8`] finishes it): `β_b` at `bb` times `e_b` at `ds`, one FMA
/// per 16 blocks, the last masked.
///
/// # Safety
/// AVX-512 F; `bb` and `ds` hold `nb` floats.
#[inline(always)]
pub(super) unsafe fn bias_lanes(bb: *const f32, ds: *const f32, nb: usize) -> __m256 {
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
    _mm256_add_ps(
        _mm512_castps512_ps256(l),
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l), 1)),
    )
}
