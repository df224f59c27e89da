//! The server's router over a live scheduler, without a socket (tower's `oneshot`): on the
//! bundled keep-tiny, greedy completions equal keep-model's `generate` alone and with eight
//! requests at once, streams end with the usage chunk and `[DONE]`, stop strings cut the text,
//! logprobs are log-probabilities; every refusal is its 4xx with an OpenAI error body; and on a
//! model that panics for one prompt, that request gets a 500 and the next one is answered.
//! What a web page could make it do is refused: a body that is not JSON (415), a `Host` that
//! does not name the server (421); no CORS header is sent; `Bearer` is taken in any case.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use keep_checkpoint::Checkpoint;
use keep_model::generate::{generate, GenerateOptions, Piece, Prompt, SamplerConfig};
use keep_model::{Cache, Generate, Model, ModelConfig, RouteObserver};
use keep_serve::engine::{self, EngineOptions};
use keep_serve::files::FileGuard;
use keep_serve::server::{router, AppOptions, AppState, HostPolicy, ModelInfo};
use keep_serve::template::ChatTemplate;
use serde_json::{json, Value};
use tower::ServiceExt;

/// Body limit of the test router (small, so that 413 is cheap to reach).
const MAX_BODY: usize = 64 << 10;
/// Context limit of the test router.
const MAX_CONTEXT: usize = 256;
/// Log-probabilities are log-softmax in f64 then rounded to f32: their exponentials sum to 1
/// within this.
const LOGPROB_SUM_TOL: f64 = 1e-3;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

fn tokenizer() -> Arc<tokenizers::Tokenizer> {
    Arc::new(keep_model::generate::load_tokenizer(&tiny()).unwrap())
}

/// A router over keep-tiny on its own scheduler thread.
fn tiny_app(api_key: Option<&str>) -> Router {
    tiny_app_with(AppOptions {
        api_key: api_key.map(String::from),
        ..AppOptions::new(MAX_CONTEXT)
    })
}

/// A router over keep-tiny with these options.
fn tiny_app_with(opts: AppOptions) -> Router {
    let tok = tokenizer();
    let (handle, rx) = engine::channel();
    let t = tok.clone();
    let metrics = opts.metrics.clone();
    std::thread::spawn(move || {
        let ck = Checkpoint::open(&tiny()).unwrap();
        let mut m = Model::load(&ck).unwrap();
        let eo = EngineOptions {
            metrics: Some(metrics),
            ..EngineOptions::new(8)
        };
        engine::run(&mut m, &t, rx, eo);
    });
    let template = ChatTemplate::from_model_dir(&tiny()).unwrap();
    let state = AppState::new(
        handle,
        tok,
        template,
        ModelInfo {
            name: "keep-tiny".into(),
            bos: 0,
        },
        opts,
    );
    router(state, MAX_BODY)
}

async fn post(
    app: &Router,
    path: &str,
    body: impl Into<Body>,
    key: Option<&str>,
) -> (StatusCode, Vec<u8>) {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let resp = app
        .clone()
        .oneshot(b.body(body.into()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, bytes.to_vec())
}

async fn post_json(app: &Router, path: &str, v: Value) -> (StatusCode, Value) {
    let (s, b) = post(app, path, v.to_string(), None).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// keep-model's greedy text for `prompt` (what `keep run --temperature 0` prints after it).
fn greedy_alone(prompt: &str, max_tokens: usize) -> String {
    let tok = tokenizer();
    let ck = Checkpoint::open(&tiny()).unwrap();
    let mut m = Model::load(&ck).unwrap();
    let opts = GenerateOptions {
        max_tokens,
        sampling: SamplerConfig {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        },
        tokenizer: Some(&tok),
    };
    let mut out = String::new();
    generate(&mut m, Prompt::Text(prompt), &opts, None, |p| {
        if let Piece::Text(s) = p {
            out.push_str(s);
        }
        ControlFlow::Continue(())
    })
    .unwrap();
    out
}

const PROMPTS: [&str; 8] = [
    "def main(",
    "import os\n",
    "class Foo:\n    def",
    "# Copyright",
    "for i in range(",
    "return self.",
    "if __name__ ==",
    "x = [",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_completions_equal_generate_alone_and_eight_at_once() {
    let app = tiny_app(None);
    let want: Vec<String> = PROMPTS.iter().map(|p| greedy_alone(p, 24)).collect();
    let req = |p: &str| json!({"prompt": p, "max_tokens": 24, "temperature": 0});
    let (s, v) = post_json(&app, "/v1/completions", req(PROMPTS[0])).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], want[0]);
    assert_eq!(v["object"], "text_completion");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    let all = futures_util::future::join_all(
        PROMPTS
            .iter()
            .map(|p| post_json(&app, "/v1/completions", req(p))),
    )
    .await;
    for ((s, v), w) in all.iter().zip(&want) {
        assert_eq!(*s, StatusCode::OK, "{v}");
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), w);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_stops_logprobs_and_chat() {
    let app = tiny_app(None);
    // A stream: text chunks, the finish chunk, the usage chunk, [DONE].
    let (s, body) = post(
        &app,
        "/v1/completions",
        json!({"prompt": "def main(", "max_tokens": 12, "temperature": 0, "stream": true,
               "stream_options": {"include_usage": true}})
        .to_string(),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let text = String::from_utf8(body).unwrap();
    let datas: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*datas.last().unwrap(), "[DONE]");
    let usage: Value = serde_json::from_str(datas[datas.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    let streamed: String = datas[..datas.len() - 2]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, greedy_alone("def main(", 12));

    // A stop string cuts the text before it, whatever tokens it spans.
    let full = greedy_alone("import os\n", 32);
    let cut = full.len() / 2;
    let stop: String = full[cut..].chars().take(3).collect();
    let (s, v) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": "import os\n", "max_tokens": 32, "temperature": 0, "stop": [stop]}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let got = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(got, &full[..full.find(&stop).unwrap()]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // Logprobs: the greedy token is the most likely, and the top list is a distribution's head.
    let (s, v) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": "def ", "max_tokens": 4, "temperature": 0, "logprobs": 5}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 5);
        let best = top
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(best, lp["token_logprobs"][i].as_f64().unwrap());
        let mass: f64 = top.values().map(|x| x.as_f64().unwrap().exp()).sum();
        assert!(mass <= 1.0 + LOGPROB_SUM_TOL, "{mass}");
    }

    // Chat through the bundled model's template, streamed, with a seed: twice the same.
    let chat = json!({"messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 8,
                      "temperature": 0.9, "seed": 7});
    let (s, a) = post_json(&app, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(s, StatusCode::OK, "{a}");
    let (_, b) = post_json(&app, "/v1/chat/completions", chat).await;
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_their_4xx_with_an_openai_error_body() {
    let app = tiny_app(Some("sesame"));
    let ok = json!({"prompt": "x", "max_tokens": 1}).to_string();
    let (s, _) = post(&app, "/v1/completions", ok.clone(), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = post(&app, "/v1/completions", ok.clone(), Some("wrong!")).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _) = post(&app, "/v1/completions", ok, Some("sesame")).await;
    assert_eq!(s, StatusCode::OK);
    let key = Some("sesame");
    let cases: Vec<(String, StatusCode, &str)> = vec![
        (
            "{not json".into(),
            StatusCode::BAD_REQUEST,
            "not valid JSON",
        ),
        (
            json!({"prompt": 3}).to_string(),
            StatusCode::BAD_REQUEST,
            "match",
        ),
        (
            json!({"prompt": "x", "max_tokens": "9"}).to_string(),
            StatusCode::BAD_REQUEST,
            "match",
        ),
        (
            json!({"prompt": "x", "temperature": -1}).to_string(),
            StatusCode::BAD_REQUEST,
            "temperature",
        ),
        (
            json!({"prompt": "x", "top_p": 0}).to_string(),
            StatusCode::BAD_REQUEST,
            "top-p",
        ),
        (
            json!({"prompt": "x", "n": 2}).to_string(),
            StatusCode::BAD_REQUEST,
            "n = 2",
        ),
        (
            json!({"prompt": "x ".repeat(MAX_CONTEXT + 10)}).to_string(),
            StatusCode::BAD_REQUEST,
            "256",
        ),
        (
            json!({"prompt": "x".repeat(MAX_BODY + 1)}).to_string(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "larger",
        ),
    ];
    for (body, status, says) in cases {
        let (s, b) = post(&app, "/v1/completions", body.clone(), key).await;
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(s, status, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (s, b) = post(
        &app,
        "/v1/chat/completions",
        json!({"messages": []}).to_string(),
        key,
    )
    .await;
    assert_eq!(
        s,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(&b)
    );
    let resp = app
        .clone()
        .oneshot(Request::get("/health").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = app
        .clone()
        .oneshot(Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// A model whose logits favour `(last token + 1) % vocab`, and that panics on token 7.
struct Panicky {
    cfg: ModelConfig,
}

impl Generate for Panicky {
    fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }
    fn new_cache(&self) -> Cache {
        Cache::new(0)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        _: &mut Cache,
        _: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        assert!(!tokens.contains(&7), "token 7 breaks this model");
        let mut l = vec![0f32; self.cfg.vocab];
        l[(*tokens.last().unwrap() as usize + 1) % self.cfg.vocab] = 1.0;
        Ok(l)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_one_request_leaves_the_server_up() {
    let json = r#"{"vocab_size":4096,"bos_token_id":0,"eos_token_id":[4095]}"#;
    let c = keep_checkpoint::DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap();
    let cfg = ModelConfig::from_deepseek(&c).unwrap();
    let tok = tokenizer();
    let (handle, rx) = engine::channel();
    let t = tok.clone();
    std::thread::spawn(move || engine::run(&mut Panicky { cfg }, &t, rx, EngineOptions::new(4)));
    let state = AppState::new(
        handle,
        tok,
        None,
        ModelInfo {
            name: "panicky".into(),
            bos: 0,
        },
        AppOptions::new(MAX_CONTEXT),
    );
    let app = router(state, MAX_BODY);
    // Prefill panics.
    let (s, v) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [1, 7], "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("panicked"));
    // A decode step panics (the model's next token after 6 is 7).
    let (s, _) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [5], "max_tokens": 5, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    // And the server still answers.
    let (s, v) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [100], "max_tokens": 3, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // No chat template: refused, not guessed.
    let (s, _) = post_json(
        &app,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
}

/// One request with these headers: its status, headers and body.
async fn send(
    app: &Router,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (StatusCode, axum::http::HeaderMap, Value) {
    let mut b = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::from(body.to_string())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_web_page_sends_is_refused() {
    let app = tiny_app_with(AppOptions {
        hosts: HostPolicy::for_bind("127.0.0.1", &["keep.example".into()]),
        ..AppOptions::new(MAX_CONTEXT)
    });
    let body = json!({"prompt": "def ", "max_tokens": 2, "temperature": 0}).to_string();
    // A form or text/plain POST (what any page may send cross-site without a preflight).
    for ct in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        None,
    ] {
        for path in [
            "/v1/completions",
            "/v1/chat/completions",
            "/tokenize",
            "/detokenize",
        ] {
            let h: Vec<(&str, &str)> = ct.iter().map(|c| ("content-type", *c)).collect();
            let (s, _, v) = send(&app, "POST", path, &h, &body).await;
            assert_eq!(s, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{path} {ct:?}: {v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains("application/json"), "{msg}");
        }
    }
    // JSON, with parameters and in any case, is served.
    for ct in ["application/json", "Application/JSON; charset=utf-8"] {
        let (s, _, v) = send(
            &app,
            "POST",
            "/v1/completions",
            &[("content-type", ct)],
            &body,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{ct}: {v}");
    }
    // Host: addresses, localhost and the allowed names are answered; another name (a page
    // that re-pointed its own name at this address) is not.
    let json_ct = ("content-type", "application/json");
    for host in [
        "127.0.0.1:8080",
        "localhost:8080",
        "LOCALHOST",
        "[::1]:8080",
        "192.168.1.5",
        "keep.example:8080",
        "keep.example.",
    ] {
        let (s, _, v) = send(&app, "GET", "/health", &[("host", host)], "").await;
        assert_eq!(s, StatusCode::OK, "{host}: {v}");
        let (s, _, v) = send(
            &app,
            "POST",
            "/v1/completions",
            &[("host", host), json_ct],
            &body,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{host}: {v}");
    }
    for host in [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "",
    ] {
        for (method, path) in [("GET", "/"), ("POST", "/v1/completions")] {
            let (s, _, v) = send(&app, method, path, &[("host", host), json_ct], &body).await;
            assert_eq!(s, StatusCode::MISDIRECTED_REQUEST, "{host} {path}: {v}");
            if !host.is_empty() {
                let msg = v["error"]["message"].as_str().unwrap();
                assert!(msg.contains("--allowed-host"), "{msg}");
            }
        }
    }
    // No CORS header, to a simple request or a preflight from another origin.
    let origin = ("origin", "http://evil.example");
    for (method, path, h) in [
        ("GET", "/v1/models", vec![origin]),
        ("POST", "/v1/completions", vec![origin, json_ct]),
        (
            "OPTIONS",
            "/v1/chat/completions",
            vec![
                origin,
                ("access-control-request-method", "POST"),
                ("access-control-request-headers", "content-type"),
            ],
        ),
    ] {
        let (_, headers, _) = send(&app, method, path, &h, &body).await;
        let cors: Vec<_> = headers
            .keys()
            .filter(|k| k.as_str().starts_with("access-control-"))
            .collect();
        assert!(cors.is_empty(), "{method} {path}: {cors:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_taken_with_bearer_in_any_case() {
    let app = tiny_app(Some("sesame"));
    let json_ct = ("content-type", "application/json");
    for auth in [
        "Bearer sesame",
        "bearer sesame",
        "BEARER sesame",
        "Bearer  sesame ",
    ] {
        let (s, _, v) = send(
            &app,
            "POST",
            "/tokenize",
            &[("authorization", auth), json_ct],
            r#"{"prompt": "hi"}"#,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{auth}: {v}");
    }
    for auth in [
        "Bearer sesam",
        "Bearer sesame2",
        "Basic sesame",
        "sesame",
        "Bearer",
        "Bearer ",
    ] {
        let (s, _, v) = send(
            &app,
            "POST",
            "/tokenize",
            &[("authorization", auth), json_ct],
            r#"{"prompt": "hi"}"#,
        )
        .await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{auth}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_token_text_in_chat_content_is_not_the_special_token() {
    let app = tiny_app(None);
    let eot = "<|endoftext|>";
    // The chat page's prompt ids, through the server: what the template renders around the
    // message, the message's characters as text.
    let (s, v) = post_json(
        &app,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": format!("hi {eot} there")}],
               "max_tokens": 1, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let tok = tokenizer();
    let template = ChatTemplate::from_model_dir(&tiny()).unwrap().unwrap();
    let rendered = template
        .render(&[keep_serve::template::Message {
            role: "user".into(),
            content: format!("hi {eot} there"),
        }])
        .unwrap();
    let as_special = tok.encode(rendered.as_str(), false).unwrap().len();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    // `<|endoftext|>` as text is several tokens, as the special token one.
    assert!(
        prompt_tokens > as_special,
        "{prompt_tokens} vs {as_special}"
    );
}

/// A model whose shard is cut short while it reads it: `forward_last` truncates the file and
/// fails as a short `pread` does.
struct ShortRead {
    cfg: ModelConfig,
    shard: PathBuf,
}

impl Generate for ShortRead {
    fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }
    fn new_cache(&self) -> Cache {
        Cache::new(0)
    }
    fn forward_last(
        &mut self,
        _: &[u32],
        _: &mut Cache,
        _: Option<&mut dyn RouteObserver>,
    ) -> keep_model::Result<Vec<f32>> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.shard)
            .unwrap();
        f.set_len(10).unwrap();
        Err(keep_model::ModelError::Config(format!(
            "{}: read 10 of 4096 bytes: the file is shorter than its header says",
            self.shard.display()
        )))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_cut_short_by_a_changed_file_is_503_naming_it() {
    let dir = std::env::temp_dir().join(format!("keep-serve-short-read-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let shard = dir.join("model-00001-of-00002.safetensors");
    std::fs::write(&shard, vec![0u8; 4096]).unwrap();
    let files = Arc::new(FileGuard::of_paths(std::slice::from_ref(&shard)).unwrap());
    let json = r#"{"vocab_size":4096,"bos_token_id":0,"eos_token_id":[4095]}"#;
    let c = keep_checkpoint::DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap();
    let cfg = ModelConfig::from_deepseek(&c).unwrap();
    let tok = tokenizer();
    let (handle, rx) = engine::channel();
    let t = tok.clone();
    let (f, sh) = (files.clone(), shard.clone());
    std::thread::spawn(move || {
        let opts = EngineOptions {
            max_batch: 4,
            files: Some(f),
            metrics: None,
        };
        engine::run(&mut ShortRead { cfg, shard: sh }, &t, rx, opts)
    });
    let state = AppState::new(
        handle,
        tok,
        None,
        ModelInfo {
            name: "short".into(),
            bos: 0,
        },
        AppOptions {
            files: Some(files),
            ..AppOptions::new(MAX_CONTEXT)
        },
    );
    let app = router(state, MAX_BODY);
    // The read fails because the file changed: 503 naming the file, not a 500.
    let (s, v) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [1, 2], "max_tokens": 3}),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("model-00001-of-00002.safetensors"), "{msg}");
    assert!(
        msg.contains("4096 bytes when opened, 10 bytes now"),
        "{msg}"
    );
    // And every later request is refused before the model runs.
    let (s, _) = post_json(
        &app,
        "/v1/completions",
        json!({"prompt": [1], "max_tokens": 1, "stream": true}),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let _ = std::fs::remove_dir_all(&dir);
}

async fn get_path(app: &Router, path: &str, key: Option<&str>) -> (StatusCode, String) {
    let mut b = Request::get(path);
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// The value of the sample line `name` (exactly, labels included) in a scrape.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok())?
    })
}

/// Every line of a scrape is a `# HELP`/`# TYPE`/`# UNIT` line, `# EOF`, or a sample
/// `name{labels} value` whose name a `# TYPE` line declared; the samples' names.
fn check_exposition(text: &str) -> Vec<String> {
    let mut families = vec![];
    let mut names = vec![];
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(l);
            assert!(
                ["counter", "gauge", "histogram", "info", "unknown"].contains(&kind),
                "{l}"
            );
            families.push(name.to_string());
            continue;
        }
        if l.starts_with("# HELP ") || l.starts_with("# UNIT ") || l == "# EOF" {
            continue;
        }
        assert!(!l.starts_with('#'), "unknown comment line: {l}");
        let (series, value) = l.rsplit_once(' ').expect(l);
        assert!(value.parse::<f64>().is_ok(), "not a number: {l}");
        let name = series.split('{').next().unwrap();
        assert!(
            name.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':'),
            "{l}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "{l}");
            }
        }
        assert!(
            families.iter().any(|f| name.starts_with(f.as_str())),
            "sample {name} has no # TYPE line"
        );
        names.push(name.to_string());
    }
    assert_eq!(text.lines().last(), Some("# EOF"));
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_and_tokens_in_prometheus_text() {
    let app = tiny_app(Some("sesame"));
    // Behind the API key, as /v1 is.
    let (s, _) = get_path(&app, "/metrics", None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, before) = get_path(&app, "/metrics", Some("sesame")).await;
    assert_eq!(s, StatusCode::OK);
    check_exposition(&before);
    let body = json!({"prompt": "def ", "max_tokens": 5, "temperature": 0}).to_string();
    let (s, b) = post(&app, "/v1/completions", body, Some("sesame")).await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b).unwrap();
    let made = v["usage"]["completion_tokens"].as_u64().unwrap() as f64;
    assert!(made >= 1.0);
    let (s, after) = get_path(&app, "/metrics", Some("sesame")).await;
    assert_eq!(s, StatusCode::OK);
    let names = check_exposition(&after);
    for want in [
        "keep_requests_total",
        "keep_generated_tokens_total",
        "keep_prompt_tokens_total",
        "keep_queue_depth",
        "keep_batch_size_bucket",
        "keep_decode_tokens_per_second",
        "keep_expert_hit_rate",
        "keep_expert_read_bytes_total",
        "keep_resident_memory_bytes",
    ] {
        assert!(names.iter().any(|n| n == want), "no {want} in\n{after}");
    }
    let ok = r#"keep_requests_total{endpoint="/v1/completions",status="200"}"#;
    assert_eq!(sample(&before, ok), None, "{before}");
    assert_eq!(sample(&after, ok), Some(1.0), "{after}");
    assert_eq!(
        sample(
            &after,
            r#"keep_requests_total{endpoint="/metrics",status="401"}"#
        ),
        Some(1.0),
        "{after}"
    );
    let tokens = |t: &str| sample(t, "keep_generated_tokens_total").unwrap_or(0.0);
    assert_eq!(tokens(&after) - tokens(&before), made, "{after}");
    assert!(sample(&after, "keep_prompt_tokens_total").unwrap() >= 1.0);
    assert!(sample(&after, "keep_resident_memory_bytes").unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_loading_ready_or_draining_and_live_is_200() {
    use keep_serve::metrics::{Health, Stage};
    let health = Arc::new(Health::new(Stage::Loading));
    let app = tiny_app_with(AppOptions {
        health: health.clone(),
        ..AppOptions::new(MAX_CONTEXT)
    });
    for (stage, status, says) in [
        (Stage::Loading, StatusCode::SERVICE_UNAVAILABLE, "loading"),
        (Stage::Ready, StatusCode::OK, "ready"),
        (Stage::Draining, StatusCode::SERVICE_UNAVAILABLE, "draining"),
    ] {
        health.set(stage);
        let (s, b) = get_path(&app, "/health", None).await;
        assert_eq!(s, status, "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["status"], says, "{b}");
        let (s, _) = get_path(&app, "/health/live", None).await;
        assert_eq!(s, StatusCode::OK);
    }
    // Before the model is set in, the bound server answers as loading.
    let cell = Arc::new(std::sync::OnceLock::new());
    let switch = keep_serve::server::switch_router(cell.clone());
    let (s, b) = get_path(&switch, "/health", None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert!(b.contains("loading"), "{b}");
    let (s, _) = get_path(&switch, "/health/live", None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = post(&switch, "/v1/completions", "{}", None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&b).contains("loading"));
    health.set(Stage::Ready);
    cell.set(app).unwrap();
    let (s, b) = get_path(&switch, "/health", None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, v) = post_json(
        &switch,
        "/v1/completions",
        json!({"prompt": "def ", "max_tokens": 2, "temperature": 0}),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
}
