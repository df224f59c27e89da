//! Engram table rows from SSD: [`EngramStore`] serves keep-model's `EngramRows` from the
//! checkpoint's own shards, through a row cache (LRU) of a fixed byte size inside the budget.
//!
//! A row of slot s is `head_dim` FP8 bytes in `layers.N.engram.embed.weight` plus `head_dim/32`
//! E8M0 bytes in `layers.N.engram.embed.scale`, two separate extents. Row ids depend only on the
//! token ids, so the model announces every row of a forward ([`EngramRows::prefetch`]) before its
//! first layer: the store queues the rows it does not hold on its I/O pool right away, and the
//! reads run while the layers before the first Engram layer compute. Rows are read with the
//! expert store's positional (`O_DIRECT` where allowed) 4 KiB-aligned reads; rows whose bytes
//! share or abut a page are read together (one run of at most [`MAX_RUN`] bytes per tensor),
//! which is what keeps read amplification (file bytes per useful row byte) down when rows are
//! close. [`EngramStats`] counts hits, misses, bytes, runs and the time `rows` waited.
//!
//! What it is not: no hashing, no arithmetic (keep-model); rows are decoded with keep-kernels'
//! MXFP8 row decoder, the same one the whole-model path uses, so logits are bit-identical.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use keep_checkpoint::{Checkpoint, Dtype};
use keep_kernels::WeightView;
use keep_model::{EngramLayout, EngramRows, ModelError};

use crate::aligned::{align_down, align_up, AlignedBuf};
use crate::io::IoPool;
use crate::store::ShardReader;
use crate::{Result, RuntimeError};

/// The longest read issued for one run of neighbouring rows (per tensor).
pub const MAX_RUN: u64 = 64 * 1024;

/// Where one slot's table lives.
#[derive(Debug, Clone)]
struct Table {
    shard_w: usize,
    w_off: u64,
    shard_s: usize,
    s_off: u64,
    rows: u64,
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
    /// Rows read synchronously because they left the cache before use.
    pub sync_rows: u64,
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

    /// Read rows `rows` (sorted, one run) of `slot`: the FP8 run and the scale run.
    fn read_run(&self, slot: usize, rows: &[u64]) -> Result<(Vec<u8>, u64, u64)> {
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
        let sb = (self.hd / 32) as u64;
        let (r0, r1) = (rows[0], rows[rows.len() - 1] + 1);
        let mut out = vec![0u8; rows.len() * self.row_bytes];
        let mut bytes = 0u64;
        for (shard, off, width, dst_at) in [
            (t.shard_w, t.w_off, self.hd as u64, 0usize),
            (t.shard_s, t.s_off, sb, self.hd),
        ] {
            let (start, end) = (off + r0 * width, off + r1 * width);
            let (a, b) = (align_down(start), align_up(end));
            let mut buf = AlignedBuf::new((b - a) as usize)
                .ok_or_else(|| RuntimeError::Invalid("cannot allocate a read buffer".into()))?;
            let sh = self
                .shards
                .get(shard)
                .ok_or_else(|| RuntimeError::Invalid(format!("no shard {shard}")))?;
            sh.read(buf.as_mut_slice(), a, (end - a) as usize)?;
            bytes += b - a;
            let src = buf.as_slice();
            for (k, &r) in rows.iter().enumerate() {
                let o = (off + r * width - a) as usize;
                let d = k * self.row_bytes + dst_at;
                out[d..d + width as usize].copy_from_slice(&src[o..o + width as usize]);
            }
        }
        Ok((out, bytes, 2))
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
            tables.push(Table {
                shard_w,
                w_off,
                shard_s,
                s_off,
                rows: layout.num_embeddings[slot],
            });
        }
        let shards = ck
            .shards()
            .iter()
            .map(|s| ShardReader::open(s.path(), direct))
            .collect::<Result<Vec<_>>>()?;
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
        self.shared.lock().stats.clone()
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
        // Runs of rows whose FP8 bytes share or abut a page, at most MAX_RUN long.
        let hd = sh.hd as u64;
        let mut runs: Vec<Vec<u64>> = vec![];
        for &r in &miss {
            let start = align_down(table.w_off + r * hd);
            match runs.last_mut() {
                Some(run)
                    if start <= align_up(table.w_off + (run[run.len() - 1] + 1) * hd)
                        && (r + 1 - run[0]) * hd <= MAX_RUN =>
                {
                    run.push(r)
                }
                _ => runs.push(vec![r]),
            }
        }
        let n = miss.len();
        for run in runs {
            let shared = self.shared.clone();
            let ok = self.pool.submit(move || match shared.read_run(slot, &run) {
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

    /// Read one row now, bypassing the cache (a row evicted before its use).
    fn read_now(
        &self,
        slot: usize,
        r: u64,
        out: &mut [f32],
    ) -> std::result::Result<(), ModelError> {
        let sh = &self.shared;
        let (data, bytes, reads) = sh
            .read_run(slot, &[r])
            .map_err(|e| ModelError::Config(format!("engram row read: {e}")))?;
        {
            let mut g = sh.lock();
            g.stats.bytes_read += bytes;
            g.stats.reads += reads;
            g.stats.useful_bytes += sh.row_bytes as u64;
            g.stats.sync_rows += 1;
        }
        let hd = sh.hd;
        let v = WeightView::mxfp8(&data[..hd], &data[hd..], 1, hd)
            .map_err(|e| ModelError::Config(format!("engram row: {e}")))?;
        v.decode_row(0, out);
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
            for (k, &id) in ids.iter().enumerate() {
                self.read_now(slot, id, &mut out[k * hd..(k + 1) * hd])?;
            }
            return Ok(());
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
                    for k in missing {
                        self.read_now(slot, ids[k], &mut out[k * hd..(k + 1) * hd])?;
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
