//! [`BudgetedModel`]: the DeepSeek-V4.1 model with its routed experts in a [`SlotCache`] sized
//! from a memory budget; it implements keep-model's [`Generate`], so keep-model's one
//! `generate` drives it, and it keeps the cache counters of the prompt's forward apart from the
//! decode's ([`BudgetedModel::take_prefill_stats`]; `crate::run` collects them).
//! Everything except the routed experts is the model's own (views of the mapped checkpoint);
//! the logits are bit-identical to [`Model::load`]'s because the same views of the same bytes
//! meet the same kernels — only where the bytes sit differs.
//!
//! Forwards take `&mut self`: one forward at a time drives the cache (see `cache.rs`).
//!
//! The run is planned for a context ([`RuntimeOptions::context`]): its decoding cache
//! ([`BudgetedModel::new_cache`] reserves it exactly) and one chunk's activations come out of
//! the budget, prompts run in chunks of `prefill_chunk` tokens, and a forward past the planned
//! context is refused rather than allowed to grow the cache beyond the budget.
//!
//! Hash-routed layers (DeepSeek-V4-Flash's first `num_hash_layers`) are prefetched exactly:
//! their experts are `tid2eid[token]`, so [`BudgetedModel::forward`] starts every such layer's
//! reads from the token ids before the first layer runs (the prompt's at prefill, the sampled
//! token's at each decode step); their remaining wait is reported apart
//! ([`CacheStats::hash_wait_secs`]).

use std::path::PathBuf;
use std::sync::Arc;

use keep_checkpoint::Checkpoint;
use keep_kernels::{ops, WeightView};
use keep_model::config::Scoring;
use keep_model::generate::Generate;
use keep_model::layer::top_k_by;
use keep_model::weights::{vec_f32, weight};
use keep_model::{
    Cache, EngramRows, ExpertOutputEvent, LinearInputEvent, Logits, MemoryEstimate, Model,
    ModelConfig, RouteEvent, RouteObserver,
};

use crate::budget::{check_machine, resident_bytes, BudgetPlan, EngramShare, SlotNeeds};
use crate::cache::{CacheSource, CacheStats, SlotCache};
use crate::engram::{engram_table_bytes, EngramStats, EngramStore};
use crate::io::DEFAULT_IO_THREADS;
use crate::policy::Policy;
use crate::routes::warm_scores;
use crate::store::ExpertStore;
use crate::{Result, RuntimeError};

/// How to run inside a budget.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    /// Bytes for the resident weights plus the expert slots.
    pub budget: u64,
    pub policy: Policy,
    pub io_threads: usize,
    /// Bypass the page cache (`O_DIRECT`/`F_NOCACHE`) when the filesystem allows it.
    pub direct_io: bool,
    /// Fill the slots before the run from `reap-stats.safetensors` or a route file.
    pub warm_start: Option<PathBuf>,
    /// Guess layer L+1's experts with its router applied to layer L's MoE input and read them
    /// while layer L computes (opt-in; scored in [`CacheStats::guess`]).
    pub prefetch_next: bool,
    /// Which kernels the products run on.
    pub kernels: keep_kernels::Kernels,
    /// Bytes of the Engram row cache, taken out of the budget (`None`: what the budget leaves
    /// after the residents, the context, the other caches and `top_k` slots per layer, shared
    /// with more slots and capped at the smaller of the tables and [`DEFAULT_ENGRAM_CACHE`]:
    /// [`default_engram_cache`]). A set size the budget
    /// cannot hold is refused naming it. Engram tables are never resident.
    pub engram_cache: Option<u64>,
    /// Tokens the run will hold (prompt + generated); its decoding cache and one forward pass's
    /// activations come out of the budget and forwards past it are refused. `None`: the
    /// model's whole context (`max_position_embeddings`).
    pub context: Option<usize>,
    /// Tokens per forward pass of a long prompt (`None`: keep-model's
    /// [`DEFAULT_PREFILL_CHUNK`](keep_model::DEFAULT_PREFILL_CHUNK)).
    pub prefill_chunk: Option<usize>,
    /// Precision tiers (`None`: every expert at its stored rung, residual stages included).
    pub tiers: Option<TierOptions>,
    /// Tokens drafted per verify forward the run plans for (0: no drafting). When the
    /// checkpoint has an MTP module, the budget then also holds the module (its tensors,
    /// experts included, are mapped whole: [`draft_bytes`]) and the snapshot of the decoding
    /// cache each verify forward takes.
    pub draft_tokens: usize,
}

/// Bytes drafting adds to a budgeted run of `ck` planned with `memory`: the drafter's tensors
/// (the MTP module's `mtp.0.*`, or every DSpark stage's `mtp.*`; mapped and read on every
/// draft) plus one copy of the decoding cache (the snapshot a verify forward restores when a
/// draft is rejected). 0 without a drafter.
pub fn draft_bytes(ck: &Checkpoint, memory: &MemoryEstimate) -> u64 {
    let prefix = if keep_model::dspark::present(ck) {
        "mtp."
    } else if keep_model::mtp::present(ck) {
        keep_model::mtp::PREFIX
    } else {
        return 0;
    };
    let mtp: u64 = ck
        .tensors()
        .filter(|t| t.name.starts_with(prefix))
        .map(|t| t.bytes.len() as u64)
        .sum();
    mtp.saturating_add(memory.cache)
}

/// Precision tiers at run time: each routed expert's base — its allocated rung — in the slots,
/// its upper stage (keep-residency's [`upper_stage`](keep_residency::tiers::upper_stage): the
/// residual codes the checkpoint carries above an `e8p2` base, or with
/// [`TierOptions::upper_from`] the shipped expert of the original checkpoint above the top
/// quantized rung) read apart from SSD by the residual reader threads into an LRU residual
/// cache whose bytes come out of the budget; a routed slot with gate weight ≥ `tau` is computed
/// at the upper rung only if the stage is in memory, else at the base now with the stage's read
/// queued (never waited for).
#[derive(Debug, Clone, PartialEq)]
pub struct TierOptions {
    pub tau: f32,
    /// The allocation the checkpoint holds (`None`: every E8P expert at its `e8p2` base, the
    /// residual codes it carries its upper stage). An expert allocated `e8p2+e81` or
    /// `e8p2+e8p2` keeps its residual in its slot; its upper stage is its shipped expert with
    /// `upper_from`, else it has none.
    pub alloc: Option<std::sync::Arc<keep_artifacts::alloc::Alloc>>,
    /// The original checkpoint (the one the allocation was made for and the checkpoint was
    /// quantized from): experts at the top quantized rung (`e8p2+e81`, `e8p2+e8p2`), and `e8p2`
    /// ones without residual codes, have its expert as their upper stage (a pruned checkpoint's
    /// expert: the original expert the allocation's survivors map it to). Checked: the
    /// allocation's fingerprint, the family, the shapes and each layer's expert count.
    pub upper_from: Option<PathBuf>,
    /// Bytes of the residual cache.
    pub residual_cache: u64,
    /// Threads reading residual stages (apart from the slots' readers).
    pub io_threads: usize,
}

/// Default residual reader threads: background reads, a few in flight are enough.
pub const DEFAULT_RESIDUAL_IO_THREADS: usize = 2;

/// Default Engram row cache: 256 MiB holds V4.1-Flash's rows (2 × 24 × 264 bytes a token) for
/// about 20,000 distinct tokens.
pub const DEFAULT_ENGRAM_CACHE: u64 = 256 << 20;

/// Without `--memory-budget`, Engram tables larger than this are still never mapped: their
/// rows are read from the shards into a row cache, as under a budget. Mapped, a table read a
/// few scattered rows a token fills the page cache with 4 KiB pages of which ~264 bytes are
/// used, and on a model whose tables exceed memory that is what evicts the weights.
pub const ENGRAM_SSD_THRESHOLD: u64 = 2 << 30;

/// Serve `model`'s Engram rows from `ck`'s shards through an [`EngramStore`] (page-aligned
/// reads into an LRU row cache of `cache_bytes`) instead of its mapped tables. `None` (and no
/// change) for a model without Engram layers.
pub fn engram_rows_from_store(
    model: &mut Model<'_>,
    ck: &Checkpoint,
    cache_bytes: u64,
    direct_io: bool,
    io_threads: usize,
) -> Result<Option<Arc<EngramStore>>> {
    let (Some(layout), Some(e)) = (model.cfg.engram.as_ref(), model.engram.as_mut()) else {
        return Ok(None);
    };
    let store = Arc::new(EngramStore::open(
        ck,
        layout,
        cache_bytes,
        direct_io,
        io_threads,
    )?);
    e.rows = Box::new(StoreRows(store.clone()));
    Ok(Some(store))
}

/// The rule for a run without a budget: tables above `threshold` bytes (normally
/// [`ENGRAM_SSD_THRESHOLD`]) are read through a store with the default row cache; smaller ones
/// stay mapped (`None`).
pub fn engram_rows_above(
    model: &mut Model<'_>,
    ck: &Checkpoint,
    threshold: u64,
) -> Result<Option<Arc<EngramStore>>> {
    let bytes = engram_table_bytes(ck);
    if model.engram.is_none() || bytes <= threshold {
        return Ok(None);
    }
    engram_rows_from_store(
        model,
        ck,
        bytes.min(DEFAULT_ENGRAM_CACHE),
        true,
        DEFAULT_IO_THREADS,
    )
}

impl RuntimeOptions {
    /// The model's run options under this budget: its kernels and its prefill chunk (the
    /// default where none is set); a chunk of 0 is refused.
    pub fn run_options(&self) -> Result<keep_model::RunOptions> {
        let mut run = keep_model::RunOptions::with_kernels(self.kernels);
        if let Some(c) = self.prefill_chunk {
            if c == 0 {
                return Err(RuntimeError::Invalid(
                    "the prefill chunk must be at least 1 token".into(),
                ));
            }
            run.prefill_chunk = c;
        }
        Ok(run)
    }

    /// Defaults (LRU, [`DEFAULT_IO_THREADS`], direct I/O, no warm start) for `budget`.
    pub fn new(budget: u64) -> RuntimeOptions {
        RuntimeOptions {
            budget,
            policy: Policy::Lru,
            io_threads: DEFAULT_IO_THREADS,
            direct_io: true,
            warm_start: None,
            prefetch_next: false,
            kernels: keep_kernels::Kernels::Exact,
            engram_cache: None,
            context: None,
            prefill_chunk: None,
            tiers: None,
            draft_tokens: 0,
        }
    }
}

/// keep-model's row source over the shared [`EngramStore`].
struct StoreRows(Arc<EngramStore>);

impl EngramRows for StoreRows {
    fn rows(&self, slot: usize, ids: &[u64], out: &mut [f32]) -> keep_model::Result<()> {
        self.0.rows(slot, ids, out)
    }
    fn prefetch(&self, slot: usize, ids: &[u64]) {
        self.0.prefetch(slot, ids)
    }
}

/// The model with its routed experts in budgeted slots.
pub struct BudgetedModel<'a> {
    model: Model<'a>,
    cache: Arc<SlotCache>,
    engram: Option<Arc<EngramStore>>,
    plan: BudgetPlan,
    policy: Policy,
    /// Router weight and bias per layer, for next-layer guesses (empty when off).
    gates: Vec<(WeightView<'a>, Vec<f32>)>,
    /// The cache counters of the last prompt's forward ([`Generate::prefilled`]).
    prefill_stats: Option<Box<CacheStats>>,
    /// The Engram row counters of the last prompt's forward.
    prefill_engram: Option<EngramStats>,
}

impl BudgetedModel<'_> {
    /// Refuse a forward that would run past the planned context.
    fn check_planned(&self, cache: &Cache, t: usize) -> keep_model::Result<()> {
        let planned = self.plan.memory.context;
        match cache.pos.checked_add(t) {
            Some(end) if end <= planned => Ok(()),
            _ => Err(keep_model::ModelError::Context(format!(
                "{t} tokens after position {} run past the {planned} tokens this run's memory \
                 budget was planned for (RuntimeOptions::context)",
                cache.pos
            ))),
        }
    }
}

/// The observer that turns layer L's router input into a guess of layer L+1's experts, passing
/// every event on to the caller's observer.
struct Guesser<'g, 'a, 'o> {
    inner: Option<&'o mut dyn RouteObserver>,
    gates: &'g [(WeightView<'a>, Vec<f32>)],
    cfg: &'g ModelConfig,
    cache: &'g SlotCache,
}

impl Guesser<'_, '_, '_> {
    fn guess(&self, layer: usize, x: &[f32], rows: usize) -> Option<Vec<usize>> {
        let (gate, bias) = self.gates.get(layer)?;
        if self.cfg.is_hash(layer) {
            return None;
        }
        let (e, k) = (self.cfg.experts_in_layer(layer), self.cfg.top_k);
        let mut logits = vec![0f32; rows * e];
        keep_kernels::matmul(x, rows, gate, &mut logits).ok()?;
        let mut out: Vec<usize> = vec![];
        let mut cand: Vec<(f32, usize)> = Vec::with_capacity(e);
        for row in logits.chunks_exact_mut(e) {
            row.iter_mut().for_each(|v| *v /= self.cfg.gate_temp);
            match self.cfg.scoring {
                Scoring::Sigmoid => row.iter_mut().for_each(|v| *v = ops::sigmoid(*v)),
                Scoring::SqrtSoftplus => row.iter_mut().for_each(|v| *v = ops::softplus(*v).sqrt()),
                Scoring::Softmax => ops::softmax(row),
            }
            cand.clear();
            cand.extend(
                row.iter()
                    .zip(bias)
                    .enumerate()
                    .map(|(j, (s, b))| (s + b, j)),
            );
            top_k_by(&mut cand, k);
            for &(_, j) in &cand[..k.min(cand.len())] {
                if !out.contains(&j) {
                    out.push(j);
                }
            }
        }
        out.truncate(self.cache.slots_per_layer());
        Some(out)
    }
}

impl RouteObserver for Guesser<'_, '_, '_> {
    fn wants_expert_outputs(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|o| o.wants_expert_outputs())
    }
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        if let Some(o) = self.inner.as_deref_mut() {
            o.on_route(ev);
        }
    }
    fn on_expert_output(&mut self, ev: &ExpertOutputEvent) {
        if let Some(o) = self.inner.as_deref_mut() {
            o.on_expert_output(ev);
        }
    }
    fn on_rungs(&mut self, ev: &keep_model::RungEvent) {
        if let Some(o) = self.inner.as_deref_mut() {
            o.on_rungs(ev);
        }
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        if ev.name == "ffn.gate" && ev.layer + 1 < self.cfg.n_layers {
            if let Some(g) = self.guess(ev.layer + 1, ev.x, ev.rows) {
                self.cache.set_next_guess(ev.layer + 1, g);
            }
        }
        if let Some(o) = self.inner.as_deref_mut() {
            if o.wants_linear_inputs() {
                o.on_linear_input(ev);
            }
        }
    }
}

/// The expert store of a run with precision tiers: each expert's upper stage by keep-residency's
/// rule ([`upper_stages`](keep_residency::tiers::upper_stages)) — residual codes read apart
/// from the base, and with [`TierOptions::upper_from`] shipped experts of the original
/// checkpoint ([`ExpertStore::attach_shipped`]).
fn tiered_store(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    t: &TierOptions,
    direct_io: bool,
) -> Result<ExpertStore> {
    use keep_residency::tiers::{original_ids, residual_bytes_of, upper_stages, UpperStage};
    let invalid = |e: keep_residency::ResidencyError| RuntimeError::Invalid(e.to_string());
    let alloc = t.alloc.as_deref();
    let layers: Vec<usize> = (0..cfg.n_layers).collect();
    let residual = residual_bytes_of(ck, &layers).map_err(invalid)?;
    let original = match &t.upper_from {
        Some(dir) => Some(open_original(dir, cfg, alloc, &layers, direct_io)?),
        None => None,
    };
    let stages = upper_stages(
        alloc,
        &layers,
        &residual,
        original.as_ref().map(|o| o.1.as_slice()),
    )
    .map_err(invalid)?;
    let apart: Vec<Vec<bool>> = stages
        .iter()
        .map(|v| v.iter().map(|s| s.0 == UpperStage::Residual).collect())
        .collect();
    let mut store = ExpertStore::open_tiered(ck, cfg, direct_io, &apart)?;
    if let Some((orig, _)) = original {
        let ids: Vec<Vec<Option<usize>>> = stages
            .iter()
            .zip(&layers)
            .map(|(v, &l)| {
                let o = original_ids(alloc, l, v.len());
                v.iter()
                    .zip(o)
                    .map(|(s, o)| (s.0 == UpperStage::Shipped).then_some(o))
                    .collect()
            })
            .collect();
        store.attach_shipped(orig, &ids)?;
    }
    Ok(store)
}

/// The original checkpoint at `dir` for the shipped upper stages of a checkpoint of `cfg` under
/// `alloc`: its routed experts and the bytes of each (keep-residency's
/// [`shipped_bytes_of`](keep_residency::tiers::shipped_bytes_of)), after checking that it is
/// the checkpoint the allocation was made for (its fingerprint) and that it has this model's
/// family, shapes and, per layer, the experts the allocation lists (or the checkpoint holds).
fn open_original(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    alloc: Option<&keep_artifacts::alloc::Alloc>,
    layers: &[usize],
    direct_io: bool,
) -> Result<(ExpertStore, Vec<Vec<u64>>)> {
    let (ock, ocfg, bytes) = check_original(dir, cfg, alloc, layers)?;
    let store = ExpertStore::open(&ock, &ocfg, direct_io)?;
    Ok((store, bytes))
}

/// The checks `keep run --upper-from` makes of the original checkpoint at `dir` before
/// anything is read (also `keep residency --upper-from`'s): the checkpoint the allocation was
/// made for (its fingerprint), this model's family and shapes, and per layer the experts the
/// allocation lists (or `cfg`'s checkpoint holds). Returns it open, its config and the bytes
/// of each of its routed experts in `layers`.
pub fn check_original(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    alloc: Option<&keep_artifacts::alloc::Alloc>,
    layers: &[usize],
) -> Result<(Checkpoint, ModelConfig, Vec<Vec<u64>>)> {
    let bad = |msg: String| {
        RuntimeError::Invalid(format!(
            "the original checkpoint {} (--upper-from): {msg}",
            dir.display()
        ))
    };
    if let Some(a) = alloc {
        let fp = keep_checkpoint::fingerprint::model_fingerprint(dir)?;
        if fp != a.model_fingerprint {
            return Err(bad(format!(
                "its fingerprint is {fp}, the allocation's model {} has {}: give the checkpoint the allocation was made for (keep alloc's MODEL)",
                a.model, a.model_fingerprint
            )));
        }
    }
    let ock = Checkpoint::open(dir)?;
    let ocfg = ModelConfig::from_checkpoint(&ock)?;
    let differs = |what: &str, o: String, q: String| {
        bad(format!(
            "its {what} is {o}, this checkpoint's {q}: give the checkpoint this one was quantized from"
        ))
    };
    if ocfg.family != cfg.family {
        return Err(differs(
            "model family",
            format!("{:?}", ocfg.family),
            format!("{:?}", cfg.family),
        ));
    }
    for (what, o, q) in [
        ("hidden size", ocfg.dim, cfg.dim),
        (
            "expert width (moe_intermediate_size)",
            ocfg.inter,
            cfg.inter,
        ),
        ("layer count", ocfg.n_layers, cfg.n_layers),
    ] {
        if o != q {
            return Err(differs(what, o.to_string(), q.to_string()));
        }
    }
    for &l in layers {
        let have = ocfg.experts_in_layer(l);
        let (want, by) = match alloc.and_then(|a| a.layers.iter().find(|x| x.layer == l)) {
            Some(la) => (la.rungs.len(), "the allocation lists"),
            None => (cfg.experts_in_layer(l), "this checkpoint has"),
        };
        if have != want {
            return Err(bad(format!(
                "layer {l} has {have} routed experts, {by} {want}: give the checkpoint this one was quantized from"
            )));
        }
    }
    let bytes =
        keep_residency::tiers::shipped_bytes_of(&ock, layers).map_err(|e| bad(e.to_string()))?;
    Ok((ock, ocfg, bytes))
}

/// The context a budgeted run plans for (the model's whole context when unset; refused past
/// it), and its decoding cache and one pass's activations.
fn planned_memory(cfg: &ModelConfig, opts: &RuntimeOptions) -> Result<MemoryEstimate> {
    let run = opts.run_options()?;
    let limit = cfg.raw.max_position_embeddings;
    let context = opts.context.unwrap_or(limit);
    if context == 0 || context > limit {
        return Err(RuntimeError::Invalid(format!(
            "a context of {context} tokens: the model holds 1 to {limit} \
             (max_position_embeddings)"
        )));
    }
    Ok(cfg.memory_estimate(context, run.prefill_chunk))
}

/// The expert store of a budgeted run: tiered with precision tiers.
fn open_store(ck: &Checkpoint, cfg: &ModelConfig, opts: &RuntimeOptions) -> Result<ExpertStore> {
    match &opts.tiers {
        Some(t) => tiered_store(ck, cfg, t, opts.direct_io),
        None => ExpertStore::open(ck, cfg, opts.direct_io),
    }
}

/// What a run of `ck` with `store` under `opts` holds besides its slots (see
/// [`BudgetedModel::slot_needs`]).
fn slot_needs(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    store: &ExpertStore,
    opts: &RuntimeOptions,
    memory: MemoryEstimate,
) -> SlotNeeds {
    let engram = match (&cfg.engram, opts.engram_cache) {
        (None, _) => EngramShare::None,
        (Some(_), Some(set)) => EngramShare::Set(set),
        (Some(layout), None) => EngramShare::Default {
            cap: engram_table_bytes(ck).min(DEFAULT_ENGRAM_CACHE),
            row_bytes: crate::engram::row_bytes(layout.head_dim) as u64,
        },
    };
    SlotNeeds {
        weights: resident_bytes(ck),
        residual_cache: opts.tiers.as_ref().map_or(0, |t| t.residual_cache),
        drafting: if opts.draft_tokens > 0 {
            draft_bytes(ck, &memory)
        } else {
            0
        },
        engram,
        memory,
        slot_bytes: store.slot_bytes(),
        n_layers: cfg.n_layers,
        top_k: cfg.top_k,
        n_experts: cfg.n_experts,
    }
}

impl<'a> BudgetedModel<'a> {
    /// What a run of `ck` under `opts` holds besides its expert slots, and the slots' shape
    /// (the expert store opened as the run opens it, nothing read): what
    /// [`SlotNeeds::plan`] splits a budget with, here and in `keep fit`'s predictions.
    pub fn slot_needs(ck: &Checkpoint, opts: &RuntimeOptions) -> Result<SlotNeeds> {
        let cfg = ModelConfig::from_checkpoint(ck)?;
        let memory = planned_memory(&cfg, opts)?;
        let store = open_store(ck, &cfg, opts)?;
        Ok(slot_needs(ck, &cfg, &store, opts, memory))
    }

    /// Plan the budget, allocate the slots, optionally warm them, and load the model.
    pub fn load(ck: &'a Checkpoint, opts: &RuntimeOptions) -> Result<BudgetedModel<'a>> {
        let cfg = ModelConfig::from_checkpoint(ck)?;
        let run = opts.run_options()?;
        let memory = planned_memory(&cfg, opts)?;
        let store = open_store(ck, &cfg, opts)?;
        let plan = slot_needs(ck, &cfg, &store, opts, memory).plan(opts.budget)?;
        let engram_cache = plan.engram_cache;
        check_machine(plan.planned(), "this budgeted run")?;
        let cache = Arc::new(SlotCache::with_tiers(
            store,
            plan.slots_per_layer,
            opts.policy,
            opts.io_threads,
            opts.tiers
                .as_ref()
                .map(|t| (t.tau, t.residual_cache, t.io_threads)),
        )?);
        if let Some(p) = &opts.warm_start {
            let scores = warm_scores(p, cfg.n_layers, cfg.n_experts)?;
            cache.warm(&scores)?;
        }
        let mut gates = vec![];
        if opts.prefetch_next {
            let hint = cfg.raw.weight_block_size();
            for l in 0..cfg.n_layers {
                let p = format!("layers.{l}.ffn.gate");
                // Hash-routed layers need no guess (their experts are exact); an empty bias
                // marks them.
                let e = cfg.experts_in_layer(l);
                let bias = if cfg.is_hash(l) {
                    vec![]
                } else {
                    vec_f32(ck, &format!("{p}.bias"), e)?
                };
                gates.push((weight(ck, &p, e, cfg.dim, hint)?, bias));
            }
        }
        cache.set_hash_layers(&(0..cfg.hash_layers).collect::<Vec<_>>());
        let mut model =
            Model::load_with(ck, cfg, Box::new(CacheSource(cache.clone())))?.with_options(run);
        let engram = engram_rows_from_store(
            &mut model,
            ck,
            engram_cache,
            opts.direct_io,
            opts.io_threads,
        )?;
        Ok(BudgetedModel {
            model,
            cache,
            engram,
            plan,
            policy: opts.policy,
            gates,
            prefill_stats: None,
            prefill_engram: None,
        })
    }

    /// The model's config.
    pub fn cfg(&self) -> &ModelConfig {
        &self.model.cfg
    }

    /// How the budget was split.
    pub fn plan(&self) -> &BudgetPlan {
        &self.plan
    }

    /// The slot replacement policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The slot cache (counters, residency).
    pub fn cache(&self) -> &SlotCache {
        &self.cache
    }

    /// The Engram row store (`None` without Engram layers).
    pub fn engram(&self) -> Option<&EngramStore> {
        self.engram.as_deref()
    }

    /// An empty KV cache, reserved for the planned context (it never grows past it).
    pub fn new_cache(&self) -> Cache {
        Cache::for_context(
            &self.model.cfg,
            self.plan.memory.context,
            self.model.opts.chunk(),
        )
    }

    /// [`Model::forward`] with the experts from the slots.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        Ok(self.forward_chunks(tokens, cache, which, obs)?)
    }

    /// The forward in chunks of `prefill_chunk` tokens (the model's own chunking, with each
    /// chunk's hash-routed experts prefetched just before it, so a long prompt never asks for
    /// more of them at once than one chunk routes to).
    fn forward_chunks(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        mut obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        self.check_planned(cache, tokens.len())?;
        let chunk = self.model.opts.chunk();
        keep_model::model::run_chunked(tokens, chunk, which, |part, w| {
            self.prefetch_hash_layers(part);
            self.model_forward(
                part,
                cache,
                w,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
            )
        })
    }

    fn model_forward(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        if self.gates.is_empty() {
            return self.model.forward_drafting(tokens, cache, which, obs);
        }
        if self.model.draft_tokens() > 0 {
            // The drafter is fed by a forward that needs the model mutably: the guesser
            // reads a copy of the config.
            let cfg = self.model.cfg.clone();
            let mut g = Guesser {
                inner: obs,
                gates: &self.gates,
                cfg: &cfg,
                cache: &self.cache,
            };
            return self
                .model
                .forward_drafting(tokens, cache, which, Some(&mut g));
        }
        let mut g = Guesser {
            inner: obs,
            gates: &self.gates,
            cfg: &self.model.cfg,
            cache: &self.cache,
        };
        self.model.forward(tokens, cache, which, Some(&mut g))
    }

    /// Attach the MTP drafter of `ck` (K drafts per verify forward); `false` when the
    /// checkpoint has none. Its experts are the module's own, mapped (not the slots).
    pub fn attach_mtp(&mut self, ck: &'a Checkpoint, k: usize) -> Result<bool> {
        Ok(self.model.attach_mtp(ck, k)?)
    }

    /// Attach the DSpark drafter of `ck` (K drafts verified per forward); `false` when the
    /// checkpoint has none. Its experts are the drafter's own, mapped (not the slots).
    pub fn attach_dspark(&mut self, ck: &'a Checkpoint, k: usize) -> Result<bool> {
        Ok(self.model.attach_dspark(ck, k)?)
    }

    /// The model the slots serve (drafters attach to it).
    pub(crate) fn model_mut(&mut self) -> &mut Model<'a> {
        &mut self.model
    }

    /// Let generation switch drafting off and on by its running estimate (`--draft auto`).
    pub fn set_mtp_auto(&mut self, auto: bool) {
        self.model.set_mtp_auto(auto);
    }

    /// Start the reads of every hash-routed layer's experts for `tokens` (their union per
    /// layer, ascending: exactly what the layer's MoE will ask for).
    fn prefetch_hash_layers(&self, tokens: &[u32]) {
        let cfg = &self.model.cfg;
        for lw in self.model.layers.iter().take(cfg.hash_layers) {
            let Some(table) = &lw.hash else { continue };
            let n = cfg.experts_in_layer(lw.layer);
            let mut used = vec![false; n];
            for &t in tokens {
                match table.experts(t) {
                    Some(ids) => ids.iter().for_each(|&j| used[j as usize] = true),
                    // Out of the vocabulary: the forward refuses it; prefetch nothing.
                    None => return,
                }
            }
            let experts: Vec<usize> = (0..n).filter(|&j| used[j]).collect();
            self.cache.prefetch_exact(lw.layer, &experts);
        }
    }

    /// The cache counters of the last prompt's forward under keep-model's generation loop
    /// (taken; the counters were zeroed after it).
    pub fn take_prefill_stats(&mut self) -> Option<CacheStats> {
        self.prefill_stats.take().map(|s| *s)
    }

    /// The Engram row counters of the last prompt's forward under keep-model's generation loop
    /// (taken; the counters were zeroed after it). `None` without Engram layers.
    pub fn take_prefill_engram(&mut self) -> Option<EngramStats> {
        self.prefill_engram.take()
    }
}

impl Generate for BudgetedModel<'_> {
    fn cfg(&self) -> &ModelConfig {
        &self.model.cfg
    }
    fn new_cache(&self) -> Cache {
        BudgetedModel::new_cache(self)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        self.forward_chunks(tokens, cache, Logits::Last, obs)
    }
    /// One batched step: the batch's expert union goes through the slot cache (each layer
    /// asks for the experts any of its rows routes to); hash-routed layers are prefetched for
    /// all the batch's tokens first.
    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> keep_model::Result<Vec<f32>> {
        for c in caches.iter() {
            self.check_planned(c, 1)?;
        }
        self.prefetch_hash_layers(tokens);
        self.model.forward_batch(tokens, caches)
    }
    fn draft_tokens(&self) -> usize {
        self.model.draft_tokens()
    }
    fn draft_auto(&self) -> bool {
        self.model.mtp_auto()
    }
    fn stop_drafting(&mut self) {
        self.model.detach_mtp();
    }
    fn pause_drafting(&mut self, paused: bool) {
        self.model.pause_drafting(paused);
    }
    fn draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> keep_model::Result<Vec<(u32, Vec<f32>)>> {
        self.model.draft(last, k, pick)
    }
    /// The verify window (K + 1 rows) in one forward through the slots: each layer asks the
    /// cache for the union of the experts its rows route to; hash-routed layers are
    /// prefetched for all the window's tokens first.
    fn forward_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        self.check_planned(cache, tokens.len())?;
        self.prefetch_hash_layers(tokens);
        self.model.forward_verify(tokens, cache, obs)
    }
    fn accept_drafts(&mut self, cache: &mut Cache, keep: usize) -> keep_model::Result<()> {
        self.model.accept_drafts(cache, keep)
    }
    /// Zero the counters, so that the prompt's forward is counted alone.
    fn starting(&mut self) {
        self.cache.reset_stats();
        self.prefill_stats = None;
        self.prefill_engram = None;
        if let Some(e) = &self.engram {
            e.reset_stats();
        }
    }
    fn prefilled(&mut self) {
        self.prefill_stats = Some(Box::new(self.cache.stats()));
        self.cache.reset_stats();
        self.prefill_engram = self.engram.as_ref().map(|e| {
            let s = e.stats();
            e.reset_stats();
            s
        });
    }
}

/// Peak resident set size of this process (`VmHWM` of `/proc/self/status`), in bytes; `None`
/// where there is no procfs.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|k| k * 1024)
}

/// MemAvailable from /proc/meminfo, in bytes.
pub fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Current resident set size (`VmRSS`), in bytes.
pub fn rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:").map(|k| k * 1024)
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Reset the peak RSS to the current RSS (writes `5` to `/proc/self/clear_refs`, Linux ≥ 4.0).
/// Returns whether it worked.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}
