//! NEON (aarch64) decode-and-dot: 16 columns at a time into accumulator `chunk mod 4` (four
//! q-registers each), one input row at a time, in the order of `simd::dot` (fused
//! multiply-adds, the same combine and tree), so results equal the scalar level bit for bit.
//! bf16 and f32 are widened in registers; the other formats decode their 16 values with the
//! scalar element decoder into a stack array first (exact values, as `WeightView::decode_row`).
//! Compile-checked with `cargo check --target aarch64-unknown-linux-gnu`; not run here.

use std::arch::aarch64::*;

use super::Src;

#[inline(always)]
unsafe fn dec16(
    src: &Src,
    r: usize,
    k: usize,
    cols: usize,
    tmp: &mut [f32; 16],
) -> [float32x4_t; 4] {
    match *src {
        Src::F32(b) => {
            let p = (b.as_ptr() as *const f32).add(r * cols + k);
            [
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ]
        }
        Src::Bf16(b) => {
            let p = (b.as_ptr() as *const u16).add(r * cols + k);
            let lo = vld1q_u16(p);
            let hi = vld1q_u16(p.add(8));
            [
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(lo))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(hi))),
                vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_high_u16(hi))),
            ]
        }
        _ => {
            for (c, t) in tmp.iter_mut().enumerate() {
                *t = src.get(r, k + c, cols);
            }
            let p = tmp.as_ptr();
            [
                vld1q_f32(p),
                vld1q_f32(p.add(4)),
                vld1q_f32(p.add(8)),
                vld1q_f32(p.add(12)),
            ]
        }
    }
}

#[inline(always)]
unsafe fn hsum(a: [float32x4_t; 4]) -> f32 {
    // Lanes 0..16: b[i] = a[i] + a[i+8]; c[i] = b[i] + b[i+4]; (c0+c2)+(c1+c3).
    let b0 = vaddq_f32(a[0], a[2]);
    let b1 = vaddq_f32(a[1], a[3]);
    let c = vaddq_f32(b0, b1);
    (vgetq_lane_f32::<0>(c) + vgetq_lane_f32::<2>(c))
        + (vgetq_lane_f32::<1>(c) + vgetq_lane_f32::<3>(c))
}

/// One input row against weight row `r`: four accumulators of 16 lanes (four q-registers
/// each), chunk `c` into accumulator `c mod 4` (the order of `simd::dot`).
#[inline(always)]
unsafe fn one(src: &Src, cols: usize, x: &[f32], i: usize, r: usize) -> f32 {
    let full = cols / 16 * 16;
    let xp = x.as_ptr().add(i * cols);
    let z = vdupq_n_f32(0.0);
    let mut a = [[z; 4]; 4];
    let mut tmp = [0f32; 16];
    let mut k = 0;
    let mut q = 0;
    while k < full {
        let w = dec16(src, r, k, cols, &mut tmp);
        let p = xp.add(k);
        for v in 0..4 {
            a[q][v] = vfmaq_f32(a[q][v], vld1q_f32(p.add(4 * v)), w[v]);
        }
        q = (q + 1) % 4;
        k += 16;
    }
    let t: [float32x4_t; 4] = core::array::from_fn(|v| {
        vaddq_f32(vaddq_f32(a[0][v], a[1][v]), vaddq_f32(a[2][v], a[3][v]))
    });
    let mut tail = 0f32;
    for c in full..cols {
        tail = x[i * cols + c].mul_add(src.get(r, c, cols), tail);
    }
    hsum(t) + tail
}

/// Rows `r0..r1` of `out[i*ld + r] = x[i] · W[r]`.
///
/// # Safety
/// The CPU has NEON; `src` holds at least `r1` rows of `cols`; `x` has `m*cols` elements;
/// `out` is valid for those writes and nobody else writes them.
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
    for r in r0..r1 {
        for i in 0..m {
            *out.add(i * ld + r) = one(src, cols, x, i, r);
        }
    }
}
