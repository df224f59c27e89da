//! `keep run --memory-budget BYTES`: the run verb with routed experts in per-layer slots inside
//! a memory budget (keep-runtime), misses read from the checkpoint's own shards. Also serves
//! `--record-routes` and `--stats-json` without a budget (plain mapped model), so that a
//! budgeted run and an mmap run can be compared with the same flags. At the end it prints hit
//! rate, bytes read and read bandwidth, prefill and decode tokens/s and peak resident memory.
//!
//! A child module of `run` so that it reads `RunArgs` without widening that struct's API.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_checkpoint::Checkpoint;
use keep_model::generate::{generate_with, Generate, Sampler, SamplerConfig};
use keep_model::{Cache, Logits, Model, RouteObserver};
use keep_runtime::{
    check_machine, peak_rss_bytes, BudgetedModel, CacheStats, EngramStats, Policy, RouteLog,
    RuntimeOptions, DEFAULT_IO_THREADS, FIXED_OVERHEAD,
};

use super::{config_id, prompt_ids, RunArgs, TextOut};
use crate::cmd::logits::{model_dir, tokenizer};
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
    /// Bytes of the Engram row cache inside the budget (default: the smaller of the tables and
    /// 256MiB); Engram rows are read from the checkpoint's shards, never resident.
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
    /// Tokens per forward pass of a long prompt (default: keep-model's DEFAULT_PREFILL_CHUNK);
    /// the logits do not depend on it, the activations grow with it.
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<usize>,
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

fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab.max(1) as u64) as u32
        })
        .collect()
}

/// The model this path drives: under a memory budget (keep-runtime) or plainly mapped.
enum Loaded<'a> {
    Budgeted(BudgetedModel<'a>),
    Plain(Model<'a>),
}

impl Generate for Loaded<'_> {
    fn new_cache(&self) -> Cache {
        match self {
            Loaded::Budgeted(m) => m.new_cache(),
            Loaded::Plain(m) => m.new_cache(),
        }
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        match self {
            Loaded::Budgeted(m) => m.forward_last(tokens, cache, obs),
            Loaded::Plain(m) => m.forward(tokens, cache, Logits::Last, obs),
        }
    }
    fn prefilled(&mut self) {
        if let Loaded::Budgeted(m) = self {
            m.prefilled();
        }
    }
}

impl<'a> Loaded<'a> {
    fn budgeted(&self) -> Option<&BudgetedModel<'a>> {
        match self {
            Loaded::Budgeted(m) => Some(m),
            Loaded::Plain(_) => None,
        }
    }
}

fn obs(l: &mut Option<RouteLog>) -> Option<&mut dyn RouteObserver> {
    l.as_mut().map(|l| l as &mut dyn RouteObserver)
}

fn engram_json(s: &EngramStats) -> serde_json::Value {
    serde_json::json!({
        "rows_requested": s.rows_requested, "hits": s.hits, "misses": s.misses,
        "hit_rate": s.hit_rate(), "bytes_read": s.bytes_read, "useful_bytes": s.useful_bytes,
        "read_amplification": s.read_amplification(), "reads": s.reads,
        "wait_secs": s.wait_secs, "sync_rows": s.sync_rows,
    })
}

fn cache_json(s: &CacheStats) -> serde_json::Value {
    serde_json::json!({
        "hits": s.hits, "misses": s.misses, "hit_rate": s.hit_rate(),
        "bytes_read": s.bytes_read, "experts_read": s.experts_read,
        "io_busy_secs": s.io_busy_secs, "read_gbps": s.read_gbps(), "wait_secs": s.wait_secs,
        "warm_bytes": s.warm_bytes,
        "hash_layers": {
            "exact_passes": s.exact_passes, "hits": s.hash_hits, "misses": s.hash_misses,
            "wait_secs": s.hash_wait_secs,
        },
        "guess": {
            "passes": s.guess.passes, "guessed": s.guess.guessed, "routed": s.guess.routed,
            "right": s.guess.right, "reads": s.guess.reads, "saved": s.guess.saved,
        },
    })
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let b = a.budget.clone();
    let dir = model_dir(a.model.clone())?;
    for p in [&b.record_routes, &b.stats_json].into_iter().flatten() {
        crate::util::check_out_file(p, b.force, &[&dir])?;
    }
    anyhow::ensure!(
        (1..=MAX_IO_THREADS).contains(&b.io_threads),
        "--io-threads must be 1 to {MAX_IO_THREADS}, not {}",
        b.io_threads
    );
    anyhow::ensure!(
        b.prompt_tokens != Some(0),
        "--prompt-tokens must be at least 1"
    );
    anyhow::ensure!(
        b.prefill_chunk != Some(0),
        "--prefill-chunk must be at least 1"
    );
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    // The prompt and the context first: the run's memory is planned for them before anything
    // is allocated.
    let mut cfg = keep_model::ModelConfig::from_checkpoint(&ck)
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    if let Some(c) = b.prefill_chunk {
        cfg.prefill_chunk = c;
    }
    let raw = &cfg.raw.raw;
    let bos = config_id(raw, "bos_token_id");
    let eos = config_id(raw, "eos_token_id");
    let tok = if b.prompt_tokens.is_some() {
        None
    } else {
        Some(tokenizer(&dir)?)
    };
    if let Some(n) = b.prompt_tokens {
        super::check_context(n, a.max_tokens, &cfg)?;
    }
    let prompt = match b.prompt_tokens {
        Some(n) => synthetic_prompt(n, cfg.vocab),
        None => {
            let p = prompt_ids(tok.as_ref(), a.prompt.as_deref(), &bos)?;
            super::check_context(p.len(), a.max_tokens, &cfg)?;
            p
        }
    };
    // Generation stops one token short of feeding the last sampled token back.
    let context = prompt.len() + a.max_tokens.saturating_sub(1);
    let policy: Policy = match b.policy.as_str() {
        "decay" => Policy::Decay {
            half_life: b.half_life,
        },
        p => p
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--policy: {e}"))?,
    };
    let t_load = std::time::Instant::now();
    // One of the two models; both run through `forward` below.
    let mut model = match b.memory_budget {
        Some(bytes) => {
            let opts = RuntimeOptions {
                budget: bytes,
                policy,
                io_threads: b.io_threads,
                direct_io: !b.buffered_io,
                warm_start: b.warm_start.clone(),
                prefetch_next: b.prefetch_next,
                kernels: a.kernels.into(),
                engram_cache: b.engram_cache,
                context: Some(context),
                prefill_chunk: b.prefill_chunk,
            };
            let m = BudgetedModel::load(&ck, &opts)
                .with_context(|| format!("loading the model from {}", dir.display()))?;
            Loaded::Budgeted(m)
        }
        None => {
            let mem = cfg.memory_estimate(context);
            check_machine(mem.total(), "this run's context").map_err(anyhow::Error::from)?;
            let mut m = Model::load(&ck)?;
            m.cfg.kernels = a.kernels.into();
            m.cfg.prefill_chunk = cfg.prefill_chunk;
            Loaded::Plain(m)
        }
    };
    let load_secs = t_load.elapsed().as_secs_f64();
    if let Some(m) = model.budgeted() {
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
            policy,
            b.io_threads,
            if st.direct_io() { "O_DIRECT" } else { "buffered reads + fadvise(DONTNEED): direct I/O unavailable or off" }
        );
    }
    let mut out = std::io::stdout().lock();
    if let (Some(p), Some(_)) = (&a.prompt, &tok) {
        write!(out, "{p}")?;
        out.flush()?;
    }
    let mut sampler = Sampler::new(SamplerConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
    });
    let mut log = b.record_routes.as_ref().map(|_| RouteLog::new());
    if let Some(l) = log.as_mut() {
        l.set_hash_layers(&(0..cfg.hash_layers).collect::<Vec<_>>());
    }
    // keep-model's generation loop; this verb prints each token (the end-of-sequence token is
    // not printed) and keeps the first output error.
    let mut text = TextOut::default();
    let mut printed: anyhow::Result<()> = Ok(());
    let stats = generate_with(
        &mut model,
        &prompt,
        a.max_tokens,
        &mut sampler,
        &eos,
        obs(&mut log),
        |t| {
            if eos.contains(&t) || printed.is_err() {
                return;
            }
            printed = match &tok {
                Some(tk) => text.push(tk, t, &mut out),
                None => write!(out, "{t} ")
                    .and_then(|_| out.flush())
                    .map_err(Into::into),
            };
        },
    )?;
    printed?;
    let (prefill_secs, steps, decode_secs) =
        (stats.prefill_secs, stats.generated, stats.decode_secs);
    let (prefill_cache, prefill_engram) = match &mut model {
        Loaded::Budgeted(m) => (m.take_prefill_stats(), m.take_prefill_engram()),
        Loaded::Plain(_) => (None, None),
    };
    writeln!(out)?;
    let decode_cache = model.budgeted().map(|m| m.cache().stats());
    let decode_engram = model.budgeted().and_then(|m| m.engram()).map(|e| e.stats());
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.2} tokens/s); decode: {} tokens in {:.3} s ({:.2} tokens/s)",
        prompt.len(),
        prefill_secs,
        rate(prompt.len(), prefill_secs),
        steps,
        decode_secs,
        rate(steps, decode_secs)
    );
    for (phase, s) in [("prefill", &prefill_cache), ("decode", &decode_cache)] {
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
    for (phase, s) in [("prefill", &prefill_engram), ("decode", &decode_engram)] {
        if let Some(s) = s {
            eprintln!(
                "{phase} engram rows: hit rate {:.1}% ({} of {} rows); read {} for {} of rows ({:.1}x, {} reads); waited {:.3} s",
                100.0 * s.hit_rate(),
                s.hits,
                s.rows_requested,
                human(s.bytes_read),
                human(s.useful_bytes),
                s.read_amplification(),
                s.reads,
                s.wait_secs
            );
        }
    }
    let peak = peak_rss_bytes();
    match (peak, b.memory_budget) {
        (Some(p), Some(budget)) => eprintln!(
            "peak resident memory: {} (budget {} + documented overhead {})",
            human(p),
            human(budget),
            human(FIXED_OVERHEAD)
        ),
        (Some(p), None) => eprintln!("peak resident memory: {}", human(p)),
        _ => {}
    }
    if let (Some(path), Some(l)) = (&b.record_routes, &log) {
        let session = format!("keep-run-{}", std::process::id());
        l.write(path, &session, cfg.n_experts, b.force)
            .with_context(|| format!("writing routes to {}", path.display()))?;
        eprintln!(
            "routes of {} tokens written to {}",
            l.tokens(),
            path.display()
        );
    }
    if let Some(path) = &b.stats_json {
        let plan = model.budgeted().map(|m| {
            let p = m.plan();
            serde_json::json!({
                "budget": p.budget, "residents": p.residents, "slot_bytes": p.slot_bytes,
                "slots_per_layer": p.slots_per_layer, "n_layers": p.n_layers,
                "n_experts": p.n_experts, "top_k": p.top_k,
                "routed_expert_bytes": m.cache().store().total_bytes(),
                "expert_bytes": m.cache().store().expert_bytes(),
                "direct_io": m.cache().store().direct_io(),
                "engram_cache_bytes": m.engram().map(|e| e.cache_bytes()),
                "context": p.memory.context, "prefill_chunk": p.memory.chunk,
                "cache_bytes": p.memory.cache, "activation_bytes": p.memory.activations,
            })
        });
        let j = serde_json::json!({
            "format": "keep-run-stats", "version": 1,
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "model": dir.display().to_string(),
            "policy": b.memory_budget.map(|_| policy.to_string()),
            "io_threads": b.io_threads,
            "plan": plan,
            "load_secs": load_secs,
            "prompt_tokens": prompt.len(), "prefill_secs": prefill_secs,
            "prefill_tps": rate(prompt.len(), prefill_secs),
            "decode_tokens": steps, "decode_secs": decode_secs,
            "decode_tps": rate(steps, decode_secs),
            "prefill_cache": prefill_cache.as_ref().map(cache_json),
            "decode_cache": decode_cache.as_ref().map(cache_json),
            "prefill_engram": prefill_engram.as_ref().map(engram_json),
            "decode_engram": decode_engram.as_ref().map(engram_json),
            "peak_rss_bytes": peak,
            "fixed_overhead_bytes": FIXED_OVERHEAD,
        });
        keep_checkpoint::atomic::write_file(
            path,
            (serde_json::to_string_pretty(&j)? + "\n").as_bytes(),
            b.force,
        )?;
    }
    Ok(())
}
