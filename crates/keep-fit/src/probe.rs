//! What `keep fit` measures before it plans: the memory the machine has (`--memory auto`), and
//! two decodes of the check set ([`crate::checkset`]) at the model's own shapes with the plan's
//! kernels. The first runs with every routed expert in memory when the machine has room for
//! them (a warm-up sequence first): its decode time is the compute per token, misses aside.
//! The second runs in the smallest budget that works (a hot set of `top_k` slots per layer, so
//! nearly every routed expert is a miss): it records the routes the predictions replay, the
//! read rate of the model's own expert bytes with direct I/O (the runtime's expert store,
//! `O_DIRECT` positional reads), and what the misses add to a token over the first decode,
//! split into a latency per decoder layer that has a miss (the forward waits for the layer's
//! first read whatever the number) and a transfer time per miss (its bytes at the read rate).
//! Without room for every expert, the compute is the second decode's time minus its waits.

use std::path::PathBuf;

use keep_artifacts::fit_plan::{CheckSet, Probes};
use keep_artifacts::routes::RouteTrace;
use keep_checkpoint::Checkpoint;
use keep_model::{Kernels, ModelConfig};
use keep_runtime::{BudgetedModel, ExpertStore, RunModel, RuntimeError, RuntimeOptions, SlotNeeds};

use crate::checkset::{self, Decoded};
use crate::{FitError, Result};

/// `--memory auto` leaves this fraction of MemAvailable to the rest of the machine (page cache
/// for the expert reads' metadata, other processes, the allocator's slack) ...
pub const AUTO_MARGIN_FRACTION: f64 = 0.10;
/// ... and never less than this many bytes.
pub const AUTO_MARGIN_MIN: u64 = 512 << 20;

pub use keep_runtime::runtime::mem_available;

/// `--memory auto`: (bytes, MemAvailable, margin).
pub fn auto_memory() -> Result<(u64, u64, u64)> {
    let avail = mem_available().ok_or_else(|| {
        FitError::Invalid(
            "--memory auto: MemAvailable is not in /proc/meminfo; give --memory BYTES".into(),
        )
    })?;
    let margin = ((avail as f64 * AUTO_MARGIN_FRACTION) as u64).max(AUTO_MARGIN_MIN);
    if avail <= margin {
        return Err(FitError::NoFit(format!(
            "--memory auto: {avail} bytes available, less than the {margin}-byte margin"
        )));
    }
    Ok((avail - margin, avail, margin))
}

/// The probes' shape.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub kernels: Kernels,
    /// Prompt tokens of each check-set sequence.
    pub prompt_tokens: usize,
    /// Tokens decoded after each prompt.
    pub decode_tokens: usize,
    /// Sequences in the check set.
    pub sequences: usize,
    /// A pack whose held-out records are the check set's texts (synthetic ids without one).
    pub held_out: Option<PathBuf>,
    /// The context the plans are made for (the budget holds its cache).
    pub context: usize,
    pub io_threads: usize,
}

/// What the probe measured and the sizes the search plans with.
#[derive(Debug, Clone)]
pub struct Probe {
    pub probes: Probes,
    /// Residents + the context's cache and activations: what is not slots in the least budget
    /// (whose default Engram row cache is empty).
    pub fixed_bytes: u64,
    /// Bytes of one expert slot.
    pub slot_bytes: u64,
    /// What the plan's run holds besides its slots: the runtime's own split of a budget
    /// ([`SlotNeeds::plan`]) gives each candidate's hot set.
    pub needs: SlotNeeds,
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// All routed experts' bytes.
    pub expert_total_bytes: u64,
    /// The sequences decoded, and their routes (every expert kept).
    pub check_set: CheckSet,
    pub trace: RouteTrace,
}

fn kernels_name(k: Kernels) -> &'static str {
    match k {
        Kernels::Exact => "exact",
        Kernels::Fast => "fast",
    }
}

/// The runtime's options for the probes' runs and the plans' (a plan runs with the plan's
/// kernels and context and no drafting; policy and warm start do not change the split).
fn runtime_options(opts: &ProbeOptions, budget: u64) -> RuntimeOptions {
    let mut ro = RuntimeOptions::new(budget);
    ro.kernels = opts.kernels;
    ro.context = Some(opts.context);
    ro.io_threads = opts.io_threads;
    ro
}

/// What a plan's run of `ck` holds besides its slots, as the runtime counts it.
pub fn slot_needs(ck: &Checkpoint, opts: &ProbeOptions) -> Result<SlotNeeds> {
    Ok(BudgetedModel::slot_needs(ck, &runtime_options(opts, 0))?)
}

/// The smallest budget `ck` runs in for `context` (residents, context, `top_k` slots per
/// layer), by the runtime's own budget split.
pub fn minimum_budget(ck: &Checkpoint, opts: &ProbeOptions) -> Result<u64> {
    Ok(slot_needs(ck, opts)?.minimum())
}

/// Load `ck` in `budget`, growing it once by what the runtime says is missing (the Engram row
/// cache comes out of the budget too).
fn load<'a>(ck: &'a Checkpoint, opts: &ProbeOptions, budget: u64) -> Result<RunModel<'a>> {
    let mut ro = runtime_options(opts, budget);
    match RunModel::load(ck, opts.kernels, Some(&ro)) {
        Ok(m) => Ok(m),
        Err(RuntimeError::BudgetTooSmall { needed, .. }) => {
            ro.budget = needed;
            Ok(RunModel::load(ck, opts.kernels, Some(&ro))?)
        }
        Err(e) => Err(e.into()),
    }
}

/// The check set for `ck`: the held-out pack's records when given, else synthetic ids.
pub fn check_set(cfg: &ModelConfig, opts: &ProbeOptions) -> Result<CheckSet> {
    let n = opts.sequences.max(1);
    let (p, d) = (opts.prompt_tokens.max(1), opts.decode_tokens.max(1));
    match &opts.held_out {
        Some(dir) => {
            let pack = keep_calib::pack::Pack::open(dir)?;
            checkset::held_out(&pack, cfg.vocab, n, p, d)
        }
        None => Ok(checkset::synthetic(cfg.vocab, n, p, d)),
    }
}

/// How a token's misses are priced: `layers_with_miss × latency + misses × transfer`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MissCost {
    pub layer_latency_secs: f64,
    pub miss_transfer_secs: f64,
}

/// Expected decoder layers per token with at least one of its `k` routes missed, when
/// `misses` of a token's `layers × k` routes miss independently.
pub fn layers_with_miss(misses: f64, layers: usize, k: usize) -> f64 {
    if layers == 0 || k == 0 || misses <= 0.0 {
        return 0.0;
    }
    let q = (misses / (layers * k) as f64).clamp(0.0, 1.0);
    layers as f64 * (1.0 - (1.0 - q).powi(k as i32))
}

/// Split `extra` seconds per token (what `misses` per token added) into a latency per layer
/// with a miss and a transfer per miss, the transfer being `slot_bytes` at `read_gbps` (capped
/// so that the latency is never negative).
pub fn miss_cost(
    extra: f64,
    misses: f64,
    layers: usize,
    k: usize,
    slot_bytes: u64,
    read_gbps: f64,
) -> MissCost {
    if misses <= 0.0 || extra <= 0.0 {
        return MissCost {
            layer_latency_secs: 0.0,
            miss_transfer_secs: 0.0,
        };
    }
    let transfer = if read_gbps > 0.0 {
        (slot_bytes as f64 / (read_gbps * 1e9)).min(extra / misses)
    } else {
        extra / misses
    };
    let lw = layers_with_miss(misses, layers, k);
    let latency = if lw > 0.0 {
        ((extra - misses * transfer) / lw).max(0.0)
    } else {
        0.0
    };
    MissCost {
        layer_latency_secs: latency,
        miss_transfer_secs: transfer,
    }
}

/// Run the probes on `ck`.
pub fn probe(ck: &Checkpoint, opts: &ProbeOptions) -> Result<Probe> {
    let cfg = ModelConfig::from_checkpoint(ck)?;
    let set = check_set(&cfg, opts)?;
    let min = minimum_budget(ck, opts)?;
    // The smallest budget: nearly every route a miss; its routes are the trace.
    let (b, fixed, slot_bytes, expert_total) = {
        let mut model = load(ck, opts, min)?;
        let (fixed, slot_bytes, expert_total) = {
            let m = model
                .budgeted()
                .ok_or_else(|| FitError::Invalid("the probe ran without a budget".into()))?;
            let p = m.plan();
            (p.fixed(), p.slot_bytes, m.cache().store().total_bytes())
        };
        let b = checkset::decode(&mut model, &set, true, None)?;
        (b, fixed, slot_bytes, expert_total)
    };
    if !b.budgeted {
        return Err(FitError::Invalid(
            "the probe's decode reported no cache counters".into(),
        ));
    }
    // Every expert in memory, when the machine has room: the compute alone.
    let needs = slot_needs(ck, opts)?;
    let all = needs.every_expert();
    let room = mem_available()
        .map(|a| a.saturating_sub(((a as f64 * AUTO_MARGIN_FRACTION) as u64).max(AUTO_MARGIN_MIN)))
        .unwrap_or(0);
    let resident: Option<Decoded> = if all <= room {
        let mut model = load(ck, opts, all)?;
        let warm = CheckSet {
            sequences: set.sequences[..1].to_vec(),
            ..set.clone()
        };
        checkset::decode(&mut model, &warm, false, None)?;
        Some(checkset::decode(&mut model, &set, false, None)?)
    } else {
        None
    };
    let tokens_b = b.decode_tokens.max(1) as f64;
    let per_token_b = b.decode_secs / tokens_b;
    let (compute, provenance) = match &resident {
        Some(a) => (
            ((a.decode_secs - a.wait_secs) / a.decode_tokens.max(1) as f64).max(0.0),
            "all-resident",
        ),
        None => (
            ((b.decode_secs - b.wait_secs) / tokens_b).max(0.0),
            "minimum-budget",
        ),
    };
    let misses = b.misses as f64 / tokens_b;
    // What the misses added: over the all-resident decode, or the waits alone without one;
    // never less than the waits (a noisy machine can make the first decode the slower).
    let waits = b.wait_secs / tokens_b;
    let extra = match &resident {
        Some(_) => (per_token_b - compute).max(waits),
        None => waits,
    };
    let cost = miss_cost(
        extra,
        misses,
        cfg.n_layers,
        cfg.top_k,
        slot_bytes,
        b.read_gbps(),
    );
    Ok(Probe {
        probes: Probes {
            ssd_gbps: b.read_gbps(),
            ssd_probe_bytes: b.bytes_read,
            direct_io: ExpertStore::open(ck, &cfg, true)?.direct_io(),
            miss_secs: if misses > 0.0 { extra / misses } else { 0.0 },
            compute_secs_per_token: compute,
            compute_probe_tokens: resident
                .as_ref()
                .map(|a| a.decode_tokens)
                .unwrap_or(b.decode_tokens) as u64,
            kernels: kernels_name(opts.kernels).into(),
            layer_latency_secs: cost.layer_latency_secs,
            miss_transfer_secs: cost.miss_transfer_secs,
            compute_provenance: provenance.into(),
        },
        fixed_bytes: fixed,
        slot_bytes,
        needs,
        n_layers: cfg.n_layers,
        n_experts: cfg.n_experts,
        top_k: cfg.top_k,
        expert_total_bytes: expert_total,
        check_set: set,
        trace: b.trace,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miss_cost_splits_extra_time_into_latency_and_transfer() {
        // 8 layers, top-2, every route missed: 16 misses, 8 layers with a miss.
        let c = miss_cost(0.016 + 0.008, 16.0, 8, 2, 1_000_000, 1.0);
        assert!((c.miss_transfer_secs - 0.001).abs() < 1e-12);
        assert!((c.layer_latency_secs - 0.001).abs() < 1e-12);
        // The transfer never exceeds the extra time; the latency is then 0.
        let c = miss_cost(0.004, 16.0, 8, 2, 1_000_000, 1.0);
        assert!((c.miss_transfer_secs - 0.00025).abs() < 1e-12);
        assert_eq!(c.layer_latency_secs, 0.0);
        assert_eq!(layers_with_miss(0.0, 8, 2), 0.0);
        assert!((layers_with_miss(16.0, 8, 2) - 8.0).abs() < 1e-12);
        // One miss in a token of 8 × 2 routes: 8·(1 − (15/16)²) layers.
        let one = layers_with_miss(1.0, 8, 2);
        assert!((one - 8.0 * 31.0 / 256.0).abs() < 1e-12, "{one}");
    }
}
