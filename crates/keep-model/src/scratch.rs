//! [`Scratch`]: the forward's working buffers, typed and named, kept in the [`crate::Cache`]
//! between calls so that a warm decode step allocates nothing. Each op writes into its buffer
//! (emptied and resized to the call's shape: no allocation once it has held that shape), the
//! values are exactly those of a freshly zeroed vector. Buffers keep the capacity of passes of
//! up to [`KEEP_ROWS`] rows; a longer pass (a prompt chunk) gives them back after it.
//! [`Scratch::for_context`] sizes the buffers that grow with the position (the indexer's
//! scores over every compressed row, the rows a query reads) for a whole run up front.
//!
//! A clone is empty (a cloned cache, such as a drafter's snapshot, holds no working memory).
//! Buffers of borrowed views (kernel jobs, expert weight views) are kept in their `'static`
//! form and recycled into the borrowing one for each call
//! ([`keep_kernels::scratch::recycle`]). A leaf of the model: it names the config and the
//! expert views, no layer.

use std::borrow::Cow;

use keep_kernels::simd::Job;

use crate::config::{Family, ModelConfig};
use crate::experts::{ExpertWeights, Rung};

/// `v` emptied and resized to `n` zeros (the values of `vec![0.0; n]`), as a slice.
pub(crate) fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    &mut v[..]
}

/// The forward's working buffers (see the module documentation).
#[derive(Default)]
pub struct Scratch {
    /// The kernels this pass's products run on: the model's [`crate::RunOptions::kernels`],
    /// set by whoever starts the pass (each pass sets it again; a reset scratch keeps it).
    pub(crate) kernels: keep_kernels::Kernels,
    // The hidden state of the running chunk (the forward's `Streams`, lent out per call).
    pub(crate) x: Vec<f32>,
    pub(crate) pre_mix: Vec<f32>,
    pub(crate) tokens: Vec<u32>,
    // Hyper-connections: the normalised streams, the mix, the block's pre / post / comb and
    // the attention block's pre kept for the feed-forward collapse (V4.1).
    pub(crate) hc_flat: Vec<f32>,
    pub(crate) hc_mix: Vec<f32>,
    pub(crate) pre: Vec<f32>,
    pub(crate) post: Vec<f32>,
    pub(crate) comb: Vec<f32>,
    pub(crate) attn_pre: Vec<f32>,
    // A block's collapsed input, its output, and the expand's mixed streams.
    pub(crate) h: Vec<f32>,
    pub(crate) block_out: Vec<f32>,
    pub(crate) mixed: Vec<f32>,
    // Attention: projections, the heads' outputs, the rows each query reads and their
    // scores, the grouped output projection.
    pub(crate) qr: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) kv: Vec<f32>,
    pub(crate) heads: Vec<f32>,
    pub(crate) keys: Vec<usize>,
    pub(crate) scores: Vec<f32>,
    pub(crate) oa: Vec<f32>,
    pub(crate) xin: Vec<f32>,
    pub(crate) yg: Vec<f32>,
    // The compressor: projections, pooled latent, the rows stored, index keys, a gate column.
    pub(crate) lat: Vec<f32>,
    pub(crate) kvp: Vec<f32>,
    pub(crate) gp: Vec<f32>,
    pub(crate) ckv: Vec<f32>,
    pub(crate) ik: Vec<f32>,
    pub(crate) gcol: Vec<f32>,
    // DeepSeek-V4's pools: a value column and the entry being pooled; its indexer's picks.
    pub(crate) vcol: Vec<f32>,
    pub(crate) entry: Vec<f32>,
    pub(crate) picks: Vec<i32>,
    // The indexer: queries, head weights, scores, block and row rankings, and spare buffers
    // for what it shares with the next layers (top-k rows per query, the candidate mask),
    // which a call's `layer::Shared` holds while it runs.
    pub(crate) iq: Vec<f32>,
    pub(crate) iw: Vec<f32>,
    pub(crate) iscores: Vec<f32>,
    pub(crate) blocks: Vec<(f32, usize)>,
    pub(crate) ranked: Vec<(f32, usize)>,
    pub(crate) topk: Vec<i32>,
    pub(crate) candidates: Vec<bool>,
    // The MoE block: router logits, picks, gate weights, scores, ranking; the shared
    // expert's gate, up, activation and output; the routed experts' outputs.
    pub(crate) logits: Vec<f32>,
    pub(crate) chosen: Vec<u32>,
    pub(crate) weights: Vec<f32>,
    pub(crate) rscores: Vec<f32>,
    pub(crate) rcand: Vec<(f32, usize)>,
    pub(crate) sg: Vec<f32>,
    pub(crate) su: Vec<f32>,
    pub(crate) sact: Vec<f32>,
    pub(crate) sh: Vec<f32>,
    pub(crate) ys: Vec<f32>,
    pub(crate) experts: ExpertScratch,
    // The head: rows asked for, their collapse and norm.
    pub(crate) head_rows: Vec<usize>,
    pub(crate) head_flat: Vec<f32>,
    pub(crate) head_mix: Vec<f32>,
    pub(crate) head_h: Vec<f32>,
    // The Hugging Face families' layers' own buffers (beside the ones above they share with
    // the V4 layers).
    pub(crate) fam: FamilyScratch,
    // Engram: the call's row ids `[t][slot][col]`, one slot's ids gathered (a chunk of
    // several tokens), the concatenated rows and their key/value projection.
    pub(crate) engram: EngramScratch,
    /// What [`Scratch::for_context`] reserved (compressed rows, candidate blocks, attended
    /// rows, attention scores).
    reserved: [usize; 4],
}

/// The working buffers of the Engram layers, kept between forwards: the call's row ids
/// `[t][slot][col]`, one slot's ids gathered, its rows and their projection.
#[derive(Debug, Default)]
pub struct EngramScratch {
    pub ids: Vec<u64>,
    pub(crate) gather: Vec<u64>,
    pub(crate) e: Vec<f32>,
    pub(crate) kv: Vec<f32>,
}

/// The routed experts' working buffers: routes grouped by (expert, rung), the batch taken,
/// the expert views, and one buffer per stage for all experts of a batch.
#[derive(Default)]
pub(crate) struct ExpertScratch {
    pub(crate) by_key: Vec<Vec<(usize, usize)>>,
    pub(crate) upper: Vec<bool>,
    pub(crate) keys: Vec<(usize, Rung)>,
    pub(crate) used: Vec<usize>,
    pub(crate) left: Vec<(usize, Rung)>,
    pub(crate) batch: Vec<(usize, Rung)>,
    pub(crate) ids: Vec<usize>,
    pub(crate) ready: Vec<bool>,
    pub(crate) take: Vec<usize>,
    pub(crate) views: Vec<ExpertWeights<'static>>,
    pub(crate) chunk: Vec<usize>,
    pub(crate) offs: Vec<usize>,
    pub(crate) xin: Vec<f32>,
    pub(crate) g: Vec<f32>,
    pub(crate) u: Vec<f32>,
    pub(crate) act: Vec<f32>,
    pub(crate) out: Vec<f32>,
    pub(crate) x1s: Vec<Cow<'static, [f32]>>,
    pub(crate) x3s: Vec<Cow<'static, [f32]>>,
    pub(crate) a2s: Vec<Cow<'static, [f32]>>,
    pub(crate) jobs: Vec<Job<'static, 'static>>,
}

/// The buffers of the Hugging Face families' layers that the V4 layers have no counterpart
/// of: the key and value projections, a latent attention in the absorbed
/// form (each head task's working space — its heads' `kv_b_proj` key and value rows, latent
/// query and output, RoPE query —, the heads' outputs head by head, a position's normalised
/// latent and RoPE key), a group-limited router (biased scores, group
/// scores, one group's ranking, the groups kept), a zero router bias and the routes per expert
/// of a family with its own expert loop.
#[derive(Default)]
pub(crate) struct FamilyScratch {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    pub(crate) mla_work: Vec<f32>,
    pub(crate) mla_heads: Vec<f32>,
    pub(crate) kpe: Vec<f32>,
    pub(crate) biased: Vec<f32>,
    pub(crate) groups: Vec<(f32, usize)>,
    pub(crate) group: Vec<(f32, usize)>,
    pub(crate) keep: Vec<bool>,
    pub(crate) zeros: Vec<f32>,
    pub(crate) routes: Vec<Vec<usize>>,
}

/// Most rows of a pass whose buffers the scratch keeps after it (decode, a drafter's verify
/// pass); a longer pass (a prompt chunk) gives them back, so that a cache holds decode-sized
/// working memory between calls, not a prefill chunk's.
pub const KEEP_ROWS: usize = 8;

impl Scratch {
    /// Buffers for a run of `context` tokens of `cfg` in forwards of at most `chunk`: those that grow with the position
    /// reserved for the whole run (the indexer's scores, ranking and candidate mask over every
    /// compressed row, the rows a query attends; for a Hugging Face family one query head's
    /// attention scores over every position), so that no decode step reallocates them.
    pub fn for_context(cfg: &ModelConfig, context: usize, chunk: usize) -> Scratch {
        let most = |rows: &dyn Fn(usize) -> usize| (0..cfg.n_layers).map(rows).max().unwrap_or(0);
        let window = cfg.window.min(context);
        let (hd, ihd) = (cfg.head_dim.max(1), cfg.index_head_dim.max(1));
        let (rows, attended) = match cfg.family {
            Family::V41 => {
                let rows = most(&|l| {
                    let r = cfg.cache_rows(l, context, chunk);
                    r.compress_kv.max(r.index_k)
                });
                // A query reads its window and at most `index_topk` compressed rows.
                (rows, window + cfg.index_topk.min(rows))
            }
            Family::V4 => {
                // The indexer ranks every index entry; an HCA query reads every KV entry.
                let index = most(&|l| cfg.cache_rows(l, context, chunk).v4_index[2] / ihd);
                let kv = most(&|l| cfg.cache_rows(l, context, chunk).v4_kv[2] / hd);
                (index.max(kv), window + kv)
            }
            // A Hugging Face family's query reads at most every earlier position (a sliding
            // layer fewer): only the attention scores grow with the position.
            _ => {
                return Scratch::reserved([0, 0, 0, context]);
            }
        };
        let blocks = rows.div_ceil(cfg.candidate_block_size.max(1));
        Scratch::reserved([rows, blocks, attended, attended])
    }

    /// An empty scratch whose passes run on `kernels`.
    pub(crate) fn on(kernels: keep_kernels::Kernels) -> Scratch {
        Scratch {
            kernels,
            ..Scratch::default()
        }
    }

    /// An empty scratch with the position-growing buffers reserved: `rows` compressed rows
    /// (the indexer's scores, ranking and candidate mask), `blocks` candidate blocks,
    /// `attended` rows a query reads, `scores` attention scores of one query (one head).
    fn reserved(reserved: [usize; 4]) -> Scratch {
        let mut s = Scratch {
            reserved,
            ..Scratch::default()
        };
        s.reserve(1);
        s
    }

    /// Reserve what [`Scratch::for_context`] asked for where a buffer holds less (nothing to do
    /// but after a clone, whose buffers are empty, or before the first forward): the attention
    /// scores of four query heads (keep-kernels' `attend` scores a KV head's query heads four
    /// at a time) once per worker thread, each of which scores its own heads.
    pub(crate) fn ensure_reserved(&mut self) {
        self.reserve(4 * keep_kernels::cpu::threads());
    }

    /// [`Scratch::ensure_reserved`] with `copies` query heads' scores (the pool's size is asked
    /// only when a forward runs: asking starts the pool, whose size is then fixed).
    fn reserve(&mut self, copies: usize) {
        fn at_least<T>(v: &mut Vec<T>, n: usize) {
            if v.capacity() < n {
                v.reserve_exact(n - v.len());
            }
        }
        let [rows, blocks, attended, scores] = self.reserved;
        at_least(&mut self.iscores, rows);
        at_least(&mut self.ranked, rows);
        at_least(&mut self.candidates, rows);
        at_least(&mut self.blocks, blocks);
        at_least(&mut self.keys, attended);
        at_least(&mut self.scores, scores * copies);
    }

    /// After a pass of `rows` rows: past [`KEEP_ROWS`], give every buffer back and keep only
    /// the reservation of [`Scratch::for_context`].
    pub(crate) fn after_pass(&mut self, rows: usize) {
        if rows > KEEP_ROWS {
            let kernels = self.kernels;
            *self = Scratch::reserved(self.reserved);
            self.kernels = kernels;
        }
    }
}

impl Clone for Scratch {
    /// An empty scratch that remembers the reservation (made again by the next forward on it,
    /// so a cache snapshot holds no working memory): buffers carry no state between forwards.
    fn clone(&self) -> Scratch {
        Scratch {
            reserved: self.reserved,
            kernels: self.kernels,
            ..Scratch::default()
        }
    }
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scratch")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// keep-tiny's config (V4.1 with compressors and an indexer), `None` when not in the tree.
    fn tiny() -> Option<ModelConfig> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../models/keep-tiny/config.json");
        let text = std::fs::read_to_string(&p).ok()?;
        let c = keep_checkpoint::DeepSeekConfig::from_json(&p, &text).unwrap();
        Some(ModelConfig::from_deepseek(&c).unwrap())
    }

    #[test]
    fn a_clone_holds_no_buffers_and_the_next_forward_reserves_again() {
        let Some(cfg) = tiny() else {
            return;
        };
        let s = Scratch::for_context(&cfg, 1000, crate::DEFAULT_PREFILL_CHUNK);
        // keep-tiny compresses by 1 on some layers: every position is a compressed row.
        assert!(s.iscores.capacity() >= 1000 && s.keys.capacity() >= 64);
        let mut c = s.clone();
        let held = [c.iscores.capacity(), c.ranked.capacity(), c.keys.capacity()];
        assert_eq!(held, [0, 0, 0], "a snapshot's scratch holds buffers");
        c.ensure_reserved();
        assert_eq!(c.iscores.capacity(), s.iscores.capacity());
        assert_eq!(c.keys.capacity(), s.keys.capacity());
    }
}
