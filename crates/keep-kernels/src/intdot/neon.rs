//! aarch64 integer dot products of [`super`]'s contract with the dot-product extension
//! (`sdot`, signed int8 × int8 into four i32 lanes, each the sum of four products — exactly
//! the contract's `p[b][g]`, so no sign trick is needed). A weight row is decoded to int8
//! once ([`IntSrc::decode_row_fast`]) and serves every input row; a block's eight lanes are
//! two `sdot`s, its coefficient one f32 multiply, and the accumulation one fused
//! multiply-add per four lanes into the contract's accumulator `b mod 4`; blocks past the last
//! whole group of four, the reduction, the row factor and the affine-8 bias term are the
//! scalar contract's own code. Compile-checked with
//! `cargo check -p keep-kernels --target aarch64-unknown-linux-gnu`; not run on this machine.

// Indexed loops mirror the contract's accumulator numbering.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::{dot_blocks_ref, finish_ref, IntSrc, Q8Acts, QBLOCK, SCRATCH};

/// `sdot` from zero: four i32 lanes, lane `g` the sum of the four products of bytes `4g..4g+4`
/// (inline assembly: the `vdotq_s32` intrinsic is not stable in Rust yet).
///
/// # Safety
/// The CPU has the dot-product extension.
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn sdot(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut r = vdupq_n_s32(0);
    std::arch::asm!(
        "sdot {r:v}.4s, {a:v}.16b, {b:v}.16b",
        r = inout(vreg) r,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    r
}

/// Rows `r0..r1` of the product.
///
/// # Safety
/// The CPU has NEON and the dot-product extension; `out` as in `super::rows_scalar`; `src`
/// holds at least `r1` rows of `a.cols`.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn rows_sdot(
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let full = nb / 4 * 4;
    let mut s = SCRATCH.with(|c| c.take());
    s.w.resize(cols, 0);
    s.f.resize(nb, 0.0);
    for r in r0..r1 {
        src.decode_row_fast(r, cols, &mut s.w);
        src.block_factors(r, cols, &mut s.f);
        let post = src.post(r);
        let w = s.w.as_ptr();
        for i in 0..a.m {
            let q = a.q.as_ptr().add(i * cols);
            let d = a.d.as_ptr().add(i * nb);
            let mut acc = [[vdupq_n_f32(0.0); 2]; 4];
            let mut b = 0;
            while b < full {
                for h in 0..4 {
                    let k = (b + h) * QBLOCK;
                    let p0 = sdot(vld1q_s8(w.add(k)), vld1q_s8(q.add(k)));
                    let p1 = sdot(vld1q_s8(w.add(k + 16)), vld1q_s8(q.add(k + 16)));
                    let c = s.f[b + h] * *d.add(b + h);
                    acc[h][0] = vfmaq_n_f32(acc[h][0], vcvtq_f32_s32(p0), c);
                    acc[h][1] = vfmaq_n_f32(acc[h][1], vcvtq_f32_s32(p1), c);
                }
                b += 4;
            }
            let mut v = [[0f32; 8]; 4];
            for h in 0..4 {
                vst1q_f32(v[h].as_mut_ptr(), acc[h][0]);
                vst1q_f32(v[h].as_mut_ptr().add(4), acc[h][1]);
            }
            let qs = std::slice::from_raw_parts(q, cols);
            let (f, dd) = (&s.f, std::slice::from_raw_parts(d, nb));
            dot_blocks_ref(&s.w, qs, |bb| f[bb] * dd[bb], &mut v, full, nb);
            let sum = finish_ref(&v);
            *out.add(i * ld + r) = post.map_or(sum, |p| sum * p);
        }
        super::add_bias_terms(src, a, r, out, ld);
    }
    SCRATCH.with(|c| c.replace(s));
}
