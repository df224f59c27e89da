//! MLX affine-4 weights (`mode="affine", bits=4, group_size=64`, the mlx-community 4-bit
//! files) on the integer kernels: the nibble `q` ∈ [0, 15] is the integer weight as it lies
//! (an unsigned byte, so the x86 levels feed it to `vpdpbusd` / `vpmaddubsw` without the sign
//! trick), the block factor is the group's bf16 scale `s`, and the group's bias `b` enters
//! through step 5 of [`super`]'s contract as `β_b = b` times the activation block's
//! `d · Σq` ([`Q8Acts::ds`]), so `s·q + b` is never formed. The results are the contract's
//! bits on every level: the scalar level is [`super`]'s own `rows_scalar` on rows decoded by
//! [`decode_nibbles`], the x86 levels are in `affine4_x86` (nibbles widened in registers),
//! NEON's `sdot` level takes the decoded rows as it takes E8P's, and from
//! [`super::GEMM_MIN_M`] rows on the AVX-512 VNNI levels run the shared GEMM on panels
//! decoded by the same nibble widening.

#[cfg(target_arch = "x86_64")]
use super::{IntLevel, IntSrc, Q8Acts};

pub use super::nibbles::decode_nibbles;

/// Rows `r0..r1` of an affine-4 product at `level` (x86 levels; the others run the scalar
/// contract).
///
/// # Safety
/// As [`super::rows_scalar`]; `src` holds at least `r1` rows of `a.cols`; `level` is one
/// the CPU has.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn rows_affine4(
    level: IntLevel,
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    use super::affine4_x86 as k;
    match level {
        IntLevel::Avx512Vnni | IntLevel::Avx512VnniVbmi => k::rows_vnni(src, a, r0, r1, out, ld),
        IntLevel::Avx512 => k::rows_bw(src, a, r0, r1, out, ld),
        IntLevel::Avx2 => k::rows_avx2(src, a, r0, r1, out, ld),
        _ => super::rows_scalar(src, a, r0, r1, out, ld),
    }
}
