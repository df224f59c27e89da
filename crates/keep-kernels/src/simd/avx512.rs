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

use super::{affine_groups, affine_param, e8m0_x256, scale_x256, Src};
use crate::codec::e8m0_to_f32;
use crate::rows::block_scale;
use crate::weight::BlockScales;

/// Decodes 16 consecutive weights of row `r` starting at column `k` (`k % 16 == 0`).
trait Dec {
    unsafe fn dec(&self, r: usize, k: usize) -> __m512;

    /// The 64 weights of row `r` from column `k` (`k % 64 == 0`, `k + 64 <= cols`) as four
    /// chunks: the same values as four [`Dec::dec`] calls (decoders override it when 64 at a
    /// time is cheaper). No `target_feature` here, so it is inlined (and the `dec` calls with
    /// it) into the kernel loop.
    #[inline(always)]
    unsafe fn dec64(&self, r: usize, k: usize) -> [__m512; 4] {
        [
            self.dec(r, k),
            self.dec(r, k + 16),
            self.dec(r, k + 32),
            self.dec(r, k + 48),
        ]
    }

    /// Decoders that set this give the 64 weights from column `k` in stride-4 order instead
    /// ([`Dec::dec64_s4`]) and multiply them with [`Dec::x_s4`], the inputs in the same order.
    const S4: bool = false;

    /// Register `q` lane `d` = weight `k + 4d + q` (only when [`Dec::S4`]).
    #[inline(always)]
    unsafe fn dec64_s4(&self, r: usize, k: usize) -> [__m512; 4] {
        self.dec64(r, k)
    }

    /// The inputs (`m × cols`) with each whole 64-column group in [`s4_order`] (only when
    /// [`Dec::S4`]).
    #[inline(always)]
    fn x_s4(&self) -> *const f32 {
        std::ptr::null()
    }
}

/// Copy `x` (`m` rows of `cols`) into `dst` with every whole 64-column group `g` stored as
/// `dst[g + 16q + d] = x[g + 4d + q]` (the stride-4 order of [`Dec::dec64_s4`]); columns past
/// the last whole group are copied as they are.
///
/// Register `q` of a group: lane `d` is input register `d / 4` lane `4(d mod 4) + q`, so one
/// index serves both two-source permutes (registers 0/1 for lanes 0..7, 2/3 for 8..15).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn s4_order(x: &[f32], m: usize, cols: usize, dst: &mut Vec<f32>) {
    assert!(x.len() >= m * cols);
    dst.clear();
    dst.resize(m * cols, 0.0);
    let full64 = cols / 64 * 64;
    let idx: [[i32; 16]; 4] = std::array::from_fn(|q| {
        std::array::from_fn(|d| ((d / 4) & 1) as i32 * 16 + 4 * (d % 4) as i32 + q as i32)
    });
    for i in 0..m {
        let (xr, dr) = (
            &x[i * cols..(i + 1) * cols],
            &mut dst[i * cols..(i + 1) * cols],
        );
        for g in (0..full64).step_by(64) {
            let v: [__m512; 4] =
                std::array::from_fn(|c| _mm512_loadu_ps(xr.as_ptr().add(g + 16 * c)));
            for (q, ix) in idx.iter().enumerate() {
                let ix = _mm512_loadu_si512(ix.as_ptr() as *const __m512i);
                let lo = _mm512_permutex2var_ps(v[0], ix, v[1]);
                let hi = _mm512_permutex2var_ps(v[2], ix, v[3]);
                _mm512_storeu_ps(
                    dr.as_mut_ptr().add(g + 16 * q),
                    _mm512_mask_mov_ps(lo, 0xFF00, hi),
                );
            }
        }
        dr[full64..].copy_from_slice(&xr[full64..]);
    }
}

/// Accumulators kept in stride-4 order (register `q` lane `d` = accumulator `d / 4` lane
/// `4(d mod 4) + q`) back to the plain order: accumulator `a` lane `l` = register `l mod 4`
/// lane `4a + l/4`. Pure data movement (two two-source permutes and a blend per register).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn from_s4(p: [__m512; 4]) -> [__m512; 4] {
    let mut out = [_mm512_setzero_ps(); 4];
    for (a, o) in out.iter_mut().enumerate() {
        // Lane l takes lane 4a + l/4 of register l mod 4: index bit 4 picks the odd register
        // of each pair, the blend (lanes with l mod 4 in {2, 3}) the second pair.
        let idx: [i32; 16] =
            std::array::from_fn(|l| ((l % 4) & 1) as i32 * 16 + 4 * a as i32 + (l / 4) as i32);
        let idx = _mm512_loadu_si512(idx.as_ptr() as *const __m512i);
        let r01 = _mm512_permutex2var_ps(p[0], idx, p[1]);
        let r23 = _mm512_permutex2var_ps(p[2], idx, p[3]);
        *o = _mm512_mask_mov_ps(r01, 0xCCCC, r23);
    }
    out
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

/// 32 E4M3FN bytes → two registers of f32 values times 2^-8 (as [`e4m3_x2m8`]) with 512-bit
/// integer ops: sign-extending each byte to 16 bits and shifting left by 7 puts the sign at bit
/// 15 and the magnitude at bits 7..14 with a copy of the sign at bit 14, which the mask clears:
/// the fp16 `(b & 0x80) << 8 | (b & 0x7F) << 7` in three ops per 32 bytes. NaN codes are NOT
/// patched: callers check [`any_e4m3_nan64`] first.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn e4m3_x2m8_32(p: *const u8) -> (__m512, __m512) {
    let v = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p as *const __m256i));
    let h = _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16(0xBF80u16 as i16));
    (
        _mm512_cvtph_ps(_mm512_castsi512_si256(h)),
        _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)),
    )
}

/// 16 E4M3FN bytes → f32 values times 2^-120, exactly, without a float conversion: each byte
/// sign-extended to 32 bits and shifted left by 20 puts the sign at bit 31 (copies at 27..30,
/// masked off) and the seven magnitude bits at 20..26, i.e. the f32 with the byte's exponent
/// field in the low four exponent bits and its mantissa on top of the f32 mantissa. Normal
/// codes become `2^(E−127)·(1+m/8)`, subnormal codes the f32 subnormal `(m/8)·2^−126`, zero
/// zero: `e4m3(b)·2^−120` in every case. NaN codes are NOT patched (callers check
/// [`any_e4m3_nan64`]). Callers multiply by `scale·2^120` when that is exact and finite, which
/// rounds the exact product once, as `e4m3(b) · scale` does.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn e4m3_x2m120(p: *const u8) -> __m512 {
    // The sign extension reads memory itself (written in asm: otherwise LLVM reuses the
    // 64-byte load of the code check and splits it with three extra lane extracts).
    let v: __m512i;
    std::arch::asm!(
        "vpmovsxbd {v}, xmmword ptr [{p}]",
        v = out(zmm_reg) v,
        p = in(reg) p,
        options(pure, readonly, nostack, preserves_flags)
    );
    _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_slli_epi32(v, 20),
        _mm512_set1_epi32(0x87F0_0000u32 as i32),
    ))
}

/// `s · 2^120` when that product is exact and finite (`|s| < 2^8`), for [`e4m3_x2m120`].
#[inline(always)]
fn scale_x2p120(s: f32) -> Option<f32> {
    let t = s * f32::from_bits((127 + 120) << 23);
    if t.is_finite() && t * f32::from_bits((127 - 120) << 23) == s {
        Some(t)
    } else {
        None
    }
}

/// Whether any of the 64 E4M3FN bytes at `p` is a code the fast decode [`e4m3_x2m120`] must
/// not meet: a NaN code (0x7F, 0xFF), a subnormal code (it would make an f32 subnormal, and a
/// multiply with a subnormal input takes a microcode assist, ~100 cycles a register) or a zero
/// (rare in real weights; sent the same way because it makes the test one compare). With
/// `u = 2·b + 2 (mod 256)` the sign drops out and NaN → 0, zero → 2, subnormals → 4..16,
/// normal codes → 18..254, so the test is `u < 17`: three ops per 64 bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn e4m3_not_normal64(p: *const u8) -> bool {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let u = _mm512_add_epi8(_mm512_add_epi8(v, v), _mm512_set1_epi8(2));
    _mm512_cmplt_epu8_mask(u, _mm512_set1_epi8(17)) != 0
}

/// Whether any of the 64 bytes at `p` is an E4M3FN NaN code (`0x7F`, `0xFF`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn any_e4m3_nan64(p: *const u8) -> bool {
    let v = _mm512_loadu_si512(p as *const __m512i);
    let m = _mm512_set1_epi8(0x7F);
    _mm512_cmpeq_epi8_mask(_mm512_and_si512(v, m), m) != 0
}

/// `2^(b−127) · 2^8` for E8M0 bytes `b <= 246` ([`e8m0_x256`]), a table so the broadcast is a
/// load; bytes 247..=255 hold NaN and are never read (callers check `b <= 246`).
static E8M0_X256: [f32; 256] = {
    let mut t = [f32::NAN; 256];
    let mut b = 0;
    while b <= 246 {
        t[b] = f32::from_bits(((b as u32) + 8) << 23);
        b += 1;
    }
    t
};

/// `2^(b−127) · 2^120` for E8M0 bytes `b <= 134`, for [`e4m3_x2m120`]; larger bytes hold NaN
/// and are never read (callers check `b <= 134`).
static E8M0_X2P120: [f32; 256] = {
    let mut t = [f32::NAN; 256];
    let mut b = 0;
    while b <= 134 {
        t[b] = f32::from_bits(((b as u32) + 120) << 23);
        b += 1;
    }
    t
};

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

    /// As [`Dec::dec`] ×4, with the same software prefetch as the MXFP8 decode (1,024 columns
    /// ahead: two cache lines of bf16), so that the kill test compares equals. Measured with
    /// `keep bench kill-tests --quick --only mxfp8-residents`, two alternated runs: bf16's
    /// chains 886/1071 → 803/774 ms. (The same prefetch made affine-8 slower, 613/645 →
    /// 776/763 ms, so affine-8 has none.)
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec64(&self, r: usize, k: usize) -> [__m512; 4] {
        let p = self.0.add((r * self.1 + k) * 2);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2048 + 64) as *const i8);
        [
            self.dec(r, k),
            self.dec(r, k + 16),
            self.dec(r, k + 32),
            self.dec(r, k + 48),
        ]
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

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec64(&self, r: usize, k: usize) -> [__m512; 4] {
        let i = r * self.2 + k;
        let p = self.0.add(i);
        let (b0, b1) = (*self.1.add(i / 32), *self.1.add(i / 32 + 1));
        // Software prefetch 1 KiB ahead (measured: the M = 1 residents chain goes from
        // ~1.37x to ~1.75x bf16's speed; a prefetch never faults past the end).
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(1024) as *const i8);
        if (b0 <= 134) & (b1 <= 134) && !e4m3_not_normal64(p) {
            let t0 = _mm512_set1_ps(*E8M0_X2P120.get_unchecked(b0 as usize));
            let t1 = _mm512_set1_ps(*E8M0_X2P120.get_unchecked(b1 as usize));
            [
                _mm512_mul_ps(e4m3_x2m120(p), t0),
                _mm512_mul_ps(e4m3_x2m120(p.add(16)), t0),
                _mm512_mul_ps(e4m3_x2m120(p.add(32)), t1),
                _mm512_mul_ps(e4m3_x2m120(p.add(48)), t1),
            ]
        } else if (b0 <= 246) & (b1 <= 246) && !any_e4m3_nan64(p) {
            mxfp8_fp16_64(p, b0, b1)
        } else {
            [
                self.dec(r, k),
                self.dec(r, k + 16),
                self.dec(r, k + 32),
                self.dec(r, k + 48),
            ]
        }
    }
}

/// 64 MXFP8 weights (no NaN codes, scale bytes `<= 246`) through the fp16 decode.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn mxfp8_fp16_64(p: *const u8, b0: u8, b1: u8) -> [__m512; 4] {
    let t0 = _mm512_set1_ps(*E8M0_X256.get_unchecked(b0 as usize));
    let t1 = _mm512_set1_ps(*E8M0_X256.get_unchecked(b1 as usize));
    let (v0, v1) = e4m3_x2m8_32(p);
    let (v2, v3) = e4m3_x2m8_32(p.add(32));
    [
        _mm512_mul_ps(v0, t0),
        _mm512_mul_ps(v1, t0),
        _mm512_mul_ps(v2, t1),
        _mm512_mul_ps(v3, t1),
    ]
}

/// E2M1 values (index = code).
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `e8m0_to_f32(b)` for every byte, so a scale broadcast is a load.
static E8M0_F32: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b < 256 {
        // As `codec::e8m0_to_f32` (the every-code test runs scales 0 and 254 through it).
        t[b] = match b {
            0 => f32::from_bits(0x0040_0000),
            255 => f32::NAN,
            _ => f32::from_bits((b as u32) << 23),
        };
        b += 1;
    }
    t
};

/// Packed codes, scales, columns, and the inputs in stride-4 order ([`s4_order`]).
struct Mxfp4D(*const u8, *const u8, usize, *const f32);
impl Dec for Mxfp4D {
    const S4: bool = true;

    /// 32 bytes → 64 weights in stride-4 order: bytes widened to 16 bits and or-ed with
    /// themselves shifted by 4, masked to `0x0F0F`, give one code per byte in column order
    /// (low nibble first); dword `d` then holds codes `4d..4d+3`, and shifting it right by
    /// `8q` puts code `4d + q` in its low bits. One two-table permute per register looks the
    /// codes up in `E2M1 · s0` (lanes 0..7, columns `k..k+32`) or `E2M1 · s1` (lanes 8..15,
    /// index bit 4 set): the products are those of the plain decode (`e2m1 · scale`, one
    /// rounding), computed once per 32-column block instead of once per weight.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec64_s4(&self, r: usize, k: usize) -> [__m512; 4] {
        let i = r * self.2 + k;
        let w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(self.0.add(i / 2) as *const __m256i));
        // (w | w << 4) & 0x0F0F.
        let n =
            _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x0F0F), 0xA8);
        let hi = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -1, -1, -1, -1);
        let n = _mm512_or_si512(n, _mm512_and_si512(hi, _mm512_set1_epi8(0x10)));
        let e = _mm512_loadu_ps(E2M1.as_ptr());
        let t0 = _mm512_mul_ps(
            e,
            _mm512_set1_ps(*E8M0_F32.get_unchecked(*self.1.add(i / 32) as usize)),
        );
        let t1 = _mm512_mul_ps(
            e,
            _mm512_set1_ps(*E8M0_F32.get_unchecked(*self.1.add(i / 32 + 1) as usize)),
        );
        [
            _mm512_permutex2var_ps(t0, n, t1),
            _mm512_permutex2var_ps(t0, _mm512_srli_epi32(n, 8), t1),
            _mm512_permutex2var_ps(t0, _mm512_srli_epi32(n, 16), t1),
            _mm512_permutex2var_ps(t0, _mm512_srli_epi32(n, 24), t1),
        ]
    }

    #[inline(always)]
    fn x_s4(&self) -> *const f32 {
        self.3
    }

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
    /// `log2(bc)` when `bc` is a power of two (column block by a shift, not a division).
    shift: Option<u32>,
}
impl Fp8BlockD<'_> {
    /// Column block of column `k`.
    #[inline(always)]
    fn cb(&self, k: usize) -> usize {
        match self.shift {
            Some(s) => k >> s,
            None => k / self.bc,
        }
    }
}
impl Dec for Fp8BlockD<'_> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let gc = self.cols.div_ceil(self.bc);
        let s = block_scale(self.scales, ((self.row0 + r) / self.br) * gc + self.cb(k));
        times_scale(e4m3_x2m8(self.q.add(r * self.cols + k)), s)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec64(&self, r: usize, k: usize) -> [__m512; 4] {
        // One scale per 32 columns needs blocks a multiple of 32 wide (or one block per row).
        if self.bc.is_multiple_of(32) || self.bc >= self.cols {
            let gc = self.cols.div_ceil(self.bc);
            let sr = ((self.row0 + r) / self.br) * gc;
            let s0 = block_scale(self.scales, sr + self.cb(k));
            let s1 = block_scale(self.scales, sr + self.cb(k + 32));
            let p = self.q.add(r * self.cols + k);
            if let (Some(t0), Some(t1)) = (scale_x2p120(s0), scale_x2p120(s1)) {
                if !e4m3_not_normal64(p) {
                    let (t0, t1) = (_mm512_set1_ps(t0), _mm512_set1_ps(t1));
                    return [
                        _mm512_mul_ps(e4m3_x2m120(p), t0),
                        _mm512_mul_ps(e4m3_x2m120(p.add(16)), t0),
                        _mm512_mul_ps(e4m3_x2m120(p.add(32)), t1),
                        _mm512_mul_ps(e4m3_x2m120(p.add(48)), t1),
                    ];
                }
            }
            if let (Some(t0), Some(t1)) = (scale_x256(s0), scale_x256(s1)) {
                if !any_e4m3_nan64(p) {
                    let (t0, t1) = (_mm512_set1_ps(t0), _mm512_set1_ps(t1));
                    let (v0, v1) = e4m3_x2m8_32(p);
                    let (v2, v3) = e4m3_x2m8_32(p.add(32));
                    return [
                        _mm512_mul_ps(v0, t0),
                        _mm512_mul_ps(v1, t0),
                        _mm512_mul_ps(v2, t1),
                        _mm512_mul_ps(v3, t1),
                    ];
                }
            }
        }
        [
            self.dec(r, k),
            self.dec(r, k + 16),
            self.dec(r, k + 32),
            self.dec(r, k + 48),
        ]
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

/// MLX affine 4-bit: codes `(ptr, scales, biases, cols)`, two per byte (element 2k in the low
/// nibble), split into 16 bytes in column order and widened.
struct MlxAffine4D<'a>(*const u8, &'a [u8], &'a [u8], usize);
impl Dec for MlxAffine4D<'_> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn dec(&self, r: usize, k: usize) -> __m512 {
        let g = r * affine_groups(self.3) + k / 64;
        let s = _mm512_set1_ps(affine_param(self.1, g));
        let b = _mm512_set1_ps(affine_param(self.2, g));
        let v = _mm_loadl_epi64(self.0.add((r * self.3 + k) / 2) as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(v, m);
        let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
        let c = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        // A multiply then an add (two roundings), as the definition says.
        _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), s), b)
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
    // Whole 64-column groups. Decoders with `S4` give them in stride-4 order, multiplied with
    // the inputs in the same order: lane for lane the same products added in the same order as
    // the plain loop, only held in other registers (put back below). `D::S4` is a constant, so
    // each decoder compiles to one of the two loops.
    let x64 = if D::S4 { d.x_s4().add(i * cols) } else { xp };
    while k < full64 {
        let w = if D::S4 {
            d.dec64_s4(r, k)
        } else {
            d.dec64(r, k)
        };
        for j in 0..MR {
            let p = x64.add(j * cols + k);
            for q in 0..4 {
                a[j][q] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(16 * q)), w[q], a[j][q]);
            }
        }
        k += 64;
    }
    if D::S4 {
        for j in 0..MR {
            a[j] = from_s4(a[j]);
        }
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
        Src::Mxfp4 { packed, scales } => {
            thread_local! {
                static XS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
            }
            XS.with(|b| {
                let mut xs = b.borrow_mut();
                s4_order(x, m, cols, &mut xs);
                rows_g(
                    &Mxfp4D(packed.as_ptr(), scales.as_ptr(), cols, xs.as_ptr()),
                    src,
                    cols,
                    x,
                    m,
                    r0,
                    r1,
                    out,
                    ld,
                )
            })
        }
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
                shift: block_cols
                    .is_power_of_two()
                    .then(|| block_cols.trailing_zeros()),
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
