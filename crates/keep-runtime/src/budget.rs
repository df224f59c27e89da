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
//!   [`ExpertStore::slot_bytes`](crate::ExpertStore::slot_bytes) (the largest expert's aligned
//!   reads: on a checkpoint of mixed rungs every slot holds the largest rung), at most
//!   `n_experts` per layer. A budget that cannot hold the residents plus `top_k` slots per
//!   layer is refused with the number of bytes needed. [`SlotNeeds::plan`] is the one split
//!   (the Engram row cache it gives included): the runtime plans with it and `keep fit`
//!   predicts with it.
//!
//! - **Context**: the decoding cache for the run's context (prompt + generated tokens: window,
//!   compressed KV, index keys, open compressor groups — reserved exactly up front) and the
//!   activations of one forward pass of at most `prefill_chunk` tokens (longer prompts run in
//!   chunks), both from keep-model's [`keep_model::memory`] before anything is allocated.
//!
//! Not in the budget (the documented fixed overhead, [`FIXED_OVERHEAD`]): the binary and its
//! libraries, thread stacks, the allocator's slack, the tokenizer and the gathered embedding
//! rows — none of which grows with the context.

use keep_checkpoint::layout;
use keep_checkpoint::naming::{self, Part};
use keep_checkpoint::Checkpoint;
use keep_model::MemoryEstimate;

use crate::{Result, RuntimeError};

/// Memory beyond the budget a run may use: the binary and its libraries, allocator slack,
/// thread stacks, tokenizer and embedding rows; it does not grow with the context. Checked by
/// the CLI's peak-RSS test (`keep-cli/tests/memory_budget.rs`, the bundled model at the least
/// budget it accepts); `dev/budget_vs_prompt.py` measures prompts of 16 to 16k tokens.
pub const FIXED_OVERHEAD: u64 = 64 << 20;

/// Whether a tensor (weight or scale) is a routed expert's, by keep-checkpoint's naming.
pub fn is_routed_expert(name: &str) -> bool {
    naming::parse(name).role.is_routed_expert()
}

/// Whether a tensor counts as resident (see the module doc).
pub fn is_resident(name: &str) -> bool {
    !is_routed_expert(name)
        && !name.starts_with("embed.")
        && !name.starts_with("model.embed_tokens.")
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

/// Physical memory of this machine in bytes (`sysconf(_SC_PHYS_PAGES) × page size`); `None`
/// where the OS does not say.
pub fn machine_memory_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system constants.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64))
}

/// Refuse `bytes` of planned allocation (`what` says whose) when it exceeds the machine's
/// physical memory, before anything is allocated.
pub fn check_machine(bytes: u64, what: &str) -> Result<()> {
    match machine_memory_bytes() {
        Some(m) if bytes > m => Err(RuntimeError::Invalid(format!(
            "{what} would allocate {bytes} bytes ({:.2} GiB), more than this machine's {m} bytes \
             ({:.2} GiB) of memory; use a shorter context (--prompt-tokens/--max-tokens) or a \
             smaller --memory-budget",
            bytes as f64 / (1u64 << 30) as f64,
            m as f64 / (1u64 << 30) as f64
        ))),
        _ => Ok(()),
    }
}

/// How a budget is split.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetPlan {
    pub budget: u64,
    /// What the budget holds besides the context and the slots: the resident weights and the
    /// caches and drafting a run holds beside them ([`SlotNeeds`]), the Engram row cache
    /// included.
    pub residents: u64,
    /// Of `residents`, the Engram row cache (0 without Engram layers).
    pub engram_cache: u64,
    pub slot_bytes: u64,
    pub n_layers: usize,
    pub top_k: usize,
    pub n_experts: usize,
    pub slots_per_layer: usize,
    /// `slots_per_layer × n_layers × slot_bytes`.
    pub slot_total: u64,
    /// The context the run is planned for, its decoding cache and one pass's activations.
    pub memory: MemoryEstimate,
}

impl BudgetPlan {
    /// The least budget that runs: residents + `top_k` slots per layer.
    pub fn minimum(residents: u64, slot_bytes: u64, n_layers: usize, top_k: usize) -> u64 {
        residents.saturating_add(slot_bytes.saturating_mul((n_layers * top_k) as u64))
    }

    /// Split `budget` with no context counted (see [`BudgetPlan::with_memory`]).
    pub fn new(
        budget: u64,
        residents: u64,
        slot_bytes: u64,
        n_layers: usize,
        top_k: usize,
        n_experts: usize,
    ) -> Result<BudgetPlan> {
        let none = MemoryEstimate {
            context: 0,
            chunk: 0,
            cache: 0,
            activations: 0,
        };
        Self::with_memory(
            budget, residents, none, slot_bytes, n_layers, top_k, n_experts,
        )
    }

    /// Split `budget` between the residents, the context's cache and activations (`memory`)
    /// and the slots, or refuse it naming the bytes needed.
    pub fn with_memory(
        budget: u64,
        residents: u64,
        memory: MemoryEstimate,
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
        let fixed = residents.saturating_add(memory.total());
        let needed = Self::minimum(fixed, slot_bytes, n_layers, top_k);
        if budget < needed {
            return Err(RuntimeError::BudgetTooSmall {
                budget,
                residents,
                held: Box::default(),
                context: memory.context,
                context_bytes: memory.total(),
                cache: memory.cache,
                activations: memory.activations,
                chunk: memory.chunk,
                layers: n_layers,
                top_k,
                slot_bytes,
                slots: needed - fixed,
                needed,
            });
        }
        let per_layer = (budget - fixed) / slot_bytes / n_layers as u64;
        let slots = (per_layer.min(n_experts as u64) as usize).max(top_k);
        Ok(BudgetPlan {
            budget,
            residents,
            engram_cache: 0,
            slot_bytes,
            n_layers,
            top_k,
            n_experts,
            slots_per_layer: slots,
            slot_total: slots as u64 * n_layers as u64 * slot_bytes,
            memory,
        })
    }

    /// What is not slots: residents + the context's cache and activations.
    pub fn fixed(&self) -> u64 {
        self.residents + self.memory.total()
    }

    /// Resident + context + slot bytes (≤ budget).
    pub fn planned(&self) -> u64 {
        self.fixed() + self.slot_total
    }
}

/// The Engram row cache a budgeted run holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngramShare {
    /// The model has no Engram layers.
    None,
    /// A size the run sets (`--engram-cache`).
    Set(u64),
    /// Unset: [`default_engram_cache`] of the budget, capped at `cap`, in whole rows of
    /// `row_bytes`.
    Default { cap: u64, row_bytes: u64 },
}

/// Everything the split of a budget depends on: what a budgeted run holds besides its expert
/// slots, and the slots' shape. [`SlotNeeds::plan`] is the one split of a budget into slots:
/// the runtime plans its run with it ([`BudgetedModel::load`](crate::BudgetedModel::load),
/// the needs from [`BudgetedModel::slot_needs`](crate::BudgetedModel::slot_needs)) and
/// `keep fit` predicts its hot sets with it, so that a plan's hot set is the run's.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotNeeds {
    /// The resident weights ([`resident_bytes`]).
    pub weights: u64,
    /// The residual cache of a run with precision tiers (0 without).
    pub residual_cache: u64,
    /// The drafter's tensors and cache copy of a drafting run (0 without).
    pub drafting: u64,
    pub engram: EngramShare,
    /// The context's decoding cache and one pass's activations.
    pub memory: MemoryEstimate,
    /// Bytes of every slot ([`ExpertStore::slot_bytes`](crate::ExpertStore::slot_bytes): the
    /// largest expert's aligned reads, whatever the rungs of the others).
    pub slot_bytes: u64,
    pub n_layers: usize,
    pub top_k: usize,
    pub n_experts: usize,
}

impl SlotNeeds {
    /// What is held beside the slots, the context and the Engram row cache.
    fn held(&self) -> u64 {
        self.weights
            .saturating_add(self.residual_cache)
            .saturating_add(self.drafting)
    }

    /// The Engram row cache a run under `budget` holds.
    pub fn engram_cache(&self, budget: u64) -> u64 {
        match self.engram {
            EngramShare::None => 0,
            EngramShare::Set(b) => b,
            // What the budget leaves after the rest and top-k slots (a budget too small for
            // those is refused by the split as without Engram layers).
            EngramShare::Default { cap, row_bytes } => default_engram_cache(
                budget,
                self.held().saturating_add(self.memory.total()),
                self.slot_bytes,
                self.n_layers,
                self.top_k,
                self.n_experts,
                cap,
                row_bytes,
            ),
        }
    }

    /// The least budget the run plans in: what is held, the context and `top_k` slots per
    /// layer (a default Engram row cache is empty there).
    pub fn minimum(&self) -> u64 {
        let set = match self.engram {
            EngramShare::Set(b) => b,
            _ => 0,
        };
        BudgetPlan::minimum(
            self.held()
                .saturating_add(set)
                .saturating_add(self.memory.total()),
            self.slot_bytes,
            self.n_layers,
            self.top_k,
        )
    }

    /// A budget in which every expert has a slot: the least one, plus `n_experts − top_k` more
    /// slots per layer, plus the whole default Engram row cache (which takes its share first).
    pub fn every_expert(&self) -> u64 {
        let more = self
            .slot_bytes
            .saturating_mul(self.n_experts.saturating_sub(self.top_k) as u64)
            .saturating_mul(self.n_layers as u64);
        let engram = match self.engram {
            EngramShare::Default { cap, .. } => cap,
            _ => 0,
        };
        self.minimum().saturating_add(more).saturating_add(engram)
    }

    /// The same run on a checkpoint keeping `n_experts` experts a layer (a pruned level of
    /// `keep fit`; its slots are the same size).
    pub fn with_experts(&self, n_experts: usize) -> SlotNeeds {
        SlotNeeds {
            n_experts,
            ..self.clone()
        }
    }

    /// Split `budget`: the Engram row cache it gives, the rest as [`BudgetPlan::with_memory`]
    /// splits it; a budget too small is refused naming what the residents' share holds
    /// besides the weights.
    pub fn plan(&self, budget: u64) -> Result<BudgetPlan> {
        let engram_cache = self.engram_cache(budget);
        BudgetPlan::with_memory(
            budget,
            self.held().saturating_add(engram_cache),
            self.memory,
            self.slot_bytes,
            self.n_layers,
            self.top_k,
            self.n_experts,
        )
        .map(|p| BudgetPlan { engram_cache, ..p })
        .map_err(|e| {
            name_held(
                e,
                &[
                    ("the Engram row cache (--engram-cache)", engram_cache),
                    ("the residual cache (--residual-cache)", self.residual_cache),
                    ("drafting (the MTP module and a cache copy)", self.drafting),
                ],
            )
        })
    }
}

/// A too-small budget's error naming what the residents' share holds besides the weights (the
/// caches and drafting), so that a cache too large for the budget is named, not the weights.
fn name_held(e: RuntimeError, parts: &[(&str, u64)]) -> RuntimeError {
    match e {
        RuntimeError::BudgetTooSmall {
            budget,
            residents,
            context,
            context_bytes,
            cache,
            activations,
            chunk,
            layers,
            top_k,
            slot_bytes,
            slots,
            needed,
            ..
        } => {
            let named: Vec<String> = parts
                .iter()
                .filter(|(_, b)| *b > 0)
                .map(|(what, b)| format!("{what} takes {b} bytes"))
                .collect();
            let held = if named.is_empty() {
                String::new()
            } else {
                format!(", of which {}", named.join(" and "))
            }
            .into_boxed_str();
            RuntimeError::BudgetTooSmall {
                budget,
                residents,
                held,
                context,
                context_bytes,
                cache,
                activations,
                chunk,
                layers,
                top_k,
                slot_bytes,
                slots,
                needed,
            }
        }
        e => e,
    }
}

/// The Engram row cache of a budgeted run that sets none: what `budget` leaves after `fixed`
/// (residents, the context's cache and activations, the other caches) and `top_k` slots per
/// layer is split evenly between the row cache and more expert slots (the row cache takes the
/// rest where the slots need less than half to hold every expert), capped at `cap` and rounded
/// down to whole rows of `row_bytes`. 0 when the budget leaves nothing: the rows are then read
/// directly, never held. Never more than the budget leaves, so the row cache alone never makes
/// a budget too small.
#[allow(clippy::too_many_arguments)]
pub fn default_engram_cache(
    budget: u64,
    fixed: u64,
    slot_bytes: u64,
    n_layers: usize,
    top_k: usize,
    n_experts: usize,
    cap: u64,
    row_bytes: u64,
) -> u64 {
    let spare = budget.saturating_sub(BudgetPlan::minimum(fixed, slot_bytes, n_layers, top_k));
    let more_slots = slot_bytes
        .saturating_mul(n_experts.saturating_sub(top_k) as u64)
        .saturating_mul(n_layers as u64);
    let share = (spare / 2).max(spare.saturating_sub(more_slots)).min(cap);
    match row_bytes {
        0 => 0,
        r => share / r * r,
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
    fn context_counts_inside_the_budget() {
        let memory = MemoryEstimate {
            context: 4096,
            chunk: 128,
            cache: 3000,
            activations: 2000,
        };
        let need = 1000 + 5000 + 4 * 2 * 100;
        let e = BudgetPlan::with_memory(need - 1, 1000, memory, 100, 4, 2, 64).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&format!("at least {need} bytes")), "{msg}");
        assert!(msg.contains("4096 tokens takes 5000 more"), "{msg}");
        let p = BudgetPlan::with_memory(need + 4 * 100, 1000, memory, 100, 4, 2, 64).unwrap();
        assert_eq!(p.slots_per_layer, 3);
        assert_eq!(p.planned(), need + 4 * 100);
        assert!(p.planned() <= p.budget);
    }

    #[test]
    fn default_engram_cache_fits_what_the_budget_leaves() {
        // residents 1000, 4 layers × top-k 2 × 100-byte slots, 64 experts a layer.
        let min = 1000 + 4 * 2 * 100;
        let cache = |budget, cap| default_engram_cache(budget, 1000, 100, 4, 2, 64, cap, 33);
        // Nothing left: no row cache (and the budget is not refused for it).
        assert_eq!(cache(min, 1 << 20), 0);
        assert_eq!(cache(min - 1, 1 << 20), 0);
        // Half of what is left, in whole rows; the plan with it still holds top-k slots.
        let c = cache(min + 10_000, 1 << 20);
        assert_eq!(c, 5_000 / 33 * 33);
        let p = BudgetPlan::new(min + 10_000, 1000 + c, 100, 4, 2, 64).unwrap();
        assert!(p.planned() <= p.budget && p.slots_per_layer >= 2);
        // Capped by the tables (or the default size).
        assert_eq!(cache(min + 10_000, 660), 660);
        // Slots that hold every expert take no more: the row cache gets the rest.
        let all = 4 * 62 * 100;
        assert_eq!(cache(min + all + 30_000, 1 << 20), 30_000 / 33 * 33);
    }

    #[test]
    fn slot_needs_split_the_budget_as_the_runtime_does() {
        let none = MemoryEstimate {
            context: 0,
            chunk: 0,
            cache: 0,
            activations: 0,
        };
        let needs = SlotNeeds {
            weights: 1000,
            residual_cache: 0,
            drafting: 0,
            engram: EngramShare::None,
            memory: none,
            slot_bytes: 100,
            n_layers: 4,
            top_k: 2,
            n_experts: 64,
        };
        // Without Engram layers: BudgetPlan's split.
        let min = 1000 + 4 * 2 * 100;
        assert_eq!(needs.minimum(), min);
        let b = min + 4 * 10 * 100;
        assert_eq!(
            needs.plan(b).unwrap(),
            BudgetPlan::new(b, 1000, 100, 4, 2, 64).unwrap()
        );
        assert_eq!(needs.every_expert(), 1000 + 4 * 64 * 100);
        assert_eq!(
            needs.plan(needs.every_expert()).unwrap().slots_per_layer,
            64
        );
        assert_eq!(needs.with_experts(16).plan(b).unwrap().slots_per_layer, 12);
        // A default Engram row cache takes half of what top-k slots leave: fewer slots.
        let engram = SlotNeeds {
            engram: EngramShare::Default {
                cap: 1 << 20,
                row_bytes: 16,
            },
            ..needs.clone()
        };
        let p = engram.plan(b).unwrap();
        assert_eq!(p.engram_cache, 4 * 10 * 100 / 2);
        assert_eq!(p.residents, 1000 + p.engram_cache);
        assert_eq!(p.slots_per_layer, 7);
        assert!(p.planned() <= b);
        // Every expert's slot beside the whole row cache.
        let all = engram.every_expert();
        let p = engram.plan(all).unwrap();
        assert_eq!((p.slots_per_layer, p.engram_cache), (64, 1 << 20));
        // Too small: refused naming a set row cache.
        let set = SlotNeeds {
            engram: EngramShare::Set(500),
            ..needs
        };
        assert_eq!(set.minimum(), min + 500);
        let msg = set.plan(min).unwrap_err().to_string();
        assert!(
            msg.contains("Engram row cache (--engram-cache) takes 500"),
            "{msg}"
        );
    }

    #[test]
    fn machine_memory_is_known_and_checked() {
        if let Some(m) = machine_memory_bytes() {
            assert!(m > 1 << 20);
            assert!(check_machine(m / 2, "a run").is_ok());
            let msg = check_machine(m + 1, "a run").unwrap_err().to_string();
            assert!(msg.contains(&format!("{}", m + 1)), "{msg}");
        }
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
