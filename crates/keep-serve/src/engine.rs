//! The scheduler: one thread owns the model and runs continuous batching ([`run`]). Requests
//! arrive on a channel ([`EngineHandle::submit`]); between decode steps the scheduler admits
//! queued requests up to `max_batch` (each prefilled alone on its own new cache), then runs
//! one batched step over every active sequence (`Generate::forward_batch`: one row per
//! sequence), and samples each row with that sequence's own [`Decoder`] (keep-model's, the one
//! `generate` uses, so sampling, end-of-sequence and limits behave exactly as in `keep run`).
//! Each sampled token goes to its request's event channel after the stop strings have had
//! their say; a request whose receiver is gone (client disconnected) is dropped at the next
//! step. A panic inside the model fails the requests it touched and the scheduler goes on.
//! When every handle is dropped, the scheduler finishes the sequences in flight and returns.
//! With a [`FileGuard`], the model's files are checked before each admission and each step: a
//! file changed under the server fails the requests with [`Event::Unavailable`] naming it, and
//! the model is not run on it.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::time::Instant;

use keep_model::generate::{Decoder, Generate, GenerateOptions, Sampled, SamplerConfig};
use keep_model::Cache;
use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use std::sync::Arc;

use crate::files::FileGuard;
use crate::metrics::Metrics;
use crate::stop::StopMatcher;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// The token limit.
    Length,
}

impl Finish {
    /// OpenAI's `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// The log-probabilities of one sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens at that position, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What the scheduler tells a request, in order: tokens, then one `Done` or `Error`.
#[derive(Debug, Clone)]
pub enum Event {
    /// A sampled token and the text it releases (possibly empty: an incomplete character, or
    /// text held back while it could be the start of a stop string).
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Seconds from admission to the first token, and of the decode after it.
        prefill_secs: f64,
        decode_secs: f64,
    },
    Error(String),
    /// The model cannot answer now (its files changed under the server): 503.
    Unavailable(String),
}

/// One generation request.
#[derive(Debug)]
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    /// `Some(n)`: report each token's log-probability and the `n` most likely alternatives.
    pub logprobs: Option<usize>,
    pub events: UnboundedSender<Event>,
}

/// Most sequences one step may batch: the kernels' largest M.
pub const MAX_BATCH: usize = 32;

/// Scheduler settings.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Most sequences decoded together; more requests queue.
    pub max_batch: usize,
    /// The model's files, checked before each admission and step (`None`: not checked).
    pub files: Option<Arc<FileGuard>>,
    /// Where tokens, queue depth and batch sizes are counted (`None`: not counted).
    pub metrics: Option<Arc<Metrics>>,
}

impl EngineOptions {
    /// Up to `max_batch` sequences at once, the files not checked.
    pub fn new(max_batch: usize) -> EngineOptions {
        EngineOptions {
            max_batch,
            files: None,
            metrics: None,
        }
    }
}

/// The message of a changed model file, if any.
fn files_changed(files: Option<&FileGuard>) -> Option<String> {
    files.and_then(|f| f.check().err()).map(|e| e.to_string())
}

/// The sending side of the scheduler's queue (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Request>,
}

impl EngineHandle {
    /// Queue a request; `false` when the scheduler has stopped.
    pub fn submit(&self, r: Request) -> bool {
        self.tx.send(r).is_ok()
    }
}

/// A queue for [`run`].
pub fn channel() -> (EngineHandle, mpsc::Receiver<Request>) {
    let (tx, rx) = mpsc::channel();
    (EngineHandle { tx }, rx)
}

/// Log-softmax of one row of logits, the sampled token's value and the `n` largest.
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> TokenLogprob {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    let lz = m + z.ln();
    let lp = |v: f32| (v as f64 - lz) as f32;
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    if n > 0 {
        idx.select_nth_unstable_by(n - 1, |&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        idx.truncate(n);
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
    } else {
        idx.clear();
    }
    TokenLogprob {
        token,
        logprob: lp(logits[token as usize]),
        top: idx
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// One active sequence.
struct Seq<'t> {
    events: UnboundedSender<Event>,
    dec: Decoder<'t>,
    stop: StopMatcher,
    logprobs: Option<usize>,
    cache: Cache,
    /// The token to feed at the next step.
    next: u32,
    prompt_tokens: usize,
    completion: usize,
    admitted: Instant,
    first_token: Option<Instant>,
    metrics: Option<Arc<Metrics>>,
}

impl Seq<'_> {
    fn done(&self, finish: Finish) {
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let _ = self.events.send(Event::Done {
            finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion,
            prefill_secs: (first - self.admitted).as_secs_f64(),
            decode_secs: (now - first).as_secs_f64(),
        });
    }

    /// Sample from this sequence's row of logits and tell the client; whether it goes on.
    fn take(&mut self, logits: &[f32]) -> bool {
        if self.events.is_closed() {
            return false;
        }
        self.first_token.get_or_insert_with(Instant::now);
        let (id, text, last) = match self.dec.next(logits) {
            Err(e) => {
                let _ = self.events.send(Event::Error(e.to_string()));
                return false;
            }
            Ok(Sampled::Eos(_)) => {
                let rest = self.stop.flush();
                if !rest.is_empty() {
                    let _ = self.events.send(Event::Token {
                        text: rest,
                        logprob: None,
                    });
                }
                self.done(Finish::Stop);
                return false;
            }
            Ok(Sampled::Token { id, text, last }) => (id, text.to_string(), last),
        };
        self.completion += 1;
        if let Some(m) = &self.metrics {
            m.token();
        }
        let (mut text, stopped) = self.stop.push(&text);
        if last && !stopped {
            text.push_str(&self.stop.flush());
        }
        let logprob = self.logprobs.map(|n| logprobs(logits, id, n));
        if self.events.send(Event::Token { text, logprob }).is_err() {
            return false;
        }
        if stopped {
            self.done(Finish::Stop);
            return false;
        }
        if last {
            self.done(Finish::Length);
            return false;
        }
        self.next = id;
        true
    }
}

/// The text of a panic's payload.
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    match p.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => match p.downcast::<&str>() {
            Ok(s) => s.to_string(),
            Err(_) => "a panic".into(),
        },
    }
}

/// Admit `r`: prefill its prompt on a new cache and sample its first token; the sequence if
/// it goes on.
fn admit<'t, G: Generate + ?Sized>(
    model: &mut G,
    tok: &'t Tokenizer,
    r: Request,
    files: Option<&FileGuard>,
    metrics: Option<&Arc<Metrics>>,
) -> Option<Seq<'t>> {
    if r.events.is_closed() {
        return None;
    }
    if let Some(m) = files_changed(files) {
        let _ = r.events.send(Event::Unavailable(m));
        return None;
    }
    let opts = GenerateOptions {
        max_tokens: r.max_tokens,
        sampling: r.sampling,
        tokenizer: Some(tok),
    };
    let dec = match Decoder::new(model.cfg(), &opts) {
        Ok(d) => d,
        Err(e) => {
            let _ = r.events.send(Event::Error(e.to_string()));
            return None;
        }
    };
    let mut seq = Seq {
        events: r.events,
        dec,
        stop: StopMatcher::new(&r.stop),
        logprobs: r.logprobs,
        cache: model.new_cache(),
        next: 0,
        prompt_tokens: r.prompt.len(),
        completion: 0,
        admitted: Instant::now(),
        first_token: None,
        metrics: metrics.cloned(),
    };
    if let Some(m) = metrics {
        m.admitted(r.prompt.len());
    }
    if r.max_tokens == 0 {
        seq.done(Finish::Length);
        return None;
    }
    let prefill = catch_unwind(AssertUnwindSafe(|| {
        model.forward_last(&r.prompt, &mut seq.cache, None)
    }));
    match prefill {
        Ok(Ok(logits)) => seq.take(&logits).then_some(seq),
        Ok(Err(e)) => {
            let _ = seq.events.send(match files_changed(files) {
                Some(m) => Event::Unavailable(m),
                None => Event::Error(e.to_string()),
            });
            None
        }
        Err(p) => {
            let _ = seq.events.send(Event::Error(format!(
                "internal error: the model panicked on this request: {}",
                panic_text(p)
            )));
            None
        }
    }
}

/// Run the scheduler until every [`EngineHandle`] is dropped and the sequences in flight are
/// finished.
pub fn run<G: Generate + ?Sized>(
    model: &mut G,
    tok: &Tokenizer,
    rx: mpsc::Receiver<Request>,
    opts: EngineOptions,
) {
    run_observed(model, tok, rx, opts, |_| {})
}

/// [`run`], calling `after_step` with the model after each batched decode step (the server
/// reads the slot cache's counters there).
pub fn run_observed<G: Generate + ?Sized>(
    model: &mut G,
    tok: &Tokenizer,
    rx: mpsc::Receiver<Request>,
    opts: EngineOptions,
    mut after_step: impl FnMut(&G),
) {
    let metrics = opts.metrics.clone();
    let max_batch = opts.max_batch.max(1);
    let mut queue: VecDeque<Request> = VecDeque::new();
    let mut active: Vec<Seq> = vec![];
    let mut open = true;
    loop {
        if active.is_empty() && queue.is_empty() {
            if let Some(m) = &metrics {
                m.scheduler(0, 0);
            }
            if !open {
                return;
            }
            match rx.recv() {
                Ok(r) => queue.push_back(r),
                Err(_) => return,
            }
        }
        while open {
            match rx.try_recv() {
                Ok(r) => queue.push_back(r),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        // Disconnected clients free their slots (and their places in the queue).
        active.retain(|s| !s.events.is_closed());
        queue.retain(|r| !r.events.is_closed());
        while active.len() < max_batch {
            let Some(r) = queue.pop_front() else { break };
            if let Some(s) = admit(model, tok, r, opts.files.as_deref(), metrics.as_ref()) {
                active.push(s);
            }
        }
        if let Some(m) = &metrics {
            m.scheduler(queue.len(), active.len());
        }
        if active.is_empty() {
            continue;
        }
        if let Some(m) = files_changed(opts.files.as_deref()) {
            for s in active.drain(..) {
                let _ = s.events.send(Event::Unavailable(m.clone()));
            }
            continue;
        }
        let tokens: Vec<u32> = active.iter().map(|s| s.next).collect();
        let started = Instant::now();
        let step = {
            let mut caches: Vec<&mut Cache> = active.iter_mut().map(|s| &mut s.cache).collect();
            catch_unwind(AssertUnwindSafe(|| {
                model.forward_batch(&tokens, &mut caches)
            }))
        };
        let fail = |active: &mut Vec<Seq>, msg: String| {
            for s in active.drain(..) {
                let _ = s.events.send(Event::Error(msg.clone()));
            }
        };
        if let Some(m) = &metrics {
            m.step(tokens.len(), started.elapsed().as_secs_f64());
        }
        after_step(&*model);
        match step {
            Ok(Ok(logits)) => {
                let vocab = logits.len() / active.len();
                let mut i = 0;
                active.retain_mut(|s| {
                    let row = &logits[i * vocab..(i + 1) * vocab];
                    i += 1;
                    s.take(row)
                });
            }
            Ok(Err(e)) => match files_changed(opts.files.as_deref()) {
                Some(m) => {
                    for s in active.drain(..) {
                        let _ = s.events.send(Event::Unavailable(m.clone()));
                    }
                }
                None => fail(&mut active, e.to_string()),
            },
            Err(p) => fail(
                &mut active,
                format!(
                    "internal error: the model panicked in a decode step: {}",
                    panic_text(p)
                ),
            ),
        }
    }
}
