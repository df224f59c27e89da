//! `keep serve`: an OpenAI-compatible HTTP server for a model (the bundled one by default),
//! batching concurrent requests. Flags and printing only: the server is keep-serve's.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::logits::model_dir;
use crate::util::parse_bytes;

/// Serve the model over HTTP with OpenAI's API and a chat page.
///
/// Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
/// "stream": true for server-sent events), GET /health (200 once the model is loaded and warm,
/// else 503 "loading" or "draining"), GET /health/live (200 while the process serves HTTP),
/// GET /metrics (Prometheus text; behind --api-key like /v1), POST /tokenize, POST
/// /detokenize, and a chat page at /. Concurrent requests share each decode step (continuous batching, up to
/// --max-batch sequences; more queue). Binds 127.0.0.1 unless --host says otherwise; with
/// --api-key (or $KEEP_API_KEY; an empty key is refused) every API request needs
/// `Authorization: Bearer KEY`.
///
/// Against web pages: a request's Host must be an IP address, localhost, the --host name or an
/// --allowed-host name (else 421); API bodies must be `Content-Type: application/json` (else
/// 415); no CORS headers are sent. Against slow or idle clients: --header-timeout,
/// --body-timeout (408), --idle-timeout, and --max-connections (one more: 503 at once). A model
/// file changed under the server makes requests 503 (restart it). The port is bound before the
/// model loads; "listening on" is printed once it is warm. SIGINT or SIGTERM drains: the
/// listener closes, idle connections close, a new request on an open connection gets 503 with
/// `Connection: close`, the requests in flight (streams included) finish, and the process
/// exits when the last one ends or at --shutdown-timeout.
///
/// Example: keep serve --port 8080 --max-batch 8
///          curl localhost:8080/v1/completions -H 'content-type: application/json' \
///            -d '{"prompt": "def ", "max_tokens": 32}'
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
    /// Require `Authorization: Bearer KEY` (default: $KEEP_API_KEY when set); an empty key is
    /// refused.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Also answer requests whose Host header is NAME (repeatable; `*`: any name). IP
    /// addresses, localhost and the --host name are always answered.
    #[arg(long, value_name = "NAME")]
    allowed_host: Vec<String>,
    /// Seconds a request's line and headers may take from their first byte.
    #[arg(long, value_name = "SECS", value_parser = parse_timeout,
          default_value_t = keep_serve::conn::Limits::DEFAULT_HEADER_TIMEOUT.as_secs_f64())]
    header_timeout: f64,
    /// Seconds a request's body may take once its headers are in (longer: 408).
    #[arg(long, value_name = "SECS", value_parser = parse_timeout,
          default_value_t = keep_serve::conn::Limits::DEFAULT_BODY_TIMEOUT.as_secs_f64())]
    body_timeout: f64,
    /// Seconds a connection may stay open with no request in progress and nothing arriving.
    #[arg(long, value_name = "SECS", value_parser = parse_timeout,
          default_value_t = keep_serve::conn::Limits::DEFAULT_IDLE_TIMEOUT.as_secs_f64())]
    idle_timeout: f64,
    /// Connections open at once (fewer if the open-file limit allows fewer); one more is
    /// answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = keep_serve::conn::Limits::DEFAULT_MAX_CONNECTIONS)]
    max_connections: usize,
    /// Seconds SIGINT/SIGTERM lets the requests in flight go on before closing them (the
    /// drain's deadline; the process exits as soon as none is left).
    #[arg(long, value_name = "SECS", value_parser = parse_secs,
          default_value_t = keep_serve::conn::Limits::DEFAULT_SHUTDOWN_TIMEOUT.as_secs_f64())]
    shutdown_timeout: f64,
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
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

/// Seconds (`2`, `0.5`, `30s`), zero included.
fn parse_secs(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let t = t.strip_suffix('s').unwrap_or(t).trim();
    let v: f64 = t
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(v.is_finite() && (0.0..=1e7).contains(&v)) {
        return Err(format!("`{s}`: give 0 to 10000000 seconds"));
    }
    Ok(v)
}

/// Seconds, more than zero (a zero timeout would close every connection at once).
fn parse_timeout(s: &str) -> Result<f64, String> {
    let d = parse_secs(s)?;
    if d == 0.0 {
        return Err(format!("`{s}`: a timeout must be more than 0 seconds"));
    }
    Ok(d)
}

/// The API key: the flag's, else $KEEP_API_KEY's; an empty one is refused.
fn api_key(flag: Option<&str>) -> anyhow::Result<Option<String>> {
    if let Some(k) = flag {
        anyhow::ensure!(
            !k.trim().is_empty(),
            "--api-key is empty: give a non-empty key, or leave the flag out to serve without one"
        );
        return Ok(Some(k.to_string()));
    }
    match std::env::var_os("KEEP_API_KEY") {
        None => Ok(None),
        Some(v) => {
            let k = v
                .into_string()
                .map_err(|_| anyhow::anyhow!("$KEEP_API_KEY is not UTF-8 text"))?;
            anyhow::ensure!(
                !k.trim().is_empty(),
                "$KEEP_API_KEY is set but empty: give it a non-empty key, or unset it to serve without one"
            );
            Ok(Some(k))
        }
    }
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let api_key = api_key(a.api_key.as_deref())?;
    anyhow::ensure!(
        a.max_connections >= 1,
        "--max-connections must be at least 1"
    );
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
    // One session assembles the model: the checkpoint, its kernels and the budget (a plan's, or
    // the flags').
    let spec = match &plan {
        Some((pp, p)) => keep_fit::apply::session_spec(pp, p, dir.clone())?,
        None => keep_runtime::SessionSpec {
            budget: a.memory_budget.map(keep_runtime::RuntimeOptions::new),
            ..keep_runtime::SessionSpec::new(dir.clone(), a.kernels.into())
        },
    };
    let session =
        keep_runtime::Session::open(spec).map_err(|e| crate::util::open_error(e, &dir))?;
    let limit = session.cfg().raw.max_position_embeddings;
    // A plan is served for the context it was fitted to unless --max-context says otherwise.
    let max_context = a
        .max_context
        .or(plan.as_ref().map(|(_, p)| p.context))
        .unwrap_or(limit);
    anyhow::ensure!(
        (1..=limit).contains(&max_context),
        "--max-context must be 1 to the model's {limit} positions, not {max_context}"
    );
    session.check_memory(keep_runtime::LoadFor {
        context: Some(max_context),
        label: Some(keep_serve::server::SERVER_CONTEXT),
        undrafted: true,
        ..Default::default()
    })?;
    let name = a.name.clone().unwrap_or_else(|| {
        if bundled {
            "keep-tiny".into()
        } else {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        }
    });
    let opts = keep_serve::server::ServeOptions {
        session,
        name: name.clone(),
        host: a.host.clone(),
        port: a.port,
        api_key: api_key.clone(),
        max_batch: a.max_batch,
        max_context,
        max_body: a.max_body as usize,
        allowed_hosts: a.allowed_host.clone(),
        limits: keep_serve::conn::Limits {
            header_timeout: Duration::from_secs_f64(a.header_timeout),
            body_timeout: Duration::from_secs_f64(a.body_timeout),
            idle_timeout: Duration::from_secs_f64(a.idle_timeout),
            max_connections: a.max_connections,
            shutdown_timeout: Duration::from_secs_f64(a.shutdown_timeout),
        },
    };
    keep_serve::server::serve(opts, |ready| {
        let addr = ready.addr;
        if ready.stage == keep_serve::metrics::Stage::Loading {
            println!(
                "keep serve: loading {name} on http://{addr} (/health answers 503 until it is warm)"
            );
            use std::io::Write;
            let _ = std::io::stdout().flush();
            return;
        }
        println!(
            "keep serve: {name} on http://{addr} (max batch {}, context {max_context}{})",
            a.max_batch,
            if api_key.is_some() {
                ", API key required"
            } else {
                ""
            }
        );
        if ready.max_connections < a.max_connections {
            println!(
                "keep serve: at most {} connections, not {}: the open-file limit allows no more (raise `ulimit -n`)",
                ready.max_connections, a.max_connections
            );
        }
        println!("listening on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })
    .with_context(|| format!("serving {}", dir.display()))?;
    eprintln!("keep serve: stopped");
    Ok(())
}
