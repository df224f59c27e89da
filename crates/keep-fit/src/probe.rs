//! What `keep fit` measures before it plans: the memory the machine has (`--memory auto`), and
//! one short budgeted decode of the model at its own shapes with the smallest budget that runs
//! (a hot set of `top_k` slots per layer, so nearly every routed expert is a miss). That one
//! pass gives the three numbers the predictions need: the read bandwidth of the model's own
//! expert bytes with direct I/O (the runtime's expert store, `O_DIRECT` positional reads), the
//! seconds the forward waits per expert read, and the compute seconds per decoded token with
//! the plan's kernels (decode time minus the I/O waits), which holds for every hot-set size
//! since a hit and a miss compute the same product.

use std::ops::ControlFlow;

use keep_artifacts::fit_plan::Probes;
use keep_checkpoint::Checkpoint;
use keep_model::generate::{encode_prompt, GenerateOptions, Prompt, SamplerConfig};
use keep_model::{Kernels, ModelConfig};
use keep_runtime::{ExpertStore, RunModel, RuntimeError, RuntimeOptions};

use crate::{FitError, Result};

/// `--memory auto` leaves this fraction of MemAvailable to the rest of the machine (page cache
/// for the expert reads' metadata, other processes, the allocator's slack) ...
pub const AUTO_MARGIN_FRACTION: f64 = 0.10;
/// ... and never less than this many bytes.
pub const AUTO_MARGIN_MIN: u64 = 512 << 20;

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

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

/// The compute probe's shape.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub kernels: Kernels,
    /// Synthetic prompt tokens before the decode.
    pub prompt_tokens: usize,
    /// Decoded tokens timed.
    pub decode_tokens: usize,
    /// The context the plans are made for (the budget holds its cache).
    pub context: usize,
    pub io_threads: usize,
}

/// What the probe measured and the sizes the search plans with.
#[derive(Debug, Clone)]
pub struct Probe {
    pub probes: Probes,
    /// Residents + Engram row cache + the context's cache and activations: what is not slots.
    pub fixed_bytes: u64,
    /// Bytes of one expert slot.
    pub slot_bytes: u64,
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// All routed experts' bytes.
    pub expert_total_bytes: u64,
}

fn kernels_name(k: Kernels) -> &'static str {
    match k {
        Kernels::Exact => "exact",
        Kernels::Fast => "fast",
    }
}

/// The smallest budget `ck` runs in for `context` (residents, context, `top_k` slots per
/// layer), found by asking the runtime's own budget split.
pub fn minimum_budget(ck: &Checkpoint, opts: &ProbeOptions) -> Result<u64> {
    let cfg = ModelConfig::from_checkpoint(ck)?;
    let store = ExpertStore::open(ck, &cfg, true)?;
    let guess = keep_runtime::resident_bytes(ck)
        + cfg.memory_estimate(opts.context).total()
        + store.slot_bytes() * (cfg.n_layers * cfg.top_k) as u64;
    match keep_runtime::BudgetPlan::with_memory(
        guess,
        keep_runtime::resident_bytes(ck),
        cfg.memory_estimate(opts.context),
        store.slot_bytes(),
        cfg.n_layers,
        cfg.top_k,
        cfg.n_experts,
    ) {
        Ok(_) => {}
        Err(RuntimeError::BudgetTooSmall { needed, .. }) => return Ok(needed),
        Err(e) => return Err(e.into()),
    }
    Ok(guess)
}

/// Run the probe on `ck`.
pub fn probe(ck: &Checkpoint, opts: &ProbeOptions) -> Result<Probe> {
    let mut budget = minimum_budget(ck, opts)?;
    let mut ro = RuntimeOptions::new(budget);
    ro.kernels = opts.kernels;
    ro.context = Some(opts.context);
    ro.io_threads = opts.io_threads;
    // The Engram row cache comes out of the budget too: grow the budget by what the runtime
    // says is missing (once).
    let model = match RunModel::load(ck, opts.kernels, Some(&ro)) {
        Ok(m) => m,
        Err(RuntimeError::BudgetTooSmall { needed, .. }) => {
            budget = needed;
            ro.budget = budget;
            RunModel::load(ck, opts.kernels, Some(&ro))?
        }
        Err(e) => return Err(e.into()),
    };
    let mut model = model;
    let (fixed, slot_bytes, expert_total) = {
        let m = model
            .budgeted()
            .ok_or_else(|| FitError::Invalid("the probe ran without a budget".into()))?;
        let p = m.plan();
        (p.fixed(), p.slot_bytes, m.cache().store().total_bytes())
    };
    let cfg = model.cfg().clone();
    let ids = encode_prompt(
        &cfg,
        None,
        Prompt::Synthetic(opts.prompt_tokens.max(1)),
        opts.decode_tokens,
    )?;
    let gen = GenerateOptions {
        max_tokens: opts.decode_tokens.max(2),
        sampling: SamplerConfig {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        },
        tokenizer: None,
    };
    let r = keep_runtime::run::run(&mut model, Prompt::Ids(&ids), &gen, None, |_| {
        ControlFlow::Continue(())
    })?;
    let d = r
        .decode_cache
        .ok_or_else(|| FitError::Invalid("the probe's decode reported no cache counters".into()))?;
    let tokens = r.gen.generated.max(1) as f64;
    let compute = ((r.gen.decode_secs - d.wait_secs) / tokens).max(0.0);
    let miss_secs = if d.misses > 0 {
        d.wait_secs / d.misses as f64
    } else {
        0.0
    };
    Ok(Probe {
        probes: Probes {
            ssd_gbps: d.read_gbps(),
            ssd_probe_bytes: d.bytes_read,
            direct_io: d.direct_io,
            miss_secs,
            compute_secs_per_token: compute,
            compute_probe_tokens: r.gen.generated as u64,
            kernels: kernels_name(opts.kernels).into(),
        },
        fixed_bytes: fixed,
        slot_bytes,
        n_layers: cfg.n_layers,
        n_experts: cfg.n_experts,
        top_k: cfg.top_k,
        expert_total_bytes: expert_total,
    })
}
