//! What a run of the model allocates, computed from the config before anything is allocated:
//! the decoding cache for a context of N tokens ([`ModelConfig::cache_bytes`], which
//! [`Cache::for_context`](crate::Cache::for_context) reserves exactly, so it never grows by
//! doubling) and the activations of one forward pass of up to
//! [`RunOptions::prefill_chunk`](crate::RunOptions::prefill_chunk) tokens
//! ([`ModelConfig::activation_bytes`]). The chunk is a run option, not part of the config:
//! each estimate takes it.
//!
//! Prompts longer than the chunk run as consecutive chunks ([`Model::forward`](crate::Model)
//! does it): every token is computed by the same instructions whatever the batch, and a chunk
//! continues from the cache exactly as a decode step does, so the logits are bit-identical to
//! one pass over the whole prompt. Without chunks a prompt of T tokens would hold T × hidden
//! state rows at once, and the indexer's score matrix (T queries × T/ratio keys) grows with
//! the square of the prompt.
//!
//! The activation bound adds up every buffer a forward pass can hold at its peak — the streams,
//! each layer's mixes, projections, attention and MoE temporaries, the indexer's scores and
//! candidate mask over the whole context, the kernels' prepared activations, the logits — as if
//! all were alive at once, so it is an upper bound; a test (`tests/memory.rs`) measures the heap
//! of real forwards with a counting allocator and checks both bounds.

use crate::cache::{Cache, LayerCache};
use crate::config::{Family, ModelConfig};
use crate::family_layer::layer_family;
use crate::model::Logits;

/// The chunk size lives with the config that carries it (re-exported here, where the memory it
/// bounds is estimated).
pub use crate::config::DEFAULT_PREFILL_CHUNK;

/// The small buffers of a pass that do not scale with the chunk (routing lists, kernel task
/// lists, per-query row lists, error-free formatting of layer names): measured at under 16 KiB
/// on the small test models (`tests/memory.rs`, chunk 1), bounded here with room to spare.
const SMALL_BUFFERS: u64 = 64 << 10;

/// Bytes of an `f32`.
const F: u64 = 4;

/// What a run holds besides its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Tokens the run is planned for (prompt + generated).
    pub context: usize,
    /// Tokens per forward pass.
    pub chunk: usize,
    /// The decoding cache for `context` tokens ([`ModelConfig::cache_bytes`]).
    pub cache: u64,
    /// One forward pass's activations ([`ModelConfig::activation_bytes`]).
    pub activations: u64,
}

impl MemoryEstimate {
    /// Cache + activations.
    pub fn total(&self) -> u64 {
        self.cache.saturating_add(self.activations)
    }
}

/// Row counts of one layer's cache buffers for a context (see [`ModelConfig::cache_rows`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerCacheRows {
    /// Window rows (`hd` floats each): the window plus one chunk appended before it is cut.
    pub window: usize,
    /// V4.1: compressed KV rows (`hd`), index keys (`ihd`), open-group rows (`hd`, kv and gate).
    pub compress_kv: usize,
    pub index_k: usize,
    pub pending: usize,
    /// V4: per pool (kv, index) the open window, the last closed window and the entries, in
    /// floats.
    pub v4_kv: [usize; 3],
    pub v4_index: [usize; 3],
    /// A Hugging Face family: floats of the keys its layer keeps, and as many of values
    /// ([`LayerFamily::kv_floats`](crate::family::LayerFamily::kv_floats)).
    pub kv_rows: usize,
}

impl ModelConfig {
    /// The rows each buffer of `layer`'s cache can reach in a run of `context` tokens whose
    /// forwards are at most `chunk` tokens long.
    pub fn cache_rows(&self, layer: usize, context: usize, chunk: usize) -> LayerCacheRows {
        let roles = self.roles[layer];
        let chunk = chunk.max(1).min(context.max(1));
        let mut r = LayerCacheRows {
            window: self.window.min(context) + chunk,
            ..Default::default()
        };
        if let Some(f) = layer_family(self.family) {
            // The family's layers keep their keys and values as the family sizes them.
            return LayerCacheRows {
                kv_rows: f.kv_floats(self, layer, context, chunk),
                ..Default::default()
            };
        }
        let ratio = roles.ratio;
        if ratio == 0 {
            return r;
        }
        // V4.1 and V4 (the Hugging Face families' rows returned above).
        if self.family == Family::V41 {
            if roles.kv_source {
                r.compress_kv = context / ratio;
                if ratio > 1 {
                    r.pending = ratio - 1 + chunk;
                }
                if roles.index_source {
                    r.index_k = context / ratio;
                }
            }
        } else if self.family == Family::V4 {
            let csa = ratio == 4;
            let pool = |dim_out: usize, overlap: bool| {
                let w = if overlap { 2 * dim_out } else { dim_out };
                [
                    (ratio - 1 + chunk) * w,
                    if overlap { ratio * w } else { 0 },
                    (context / ratio) * dim_out,
                ]
            };
            r.v4_kv = pool(self.head_dim, csa);
            if csa {
                r.v4_index = pool(self.index_head_dim, true);
            }
        }
        r
    }

    /// Bytes of the decoding cache of a run of `context` tokens in forwards of at most `chunk`,
    /// as [`Cache::for_context`] reserves it (an upper bound of what it ever holds).
    pub fn cache_bytes(&self, context: usize, chunk: usize) -> u64 {
        let (hd, ihd) = (self.head_dim as u64, self.index_head_dim as u64);
        let mut total = 0u64;
        for l in 0..self.n_layers {
            let r = self.cache_rows(l, context, chunk);
            let floats = r.window as u64 * hd
                + r.compress_kv as u64 * hd
                + r.index_k as u64 * ihd
                + 2 * r.pending as u64 * hd
                + 2 * (r.v4_kv[0] + r.v4_kv[1]) as u64
                + r.v4_kv[2] as u64
                + 2 * (r.v4_index[0] + r.v4_index[1]) as u64
                + r.v4_index[2] as u64
                + 2 * r.kv_rows as u64;
            total = total.saturating_add(floats * F);
        }
        // Engram's n-gram look-back (a few token ids) and the per-layer headers.
        total.saturating_add(self.n_layers as u64 * std::mem::size_of::<LayerCache>() as u64 + 64)
    }

    /// Most index keys (V4.1) or indexer entries (V4) any layer scores in a context of
    /// `context` tokens.
    fn max_index_keys(&self, context: usize) -> usize {
        // A V4.1 indexer scores another layer's keys: bound by every compressing layer.
        self.roles
            .iter()
            .filter(|r| r.ratio > 0)
            .map(|r| context / r.ratio)
            .max()
            .unwrap_or(0)
    }

    /// An upper bound of the heap one forward pass of up to `chunk` tokens holds at once beyond
    /// the cache, anywhere in a context of `context` tokens, returning `which` logits for the
    /// chunk (a whole-prompt [`Logits::All`] adds `tokens × vocab × 4` bytes of output the caller
    /// asked for, not counted here).
    pub fn activation_bytes(&self, chunk: usize, context: usize, which: Logits) -> u64 {
        let t = chunk.max(1).min(context.max(1)) as u64;
        let (d, hc) = (self.dim as u64, self.hc as u64);
        let (h, hd, ql) = (self.heads as u64, self.head_dim as u64, self.q_lora as u64);
        let (ih, ihd) = (self.index_heads as u64, self.index_head_dim as u64);
        let (e, k, inter) = (self.n_experts as u64, self.top_k as u64, self.inter as u64);
        let (g, ol) = (self.o_groups as u64, self.o_lora as u64);
        let n = self.max_index_keys(context) as u64;
        let kidx = (self.index_topk as u64).min(n);
        let nm = (2 + hc) * hc;
        // The streams (x, pre-mix, token ids) and the embedding row.
        let streams = t * hc * d * F + t * hc * F + t * 4 + d * F;
        // Two hyper-connection mixes alive (attention's and the MoE's: pre, post, comb), the
        // normalised copy of the streams and the raw mix of the one being computed.
        let hc_mix = 2 * t * (2 * hc + hc * hc) * F + t * hc * d * F + t * nm * F;
        let threads = rayon_threads() as u64;
        // Block input, attention projections, per-query rows (the scores of four heads once
        // per thread) and the grouped output.
        let window = (self.window as u64) + t;
        let attn = t * d * F
            + t * ql * F
            + 2 * t * h * hd * F
            + t * hd * F
            + t * g * ol * F
            + t * (h * hd / g.max(1)) * F
            + t * ol * F
            + t * d * F
            + (window + kidx) * (4 * threads * F + 16);
        // Compressor: projections (two series for V4's CSA), pooled rows, index keys; the
        // open-group rows appended to the cache are counted in the cache.
        let new_rows = t + 1;
        let comp = 2 * t * 2 * hd * F
            + 2 * t * 2 * ihd * F
            + 2 * new_rows * hd * F
            + new_rows * ihd * F
            + 4 * hd * F;
        // Indexer: queries, head weights, scores and candidate mask over every key (V4.1
        // shares them between layers for the whole pass), picks, sort rows.
        let index = t * ih * ihd * F
            + t * ih * F
            + t * n * F
            + t * n
            + 2 * t * kidx * 4
            + n * 16
            + n.div_ceil(self.candidate_block_size.max(1) as u64) * 16;
        // MoE: router logits and scores, picks, routes per expert, every routed product
        // (inputs, gate, up, activation, output) and the shared expert.
        let moe = 2 * t * e * F
            + 2 * t * k * 4
            + t * k * 16
            + e * 24
            + t * k * d * F
            + t * k * (2 * d + 3 * inter) * F
            + 3 * t * inter * F
            + 2 * t * d * F;
        // Engram: row ids of the pass, one layer's rows and their projection.
        let engram = match &self.engram {
            Some(lay) => {
                let (ns, cols) = (lay.layer_ids.len() as u64, lay.cols() as u64);
                let lhd = lay.head_dim as u64;
                2 * t * ns * cols * 8 + t * cols * 8 + t * cols * lhd * F + t * (hc + 1) * d * F
            }
            None => 0,
        };
        // The kernels' prepared activations (int8 blocks with scales, or bf16) and per-thread
        // row buffers, for the widest product.
        let widest = [d * hc, ql, h * hd, inter, g * ol, d, self.vocab as u64]
            .into_iter()
            .max()
            .unwrap_or(0);
        let kernels = 2 * t * widest * F + threads * 4 * widest * F;
        // Final collapse, norm and head.
        let rows = match which {
            Logits::All => t,
            Logits::Last => 1,
            Logits::None => 0,
        };
        let head = rows * (hc * d + hc + d) * F + rows * self.vocab as u64 * F;
        // A Hugging Face family's attention: q, k, v, the attention output and one head's scores
        // over the whole context, four heads per thread (the DeepSeek terms above bound the
        // rest), and what the family's attention holds beyond them (a latent attention: its
        // head tasks' decoded `kv_b_proj` rows and its outputs head by head).
        let family_attn = if self.family.is_hugging_face() {
            let work = layer_family(self.family).map_or(0, |f| {
                f.attention_work_floats(self, t as usize, threads as usize)
            });
            3 * t * h * hd * F
                + t * d * F
                + 4 * threads * (context as u64 + t) * F
                + hd * F
                + work as u64 * F
        } else {
            0
        };
        streams
            + family_attn
            + hc_mix
            + attn
            + comp
            + index
            + moe
            + engram
            + kernels
            + head
            + SMALL_BUFFERS
    }

    /// The cache and activations of a run of `context` tokens in forwards of at most `chunk`
    /// tokens (the run's [`RunOptions::prefill_chunk`](crate::RunOptions::prefill_chunk)).
    pub fn memory_estimate(&self, context: usize, chunk: usize) -> MemoryEstimate {
        let chunk = chunk.max(1);
        MemoryEstimate {
            context,
            chunk,
            cache: self.cache_bytes(context, chunk),
            activations: self.activation_bytes(chunk, context, Logits::Last),
        }
    }
}

/// Threads the kernels may run on (rayon's default pool: one per available core).
fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .max(1)
}

impl Cache {
    /// An empty cache with every buffer reserved for a run of `context` tokens in forwards of
    /// at most `chunk` ([`ModelConfig::cache_rows`]): it never reallocates within that context,
    /// and its capacity is [`ModelConfig::cache_bytes`].
    pub fn for_context(cfg: &ModelConfig, context: usize, chunk: usize) -> Cache {
        let mut c = Cache::new(cfg.n_layers);
        let (hd, ihd) = (cfg.head_dim, cfg.index_head_dim);
        for (l, lc) in c.layers.iter_mut().enumerate() {
            let r = cfg.cache_rows(l, context, chunk);
            lc.window.reserve_exact(r.window * hd);
            lc.compress_kv.reserve_exact(r.compress_kv * hd);
            lc.index_k.reserve_exact(r.index_k * ihd);
            lc.pending_kv.reserve_exact(r.pending * hd);
            lc.pending_gate.reserve_exact(r.pending * hd);
            lc.kv_rows.k.reserve_exact(r.kv_rows);
            lc.kv_rows.v.reserve_exact(r.kv_rows);
            for (st, rows) in [(&mut lc.v4.kv, r.v4_kv), (&mut lc.v4.index, r.v4_index)] {
                st.pending_kv.reserve_exact(rows[0]);
                st.pending_gate.reserve_exact(rows[0]);
                st.prev_kv.reserve_exact(rows[1]);
                st.prev_gate.reserve_exact(rows[1]);
                st.entries.reserve_exact(rows[2]);
            }
        }
        c.scratch = crate::scratch::Scratch::for_context(cfg, context, chunk);
        c
    }

    /// Bytes reserved by all layers' buffers (what the cache holds in memory, ≥ [`Cache::nbytes`]).
    pub fn capacity_bytes(&self) -> usize {
        self.layers.iter().map(LayerCache::capacity_bytes).sum()
    }
}
