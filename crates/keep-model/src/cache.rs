//! Decoding state, as the reference's `LayerCache`: per layer the sliding window of KV rows, the
//! rows of the compressor group still open (`pending_kv`, `pending_gate`), the closed compressed
//! KV rows and their index keys. The token position is kept once for the whole model.

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
    pub v4: crate::v4::V4Cache,
    /// Qwen3-MoE: every position's keys and values.
    pub qwen3: crate::qwen3::KvRows,
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
            + self.qwen3.nbytes()
    }

    /// Bytes reserved (capacity of every buffer).
    pub fn capacity_bytes(&self) -> usize {
        4 * (self.window.capacity()
            + self.compress_kv.capacity()
            + self.index_k.capacity()
            + self.pending_kv.capacity()
            + self.pending_gate.capacity())
            + self.v4.capacity_bytes()
            + self.qwen3.capacity_bytes()
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
}

impl Cache {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Cache {
        Cache {
            layers: vec![LayerCache::default(); n_layers],
            pos: 0,
            engram_history: Vec::new(),
        }
    }

    /// Bytes held by all layers.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerCache::nbytes).sum()
    }
}
