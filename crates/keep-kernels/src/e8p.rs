//! E8P12 lattice-coded weights (`keep_format::e8p`: one 16-bit code per 8 weights, one f32
//! scale per weight row) as a kernel operand: [`E8pView`], the scalar reference
//! [`e8p_matmul_ref`] (f64 accumulation of `decode_e8p_ref` elements) and the fast product
//! [`e8p_matmul`], threaded over output rows and compiled for AVX2/AVX-512 at run time;
//! [`e8p_matmul_many`] runs a token's top-k experts in one parallel pass.
//!
//! The fast path's order: activation rows in blocks of [`E8P_MATMUL_ROW_BLOCK`] (then 3, 2,
//! 1), each code decoded once with `decode_e8p` and multiply-added into 8 lanes per activation
//! row with a separate multiply and add, the lanes summed pairwise, times the row scale. The
//! result does not depend on the threading (tested).

use rayon::prelude::*;

use keep_format::e8p::{decode_e8p, decode_e8p_ref, E8P_DIM};

/// Activation rows the fast product takes per pass over the codes (`M` is taken in blocks of
/// this many, the tail as 3, 2 or 1; any `M` is accepted).
pub const E8P_MATMUL_ROW_BLOCK: usize = 4;

use crate::{KernelError, Result};

/// A borrowed E8P weight `[rows, cols]` (out × in): `rows × cols/8` codes, `rows` scales.
#[derive(Debug, Clone, Copy)]
pub struct E8pView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u16],
    pub scales: &'a [f32],
}

impl<'a> E8pView<'a> {
    /// Check lengths (`cols % 8 == 0`).
    pub fn new(codes: &'a [u16], scales: &'a [f32], rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(E8P_DIM) {
            return Err(KernelError::Shape {
                what: "e8p weight",
                msg: format!("{cols} columns is not a multiple of 8"),
            });
        }
        if codes.len() != rows * cols / E8P_DIM || scales.len() != rows {
            return Err(KernelError::Bytes {
                what: "e8p codes/scales",
                rows,
                cols,
                expected: rows * cols / E8P_DIM * 2 + rows * 4,
                got: codes.len() * 2 + scales.len() * 4,
            });
        }
        Ok(E8pView {
            rows,
            cols,
            codes,
            scales,
        })
    }

    /// Bytes one pass reads (codes and scales).
    pub fn nbytes(&self) -> usize {
        self.codes.len() * 2 + self.scales.len() * 4
    }
}

/// Scalar reference: `out[i, r] = Σ_j x[i, j] · (scale[r] · decode_e8p_ref(code)[j % 8])`
/// (one f32 multiply per weight), accumulated in f64 in ascending `j`, rounded once.
pub fn e8p_matmul_ref(x: &[f32], m: usize, w: &E8pView, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    let (k, kc) = (w.cols, w.cols / E8P_DIM);
    for i in 0..m {
        for r in 0..w.rows {
            let mut acc = 0f64;
            for j in 0..k {
                let v = w.scales[r] * decode_e8p_ref(w.codes[r * kc + j / E8P_DIM])[j % E8P_DIM];
                acc += x[i * k + j] as f64 * v as f64;
            }
            out[i * w.rows + r] = acc as f32;
        }
    }
    Ok(())
}

#[inline(always)]
fn lane_sum(a: &[f32; 8]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (b[0] + b[2]) + (b[1] + b[3])
}

#[inline(always)]
fn dot_rows<const MR: usize>(x: &[f32], k: usize, i: usize, row: &[u16]) -> [f32; MR] {
    let mut acc = [[0.0f32; 8]; MR];
    for (c, &code) in row.iter().enumerate() {
        let w = decode_e8p(code);
        for (j, a) in acc.iter_mut().enumerate() {
            let xc = &x[(i + j) * k + c * 8..(i + j) * k + c * 8 + 8];
            for l in 0..8 {
                a[l] += xc[l] * w[l];
            }
        }
    }
    let mut s = [0f32; MR];
    for (o, a) in s.iter_mut().zip(&acc) {
        *o = lane_sum(a);
    }
    s
}

/// Rows `r0..r1`, activation rows in blocks of 4, then 3, 2, 1 (as the format's kernel).
///
/// # Safety
/// `out` is valid for writes at `i*ld + r` (i < m, r in r0..r1) that nobody else makes.
#[inline(always)]
unsafe fn rows_impl(
    w: &E8pView,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    let (k, kc) = (w.cols, w.cols / E8P_DIM);
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(E8P_MATMUL_ROW_BLOCK);
        for r in r0..r1 {
            let row = &w.codes[r * kc..(r + 1) * kc];
            let sc = w.scales[r];
            macro_rules! go {
                ($n:literal) => {{
                    let d = dot_rows::<$n>(x, k, i, row);
                    for (j, v) in d.iter().enumerate() {
                        *out.add((i + j) * ld + r) = sc * v;
                    }
                }};
            }
            match mr {
                4 => go!(4),
                3 => go!(3),
                2 => go!(2),
                _ => go!(1),
            }
        }
        i += mr;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn rows_avx512(
    w: &E8pView,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    rows_impl(w, x, m, r0, r1, out, ld)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_avx2(
    w: &E8pView,
    x: &[f32],
    m: usize,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    rows_impl(w, x, m, r0, r1, out, ld)
}

unsafe fn rows(w: &E8pView, x: &[f32], m: usize, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    #[allow(unused_imports)]
    use crate::cpu::Level;
    match crate::cpu::level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => rows_avx512(w, x, m, r0, r1, out, ld),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => rows_avx2(w, x, m, r0, r1, out, ld),
        _ => rows_impl(w, x, m, r0, r1, out, ld),
    }
}

use crate::rows::{row_tasks, SyncPtr};

/// `out[M×rows] = x[M×cols] · Wᵀ`, threaded over output rows when big (see the module doc).
pub fn e8p_matmul(x: &[f32], m: usize, w: &E8pView, out: &mut [f32]) -> Result<()> {
    crate::cpu::check_operands(x, m, w.rows, w.cols, out)?;
    let rows_n = w.rows;
    let ptr = SyncPtr(out.as_mut_ptr());
    crate::rows::par_rows(rows_n, m * w.cols, |r0, r1| {
        let p = &ptr;
        // SAFETY: lengths checked; disjoint rows of the m×rows output per task.
        unsafe { rows(w, x, m, r0, r1, p.0, rows_n) }
    });
    Ok(())
}

/// One product of an [`e8p_matmul_many`] batch.
pub struct E8pJob<'a, 'b> {
    pub w: E8pView<'a>,
    pub x: &'b [f32],
    pub m: usize,
    pub out: &'b mut [f32],
}

/// Independent E8P products in one parallel pass (a token's top-k experts); each output
/// equals [`e8p_matmul`] of its job.
pub fn e8p_matmul_many(jobs: &mut [E8pJob]) -> Result<()> {
    for j in jobs.iter() {
        crate::cpu::check_operands(j.x, j.m, j.w.rows, j.w.cols, j.out)?;
    }
    let tasks = row_tasks(
        jobs.iter().map(|j| (j.m, j.w.rows, j.w.cols)),
        rayon::current_num_threads(),
    );
    let ptrs: Vec<SyncPtr> = jobs
        .iter_mut()
        .map(|j| SyncPtr(j.out.as_mut_ptr()))
        .collect();
    let jobs_ro: &[E8pJob] = jobs;
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    tasks.par_iter().for_each(|&(ji, r0, r1)| {
        let j = &jobs_ro[ji];
        // SAFETY: tasks of one job cover disjoint row ranges of its output.
        crate::profile::task(reg, || unsafe {
            rows(&j.w, j.x, j.m, r0, r1, ptrs[ji].0, j.w.rows)
        });
    });
    if let Some(r) = region {
        r.finish();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 accumulation over `cols` terms against the f64 reference, relative to Σ|x·w|.
    const REL_TOL: f32 = 1e-5;

    #[test]
    fn fast_matches_ref_on_odd_shapes() {
        let mut r = keep_rng::rng(0x9E37_79B9_7F4A_7C15);
        let mut next = move || keep_rng::RngCore::next_u64(&mut r);
        for &(rows, cols) in &[(1, 8), (5, 24), (33, 136), (300, 512)] {
            let codes: Vec<u16> = (0..rows * cols / 8).map(|_| next() as u16).collect();
            let scales: Vec<f32> = (0..rows)
                .map(|_| (next() % 1000) as f32 / 5000.0 + 0.01)
                .collect();
            let w = E8pView::new(&codes, &scales, rows, cols).unwrap();
            for &m in &[1usize, 2, 3, 4, 5, 9, 32] {
                let x: Vec<f32> = (0..m * cols)
                    .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let (mut a, mut b, mut c) = (
                    vec![0f32; m * rows],
                    vec![0f32; m * rows],
                    vec![0f32; m * rows],
                );
                e8p_matmul_ref(&x, m, &w, &mut a).unwrap();
                e8p_matmul(&x, m, &w, &mut b).unwrap();
                // One thread, at the level the CPU runs: the same bits.
                // SAFETY: c has m*rows elements; one thread.
                unsafe { super::rows(&w, &x, m, 0, rows, c.as_mut_ptr(), rows) };
                assert_eq!(b, c, "threaded vs one thread ({rows}x{cols}, m={m})");
                for i in 0..m {
                    for r in 0..rows {
                        let mag: f32 = (0..cols)
                            .map(|j| {
                                (x[i * cols + j]
                                    * scales[r]
                                    * decode_e8p(codes[r * cols / 8 + j / 8])[j % 8])
                                    .abs()
                            })
                            .sum::<f32>()
                            + 1e-30;
                        assert!((a[i * rows + r] - b[i * rows + r]).abs() <= REL_TOL * mag);
                    }
                }
                // The batched call gives the same bits.
                let mut d = vec![0f32; m * rows];
                e8p_matmul_many(&mut [E8pJob {
                    w,
                    x: &x,
                    m,
                    out: &mut d,
                }])
                .unwrap();
                assert_eq!(b, d);
            }
        }
    }

    #[test]
    fn exact_case_and_errors() {
        // One weight row of code 0 (all 0.75), scale 2: out = 1.5 · Σ x.
        let x: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let (codes, scales) = ([0u16, 0], [2.0f32]);
        let w = E8pView::new(&codes, &scales, 1, 16).unwrap();
        let mut out = [0.0f32; 1];
        e8p_matmul(&x, 1, &w, &mut out).unwrap();
        assert_eq!(out[0], 1.5 * 120.0);
        e8p_matmul_ref(&x, 1, &w, &mut out).unwrap();
        assert_eq!(out[0], 1.5 * 120.0);
        assert!(E8pView::new(&codes[..1], &scales, 1, 12).is_err());
        assert!(E8pView::new(&codes[..1], &scales, 1, 16).is_err());
        assert!(E8pView::new(&codes, &[], 1, 16).is_err());
        assert!(e8p_matmul(&x, 2, &w, &mut out).is_err());
        assert!(e8p_matmul_ref(&x, 1, &w, &mut []).is_err());
        assert!(e8p_matmul(&[], usize::MAX, &w, &mut []).is_err());
    }
}
