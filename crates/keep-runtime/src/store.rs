//! The expert store: every routed expert of every layer addressed as (layer, expert) → the
//! extents of its tensors in the checkpoint's own safetensors shards (no conversion step), and
//! the reads that bring one expert into a slot buffer.
//!
//! An expert is its three matrices `w1`, `w2`, `w3`, each a `.weight` and an optional `.scale`
//! (or `.weight_scale_inv`, or MLX's `.scales` with its `.biases`), or a registered format's
//! parts the kernels read, however many its entry has (keep-checkpoint's `ExpertMatrix`:
//! NVFP4's `weight_packed`, `weight_scale` and the per-tensor `weight_global_scale`, read with
//! the expert into its slot like the others): each tensor contiguous in its shard but not
//! necessarily adjacent. Experts that mlx-lm stacks per layer
//! (`switch_mlp`) are the expert's slice of each stacked tensor: nine extents, each in its own
//! stacked tensor, so nine reads (the layout puts them apart; a per-expert layout such as
//! `keep synth`'s or `keep quant`'s is one). Extents of one shard closer than [`COALESCE_GAP`] are merged into one read (a
//! `keep synth` expert, whose six tensors are consecutive, is one read). Each read covers the
//! [`ALIGN`]ed superset of its extents, so it can be issued with `O_DIRECT` into an aligned
//! buffer; a tensor is then the sub-range of the slot at its recorded offset.
//!
//! Reads are positional (`pread`) and bypass the page cache: `O_DIRECT` on Linux, `F_NOCACHE`
//! on macOS. When the filesystem refuses direct I/O (tmpfs), the shard falls back to buffered
//! `pread` followed by `posix_fadvise(DONTNEED)` on the range, and [`ExpertStore::direct_io`]
//! says so.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use keep_checkpoint::naming::ExpertMat;
use keep_checkpoint::{Checkpoint, Dtype, TensorRef};
use keep_model::{ExpertWeights, ModelConfig};

use crate::aligned::{align_down, align_up, read_block, BlockSource, ALIGN};
use crate::{Result, RuntimeError};

/// Extents of one shard with a gap of at most this many bytes are read as one.
pub const COALESCE_GAP: u64 = 64 * 1024;

/// One tensor of an expert: where it is in the file and where it lands in the slot.
#[derive(Debug, Clone)]
pub struct TensorPart {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub shard: usize,
    pub file_offset: u64,
    pub len: u64,
    /// Offset of the tensor's first byte in the slot buffer.
    pub slot_offset: u64,
}

/// One positional read: `len` bytes (aligned) of shard `shard` from `file_start` (aligned) into
/// the slot at `slot_offset` (aligned). `need` bytes from the start must be present (the rest is
/// alignment padding past the last extent, which may lie beyond the end of the file).
#[derive(Debug, Clone, Copy)]
pub struct ReadRun {
    pub shard: usize,
    pub file_start: u64,
    pub len: u64,
    pub need: u64,
    pub slot_offset: u64,
}

/// Where one expert's bytes are and how they land in a slot.
#[derive(Debug, Clone)]
pub struct ExpertLayout {
    /// `w1.weight`, `w1.scale?`, `w2.weight`, `w2.scale?`, `w3.weight`, `w3.scale?`.
    pub tensors: Vec<TensorPart>,
    /// Index into `tensors` of each matrix's weight and optional scale (`w1`, `w2`, `w3`).
    pub mats: [(usize, Option<usize>); 3],
    /// Per matrix, the index into `tensors` of an MLX affine weight's `.biases`, if any.
    pub biases: [Option<usize>; 3],
    /// Per matrix, the indices into `tensors` of the further parts a registered format's
    /// kernels read past the weight and its scale (NVFP4's global scale), in the entry's order.
    pub further: [Vec<usize>; 3],
    /// Per matrix, the residual stage of an E8P weight (code tensor, scale tensor), if any.
    pub resid: [Option<(usize, Option<usize>)>; 3],
    pub runs: Vec<ReadRun>,
    /// Bytes of the tensors themselves.
    pub bytes: u64,
    /// Bytes of the slot this layout needs (sum of the aligned runs).
    pub slot_bytes: u64,
    /// With the residual stages read apart ([`ExpertStore::open_tiered`]): where they are and
    /// how they land in a residual buffer (`resid` is then empty: the slot holds the base).
    pub upper: Option<UpperLayout>,
}

/// The residual stages of one expert, read apart from its base into a buffer of their own.
#[derive(Debug, Clone)]
pub struct UpperLayout {
    /// The residual code and scale tensors.
    pub tensors: Vec<TensorPart>,
    /// Per matrix (`w1`, `w2`, `w3`), the residual stage's (code, scale) index into `tensors`.
    pub mats: [Option<(usize, Option<usize>)>; 3],
    pub runs: Vec<ReadRun>,
    /// Bytes of the tensors themselves.
    pub bytes: u64,
    /// Bytes of the buffer it needs (sum of the aligned runs).
    pub buf_bytes: u64,
}

/// A shard opened for positional reads: a direct descriptor when the filesystem allows one,
/// and a buffered one for the fallback.
#[derive(Debug)]
pub(crate) struct ShardReader {
    path: PathBuf,
    direct: Option<File>,
    direct_ok: AtomicBool,
    buffered: File,
    /// The alignment the file's direct reads need ([`read_block`]) and how it was found.
    block: (u64, BlockSource),
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

#[cfg(target_os = "macos")]
fn open_direct(path: &Path) -> Option<File> {
    use std::os::unix::io::AsRawFd;
    let f = File::open(path).ok()?;
    // SAFETY: fcntl on a descriptor we own; F_NOCACHE takes an int argument.
    let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) };
    (r != -1).then_some(f)
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn open_direct(_path: &Path) -> Option<File> {
    None
}

/// `pread` into `dst` until its first `need` bytes are filled. The first request asks for all of
/// `dst` (aligned, for direct I/O); a short read happens only at the end of the file, where the
/// alignment padding past the last extent may not exist — so the loop stops once `need` bytes
/// are in rather than asking again from an unaligned offset (which `O_DIRECT` would refuse).
fn pread_at_least(f: &File, dst: &mut [u8], offset: u64, need: usize) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut done = 0usize;
    while done < need.min(dst.len()) {
        match f.read_at(&mut dst[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if done < need {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("read {done} of {need} bytes at offset {offset}: the file is shorter than its header says"),
        ));
    }
    Ok(())
}

impl ShardReader {
    pub(crate) fn open(path: &Path, want_direct: bool) -> Result<ShardReader> {
        let buffered = File::open(path).map_err(|e| RuntimeError::io(path, e))?;
        let direct = if want_direct { open_direct(path) } else { None };
        let block = read_block(direct.as_ref().unwrap_or(&buffered));
        Ok(ShardReader {
            path: path.to_path_buf(),
            direct_ok: AtomicBool::new(direct.is_some()),
            direct,
            buffered,
            block,
        })
    }

    /// The alignment (bytes) a read's offset and length need, and how it was found.
    pub(crate) fn block(&self) -> (u64, BlockSource) {
        self.block
    }

    /// The same reader with reads aligned to `bytes` (tests of other device block sizes).
    #[cfg(test)]
    pub(crate) fn with_block(mut self, bytes: u64) -> ShardReader {
        self.block = (bytes, BlockSource::Default);
        self
    }

    /// Read `dst.len()` bytes (aligned) from `offset` (aligned), of which `need` must exist.
    pub(crate) fn read(&self, dst: &mut [u8], offset: u64, need: usize) -> Result<()> {
        if let (Some(f), true) = (&self.direct, self.direct_ok.load(Ordering::Relaxed)) {
            match pread_at_least(f, dst, offset, need) {
                Ok(()) => return Ok(()),
                // The filesystem refused direct I/O on this read: fall back for good.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(RuntimeError::io(&self.path, e)),
            }
        }
        pread_at_least(&self.buffered, dst, offset, need)
            .map_err(|e| RuntimeError::io(&self.path, e))?;
        drop_cached(&self.buffered, offset, dst.len() as u64);
        Ok(())
    }
}

/// Ask the kernel to drop the page-cache pages of a range we just read (advisory).
#[cfg(target_os = "linux")]
fn drop_cached(f: &File, offset: u64, len: u64) {
    use std::os::unix::io::AsRawFd;
    // SAFETY: an advisory call on a descriptor we own; no memory is passed.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_cached(_f: &File, _offset: u64, _len: u64) {}

/// Holds residual-stage reads until opened: a store whose upper stages arrive late, for tests of
/// the rule that a forward never waits for one ([`ExpertStore::hold_upper_reads`]).
#[derive(Debug, Default)]
pub struct ReadGate {
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
}

impl ReadGate {
    /// A closed gate.
    pub fn new() -> ReadGate {
        ReadGate::default()
    }
    /// Let every held read (and every later one) through.
    pub fn open(&self) {
        if let Ok(mut o) = self.open.lock() {
            *o = true;
        }
        self.cv.notify_all();
    }
    /// Hold every later read again (reads already through are not affected).
    pub fn close(&self) {
        if let Ok(mut o) = self.open.lock() {
            *o = false;
        }
    }
    fn wait(&self) {
        let Ok(mut o) = self.open.lock() else { return };
        while !*o {
            match self.cv.wait(o) {
                Ok(g) => o = g,
                Err(_) => return,
            }
        }
    }
}

/// The routed experts of a checkpoint, addressed by (layer, expert).
#[derive(Debug)]
pub struct ExpertStore {
    shards: Vec<ShardReader>,
    layouts: Vec<ExpertLayout>,
    n_layers: usize,
    /// The most routed experts of any layer: the stride of `layouts` and `rht`.
    n_experts: usize,
    /// Each layer's routed experts (`ModelConfig::experts_in_layer`).
    per_layer: Vec<usize>,
    dim: usize,
    inter: usize,
    /// The matrices of an expert with their rows and columns, as the family lays them out
    /// (`Family::expert_matrices`: where gate and up are one interleaved matrix, `w1` is it,
    /// `[2·inter, dim]`, and there is no `w3`).
    mats: Vec<(ExpertMat, usize, usize)>,
    block_hint: Option<(usize, usize)>,
    slot_bytes: u64,
    expert_bytes: u64,
    total_bytes: u64,
    /// Largest residual buffer and bytes of all residual stages (0 unless tiered).
    upper_buf_bytes: u64,
    upper_total_bytes: u64,
    upper_gate: std::sync::Mutex<Option<std::sync::Arc<ReadGate>>>,
    /// Per (layer, expert), the incoherence transforms of matrices stored rotated.
    rht: Vec<keep_model::ExpertRht>,
    /// Shipped upper stages: experts whose upper rung is an expert of the original checkpoint
    /// ([`Self::attach_shipped`]).
    shipped: Option<Box<Shipped>>,
}

/// The original checkpoint's experts that are upper stages of this store's experts.
#[derive(Debug)]
struct Shipped {
    /// The original checkpoint's routed experts.
    store: ExpertStore,
    /// Per (layer, expert) of this store (stride `n_experts`): the original expert that is its
    /// upper stage, if it is one.
    ids: Vec<Option<usize>>,
    /// Experts with a shipped upper stage.
    count: usize,
}

fn part_of(t: TensorRef<'_>) -> TensorPart {
    TensorPart {
        name: t.name.to_string(),
        dtype: t.dtype,
        shape: t.shape.to_vec(),
        shard: t.shard,
        file_offset: t.file_offset,
        len: t.bytes.len() as u64,
        slot_offset: 0,
    }
}

/// Merge the extents of `tensors` into aligned reads and assign each tensor its slot offset.
fn plan_runs(tensors: &mut [TensorPart]) -> (Vec<ReadRun>, u64) {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| (tensors[i].shard, tensors[i].file_offset));
    // Groups of tensor indices read together, with their [start, end) in the file.
    let mut groups: Vec<(usize, u64, u64, Vec<usize>)> = vec![];
    for i in order {
        let t = &tensors[i];
        let end = t.file_offset + t.len;
        match groups.last_mut() {
            Some((sh, _, gend, members))
                if *sh == t.shard && t.file_offset <= gend.saturating_add(COALESCE_GAP) =>
            {
                *gend = (*gend).max(end);
                members.push(i);
            }
            _ => groups.push((t.shard, t.file_offset, end, vec![i])),
        }
    }
    let mut runs = Vec::with_capacity(groups.len());
    let mut slot = 0u64;
    for (shard, start, end, members) in groups {
        let a = align_down(start);
        let b = align_up(end);
        for i in members {
            tensors[i].slot_offset = slot + (tensors[i].file_offset - a);
        }
        runs.push(ReadRun {
            shard,
            file_start: a,
            len: b - a,
            need: end - a,
            slot_offset: slot,
        });
        slot += b - a;
    }
    (runs, slot)
}

impl ExpertStore {
    /// Lay out every routed expert of `ck` (checked against `cfg`'s shapes; no weight byte is
    /// read) and open the shards for reading, with direct I/O when `direct` and the filesystem
    /// allow it.
    pub fn open(ck: &Checkpoint, cfg: &ModelConfig, direct: bool) -> Result<ExpertStore> {
        Self::open_with(ck, cfg, direct, &[])
    }

    /// [`Self::open`] with the residual stages (E8P `.resid.*` tensors) of the experts marked
    /// in `apart[layer][expert]` read apart from their base: their slot holds the base rung
    /// only ([`Self::views`]: base views), and [`Self::read_upper_into`] reads the residual
    /// stages into a buffer of their own ([`Self::views_upper`]: base plus residual). For
    /// precision tiers (`apart`: the experts whose upper stage is their residual).
    pub fn open_tiered(
        ck: &Checkpoint,
        cfg: &ModelConfig,
        direct: bool,
        apart: &[Vec<bool>],
    ) -> Result<ExpertStore> {
        Self::open_with(ck, cfg, direct, apart)
    }

    fn open_with(
        ck: &Checkpoint,
        cfg: &ModelConfig,
        direct: bool,
        apart: &[Vec<bool>],
    ) -> Result<ExpertStore> {
        let shards = ck
            .shards()
            .iter()
            .map(|s| ShardReader::open(s.path(), direct))
            .collect::<Result<Vec<_>>>()?;
        let hint = cfg.raw.weight_block_size();
        let (d, i) = (cfg.dim, cfg.inter);
        let mut layouts = Vec::with_capacity(cfg.n_layers * cfg.n_experts);
        let marker = keep_model::experts::incoherence_map(ck)?;
        let mut rht = Vec::with_capacity(cfg.n_layers * cfg.n_experts);
        let (mut slot_bytes, mut expert_bytes, mut total) = (0u64, 0u64, 0u64);
        let (mut upper_buf, mut upper_total) = (0u64, 0u64);
        let mats_of = cfg.raw.family().expert_matrices(&cfg.raw);
        for l in 0..cfg.n_layers {
            for x in 0..cfg.n_experts {
                let mut tensors = vec![];
                let mut mats = [(0usize, None); 3];
                let mut biases = [None; 3];
                let mut further: [Vec<usize>; 3] = Default::default();
                if !cfg.raw.is_moe_layer(l) || x >= cfg.experts_in_layer(l) {
                    // A dense layer (Qwen3-MoE's, DeepSeek-V3's), or past the layer's own count
                    // where layers have different counts: no routed expert, never asked for one.
                    rht.push(keep_model::ExpertRht::default());
                    layouts.push(ExpertLayout {
                        tensors,
                        mats,
                        runs: vec![],
                        bytes: 0,
                        slot_bytes: 0,
                        resid: [None; 3],
                        biases,
                        further,
                        upper: None,
                    });
                    continue;
                }
                // The transforms keep quant stored, under the family's names of the matrices.
                rht.push(keep_model::experts::coded_rht(&marker, &cfg.raw, l, x)?);
                let split = apart
                    .get(l)
                    .and_then(|v| v.get(x))
                    .copied()
                    .unwrap_or(false);
                let mut resid = [None; 3];
                let mut up_tensors: Vec<TensorPart> = vec![];
                let mut up_mats: [Option<(usize, Option<usize>)>; 3] = [None; 3];
                for (m, &(mat, rows, cols)) in mats_of.iter().enumerate() {
                    // The expert's own tensors, or its slices of mlx-lm's stacked `switch_mlp`
                    // (weight, scales and biases each one extent of its stacked tensor).
                    let em = keep_checkpoint::layout::expert_matrix(ck, &cfg.raw, l, x, mat)
                        .map_err(|msg| RuntimeError::Layout {
                            layer: l,
                            expert: x,
                            msg: format!("{msg} in the checkpoint"),
                        })?;
                    let (wt, st) = (em.weight, em.scale);
                    let rt = keep_checkpoint::layout::residual_of(ck, wt.name);
                    // The same format and shape checks the model makes (views only).
                    keep_model::weights::expert_view(&em, rt, rows, cols, hint)?;
                    let wi = tensors.len();
                    tensors.push(part_of(wt));
                    let si = st.map(|s| {
                        tensors.push(part_of(s));
                        tensors.len() - 1
                    });
                    mats[m] = (wi, si);
                    biases[m] = em.biases.map(|b| {
                        tensors.push(part_of(b));
                        tensors.len() - 1
                    });
                    for &t in &em.further {
                        tensors.push(part_of(t));
                        further[m].push(tensors.len() - 1);
                    }
                    if split {
                        up_mats[m] = rt.map(|(r, rs)| {
                            up_tensors.push(part_of(r));
                            let ri = up_tensors.len() - 1;
                            let rsi = rs.map(|s| {
                                up_tensors.push(part_of(s));
                                up_tensors.len() - 1
                            });
                            (ri, rsi)
                        });
                        continue;
                    }
                    resid[m] = rt.map(|(r, rs)| {
                        tensors.push(part_of(r));
                        let ri = tensors.len() - 1;
                        let rsi = rs.map(|s| {
                            tensors.push(part_of(s));
                            tensors.len() - 1
                        });
                        (ri, rsi)
                    });
                }
                let (runs, sb) = plan_runs(&mut tensors);
                let bytes: u64 = tensors.iter().map(|t| t.len).sum();
                slot_bytes = slot_bytes.max(sb);
                expert_bytes = expert_bytes.max(bytes);
                total += bytes;
                let upper = (!up_tensors.is_empty()).then(|| {
                    let (runs, bb) = plan_runs(&mut up_tensors);
                    let bytes: u64 = up_tensors.iter().map(|t| t.len).sum();
                    upper_buf = upper_buf.max(bb);
                    upper_total += bytes;
                    UpperLayout {
                        tensors: std::mem::take(&mut up_tensors),
                        mats: up_mats,
                        runs,
                        bytes,
                        buf_bytes: bb,
                    }
                });
                layouts.push(ExpertLayout {
                    tensors,
                    mats,
                    biases,
                    further,
                    resid,
                    runs,
                    bytes,
                    slot_bytes: sb,
                    upper,
                });
            }
        }
        Ok(ExpertStore {
            shards,
            layouts,
            n_layers: cfg.n_layers,
            n_experts: cfg.n_experts,
            per_layer: (0..cfg.n_layers).map(|l| cfg.experts_in_layer(l)).collect(),
            dim: d,
            inter: i,
            mats: mats_of,
            block_hint: hint,
            slot_bytes: slot_bytes.max(ALIGN as u64),
            expert_bytes,
            total_bytes: total,
            upper_buf_bytes: upper_buf,
            upper_total_bytes: upper_total,
            upper_gate: std::sync::Mutex::new(None),
            rht,
            shipped: None,
        })
    }

    /// Make experts of the original checkpoint the upper stages of this store's experts: the
    /// expert `original_ids[layer][expert]` of `original` (an [`ExpertStore::open`] of the
    /// checkpoint this one was quantized from) where it is `Some`. Such a stage is the whole
    /// shipped expert: [`Self::read_upper_into`] reads it into a buffer of its own and
    /// [`Self::views_upper`] gives its views (the base in the slot is not used). Refused when
    /// the shapes differ, an id is not an expert of `original`, or the expert already has its
    /// residual codes as its upper stage.
    pub fn attach_shipped(
        &mut self,
        original: ExpertStore,
        original_ids: &[Vec<Option<usize>>],
    ) -> Result<()> {
        if (original.dim, original.inter, original.n_layers)
            != (self.dim, self.inter, self.n_layers)
        {
            return Err(RuntimeError::Invalid(format!(
                "the original checkpoint's experts are {} × {} in {} layers, this checkpoint's {} × {} in {}: it is not the checkpoint this one was quantized from",
                original.inter, original.dim, original.n_layers, self.inter, self.dim, self.n_layers
            )));
        }
        let mut ids = vec![None; self.layouts.len()];
        let (mut count, mut buf, mut total) = (0usize, 0u64, 0u64);
        for (l, row) in original_ids.iter().enumerate().take(self.n_layers) {
            for (e, &o) in row.iter().enumerate().take(self.experts_in(l)) {
                let Some(o) = o else { continue };
                let lay = original.layout(l, o).ok_or_else(|| RuntimeError::Layout {
                    layer: l,
                    expert: e,
                    msg: format!(
                        "its shipped upper stage would be expert {o} of the original checkpoint, which has {} experts in this layer",
                        original.experts_in(l)
                    ),
                })?;
                if self.layout(l, e).is_some_and(|x| x.upper.is_some()) {
                    return Err(RuntimeError::Layout {
                        layer: l,
                        expert: e,
                        msg: "its residual codes are its upper stage: it cannot also have a shipped one"
                            .into(),
                    });
                }
                ids[l * self.n_experts + e] = Some(o);
                count += 1;
                buf = buf.max(lay.slot_bytes);
                total += lay.bytes;
            }
        }
        self.upper_buf_bytes = self.upper_buf_bytes.max(buf);
        self.upper_total_bytes += total;
        self.shipped = Some(Box::new(Shipped {
            store: original,
            ids,
            count,
        }));
        Ok(())
    }

    /// The original expert that is the shipped upper stage of an expert (`None`: it has none).
    pub fn shipped_upper(&self, layer: usize, expert: usize) -> Option<usize> {
        let sh = self.shipped.as_ref()?;
        self.layout(layer, expert)?;
        sh.ids
            .get(layer * self.n_experts + expert)
            .copied()
            .flatten()
    }

    /// Experts whose upper stage is an expert of the original checkpoint.
    pub fn experts_with_shipped_upper(&self) -> usize {
        self.shipped.as_ref().map_or(0, |s| s.count)
    }

    /// Bytes of the largest upper-stage buffer (0 unless [`Self::open_tiered`] found residual
    /// stages or [`Self::attach_shipped`] added shipped ones).
    pub fn upper_buf_bytes(&self) -> u64 {
        self.upper_buf_bytes
    }
    /// Bytes of all upper stages of all layers, residual and shipped (0 unless tiered).
    pub fn upper_total_bytes(&self) -> u64 {
        self.upper_total_bytes
    }
    /// Experts with an upper stage: a residual stage read apart or a shipped expert (0 unless
    /// tiered).
    pub fn experts_with_upper(&self) -> usize {
        self.layouts.iter().filter(|l| l.upper.is_some()).count()
            + self.experts_with_shipped_upper()
    }

    /// Bytes of the upper-stage buffer of an expert (`None`: it has no upper stage here).
    pub fn upper_bytes(&self, layer: usize, expert: usize) -> Option<u64> {
        if let (Some(o), Some(sh)) = (self.shipped_upper(layer, expert), &self.shipped) {
            return sh.store.layout(layer, o).map(|l| l.slot_bytes);
        }
        self.layout(layer, expert)
            .and_then(|l| l.upper.as_ref())
            .map(|u| u.buf_bytes)
    }

    /// Hold every later residual-stage read until `gate` opens (tests of the never-wait rule).
    pub fn hold_upper_reads(&self, gate: std::sync::Arc<ReadGate>) {
        if let Ok(mut g) = self.upper_gate.lock() {
            *g = Some(gate);
        }
    }

    /// Read the upper stage of an expert (its residual stages, or its shipped expert from the
    /// original checkpoint) into `buf` (at least its [`Self::upper_bytes`] long and
    /// [`ALIGN`]-aligned). Returns the bytes read.
    pub fn read_upper_into(&self, layer: usize, expert: usize, buf: &mut [u8]) -> Result<u64> {
        let gate = self.upper_gate.lock().ok().and_then(|g| g.clone());
        if let Some(g) = gate {
            g.wait();
        }
        if let (Some(o), Some(sh)) = (self.shipped_upper(layer, expert), &self.shipped) {
            return sh.store.read_into(layer, o, buf);
        }
        let up = self
            .layout_or_err(layer, expert)?
            .upper
            .as_ref()
            .ok_or_else(|| RuntimeError::Layout {
                layer,
                expert,
                msg: "no residual stage to read".into(),
            })?;
        self.read_runs(layer, expert, &up.runs, up.buf_bytes, buf)
    }

    fn read_runs(
        &self,
        layer: usize,
        expert: usize,
        runs: &[ReadRun],
        need: u64,
        slot: &mut [u8],
    ) -> Result<u64> {
        if slot.len() < need as usize || !(slot.as_ptr() as usize).is_multiple_of(ALIGN) {
            return Err(RuntimeError::Invalid(format!(
                "buffer of {} bytes at alignment {} cannot take {} bytes",
                slot.len(),
                slot.as_ptr() as usize % ALIGN,
                need
            )));
        }
        let mut n = 0;
        for r in runs {
            let sh = self
                .shards
                .get(r.shard)
                .ok_or_else(|| RuntimeError::Layout {
                    layer,
                    expert,
                    msg: format!("shard {} does not exist", r.shard),
                })?;
            let dst = &mut slot[r.slot_offset as usize..(r.slot_offset + r.len) as usize];
            sh.read(dst, r.file_start, r.need as usize)?;
            n += r.len;
        }
        Ok(n)
    }

    pub fn n_layers(&self) -> usize {
        self.n_layers
    }
    /// The most routed experts of any layer (layers may have fewer: [`Self::experts_in`]).
    pub fn n_experts(&self) -> usize {
        self.n_experts
    }
    /// Routed experts of `layer` (0 past the last layer).
    pub fn experts_in(&self, layer: usize) -> usize {
        self.per_layer.get(layer).copied().unwrap_or(0)
    }
    /// Bytes of one slot: the largest aligned read plan of any expert.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }
    /// Bytes of the largest expert's tensors.
    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }
    /// Bytes of all routed experts of all layers.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }
    /// Whether every shard reads with direct I/O (false once any shard fell back to buffered
    /// reads + `posix_fadvise(DONTNEED)`, e.g. on tmpfs).
    pub fn direct_io(&self) -> bool {
        self.shards
            .iter()
            .all(|s| s.direct.is_some() && s.direct_ok.load(Ordering::Relaxed))
    }

    /// The layout of one expert.
    pub fn layout(&self, layer: usize, expert: usize) -> Option<&ExpertLayout> {
        if layer >= self.n_layers || expert >= self.experts_in(layer) {
            return None;
        }
        self.layouts.get(layer * self.n_experts + expert)
    }

    fn layout_or_err(&self, layer: usize, expert: usize) -> Result<&ExpertLayout> {
        self.layout(layer, expert)
            .ok_or_else(|| RuntimeError::Layout {
                layer,
                expert,
                msg: format!(
                    "no such expert ({} layers; layer {layer} has {} experts)",
                    self.n_layers,
                    self.experts_in(layer)
                ),
            })
    }

    /// Read expert `expert` of `layer` into `slot` (at least [`Self::slot_bytes`] long and
    /// [`ALIGN`]-aligned). Returns the bytes read from the file.
    pub fn read_into(&self, layer: usize, expert: usize, slot: &mut [u8]) -> Result<u64> {
        let lay = self.layout_or_err(layer, expert)?;
        self.read_runs(layer, expert, &lay.runs, lay.slot_bytes, slot)
    }

    /// The three matrices of an expert whose bytes are in `slot` (as [`Self::read_into`] put
    /// them), in their stored format.
    pub fn views<'a>(
        &'a self,
        layer: usize,
        expert: usize,
        slot: &'a [u8],
    ) -> Result<ExpertWeights<'a>> {
        self.views_with(layer, expert, slot, None)
    }

    /// The three matrices of an expert at its upper rung: the base in `slot` (as
    /// [`Self::read_into`] put it) with the residual stages in `upper` (as
    /// [`Self::read_upper_into`] put them); for a shipped upper stage, the original expert in
    /// `upper` alone, in its stored format.
    pub fn views_upper<'a>(
        &'a self,
        layer: usize,
        expert: usize,
        slot: &'a [u8],
        upper: &'a [u8],
    ) -> Result<ExpertWeights<'a>> {
        if let (Some(o), Some(sh)) = (self.shipped_upper(layer, expert), &self.shipped) {
            return sh.store.views(layer, o, upper);
        }
        self.views_with(layer, expert, slot, Some(upper))
    }

    fn views_with<'a>(
        &'a self,
        layer: usize,
        expert: usize,
        slot: &'a [u8],
        upper: Option<&'a [u8]>,
    ) -> Result<ExpertWeights<'a>> {
        let lay = self.layout_or_err(layer, expert)?;
        let up = match upper {
            Some(buf) => Some((
                lay.upper.as_ref().ok_or_else(|| RuntimeError::Layout {
                    layer,
                    expert,
                    msg: "no residual stage".into(),
                })?,
                buf,
            )),
            None => None,
        };
        let uref = |i: usize| -> Result<TensorRef<'a>> {
            let Some((u, buf)) = up else {
                return Err(RuntimeError::Invalid("no residual buffer".into()));
            };
            let t = &u.tensors[i];
            let a = t.slot_offset as usize;
            let bytes = buf.get(a..a + t.len as usize).ok_or_else(|| {
                RuntimeError::Invalid(format!("`{}` lies past the residual buffer", t.name))
            })?;
            Ok(TensorRef {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                bytes,
                shard: t.shard,
                file_offset: t.file_offset,
            })
        };
        let tref = |i: usize| -> Result<TensorRef<'a>> {
            let t = &lay.tensors[i];
            let a = t.slot_offset as usize;
            let bytes = slot
                .get(a..a + t.len as usize)
                .ok_or_else(|| RuntimeError::Invalid(format!("`{}` lies past the slot", t.name)))?;
            Ok(TensorRef {
                name: &t.name,
                dtype: t.dtype,
                shape: &t.shape,
                bytes,
                shard: t.shard,
                file_offset: t.file_offset,
            })
        };
        let mut out = vec![];
        for (m, &(_, rows, cols)) in self.mats.iter().enumerate() {
            let (wi, si) = lay.mats[m];
            let w = tref(wi)?;
            let s = si.map(tref).transpose()?;
            let r = match (lay.resid[m], up.and_then(|(u, _)| u.mats[m])) {
                (Some((ri, rsi)), _) => Some((tref(ri)?, rsi.map(tref).transpose()?)),
                (None, Some((ri, rsi))) => Some((uref(ri)?, rsi.map(uref).transpose()?)),
                (None, None) => None,
            };
            let em = keep_checkpoint::layout::ExpertMatrix {
                weight: w,
                scale: s,
                biases: lay.biases[m].map(tref).transpose()?,
                further: lay.further[m]
                    .iter()
                    .map(|&i| tref(i))
                    .collect::<Result<_>>()?,
            };
            out.push(keep_model::weights::expert_view(
                &em,
                r,
                rows,
                cols,
                self.block_hint,
            )?);
        }
        // A family without an up matrix of its own (gate and up interleaved in `w1`): an empty
        // view, as the checkpoint's.
        while out.len() < 3 {
            out.push(
                keep_kernels::WeightView::f32(&[], 0, 0)
                    .map_err(|e| RuntimeError::Invalid(e.to_string()))?,
            );
        }
        Ok(ExpertWeights {
            w1: out[0],
            w2: out[1],
            w3: out[2],
            rht: self
                .rht
                .get(layer * self.n_experts + expert)
                .copied()
                .unwrap_or_default(),
        })
    }
}

/// Read `len` bytes at `offset` of `path` the way the store does (aligned superset with direct
/// I/O when `direct`, buffered fallback otherwise): for tests and `keep bench`.
pub fn read_range(path: &Path, offset: u64, len: u64, direct: bool) -> Result<(Vec<u8>, bool)> {
    let r = ShardReader::open(path, direct)?;
    let a = align_down(offset);
    let b = align_up(offset + len);
    let mut buf = crate::aligned::AlignedBuf::new((b - a) as usize)
        .ok_or_else(|| RuntimeError::Invalid(format!("cannot allocate {} bytes", b - a)))?;
    r.read(
        &mut buf.as_mut_slice()[..(b - a) as usize],
        a,
        (offset + len - a) as usize,
    )?;
    let s = (offset - a) as usize;
    let used_direct = r.direct.is_some() && r.direct_ok.load(Ordering::Relaxed);
    Ok((buf.as_slice()[s..s + len as usize].to_vec(), used_direct))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(shard: usize, off: u64, len: u64) -> TensorPart {
        TensorPart {
            name: format!("t{off}"),
            dtype: Dtype::U8,
            shape: vec![len],
            shard,
            file_offset: off,
            len,
            slot_offset: 0,
        }
    }

    #[test]
    fn runs_coalesce_and_align() {
        // Consecutive (synth-style) extents: one read.
        let mut t = vec![part(0, 100, 50), part(0, 150, 10), part(0, 160, 5000)];
        let (runs, bytes) = plan_runs(&mut t);
        assert_eq!(runs.len(), 1);
        assert_eq!(
            (runs[0].file_start, runs[0].len, runs[0].need),
            (0, 8192, 5160)
        );
        assert_eq!(bytes, 8192);
        assert_eq!(
            t.iter().map(|x| x.slot_offset).collect::<Vec<_>>(),
            vec![100, 150, 160]
        );
        // Far apart, or in another shard: separate reads, each aligned in the slot.
        let mut t = vec![part(1, 10, 10), part(0, 1 << 30, 4096), part(0, 5, 1)];
        let (runs, bytes) = plan_runs(&mut t);
        assert_eq!(runs.len(), 3);
        assert_eq!(bytes, 4096 * 3);
        assert_eq!(t[2].slot_offset, 5);
        assert_eq!(t[1].slot_offset, 4096);
        assert_eq!(t[0].slot_offset, 2 * 4096 + 10);
        assert!(runs.iter().all(|r| r.slot_offset % 4096 == 0));
    }
}
