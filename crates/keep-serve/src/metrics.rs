//! What `/metrics` reports ([`Metrics`], Prometheus/OpenMetrics text through
//! `prometheus-client`) and what `/health` says ([`Health`]: loading, ready, draining).
//!
//! The counters are cumulative (a scraper rates them: `rate(keep_generated_tokens_total[1m])`
//! is tokens per second); the gauges are read when they change (queue depth, batch size,
//! the last decode step's tokens per second) or at the scrape (resident memory). Expert
//! counters move only under a memory budget (the slot cache counts hits, misses and bytes
//! read); a mapped model reports zero.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Where the server is in its life, as `/health` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Listening; the model is loading or warming up (`/health`: 503 `loading`).
    Loading,
    /// The model is loaded and has run a forward (`/health`: 200 `ready`).
    Ready,
    /// SIGINT/SIGTERM came: no new connections, requests in flight finish (`/health`: 503
    /// `draining`).
    Draining,
}

impl Stage {
    /// The `status` field of `/health`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Loading => "loading",
            Stage::Ready => "ready",
            Stage::Draining => "draining",
        }
    }
}

/// The server's [`Stage`], shared by the connection layer and the handlers.
#[derive(Debug)]
pub struct Health(AtomicU8);

impl Health {
    pub fn new(stage: Stage) -> Health {
        Health(AtomicU8::new(stage as u8))
    }

    pub fn get(&self) -> Stage {
        match self.0.load(Ordering::Acquire) {
            0 => Stage::Loading,
            1 => Stage::Ready,
            _ => Stage::Draining,
        }
    }

    pub fn set(&self, stage: Stage) {
        self.0.store(stage as u8, Ordering::Release);
    }

    /// Loading → ready; `false` (and no change) when it is draining already.
    pub fn ready_if_loading(&self) -> bool {
        self.0
            .compare_exchange(
                Stage::Loading as u8,
                Stage::Ready as u8,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }
}

/// The labels of `keep_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: u16,
}

/// The server's counters and gauges (one per server, shared by the handlers and the
/// scheduler).
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    prompt_tokens: Counter,
    generated_tokens: Counter,
    decode_steps: Counter,
    tokens_per_second: Gauge<f64, AtomicU64>,
    queue_depth: Gauge,
    active_sequences: Gauge,
    batch_size: Histogram,
    expert_hits: Counter,
    expert_misses: Counter,
    expert_bytes_read: Counter,
    expert_hit_rate: Gauge<f64, AtomicU64>,
    rss: Gauge,
    peak_rss: Gauge,
    /// The slot cache's cumulative counters last seen (hits, misses, bytes).
    experts_seen: Mutex<(u64, u64, u64)>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

/// The endpoints counted by name; any other path is counted as `other`.
const ENDPOINTS: [&str; 10] = [
    "/",
    "/health",
    "/health/live",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/favicon.ico",
];

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("keep");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "HTTP requests answered, by endpoint and status",
            requests.clone(),
        );
        let prompt_tokens = Counter::default();
        registry.register(
            "prompt_tokens",
            "Prompt tokens of the generations admitted",
            prompt_tokens.clone(),
        );
        let generated_tokens = Counter::default();
        registry.register(
            "generated_tokens",
            "Tokens generated (rate it for tokens per second)",
            generated_tokens.clone(),
        );
        let decode_steps = Counter::default();
        registry.register(
            "decode_steps",
            "Batched decode steps run",
            decode_steps.clone(),
        );
        let tokens_per_second = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "decode_tokens_per_second",
            "Tokens per second of the last batched decode step",
            tokens_per_second.clone(),
        );
        let queue_depth = Gauge::default();
        registry.register(
            "queue_depth",
            "Requests waiting for a place in the batch",
            queue_depth.clone(),
        );
        let active_sequences = Gauge::default();
        registry.register(
            "active_sequences",
            "Sequences being decoded (the current batch)",
            active_sequences.clone(),
        );
        let batch_size = Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0]);
        registry.register(
            "batch_size",
            "Sequences per batched decode step",
            batch_size.clone(),
        );
        let expert_hits = Counter::default();
        registry.register(
            "expert_hits",
            "Routed experts found resident in the slot cache (memory budget only)",
            expert_hits.clone(),
        );
        let expert_misses = Counter::default();
        registry.register(
            "expert_misses",
            "Routed experts read into the slot cache (memory budget only)",
            expert_misses.clone(),
        );
        let expert_bytes_read = Counter::default();
        registry.register(
            "expert_read_bytes",
            "Bytes of experts read from the model's files (memory budget only)",
            expert_bytes_read.clone(),
        );
        let expert_hit_rate = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "expert_hit_rate",
            "Hits / (hits + misses) of the slot cache since start (memory budget only)",
            expert_hit_rate.clone(),
        );
        let rss = Gauge::default();
        registry.register(
            "resident_memory_bytes",
            "Resident set size of the process",
            rss.clone(),
        );
        let peak_rss = Gauge::default();
        registry.register(
            "peak_resident_memory_bytes",
            "Peak resident set size of the process",
            peak_rss.clone(),
        );
        Metrics {
            registry,
            requests,
            prompt_tokens,
            generated_tokens,
            decode_steps,
            tokens_per_second,
            queue_depth,
            active_sequences,
            batch_size,
            expert_hits,
            expert_misses,
            expert_bytes_read,
            expert_hit_rate,
            rss,
            peak_rss,
            experts_seen: Mutex::new((0, 0, 0)),
        }
    }

    /// One request answered on `path` with `status`.
    pub fn request(&self, path: &str, status: u16) {
        let endpoint = if ENDPOINTS.contains(&path) {
            path
        } else {
            "other"
        };
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_string(),
                status,
            })
            .inc();
    }

    /// A generation admitted with this many prompt tokens.
    pub fn admitted(&self, prompt_tokens: usize) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
    }

    /// One token generated.
    pub fn token(&self) {
        self.generated_tokens.inc();
    }

    /// The scheduler's queue and batch between steps.
    pub fn scheduler(&self, queued: usize, active: usize) {
        self.queue_depth.set(queued as i64);
        self.active_sequences.set(active as i64);
    }

    /// A batched decode step of `batch` sequences that took `secs`.
    pub fn step(&self, batch: usize, secs: f64) {
        self.decode_steps.inc();
        self.batch_size.observe(batch as f64);
        if secs > 0.0 {
            self.tokens_per_second.set(batch as f64 / secs);
        }
    }

    /// The slot cache's cumulative counters (hits, misses, bytes read).
    pub fn experts(&self, hits: u64, misses: u64, bytes: u64) {
        let mut seen = self.experts_seen.lock().unwrap_or_else(|p| p.into_inner());
        self.expert_hits.inc_by(hits.saturating_sub(seen.0));
        self.expert_misses.inc_by(misses.saturating_sub(seen.1));
        self.expert_bytes_read.inc_by(bytes.saturating_sub(seen.2));
        *seen = (hits.max(seen.0), misses.max(seen.1), bytes.max(seen.2));
        let (h, m) = (seen.0, seen.1);
        if h + m > 0 {
            self.expert_hit_rate.set(h as f64 / (h + m) as f64);
        }
    }

    /// The text a scrape gets (OpenMetrics text, which Prometheus reads), with the resident
    /// memory read now.
    pub fn render(&self) -> String {
        if let Some(b) = keep_runtime::rss_bytes() {
            self.rss.set(b.min(i64::MAX as u64) as i64);
        }
        if let Some(b) = keep_runtime::peak_rss_bytes() {
            self.peak_rss.set(b.min(i64::MAX as u64) as i64);
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
