//! keep-serve: `keep serve`'s library, an OpenAI-compatible HTTP server over keep-runtime's
//! model that batches concurrent requests.
//!
//! What it is: the HTTP side ([`server`]: axum on tokio — `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` with server-sent events, `/health`, `/health/live`, `/metrics`,
//! `/tokenize`, `/detokenize`, the chat page at `/`; API key, `Host` and content-type checks,
//! body limit, context limit, panics caught), health and Prometheus metrics ([`metrics`]:
//! loading → ready → draining; prometheus-client), the connections under it ([`conn`]:
//! header, body and idle timeouts, a connection cap, the drain on shutdown), the model files' watch ([`files`]: a shard changed under the
//! server is refused, never read), the scheduler
//! ([`engine`]: continuous batching on one model thread through keep-model's `Decoder` and
//! `Generate::forward_batch`), the request and error formats ([`api`]), chat templates
//! ([`template`], minijinja in Hugging Face's dialect) and stop strings ([`stop`]).
//!
//! What it is not: no model code and no generation loop of its own (keep-model's `Decoder`
//! samples and stops; `forward_batch` computes), no printing (the CLI prints what
//! [`server::serve`] reports).
//!
//! Depends on: keep-runtime (the mapped or budgeted model), keep-model, keep-checkpoint,
//! axum/tokio, prometheus-client, minijinja.

pub mod api;
pub mod conn;
pub mod engine;
pub mod files;
pub mod metrics;
pub mod server;
pub mod stop;
pub mod template;

/// What can go wrong starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    BadRequest(String),
    #[error(transparent)]
    Model(#[from] keep_model::ModelError),
    #[error(transparent)]
    Runtime(#[from] keep_runtime::RuntimeError),
    #[error("{0}")]
    Startup(String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, ServeError>;
