//! Engram table rows from SSD: [`EngramStore`] serves keep-model's `EngramRows` from the
//! checkpoint's own shards, through a row cache (LRU) of a fixed byte size inside the budget.
//!
//! A row of slot s is `head_dim` FP8 bytes in `layers.N.engram.embed.weight` plus `head_dim/32`
//! E8M0 bytes in `layers.N.engram.embed.scale`, two separate extents. Row ids depend only on the
//! token ids, so the model announces every row of a forward ([`EngramRows::prefetch`]) before its
//! first layer: the store queues the rows it does not hold on its I/O pool right away, and the
//! reads run while the layers before the first Engram layer compute. Rows are read with the
//! expert store's positional reads (`O_DIRECT` where allowed), aligned to the logical block size
//! of the device holding the shard ([`read_block`](crate::aligned::read_block): `statx`'s
//! STATX_DIOALIGN, else sysfs, else 4096 — 512 bytes where the device allows). Per tensor, rows
//! whose bytes share or abut a block are read together (one read of at most [`MAX_RUN`] bytes),
//! so a block is read once however many rows it holds; a job of the I/O pool is rows whose scale
//! bytes share or abut a block (`plan_jobs`). That is what keeps read amplification (file
//! bytes per useful row byte) down. [`EngramStats`] counts hits, misses, bytes, reads, the block
//! and the time `rows` waited.
//!
//! What it is not: no hashing, no arithmetic (keep-model); rows are decoded with keep-kernels'
//! MXFP8 row decoder, the same one the whole-model path uses, so logits are bit-identical.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use keep_checkpoint::{Checkpoint, Dtype};
use keep_kernels::WeightView;
use keep_model::{EngramLayout, EngramRows, ModelError};

use crate::aligned::{AlignedBuf, BlockSource, ALIGN};
use crate::io::IoPool;
use crate::store::ShardReader;
use crate::{Result, RuntimeError};

/// The longest read issued for one run of neighbouring rows (per tensor).
pub const MAX_RUN: u64 = 64 * 1024;

/// Where one slot's table lives: its FP8 tensor and its scale tensor.
#[derive(Debug, Clone)]
struct Table {
    w: Tensor,
    s: Tensor,
    rows: u64,
}

/// One tensor of a table: where its rows start, their width and the block its reads align to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tensor {
    shard: usize,
    off: u64,
    width: u64,
    block: u64,
}

impl Tensor {
    fn down(&self, v: u64) -> u64 {
        v / self.block * self.block
    }
    fn up(&self, v: u64) -> u64 {
        v.div_ceil(self.block) * self.block
    }
    /// The first byte of row `r` and the byte after it.
    fn bytes(&self, r: u64) -> (u64, u64) {
        let a = self.off + r * self.width;
        (a, a + self.width)
    }
}

/// One read: bytes `start..end` of a shard (block multiples), of which those before `need_end`
/// exist (the file may end inside the last block), for rows `first..last` of the rows planned.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Extent {
    start: u64,
    end: u64,
    need_end: u64,
    first: usize,
    last: usize,
}

/// Reads of `t` for sorted distinct `rows`: rows whose bytes share or abut a block are read
/// together (so a block is read once however many rows it holds, and no block holding none of
/// them is read), each read at most `max` bytes unless one row alone spans more.
fn block_runs(rows: &[u64], t: Tensor, max: u64) -> Vec<Extent> {
    let mut out: Vec<Extent> = vec![];
    for (k, &r) in rows.iter().enumerate() {
        let (a, b) = t.bytes(r);
        let (start, end) = (t.down(a), t.up(b));
        match out.last_mut() {
            Some(e) if start <= e.end && end - e.start <= max => {
                e.end = e.end.max(end);
                e.need_end = b;
                e.last = k + 1;
            }
            _ => out.push(Extent {
                start,
                end,
                need_end: b,
                first: k,
                last: k + 1,
            }),
        }
    }
    out
}

/// Sorted distinct `rows` of one table split into jobs (one task of the I/O pool each):
/// consecutive rows whose scale bytes share or abut a block, spanning at most [`MAX_RUN`]
/// FP8 bytes, so that a job reads its scale blocks once and its FP8 bytes in
/// [`block_runs`].
fn plan_jobs(rows: &[u64], w: Tensor, s: Tensor) -> Vec<&[u64]> {
    let mut jobs = vec![];
    let mut first = 0;
    for k in 1..=rows.len() {
        let join = k < rows.len() && {
            let (prev, r) = (rows[k - 1], rows[k]);
            s.down(s.bytes(r).0) <= s.up(s.bytes(prev).1)
                && (r + 1 - rows[first]) * w.width <= MAX_RUN
        };
        if !join {
            jobs.push(&rows[first..k]);
            first = k;
        }
    }
    jobs
}

/// Counters of an [`EngramStore`] (since the last reset).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngramStats {
    /// Distinct rows asked for per forward (summed over forwards).
    pub rows_requested: u64,
    /// Of those, rows already in the cache or already being read.
    pub hits: u64,
    /// Rows that had to be read.
    pub misses: u64,
    /// Bytes read from the files (aligned runs).
    pub bytes_read: u64,
    /// Bytes of the rows those reads were for (FP8 + scales).
    pub useful_bytes: u64,
    /// Reads issued.
    pub reads: u64,
    /// Seconds `rows` spent waiting for reads.
    pub wait_secs: f64,
    /// Rows read synchronously because they left the cache before use (or the cache holds
    /// none).
    pub sync_rows: u64,
    /// The alignment of the reads: the tables' device's logical block size
    /// ([`read_block`](crate::aligned::read_block)).
    pub block_bytes: u64,
    /// How `block_bytes` was found (`None` in counters not taken from a store).
    pub block_source: Option<BlockSource>,
}

impl EngramStats {
    /// Hits over requests (1 when nothing was requested).
    pub fn hit_rate(&self) -> f64 {
        if self.rows_requested == 0 {
            1.0
        } else {
            self.hits as f64 / self.rows_requested as f64
        }
    }

    /// File bytes per useful row byte.
    pub fn read_amplification(&self) -> f64 {
        if self.useful_bytes == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.useful_bytes as f64
        }
    }
}

type Key = (u32, u64);

struct Inner {
    map: HashMap<Key, (usize, u64)>,
    order: VecDeque<(Key, u64)>,
    slab: Vec<u8>,
    free: Vec<usize>,
    tick: u64,
    pending: HashSet<Key>,
    failed: Option<String>,
    stats: EngramStats,
}

impl Inner {
    fn touch(&mut self, k: Key) {
        self.tick += 1;
        if let Some(e) = self.map.get_mut(&k) {
            e.1 = self.tick;
            self.order.push_back((k, self.tick));
        }
        if self.order.len() > 4 * self.map.len().max(16) {
            let map = &self.map;
            self.order
                .retain(|(k, s)| map.get(k).is_some_and(|e| e.1 == *s));
        }
    }

    /// A free slab slot, evicting the least recently used row when full.
    fn slot(&mut self) -> Option<usize> {
        if let Some(i) = self.free.pop() {
            return Some(i);
        }
        while let Some((k, s)) = self.order.pop_front() {
            if self.map.get(&k).is_some_and(|e| e.1 == s) {
                return self.map.remove(&k).map(|e| e.0);
            }
        }
        None
    }
}

struct Shared {
    inner: Mutex<Inner>,
    ready: Condvar,
    shards: Vec<ShardReader>,
    tables: Vec<Table>,
    hd: usize,
    row_bytes: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The bytes of sorted distinct `rows` of `slot` (row k at `k·row_bytes`: FP8, then
    /// scales), read per tensor in block-aligned runs ([`block_runs`]); with the bytes read
    /// and the reads issued.
    fn fetch(&self, slot: usize, rows: &[u64]) -> Result<(Vec<u8>, u64, u64)> {
        let t = self
            .tables
            .get(slot)
            .ok_or_else(|| RuntimeError::Invalid(format!("no engram table for slot {slot}")))?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= t.rows) {
            return Err(RuntimeError::Invalid(format!(
                "engram row {bad} of slot {slot} is outside its table ({} rows)",
                t.rows
            )));
        }
        let mut out = vec![0u8; rows.len() * self.row_bytes];
        let (mut bytes, mut reads) = (0u64, 0u64);
        for (tensor, dst_at) in [(t.w, 0usize), (t.s, self.hd)] {
            let sh = self
                .shards
                .get(tensor.shard)
                .ok_or_else(|| RuntimeError::Invalid(format!("no shard {}", tensor.shard)))?;
            let width = tensor.width as usize;
            for e in block_runs(rows, tensor, MAX_RUN) {
                let len = (e.end - e.start) as usize;
                let mut buf = AlignedBuf::new(len)
                    .ok_or_else(|| RuntimeError::Invalid("cannot allocate a read buffer".into()))?;
                let dst = &mut buf.as_mut_slice()[..len];
                sh.read(dst, e.start, (e.need_end - e.start) as usize)?;
                bytes += len as u64;
                reads += 1;
                for (k, &r) in rows.iter().enumerate().take(e.last).skip(e.first) {
                    let o = (tensor.bytes(r).0 - e.start) as usize;
                    let d = k * self.row_bytes + dst_at;
                    out[d..d + width].copy_from_slice(&dst[o..o + width]);
                }
            }
        }
        Ok((out, bytes, reads))
    }

    fn insert(&self, slot: usize, rows: &[u64], data: &[u8]) {
        let mut g = self.lock();
        for (k, &r) in rows.iter().enumerate() {
            let key = (slot as u32, r);
            g.pending.remove(&key);
            if g.map.contains_key(&key) {
                continue;
            }
            let Some(i) = g.slot() else { continue };
            let rb = self.row_bytes;
            g.slab[i * rb..(i + 1) * rb].copy_from_slice(&data[k * rb..(k + 1) * rb]);
            g.map.insert(key, (i, 0));
            g.touch(key);
        }
        drop(g);
        self.ready.notify_all();
    }
}

/// Engram rows read from the checkpoint's shards into an LRU row cache of a fixed size.
pub struct EngramStore {
    shared: Arc<Shared>,
    pool: IoPool,
    capacity_rows: usize,
    block: (u64, BlockSource),
}

/// Bytes of one row (FP8 channels + E8M0 scales).
pub fn row_bytes(head_dim: usize) -> usize {
    head_dim + head_dim / 32
}

/// Bytes of all Engram tables of a checkpoint (`layers.N.engram.embed.*`).
pub fn engram_table_bytes(ck: &Checkpoint) -> u64 {
    ck.tensors()
        .filter(|t| is_engram_table(t.name))
        .map(|t| t.bytes.len() as u64)
        .sum()
}

pub use keep_checkpoint::naming::is_engram_table;

impl EngramStore {
    /// Lay out `layout`'s tables in `ck` (no table byte is read) with a row cache of
    /// `cache_bytes` and `io_threads` readers.
    pub fn open(
        ck: &Checkpoint,
        layout: &EngramLayout,
        cache_bytes: u64,
        direct: bool,
        io_threads: usize,
    ) -> Result<EngramStore> {
        let hd = layout.head_dim;
        if hd == 0 || !hd.is_multiple_of(32) {
            return Err(RuntimeError::Invalid(format!(
                "engram_head_dim {hd} is not a positive multiple of 32"
            )));
        }
        let shards = ck
            .shards()
            .iter()
            .map(|s| ShardReader::open(s.path(), direct))
            .collect::<Result<Vec<_>>>()?;
        let mut tables = vec![];
        for (slot, &l) in layout.layer_ids.iter().enumerate() {
            let get = |n: &str, dt: Dtype, cols: usize| -> Result<(usize, u64)> {
                let name = keep_checkpoint::naming::engram_table(l, n);
                let t = ck
                    .get(&name)
                    .ok_or_else(|| RuntimeError::Invalid(format!("{name} is missing")))?;
                let rows = layout.num_embeddings[slot];
                if t.dtype != dt || t.shape != [rows, cols as u64] {
                    return Err(RuntimeError::Invalid(format!(
                        "{name} is {} {:?}, expected {dt} [{rows}, {cols}]",
                        t.dtype, t.shape
                    )));
                }
                Ok((t.shard, t.file_offset))
            };
            let (shard_w, w_off) = get("weight", Dtype::F8_E4M3, hd)?;
            let (shard_s, s_off) = get("scale", Dtype::F8_E8M0, hd / 32)?;
            let tensor = |shard: usize, off: u64, width: usize| -> Result<Tensor> {
                let sh = shards
                    .get(shard)
                    .ok_or_else(|| RuntimeError::Invalid(format!("no shard {shard}")))?;
                Ok(Tensor {
                    shard,
                    off,
                    width: width as u64,
                    block: sh.block().0,
                })
            };
            tables.push(Table {
                w: tensor(shard_w, w_off, hd)?,
                s: tensor(shard_s, s_off, hd / 32)?,
                rows: layout.num_embeddings[slot],
            });
        }
        Self::from_parts(shards, tables, hd, cache_bytes, io_threads)
    }

    /// A store over `tables` of `shards` with a row cache of `cache_bytes`.
    fn from_parts(
        shards: Vec<ShardReader>,
        tables: Vec<Table>,
        hd: usize,
        cache_bytes: u64,
        io_threads: usize,
    ) -> Result<EngramStore> {
        // The block the reads align to: the largest of the tables' shards (and how found).
        let block = tables
            .iter()
            .flat_map(|t| [t.w.shard, t.s.shard])
            .filter_map(|i| shards.get(i).map(|s| s.block()))
            .max_by_key(|b| b.0)
            .unwrap_or((ALIGN as u64, BlockSource::Default));
        let rb = row_bytes(hd);
        // 0 rows (a budget that leaves nothing for the cache): every row is read when used.
        let capacity_rows = (cache_bytes / rb as u64) as usize;
        let inner = Inner {
            map: HashMap::new(),
            order: VecDeque::new(),
            slab: vec![0u8; capacity_rows * rb],
            free: (0..capacity_rows).rev().collect(),
            tick: 0,
            pending: HashSet::new(),
            failed: None,
            stats: EngramStats::default(),
        };
        Ok(EngramStore {
            shared: Arc::new(Shared {
                inner: Mutex::new(inner),
                ready: Condvar::new(),
                shards,
                tables,
                hd,
                row_bytes: rb,
            }),
            pool: IoPool::new(io_threads).map_err(|e| RuntimeError::io("keep-io threads", e))?,
            capacity_rows,
            block,
        })
    }

    /// Rows the cache holds at most.
    pub fn capacity_rows(&self) -> usize {
        self.capacity_rows
    }

    /// Bytes of the row cache.
    pub fn cache_bytes(&self) -> u64 {
        (self.capacity_rows * self.shared.row_bytes) as u64
    }

    /// Counters since the last reset.
    pub fn stats(&self) -> EngramStats {
        let mut s = self.shared.lock().stats.clone();
        (s.block_bytes, s.block_source) = (self.block.0, Some(self.block.1));
        s
    }

    /// The alignment of the row reads (the tables' device's logical block size, the largest
    /// when shards differ) and how it was found.
    pub fn read_block(&self) -> (u64, BlockSource) {
        self.block
    }

    /// Zero the counters.
    pub fn reset_stats(&self) {
        self.shared.lock().stats = EngramStats::default();
    }

    /// Queue reads for the rows of `slot` that are neither held nor on their way; returns the
    /// rows queued.
    fn request(
        &self,
        slot: usize,
        ids: &[u64],
        count: bool,
    ) -> std::result::Result<usize, ModelError> {
        let sh = &self.shared;
        let table = sh
            .tables
            .get(slot)
            .ok_or_else(|| ModelError::Config(format!("no engram table for slot {slot}")))?;
        let mut rows: Vec<u64> = ids.to_vec();
        rows.sort_unstable();
        rows.dedup();
        if let Some(&bad) = rows.iter().find(|&&r| r >= table.rows) {
            return Err(ModelError::Config(format!(
                "engram row {bad} of slot {slot} is outside its table ({} rows)",
                table.rows
            )));
        }
        let mut g = sh.lock();
        if self.capacity_rows == 0 {
            // Nothing can be held: `rows` reads every row when it is used.
            if count {
                g.stats.rows_requested += rows.len() as u64;
                g.stats.misses += rows.len() as u64;
            }
            return Ok(0);
        }
        let mut miss = vec![];
        for &r in &rows {
            let key = (slot as u32, r);
            if g.map.contains_key(&key) || g.pending.contains(&key) {
                if count {
                    g.stats.hits += 1;
                }
            } else {
                g.pending.insert(key);
                miss.push(r);
            }
        }
        if count {
            g.stats.rows_requested += rows.len() as u64;
        }
        g.stats.misses += miss.len() as u64;
        g.stats.useful_bytes += (miss.len() * sh.row_bytes) as u64;
        drop(g);
        let jobs: Vec<Vec<u64>> = plan_jobs(&miss, table.w, table.s)
            .into_iter()
            .map(<[u64]>::to_vec)
            .collect();
        let n = miss.len();
        for run in jobs {
            let shared = self.shared.clone();
            let ok = self.pool.submit(move || match shared.fetch(slot, &run) {
                Ok((data, bytes, reads)) => {
                    {
                        let mut g = shared.lock();
                        g.stats.bytes_read += bytes;
                        g.stats.reads += reads;
                    }
                    shared.insert(slot, &run, &data);
                }
                Err(e) => {
                    let mut g = shared.lock();
                    g.failed = Some(e.to_string());
                    for &r in &run {
                        g.pending.remove(&(slot as u32, r));
                    }
                    drop(g);
                    shared.ready.notify_all();
                }
            });
            if !ok {
                return Err(ModelError::Config(
                    "the engram I/O pool has shut down".into(),
                ));
            }
        }
        Ok(n)
    }

    fn decode(&self, g: &Inner, i: usize, out: &mut [f32]) -> std::result::Result<(), ModelError> {
        let (hd, rb) = (self.shared.hd, self.shared.row_bytes);
        let row = &g.slab[i * rb..(i + 1) * rb];
        let v = WeightView::mxfp8(&row[..hd], &row[hd..], 1, hd)
            .map_err(|e| ModelError::Config(format!("engram row: {e}")))?;
        v.decode_row(0, out);
        Ok(())
    }

    /// Read the rows `ids[k]` for `k` in `which` now, bypassing the cache (rows evicted before
    /// their use, or every row when the cache holds none): each distinct row once, rows of one
    /// block in one read; row k decoded into `out[k·hd..]`.
    fn read_now(
        &self,
        slot: usize,
        ids: &[u64],
        which: &[usize],
        out: &mut [f32],
    ) -> std::result::Result<(), ModelError> {
        let sh = &self.shared;
        let (hd, rb) = (sh.hd, sh.row_bytes);
        let mut rows: Vec<u64> = which.iter().map(|&k| ids[k]).collect();
        rows.sort_unstable();
        rows.dedup();
        let table = sh
            .tables
            .get(slot)
            .ok_or_else(|| ModelError::Config(format!("no engram table for slot {slot}")))?;
        let mut data = Vec::with_capacity(rows.len() * rb);
        let (mut bytes, mut reads) = (0u64, 0u64);
        for job in plan_jobs(&rows, table.w, table.s) {
            let (d, b, n) = sh
                .fetch(slot, job)
                .map_err(|e| ModelError::Config(format!("engram row read: {e}")))?;
            data.extend_from_slice(&d);
            bytes += b;
            reads += n;
        }
        {
            let mut g = sh.lock();
            g.stats.bytes_read += bytes;
            g.stats.reads += reads;
            g.stats.useful_bytes += (rows.len() * rb) as u64;
            g.stats.sync_rows += rows.len() as u64;
        }
        for &k in which {
            let i = rows
                .binary_search(&ids[k])
                .map_err(|_| ModelError::Config("engram row read: a row was not read".into()))?;
            let row = &data[i * rb..(i + 1) * rb];
            let v = WeightView::mxfp8(&row[..hd], &row[hd..], 1, hd)
                .map_err(|e| ModelError::Config(format!("engram row: {e}")))?;
            v.decode_row(0, &mut out[k * hd..(k + 1) * hd]);
        }
        Ok(())
    }
}

impl EngramRows for EngramStore {
    fn rows(&self, slot: usize, ids: &[u64], out: &mut [f32]) -> keep_model::Result<()> {
        let hd = self.shared.hd;
        if out.len() < ids.len() * hd {
            return Err(ModelError::Config("engram row buffer too small".into()));
        }
        if self.capacity_rows == 0 {
            let all: Vec<usize> = (0..ids.len()).collect();
            return self.read_now(slot, ids, &all, out);
        }
        self.request(slot, ids, false)?;
        let mut done = vec![false; ids.len()];
        let mut asked_again = false;
        let mut waited = 0f64;
        loop {
            let mut g = self.shared.lock();
            if let Some(e) = g.failed.take() {
                return Err(ModelError::Config(format!("engram row read failed: {e}")));
            }
            let (mut missing, mut waiting) = (vec![], false);
            for (k, &id) in ids.iter().enumerate() {
                if done[k] {
                    continue;
                }
                let key = (slot as u32, id);
                if let Some(&(i, _)) = g.map.get(&key) {
                    self.decode(&g, i, &mut out[k * hd..(k + 1) * hd])?;
                    g.touch(key);
                    done[k] = true;
                } else if g.pending.contains(&key) {
                    waiting = true;
                } else {
                    missing.push(k);
                }
            }
            if !missing.is_empty() {
                drop(g);
                if asked_again {
                    // The cache is smaller than this call's rows: read the rest directly.
                    self.read_now(slot, ids, &missing, out)?;
                    for k in missing {
                        done[k] = true;
                    }
                } else {
                    let m: Vec<u64> = missing.iter().map(|&k| ids[k]).collect();
                    self.request(slot, &m, false)?;
                    asked_again = true;
                }
                continue;
            }
            if !waiting {
                g.stats.wait_secs += waited;
                return Ok(());
            }
            let t = Instant::now();
            let g = self.shared.ready.wait(g).unwrap_or_else(|p| p.into_inner());
            drop(g);
            waited += t.elapsed().as_secs_f64();
        }
    }

    fn prefetch(&self, slot: usize, ids: &[u64]) {
        // Errors surface in `rows`, which asks again.
        let _ = self.request(slot, ids, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(off: u64, width: u64, block: u64) -> Tensor {
        Tensor {
            shard: 0,
            off,
            width,
            block,
        }
    }

    #[test]
    fn block_runs_coalesce_rows_that_share_or_abut_a_block() {
        // 96-byte rows from byte 100, 512-byte blocks: rows 0..4 lie in block 0, row 4
        // straddles blocks 0 and 1, row 20 lies in block 3.
        let t = tensor(100, 96, 512);
        let one = |first, last, start, end, need_end| Extent {
            start,
            end,
            need_end,
            first,
            last,
        };
        assert_eq!(block_runs(&[0, 1, 2], t, MAX_RUN), [one(0, 3, 0, 512, 388)]);
        assert_eq!(block_runs(&[4], t, MAX_RUN), [one(0, 1, 0, 1024, 580)]);
        // Abutting blocks: one read; a block between them holding no row: two.
        assert_eq!(block_runs(&[0, 5], t, MAX_RUN), [one(0, 2, 0, 1024, 676)]);
        assert_eq!(
            block_runs(&[0, 20], t, MAX_RUN),
            [one(0, 1, 0, 512, 196), one(1, 2, 1536, 2560, 2116)]
        );
        // A read stops at `max` bytes.
        assert_eq!(
            block_runs(&[0, 5, 10], t, 1024),
            [one(0, 2, 0, 1024, 676), one(2, 3, 1024, 1536, 1156)]
        );
        // At 4096 the same rows are one read.
        assert_eq!(
            block_runs(&[0, 20], tensor(100, 96, 4096), MAX_RUN),
            [one(0, 2, 0, 4096, 2116)]
        );
        // Jobs: rows whose scales (3 bytes a row) share or abut a block, at most MAX_RUN of
        // FP8 bytes apart.
        let s = tensor(40_000, 3, 512);
        let rows = [0u64, 20, 300, 400, 900];
        let jobs = plan_jobs(&rows, t, s);
        assert_eq!(jobs, [&rows[..4], &rows[4..]]);
        let far: Vec<u64> = (0..2000).step_by(10).collect();
        for j in plan_jobs(&far, t, s) {
            assert!((j[j.len() - 1] + 1 - j[0]) * 96 <= MAX_RUN);
        }
    }

    /// A file of `len` pseudo-random bytes.
    fn bytes(len: usize) -> Vec<u8> {
        (0..len as u64)
            .map(|i| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect()
    }

    #[test]
    fn reads_at_any_block_return_exactly_the_rows() {
        // A table of 300 rows of 96 FP8 bytes + 3 scale bytes (odd widths) at odd offsets, the
        // scales ending the file (its last block lies past the end): every set of rows —
        // duplicates, rows straddling blocks, the last row — comes back byte for byte at 512,
        // 1024 and 4096-byte blocks and at the device's own, through the cache, past it and
        // with no cache.
        let (rows, hd, sb) = (300u64, 96usize, 3usize);
        let (w_off, s_off) = (1001u64, 1001 + 300 * 96 + 37);
        let data = bytes(s_off as usize + rows as usize * sb);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.bin");
        std::fs::write(&path, &data).unwrap();
        let rb = row_bytes(hd);
        let want = |r: u64| {
            let (w, s) = (
                (w_off + r * hd as u64) as usize,
                (s_off + r * sb as u64) as usize,
            );
            [&data[w..w + hd], &data[s..s + sb]].concat()
        };
        let sets: [&[u64]; 5] = [
            &[0],
            &[299],
            &[0, 1, 2, 3, 4, 5, 6],
            &[3, 50, 51, 170, 298, 299],
            &(0..300).collect::<Vec<u64>>(),
        ];
        let device = ShardReader::open(&path, true).unwrap().block().0;
        let mut sparse_read = vec![];
        for block in [512u64, 1024, 4096, device] {
            for cache_rows in [0u64, 3, 1000] {
                let reader = ShardReader::open(&path, true).unwrap().with_block(block);
                let table = Table {
                    w: tensor(w_off, hd as u64, block),
                    s: tensor(s_off, sb as u64, block),
                    rows,
                };
                let store = EngramStore::from_parts(
                    vec![reader],
                    vec![table],
                    hd,
                    cache_rows * rb as u64,
                    2,
                )
                .unwrap();
                assert_eq!(store.read_block().0, block);
                for set in sets {
                    let (got, read, reads) = store.shared.fetch(0, set).unwrap();
                    let exp: Vec<u8> = set.iter().flat_map(|&r| want(r)).collect();
                    assert_eq!(got, exp, "block {block}, rows {set:?}");
                    assert_eq!(read % block, 0);
                    assert!(read >= (set.len() * rb) as u64 && reads >= 2);
                    if set.len() == 7 {
                        assert_eq!(reads, 2, "rows of one block: one read per tensor");
                    }
                    if set.len() == 6 && cache_rows == 0 {
                        sparse_read.push((block, read));
                    }
                }
                // Through `rows`, duplicates and out of order: the rows' decoded values.
                let ids = [5u64, 5, 299, 0, 5, 170, 171, 0, 298];
                store.prefetch(0, &ids);
                let mut out = vec![0f32; ids.len() * hd];
                store.rows(0, &ids, &mut out).unwrap();
                for (k, &r) in ids.iter().enumerate() {
                    let row = want(r);
                    let mut exp = vec![0f32; hd];
                    WeightView::mxfp8(&row[..hd], &row[hd..], 1, hd)
                        .unwrap()
                        .decode_row(0, &mut exp);
                    let got = &out[k * hd..(k + 1) * hd];
                    assert!(
                        got.iter()
                            .zip(&exp)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "block {block}, cache {cache_rows} rows: row {r} differs"
                    );
                }
                let s = store.stats();
                assert_eq!(s.block_bytes, block);
                assert_eq!(s.bytes_read % block, 0, "{s:?}");
                assert!(s.bytes_read >= s.useful_bytes, "{s:?}");
                assert!(store.rows(0, &[rows], &mut out).is_err(), "past the table");
            }
        }
        // Smaller blocks read fewer bytes for scattered rows.
        let at = |b: u64| sparse_read.iter().find(|x| x.0 == b).unwrap().1;
        assert!(at(512) < at(4096), "{sparse_read:?}");
    }
}
