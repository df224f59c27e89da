//! `keep serve`: an OpenAI-compatible HTTP server for a model (the bundled one by default),
//! batching concurrent requests. Flags and printing only: the server is keep-serve's.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::logits::model_dir;
use crate::util::parse_bytes;

/// Serve the model over HTTP with OpenAI's API and a chat page.
///
/// Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
/// "stream": true for server-sent events), GET /health, POST /tokenize, POST /detokenize, and a
/// chat page at /. Concurrent requests share each decode step (continuous batching, up to
/// --max-batch sequences; more queue). Binds 127.0.0.1 unless --host says otherwise; with
/// --api-key (or $KEEP_API_KEY) every API request needs `Authorization: Bearer KEY`. SIGINT or
/// SIGTERM stops accepting and lets the requests in flight finish.
///
/// Example: keep serve --port 8080 --max-batch 8
///          curl localhost:8080/v1/completions -d '{"prompt": "def ", "max_tokens": 32}'
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct ServeArgs {
    /// Model directory (default: the bundled model).
    model: Option<PathBuf>,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Most sequences decoded together; more requests wait in a queue.
    #[arg(long, default_value_t = 8)]
    max_batch: usize,
    /// Most prompt + completion tokens of one request (default: the model's context); a longer
    /// prompt is refused with 400, a completion is cut at it.
    #[arg(long, value_name = "TOKENS")]
    max_context: Option<usize>,
    /// Require `Authorization: Bearer KEY` (default: $KEEP_API_KEY when set).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Run inside this many bytes (e.g. 2GiB): routed experts in slots read from SSD, the
    /// batch's expert union through the slot cache.
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    memory_budget: Option<u64>,
    /// Largest request body in bytes (larger: 413).
    #[arg(long, value_parser = parse_bytes, default_value_t = keep_serve::server::DEFAULT_MAX_BODY as u64)]
    max_body: u64,
    /// The model id `/v1/models` lists (default: the model directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Kernels: fast (the default, as `keep run`) or exact.
    #[arg(long, value_enum, default_value_t = super::KernelsArg::Fast)]
    kernels: super::KernelsArg,
    /// Apply a plan from `keep fit` whole: its checkpoint, budget (planned for the plan's
    /// context, or --max-context when given), policy, warm start (the plan's route profile when
    /// a run has written it) and kernels.
    #[arg(long, value_name = "PLAN", conflicts_with_all = ["model", "memory_budget", "kernels"])]
    plan: Option<PathBuf>,
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=keep_serve::engine::MAX_BATCH).contains(&a.max_batch),
        "--max-batch must be 1 to {}, not {}",
        keep_serve::engine::MAX_BATCH,
        a.max_batch
    );
    let bundled = a.model.is_none() && a.plan.is_none();
    let plan = match &a.plan {
        Some(p) => Some((
            p.clone(),
            keep_artifacts::fit_plan::FitPlan::read(p)
                .with_context(|| format!("reading the plan {}", p.display()))?,
        )),
        None => None,
    };
    let dir = match &plan {
        Some((pp, p)) => keep_fit::apply::checkpoint(pp, p, false, &|_, _| {})?,
        None => model_dir(a.model.clone())?,
    };
    let ck = keep_checkpoint::Checkpoint::open(&dir)
        .with_context(|| format!("opening {}", dir.display()))?;
    let cfg = keep_model::ModelConfig::from_checkpoint(&ck)
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    let limit = cfg.raw.max_position_embeddings;
    // A plan is served for the context it was fitted to unless --max-context says otherwise.
    let max_context = a
        .max_context
        .or(plan.as_ref().map(|(_, p)| p.context))
        .unwrap_or(limit);
    anyhow::ensure!(
        (1..=limit).contains(&max_context),
        "--max-context must be 1 to the model's {limit} positions, not {max_context}"
    );
    let (kernels, budget) = match &plan {
        Some((pp, p)) => (
            keep_fit::apply::kernels(p),
            keep_fit::apply::runtime_options(pp, p, &ck, max_context)?,
        ),
        None => {
            let kernels: keep_model::Kernels = a.kernels.into();
            (
                kernels,
                a.memory_budget.map(|b| keep_runtime::RuntimeOptions {
                    kernels,
                    context: Some(max_context),
                    ..keep_runtime::RuntimeOptions::new(b)
                }),
            )
        }
    };
    drop(ck);
    if budget.is_none() {
        keep_runtime::check_machine(
            cfg.memory_estimate(max_context).total(),
            "this server's context",
        )?;
    }
    let name = a.name.clone().unwrap_or_else(|| {
        if bundled {
            "keep-tiny".into()
        } else {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        }
    });
    let api_key = a
        .api_key
        .clone()
        .or_else(|| std::env::var("KEEP_API_KEY").ok().filter(|k| !k.is_empty()));
    let opts = keep_serve::server::ServeOptions {
        dir: dir.clone(),
        name: name.clone(),
        host: a.host.clone(),
        port: a.port,
        api_key: api_key.clone(),
        max_batch: a.max_batch,
        max_context,
        max_body: a.max_body as usize,
        kernels,
        budget,
    };
    keep_serve::server::serve(opts, |addr| {
        println!(
            "keep serve: {name} on http://{addr} (max batch {}, context {max_context}{})",
            a.max_batch,
            if api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        println!("listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
    .with_context(|| format!("serving {}", dir.display()))?;
    eprintln!("keep serve: stopped");
    Ok(())
}
