//! Small-batch (M = 1..32 activation rows) decode-and-dot kernels that read packed weight bytes
//! once, at close to the memory-bandwidth limit: bf16, f32, MXFP8, MXFP4, FP8-block (block
//! columns a multiple of 16) and MLX affine-8, with an AVX-512 path, an AVX2+FMA path (chosen
//! at run time), a NEON path on aarch64, and a scalar path (decode a row, then [`dot`]) that is
//! also the fallback for every shape the SIMD paths do not take.
//!
//! Contract: every output `(i, r)` is [`dot`] of input row `i` with decoded weight row `r`:
//! four accumulators of 16 lanes, 16-column chunk `c` going to accumulator `c mod 4` (lane `l`
//! of a chunk with fused multiply-adds), the accumulators combined as `(A0 + A1) + (A2 + A3)`,
//! the 16 lanes reduced by the same tree as [`crate::matmul::dot`], then the columns past the
//! last whole chunk with a scalar FMA chain. Four independent FMA chains keep the kernel off the
//! FMA latency bound (one chain caps M=1 at 16 weights per 4 cycles). Every level computes
//! exactly this, so results are bit-identical whatever M is, however rows are split over
//! threads, and whichever of scalar/AVX2/AVX-512/NEON ran (tested); they differ from the one-chain
//! [`crate::matmul::matmul`] in the last bits. The weights are decoded in registers,
//! 16 columns at a time; on AVX-512 each decoded chunk serves up to four input rows.
//!
//! Threads split the output rows (rayon) when the call has at least
//! [`crate::cpu::PAR_MIN_MACS`] multiply-adds. [`matmul_many`] runs several independent
//! products (one token against all its top-k experts' projections) in one parallel pass.
//!
//! `KEEP_SIMD=scalar|avx2|avx512` caps the level (for tests and A/B runs); the default is the
//! best the CPU has.

use rayon::prelude::*;

use crate::affine::{Affine8View, AFFINE8_GROUP};
use crate::rows::{row_tasks_into, Books, SyncPtr};
use crate::weight::{BlockScales, E8pResidual, WeightKind};
use crate::{Result, WeightView};

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "aarch64")]
pub mod neon;

pub use crate::cpu::{detected, level, Level};

/// The packed bytes of one weight, resolved for the kernels.
#[derive(Debug, Clone, Copy)]
pub enum Src<'a> {
    F32(&'a [u8]),
    Bf16(&'a [u8]),
    Mxfp8 {
        q: &'a [u8],
        scales: &'a [u8],
    },
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
    },
    Fp8Block {
        q: &'a [u8],
        scales: BlockScales<'a>,
        block_rows: usize,
        block_cols: usize,
        row0: usize,
    },
    Affine8 {
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
    /// E8P12 codes with an optional residual stage (the scalar path computes it).
    E8p {
        codes: &'a [u8],
        scales: &'a [u8],
        resid: Option<E8pResidual<'a>>,
    },
    /// MLX affine codes at 2, 3 or 4 bits (8-bit weights are [`Src::Affine8`]).
    MlxAffine {
        bits: u32,
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
    /// A format of keep-format's registry (the scalar path decodes it).
    Registered(crate::RegView<'a>),
}

impl<'a> Src<'a> {
    /// From a [`WeightView`].
    pub fn view(w: &WeightView<'a>) -> Self {
        match w.kind {
            WeightKind::F32(b) => Src::F32(b),
            WeightKind::Bf16(b) => Src::Bf16(b),
            WeightKind::Mxfp8 { q, scales } => Src::Mxfp8 { q, scales },
            WeightKind::Mxfp4 { packed, scales } => Src::Mxfp4 { packed, scales },
            WeightKind::E8p {
                codes,
                scales,
                resid,
            } => Src::E8p {
                codes,
                scales,
                resid,
            },
            WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } => Src::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            },
            // 8-bit codes are one byte each, exactly affine-8's layout: its kernels serve them.
            WeightKind::MlxAffine {
                bits: 8,
                q,
                scales,
                biases,
            } => Src::Affine8 { q, scales, biases },
            WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            } => Src::MlxAffine {
                bits,
                q,
                scales,
                biases,
            },
            WeightKind::Registered(v) => Src::Registered(v),
        }
    }

    /// From an [`Affine8View`].
    pub fn affine8(w: &Affine8View<'a>) -> Self {
        Src::Affine8 {
            q: w.q,
            scales: w.scales,
            biases: w.biases,
        }
    }

    /// Whether the SIMD paths take this source (otherwise the scalar path runs).
    fn simd_ok(&self, cols: usize) -> bool {
        match *self {
            Src::Fp8Block { block_cols, .. } => block_cols % 16 == 0 || block_cols >= cols,
            Src::E8p { .. } | Src::Registered(_) => false,
            Src::MlxAffine { bits, .. } => mlx_simd_ok(bits),
            _ => true,
        }
    }

    /// Decode row `r` (`cols` wide) into `dst` from the definitions (the values every path
    /// multiplies; the scalar path and the SIMD tails use this).
    pub fn decode_row(&self, r: usize, cols: usize, dst: &mut [f32]) {
        match *self {
            Src::Affine8 { q, scales, biases } => Affine8View {
                rows: r + 1,
                cols,
                q,
                scales,
                biases,
            }
            .decode_row(r, dst),
            _ => self.as_view(r + 1, cols).decode_row(r, dst),
        }
    }

    /// Element `(r, c)` (used for tails of columns not a multiple of 16).
    #[inline]
    pub fn get(&self, r: usize, c: usize, cols: usize) -> f32 {
        match *self {
            Src::Affine8 { q, scales, biases } => Affine8View {
                rows: r + 1,
                cols,
                q,
                scales,
                biases,
            }
            .get_ref(r, c),
            _ => {
                // The fast decoders are equal to the reference element decode (tested in
                // `weight`), so the reference is used for the few tail columns.
                self.as_view(r + 1, cols).get_ref(r, c)
            }
        }
    }

    fn as_view(&self, rows: usize, cols: usize) -> WeightView<'a> {
        let kind = match *self {
            Src::F32(b) => WeightKind::F32(b),
            Src::Bf16(b) => WeightKind::Bf16(b),
            Src::Mxfp8 { q, scales } => WeightKind::Mxfp8 { q, scales },
            Src::Mxfp4 { packed, scales } => WeightKind::Mxfp4 { packed, scales },
            Src::E8p {
                codes,
                scales,
                resid,
            } => WeightKind::E8p {
                codes,
                scales,
                resid,
            },
            Src::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } => WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            },
            Src::MlxAffine {
                bits,
                q,
                scales,
                biases,
            } => WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            },
            Src::Registered(v) => WeightKind::Registered(v),
            Src::Affine8 { .. } => unreachable!("affine8 has its own view"),
        };
        WeightView { rows, cols, kind }
    }
}

/// Whether the SIMD levels decode MLX affine codes of this width in registers (AVX2 and
/// AVX-512 take 4 bits; 2 and 3 bits go through the scalar path: decode the row, then [`dot`]).
#[inline(always)]
fn mlx_simd_ok(bits: u32) -> bool {
    cfg!(target_arch = "x86_64") && bits == 4
}

/// `s · 2^8` when that product is exact and finite (it always is for E8M0 scales up to
/// byte 246 and for f32 scales below 2^119), for the E4M3-through-fp16 decode.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn scale_x256(s: f32) -> Option<f32> {
    let t = s * 256.0;
    // Multiplying back by 2^-8 is exact unless it underflows, so this tests exactness with
    // two multiplies and no division.
    if t.is_finite() && t * (1.0 / 256.0) == s {
        Some(t)
    } else {
        None
    }
}

/// E8M0 scale byte `b` → `Some(2^(b−127) · 2^8)` (bytes 0..=246; byte 0 is 2^-127 as in
/// `e8m0_to_f32`, so 2^-119), `None` for bytes 247..=255 (the product would overflow, or NaN).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn e8m0_x256(b: u8) -> Option<f32> {
    if b <= 246 {
        Some(f32::from_bits((b as u32 + 8) << 23))
    } else {
        None
    }
}

/// bf16 scale/bias `i` of an affine-8 weight (helper for the SIMD paths).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn affine_param(b: &[u8], i: usize) -> f32 {
    crate::codec::bf16_at(b, i)
}

/// Groups per affine-8 row.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn affine_groups(cols: usize) -> usize {
    cols / AFFINE8_GROUP
}

/// The kernels' dot product (see the module doc), written plainly: the scalar reference of the
/// accumulation order every level follows. Every `mul_add` is one fused multiply-add whatever
/// the CPU, so the result does not depend on where it runs; on a CPU with FMA the same code is
/// compiled with it ([`dot_fma`]), where without it each `mul_add` would be a call into the
/// software `fmaf`.
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { dot_fma(x, w) };
    }
    dot_plain(x, w)
}

/// [`dot_plain`] in AVX2 + FMA registers: lane `l` of accumulator `k` is `acc[k][l]` of the
/// plain loop, fed the same products in the same order, and the reduction is the plain one.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_fma(x: &[f32], w: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = w.len();
    let x = &x[..n];
    let chunks = n / 16;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3) = ([z; 2], [z; 2], [z; 2], [z; 2]);
    // SAFETY (every load): offsets below 16 * chunks <= n, within both slices.
    let step = |a: &mut [__m256; 2], o: usize| {
        a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(o)), _mm256_loadu_ps(wp.add(o)), a[0]);
        a[1] = _mm256_fmadd_ps(
            _mm256_loadu_ps(xp.add(o + 8)),
            _mm256_loadu_ps(wp.add(o + 8)),
            a[1],
        );
    };
    let mut c = 0;
    while c + 4 <= chunks {
        step(&mut a0, 16 * c);
        step(&mut a1, 16 * (c + 1));
        step(&mut a2, 16 * (c + 2));
        step(&mut a3, 16 * (c + 3));
        c += 4;
    }
    for (k, a) in [&mut a0, &mut a1, &mut a2].into_iter().enumerate() {
        if c + k < chunks {
            step(a, 16 * (c + k));
        }
    }
    let mut acc = [[0f32; 16]; 4];
    for (dst, a) in acc.iter_mut().zip([a0, a1, a2, a3]) {
        _mm256_storeu_ps(dst.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(dst.as_mut_ptr().add(8), a[1]);
    }
    dot_finish(&acc, x, w, chunks * 16)
}

#[inline(always)]
fn dot_plain(x: &[f32], w: &[f32]) -> f32 {
    let n = w.len();
    let x = &x[..n];
    let full = n / 16 * 16;
    let mut acc = [[0f32; 16]; 4];
    for c in 0..full / 16 {
        let a = &mut acc[c % 4];
        for l in 0..16 {
            a[l] = x[16 * c + l].mul_add(w[16 * c + l], a[l]);
        }
    }
    dot_finish(&acc, x, w, full)
}

/// The lanes of [`dot`]'s four accumulators added in its order, then the tail from `full`.
#[inline(always)]
fn dot_finish(acc: &[[f32; 16]; 4], x: &[f32], w: &[f32], full: usize) -> f32 {
    let mut t = [0f32; 16];
    for l in 0..16 {
        t[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    }
    let b: [f32; 8] = std::array::from_fn(|i| t[i] + t[i + 8]);
    let c = [b[0] + b[4], b[1] + b[5], b[2] + b[6], b[3] + b[7]];
    let mut tail = 0f32;
    for i in full..w.len() {
        tail = x[i].mul_add(w[i], tail);
    }
    ((c[0] + c[2]) + (c[1] + c[3])) + tail
}

/// Scalar path: decode a row, then [`dot`] per input row.
///
/// # Safety
/// `out` valid for writes at `i*ld + r` (i < m, r in r0..r1), not written by anyone else.
#[allow(clippy::too_many_arguments)]
unsafe fn rows_scalar(
    src: &Src,
    cols: usize,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut buf = vec![0f32; cols];
    for r in r0..r1 {
        src.decode_row(r, cols, &mut buf);
        for i in 0..m {
            *out.add(i * ld + r) = dot(&x[i * cols..(i + 1) * cols], &buf);
        }
    }
}

/// Rows `r0..r1` of the product at `level` (falls back to scalar where the level does not
/// take the source).
///
/// # Safety
/// As [`rows_scalar`]; `x` has `m * cols` elements, `src` holds at least `r1` rows of `cols`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn rows_at(
    level: Level,
    src: &Src,
    cols: usize,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    if !src.simd_ok(cols) {
        return rows_scalar(src, cols, x, m, r0, r1, out, ld);
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => avx512::rows(src, cols, x, m, r0, r1, out, ld),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => avx2::rows(src, cols, x, m, r0, r1, out, ld),
        #[cfg(target_arch = "aarch64")]
        Level::Neon => neon::rows(src, cols, x, m, r0, r1, out, ld),
        _ => rows_scalar(src, cols, x, m, r0, r1, out, ld),
    }
}

/// The whole product at a given level, threaded over output rows when big. Operand lengths
/// must already be checked (`x`: `m*cols`, `out`: `m*rows`).
pub(crate) fn run_at(
    level: Level,
    src: Src,
    rows: usize,
    cols: usize,
    x: &[f32],
    m: usize,
    out: &mut [f32],
) {
    assert!(x.len() >= m * cols && out.len() >= m * rows);
    let ptr = SyncPtr(out.as_mut_ptr());
    crate::rows::par_rows(rows, m * cols, |r0, r1| {
        let p = &ptr;
        // SAFETY: out has m*rows elements; each task writes only its own rows.
        unsafe { rows_at(level, &src, cols, x, m, r0, r1, p.0, rows) }
    });
}

pub(crate) fn run(src: Src, rows: usize, cols: usize, x: &[f32], m: usize, out: &mut [f32]) {
    run_at(level(), src, rows, cols, x, m, out)
}

/// `out[M×rows] = x[M×cols] · Wᵀ` with the weight decoded in registers (see the module doc);
/// on AVX2+FMA CPUs bit-identical to [`crate::matmul::matmul`]. Meant for M = 1..32 (any M
/// works).
pub fn matmul_fast(x: &[f32], m: usize, w: &WeightView, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    run(Src::view(w), w.rows, w.cols, x, m, out);
    Ok(())
}

/// [`matmul_fast`] at an explicit level (tests and A/B benchmarks). A level the CPU lacks is
/// lowered to the best one it has.
pub fn matmul_at(level: Level, x: &[f32], m: usize, w: &WeightView, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    run_at(
        level.min(detected()),
        Src::view(w),
        w.rows,
        w.cols,
        x,
        m,
        out,
    );
    Ok(())
}

/// `out[M×rows] = x[M×cols] · Wᵀ`, fast path (SIMD where the CPU has it, threaded over output
/// rows when big); each output equals [`dot`] of the input row with the
/// decoded weight row, bit for bit.
pub fn affine8_matmul(x: &[f32], m: usize, w: &Affine8View, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    run(Src::affine8(w), w.rows, w.cols, x, m, out);
    Ok(())
}

/// One product of a [`matmul_many`] batch: `out[m×w.rows] = x[m×w.cols] · wᵀ`.
pub struct Job<'a, 'b> {
    pub w: Src<'a>,
    pub rows: usize,
    pub cols: usize,
    pub x: &'b [f32],
    pub m: usize,
    pub out: &'b mut [f32],
}

impl<'a, 'b> Job<'a, 'b> {
    /// A job over a [`WeightView`] (lengths checked).
    pub fn view(w: &WeightView<'a>, x: &'b [f32], m: usize, out: &'b mut [f32]) -> Result<Self> {
        crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
        Ok(Job {
            w: Src::view(w),
            rows: w.rows,
            cols: w.cols,
            x,
            m,
            out,
        })
    }
}

/// Run independent products in one parallel pass (e.g. a token's top-k experts' gate and up
/// projections): the output rows of all jobs are cut into chunks of similar size and spread
/// over the threads together. Each output equals what [`matmul_fast`] gives for its job.
pub fn matmul_many(jobs: &mut [Job]) {
    let level = level();
    let threads = rayon::current_num_threads();
    let total: usize = jobs.iter().map(|j| j.m * j.rows * j.cols).sum();
    if threads < 2 || total < crate::cpu::PAR_MIN_MACS {
        for j in jobs.iter_mut() {
            run_at(level, j.w, j.rows, j.cols, j.x, j.m, j.out);
        }
        return;
    }
    let mut books = Books::take();
    row_tasks_into(
        jobs.iter().map(|j| (j.m, j.rows, j.cols)),
        threads,
        &mut books.tasks,
    );
    books
        .outs
        .extend(jobs.iter_mut().map(|j| SyncPtr(j.out.as_mut_ptr())));
    let jobs_ro: &[Job] = jobs;
    let (tasks, ptrs) = (&books.tasks, &books.outs);
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    tasks.par_iter().for_each(|&(ji, r0, r1)| {
        let j = &jobs_ro[ji];
        // SAFETY: tasks of one job cover disjoint row ranges of its m×rows output.
        crate::profile::task(reg, || unsafe {
            rows_at(level, &j.w, j.cols, j.x, j.m, r0, r1, ptrs[ji].0, j.rows)
        });
    });
    if let Some(r) = region {
        r.finish();
    }
    books.keep();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul_ref;

    use crate::test_rng::Rng;

    /// f32 accumulation over `cols` terms against the f64 reference, relative to Σ|x·w|.
    const REL_TOL: f32 = 1e-5;

    /// The dot product the CPU runs ([`dot`]: in AVX2 + FMA registers where it has them) is the
    /// plain loop's bits at every length, tails and partial accumulator rounds included.
    #[test]
    fn dot_is_the_plain_loop_bit_for_bit() {
        let mut rng = Rng::new(41);
        for n in (0..200).chain([255, 256, 1152, 2560, 4097]) {
            let x: Vec<f32> = (0..n).map(|_| rng.f() * 3.0).collect();
            let w: Vec<f32> = (0..n).map(|_| rng.f()).collect();
            assert_eq!(
                dot(&x, &w).to_bits(),
                dot_plain(&x, &w).to_bits(),
                "n = {n}"
            );
            // x longer than w: only w's length counts
            let mut xl = x.clone();
            xl.push(1e30);
            assert_eq!(
                dot(&xl, &w).to_bits(),
                dot_plain(&x, &w).to_bits(),
                "n = {n}"
            );
        }
    }

    fn levels() -> Vec<Level> {
        let d = detected();
        [Level::Scalar, Level::Neon, Level::Avx2, Level::Avx512]
            .into_iter()
            .filter(|l| *l <= d && (*l != Level::Neon || d == Level::Neon))
            .collect()
    }

    fn compare(w: &WeightView, rng: &mut Rng) {
        for &m in &[1usize, 2, 3, 4, 5, 7, 8, 13, 32] {
            let x: Vec<f32> = (0..m * w.cols).map(|_| rng.f()).collect();
            let mut r = vec![0f32; m * w.rows];
            let mut base = vec![0f32; m * w.rows];
            matmul_ref(&x, m, w, &mut r).unwrap();
            matmul_at(Level::Scalar, &x, m, w, &mut base).unwrap();
            for lv in levels() {
                let mut f = vec![0f32; m * w.rows];
                matmul_at(lv, &x, m, w, &mut f).unwrap();
                for i in 0..m {
                    for o in 0..w.rows {
                        let mag: f32 = (0..w.cols)
                            .map(|c| (x[i * w.cols + c] * w.get_ref(o, c)).abs())
                            .sum::<f32>()
                            + 1e-30;
                        let (p, q) = (r[i * w.rows + o], f[i * w.rows + o]);
                        if p.is_nan() {
                            assert!(q.is_nan());
                            continue;
                        }
                        assert!(
                            (p - q).abs() <= REL_TOL * mag,
                            "{} {:?} m={m} ({i},{o}) {p} vs {q}",
                            w.format_name(),
                            lv
                        );
                    }
                }
                // Every level computes the same order: bit-identical to the scalar level.
                let same = f
                    .iter()
                    .zip(&base)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                assert!(
                    same,
                    "{} {:?} m={m}: not bit-identical to the scalar level",
                    w.format_name(),
                    lv
                );
                // Row independence: a row of the batch equals the same row alone.
                for i in [0, m / 2, m - 1] {
                    let mut one = vec![0f32; w.rows];
                    matmul_at(lv, &x[i * w.cols..(i + 1) * w.cols], 1, w, &mut one).unwrap();
                    let same = one
                        .iter()
                        .zip(&f[i * w.rows..(i + 1) * w.rows])
                        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                    assert!(
                        same,
                        "{} {lv:?}: row {i} of {m} differs alone",
                        w.format_name()
                    );
                }
            }
        }
    }

    #[test]
    fn mlx_affine_every_width_every_level() {
        let mut rng = Rng::new(0x6d6c_7861_6666_696e);
        for bits in [2u32, 3, 4, 8] {
            for &(rows, cols) in &[(1, 64), (5, 128), (19, 192), (33, 640)] {
                let q = rng.bytes(rows * cols * bits as usize / 8);
                let bf = |rng: &mut Rng, n: usize| -> Vec<u8> {
                    (0..n)
                        .flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes())
                        .collect()
                };
                let (sc, bi) = (
                    bf(&mut rng, rows * cols / 64),
                    bf(&mut rng, rows * cols / 64),
                );
                let w = WeightView::mlx_affine(bits, &q, &sc, &bi, rows, cols).unwrap();
                // The element reference is keep-format's row reference; the row decoder and a
                // row slice agree with it bit for bit.
                let mut row = vec![0f32; cols];
                let mut fmt = vec![0f32; cols];
                let pb = cols * bits as usize / 8;
                let half = w.slice_rows(rows / 2, rows).unwrap();
                for r in 0..rows {
                    w.decode_row(r, &mut row);
                    keep_format::mlx_affine::decode_row_ref(
                        bits,
                        &q[r * pb..(r + 1) * pb],
                        keep_format::affine::ParamSlice::Bf16Le(
                            &sc[r * cols / 32..(r + 1) * cols / 32],
                        ),
                        keep_format::affine::ParamSlice::Bf16Le(
                            &bi[r * cols / 32..(r + 1) * cols / 32],
                        ),
                        &mut fmt,
                    )
                    .unwrap();
                    for c in 0..cols {
                        assert_eq!(row[c].to_bits(), w.get_ref(r, c).to_bits(), "bits {bits}");
                        assert_eq!(row[c].to_bits(), fmt[c].to_bits(), "bits {bits}");
                        if r >= rows / 2 {
                            assert_eq!(half.get_ref(r - rows / 2, c).to_bits(), row[c].to_bits());
                        }
                    }
                }
                compare(&w, &mut rng);
            }
        }
        assert!(WeightView::mlx_affine(5, &[0; 40], &[0; 2], &[0; 2], 1, 64).is_err());
        assert!(WeightView::mlx_affine(4, &[0; 31], &[0; 2], &[0; 2], 1, 64).is_err());
        assert!(WeightView::mlx_affine(3, &[0; 24], &[0; 2], &[0; 1], 1, 64).is_err());
        assert!(WeightView::mlx_affine(2, &[0; 8], &[0; 2], &[0; 2], 1, 32).is_err());
    }

    #[test]
    fn every_level_matches_ref_on_odd_shapes() {
        let mut rng = Rng::new(0xD1B5_4A32_D192_ED03);
        for &(rows, cols) in &[(1, 32), (3, 64), (17, 96), (33, 160), (70, 1056)] {
            let f32b: Vec<u8> = (0..rows * cols)
                .flat_map(|_| rng.f().to_le_bytes())
                .collect();
            compare(&WeightView::f32(&f32b, rows, cols).unwrap(), &mut rng);
            let bf: Vec<u8> = (0..rows * cols)
                .flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            compare(&WeightView::bf16(&bf, rows, cols).unwrap(), &mut rng);
            let q: Vec<u8> = rng
                .bytes(rows * cols)
                .into_iter()
                .map(|b| if b & 0x7F == 0x7F { 0 } else { b })
                .collect();
            let s = rng.scales(rows * cols / 32);
            compare(&WeightView::mxfp8(&q, &s, rows, cols).unwrap(), &mut rng);
            let p = rng.bytes(rows * cols / 2);
            compare(&WeightView::mxfp4(&p, &s, rows, cols).unwrap(), &mut rng);
            for b in [32usize, 128] {
                let gs = rng.scales(rows.div_ceil(b) * cols.div_ceil(b));
                compare(
                    &WeightView::fp8_block(&q, BlockScales::E8m0(&gs), rows, cols, b, b).unwrap(),
                    &mut rng,
                );
                // f32 scales, small (the 2^120 decode) and large (|s| >= 2^8: the fp16 one).
                for mul in [0.01f32, 1000.0] {
                    let fs: Vec<u8> = (0..rows.div_ceil(b) * cols.div_ceil(b))
                        .flat_map(|_| (rng.f() * mul).to_le_bytes())
                        .collect();
                    compare(
                        &WeightView::fp8_block(&q, BlockScales::F32(&fs), rows, cols, b, b)
                            .unwrap(),
                        &mut rng,
                    );
                    let hs: Vec<u8> = fs.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
                    compare(
                        &WeightView::fp8_block(&q, BlockScales::Bf16(&hs), rows, cols, b, b)
                            .unwrap(),
                        &mut rng,
                    );
                }
            }
        }
        // Odd column counts (tails) for the formats that allow them.
        for &(rows, cols) in &[(5, 7), (9, 50), (31, 133)] {
            let bf: Vec<u8> = (0..rows * cols)
                .flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            compare(&WeightView::bf16(&bf, rows, cols).unwrap(), &mut rng);
            let q: Vec<u8> = rng
                .bytes(rows * cols)
                .into_iter()
                .map(|b| b & 0x7E)
                .collect();
            for b in [16usize, 32, 5] {
                let gs = rng.scales(rows.div_ceil(b) * cols.div_ceil(b));
                compare(
                    &WeightView::fp8_block(&q, BlockScales::E8m0(&gs), rows, cols, b, b).unwrap(),
                    &mut rng,
                );
            }
        }
    }

    #[test]
    fn every_code_and_special_scale_decodes_like_the_reference() {
        // Each E4M3 code (NaNs included) and each E2M1 code alone in a zero row, under a
        // different scale per group (extremes included), picked out by a one-hot input.
        let s = vec![127u8, 130, 100, 0, 140, 1, 254, 127];
        for lv in levels() {
            for c in 0..256usize {
                let mut xo = vec![0f32; 256];
                xo[c] = 1.0;
                let mut q = vec![0u8; 256];
                q[c] = c as u8;
                let w = WeightView::mxfp8(&q, &s, 1, 256).unwrap();
                let mut o = [0f32; 1];
                matmul_at(lv, &xo, 1, &w, &mut o).unwrap();
                let r = w.get_ref(0, c);
                let ok = o[0].to_bits() == r.to_bits()
                    || (r.is_nan() && o[0].is_nan())
                    || (o[0] == 0.0 && r == 0.0);
                assert!(ok, "{lv:?} e4m3 {c}: {} vs {r}", o[0]);
                let mut p = vec![0u8; 128];
                let code = (c % 16) as u8;
                p[c / 2] = if c % 2 == 0 { code } else { code << 4 };
                let w = WeightView::mxfp4(&p, &s, 1, 256).unwrap();
                matmul_at(lv, &xo, 1, &w, &mut o).unwrap();
                let r = w.get_ref(0, c);
                let ok = o[0].to_bits() == r.to_bits() || (o[0] == 0.0 && r == 0.0);
                assert!(ok, "{lv:?} e2m1 elem {c}: {} vs {r}", o[0]);
            }
        }
    }

    #[test]
    fn threaded_equals_one_thread() {
        // Above PAR_MIN_MACS and in a 4-thread pool, so the threaded path runs on any machine;
        // against all rows computed on this thread.
        let mut rng = Rng::new(7);
        let (rows, cols) = (1037, 4160);
        assert!(rows * cols >= crate::cpu::PAR_MIN_MACS);
        let (p, sc) = (rng.bytes(rows * cols / 2), rng.scales(rows * cols / 32));
        let w = WeightView::mxfp4(&p, &sc, rows, cols).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        for m in [1, 3] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
            let mut threaded = vec![0f32; m * rows];
            pool.install(|| matmul_fast(&x, m, &w, &mut threaded).unwrap());
            let mut serial = vec![0f32; m * rows];
            // SAFETY: serial has m*rows elements; one thread.
            unsafe {
                rows_at(
                    level(),
                    &Src::view(&w),
                    cols,
                    &x,
                    m,
                    0,
                    rows,
                    serial.as_mut_ptr(),
                    rows,
                )
            };
            assert_eq!(threaded, serial, "m = {m}");
        }
    }

    #[test]
    fn many_equals_one_by_one() {
        let mut rng = Rng::new(42);
        // Six jobs above PAR_MIN_MACS together (the threaded pass), in a 4-thread pool.
        let (rows, cols) = (1400, 512);
        assert!(6 * rows * cols >= crate::cpu::PAR_MIN_MACS);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        let ws: Vec<(Vec<u8>, Vec<u8>)> = (0..6)
            .map(|_| (rng.bytes(rows * cols / 2), rng.scales(rows * cols / 32)))
            .collect();
        let views: Vec<WeightView> = ws
            .iter()
            .map(|(p, s)| WeightView::mxfp4(p, s, rows, cols).unwrap())
            .collect();
        let x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
        let mut outs = vec![vec![0f32; rows]; 6];
        {
            let mut jobs: Vec<Job> = views
                .iter()
                .zip(outs.iter_mut())
                .map(|(w, o)| Job::view(w, &x, 1, o).unwrap())
                .collect();
            pool.install(|| matmul_many(&mut jobs));
        }
        for (w, o) in views.iter().zip(&outs) {
            let mut one = vec![0f32; rows];
            matmul_fast(&x, 1, w, &mut one).unwrap();
            assert_eq!(&one, o);
        }
    }
}

#[cfg(test)]
mod timing {
    //! Manual single-thread timing (`cargo test --release -p keep-kernels timing -- --ignored
    //! --nocapture`); asserts nothing.
    use super::*;
    use std::time::Instant;

    #[test]
    #[ignore]
    fn print_m1_single_thread_gbps() {
        print_gbps(1);
    }

    /// Four input rows per call (prefill-like): GB/s of weight bytes per call.
    #[test]
    #[ignore]
    fn print_m4_single_thread_gbps() {
        print_gbps(4);
    }

    fn print_gbps(m: usize) {
        let (rows, cols) = (2304usize, 5120usize);
        let mut r = crate::test_rng::Rng::new(0x1234_5678);
        let mut bytes = |n: usize| -> Vec<u8> { r.bytes(n) };
        let bf: Vec<u8> = bytes(rows * cols * 2)
            .chunks(2)
            .flat_map(|c| [c[0], 0x3C | (c[1] & 0x81)])
            .collect();
        let q: Vec<u8> = bytes(rows * cols).into_iter().map(|b| b & 0x77).collect();
        // No subnormal codes (exponent field >= 1), as in real MX weights where they are rare.
        let qn: Vec<u8> = q.iter().map(|b| (b & 0xE7) | 0x08).collect();
        let sc: Vec<u8> = vec![120; rows * cols / 32];
        let p = bytes(rows * cols / 2);
        let aq = bytes(rows * cols);
        let ap: Vec<u8> = (0..rows * cols / 64).flat_map(|_| [0x80u8, 0x3C]).collect();
        let views = [
            (
                "bf16",
                Src::view(&WeightView::bf16(&bf, rows, cols).unwrap()),
                rows * cols * 2,
            ),
            (
                "mxfp8",
                Src::view(&WeightView::mxfp8(&q, &sc, rows, cols).unwrap()),
                rows * cols * 33 / 32,
            ),
            (
                "mxfp8-normal",
                Src::view(&WeightView::mxfp8(&qn, &sc, rows, cols).unwrap()),
                rows * cols * 33 / 32,
            ),
            (
                "mxfp4",
                Src::view(&WeightView::mxfp4(&p, &sc, rows, cols).unwrap()),
                rows * cols * 17 / 32,
            ),
            (
                "affine8",
                Src::affine8(&Affine8View::new(&aq, &ap, &ap, rows, cols).unwrap()),
                rows * cols * 17 / 16,
            ),
        ];
        let x: Vec<f32> = (0..m * cols).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut out = vec![0f32; m * rows];
        for (name, src, nb) in views {
            let n = 20;
            let mut best = f64::INFINITY;
            for _ in 0..n {
                let t = Instant::now();
                unsafe { rows_at(level(), &src, cols, &x, m, 0, rows, out.as_mut_ptr(), rows) };
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{name}: {:.2} GB/s (best of {n}, one thread, M = {m}, {:?})",
                nb as f64 / 1e9 / best,
                level()
            );
        }
    }
}
