//! NEON (aarch64) decode-and-dot: 16 columns at a time, four 4-lane FMA accumulators per input
//! row, up to four input rows per decoded chunk. bf16 and f32 are widened in registers; the
//! other formats decode their 16 values with the scalar element decoder into a stack array
//! first (exact values, the same as `WeightView::decode_row`). Accumulation order: lane `l`
//! sums columns `≡ l mod 16` with fused multiply-adds, then the lanes are reduced as
//! `matmul`'s tree, then the tail; this differs from the portable `matmul` (which does not
//! fuse), so it is held against the reference with a tolerance, not bit for bit.
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

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const MR: usize>(
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
    let z = vdupq_n_f32(0.0);
    let mut a = [[z; 4]; MR];
    let mut tmp = [0f32; 16];
    let mut k = 0;
    while k < full {
        let w = dec16(src, r, k, cols, &mut tmp);
        for j in 0..MR {
            let p = xp.add(j * cols + k);
            for q in 0..4 {
                a[j][q] = vfmaq_f32(a[j][q], vld1q_f32(p.add(4 * q)), w[q]);
            }
        }
        k += 16;
    }
    for j in 0..MR {
        let mut tail = 0f32;
        for c in full..cols {
            tail = x[(i + j) * cols + c].mul_add(src.get(r, c, cols), tail);
        }
        *out.add((i + j) * ld + r) = hsum(a[j]) + tail;
    }
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
        let mut i = 0;
        while i < m {
            match m - i {
                1 => block::<1>(src, cols, x, i, r, out, ld),
                2 => block::<2>(src, cols, x, i, r, out, ld),
                3 => block::<3>(src, cols, x, i, r, out, ld),
                _ => block::<4>(src, cols, x, i, r, out, ld),
            }
            i += (m - i).min(4);
        }
    }
}
