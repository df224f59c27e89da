//! One `keep run`: the model it drives ([`RunModel`]: whole and mapped, or under a memory budget),
//! keep-model's one [`generate`] over it with the optional route recorder, and what the run
//! measured ([`RunReport`]: prefill and decode timings, the expert cache's and the Engram row
//! cache's counters per phase, peak resident memory), which becomes the `keep-run-stats` file
//! of keep-artifacts ([`RunReport::stats`]). It never prints; keep-cli prints the report.

use std::ops::ControlFlow;
use std::time::Instant;

use keep_artifacts::run_stats::{
    self, CacheCounters, DraftNumbers, EngramCounters, GuessCounters, HashLayerCounters,
    PlanNumbers, ProfileNumbers, ProfileStep, RunStats, TierCounters,
};
use keep_checkpoint::Checkpoint;
use keep_kernels::profile;
use keep_model::generate::{generate, GenStats, Generate, GenerateOptions, Piece, Prompt};
use keep_model::{Cache, Model, ModelConfig, RouteObserver, RunOptions};

use crate::budget::FIXED_OVERHEAD;
use crate::cache::CacheStats;
use std::sync::Arc;

use crate::engram::{EngramStats, EngramStore};
use crate::routes::RouteLog;
use crate::runtime::{
    engram_rows_above, peak_rss_bytes, BudgetedModel, RuntimeOptions, ENGRAM_SSD_THRESHOLD,
};
use crate::Result;

/// The model a run drives: plainly mapped, or with its routed experts in budgeted slots.
pub enum RunModel<'a> {
    /// Mapped whole; Engram tables above [`ENGRAM_SSD_THRESHOLD`] still read row by row
    /// through a store (`Some`).
    Mapped(Model<'a>, Option<MappedEngram>),
    Budgeted(BudgetedModel<'a>),
}

/// The Engram row store of a mapped run and its prefill counters.
pub struct MappedEngram {
    pub store: Arc<EngramStore>,
    prefill: Option<EngramStats>,
}

impl<'a> RunModel<'a> {
    /// Load the model of `ck`: under `budget` when given (its `kernels` and `prefill_chunk` are
    /// used), else mapped whole with `kernels` and the default prefill chunk.
    pub fn load(
        ck: &'a Checkpoint,
        kernels: keep_kernels::Kernels,
        budget: Option<&RuntimeOptions>,
    ) -> Result<RunModel<'a>> {
        RunModel::load_opts(ck, RunOptions::with_kernels(kernels), budget)
    }

    /// [`RunModel::load`] mapped whole with `opts` (under a budget, the budget's kernels and
    /// chunk are used: [`RuntimeOptions::run_options`]).
    pub fn load_opts(
        ck: &'a Checkpoint,
        opts: RunOptions,
        budget: Option<&RuntimeOptions>,
    ) -> Result<RunModel<'a>> {
        Ok(match budget {
            Some(b) => RunModel::Budgeted(BudgetedModel::load(ck, b)?),
            None => {
                populate_if_it_fits(ck);
                let mut m = Model::load_opts(ck, opts)?;
                let engram = engram_rows_above(&mut m, ck, ENGRAM_SSD_THRESHOLD)?.map(|store| {
                    MappedEngram {
                        store,
                        prefill: None,
                    }
                });
                RunModel::Mapped(m, engram)
            }
        })
    }

    /// The model's config.
    pub fn cfg(&self) -> &ModelConfig {
        match self {
            RunModel::Mapped(m, _) => &m.cfg,
            RunModel::Budgeted(m) => m.cfg(),
        }
    }

    /// Turn speculative decoding on or off for `mode` with `k` drafts per verify forward: the
    /// drafts per verify forward in use (0: off). `Mtp` is refused when the checkpoint has no
    /// MTP module; `Auto` drafts when it has one and lets generation switch drafting off and
    /// on by its running estimate of whether it pays. Under a memory budget the verify
    /// window's experts go through the slots (plan the budget with
    /// [`RuntimeOptions::draft_tokens`] so that it holds the module and the cache snapshot).
    pub fn set_draft(&mut self, ck: &'a Checkpoint, mode: DraftMode, k: usize) -> Result<usize> {
        if mode == DraftMode::None {
            return Ok(0);
        }
        let dspark = keep_model::dspark::present(ck);
        let use_dspark = match mode {
            DraftMode::DSpark if !dspark => {
                return Err(crate::RuntimeError::Model(keep_model::ModelError::Config(
                    "the checkpoint has no DSpark drafter (dspark_* config keys and \
                     mtp.0.main_proj.weight) to draft with; use --draft mtp or none"
                        .into(),
                )))
            }
            DraftMode::DSpark => true,
            DraftMode::Auto => dspark,
            _ => false,
        };
        let has = use_dspark || keep_model::mtp::present(ck);
        let model = match self {
            RunModel::Mapped(m, _) => m,
            RunModel::Budgeted(m) => m.model_mut(),
        };
        match () {
            _ if has => {
                if use_dspark {
                    model.attach_dspark(ck, k)?;
                } else {
                    model.attach_mtp(ck, k)?;
                }
                model.set_mtp_auto(mode == DraftMode::Auto);
                Ok(model.draft_tokens())
            }
            _ if mode == DraftMode::Auto => Ok(0),
            _ => Err(crate::RuntimeError::Model(keep_model::ModelError::Config(
                "the checkpoint has no MTP module (mtp.0.*) to draft with".into(),
            ))),
        }
    }

    /// Verify only the DSpark drafts whose predicted chance of all being accepted is at least
    /// `p` ([`Model::set_dspark_confidence`]); no effect without a DSpark drafter.
    pub fn set_dspark_confidence(&mut self, p: Option<f32>) {
        match self {
            RunModel::Mapped(m, _) => m.set_dspark_confidence(p),
            RunModel::Budgeted(m) => m.model_mut().set_dspark_confidence(p),
        }
    }

    /// The budgeted model, if this run has a budget.
    pub fn budgeted(&self) -> Option<&BudgetedModel<'a>> {
        match self {
            RunModel::Budgeted(m) => Some(m),
            RunModel::Mapped(..) => None,
        }
    }
}

impl Generate for RunModel<'_> {
    fn cfg(&self) -> &ModelConfig {
        RunModel::cfg(self)
    }
    fn new_cache(&self) -> Cache {
        match self {
            RunModel::Mapped(m, _) => m.new_cache(),
            RunModel::Budgeted(m) => m.new_cache(),
        }
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        match self {
            RunModel::Mapped(m, _) => m.forward_last(tokens, cache, obs),
            RunModel::Budgeted(m) => m.forward_last(tokens, cache, obs),
        }
    }
    fn forward_last_into(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
        logits: &mut Vec<f32>,
    ) -> keep_model::Result<()> {
        match self {
            RunModel::Mapped(m, _) => Generate::forward_last_into(m, tokens, cache, obs, logits),
            RunModel::Budgeted(m) => Generate::forward_last_into(m, tokens, cache, obs, logits),
        }
    }
    fn new_cache_for(&self, context: usize) -> Cache {
        match self {
            RunModel::Mapped(m, _) => Generate::new_cache_for(m, context),
            RunModel::Budgeted(m) => Generate::new_cache_for(m, context),
        }
    }
    fn draft_tokens(&self) -> usize {
        match self {
            RunModel::Mapped(m, _) => m.draft_tokens(),
            RunModel::Budgeted(m) => Generate::draft_tokens(m),
        }
    }
    fn draft_auto(&self) -> bool {
        match self {
            RunModel::Mapped(m, _) => m.mtp_auto(),
            RunModel::Budgeted(m) => m.draft_auto(),
        }
    }
    fn stop_drafting(&mut self) {
        match self {
            RunModel::Mapped(m, _) => m.detach_mtp(),
            RunModel::Budgeted(m) => m.stop_drafting(),
        }
    }
    fn pause_drafting(&mut self, paused: bool) {
        match self {
            RunModel::Mapped(m, _) => m.pause_drafting(paused),
            RunModel::Budgeted(m) => m.pause_drafting(paused),
        }
    }
    fn draft(
        &mut self,
        last: u32,
        k: usize,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> keep_model::Result<Vec<(u32, Vec<f32>)>> {
        match self {
            RunModel::Mapped(m, _) => m.draft(last, k, pick),
            RunModel::Budgeted(m) => m.draft(last, k, pick),
        }
    }
    fn forward_verify(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        match self {
            RunModel::Mapped(m, _) => m.forward_verify(tokens, cache, obs),
            RunModel::Budgeted(m) => m.forward_verify(tokens, cache, obs),
        }
    }
    fn accept_drafts(&mut self, cache: &mut Cache, keep: usize) -> keep_model::Result<()> {
        match self {
            RunModel::Mapped(m, _) => m.accept_drafts(cache, keep),
            RunModel::Budgeted(m) => m.accept_drafts(cache, keep),
        }
    }
    fn forward_batch(
        &mut self,
        tokens: &[u32],
        caches: &mut [&mut Cache],
    ) -> keep_model::Result<Vec<f32>> {
        match self {
            RunModel::Mapped(m, _) => m.forward_batch(tokens, caches),
            RunModel::Budgeted(m) => m.forward_batch(tokens, caches),
        }
    }
    fn starting(&mut self) {
        match self {
            RunModel::Budgeted(m) => m.starting(),
            RunModel::Mapped(_, Some(e)) => {
                e.store.reset_stats();
                e.prefill = None;
            }
            RunModel::Mapped(_, None) => {}
        }
    }
    fn prefilled(&mut self) {
        match self {
            RunModel::Budgeted(m) => m.prefilled(),
            RunModel::Mapped(_, Some(e)) => {
                e.prefill = Some(e.store.stats());
                e.store.reset_stats();
            }
            RunModel::Mapped(_, None) => {}
        }
    }
}

/// Whether a run drafts with the checkpoint's MTP module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftMode {
    None,
    Mtp,
    /// The DSpark drafter V4.1 checkpoints carry under `mtp.0.*` … (docs/dspark.md).
    DSpark,
    Auto,
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct RunReport {
    pub gen: GenStats,
    /// Expert cache counters of the prefill and of the decode (`None` without a budget).
    pub prefill_cache: Option<CacheStats>,
    pub decode_cache: Option<CacheStats>,
    /// Engram row cache counters (`None` without Engram layers, or when a run without a budget
    /// maps tables below [`ENGRAM_SSD_THRESHOLD`]).
    pub prefill_engram: Option<EngramStats>,
    pub decode_engram: Option<EngramStats>,
    /// Peak resident set size at the end (`None` where the system does not report it).
    pub peak_rss: Option<u64>,
    /// Each forward pass's profile ([`run_with`] with `profile`; `None` otherwise).
    pub profile: Option<Vec<profile::Step>>,
}

/// Generate with `model` ([`generate`]), recording the routes into `routes` when given (its
/// hash-routed layers are marked first); the report of the run.
pub fn run(
    model: &mut RunModel,
    prompt: Prompt,
    opts: &GenerateOptions,
    routes: Option<&mut RouteLog>,
    on_piece: impl FnMut(Piece) -> ControlFlow<()>,
) -> Result<RunReport> {
    run_with(model, prompt, opts, routes, false, on_piece)
}

/// [`run`], profiling every forward pass when `profiled` (keep-kernels' [`profile`]: the
/// report's `profile`; the run's tokens and logits are the same either way).
pub fn run_with(
    model: &mut RunModel,
    prompt: Prompt,
    opts: &GenerateOptions,
    routes: Option<&mut RouteLog>,
    profiled: bool,
    on_piece: impl FnMut(Piece) -> ControlFlow<()>,
) -> Result<RunReport> {
    let hash_layers: Vec<usize> = (0..model.cfg().hash_layers).collect();
    let obs = routes.map(|l| {
        l.set_hash_layers(&hash_layers);
        l as &mut dyn RouteObserver
    });
    if profiled {
        profile::start();
    }
    let gen = generate(model, prompt, opts, obs, on_piece);
    let steps = profiled.then(profile::take);
    let mut r = RunReport {
        gen: gen?,
        profile: steps,
        ..RunReport::default()
    };
    match model {
        RunModel::Budgeted(m) => {
            r.prefill_cache = m.take_prefill_stats();
            r.prefill_engram = m.take_prefill_engram();
            r.decode_cache = Some(m.cache().stats());
            r.decode_engram = m.engram().map(|e| e.stats());
        }
        RunModel::Mapped(_, Some(e)) => {
            r.prefill_engram = e.prefill.take();
            r.decode_engram = Some(e.store.stats());
        }
        RunModel::Mapped(_, None) => {}
    }
    r.peak_rss = peak_rss_bytes();
    Ok(r)
}

/// A mapped model is faulted in at load ([`Checkpoint::populate`], as llama.cpp's loader does)
/// when its files take at most this fraction of MemAvailable: its first forward then reads
/// memory rather than taking a page fault per page it touches first. A larger model is left to
/// fault in as it is read, so that mapping it never pushes the machine into reclaim.
pub const POPULATE_MAX_FRACTION: f64 = 0.5;

/// Fault `ck`'s files in when they take at most [`POPULATE_MAX_FRACTION`] of MemAvailable;
/// the bytes populated (0 when skipped, or where the kernel has no `MADV_POPULATE_READ`).
pub fn populate_if_it_fits(ck: &Checkpoint) -> u64 {
    match crate::runtime::mem_available() {
        Some(avail) if ck.file_bytes() as f64 <= avail as f64 * POPULATE_MAX_FRACTION => {
            ck.populate()
        }
        _ => 0,
    }
}

/// Load timing: [`RunModel::load_opts`] and the seconds it took.
pub fn load_timed<'a>(
    ck: &'a Checkpoint,
    opts: RunOptions,
    budget: Option<&RuntimeOptions>,
) -> Result<(RunModel<'a>, f64)> {
    let t = Instant::now();
    let m = RunModel::load_opts(ck, opts, budget)?;
    Ok((m, t.elapsed().as_secs_f64()))
}

/// How a run was started, for its stats file.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// The command line, space-joined.
    pub command: String,
    /// The model directory.
    pub model: String,
    pub io_threads: usize,
    pub load_secs: f64,
}

fn cache_counters(s: &CacheStats) -> CacheCounters {
    CacheCounters {
        bytes_read: s.bytes_read,
        experts_read: s.experts_read,
        guess: GuessCounters {
            guessed: s.guess.guessed,
            passes: s.guess.passes,
            reads: s.guess.reads,
            right: s.guess.right,
            routed: s.guess.routed,
            saved: s.guess.saved,
        },
        hash_layers: HashLayerCounters {
            exact_passes: s.exact_passes,
            hits: s.hash_hits,
            misses: s.hash_misses,
            wait_secs: s.hash_wait_secs,
        },
        hit_rate: s.hit_rate(),
        hits: s.hits,
        io_busy_secs: s.io_busy_secs,
        misses: s.misses,
        read_gbps: s.read_gbps(),
        tiers: s.tiers.as_ref().map(|t| TierCounters {
            admissions: t.admissions,
            above_tau: t.above_tau,
            base: t.base,
            bytes_read: t.bytes_read,
            cache_bytes: t.cache_bytes,
            evictions: t.evictions,
            failed: t.failed,
            in_flight: t.in_flight,
            no_room: t.no_room,
            tau: t.tau,
            upper: t.upper,
            upper_hit_rate: t.upper_hit_rate(),
            upper_misses: t.upper_misses,
            wait_secs: t.wait_secs,
        }),
        wait_secs: s.wait_secs,
        warm_bytes: s.warm_bytes,
    }
}

/// One step of keep-kernels' profile (or a sum of steps) as the stats file writes it.
fn profile_step(s: &profile::Step, steps: u64) -> ProfileStep {
    ProfileStep {
        bytes: s.bytes.to_vec(),
        ns: s.ns.to_vec(),
        phase: s.phase.name().into(),
        regions: s.regions,
        steps,
        tokens: s.tokens as u64,
        total_ns: s.total_ns,
        wait_ns: s.wait_ns.to_vec(),
    }
}

/// The steps of `phase` summed, with how many there were.
pub fn profile_sum(steps: &[profile::Step], phase: profile::Phase) -> (profile::Step, u64) {
    let mut sum = profile::Step {
        phase,
        ..profile::Step::default()
    };
    let mut n = 0;
    for s in steps.iter().filter(|s| s.phase == phase) {
        n += 1;
        sum.tokens += s.tokens;
        sum.total_ns += s.total_ns;
        sum.regions += s.regions;
        for p in 0..profile::PARTS {
            sum.ns[p] += s.ns[p];
            sum.bytes[p] += s.bytes[p];
            sum.wait_ns[p] += s.wait_ns[p];
        }
    }
    (sum, n)
}

/// A run's profile as the stats file writes it: the part names, each phase's sum, every step.
pub fn profile_numbers(steps: &[profile::Step]) -> ProfileNumbers {
    let (pre, np) = profile_sum(steps, profile::Phase::Prefill);
    let (dec, nd) = profile_sum(steps, profile::Phase::Decode);
    ProfileNumbers {
        decode: profile_step(&dec, nd),
        parts: profile::Part::ALL
            .iter()
            .map(|p| p.name().to_string())
            .collect(),
        prefill: profile_step(&pre, np),
        steps: steps.iter().map(|s| profile_step(s, 1)).collect(),
    }
}

fn engram_counters(s: &EngramStats) -> EngramCounters {
    EngramCounters {
        block_bytes: s.block_bytes,
        block_source: s.block_source.map_or("", |b| b.as_str()).into(),
        bytes_read: s.bytes_read,
        hit_rate: s.hit_rate(),
        hits: s.hits,
        misses: s.misses,
        read_amplification: s.read_amplification(),
        reads: s.reads,
        rows_requested: s.rows_requested,
        sync_rows: s.sync_rows,
        useful_bytes: s.useful_bytes,
        wait_secs: s.wait_secs,
    }
}

impl RunReport {
    /// The `keep-run-stats` record of this run of `model`.
    pub fn stats(&self, model: &RunModel, info: &RunInfo) -> RunStats {
        let b = model.budgeted();
        let plan = b.map(|m| {
            let p = m.plan();
            let store = m.cache().store();
            PlanNumbers {
                activation_bytes: p.memory.activations,
                budget: p.budget,
                cache_bytes: p.memory.cache,
                context: p.memory.context as u64,
                direct_io: store.direct_io(),
                engram_cache_bytes: m.engram().map(|e| e.cache_bytes()),
                expert_bytes: store.expert_bytes(),
                n_experts: p.n_experts as u64,
                n_layers: p.n_layers as u64,
                prefill_chunk: p.memory.chunk as u64,
                residents: p.residents,
                routed_expert_bytes: store.total_bytes(),
                slot_bytes: p.slot_bytes,
                slots_per_layer: p.slots_per_layer as u64,
                top_k: p.top_k as u64,
            }
        });
        let g = &self.gen;
        RunStats {
            command: info.command.clone(),
            decode_cache: self.decode_cache.as_ref().map(cache_counters),
            decode_engram: self.decode_engram.as_ref().map(engram_counters),
            decode_secs: g.decode_secs,
            decode_tokens: g.generated as u64,
            decode_tps: g.decode_tps(),
            draft: (g.draft.k > 0).then(|| {
                let d = &g.draft;
                let k = d.k.min(d.proposed.len());
                DraftNumbers {
                    acceptance: d.acceptance(),
                    accepted: d.accepted[..k].to_vec(),
                    k: d.k as u64,
                    proposed: d.proposed[..k].to_vec(),
                    replays: d.replays,
                    auto_off: d.auto_off,
                    auto_offs: d.auto_offs,
                    auto_ons: d.auto_ons,
                    auto_stopped: d.auto_stopped,
                    plain_tokens: d.plain_tokens,
                    tokens_per_forward: d.tokens_per_forward(),
                    verify_forwards: d.verify_forwards,
                    window_experts: d.window_experts_per_layer(),
                }
            }),
            fixed_overhead_bytes: FIXED_OVERHEAD,
            format: run_stats::FORMAT.into(),
            io_threads: info.io_threads as u64,
            load_secs: info.load_secs,
            model: info.model.clone(),
            peak_rss_bytes: self.peak_rss,
            plan,
            policy: b.map(|m| m.policy().to_string()),
            prefill_cache: self.prefill_cache.as_ref().map(cache_counters),
            prefill_engram: self.prefill_engram.as_ref().map(engram_counters),
            prefill_secs: g.prefill_secs,
            prefill_tps: g.prefill_tps(),
            profile: self.profile.as_deref().map(profile_numbers),
            prompt_tokens: g.prompt_tokens as u64,
            threads: keep_kernels::cpu::threads() as u64,
            version: run_stats::VERSION,
        }
    }
}
