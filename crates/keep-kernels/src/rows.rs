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
    let mut tasks = vec![];
    row_tasks_into(shapes, threads, &mut tasks);
    tasks
}

/// [`row_tasks`] into `tasks` (emptied first; no allocation when it holds enough).
pub(crate) fn row_tasks_into(
    shapes: impl Iterator<Item = (usize, usize, usize)> + Clone,
    threads: usize,
    tasks: &mut Vec<(usize, usize, usize)>,
) {
    tasks.clear();
    let total: usize = shapes.clone().map(|(m, rows, cols)| m * rows * cols).sum();
    let target = (total / (threads.max(1) * 4)).max(1);
    for (ji, (m, rows, cols)) in shapes.enumerate() {
        let rows_per = (target / (m * cols).max(1)).clamp(1, rows.max(1));
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + rows_per).min(rows);
            tasks.push((ji, r0, r1));
            r0 = r1;
        }
    }
}

/// The bookkeeping of one batched kernel call (shapes, output pointers, row tasks, the
/// prepared input of each job), kept per thread between calls so that a warm decode step
/// allocates none of it. Taken out of the thread's slot for the call and put back after
/// ([`Books::take`], [`Books::keep`]): a call nested inside another on the same thread finds
/// the slot empty and allocates its own, which is correct, only not free.
#[derive(Default)]
pub(crate) struct Books {
    pub(crate) shapes: Vec<(usize, usize, usize)>,
    pub(crate) outs: Vec<SyncPtr>,
    pub(crate) tasks: Vec<(usize, usize, usize)>,
    pub(crate) which: Vec<usize>,
    pub(crate) keys: Vec<(*const f32, usize, usize)>,
}

thread_local! {
    static BOOKS: std::cell::RefCell<Books> = std::cell::RefCell::new(Books::default());
}

impl Books {
    /// This thread's kept bookkeeping (empty buffers with their capacity).
    pub(crate) fn take() -> Books {
        BOOKS.with(|b| std::mem::take(&mut *b.borrow_mut()))
    }

    /// Empty the buffers (no pointer outlives the call) and keep them for this thread's next
    /// call.
    pub(crate) fn keep(mut self) {
        self.shapes.clear();
        self.outs.clear();
        self.tasks.clear();
        self.which.clear();
        self.keys.clear();
        BOOKS.with(|b| *b.borrow_mut() = self);
    }
}

/// Prepare one activation form per distinct input of a batch: jobs whose input is the same
/// slice (same pointer, length and width) share it. The `k`-th distinct input is prepared into
/// `pool[k]` (the pool grows with default forms where it is short: buffers of earlier calls
/// are reused); `which` gets, per job, the index of its form, `keys` is scratch. `jobs` yields
/// `(x, m, cols)`.
pub(crate) fn prepare_per_input<'x, A: Default, E>(
    jobs: impl Iterator<Item = (&'x [f32], usize, usize)>,
    pool: &mut Vec<A>,
    which: &mut Vec<usize>,
    keys: &mut Vec<(*const f32, usize, usize)>,
    mut prepare: impl FnMut(&mut A, &'x [f32], usize, usize) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    which.clear();
    keys.clear();
    for (x, m, cols) in jobs {
        let key = (x.as_ptr(), x.len(), cols);
        match keys.iter().position(|k| *k == key) {
            Some(p) => which.push(p),
            None => {
                keys.push(key);
                if pool.len() < keys.len() {
                    pool.push(A::default());
                }
                prepare(&mut pool[keys.len() - 1], x, m, cols)?;
                which.push(keys.len() - 1);
            }
        }
    }
    Ok(())
}

/// Run a batch of products given as `(m, rows, cols)` shapes and output pointers: on this
/// thread when small, else as [`row_tasks`] over rayon. `run(job, r0, r1, out)` computes output
/// rows `r0..r1` of job `job` into `out` (the job's `m × rows` output, leading dimension
/// `rows`); tasks of one job cover disjoint row ranges. `tasks` is scratch.
pub(crate) fn run_row_jobs(
    shapes: &[(usize, usize, usize)],
    outs: &[SyncPtr],
    tasks: &mut Vec<(usize, usize, usize)>,
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
    row_tasks_into(shapes.iter().copied(), threads, tasks);
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    tasks
        .par_iter()
        .for_each(|&(ji, r0, r1)| crate::profile::task(reg, || run(ji, r0, r1, outs[ji].0)));
    if let Some(r) = region {
        r.finish();
    }
}
