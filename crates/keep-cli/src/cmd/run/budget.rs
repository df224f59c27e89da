//! `keep run`'s memory-budget flags (`--memory-budget` and what goes with it: policy, warm start,
//! next-layer prefetch, the Engram row cache, I/O threads, `--record-routes`, `--stats-json`,
//! `--prompt-tokens`), their checks, and the printing of what a budgeted run measured: hit
//! rates, bytes read and read bandwidth per phase, the Engram row cache, peak resident memory.
//! Flags and printing only; the run itself is keep-runtime's.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use keep_runtime::{
    BudgetedModel, Policy, RunReport, RuntimeOptions, TierOptions, DEFAULT_IO_THREADS,
    DEFAULT_RESIDUAL_IO_THREADS, FIXED_OVERHEAD,
};

use crate::util::{human, parse_bytes};

/// Most expert-reading threads a run may start (each holds a read buffer; far beyond what an
/// SSD's queue depth can use).
const MAX_IO_THREADS: usize = 256;

/// The memory-budget flags of `keep run`.
#[derive(Args, Debug, Clone)]
pub struct BudgetArgs {
    /// Run inside this many bytes (e.g. 2GiB): resident weights plus per-layer expert slots;
    /// missing experts are read from the checkpoint's shards with direct I/O.
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub memory_budget: Option<u64>,
    /// Slot replacement policy: lru, decay (with --half-life) or static.
    #[arg(long, default_value = "lru", requires = "memory_budget")]
    pub policy: String,
    /// Half-life of --policy decay, in forward passes (decoded tokens).
    #[arg(long, default_value_t = keep_runtime::policy::DEFAULT_HALF_LIFE)]
    pub half_life: f64,
    /// Fill the slots before the run from reap-stats.safetensors or a --record-routes file.
    #[arg(long, value_name = "FILE", requires = "memory_budget")]
    pub warm_start: Option<PathBuf>,
    /// Guess layer L+1's experts with its router on layer L's hidden state and read them while
    /// layer L computes; reports how often the guess was right and the reads it saved.
    #[arg(long, requires = "memory_budget")]
    pub prefetch_next: bool,
    /// Bytes of the Engram row cache inside the budget (default: half of what the budget leaves
    /// after the resident weights, the context and top-k expert slots per layer — all of it
    /// past what slots for every expert take — at most the tables and 256MiB); Engram rows are
    /// read from the checkpoint's shards, never resident. A size the budget cannot hold is
    /// refused.
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES", requires = "memory_budget")]
    pub engram_cache: Option<u64>,
    /// Threads reading experts.
    #[arg(long, default_value_t = DEFAULT_IO_THREADS)]
    pub io_threads: usize,
    /// Read experts through the page cache instead of O_DIRECT (for comparison).
    #[arg(long)]
    pub buffered_io: bool,
    /// Write the routes (keep-routes v1, what `keep residency` reads) to FILE.
    #[arg(long, value_name = "FILE")]
    pub record_routes: Option<PathBuf>,
    /// Write the run's numbers as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub stats_json: Option<PathBuf>,
    /// Replace existing --record-routes and --stats-json files.
    #[arg(long)]
    pub force: bool,
    /// Without a tokenizer (keep synth models): use N deterministic prompt token ids.
    #[arg(long, value_name = "N")]
    pub prompt_tokens: Option<usize>,
    /// Tokens per forward pass of a long prompt (default: keep-model's DEFAULT_PREFILL_CHUNK,
    /// or the prompt's length when shorter, so that the budget holds the activations of the
    /// pass the run makes); the logits do not depend on it, the activations grow with it.
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<usize>,
    /// Precision tiers, with the allocation the checkpoint holds (checked): each expert's base
    /// is its allocated rung, in the slots; its upper stage is what lies above it — the
    /// residual codes the checkpoint carries for an `e8p2` expert (e.g. a `keep quant --alloc`
    /// checkpoint under an allocation of `e8p2` and `e8p2+e81`), and for an expert at
    /// `e8p2+e81`/`e8p2+e8p2` (or `e8p2` without residual codes) its shipped expert in the
    /// original checkpoint (--upper-from, required when the allocation has such experts); an
    /// expert at `shipped` has none. Upper stages are read apart from SSD into a residual cache
    /// inside the budget. A routed slot with gate weight ≥ --tau uses the upper rung only if
    /// its stage is in memory, else the base now while the stage is read in the background; a
    /// forward never waits for an upper-stage read. Without --tiers every E8P expert's base is
    /// its `e8p2` codes and its residual its upper stage.
    #[arg(long, value_name = "ALLOC.json", requires_all = ["memory_budget", "tau"])]
    pub tiers: Option<PathBuf>,
    /// The original checkpoint (the model `keep alloc` was run on and MODEL quantized from;
    /// checked: the allocation's fingerprint, family, shapes, experts per layer): the shipped
    /// upper stages of --tiers are its experts (a pruned MODEL's experts are mapped to the
    /// original's by the allocation), read by the same reader threads into the same residual
    /// cache as residual codes.
    #[arg(long, value_name = "ORIGINAL", requires = "tau")]
    pub upper_from: Option<PathBuf>,
    /// Gate weight from which a routed slot wants its expert's upper rung: turns the tiers on
    /// (with or without --tiers).
    #[arg(long, value_name = "T", requires = "memory_budget")]
    pub tau: Option<f32>,
    /// Bytes of the residual cache, taken out of the budget (with --tiers).
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES", default_value = "256MiB")]
    pub residual_cache: u64,
}

impl BudgetArgs {
    /// Whether these flags ask for this path rather than the plain run.
    pub fn active(&self) -> bool {
        self.memory_budget.is_some()
            || self.record_routes.is_some()
            || self.stats_json.is_some()
            || self.prompt_tokens.is_some()
            || self.prefill_chunk.is_some()
    }
}

impl BudgetArgs {
    /// Refuse bad flags and outputs before anything is loaded: existing `--record-routes` /
    /// `--stats-json` files without `--force` (and any inside the model `dir`), an I/O thread
    /// count out of range, an empty synthetic prompt.
    pub fn check(&self, dir: &Path) -> anyhow::Result<()> {
        for p in [&self.record_routes, &self.stats_json]
            .into_iter()
            .flatten()
        {
            crate::util::check_out_file(p, self.force, &[dir])?;
        }
        anyhow::ensure!(
            (1..=MAX_IO_THREADS).contains(&self.io_threads),
            "--io-threads must be 1 to {MAX_IO_THREADS}, not {}",
            self.io_threads
        );
        anyhow::ensure!(
            self.prompt_tokens != Some(0),
            "--prompt-tokens must be at least 1"
        );
        anyhow::ensure!(
            self.prefill_chunk != Some(0),
            "--prefill-chunk must be at least 1"
        );
        if let Some(t) = self.tau {
            anyhow::ensure!(!t.is_nan(), "--tau must be a number");
        }
        Ok(())
    }

    /// Refuse `--tiers` without `--upper-from` on a checkpoint `ck` whose allocation gives
    /// some experts their shipped expert as the upper stage (which only the original
    /// checkpoint has).
    pub fn check_tiers(&self, ck: &keep_checkpoint::Checkpoint) -> anyhow::Result<()> {
        let (Some(_), Some(f), None) = (self.memory_budget, &self.tiers, &self.upper_from) else {
            return Ok(());
        };
        let a = keep_artifacts::alloc::Alloc::read(f)
            .with_context(|| format!("--tiers {}", f.display()))?;
        let n = shipped_upper_rungs(ck, &a).with_context(|| format!("--tiers {}", f.display()))?;
        anyhow::ensure!(
            n == 0,
            "--tiers {}: {n} experts are allocated `e8p2+e81`/`e8p2+e8p2` (or `e8p2` without \
             residual codes), whose upper rung is their shipped expert in the original \
             checkpoint: give it with --upper-from ORIGINAL (the model keep alloc was run on)",
            f.display()
        );
        Ok(())
    }

    /// The runtime's options when `--memory-budget` is given (the session plans them for the
    /// run's context, kernels, prefill chunk and drafting).
    pub fn runtime_options(&self) -> anyhow::Result<Option<RuntimeOptions>> {
        let Some(budget) = self.memory_budget else {
            return Ok(None);
        };
        let policy: Policy = match self.policy.as_str() {
            "decay" => {
                anyhow::ensure!(
                    self.half_life.is_finite() && self.half_life > 0.0,
                    "--half-life must be a positive number of forward passes, not {}",
                    self.half_life
                );
                Policy::Decay {
                    half_life: self.half_life,
                }
            }
            p => p
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--policy: {e}"))?,
        };
        let alloc = match &self.tiers {
            Some(f) => Some(std::sync::Arc::new(
                keep_artifacts::alloc::Alloc::read(f)
                    .with_context(|| format!("--tiers {}", f.display()))?,
            )),
            None => None,
        };
        Ok(Some(RuntimeOptions {
            policy,
            io_threads: self.io_threads,
            direct_io: !self.buffered_io,
            warm_start: self.warm_start.clone(),
            prefetch_next: self.prefetch_next,
            engram_cache: self.engram_cache,
            tiers: self.tau.map(|tau| TierOptions {
                tau,
                alloc: alloc.clone(),
                residual_cache: self.residual_cache,
                io_threads: DEFAULT_RESIDUAL_IO_THREADS,
                upper_from: self.upper_from.clone(),
            }),
            ..RuntimeOptions::new(budget)
        }))
    }
}

/// Experts of `ck` whose upper stage under `alloc` would be their shipped expert (keep-residency's
/// rule with an original checkpoint given).
fn shipped_upper_rungs(
    ck: &keep_checkpoint::Checkpoint,
    alloc: &keep_artifacts::alloc::Alloc,
) -> anyhow::Result<usize> {
    use keep_residency::tiers::{residual_bytes_of, stage_mix, upper_stages};
    let cfg = ck.require_config()?;
    let layers: Vec<usize> = (0..cfg.num_hidden_layers).collect();
    let residual = residual_bytes_of(ck, &layers)?;
    // Any original expert, one byte each: only which stages are shipped matters here.
    let any: Vec<Vec<u64>> = layers
        .iter()
        .map(|&l| {
            let n = alloc
                .layers
                .iter()
                .find(|x| x.layer == l)
                .map_or(cfg.experts_in_layer(l), |x| x.rungs.len());
            vec![1; n]
        })
        .collect();
    let stages = upper_stages(Some(alloc), &layers, &residual, Some(&any))?;
    Ok(stage_mix(&stages).1)
}

/// The budget split, before the run.
pub fn print_plan(m: &BudgetedModel) {
    let p = m.plan();
    let st = m.cache().store();
    eprintln!(
        "budget {}: residents {} + context of {} tokens {} (decoding cache {} + activations {} of a {}-token pass) + {} slots/layer × {} layers × {} = {} (routed experts {}; {} per layer of {}; policy {}; {} I/O threads, {})",
        human(p.budget),
        human(p.residents),
        p.memory.context,
        human(p.memory.total()),
        human(p.memory.cache),
        human(p.memory.activations),
        p.memory.chunk,
        p.slots_per_layer,
        p.n_layers,
        human(p.slot_bytes),
        human(p.planned()),
        human(st.total_bytes()),
        p.slots_per_layer,
        p.n_experts,
        m.policy(),
        m.cache().stats().io_threads,
        if st.direct_io() { "O_DIRECT" } else { "buffered reads + fadvise(DONTNEED): direct I/O unavailable or off" }
    );
    if let Some(t) = m.cache().tier_stats() {
        eprintln!(
            "tiers: τ {}, residual cache {} inside the budget; {} of {} experts have an upper stage ({} their residual codes, {} their shipped expert of --upper-from; {} on SSD); the others are served at their allocated rung only",
            t.tau,
            human(t.cache_bytes),
            st.experts_with_upper(),
            st.n_layers() * st.n_experts(),
            st.experts_with_upper() - st.experts_with_shipped_upper(),
            st.experts_with_shipped_upper(),
            human(st.upper_total_bytes())
        );
    }
}

/// The caches' counters per phase and the peak resident memory, after the run.
pub fn print_report(r: &RunReport, memory_budget: Option<u64>) {
    for (phase, s) in [("prefill", &r.prefill_cache), ("decode", &r.decode_cache)] {
        if let Some(s) = s {
            eprintln!(
                "{phase} experts: hit rate {:.1}% ({} hits, {} misses); read {} in {} reads at {:.2} GB/s; waited {:.3} s",
                100.0 * s.hit_rate(),
                s.hits,
                s.misses,
                human(s.bytes_read),
                s.experts_read,
                s.read_gbps(),
                s.wait_secs
            );
            if s.exact_passes > 0 {
                eprintln!(
                    "{phase} hash-routed layers: {} passes prefetched from the token ids ({} hits, {} misses); waited {:.3} s of the {:.3} s",
                    s.exact_passes,
                    s.hash_hits,
                    s.hash_misses,
                    s.hash_wait_secs,
                    s.wait_secs
                );
            }
            if let Some(t) = &s.tiers {
                eprintln!(
                    "{phase} tiers: {} routed slots upper, {} base ({} with gate ≥ τ {}); residual {} hits, {} misses ({} in flight, {} admitted, {} no room, {} failed), {} evictions; read {}; waited {:.3} s",
                    t.upper,
                    t.base,
                    t.above_tau,
                    t.tau,
                    t.upper,
                    t.upper_misses,
                    t.in_flight,
                    t.admissions,
                    t.no_room,
                    t.failed,
                    t.evictions,
                    human(t.bytes_read),
                    t.wait_secs
                );
            }
            if s.guess.passes > 0 {
                let g = s.guess;
                eprintln!(
                    "{phase} next-layer guesses: {:.1}% of routed experts guessed ({} of {}); {} guessed reads, {} used ({} read ahead of their layer)",
                    100.0 * g.right as f64 / g.routed.max(1) as f64,
                    g.right,
                    g.routed,
                    g.reads,
                    g.saved,
                    human(g.saved * s.slot_bytes)
                );
            }
        }
    }
    for (phase, s) in [("prefill", &r.prefill_engram), ("decode", &r.decode_engram)] {
        if let Some(s) = s {
            eprintln!(
                "{phase} engram rows: hit rate {:.1}% ({} of {} rows); read {} for {} of rows ({:.1}x, {} reads of {}-byte blocks, {}); waited {:.3} s",
                100.0 * s.hit_rate(),
                s.hits,
                s.rows_requested,
                human(s.bytes_read),
                human(s.useful_bytes),
                s.read_amplification(),
                s.reads,
                s.block_bytes,
                s.block_source.map_or("unknown", |b| b.as_str()),
                s.wait_secs
            );
        }
    }
    match (r.peak_rss, memory_budget) {
        (Some(p), Some(budget)) => eprintln!(
            "peak resident memory: {} (budget {} + documented overhead {})",
            human(p),
            human(budget),
            human(FIXED_OVERHEAD)
        ),
        (Some(p), None) => eprintln!("peak resident memory: {}", human(p)),
        _ => {}
    }
}
