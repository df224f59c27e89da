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
        let mut ssd = 0.0;
        let mut pre = 0.0;
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
            mem_bytes_per_token: mem,
            seconds_per_token: s,
            tokens_per_sec: if s > 0.0 { 1.0 / s } else { f64::INFINITY },
        }
    }
}

/// What a checkpoint says about the trace's layers: bytes of one routed expert per layer
/// (expert 0's `w1`, `w2`, `w3` weights and scales), resident bytes, and its expert count.
#[derive(Debug, Clone, Serialize)]
pub struct ModelBytes {
    pub expert_bytes: Vec<u64>,
    pub resident_bytes: u64,
    pub n_routed_experts: Option<usize>,
}

/// Read expert and resident byte counts for `layers` from the checkpoint at `dir`. Errors
/// when a layer has no routed-expert weights (the trace is not of this model) or when the
/// model's expert count differs from the trace's.
pub fn model_bytes(dir: &Path, layers: &[usize], trace_n_experts: usize) -> Result<ModelBytes> {
    let ck = Checkpoint::open(dir)?;
    let n_cfg = ck.config().map(|c| c.n_routed_experts);
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
        for mat in ExpertMat::ALL {
            let w = naming::expert_tensor(l, 0, mat, "weight");
            let Some(t) = ck.get(&w) else {
                return Err(ResidencyError::Model {
                    msg: format!(
                        "{}: tensor `{w}` not found; the trace records layer {l}, which this model \
                         has no routed experts for (is the trace from this model?)",
                        dir.display()
                    ),
                });
            };
            b += t.bytes.len() as u64;
            if let Some(s) = ck.get(&naming::expert_tensor(l, 0, mat, "scale")) {
                b += s.bytes.len() as u64;
            }
        }
        expert_bytes.push(b);
    }
    let mut resident = 0u64;
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        let skip = matches!(
            n.role,
            Role::RoutedExpert { .. } | Role::Embedding | Role::Vision
        ) || matches!(n.scope, Scope::Mtp(_));
        if !skip {
            resident += t.bytes.len() as u64;
        }
    }
    Ok(ModelBytes {
        expert_bytes,
        resident_bytes: resident,
        n_routed_experts: n_cfg,
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
}
