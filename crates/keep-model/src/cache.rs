//! Decoding state, as the reference's `LayerCache`: per layer the sliding window of KV rows, the
//! rows of the compressor group still open (`pending_kv`, `pending_gate`), the closed compressed
//! KV rows and their index keys. The token position is kept once for the whole model, and so
//! are the forward's working buffers ([`crate::scratch::Scratch`]).

use crate::scratch::Scratch;

/// One layer's cache.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    /// Window rows `[window_rows × head_dim]` (at most `sliding_window` rows between calls).
    pub window: Vec<f32>,
    pub window_rows: usize,
    /// Compressed KV rows `[n_compressed × head_dim]`.
    pub compress_kv: Vec<f32>,
    pub n_compressed: usize,
    /// Index keys `[n_index × index_head_dim]`.
    pub index_k: Vec<f32>,
    pub n_index: usize,
    /// Open compressor group rows `[n_pending × head_dim]` (projections, before pooling).
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub n_pending: usize,
    /// DeepSeek-V4: the layer's own compressor and indexer state.
    pub v4: V4Cache,
    /// A Hugging Face family's layer: the keys and values it keeps (every position's, a sliding
    /// window's, or a latent attention's compressed KV and RoPE key).
    pub kv_rows: KvRows,
}

impl LayerCache {
    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        4 * (self.window.len()
            + self.compress_kv.len()
            + self.index_k.len()
            + self.pending_kv.len()
            + self.pending_gate.len())
            + self.v4.nbytes()
            + self.kv_rows.nbytes()
    }

    /// Bytes reserved (capacity of every buffer).
    pub fn capacity_bytes(&self) -> usize {
        4 * (self.window.capacity()
            + self.compress_kv.capacity()
            + self.index_k.capacity()
            + self.pending_kv.capacity()
            + self.pending_gate.capacity())
            + self.v4.capacity_bytes()
            + self.kv_rows.capacity_bytes()
    }
}

/// The whole model's cache.
#[derive(Debug, Clone)]
pub struct Cache {
    pub layers: Vec<LayerCache>,
    /// Tokens seen so far (the position of the next token).
    pub pos: usize,
    /// Engram: the compressed ids of the last `max_ngram − 1` tokens (n-gram look-back).
    pub engram_history: Vec<u32>,
    /// The forward's working buffers, kept between calls (no state: a clone is empty).
    pub(crate) scratch: Scratch,
}

impl Cache {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Cache {
        Cache {
            layers: vec![LayerCache::default(); n_layers],
            pos: 0,
            engram_history: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    /// Bytes held by all layers.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerCache::nbytes).sum()
    }
}

/// State of one pool in a layer's cache.
#[derive(Debug, Clone, Default)]
pub struct PoolState {
    /// Projections of the open window `[n_pending × width·dim_out]` (kv, gate).
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub n_pending: usize,
    /// The last closed window's projections (CSA's Ca slots of the next entry).
    pub prev_kv: Vec<f32>,
    pub prev_gate: Vec<f32>,
    /// Pooled, normalised, RoPE'd entries `[n × dim_out]`.
    pub entries: Vec<f32>,
    pub n: usize,
}

impl PoolState {
    fn nbytes(&self) -> usize {
        4 * (self.pending_kv.len()
            + self.pending_gate.len()
            + self.prev_kv.len()
            + self.prev_gate.len()
            + self.entries.len())
    }

    fn capacity_bytes(&self) -> usize {
        4 * (self.pending_kv.capacity()
            + self.pending_gate.capacity()
            + self.prev_kv.capacity()
            + self.prev_gate.capacity()
            + self.entries.capacity())
    }
}

/// A V4 layer's compressor and indexer state.
#[derive(Debug, Clone, Default)]
pub struct V4Cache {
    pub kv: PoolState,
    pub index: PoolState,
}

impl V4Cache {
    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.kv.nbytes() + self.index.nbytes()
    }

    /// Bytes reserved.
    pub fn capacity_bytes(&self) -> usize {
        self.kv.capacity_bytes() + self.index.capacity_bytes()
    }
}

/// One layer's keys and values for every position so far (`[rows × kv_heads·head_dim]` each,
/// after the key norm and RoPE).
#[derive(Debug, Clone, Default)]
pub struct KvRows {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub rows: usize,
}

impl KvRows {
    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }
    /// Bytes reserved.
    pub fn capacity_bytes(&self) -> usize {
        4 * (self.k.capacity() + self.v.capacity())
    }
}
