//! The row-threading helpers every kernel family shares: the output pointer threads write
//! disjoint rows through, the cut of a batch's output rows into tasks, one prepared activation
//! form per distinct input, the run of a batch over rayon, and an FP8 block's scale.
//!
//! A leaf below the kernels (beside [`crate::cpu`]): the exact SIMD rows ([`crate::simd`]), the
//! integer and bf16 kernels ([`crate::intdot`], [`crate::bf16dot`]) and E8P ([`crate::e8p`]) use
//! it, and it uses none of them.

use rayon::prelude::*;

use crate::weight::BlockScales;

/// Scale of an FP8 block (helper for the SIMD paths).
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn block_scale(scales: BlockScales, i: usize) -> f32 {
    match scales {
        BlockScales::E8m0(s) => crate::codec::e8m0_to_f32(s[i]),
        BlockScales::F32(s) => crate::codec::f32_at(s, i),
        BlockScales::Bf16(s) => crate::codec::bf16_at(s, i),
    }
}

/// An output pointer shared by threads that write disjoint rows.
pub(crate) struct SyncPtr(pub(crate) *mut f32);
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

/// Cut the output rows of several products (each `(m, rows, cols)`) into `(job, r0, r1)`
/// tasks of about `total MACs / (threads * 4)` multiply-adds each, for one parallel pass.
pub(crate) fn row_tasks(
    shapes: impl Iterator<Item = (usize, usize, usize)> + Clone,
    threads: usize,
) -> Vec<(usize, usize, usize)> {
    let total: usize = shapes.clone().map(|(m, rows, cols)| m * rows * cols).sum();
    let target = (total / (threads.max(1) * 4)).max(1);
    let mut tasks = vec![];
    for (ji, (m, rows, cols)) in shapes.enumerate() {
        let rows_per = (target / (m * cols).max(1)).clamp(1, rows.max(1));
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + rows_per).min(rows);
            tasks.push((ji, r0, r1));
            r0 = r1;
        }
    }
    tasks
}

/// Prepare one activation form per distinct input of a batch: jobs whose input is the same
/// slice (same pointer, length and width) share it. Returns the prepared forms and, per job,
/// the index of its form. `jobs` yields `(x, m, cols)`.
pub(crate) fn prepare_per_input<'x, A, E>(
    jobs: impl Iterator<Item = (&'x [f32], usize, usize)>,
    mut prepare: impl FnMut(&'x [f32], usize, usize) -> std::result::Result<A, E>,
) -> std::result::Result<(Vec<A>, Vec<usize>), E> {
    let mut acts: Vec<A> = vec![];
    let mut which = vec![];
    let mut keys: Vec<(*const f32, usize, usize)> = vec![];
    for (x, m, cols) in jobs {
        let key = (x.as_ptr(), x.len(), cols);
        match keys.iter().position(|k| *k == key) {
            Some(p) => which.push(p),
            None => {
                keys.push(key);
                acts.push(prepare(x, m, cols)?);
                which.push(acts.len() - 1);
            }
        }
    }
    Ok((acts, which))
}

/// Run a batch of products given as `(m, rows, cols)` shapes and output pointers: on this
/// thread when small, else as [`row_tasks`] over rayon. `run(job, r0, r1, out)` computes output
/// rows `r0..r1` of job `job` into `out` (the job's `m × rows` output, leading dimension
/// `rows`); tasks of one job cover disjoint row ranges.
pub(crate) fn run_row_jobs(
    shapes: &[(usize, usize, usize)],
    outs: &[SyncPtr],
    run: impl Fn(usize, usize, usize, *mut f32) + Sync,
) {
    let threads = rayon::current_num_threads();
    let total: usize = shapes.iter().map(|&(m, rows, cols)| m * rows * cols).sum();
    if threads < 2 || total < crate::cpu::PAR_MIN_MACS {
        for (ji, &(_, rows, _)) in shapes.iter().enumerate() {
            run(ji, 0, rows, outs[ji].0);
        }
        return;
    }
    let tasks = row_tasks(shapes.iter().copied(), threads);
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    tasks
        .par_iter()
        .for_each(|&(ji, r0, r1)| crate::profile::task(reg, || run(ji, r0, r1, outs[ji].0)));
    if let Some(r) = region {
        r.finish();
    }
}
