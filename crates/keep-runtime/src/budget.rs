//! Budget math: how a `--memory-budget` is split between the resident weights and the expert
//! slots.
//!
//! - **Residents**: every tensor the model keeps mapped and reads each token — attention,
//!   norms, hyper-connections, routers, shared experts and the output head — counted at their
//!   stored size. Two exclusions: routed experts (they live in slots) and the token embedding,
//!   which is only gathered one row per token (its touched rows are part of the fixed overhead,
//!   as in `keep residency`'s cost model); MTP tensors are not loaded. A weight's size is its
//!   layout's (keep-checkpoint's one classification: elements plus scale partner). Engram tables
//!   (`layers.N.engram.embed.*`) are never resident: their rows are read on demand into the
//!   Engram row cache, whose bytes the runtime adds to the residents' share.
//! - **Slots**: the rest of the budget, split evenly over the MoE layers, in whole slots of
//!   [`ExpertStore::slot_bytes`](crate::ExpertStore::slot_bytes) (one expert's aligned reads),
//!   at most `n_experts` per layer. A budget that cannot hold the residents plus `top_k` slots
//!   per layer is refused with the number of bytes needed.
//!
//! Not in the budget (the documented fixed overhead, [`FIXED_OVERHEAD`]): the binary and its
//! libraries, thread stacks, activations of the current forward, the KV cache (it grows with
//! the context), the tokenizer and the gathered embedding rows.

use keep_checkpoint::layout;
use keep_checkpoint::naming::{self, Part, Role};
use keep_checkpoint::Checkpoint;

use crate::{Result, RuntimeError};

/// Memory beyond the budget a run may use, measured by the peak-RSS test on a small model and
/// documented in the README: 256 MiB (binary, allocator, stacks, activations, KV cache of a short
/// context). Longer contexts add their KV cache on top.
pub const FIXED_OVERHEAD: u64 = 256 << 20;

/// Whether a tensor (weight or scale) is a routed expert's, by keep-checkpoint's naming.
pub fn is_routed_expert(name: &str) -> bool {
    matches!(naming::parse(name).role, Role::RoutedExpert { .. })
}

/// Whether a tensor counts as resident (see the module doc).
pub fn is_resident(name: &str) -> bool {
    !is_routed_expert(name)
        && !name.starts_with("embed.")
        && !name.starts_with("mtp.")
        && !crate::engram::is_engram_table(name)
}

/// Bytes of the resident tensors of `ck`: each weight at its stored size in the layout
/// keep-checkpoint's one classification gives it (elements plus its scale partner), every other
/// resident tensor (norms, biases, hyper-connection mixes, a scale with no weight) at its size.
pub fn resident_bytes(ck: &Checkpoint) -> u64 {
    let hint = ck.config().and_then(|c| c.weight_block_size());
    let mut total = 0u64;
    let mut counted_scales = std::collections::HashSet::new();
    for t in ck.tensors().filter(|t| is_resident(t.name)) {
        let n = naming::parse(t.name);
        if n.part == Part::Scale {
            continue;
        }
        let scale = (n.part == Part::Weight)
            .then(|| layout::scale_of(ck, t.name))
            .flatten();
        total += match layout::classify(t, scale, hint) {
            Ok(l) => l.bytes(),
            // The loader refuses such a weight; count what is there.
            Err(_) => t.bytes.len() as u64 + scale.map_or(0, |s| s.bytes.len() as u64),
        };
        counted_scales.extend(scale.map(|s| s.name.to_string()));
    }
    let orphans: u64 = ck
        .tensors()
        .filter(|t| is_resident(t.name) && naming::parse(t.name).part == Part::Scale)
        .filter(|t| !counted_scales.contains(t.name))
        .map(|t| t.bytes.len() as u64)
        .sum();
    total + orphans
}

/// How a budget is split.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetPlan {
    pub budget: u64,
    pub residents: u64,
    pub slot_bytes: u64,
    pub n_layers: usize,
    pub top_k: usize,
    pub n_experts: usize,
    pub slots_per_layer: usize,
    /// `slots_per_layer × n_layers × slot_bytes`.
    pub slot_total: u64,
}

impl BudgetPlan {
    /// The least budget that runs: residents + `top_k` slots per layer.
    pub fn minimum(residents: u64, slot_bytes: u64, n_layers: usize, top_k: usize) -> u64 {
        residents.saturating_add(slot_bytes.saturating_mul((n_layers * top_k) as u64))
    }

    /// Split `budget`, or refuse it naming the bytes needed.
    pub fn new(
        budget: u64,
        residents: u64,
        slot_bytes: u64,
        n_layers: usize,
        top_k: usize,
        n_experts: usize,
    ) -> Result<BudgetPlan> {
        if slot_bytes == 0 || n_layers == 0 || top_k == 0 || n_experts < top_k {
            return Err(RuntimeError::Invalid(format!(
                "cannot plan slots for {n_layers} layers of {n_experts} experts (top-k {top_k}) of {slot_bytes} bytes"
            )));
        }
        let needed = Self::minimum(residents, slot_bytes, n_layers, top_k);
        if budget < needed {
            return Err(RuntimeError::BudgetTooSmall {
                budget,
                residents,
                layers: n_layers,
                top_k,
                slot_bytes,
                slots: needed - residents,
                needed,
                needed_gib: needed as f64 / (1u64 << 30) as f64,
            });
        }
        let per_layer = (budget - residents) / slot_bytes / n_layers as u64;
        let slots = (per_layer.min(n_experts as u64) as usize).max(top_k);
        Ok(BudgetPlan {
            budget,
            residents,
            slot_bytes,
            n_layers,
            top_k,
            n_experts,
            slots_per_layer: slots,
            slot_total: slots as u64 * n_layers as u64 * slot_bytes,
        })
    }

    /// Resident + slot bytes (≤ budget).
    pub fn planned(&self) -> u64 {
        self.residents + self.slot_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_refuse() {
        let p = BudgetPlan::new(1000 + 10 * 4 * 100, 1000, 100, 4, 2, 64).unwrap();
        assert_eq!(p.slots_per_layer, 10);
        assert!(p.planned() <= p.budget);
        // Capped at the number of experts.
        let p = BudgetPlan::new(u64::MAX / 2, 1000, 100, 4, 2, 64).unwrap();
        assert_eq!(p.slots_per_layer, 64);
        // One byte short of residents + top-k slots per layer: refused, naming the need.
        let need = 1000 + 4 * 2 * 100;
        let e = BudgetPlan::new(need - 1, 1000, 100, 4, 2, 64).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&format!("at least {need} bytes")), "{msg}");
        assert!(msg.contains("resident weights take 1000 bytes"), "{msg}");
        assert!(BudgetPlan::new(need, 1000, 100, 4, 2, 64).is_ok());
    }

    #[test]
    fn resident_names() {
        assert!(!is_resident("layers.3.ffn.experts.7.w1.weight"));
        assert!(!is_resident("layers.3.ffn.experts.7.w2.scale"));
        assert!(!is_resident("mtp.0.ffn.experts.1.w3.weight"));
        assert!(is_resident("layers.3.ffn.shared_experts.w1.weight"));
        assert!(is_resident("layers.3.ffn.gate.weight"));
        assert!(is_resident("head.weight"));
        assert!(!is_resident("embed.weight"));
    }
}
