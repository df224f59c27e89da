//! The HTTP side: [`router`] (the endpoints over an [`AppState`]) and [`serve`] (open the
//! model on its scheduler thread, bind, serve until SIGINT/SIGTERM, then let the streams in
//! flight finish).
//!
//! Requests are parsed here, not by axum's extractors, so that every refusal is an OpenAI error
//! body: a body over the limit is 413, malformed JSON or a field of the wrong type 400, a prompt
//! longer than the context limit 400 naming both lengths, a missing or wrong API key 401. A
//! panic in a handler becomes a 500 for that request only (the scheduler catches its own).
//!
//! What a web page in a browser cannot make it do: every request's `Host` must name this
//! server ([`HostPolicy`]: an IP address, `localhost`, the bound name or a name allowed on the
//! command line; else 421, which stops DNS rebinding), the API's POST bodies must be
//! `application/json` (else 415: a page can send `text/plain` cross-site without asking, JSON
//! only after a CORS preflight), and no CORS header is ever sent (so no preflight succeeds).
//! The API key is compared as SHA-256 digests, `Bearer` in any case. A body must arrive within
//! the body timeout (else 408); a model file changed under the server makes requests 503.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, State};
use axum::http::{header, HeaderValue, Method, Request as HttpRequest, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use keep_model::generate::{Generate, SamplerConfig};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{self, ChatRequest, Common, CompletionRequest, PromptField};
use crate::conn::Limits;
use crate::engine::{self, EngineHandle, EngineOptions, Event, Finish, Request, TokenLogprob};
use crate::files::FileGuard;
use crate::metrics::{Health, Metrics, Stage};
use crate::template::{ChatTemplate, Message};
use crate::{Result, ServeError};

/// The chat page: one static file, no external resources.
pub const PAGE: &str = include_str!("page.html");

/// Request bodies larger than this are refused with 413 (a prompt of the longest context
/// the bundled tokenizer can make fits many times over).
pub const DEFAULT_MAX_BODY: usize = 4 << 20;

/// `max_tokens` of a completion that names none (OpenAI's default for completions).
pub const DEFAULT_COMPLETION_TOKENS: usize = 16;

/// What the handlers know of the model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id `/v1/models` lists and responses carry.
    pub name: String,
    /// Beginning-of-sequence token (the prompt of an empty text).
    pub bos: u32,
}

/// Which `Host` headers the server answers (the defence against DNS rebinding: a page of
/// another site that re-points its own name at this address still sends its own name).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPolicy {
    /// Every host (`--allowed-host '*'`).
    Any,
    /// IP addresses, `localhost`, and these names (lowercase, without port or final dot).
    Names(Vec<String>),
}

/// The name of a `Host` header or `--allowed-host` value (`name`, `name:port`, `[v6]:port`):
/// lowercase, without port or final dot; `None` when it is not one.
fn host_name(h: &str) -> Option<String> {
    let h = h.trim();
    let name = if let Some(rest) = h.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        let port_ok = after.is_empty()
            || after
                .strip_prefix(':')
                .is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()));
        if !port_ok {
            return None;
        }
        inside
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) if !n.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => n,
            Some(_) if h.parse::<Ipv6Addr>().is_ok() => h,
            Some(_) => return None,
            None => h,
        }
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    (!name.is_empty()).then(|| name.to_ascii_lowercase())
}

impl HostPolicy {
    /// The policy of a server bound to `host` (an address or a name) with `extra` names
    /// allowed too (`*` among them: any host).
    pub fn for_bind(host: &str, extra: &[String]) -> HostPolicy {
        if extra.iter().any(|h| h.trim() == "*") {
            return HostPolicy::Any;
        }
        let mut names: Vec<String> = extra.iter().filter_map(|h| host_name(h)).collect();
        names.extend(host_name(host));
        HostPolicy::Names(names)
    }

    /// Whether a request with this `Host` header is answered.
    pub fn allows(&self, host: &str) -> bool {
        let HostPolicy::Names(names) = self else {
            return true;
        };
        let Some(name) = host_name(host) else {
            return false;
        };
        name.parse::<IpAddr>().is_ok() || name == "localhost" || names.contains(&name)
    }
}

/// The settings of an [`AppState`] beside its model.
#[derive(Debug, Clone)]
pub struct AppOptions {
    /// With a key, `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Requests are refused beyond this many tokens of prompt + completion.
    pub max_context: usize,
    pub hosts: HostPolicy,
    /// Time to receive a request's body (else 408).
    pub body_timeout: Duration,
    /// The model's files, checked at each request (a change: 503).
    pub files: Option<Arc<FileGuard>>,
    /// What `/health` says (ready unless told otherwise).
    pub health: Arc<Health>,
    /// What `/metrics` reports; the scheduler counts into the same one.
    pub metrics: Arc<Metrics>,
}

impl AppOptions {
    /// No key, any host, the default body timeout, files not checked.
    pub fn new(max_context: usize) -> AppOptions {
        AppOptions {
            api_key: None,
            max_context,
            hosts: HostPolicy::Any,
            body_timeout: Limits::DEFAULT_BODY_TIMEOUT,
            files: None,
            health: Arc::new(Health::new(Stage::Ready)),
            metrics: Arc::new(Metrics::new()),
        }
    }
}

struct Inner {
    engine: EngineHandle,
    tok: Arc<Tokenizer>,
    /// `tok` with special-token text encoded as text (chat messages' text).
    plain_tok: Tokenizer,
    template: Option<ChatTemplate>,
    model: ModelInfo,
    /// SHA-256 of the API key.
    key_digest: Option<[u8; 32]>,
    max_context: usize,
    hosts: HostPolicy,
    body_timeout: Duration,
    files: Option<Arc<FileGuard>>,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    ids: AtomicU64,
}

/// Everything a handler needs (cheap to clone).
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

impl AppState {
    /// A state over a running scheduler.
    pub fn new(
        engine: EngineHandle,
        tok: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
        model: ModelInfo,
        opts: AppOptions,
    ) -> AppState {
        AppState(Arc::new(Inner {
            engine,
            plain_tok: crate::template::plain_tokenizer(&tok),
            tok,
            template,
            model,
            key_digest: opts.api_key.as_deref().map(digest),
            max_context: opts.max_context,
            hosts: opts.hosts,
            body_timeout: opts.body_timeout,
            files: opts.files,
            health: opts.health,
            metrics: opts.metrics,
            ids: AtomicU64::new(0),
        }))
    }
}

/// SHA-256 of a key.
fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether two digests are equal, in time independent of where they differ.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    std::hint::black_box(diff) == 0
}

/// The key of an `Authorization` header: `Bearer KEY`, the scheme in any case.
fn bearer(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim_start())
}

/// Seconds of a duration as a user writes them.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

/// An error response in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        };
        let mut r = (
            self.status,
            Json(api::error_body(&self.message, kind, self.param)),
        )
            .into_response();
        if self.status == StatusCode::REQUEST_TIMEOUT {
            // The rest of the body is not read: the connection cannot carry another request.
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

/// The body as `T`: 413 over the limit, 400 for anything that is not a JSON object of the
/// right types.
fn parse<T: DeserializeOwned>(
    body: std::result::Result<Bytes, BytesRejection>,
) -> std::result::Result<T, ApiError> {
    let body = body.map_err(|r| ApiError {
        status: r.status(),
        message: match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => {
                "the request body is larger than this server accepts".into()
            }
            _ => r.body_text(),
        },
        param: None,
    })?;
    serde_json::from_slice(&body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "the body is not valid JSON"
        } else {
            "the request does not match the API"
        };
        ApiError::bad(format!("{what}: {e}"), None)
    })
}

/// The body of `req` as `T`, received within the body timeout (else 408).
async fn read_json<T: DeserializeOwned>(
    st: &AppState,
    req: HttpRequest<Body>,
) -> std::result::Result<T, ApiError> {
    let limit = st.0.body_timeout;
    match tokio::time::timeout(limit, Bytes::from_request(req, &())).await {
        Ok(body) => parse(body),
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!(
                "the request body did not arrive within {} s (the server's --body-timeout)",
                secs(limit)
            ),
            param: None,
        }),
    }
}

/// Requests whose `Host` does not name this server are refused with 421 (see [`HostPolicy`]);
/// a request without one (not a browser's) is answered.
async fn check_host(State(st): State<AppState>, req: HttpRequest<Body>, next: Next) -> Response {
    if let Some(h) = req.headers().get(header::HOST) {
        let host = String::from_utf8_lossy(h.as_bytes()).into_owned();
        if !st.0.hosts.allows(&host) {
            let name = host_name(&host).unwrap_or_else(|| host.clone());
            return ApiError {
                status: StatusCode::MISDIRECTED_REQUEST,
                message: format!(
                    "the Host header `{host}` does not name this server: use its address or localhost, or start it with --allowed-host {name}"
                ),
                param: None,
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// The API's POST bodies are `application/json` only (415 otherwise): a web page may send
/// other types to any site without a CORS preflight.
async fn json_only(req: HttpRequest<Body>, next: Next) -> Response {
    if req.method() == Method::POST {
        let given = req
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let json = given.as_deref().is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
        if !json {
            return ApiError {
                status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
                message: format!(
                    "the body must be sent as `Content-Type: application/json`, not {}",
                    given.map_or("without a Content-Type".into(), |g| format!("`{g}`"))
                ),
                param: None,
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// `Authorization: Bearer KEY` (the scheme in any case), the key compared as SHA-256 digests
/// so that the time depends neither on its length nor on where it differs.
async fn auth(State(st): State<AppState>, req: HttpRequest<Body>, next: Next) -> Response {
    if let Some(want) = &st.0.key_digest {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer)
            .unwrap_or("");
        if !same_digest(&digest(given), want) {
            return ApiError {
                status: StatusCode::UNAUTHORIZED,
                message: "a valid API key is needed: send `Authorization: Bearer KEY`".into(),
                param: None,
            }
            .into_response();
        }
    }
    next.run(req).await
}

/// `/health`: 200 `{"status":"ready"}` once the model is loaded and warm, else 503 with
/// `loading` or `draining`.
pub fn health_response(stage: Stage) -> Response {
    let status = if stage == Stage::Ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"status": stage.as_str()}))).into_response()
}

/// `/health/live`: 200 whenever the process answers HTTP.
async fn live() -> Response {
    Json(json!({"status": "live"})).into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        st.0.metrics.render(),
    )
        .into_response()
}

/// Count each request by endpoint and status.
async fn count(State(st): State<AppState>, req: HttpRequest<Body>, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let r = next.run(req).await;
    st.0.metrics.request(&path, r.status().as_u16());
    r
}

/// The app: every endpoint, the body limit, the API key check, the panic guard.
pub fn router(state: AppState, max_body: usize) -> Router {
    let guarded = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn(json_only))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/", get(|| async { Html(PAGE) }))
        .route(
            "/health",
            get(|State(st): State<AppState>| async move { health_response(st.0.health.get()) }),
        )
        .route("/health/live", get(live))
        .merge(guarded)
        .layer(middleware::from_fn_with_state(state.clone(), check_host))
        .layer(DefaultBodyLimit::max(max_body))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "internal error: this request panicked; the server goes on".into(),
                    param: None,
                }
                .into_response()
            },
        ))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// What answers before the model is ready: `/health` 503 `loading`, `/health/live` 200, any
/// other path 503 with `Retry-After`.
fn loading_router() -> Router {
    Router::new()
        .route("/health", get(|| async { health_response(Stage::Loading) }))
        .route("/health/live", get(live))
        .fallback(|| async {
            let mut r = ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message:
                    "the model is loading: try again shortly (GET /health says ready when it is)"
                        .into(),
                param: None,
            }
            .into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        })
}

/// The router a server binds before its model is ready: it answers as [`loading_router`]
/// until `app` is set, then as `app`.
pub fn switch_router(app: Arc<std::sync::OnceLock<Router>>) -> Router {
    let loading = loading_router();
    Router::new().fallback(move |req: HttpRequest<Body>| {
        let app = app.clone();
        let loading = loading.clone();
        async move {
            use tower::Service;
            let mut r = app.get().cloned().unwrap_or(loading);
            r.call(req).await.unwrap_or_else(|e| match e {})
        }
    })
}

async fn models(State(st): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.0.model.name,
            "object": "model",
            "created": api::now_secs(),
            "owned_by": "keep",
        }],
    }))
}

async fn tokenize(
    State(st): State<AppState>,
    req: HttpRequest<Body>,
) -> std::result::Result<Json<Value>, ApiError> {
    let r: api::TokenizeRequest = read_json(&st, req).await?;
    let enc =
        st.0.tok
            .encode(r.prompt, r.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::bad(format!("cannot tokenize: {e}"), Some("prompt")))?;
    let ids = enc.get_ids();
    Ok(Json(json!({"tokens": ids, "count": ids.len()})))
}

async fn detokenize(
    State(st): State<AppState>,
    req: HttpRequest<Body>,
) -> std::result::Result<Json<Value>, ApiError> {
    let r: api::DetokenizeRequest = read_json(&st, req).await?;
    let vocab = st.0.tok.get_vocab_size(true) as u32;
    if let Some(&t) = r.tokens.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::bad(
            format!("token {t} is outside the vocabulary of {vocab}"),
            Some("tokens"),
        ));
    }
    let text =
        st.0.tok
            .decode(&r.tokens, true)
            .map_err(|e| ApiError::bad(format!("cannot detokenize: {e}"), Some("tokens")))?;
    Ok(Json(json!({"prompt": text})))
}

/// Which endpoint a generation answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// A generation ready to submit, and how to answer it.
struct Job {
    kind: Kind,
    id: String,
    stream: bool,
    include_usage: bool,
    /// Top alternatives per token (`Some` when logprobs were asked for).
    logprobs: Option<usize>,
}

/// Check the shared fields, queue the request; the event receiver.
fn submit(
    st: &AppState,
    kind: Kind,
    c: &Common,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
) -> std::result::Result<(Job, UnboundedReceiver<Event>), ApiError> {
    let inner = &st.0;
    if let Some(e) = inner.files.as_ref().and_then(|f| f.check().err()) {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: e.to_string(),
            param: None,
        });
    }
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::bad(
                format!("n = {n}: this server makes one choice per request (n = 1)"),
                Some("n"),
            ));
        }
    }
    let max_ctx = inner.max_context;
    if prompt.len() > max_ctx {
        return Err(ApiError::bad(
            format!(
                "the prompt is {} tokens, longer than this server's context limit of {max_ctx} tokens (--max-context)",
                prompt.len()
            ),
            Some(if kind == Kind::Chat { "messages" } else { "prompt" }),
        ));
    }
    let room = max_ctx - prompt.len();
    let asked = c.max_completion_tokens.or(c.max_tokens);
    let max_tokens = match (asked, kind) {
        (Some(n), _) => (n.min(usize::MAX as u64) as usize).min(room),
        (None, Kind::Completion) => DEFAULT_COMPLETION_TOKENS.min(room),
        (None, Kind::Chat) => room,
    };
    let seed = match c.seed {
        Some(s) => s as u64,
        None => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            t ^ inner
                .ids
                .load(Ordering::Relaxed)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        }
    };
    let sampling = SamplerConfig {
        temperature: c.temperature.unwrap_or(1.0),
        top_p: c.top_p.unwrap_or(1.0),
        seed,
    };
    sampling.check().map_err(|e| {
        ApiError::bad(
            e.to_string(),
            Some(
                if sampling.temperature.is_finite() && sampling.temperature >= 0.0 {
                    "top_p"
                } else {
                    "temperature"
                },
            ),
        )
    })?;
    let stop = c.stop.clone().map(|s| s.list()).unwrap_or_default();
    let (tx, rx) = unbounded_channel();
    let n = inner.ids.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Completion => format!("cmpl-keep-{n}"),
        Kind::Chat => format!("chatcmpl-keep-{n}"),
    };
    let req = Request {
        prompt,
        max_tokens,
        sampling,
        stop,
        logprobs,
        events: tx,
    };
    if !inner.engine.submit(req) {
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the server is shutting down".into(),
            param: None,
        });
    }
    let job = Job {
        kind,
        id,
        stream: c.stream.unwrap_or(false),
        include_usage: c
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        logprobs,
    };
    Ok((job, rx))
}

/// Prompt ids of a completion: text encoded as `keep run` encodes it (special tokens added),
/// ids as given; empty → the beginning-of-sequence token.
fn completion_prompt(st: &AppState, p: &PromptField) -> std::result::Result<Vec<u32>, ApiError> {
    let text = match p {
        PromptField::Text(t) => t.clone(),
        PromptField::Texts(v) if v.len() == 1 => v[0].clone(),
        PromptField::Texts(v) => {
            return Err(ApiError::bad(
                format!(
                    "{} prompts: this server takes one prompt per request",
                    v.len()
                ),
                Some("prompt"),
            ))
        }
        PromptField::Ids(ids) => {
            let vocab = st.0.tok.get_vocab_size(true) as u32;
            if let Some(&t) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ApiError::bad(
                    format!("token {t} is outside the vocabulary of {vocab}"),
                    Some("prompt"),
                ));
            }
            return Ok(if ids.is_empty() {
                vec![st.0.model.bos]
            } else {
                ids.clone()
            });
        }
    };
    encode(st, &text, true)
}

fn encode(st: &AppState, text: &str, special: bool) -> std::result::Result<Vec<u32>, ApiError> {
    let mut ids = if text.is_empty() {
        vec![]
    } else {
        st.0.tok
            .encode(text, special)
            .map_err(|e| ApiError::bad(format!("cannot tokenize the prompt: {e}"), Some("prompt")))?
            .get_ids()
            .to_vec()
    };
    if ids.is_empty() {
        ids.push(st.0.model.bos);
    }
    Ok(ids)
}

async fn completions(State(st): State<AppState>, req: HttpRequest<Body>) -> Response {
    let r: CompletionRequest = match read_json(&st, req).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if r.echo == Some(true) {
        return ApiError::bad("echo is not supported", Some("echo")).into_response();
    }
    if let Some(n) = r.logprobs {
        if n > 5 {
            return ApiError::bad(format!("logprobs = {n}: at most 5"), Some("logprobs"))
                .into_response();
        }
    }
    let prompt = match completion_prompt(&st, &r.prompt) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let logprobs = r.logprobs.map(|n| n as usize);
    match submit(&st, Kind::Completion, &r.common, prompt, logprobs) {
        Ok((job, rx)) => respond(st, job, rx).await,
        Err(e) => e.into_response(),
    }
}

async fn chat(State(st): State<AppState>, req: HttpRequest<Body>) -> Response {
    let r: ChatRequest = match read_json(&st, req).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let Some(template) = &st.0.template else {
        return ApiError::bad(
            "this model has no chat template (tokenizer_config.json `chat_template`); use /v1/completions",
            Some("messages"),
        )
        .into_response();
    };
    if r.messages.is_empty() {
        return ApiError::bad("messages is empty", Some("messages")).into_response();
    }
    let messages: Vec<Message> = r.messages.iter().map(|m| m.template_message()).collect();
    if let Some(n) = r.top_logprobs {
        if n > 20 {
            return ApiError::bad(
                format!("top_logprobs = {n}: at most 20"),
                Some("top_logprobs"),
            )
            .into_response();
        }
    }
    // The template writes the special tokens it wants (as transformers' apply_chat_template);
    // the messages' text is only text.
    let prompt = match template.encode_with(&st.0.tok, &st.0.plain_tok, &messages) {
        Ok(p) if p.is_empty() => vec![st.0.model.bos],
        Ok(p) => p,
        Err(e) => return ApiError::bad(e.to_string(), Some("messages")).into_response(),
    };
    let logprobs = (r.logprobs == Some(true)).then(|| r.top_logprobs.unwrap_or(0) as usize);
    match submit(&st, Kind::Chat, &r.common, prompt, logprobs) {
        Ok((job, rx)) => respond(st, job, rx).await,
        Err(e) => e.into_response(),
    }
}

/// The text of one token on its own.
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Completion-style logprobs of some tokens (`tokens`, `token_logprobs`, `top_logprobs`,
/// `text_offset` from `offset`).
fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = vec![];
    let mut values = vec![];
    let mut tops = vec![];
    let mut offsets = vec![];
    for lp in lps {
        let t = token_text(tok, lp.token);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        values.push(lp.logprob);
        let mut m = serde_json::Map::new();
        for &(id, v) in &lp.top {
            m.insert(token_text(tok, id), json!(v));
        }
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets})
}

/// Chat-style logprobs (`content`: token, logprob, bytes, top_logprobs).
fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, v: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": v, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = Value::Array(lp.top.iter().map(|&(i, v)| entry(i, v)).collect());
            e
        })
        .collect();
    json!({"content": content})
}

/// Answer a queued generation: one JSON body, or server-sent events.
async fn respond(st: AppState, job: Job, rx: UnboundedReceiver<Event>) -> Response {
    if job.stream {
        let stream = futures_util::stream::unfold(
            StreamState {
                st,
                job,
                rx,
                pending: VecDeque::new(),
                started: false,
                ended: false,
                offset: 0,
            },
            |mut s| async move {
                loop {
                    if let Some(data) = s.pending.pop_front() {
                        return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), s));
                    }
                    if s.ended {
                        return None;
                    }
                    s.advance().await;
                }
            },
        );
        return Sse::new(stream).into_response();
    }
    let mut rx = rx;
    let mut text = String::new();
    let mut lps = vec![];
    loop {
        match rx.recv().await {
            Some(Event::Token { text: t, logprob }) => {
                text.push_str(&t);
                lps.extend(logprob);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                return Json(final_body(
                    &st,
                    &job,
                    &text,
                    &lps,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                ))
                .into_response();
            }
            Some(Event::Error(m)) => {
                return ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: m,
                    param: None,
                }
                .into_response()
            }
            Some(Event::Unavailable(m)) => {
                return ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: m,
                    param: None,
                }
                .into_response()
            }
            None => {
                return ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    message: "the generation ended without a result".into(),
                    param: None,
                }
                .into_response()
            }
        }
    }
}

/// The whole (non-streamed) response.
fn final_body(
    st: &AppState,
    job: &Job,
    text: &str,
    lps: &[TokenLogprob],
    finish: Finish,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    let tok = &st.0.tok;
    let (object, choice) = match job.kind {
        Kind::Completion => (
            "text_completion",
            json!({
                "index": 0,
                "text": text,
                "logprobs": job.logprobs.map(|_| completion_logprobs(tok, lps, 0)),
                "finish_reason": finish.as_str(),
            }),
        ),
        Kind::Chat => (
            "chat.completion",
            json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": job.logprobs.map(|_| chat_logprobs(tok, lps)),
                "finish_reason": finish.as_str(),
            }),
        ),
    };
    json!({
        "id": job.id,
        "object": object,
        "created": api::now_secs(),
        "model": st.0.model.name,
        "choices": [choice],
        "usage": api::usage(prompt_tokens, completion_tokens),
    })
}

/// The state of one event stream.
struct StreamState {
    st: AppState,
    job: Job,
    rx: UnboundedReceiver<Event>,
    /// `data:` payloads ready to send.
    pending: VecDeque<String>,
    started: bool,
    ended: bool,
    /// Bytes of text sent so far (completion logprobs' `text_offset`).
    offset: usize,
}

impl StreamState {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let object = match self.job.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        let mut v = json!({
            "id": self.job.id,
            "object": object,
            "created": api::now_secs(),
            "model": self.st.0.model.name,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v.to_string()
    }

    fn choice(&self, text: &str, lps: &[TokenLogprob], finish: Option<Finish>) -> Value {
        let tok = &self.st.0.tok;
        match self.job.kind {
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": self.job.logprobs.map(|_| completion_logprobs(tok, lps, self.offset)),
                "finish_reason": finish.map(Finish::as_str),
            }),
            Kind::Chat => json!({
                "index": 0,
                "delta": if finish.is_some() && text.is_empty() { json!({}) } else { json!({"content": text}) },
                "logprobs": self.job.logprobs.map(|_| chat_logprobs(tok, lps)),
                "finish_reason": finish.map(Finish::as_str),
            }),
        }
    }

    /// Wait for the next event and queue what it sends.
    async fn advance(&mut self) {
        if !self.started && self.job.kind == Kind::Chat {
            self.started = true;
            let c = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            let data = self.chunk(c, None);
            self.pending.push_back(data);
            return;
        }
        self.started = true;
        match self.rx.recv().await {
            Some(Event::Token { text, logprob }) => {
                if text.is_empty() && logprob.is_none() {
                    return;
                }
                let lps: Vec<TokenLogprob> = logprob.into_iter().collect();
                let c = self.choice(&text, &lps, None);
                self.offset += text.len();
                let data = self.chunk(json!([c]), None);
                self.pending.push_back(data);
            }
            Some(Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                ..
            }) => {
                let c = self.choice("", &[], Some(finish));
                let data = self.chunk(json!([c]), None);
                self.pending.push_back(data);
                if self.job.include_usage {
                    let u = api::usage(prompt_tokens, completion_tokens);
                    let data = self.chunk(json!([]), Some(u));
                    self.pending.push_back(data);
                }
                self.pending.push_back("[DONE]".into());
                self.ended = true;
            }
            Some(Event::Error(m)) | Some(Event::Unavailable(m)) => {
                self.pending
                    .push_back(api::error_body(&m, "server_error", None).to_string());
                self.pending.push_back("[DONE]".into());
                self.ended = true;
            }
            None => {
                self.pending.push_back(
                    api::error_body(
                        "the generation ended without a result",
                        "server_error",
                        None,
                    )
                    .to_string(),
                );
                self.pending.push_back("[DONE]".into());
                self.ended = true;
            }
        }
    }
}

/// How to serve.
#[derive(Debug)]
pub struct ServeOptions {
    /// The model: the session the engine loads it from (its directory, kernels, budget), and
    /// plans for `max_context`.
    pub session: keep_runtime::Session,
    /// The id the model is listed as.
    pub name: String,
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_batch: usize,
    /// Most prompt + completion tokens of one request (at most the model's context).
    pub max_context: usize,
    pub max_body: usize,
    /// Host names answered besides IP addresses, `localhost` and `host` (`*`: any).
    pub allowed_hosts: Vec<String>,
    /// Timeouts, the connection cap and the shutdown deadline.
    pub limits: Limits,
}

/// What a server's context is called where the machine cannot hold it.
pub const SERVER_CONTEXT: &str = "this server's context";

/// What [`serve`] reports: once it listens (`stage` loading) and once the model is warm
/// (`stage` ready).
#[derive(Debug, Clone, Copy)]
pub struct Ready {
    pub addr: SocketAddr,
    /// The connection cap in force: `limits.max_connections`, or less where the open-file
    /// limit allows fewer.
    pub max_connections: usize,
    pub stage: Stage,
}

/// Waits for SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Bind, call `report` (stage loading), open the model and run one forward to warm it while
/// `/health` answers 503 `loading`, call `report` again (stage ready), serve until
/// SIGINT/SIGTERM, then drain: stop accepting, let the requests in flight finish (for up to the
/// shutdown timeout), and stop the scheduler. An empty API key is refused: it would let every
/// request in.
pub fn serve(opts: ServeOptions, mut report: impl FnMut(&Ready)) -> Result<()> {
    if opts.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(ServeError::Startup(
            "the API key is empty: give a non-empty key (--api-key or $KEEP_API_KEY), or none to serve without one".into(),
        ));
    }
    let tok = Arc::new(keep_model::generate::load_tokenizer(opts.session.dir())?);
    let template = ChatTemplate::from_model_dir(opts.session.dir())?;
    let limits = Limits {
        max_connections: crate::conn::fit_connections(opts.limits.max_connections),
        ..opts.limits
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ServeError::Io("starting the async runtime".into(), e))?;
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(&addr))
        .map_err(|e| ServeError::Io(format!("binding {addr}"), e))?;
    let local = listener
        .local_addr()
        .map_err(|e| ServeError::Io(format!("binding {addr}"), e))?;
    let health = Arc::new(Health::new(Stage::Loading));
    let metrics = Arc::new(Metrics::new());
    let app = Arc::new(std::sync::OnceLock::new());
    let mut ready = Ready {
        addr: local,
        max_connections: limits.max_connections,
        stage: Stage::Loading,
    };
    report(&ready);
    let (handle, rx) = engine::channel();
    let (ready_tx, ready_rx) =
        tokio::sync::oneshot::channel::<Result<(u32, usize, Arc<FileGuard>)>>();
    let (session, max_batch, max_context) = (opts.session, opts.max_batch, opts.max_context);
    let engine_tok = tok.clone();
    let engine_metrics = metrics.clone();
    let thread = std::thread::Builder::new()
        .name("keep-serve-model".into())
        .spawn(move || {
            let mut ready_tx = Some(ready_tx);
            let mut fail = |e: ServeError| {
                if let Some(t) = ready_tx.take() {
                    let _ = t.send(Err(e));
                }
            };
            let files = match FileGuard::of_checkpoint(session.checkpoint()) {
                Ok(f) => Arc::new(f),
                Err(e) => return fail(e),
            };
            // The engine batches without verify forwards: no drafter is attached (a plan that
            // drafts still has its drafter held in the budget it was fitted with).
            let what = keep_runtime::LoadFor {
                context: Some(max_context),
                label: Some(SERVER_CONTEXT),
                undrafted: true,
                ..Default::default()
            };
            let mut model = match session.load(what) {
                Ok((m, _)) => m,
                Err(e) => return fail(e.into()),
            };
            let cfg = model.cfg();
            let (bos, limit) = (cfg.bos, cfg.raw.max_position_embeddings);
            // Warm up: one forward of one token, so that the first request finds the model's
            // pages and (under a budget) its slots as a running server has them.
            let mut cache = model.new_cache();
            let warm = catch_unwind_silent(|| model.forward_last(&[bos], &mut cache, None));
            drop(cache);
            match warm {
                Some(Ok(_)) => {}
                Some(Err(e)) => return fail(e.into()),
                None => {
                    return fail(ServeError::Startup(
                        "the model panicked in its warm-up forward".into(),
                    ))
                }
            }
            let Some(t) = ready_tx.take() else { return };
            if t.send(Ok((bos, limit, files.clone()))).is_err() {
                return;
            }
            let opts = EngineOptions {
                max_batch,
                files: Some(files),
                metrics: Some(engine_metrics.clone()),
            };
            engine::run_observed(&mut model, &engine_tok, rx, opts, |m| {
                if let Some(b) = m.budgeted() {
                    let s = b.cache().stats();
                    engine_metrics.experts(s.hits, s.misses, s.bytes_read);
                }
            });
        })
        .map_err(|e| ServeError::Io("starting the model thread".into(), e))?;
    let app_opts = AppOptions {
        api_key: opts.api_key.clone(),
        max_context: opts.max_context,
        hosts: HostPolicy::for_bind(&opts.host, &opts.allowed_hosts),
        body_timeout: opts.limits.body_timeout,
        files: None,
        health: health.clone(),
        metrics,
    };
    let (name, max_body, max_context) = (opts.name.clone(), opts.max_body, opts.max_context);
    let switch = switch_router(app.clone());
    let outcome = rt.block_on(async move {
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<()>();
        let drain_health = health.clone();
        let shutdown = async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                _ = failed_rx => {}
            }
            drain_health.set(Stage::Draining);
        };
        let mut serving = tokio::spawn(crate::conn::serve_connections(
            listener, switch, limits, shutdown,
        ));
        let loading = async {
            let (bos, limit, files) = ready_rx.await.map_err(|_| {
                ServeError::Startup("the model thread stopped while loading".into())
            })??;
            if max_context > limit {
                return Err(ServeError::Startup(format!(
                    "--max-context {max_context} is more than the model's {limit} positions (max_position_embeddings)"
                )));
            }
            let state = AppState::new(
                handle,
                tok,
                template,
                ModelInfo { name, bos },
                AppOptions {
                    files: Some(files),
                    ..app_opts
                },
            );
            let _ = app.set(router(state, max_body));
            Ok(())
        };
        // A signal while loading ends serving before the model is ready: stop without
        // waiting for the load.
        let loaded = tokio::select! {
            r = loading => r,
            _ = &mut serving => return Ok(false),
        };
        match &loaded {
            Ok(()) => {
                // Ready unless a signal came while loading.
                if health.ready_if_loading() {
                    ready.stage = Stage::Ready;
                    report(&ready);
                }
            }
            Err(_) => {
                let _ = failed_tx.send(());
            }
        }
        let _ = serving.await;
        // The app (and the scheduler's last handle in it) goes with the router.
        drop(app);
        loaded.map(|()| true)
    });
    // Connections still open after the shutdown deadline are dropped with the runtime.
    drop(rt);
    if !outcome? {
        // Stopped while loading: the model thread stops once it has loaded (nobody waits).
        return Ok(());
    }
    // Every handle is gone with the app: the scheduler drops the requests whose clients are
    // gone, finishes the others and returns.
    let _ = thread.join();
    Ok(())
}

/// `f()`, or `None` if it panicked.
fn catch_unwind_silent<T>(f: impl FnOnce() -> T) -> Option<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).ok()
}
