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

/// Tasks per thread of one parallel pass. More, smaller tasks let work stealing even out the
/// threads' finish: a thread left idle at the end of a memory-bound pass is read bandwidth
/// lost, and on two threads one core alone reads about half the machine's line. At 4 per
/// thread the 151,936×2048 bf16 head of Qwen3-30B-A3B shapes left 7.4 ms of a 38 ms pass with
/// one thread waiting; at 16, 1.6 ms of 34 (`keep run --profile`, 2 threads). Each task costs a
/// hand-off of a few microseconds; the smallest threaded product (`PAR_MIN_MACS`) still gives
/// each task 64 Ki multiply-adds.
pub(crate) const TASKS_PER_THREAD: usize = 16;

/// Output rows `0..rows` of one product (`macs_per_row` multiply-adds each) on the worker pool:
/// `run(r0, r1)` computes rows `r0..r1`; on this thread alone when the product is small or the
/// pool has one thread, else as tasks of disjoint row ranges over rayon (timed as one profile
/// region). The one place a single product's rows are cut into tasks.
pub(crate) fn par_rows(rows: usize, macs_per_row: usize, run: impl Fn(usize, usize) + Sync) {
    let threads = rayon::current_num_threads();
    if rows * macs_per_row < crate::cpu::PAR_MIN_MACS || threads < 2 || rows < 2 {
        run(0, rows);
        return;
    }
    let chunks = (threads * TASKS_PER_THREAD).min(rows);
    let per = rows.div_ceil(chunks);
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    (0..chunks).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * per, ((c + 1) * per).min(rows));
        if r0 < r1 {
            crate::profile::task(reg, || run(r0, r1));
        }
    });
    if let Some(r) = region {
        r.finish();
    }
}

/// Cut the output rows of several products (each `(m, rows, cols)`) into `(job, r0, r1)`
/// tasks of about `total MACs / (threads * TASKS_PER_THREAD)` multiply-adds each, for one
/// parallel pass.
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
    let target = (total / (threads.max(1) * TASKS_PER_THREAD)).max(1);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Every output row is computed exactly once, on a pool of 1, 2 and 3 threads, for products
    /// below and above the threading threshold and row counts that do not divide evenly.
    #[test]
    fn par_rows_covers_every_row_once() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (rows, macs) in [(1, 1 << 22), (7, 1 << 22), (1000, 4096), (151_936, 2048)] {
                let seen: Vec<AtomicU32> = (0..rows).map(|_| AtomicU32::new(0)).collect();
                pool.install(|| {
                    par_rows(rows, macs, |r0, r1| {
                        for s in &seen[r0..r1] {
                            s.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                });
                assert!(
                    seen.iter().all(|s| s.load(Ordering::Relaxed) == 1),
                    "{threads} threads, {rows} rows"
                );
            }
        }
    }

    /// The tasks of a batch cover each job's rows once, in order, within the job.
    #[test]
    fn row_tasks_cover_each_job_once() {
        let shapes = [
            (1, 768, 2048),
            (1, 2048, 768),
            (3, 5, 64),
            (1, 151_936, 2048),
        ];
        for threads in [1, 2, 16] {
            let tasks = row_tasks(shapes.iter().copied(), threads);
            for (ji, &(_, rows, _)) in shapes.iter().enumerate() {
                let mut next = 0;
                for &(j, r0, r1) in tasks.iter().filter(|t| t.0 == ji) {
                    assert_eq!((j, r0), (ji, next), "{threads} threads");
                    assert!(r1 > r0);
                    next = r1;
                }
                assert_eq!(next, rows, "job {ji}, {threads} threads");
            }
        }
    }
}
