//! Engram layers of DeepSeek-V4.1: hashed n-gram rows written into the hyper-connection streams
//! before the layer runs (the published `Engram.forward`, equations in `docs/engram.md`).
//!
//! For position t with row ids `r[t, c]` (c < C = (max_ngram − 1)·heads, from
//! [`EngramLayout::hash`]) the C dequantized rows are concatenated into `e[t]` (C·head_dim),
//! `kv = wkv·e` splits into one key per stream (`hc × dim`) and one shared value (`dim`), and
//! each stream h moves by `gate·value`, `gate = σ(sign(dot)·√max(|dot|, 1e-6))` with
//! `dot = Σ h⊙(q_weight⊙k_weight)⊙key · rsqrt(mean h² + ε) · rsqrt(mean key² + ε) / √dim`.
//!
//! Rows come from an [`EngramRows`] source: [`TableRows`] gathers them from the checkpoint's
//! mapped tables (FP8 E4M3 with one E8M0 scale per 32 channels, read as MXFP8 rows); the runtime
//! can supply them from SSD instead. Because row ids depend only on token ids, a source is told
//! every position's rows ([`EngramRows::prefetch`]) as soon as the tokens are known, before the
//! first layer runs.

use keep_checkpoint::Checkpoint;
use keep_kernels::{matmul_with, profile, WeightView};

use crate::config::ModelConfig;
use crate::engram_hash::EngramLayout;
use crate::layer::Streams;
pub use crate::scratch::EngramScratch;
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// The floor of |dot| under the gate's square root (`clamp_value` of the published module).
pub const GATE_CLAMP: f32 = 1e-6;

/// How much of the Engram tables a token stream uses: rows and bytes per token, and the
/// distinct rows it touched per layer (the size a row cache needs to serve every repeat). Rows
/// follow from the token ids alone, so this needs no forward pass; each sequence added is
/// hashed from its own start, as the model does.
#[derive(Debug, Clone)]
pub struct EngramUse {
    layout: EngramLayout,
    /// Bytes of one row (FP8 weight row plus its E8M0 scale row) per engram slot.
    row_bytes: Vec<u64>,
    seen: Vec<std::collections::HashSet<u64>>,
    tokens: u64,
}

/// What [`EngramUse`] counted.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngramUseReport {
    /// Decoder layers with an Engram.
    pub layers: Vec<usize>,
    pub tokens: u64,
    /// Rows gathered per token in each layer (n-gram orders × hash heads).
    pub rows_per_token: usize,
    /// Table bytes used per token over all Engram layers (weights and scales of the rows).
    pub bytes_per_token: u64,
    /// Distinct rows touched per layer.
    pub distinct_rows: Vec<u64>,
    /// Bytes of those distinct rows over all layers: a row cache this large serves every
    /// repeated row of the stream from memory.
    pub distinct_bytes: u64,
    /// Rows gathered over all layers and tokens.
    pub rows_gathered: u64,
}

impl EngramUse {
    /// `None` when `cfg` has no Engram layers; refuses a checkpoint whose tables are missing.
    pub fn new(ck: &Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>> {
        let Some(layout) = cfg.engram.clone() else {
            return Ok(None);
        };
        let mut row_bytes = vec![];
        for (slot, &l) in layout.layer_ids.iter().enumerate() {
            let rows = layout.num_embeddings[slot].max(1);
            let mut b = 0u64;
            for part in ["weight", "scale"] {
                let name = keep_checkpoint::naming::engram_table(l, part);
                let t = ck
                    .get(&name)
                    .ok_or_else(|| ModelError::Config(format!("engram table {name} is missing")))?;
                b += t.bytes.len() as u64 / rows;
            }
            row_bytes.push(b);
        }
        let seen = vec![Default::default(); layout.layer_ids.len()];
        Ok(Some(EngramUse {
            layout,
            row_bytes,
            seen,
            tokens: 0,
        }))
    }

    /// Count one sequence's rows.
    pub fn add(&mut self, tokens: &[u32]) -> Result<()> {
        let ids = self.layout.hash(&mut vec![], tokens)?;
        let (ns, cols) = (self.layout.layer_ids.len(), self.layout.cols());
        for (i, id) in ids.iter().enumerate() {
            self.seen[(i / cols) % ns].insert(*id);
        }
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    pub fn report(&self) -> EngramUseReport {
        let cols = self.layout.cols();
        let distinct_rows: Vec<u64> = self.seen.iter().map(|s| s.len() as u64).collect();
        EngramUseReport {
            layers: self.layout.layer_ids.clone(),
            tokens: self.tokens,
            rows_per_token: cols,
            bytes_per_token: self.row_bytes.iter().map(|b| b * cols as u64).sum(),
            distinct_bytes: distinct_rows
                .iter()
                .zip(&self.row_bytes)
                .map(|(n, b)| n * b)
                .sum(),
            distinct_rows,
            rows_gathered: self.tokens * (cols * self.row_bytes.len()) as u64,
        }
    }
}

/// Where engram table rows come from.
pub trait EngramRows: Send + Sync {
    /// Dequantized rows `ids` of engram slot `slot` (its index in `engram_layer_ids`) into
    /// `out` (`ids.len() × head_dim`, row after row).
    fn rows(&self, slot: usize, ids: &[u64], out: &mut [f32]) -> Result<()>;
    /// These rows will be asked for soon (all of a forward's rows, before its first layer).
    fn prefetch(&self, _slot: usize, _ids: &[u64]) {}
}

/// Rows gathered from the checkpoint's own mapped tables (`layers.N.engram.embed.{weight,scale}`).
pub struct TableRows<'a> {
    pub tables: Vec<WeightView<'a>>,
}

impl<'a> TableRows<'a> {
    /// Views of every engram table of the checkpoint (nothing is read until a row is asked for).
    pub fn load(ck: &'a Checkpoint, layout: &EngramLayout) -> Result<Self> {
        let tables = layout
            .layer_ids
            .iter()
            .enumerate()
            .map(|(slot, &l)| table_view(ck, layout, slot, l))
            .collect::<Result<Vec<_>>>()?;
        Ok(TableRows { tables })
    }
}

/// The table of engram slot `slot` (decoder layer `layer`) as an MXFP8 view.
pub fn table_view<'a>(
    ck: &'a Checkpoint,
    layout: &EngramLayout,
    slot: usize,
    layer: usize,
) -> Result<WeightView<'a>> {
    let rows = usize::try_from(layout.num_embeddings[slot])
        .map_err(|_| ModelError::Config("engram table too large for this machine".into()))?;
    weight(
        ck,
        &format!("layers.{layer}.engram.embed"),
        rows,
        layout.head_dim,
        None,
    )
}

impl EngramRows for TableRows<'_> {
    fn rows(&self, slot: usize, ids: &[u64], out: &mut [f32]) -> Result<()> {
        let t = self
            .tables
            .get(slot)
            .ok_or_else(|| ModelError::Config(format!("no engram table for slot {slot}")))?;
        let hd = t.cols;
        for (k, &id) in ids.iter().enumerate() {
            if id as usize >= t.rows {
                return Err(ModelError::Config(format!(
                    "engram row {id} of slot {slot} is outside its table ({} rows)",
                    t.rows
                )));
            }
            t.decode_row(id as usize, &mut out[k * hd..(k + 1) * hd]);
        }
        profile::bytes(
            profile::Part::Engram,
            t.nbytes() / t.rows.max(1) * ids.len(),
        );
        Ok(())
    }
}

/// The small weights of one engram layer (the table is an [`EngramRows`] source).
pub struct EngramLayer<'a> {
    pub layer: usize,
    pub slot: usize,
    /// `[(hc + 1)·dim, C·head_dim]`.
    pub wkv: WeightView<'a>,
    /// `q_weight ⊙ k_weight`, `[hc × dim]` (the module only ever uses the product).
    pub qk: Vec<f32>,
}

impl<'a> EngramLayer<'a> {
    /// Resolve `layers.{layer}.engram.{wkv,q_weight,k_weight}`.
    pub fn load(
        ck: &'a Checkpoint,
        cfg: &ModelConfig,
        layout: &EngramLayout,
        slot: usize,
    ) -> Result<Self> {
        let layer = layout.layer_ids[slot];
        let p = format!("layers.{layer}.engram.");
        let (hc, d) = (cfg.hc, cfg.dim);
        let wkv = weight(
            ck,
            &format!("{p}wkv"),
            (hc + 1) * d,
            layout.cols() * layout.head_dim,
            cfg.raw.weight_block_size(),
        )?;
        let q = vec_f32(ck, &format!("{p}q_weight"), hc * d)?;
        let k = vec_f32(ck, &format!("{p}k_weight"), hc * d)?;
        let qk = q.iter().zip(&k).map(|(a, b)| a * b).collect();
        Ok(EngramLayer {
            layer,
            slot,
            wkv,
            qk,
        })
    }

    /// Add this layer's lookup into the streams, its product on `kernels`. `ids` are all
    /// engram row ids of the call's tokens, `[t][slot][col]` as [`EngramLayout::hash`] returns
    /// them.
    pub fn forward(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        layout: &EngramLayout,
        s: &mut Streams,
        ids: &[u64],
        rows: &dyn EngramRows,
    ) -> Result<()> {
        let mut bufs = EngramScratch::default();
        bufs.ids.extend_from_slice(ids);
        self.forward_with(cfg, kernels, layout, s, rows, &mut bufs)
    }

    /// [`EngramLayer::forward`] on the ids in `bufs.ids`, its working buffers kept in `bufs`
    /// (nothing allocated once they have the room).
    pub fn forward_with(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        layout: &EngramLayout,
        s: &mut Streams,
        rows: &dyn EngramRows,
        bufs: &mut EngramScratch,
    ) -> Result<()> {
        let (t, cols, hd, ns) = (s.t, layout.cols(), layout.head_dim, layout.layer_ids.len());
        let EngramScratch { ids, gather, e, kv } = bufs;
        if ids.len() != t * ns * cols {
            return Err(ModelError::Config(format!(
                "{} engram row ids for {t} tokens × {ns} layers × {cols} columns",
                ids.len()
            )));
        }
        let mine = slot_ids(ids, t, ns, cols, self.slot, gather);
        e.clear();
        e.resize(t * cols * hd, 0.0);
        {
            let _io = profile::span(profile::Part::IoWait);
            rows.rows(self.slot, mine, e)?;
        }
        profile::read(self.wkv.nbytes());
        let (hc, d) = (cfg.hc, cfg.dim);
        kv.clear();
        kv.resize(t * (hc + 1) * d, 0.0);
        // The model's kernels, like every other product of the layer (exact unless the
        // caller chose fast).
        matmul_with(kernels, e, t, &self.wkv, kv)?;
        gate_ref(&mut s.x, kv, &self.qk, t, hc, d, cfg.eps);
        Ok(())
    }
}

/// The row ids of engram slot `slot` in `ids` (`[t][slot][col]`): a slice of `ids` for one
/// token, else gathered into `gather`.
fn slot_ids<'b>(
    ids: &'b [u64],
    t: usize,
    ns: usize,
    cols: usize,
    slot: usize,
    gather: &'b mut Vec<u64>,
) -> &'b [u64] {
    if t == 1 {
        return &ids[slot * cols..(slot + 1) * cols];
    }
    gather.clear();
    for i in 0..t {
        gather.extend_from_slice(&ids[(i * ns + slot) * cols..(i * ns + slot + 1) * cols]);
    }
    gather
}

/// The gated write, scalar: `x[t,k] += σ(signed √dot)·value[t]` (see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn gate_ref(x: &mut [f32], kv: &[f32], qk: &[f32], t: usize, hc: usize, d: usize, eps: f32) {
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    for i in 0..t {
        let kvi = &kv[i * (hc + 1) * d..(i + 1) * (hc + 1) * d];
        let value = &kvi[hc * d..];
        for k in 0..hc {
            let key = &kvi[k * d..(k + 1) * d];
            let h = &mut x[(i * hc + k) * d..(i * hc + k + 1) * d];
            let w = &qk[k * d..(k + 1) * d];
            let (mut hh, mut kk, mut dot) = (0f32, 0f32, 0f32);
            for j in 0..d {
                hh += h[j] * h[j];
                kk += key[j] * key[j];
                dot += h[j] * w[j] * key[j];
            }
            let rstd = (hh / d as f32 + eps).sqrt().recip() * (kk / d as f32 + eps).sqrt().recip();
            let dot = dot * rstd * inv_sqrt_d;
            let g = dot.abs().max(GATE_CLAMP).sqrt().copysign(dot);
            let gate = 1.0 / (1.0 + (-g).exp());
            for j in 0..d {
                h[j] += gate * value[j];
            }
        }
    }
}

/// Every engram of a model: the layout (hashing), each layer's weights and the row source.
pub struct Engram<'a> {
    pub layout: EngramLayout,
    pub layers: Vec<EngramLayer<'a>>,
    pub rows: Box<dyn EngramRows + 'a>,
}

impl<'a> Engram<'a> {
    /// The engram layers of `cfg` with rows from the checkpoint's mapped tables; `None` when the
    /// config has no engram layers.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>> {
        let Some(layout) = cfg.engram.clone() else {
            return Ok(None);
        };
        let layers = (0..layout.layer_ids.len())
            .map(|slot| EngramLayer::load(ck, cfg, &layout, slot))
            .collect::<Result<Vec<_>>>()?;
        let rows = Box::new(TableRows::load(ck, &layout)?);
        Ok(Some(Engram {
            layout,
            layers,
            rows,
        }))
    }

    /// Hash `tokens` after the cache's history and tell the row source what is coming.
    pub fn hash(&self, history: &mut Vec<u32>, tokens: &[u32]) -> Result<Vec<u64>> {
        let mut bufs = EngramScratch::default();
        self.hash_into(history, tokens, &mut bufs)?;
        Ok(bufs.ids)
    }

    /// [`Engram::hash`] into `bufs.ids`, allocating nothing once the buffers have the room.
    pub fn hash_into(
        &self,
        history: &mut Vec<u32>,
        tokens: &[u32],
        bufs: &mut EngramScratch,
    ) -> Result<()> {
        self.layout.hash_into(history, tokens, &mut bufs.ids)?;
        let (ns, cols) = (self.layout.layer_ids.len(), self.layout.cols());
        for slot in 0..ns {
            let mine = slot_ids(&bufs.ids, tokens.len(), ns, cols, slot, &mut bufs.gather);
            let _io = profile::span(profile::Part::IoWait);
            self.rows.prefetch(slot, mine);
        }
        Ok(())
    }

    /// Apply the engram of decoder layer `layer`, if it has one, on `kernels`, on the row ids
    /// of the last [`Engram::hash_into`] into `bufs`.
    pub fn apply(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        layer: usize,
        s: &mut Streams,
        bufs: &mut EngramScratch,
    ) -> Result<()> {
        if let Some(slot) = self.layout.slot_of(layer) {
            self.layers[slot].forward_with(
                cfg,
                kernels,
                &self.layout,
                s,
                self.rows.as_ref(),
                bufs,
            )?;
        }
        Ok(())
    }
}
