//! Attention of query heads over cached key and value rows: the op every family's attention
//! calls for its scores, softmax and weighted sum (Qwen3-MoE's and gpt-oss's grouped-query
//! attention, DeepSeek-V4's window and compressed rows), with the (query, head) pairs of one
//! call run in parallel on the worker pool, four heads of one KV head at a time where they come
//! in fours (one pass over each key and value row for the four).
//!
//! One pair is computed by one sequence of operations whatever the pair count and however
//! pairs are cut into tasks or grouped: scores `dot(q·s, k_r)` ([`Scale::Query`]) or `dot(q, k_r)·s`
//! ([`Scale::Score`]) in row order, the softmax's maximum and denominator in row order (with the
//! head's sink logit first where the family has one), and the output `Σ_r (p_r / Σ)·v_r`
//! accumulated in row order from zero. So decode equals prefill bit for bit, and the op equals
//! the per-pair loop each family ran before ([`attend_one`], the scalar statement of it, is
//! what the tests hold the parallel op against).
//!
//! Where the rows are is the family's ([`KvSource`]): [`CausalRows`] is a contiguous cache
//! (every earlier position, or a sliding window of them); [`SharedRows`] a list of rows that
//! are both key and value (V4's window and selected compressed rows).

use rayon::prelude::*;

use crate::rows::{SyncPtr, TASKS_PER_THREAD};

/// Where the score scale is applied.
#[derive(Debug, Clone, Copy)]
pub enum Scale {
    /// To the query before the dots (`dot(q·s, k)`; Qwen3-MoE, DeepSeek-V4).
    Query(f32),
    /// To each dot (`dot(q, k)·s`; gpt-oss).
    Score(f32),
}

/// The key and value rows each query attends.
pub trait KvSource<'a>: Sync {
    /// Rows query `i` attends.
    fn count(&self, i: usize) -> usize;
    /// Key `r` (of `count(i)`) of query `i` for KV head `g`.
    fn key(&self, i: usize, g: usize, r: usize) -> &'a [f32];
    /// Value `r` of query `i` for KV head `g`.
    fn value(&self, i: usize, g: usize, r: usize) -> &'a [f32];
}

/// A contiguous cache of `[rows × kv_heads·head_dim]` keys and values where query `i` sits at
/// position `start + i` and attends every position up to its own, or only the last `window` of
/// them; cache row `0` holds position `base` (a sliding cache dropped the rows before).
#[derive(Debug, Clone, Copy)]
pub struct CausalRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    /// Floats per cache row (`kv_heads · head_dim`).
    pub stride: usize,
    pub head_dim: usize,
    /// Position of query 0.
    pub start: usize,
    /// Position of cache row 0.
    pub base: usize,
    /// Positions a query sees, its own included (`None`: all).
    pub window: Option<usize>,
}

impl CausalRows<'_> {
    /// Cache row of query `i`'s first key.
    #[inline]
    fn first(&self, i: usize) -> usize {
        let pos = self.start + i;
        let first = match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        };
        first - self.base
    }

    #[inline]
    fn row<'s>(&self, m: &'s [f32], i: usize, g: usize, r: usize) -> &'s [f32] {
        let at = (self.first(i) + r) * self.stride + g * self.head_dim;
        &m[at..at + self.head_dim]
    }
}

impl<'a> KvSource<'a> for CausalRows<'a> {
    #[inline]
    fn count(&self, i: usize) -> usize {
        self.start + i + 1 - self.first(i) - self.base
    }
    #[inline]
    fn key(&self, i: usize, g: usize, r: usize) -> &'a [f32] {
        self.row(self.k, i, g, r)
    }
    #[inline]
    fn value(&self, i: usize, g: usize, r: usize) -> &'a [f32] {
        self.row(self.v, i, g, r)
    }
}

/// One query's `n` rows given by `row(r)`, each both key and value (one KV head shared by
/// every query head: DeepSeek-V4's window and compressed rows); `i` and `g` are ignored, so
/// a call covers one query.
pub struct SharedRows<F> {
    pub n: usize,
    pub row: F,
}

impl<'r, F: Fn(usize) -> &'r [f32] + Sync> KvSource<'r> for SharedRows<F> {
    #[inline]
    fn count(&self, _: usize) -> usize {
        self.n
    }
    #[inline]
    fn key(&self, _: usize, _: usize, r: usize) -> &'r [f32] {
        (self.row)(r)
    }
    #[inline]
    fn value(&self, _: usize, _: usize, r: usize) -> &'r [f32] {
        (self.row)(r)
    }
}

/// The shape of one call: `queries` × `heads` query heads of `head_dim`, `group` query heads
/// per KV head (head `h` reads KV head `h / group`).
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub queries: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub group: usize,
}

/// One (query `i`, head `head`) pair: `out` (`head_dim`, added to: zero it first) gets the
/// softmax-weighted sum of the values; `q` is the head's query; `scores` holds at least
/// `kv.count(i)` floats of working space.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn attend_one<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    q: &[f32],
    scale: Scale,
    sink: Option<f32>,
    out: &mut [f32],
    scores: &mut [f32],
) {
    let n = kv.count(i);
    let scores = &mut scores[..n];
    match scale {
        Scale::Query(s) => {
            let mut buf = [0f32; 1024];
            let mut long = Vec::new();
            let qs: &mut [f32] = if q.len() <= buf.len() {
                &mut buf[..q.len()]
            } else {
                long.resize(q.len(), 0f32);
                &mut long[..]
            };
            for (a, b) in qs.iter_mut().zip(q) {
                *a = b * s;
            }
            for (r, o) in scores.iter_mut().enumerate() {
                *o = crate::matmul::dot(qs, kv.key(i, g, r));
            }
        }
        Scale::Score(s) => {
            for (r, o) in scores.iter_mut().enumerate() {
                *o = crate::matmul::dot(q, kv.key(i, g, r)) * s;
            }
        }
    }
    // A missing sink is a logit of −∞: it leaves the maximum and adds exp(−∞) = 0 first.
    let sink = sink.unwrap_or(f32::NEG_INFINITY);
    let m = scores.iter().copied().fold(sink, f32::max);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut sum = (sink - m).exp();
    for v in scores.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    for v in scores.iter_mut() {
        *v /= sum;
    }
    let hd = out.len();
    weighted_rows(kv, i, g, scores, [true, false, false, false], out, hd);
}

/// `out[j] += w[j][r] · v_r` (the product rounded, then the sum) for every value row `r` in
/// order, for the live heads `j` of up to four (`w`: `heads × n` weights, head `j`'s at
/// `j·n`; `out`: the heads' outputs one after the other, `hd` each; the first
/// `min(hd, value row)` columns). The same bits on every level: the vector levels multiply
/// and add per lane as the scalar loop does, without fusing.
fn weighted_rows<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    w: &[f32],
    live: [bool; 4],
    out: &mut [f32],
    hd: usize,
) {
    let n = kv.count(i);
    if n == 0 || hd == 0 {
        return;
    }
    let cols = hd.min(kv.value(i, g, 0).len());
    #[cfg(target_arch = "x86_64")]
    match crate::cpu::level() {
        // SAFETY: the CPU has the level's features (checked by `cpu::level`).
        crate::cpu::Level::Avx512 => unsafe {
            weighted_rows_avx512(kv, i, g, w, live, out, hd, cols)
        },
        // SAFETY: as above.
        crate::cpu::Level::Avx2 => unsafe { weighted_rows_avx2(kv, i, g, w, live, out, hd, cols) },
        _ => weighted_rows_scalar(kv, i, g, w, live, out, hd, 0..cols),
    }
    #[cfg(not(target_arch = "x86_64"))]
    weighted_rows_scalar(kv, i, g, w, live, out, hd, 0..cols)
}

/// [`weighted_rows`] in plain Rust on columns `c` (the vector levels' tails).
#[allow(clippy::too_many_arguments)]
fn weighted_rows_scalar<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    w: &[f32],
    live: [bool; 4],
    out: &mut [f32],
    hd: usize,
    c: std::ops::Range<usize>,
) {
    let n = kv.count(i);
    for r in 0..n {
        let v = &kv.value(i, g, r)[c.clone()];
        for (j, o) in out.chunks_exact_mut(hd).take(4).enumerate() {
            if live[j] {
                let wj = w[j * n + r];
                for (a, b) in o[c.clone()].iter_mut().zip(v) {
                    *a += wj * b;
                }
            }
        }
    }
}

/// [`weighted_rows`] on 16 lanes (AVX-512 F).
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_rows_avx512<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    w: &[f32],
    live: [bool; 4],
    out: &mut [f32],
    hd: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let n = kv.count(i);
    let full = cols / 16 * 16;
    let heads = (out.len() / hd).min(4);
    for r in 0..n {
        let v = &kv.value(i, g, r)[..full];
        for j in 0..heads {
            if !live[j] {
                continue;
            }
            let wj = _mm512_set1_ps(w[j * n + r]);
            let o = &mut out[j * hd..j * hd + full];
            let mut k = 0;
            while k < full {
                // SAFETY: k + 16 <= full, the length of both slices.
                let p = _mm512_mul_ps(wj, _mm512_loadu_ps(v.as_ptr().add(k)));
                _mm512_storeu_ps(
                    o.as_mut_ptr().add(k),
                    _mm512_add_ps(_mm512_loadu_ps(o.as_ptr().add(k)), p),
                );
                k += 16;
            }
        }
    }
    if full < cols {
        weighted_rows_scalar(kv, i, g, w, live, out, hd, full..cols);
    }
}

/// [`weighted_rows`] on 8 lanes (AVX).
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_rows_avx2<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    w: &[f32],
    live: [bool; 4],
    out: &mut [f32],
    hd: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let n = kv.count(i);
    let full = cols / 8 * 8;
    let heads = (out.len() / hd).min(4);
    for r in 0..n {
        let v = &kv.value(i, g, r)[..full];
        for j in 0..heads {
            if !live[j] {
                continue;
            }
            let wj = _mm256_set1_ps(w[j * n + r]);
            let o = &mut out[j * hd..j * hd + full];
            let mut k = 0;
            while k < full {
                // SAFETY: k + 8 <= full, the length of both slices.
                let p = _mm256_mul_ps(wj, _mm256_loadu_ps(v.as_ptr().add(k)));
                _mm256_storeu_ps(
                    o.as_mut_ptr().add(k),
                    _mm256_add_ps(_mm256_loadu_ps(o.as_ptr().add(k)), p),
                );
                k += 8;
            }
        }
    }
    if full < cols {
        weighted_rows_scalar(kv, i, g, w, live, out, hd, full..cols);
    }
}

/// Four heads of query `i` that read the same KV head `g` (consecutive heads of one group),
/// each computed exactly as [`attend_one`] computes it: the four dots against a key row in one
/// pass over it ([`crate::matmul::dot4`], each equal to `dot` bit for bit), and each value row
/// read once for the four weighted sums, every output element still summed in row order.
/// `out`: the four heads' outputs, one after the other (added to: zero them first); `scores`:
/// at least `4 · kv.count(i)` floats.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn attend_four<'a, K: KvSource<'a> + ?Sized>(
    kv: &K,
    i: usize,
    g: usize,
    q: [&[f32]; 4],
    scale: Scale,
    sinks: [Option<f32>; 4],
    out: &mut [f32],
    scores: &mut [f32],
) {
    let (n, hd) = (kv.count(i), q[0].len());
    if hd > 1024 {
        for (j, o) in out.chunks_exact_mut(hd).take(4).enumerate() {
            attend_one(kv, i, g, q[j], scale, sinks[j], o, scores);
        }
        return;
    }
    let scores = &mut scores[..4 * n];
    let mut buf = [[0f32; 1024]; 4];
    let qs: [&[f32]; 4] = match scale {
        Scale::Query(s) => {
            for (b, qj) in buf.iter_mut().zip(q) {
                for (a, v) in b.iter_mut().zip(qj) {
                    *a = v * s;
                }
            }
            let [b0, b1, b2, b3] = &buf;
            [&b0[..hd], &b1[..hd], &b2[..hd], &b3[..hd]]
        }
        Scale::Score(_) => q,
    };
    for r in 0..n {
        let d = crate::matmul::dot4(qs, kv.key(i, g, r));
        for (j, d) in d.into_iter().enumerate() {
            scores[j * n + r] = match scale {
                Scale::Query(_) => d,
                Scale::Score(s) => d * s,
            };
        }
    }
    let mut live = [false; 4];
    for (j, sc) in scores.chunks_exact_mut(n.max(1)).take(4).enumerate() {
        let sink = sinks[j].unwrap_or(f32::NEG_INFINITY);
        let m = sc.iter().copied().fold(sink, f32::max);
        if m == f32::NEG_INFINITY || n == 0 {
            continue;
        }
        let mut sum = (sink - m).exp();
        for v in sc.iter_mut() {
            *v = (*v - m).exp();
            sum += *v;
        }
        for v in sc.iter_mut() {
            *v /= sum;
        }
        live[j] = true;
    }
    weighted_rows(kv, i, g, scores, live, out, hd);
}

/// Every (query, head) pair of `shape` into `out` (`[queries × heads × head_dim]`, zeroed
/// here) from `q` (the same layout), `sinks` one logit per head where the family has them;
/// `scores`: working space, grown to `4 · threads · most rows` (reserve it for the context to
/// keep decode free of allocations). Where a KV head's query heads come in fours, each four
/// is one unit ([`attend_four`]), else each pair ([`attend_one`]); units run in parallel when
/// the call is large enough.
pub fn attend<'a, K: KvSource<'a>>(
    shape: Heads,
    q: &[f32],
    kv: &K,
    scale: Scale,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let Heads {
        queries: t,
        heads: h,
        head_dim: hd,
        group,
    } = shape;
    let group = group.max(1);
    let pairs = t * h;
    let out = &mut out[..pairs * hd];
    out.fill(0.0);
    let q = &q[..pairs * hd];
    let most = (0..t).map(|i| kv.count(i)).max().unwrap_or(0);
    let rows: usize = (0..t).map(|i| kv.count(i)).sum();
    // Heads per unit: four where every KV head's query heads come in fours.
    let width = if group.is_multiple_of(4) { 4 } else { 1 };
    let units = pairs / width;
    let threads = rayon::current_num_threads();
    let parallel = threads > 1 && units > 1 && rows * h * hd * 2 >= crate::cpu::PAR_MIN_MACS;
    let slots = if parallel { threads } else { 1 };
    let slot_len = width * most;
    if scores.len() < slots * slot_len {
        scores.resize(slots * slot_len, 0.0);
    }
    let one = |u: usize, o: &mut [f32], sc: &mut [f32]| {
        let p = u * width;
        let (i, head) = (p / h, p % h);
        let qh = |j: usize| &q[(p + j) * hd..(p + j + 1) * hd];
        let sink = |j: usize| sinks.map(|s| s[head + j]);
        if width == 4 {
            let qs = [qh(0), qh(1), qh(2), qh(3)];
            let sk = [sink(0), sink(1), sink(2), sink(3)];
            attend_four(kv, i, head / group, qs, scale, sk, o, sc);
        } else {
            attend_one(kv, i, head / group, qh(0), scale, sink(0), o, sc);
        }
    };
    let unit_len = width * hd;
    if !parallel {
        for (u, o) in out.chunks_exact_mut(unit_len).enumerate() {
            one(u, o, &mut scores[..slot_len]);
        }
        return;
    }
    let chunks = (threads * TASKS_PER_THREAD).min(units);
    let per = units.div_ceil(chunks);
    let (optr, sptr) = (SyncPtr(out.as_mut_ptr()), SyncPtr(scores.as_mut_ptr()));
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    (0..chunks).into_par_iter().for_each(|c| {
        let (u0, u1) = (c * per, ((c + 1) * per).min(units));
        if u0 >= u1 {
            return;
        }
        // Each pool thread runs one task at a time and a task calls no parallel code, so a
        // thread's slot of the working space is its own for the task.
        let slot = rayon::current_thread_index().unwrap_or(0) % slots;
        let (op, sp) = (&optr, &sptr);
        crate::profile::task(reg, || {
            // SAFETY: units u0..u1 own out[u0·unit_len..u1·unit_len] (tasks' ranges are
            // disjoint) and this thread owns scores slot `slot`; both lie inside their buffers.
            let (o, sc) = unsafe {
                (
                    std::slice::from_raw_parts_mut(op.0.add(u0 * unit_len), (u1 - u0) * unit_len),
                    std::slice::from_raw_parts_mut(sp.0.add(slot * slot_len), slot_len),
                )
            };
            for (k, o) in o.chunks_exact_mut(unit_len).enumerate() {
                one(u0 + k, o, sc);
            }
        });
    });
    if let Some(r) = region {
        r.finish();
    }
}

/// Tasks that each own one block of an output, of a working space and of a scores buffer
/// (DeepSeek-V3's latent attention: a task's heads, one after another, with the head's
/// decoded `kv_b_proj` rows): `f(task, out, work, scores)` for every task, `out` cut into
/// blocks of `out_len` (the last may be shorter), `work` and `scores` into exact blocks of
/// `work_len` and `scores_len`, as many tasks as `out` has blocks (the other two hold at least
/// that many); on the worker pool when `parallel`, else here in order (timed as one profile
/// region when parallel).
#[allow(clippy::too_many_arguments)]
pub fn par_blocks(
    out: &mut [f32],
    out_len: usize,
    work: &mut [f32],
    work_len: usize,
    scores: &mut [f32],
    scores_len: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync,
) {
    let (ol, wl, sl) = (out_len.max(1), work_len.max(1), scores_len.max(1));
    if !parallel {
        out.chunks_mut(ol)
            .zip(work.chunks_exact_mut(wl))
            .zip(scores.chunks_exact_mut(sl))
            .enumerate()
            .for_each(|(c, ((o, w), s))| f(c, o, w, s));
        return;
    }
    let region = crate::profile::Region::begin();
    let reg = region.as_ref();
    out.par_chunks_mut(ol)
        .zip(work.par_chunks_exact_mut(wl))
        .zip(scores.par_chunks_exact_mut(sl))
        .enumerate()
        .for_each(|(c, ((o, w), s))| crate::profile::task(reg, || f(c, o, w, s)));
    if let Some(r) = region {
        r.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.f()).collect()
    }

    /// The parallel op equals the pair-by-pair statement bit for bit, for both scale kinds,
    /// with and without sinks, full and windowed caches, one query (decode) and many (prefill),
    /// on 1–3 threads; and a prefill's row `i` equals a decode at that position.
    #[test]
    fn parallel_pairs_equal_the_pair_by_pair_loop() {
        let mut rng = Rng::new(11);
        for (kvh, hd, group) in [(2, 40, 3), (2, 40, 4), (1, 24, 8)] {
            let h = kvh * group;
            let stride = kvh * hd;
            for threads in 1..=3 {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                // The last two are above the threading threshold.
                for (start, t, window) in [
                    (0, 1, None),
                    (5, 1, None),
                    (9, 64, Some(7)),
                    (0, 200, None),
                    (50, 120, Some(60)),
                ] {
                    let rows = start + t;
                    let (k, v) = (rand(&mut rng, rows * stride), rand(&mut rng, rows * stride));
                    let q = rand(&mut rng, t * h * hd);
                    let sinks = rand(&mut rng, h);
                    let kv = CausalRows {
                        k: &k,
                        v: &v,
                        stride,
                        head_dim: hd,
                        start,
                        base: 0,
                        window,
                    };
                    for scale in [Scale::Query(0.3), Scale::Score(0.3)] {
                        for sink in [None, Some(&sinks[..])] {
                            let shape = Heads {
                                queries: t,
                                heads: h,
                                head_dim: hd,
                                group,
                            };
                            let mut got = vec![f32::NAN; t * h * hd];
                            pool.install(|| {
                                attend(shape, &q, &kv, scale, sink, &mut got, &mut Vec::new())
                            });
                            let mut want = vec![0f32; t * h * hd];
                            let mut sc = vec![0f32; rows];
                            for i in 0..t {
                                for head in 0..h {
                                    let p = i * h + head;
                                    attend_one(
                                        &kv,
                                        i,
                                        head / group,
                                        &q[p * hd..(p + 1) * hd],
                                        scale,
                                        sink.map(|s| s[head]),
                                        &mut want[p * hd..(p + 1) * hd],
                                        &mut sc,
                                    );
                                }
                            }
                            let bits =
                                |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&got), bits(&want), "{threads} threads, t {t}");
                            // The last query of a prefill is a decode at its position.
                            let one = CausalRows {
                                start: start + t - 1,
                                ..kv
                            };
                            let mut dec = vec![0f32; h * hd];
                            let shape1 = Heads {
                                queries: 1,
                                ..shape
                            };
                            let ql = &q[(t - 1) * h * hd..];
                            attend(shape1, ql, &one, scale, sink, &mut dec, &mut Vec::new());
                            assert_eq!(bits(&dec), bits(&got[(t - 1) * h * hd..]));
                        }
                    }
                }
            }
        }
    }

    /// Every task gets its own blocks, in order, the last output block shorter, parallel or
    /// not (fails when a task is handed another's working space).
    #[test]
    fn par_blocks_hands_each_task_its_own_blocks() {
        for parallel in [false, true] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(3)
                .build()
                .unwrap();
            let (mut out, mut work, mut sc) =
                (vec![0f32; 23], vec![0f32; 5 * 4], vec![0f32; 5 * 2]);
            pool.install(|| {
                par_blocks(
                    &mut out,
                    5,
                    &mut work,
                    4,
                    &mut sc,
                    2,
                    parallel,
                    |c, o, w, s| {
                        assert_eq!((w.len(), s.len()), (4, 2));
                        assert!(w.iter().chain(s.iter()).all(|&v| v == 0.0), "shared work");
                        w.fill(c as f32 + 1.0);
                        s.fill(c as f32 + 1.0);
                        for (j, v) in o.iter_mut().enumerate() {
                            *v = (c * 5 + j) as f32;
                        }
                    },
                )
            });
            assert_eq!(out, (0..23).map(|v| v as f32).collect::<Vec<_>>());
            for c in 0..5 {
                assert!(work[c * 4..(c + 1) * 4]
                    .iter()
                    .all(|&v| v == c as f32 + 1.0));
                assert!(sc[c * 2..(c + 1) * 2].iter().all(|&v| v == c as f32 + 1.0));
            }
        }
    }

    /// The weighted sum of value rows is the plain loop's bits on every level this CPU has,
    /// with and without columns past the last whole vector and with a head skipped (fails
    /// when a level fuses the multiply and the add).
    #[test]
    fn weighted_rows_are_the_plain_loop_on_every_level() {
        let mut rng = Rng::new(17);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for hd in [8, 20, 40, 64, 77] {
            let n = 13;
            let v = rand(&mut rng, n * hd);
            let kv = CausalRows {
                k: &v,
                v: &v,
                stride: hd,
                head_dim: hd,
                start: n - 1,
                base: 0,
                window: None,
            };
            let w = rand(&mut rng, 4 * n);
            let live = [true, false, true, true];
            let init = rand(&mut rng, 4 * hd);
            let mut want = init.clone();
            for r in 0..n {
                for j in (0..4).filter(|&j| live[j]) {
                    for c in 0..hd {
                        want[j * hd + c] += w[j * n + r] * v[r * hd + c];
                    }
                }
            }
            let mut got = vec![init.clone(); 2];
            weighted_rows_scalar(&kv, 0, 0, &w, live, &mut got[0], hd, 0..hd);
            weighted_rows(&kv, 0, 0, &w, live, &mut got[1], hd);
            #[cfg(target_arch = "x86_64")]
            {
                if is_x86_feature_detected!("avx512f") {
                    let mut o = init.clone();
                    // SAFETY: AVX-512 F checked.
                    unsafe { weighted_rows_avx512(&kv, 0, 0, &w, live, &mut o, hd, hd) };
                    got.push(o);
                }
                if is_x86_feature_detected!("avx") {
                    let mut o = init.clone();
                    // SAFETY: AVX checked.
                    unsafe { weighted_rows_avx2(&kv, 0, 0, &w, live, &mut o, hd, hd) };
                    got.push(o);
                }
            }
            for (l, o) in got.iter().enumerate() {
                assert_eq!(bits(o), bits(&want), "hd {hd}, level {l}");
            }
        }
    }

    /// The scores against a direct f64 softmax attention: the op is attention.
    #[test]
    fn one_pair_is_softmax_attention() {
        let mut rng = Rng::new(5);
        let (hd, n) = (16, 9);
        let (k, v, q) = (
            rand(&mut rng, n * hd),
            rand(&mut rng, n * hd),
            rand(&mut rng, hd),
        );
        let kv = CausalRows {
            k: &k,
            v: &v,
            stride: hd,
            head_dim: hd,
            start: n - 1,
            base: 0,
            window: None,
        };
        for sink in [None, Some(0.7f32)] {
            let mut out = vec![0f32; hd];
            attend_one(
                &kv,
                0,
                0,
                &q,
                Scale::Score(0.25),
                sink,
                &mut out,
                &mut [0.0; 16],
            );
            let s: Vec<f64> = (0..n)
                .map(|r| {
                    (0..hd)
                        .map(|j| q[j] as f64 * k[r * hd + j] as f64)
                        .sum::<f64>()
                        * 0.25
                })
                .collect();
            let e: Vec<f64> = s.iter().map(|x| x.exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |x| (x as f64).exp());
            for j in 0..hd {
                let want: f64 = (0..n).map(|r| e[r] / z * v[r * hd + j] as f64).sum();
                assert!(
                    (out[j] as f64 - want).abs() < 1e-5,
                    "{j}: {} vs {want}",
                    out[j]
                );
            }
        }
    }
}
