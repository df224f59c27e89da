//! The cost model: bytes read per token and a tokens/s bound from a replay's counts, and the
//! per-expert and resident byte counts read from a checkpoint.
//!
//! Per token and recorded layer `l` with expert size `B_l`: `misses_l/token · B_l` bytes come
//! from SSD at `ssd_gbps`, `hits_l/token · B_l` bytes from memory at `mem_gbps` (dropped slots
//! read nothing). With a model, its resident bytes (every tensor except routed experts, the
//! embedding — only gathered —, MTP and vision tensors) are read from memory once per token.
//! Seconds per token = SSD bytes / SSD bandwidth + memory bytes / memory bandwidth (no overlap
//! of the two, no compute time): `tok/s = 1 / seconds` is an upper bound for decode. Reads of
//! hash-routed layers are prefetched from the token ids: they still take SSD bandwidth (in
//! `ssd_bytes_per_token`) but are reported apart (`prefetched_ssd_bytes_per_token`) because
//! the runtime starts them before any layer runs, so they need not stall the forward.
//!
//! Engram tables (DeepSeek-V4.1) are never resident: per token and Engram layer, `cols` rows
//! (one per n-gram order × hash head) are gathered by hashed token ids. Without a row cache
//! each row is one direct read of the 4 KiB pages it spans — `1 + (row − 1) / 4096` pages on
//! average for a row at a random byte offset — for the weight row and again for its scale row.
//! Those bytes are SSD reads known from the token ids alone, so they count as prefetched. The
//! model is an upper bound: a row cache (`keep run --engram-cache`) turns repeated n-grams
//! into memory reads.

use std::path::Path;

use keep_checkpoint::naming::{self, ExpertMat, Role, Scope};
use keep_checkpoint::Checkpoint;
use serde::Serialize;

use crate::sim::Counts;
use crate::{ResidencyError, Result};

/// Byte sizes and bandwidths.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    /// Bytes of one routed expert per recorded layer (trace order).
    pub expert_bytes: Vec<u64>,
    /// Bytes read from memory once per token besides the routed experts (0 without a model).
    pub resident_bytes: u64,
    /// Engram table reads per token (empty without Engram layers or without a model).
    pub engram: Vec<EngramBytes>,
    /// SSD read bandwidth, GB/s (10⁹ bytes).
    pub ssd_gbps: f64,
    /// Memory read bandwidth, GB/s (10⁹ bytes).
    pub mem_gbps: f64,
}

/// Bytes and time per token of one replay.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TokenCost {
    /// Expert bytes read from SSD per token.
    pub ssd_bytes_per_token: f64,
    /// Of those, the bytes of hash-routed layers (read ahead from the token ids).
    pub prefetched_ssd_bytes_per_token: f64,
    /// Engram table bytes read from SSD per token (whole pages, with no row cache); included
    /// in `ssd_bytes_per_token` and in `prefetched_ssd_bytes_per_token`.
    pub engram_ssd_bytes_per_token: f64,
    /// Bytes read from memory per token (hit experts plus resident weights).
    pub mem_bytes_per_token: f64,
    /// Seconds per token of SSD reads plus memory reads.
    pub seconds_per_token: f64,
    /// `1 / seconds_per_token`.
    pub tokens_per_sec: f64,
}

impl CostModel {
    /// Cost of the per-layer counts of one replay.
    pub fn cost(&self, layers: &[Counts]) -> TokenCost {
        let engram: f64 = self
            .engram
            .iter()
            .map(EngramBytes::ssd_bytes_per_token)
            .sum();
        let mut ssd = engram;
        let mut pre = engram;
        let mut mem = self.resident_bytes as f64;
        for (c, &b) in layers.iter().zip(&self.expert_bytes) {
            if c.tokens == 0 {
                continue;
            }
            let t = c.tokens as f64;
            ssd += c.misses as f64 / t * b as f64;
            pre += c.prefetched as f64 / t * b as f64;
            mem += c.hits as f64 / t * b as f64;
        }
        let s = ssd / (self.ssd_gbps * 1e9) + mem / (self.mem_gbps * 1e9);
        TokenCost {
            ssd_bytes_per_token: ssd,
            prefetched_ssd_bytes_per_token: pre,
            engram_ssd_bytes_per_token: engram,
            mem_bytes_per_token: mem,
            seconds_per_token: s,
            tokens_per_sec: if s > 0.0 { 1.0 / s } else { f64::INFINITY },
        }
    }
}

/// The direct-read page size the runtime's stores use.
pub const PAGE_BYTES: u64 = 4096;

/// One Engram layer's table reads per token.
#[derive(Debug, Clone, Serialize)]
pub struct EngramBytes {
    /// Decoder layer.
    pub layer: usize,
    /// Rows gathered per token (n-gram orders × hash heads).
    pub rows_per_token: usize,
    /// Bytes of one weight row (FP8 channels) and of its scale row (E8M0).
    pub row_bytes: u64,
    pub scale_row_bytes: u64,
}

impl EngramBytes {
    /// Expected 4 KiB pages a read of `bytes` at a uniformly random byte offset spans.
    fn pages(bytes: u64) -> f64 {
        if bytes == 0 {
            0.0
        } else {
            1.0 + (bytes - 1) as f64 / PAGE_BYTES as f64
        }
    }

    /// Table bytes used per token (rows × row bytes, scales included).
    pub fn row_bytes_per_token(&self) -> f64 {
        (self.rows_per_token as u64 * (self.row_bytes + self.scale_row_bytes)) as f64
    }

    /// SSD bytes read per token with no row cache: whole pages of each weight and scale row.
    pub fn ssd_bytes_per_token(&self) -> f64 {
        self.rows_per_token as f64
            * (Self::pages(self.row_bytes) + Self::pages(self.scale_row_bytes))
            * PAGE_BYTES as f64
    }
}

/// What a checkpoint says about the trace's layers: bytes a run reads for a routed expert per
/// layer (the mean over the layer's experts of their `w1`, `w2`, `w3` weights, scales and
/// biases, and with `residual` the E8P residual stages the runtime reads with them:
/// keep-checkpoint's `ExpertMatrix::read_bytes`), resident bytes, and its expert count.
#[derive(Debug, Clone, Serialize)]
pub struct ModelBytes {
    pub expert_bytes: Vec<u64>,
    pub resident_bytes: u64,
    pub n_routed_experts: Option<usize>,
    /// Engram table reads per token, one entry per Engram layer.
    pub engram: Vec<EngramBytes>,
}

/// Read expert and resident byte counts for `layers` from the checkpoint at `dir`. Errors
/// when a layer has no routed-expert weights (the trace is not of this model) or when the
/// model's expert count differs from the trace's.
pub fn model_bytes(
    dir: &Path,
    layers: &[usize],
    trace_n_experts: usize,
    residual: bool,
) -> Result<ModelBytes> {
    let ck = Checkpoint::open(dir)?;
    // A trace's expert count is the most of any layer (the runtime's recorder writes the
    // model's), which differs from `n_routed_experts` where hash-routed layers kept theirs.
    let n_cfg = ck.config().map(|c| c.max_experts_in_a_layer());
    if let Some(n) = n_cfg {
        if n != trace_n_experts {
            return Err(ResidencyError::Model {
                msg: format!(
                    "{}: the model has {n} routed experts per layer, the trace {trace_n_experts}; \
                     replay a trace recorded with this model (or pass --expert-bytes instead of --model)",
                    dir.display()
                ),
            });
        }
    }
    let mut expert_bytes = Vec::with_capacity(layers.len());
    for &l in layers {
        let mut b = 0u64;
        if ck.config().is_some_and(|c| !c.is_moe_layer(l)) {
            // A dense layer (Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's first layers): no
            // routed experts (its trace rows are empty).
            expert_bytes.push(0);
            continue;
        }
        let experts = ck.config().map_or(1, |c| c.experts_in_layer(l).max(1));
        // The family's matrices of each expert (gate-up and down where gate and up are one matrix).
        let mats = |x: usize| -> Vec<ExpertMat> {
            match ck.config() {
                Some(c) => c.coded_matrices(l, x).into_iter().map(|m| m.mat).collect(),
                None => ExpertMat::ALL.to_vec(),
            }
        };
        for (x, mat) in (0..experts).flat_map(|x| mats(x).into_iter().map(move |m| (x, m))) {
            // The expert's own tensors or its slices of a stacked `switch_mlp` (MLX biases too).
            let found = match ck.config() {
                Some(cfg) => keep_checkpoint::layout::expert_matrix(&ck, cfg, l, x, mat),
                None => {
                    let w = naming::expert_tensor(l, 0, mat, "weight");
                    ck.get(&w)
                        .map(|t| keep_checkpoint::layout::ExpertMatrix {
                            weight: t,
                            scale: keep_checkpoint::layout::scale_of(&ck, &w),
                            biases: keep_checkpoint::layout::biases_of(&ck, &w),
                            further: vec![],
                        })
                        .ok_or_else(|| format!("tensor `{w}` is missing"))
                }
            };
            let m = found.map_err(|e| ResidencyError::Model {
                msg: format!(
                    "{}: {e}; the trace records layer {l}, which this model has no routed \
                     experts for (is the trace from this model?)",
                    dir.display()
                ),
            })?;
            b += if residual {
                m.read_bytes(&ck)
            } else {
                m.bytes()
            };
        }
        expert_bytes.push(b.div_ceil(experts as u64));
    }
    let mut resident = 0u64;
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        let skip = n.role.is_routed_expert()
            || matches!(n.role, Role::Embedding | Role::Vision)
            || matches!(n.scope, Scope::Mtp(_))
            || naming::is_engram_table(t.name);
        if !skip {
            resident += t.bytes.len() as u64;
        }
    }
    let mut engram = vec![];
    if let Some(c) = ck.config() {
        let rows_per_token = c.engram_max_ngram_size.saturating_sub(1) * c.engram_n_heads;
        for &l in &c.engram_layer_ids {
            let per_row = |part: &str| -> Result<u64> {
                let name = naming::engram_table(l, part);
                match ck.get(&name) {
                    Some(t) if t.shape.len() == 2 && t.shape[0] > 0 => {
                        Ok(t.bytes.len() as u64 / t.shape[0])
                    }
                    _ => Err(ResidencyError::Model {
                        msg: format!(
                            "{}: Engram layer {l} has no table `{name}` of shape [rows, channels]",
                            dir.display()
                        ),
                    }),
                }
            };
            engram.push(EngramBytes {
                layer: l,
                rows_per_token,
                row_bytes: per_row("weight")?,
                scale_row_bytes: per_row("scale")?,
            });
        }
    }
    Ok(ModelBytes {
        expert_bytes,
        resident_bytes: resident,
        n_routed_experts: n_cfg,
        engram,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cost_adds_ssd_and_memory_time() {
        let m = CostModel {
            expert_bytes: vec![1_000_000, 2_000_000],
            resident_bytes: 500_000,
            engram: vec![],
            ssd_gbps: 1.0,
            mem_gbps: 10.0,
        };
        let c = |tokens, hits, misses| Counts {
            tokens,
            hits,
            misses,
            ..Counts::default()
        };
        let t = m.cost(&[c(10, 10, 10), c(10, 20, 0)]);
        assert_eq!(t.ssd_bytes_per_token, 1_000_000.0);
        assert_eq!(t.mem_bytes_per_token, 1_000_000.0 + 4_000_000.0 + 500_000.0);
        let s = 1e6 / 1e9 + 5.5e6 / 1e10;
        assert!((t.seconds_per_token - s).abs() < 1e-15);
        assert!((t.tokens_per_sec - 1.0 / s).abs() < 1e-6);
    }

    #[test]
    fn engram_rows_are_prefetched_page_reads() {
        // V4.1-Flash's Engram shape: 2-, 3- and 4-grams × 8 heads, 256 FP8 channels with an
        // E8M0 scale per 32: a 256-byte row spans 1 + 255/4096 pages on average, its 8-byte
        // scale row 1 + 7/4096.
        let e = EngramBytes {
            layer: 1,
            rows_per_token: 24,
            row_bytes: 256,
            scale_row_bytes: 8,
        };
        assert_eq!(e.row_bytes_per_token(), 24.0 * 264.0);
        let pages = (1.0 + 255.0 / 4096.0) + (1.0 + 7.0 / 4096.0);
        assert_eq!(e.ssd_bytes_per_token(), 24.0 * pages * 4096.0);
        let m = CostModel {
            expert_bytes: vec![1_000],
            resident_bytes: 0,
            engram: vec![e.clone(), EngramBytes { layer: 14, ..e }],
            ssd_gbps: 1.0,
            mem_gbps: 10.0,
        };
        let t = m.cost(&[Counts {
            tokens: 1,
            misses: 1,
            ..Counts::default()
        }]);
        let engram = 2.0 * 24.0 * pages * 4096.0;
        assert_eq!(t.engram_ssd_bytes_per_token, engram);
        assert_eq!(t.ssd_bytes_per_token, 1_000.0 + engram);
        assert_eq!(t.prefetched_ssd_bytes_per_token, engram);
    }
}
