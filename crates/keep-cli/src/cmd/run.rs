//! `keep run`: generate text from a model (the bundled one by default), streaming it to stdout,
//! and print prefill and decode speeds to stderr at the end. Flags and printing only: the run
//! is keep-runtime's (`run::run` over a mapped or budgeted model, driving keep-model's one
//! `generate`), the `--stats-json` file keep-artifacts' `run_stats`.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_model::generate::{
    encode_prompt, load_tokenizer, GenerateOptions, Piece, Prompt, SamplerConfig,
};
use keep_model::ModelError;
use keep_runtime::run::DraftMode;
use keep_runtime::{RouteLog, RunInfo, RuntimeError, Session};

use super::logits::model_dir;

// Memory-budget flags and the printing of what a budgeted run measured.
mod budget;

/// Generate text with the model, streaming it to stdout.
///
/// The prompt is encoded with the model's tokenizer.json (no prompt: generation starts from the
/// beginning-of-sequence token). Sampling is greedy at --temperature 0, otherwise
/// temperature + nucleus (--top-p) with a seeded generator (same seed, same text). Prefill and
/// decode tokens/s go to stderr at the end.
///
/// Example: keep run --prompt "Once upon a time" --max-tokens 64 --temperature 0.7 --seed 1
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct RunArgs {
    /// Model directory (default: the bundled model).
    model: Option<PathBuf>,
    /// Prompt text.
    #[arg(long)]
    prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Kernels: fast (integer dot products on int8 activations where the weight format has
    /// them) or exact (f32, bit-identical to `keep logits`). Fast is the default because on the
    /// bundled model's held-out split it scores KL 4.0e-4 nats and top-1 99.1% against the
    /// exact model (`keep eval --kernels fast`; the rule is KL ≤ 1e-3 and top-1 ≥ 99%).
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Fast)]
    kernels: super::KernelsArg,
    /// Speculative decoding: mtp drafts --draft-tokens tokens one after another with the
    /// checkpoint's MTP module (`mtp.0.*`, DeepSeek-V4) and verifies them in one forward;
    /// dspark drafts a block in one pass with the DSpark drafter of a DeepSeek-V4.1 checkpoint
    /// (`mtp.0.*` … with the `dspark_*` config keys) and verifies the token just sampled and
    /// the block in one forward (refused without a DSpark drafter); greedy output is identical
    /// to none either way. auto, the default, drafts with DSpark when the checkpoint carries
    /// it, else with an MTP module when it has one, and switches drafting off and back on from
    /// a running measurement of the seconds per token with and without it (it stops for good
    /// after losing three comparisons in a row, or at once when its fastest verify forward
    /// costs at least K + 1 plain steps). Under --memory-budget the verify window's
    /// experts go through the slots, and the budget also holds the drafter's tensors and one
    /// copy of the decoding cache.
    #[arg(long, value_enum, default_value_t = DraftArg::Auto)]
    draft: DraftArg,
    /// Tokens drafted per verify forward (1..=8; default 2 with MTP, DSpark's block size,
    /// at most 8, with DSpark, which drafts no more than its block).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=8))]
    draft_tokens: Option<u64>,
    /// With DSpark: verify only the leading drafts whose predicted chance of all being
    /// accepted (the product of the confidence head's sigmoids) is at least P, in (0, 1];
    /// fewer rows per verify forward when the drafter is unsure, none when even the first
    /// draft is below P. Off by default (every draft verified).
    #[arg(long, value_name = "P", value_parser = parse_probability)]
    draft_confidence: Option<f32>,
    #[command(flatten)]
    budget: budget::BudgetArgs,
    /// Apply a plan from `keep fit` whole: its checkpoint, budget (for at least its context),
    /// policy, warm start (the plan's route profile once a run has written it), kernels and
    /// drafting — what `keep fit --check` runs; at the end the run's routes are folded into
    /// the route profile beside the plan.
    #[arg(long, value_name = "PLAN", conflicts_with_all = ["model", "memory_budget", "policy", "warm_start", "kernels", "draft", "draft_tokens"])]
    plan: Option<PathBuf>,
    /// With --plan: build the plan's derived checkpoint when it is missing (else the run is
    /// refused with the command that builds it).
    #[arg(long, requires = "plan")]
    build: bool,
    /// Time every forward pass by part (attention, hyper-connections, norms, router, routed and
    /// shared experts, Engram, head, sampling, I/O wait, printing, ...) with the bytes each read and the
    /// time threads waited on each other; print the split per decoded token and per prefill
    /// chunk, and add every step to the --stats-json file. The tokens are the same as without.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

/// `--draft`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DraftArg {
    Mtp,
    Dspark,
    None,
    Auto,
}

impl From<DraftArg> for keep_runtime::run::DraftMode {
    fn from(d: DraftArg) -> Self {
        match d {
            DraftArg::Mtp => Self::Mtp,
            DraftArg::Dspark => Self::DSpark,
            DraftArg::None => Self::None,
            DraftArg::Auto => Self::Auto,
        }
    }
}

/// A refusal of the run, in the words of its flags where a flag is the cause.
fn flag_error(e: RuntimeError) -> anyhow::Error {
    match e {
        RuntimeError::Model(ModelError::TooLong {
            prompt,
            max_tokens,
            limit,
        }) => anyhow::anyhow!(
            "{prompt} prompt tokens + --max-tokens {max_tokens} exceed the model's context of {limit} positions (max_position_embeddings); use --prompt-tokens/--max-tokens within it"
        ),
        RuntimeError::Model(e @ ModelError::Sampling(_)) => {
            anyhow::anyhow!("{e}: give --temperature ≥ 0 and --top-p in (0, 1]")
        }
        e => e.into(),
    }
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let b = &a.budget;
    let sampling = SamplerConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
    };
    sampling
        .check()
        .map_err(|e| flag_error(RuntimeError::Model(e)))?;
    let plan = match &a.plan {
        Some(p) => Some((
            p.clone(),
            keep_artifacts::fit_plan::FitPlan::read(p)
                .with_context(|| format!("reading the plan {}", p.display()))?,
        )),
        None => None,
    };
    let dir = match &plan {
        Some((pp, plan)) => {
            let bar = crate::util::byte_bar(0, "prune");
            let d = keep_fit::apply::checkpoint(pp, plan, a.build, &|d, t| {
                bar.set_length(t);
                bar.set_position(d);
            })?;
            bar.finish_and_clear();
            d
        }
        None => model_dir(a.model.clone())?,
    };
    b.check(&dir)?;
    // One session assembles the run: the checkpoint, its kernels and prefill chunk, the budget
    // and the drafting (a plan's, or the flags').
    let spec = match &plan {
        Some((pp, p)) => {
            let mut spec = keep_fit::apply::session_spec(pp, p, dir.clone())?;
            spec.budget = spec.budget.map(|o| keep_runtime::RuntimeOptions {
                io_threads: b.io_threads,
                direct_io: !b.buffered_io,
                prefetch_next: b.prefetch_next,
                engram_cache: b.engram_cache,
                ..o
            });
            spec
        }
        None => keep_runtime::SessionSpec {
            budget: b.runtime_options()?,
            draft: keep_runtime::Draft {
                mode: a.draft.into(),
                tokens: a.draft_tokens.map(|k| k as usize),
                required: true,
            },
            ..keep_runtime::SessionSpec::new(dir.clone(), a.kernels.into())
        },
    };
    let session = Session::open(keep_runtime::SessionSpec {
        prefill_chunk: b.prefill_chunk,
        draft_confidence: a.draft_confidence,
        ..spec
    })
    .map_err(|e| crate::util::open_error(e, &dir))?;
    if plan.is_none() {
        b.check_tiers(session.checkpoint())?;
    }
    // The prompt and the context first: the run's memory is planned for them (and refused when
    // it cannot fit the budget or the machine) before anything is allocated.
    let tok = match b.prompt_tokens {
        Some(_) => None,
        None => Some(load_tokenizer(&dir)?),
    };
    let prompt = match b.prompt_tokens {
        Some(n) => Prompt::Synthetic(n),
        None => Prompt::Text(a.prompt.as_deref().unwrap_or("")),
    };
    let ids = encode_prompt(session.cfg(), tok.as_ref(), prompt, a.max_tokens)
        .map_err(|e| flag_error(RuntimeError::Model(e)))?;
    // Generation stops one token short of feeding the last sampled token back. The budget holds
    // the activations of the largest forward this run makes: the prompt (or a verify window)
    // rather than a whole prefill chunk. A plan keeps the chunk it was fitted with, so that it
    // runs what `keep fit --check` runs.
    let what = keep_runtime::LoadFor {
        context: Some(ids.len() + a.max_tokens.saturating_sub(1)),
        prompt: plan.is_none().then_some(ids.len()),
        ..Default::default()
    };
    session.check_memory(what)?;
    let (mut model, load_secs) = session
        .load(what)
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    if let Some(m) = model.budgeted() {
        budget::print_plan(m);
    }
    session
        .attach_draft(&mut model)
        .with_context(|| format!("--draft {}", draft_name(session.draft().0)))?;
    let prompt = Prompt::Ids(&ids);
    let gen = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling,
        tokenizer: tok.as_ref(),
    };
    let mut log = (b.record_routes.is_some() || plan.is_some()).then(RouteLog::new);
    // Each piece goes to stdout as it comes; the first output error stops the run.
    let mut out = std::io::stdout().lock();
    let mut printed: std::io::Result<()> = Ok(());
    let report =
        keep_runtime::run::run_with(&mut model, prompt, &gen, log.as_mut(), a.profile, |p| {
            printed = match p {
                Piece::Prompt(_) => match (&a.prompt, &tok) {
                    (Some(text), Some(_)) => write!(out, "{text}"),
                    _ => Ok(()),
                },
                Piece::Text(s) => write!(out, "{s}"),
                Piece::Token(t) => write!(out, "{t} "),
            }
            .and_then(|_| out.flush());
            match printed {
                Ok(()) => ControlFlow::Continue(()),
                Err(_) => ControlFlow::Break(()),
            }
        })
        .map_err(flag_error)?;
    printed?;
    writeln!(out)?;
    let g = &report.gen;
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.2} tokens/s); decode: {} tokens in {:.3} s ({:.2} tokens/s)",
        g.prompt_tokens,
        g.prefill_secs,
        g.prefill_tps(),
        g.generated,
        g.decode_secs,
        g.decode_tps()
    );
    if g.draft.k > 0 {
        let acc: Vec<String> = g
            .draft
            .acceptance()
            .iter()
            .map(|a| format!("{a:.3}"))
            .collect();
        eprintln!(
            "draft: K = {}, {} verify forwards, {:.2} tokens per forward, acceptance by position [{}], {:.2} experts per layer per verify forward{}",
            g.draft.k,
            g.draft.verify_forwards,
            g.draft.tokens_per_forward(),
            acc.join(", "),
            g.draft.window_experts_per_layer(),
            if g.draft.auto_off {
                format!(
                    "; --draft auto switched drafting off {} and on {} times ({} tokens without drafts{})",
                    g.draft.auto_offs,
                    g.draft.auto_ons,
                    g.draft.plain_tokens,
                    if g.draft.auto_stopped {
                        ", then stopped it"
                    } else {
                        ""
                    }
                )
            } else {
                String::new()
            }
        );
    }
    if let Some(steps) = &report.profile {
        print_profile(steps);
    }
    // A run without a budget still reads Engram tables above the threshold from SSD: its row
    // counters are printed the same way.
    if b.active() || plan.is_some() || report.decode_engram.is_some() {
        budget::print_report(&report, session.runtime_options(what).map(|o| o.budget));
    }
    if let (Some((pp, p)), Some(l)) = (&plan, &log) {
        let cfg = model.cfg();
        let path = keep_fit::apply::save_profile(pp, p, l, cfg.n_layers, cfg.n_experts)
            .with_context(|| format!("saving the route profile of {}", pp.display()))?;
        eprintln!(
            "route profile: {} tokens folded into {}",
            l.tokens(),
            path.display()
        );
    }
    if let (Some(path), Some(l)) = (&b.record_routes, &log) {
        let session = format!("keep-run-{}", std::process::id());
        l.write(path, &session, model.cfg().n_experts, b.force)
            .with_context(|| format!("writing routes to {}", path.display()))?;
        eprintln!(
            "routes of {} tokens written to {}",
            l.tokens(),
            path.display()
        );
    }
    if let Some(path) = &b.stats_json {
        let info = RunInfo {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            model: dir.display().to_string(),
            io_threads: b.io_threads,
            load_secs,
        };
        keep_artifacts::run_stats::write(path, &report.stats(&model, &info), b.force)
            .with_context(|| format!("writing the run's numbers to {}", path.display()))?;
    }
    Ok(())
}

/// `--profile`'s table: per part, milliseconds per decoded token and per prefill chunk, the
/// share of the step, the bytes read as GB/s over the part's own time, and the thread wait.
fn print_profile(steps: &[keep_runtime::profile::Step]) {
    use keep_runtime::profile::{Part, Phase};
    let (pre, np) = keep_runtime::run::profile_sum(steps, Phase::Prefill);
    let (dec, nd) = keep_runtime::run::profile_sum(steps, Phase::Decode);
    eprintln!(
        "profile: decode {nd} steps ({} tokens), prefill {np} chunks ({} tokens); ms per step, share of the step, GB/s read over the part's own time, thread wait ms inside it",
        dec.tokens, pre.tokens
    );
    eprintln!(
        "{:<26} {:>10} {:>7} {:>8} {:>8}   {:>10} {:>7} {:>8} {:>8}",
        "part", "decode ms", "share", "GB/s", "wait ms", "prefill ms", "share", "GB/s", "wait ms"
    );
    let col = |s: &keep_runtime::profile::Step, n: u64, p: usize| {
        let n = n.max(1) as f64;
        let ms = s.ns[p] as f64 / 1e6 / n;
        let share = s.ns[p] as f64 / s.total_ns.max(1) as f64;
        let gbps = if s.ns[p] > 0 {
            s.bytes[p] as f64 / s.ns[p] as f64
        } else {
            0.0
        };
        let wait = s.wait_ns[p] as f64 / 1e6 / n;
        format!("{ms:>10.3} {:>6.1}% {gbps:>8.2} {wait:>8.3}", 100.0 * share)
    };
    for (i, part) in Part::ALL.iter().enumerate() {
        eprintln!(
            "{:<26} {}   {}",
            part.name(),
            col(&dec, nd, i),
            col(&pre, np, i)
        );
    }
    let total = |s: &keep_runtime::profile::Step, n: u64| {
        let n = n.max(1) as f64;
        let bytes: u64 = s.bytes.iter().sum();
        let wait: u64 = s.wait_ns.iter().sum();
        format!(
            "{:>10.3} {:>6.1}% {:>8.2} {:>8.3}",
            s.total_ns as f64 / 1e6 / n,
            100.0,
            bytes as f64 / s.total_ns.max(1) as f64,
            wait as f64 / 1e6 / n
        )
    };
    eprintln!("{:<26} {}   {}", "total", total(&dec, nd), total(&pre, np));
}

/// A probability in (0, 1].
fn parse_probability(s: &str) -> Result<f32, String> {
    let p: f32 = s.parse().map_err(|e| format!("{s}: {e}"))?;
    if p > 0.0 && p <= 1.0 {
        Ok(p)
    } else {
        Err(format!("{s} is not in (0, 1]"))
    }
}

fn draft_name(d: DraftMode) -> &'static str {
    match d {
        DraftMode::Mtp => "mtp",
        DraftMode::DSpark => "dspark",
        DraftMode::None => "none",
        DraftMode::Auto => "auto",
    }
}
