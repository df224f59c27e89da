//! The connections under the router ([`serve_connections`]): hyper's HTTP/1.1 on tokio, with
//! the limits that keep slow or idle clients from holding the server ([`Limits`]).
//!
//! - A connection with no request in progress is closed `idle_timeout` after it was accepted
//!   or its last response was sent, unless a new request has begun to arrive.
//! - A request's line and headers must arrive within `header_timeout` of their first byte.
//! - A request's body must arrive within `body_timeout` (the handlers read bodies under it;
//!   see the server module).
//! - At most `max_connections` are open; one more is answered 503 at once and closed.
//! - On shutdown (drain) the listener closes at once (a balancer's next connect is refused and
//!   goes to another replica), connections with no request in progress close at once, a request
//!   that arrives on a connection still open is answered 503 with `Connection: close`
//!   (`/health`: `{"status":"draining"}`), and every request in flight — streams included —
//!   runs to its end, after which its connection closes. Serving ends when no request is in
//!   flight (connections still sending a request's headers are not: they are closed then), or
//!   `shutdown_timeout` after the signal, whatever is left.
//!
//! A connection's clock: the service marks a request busy from the moment hyper hands it over
//! until its response body is sent or dropped; a read while no request is busy marks the start
//! of the next request's head. One watchdog per connection sleeps until the deadline the clock
//! gives and closes the connection if the deadline still holds when it wakes.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::Service;

/// How long clients may take, how many may connect, and how long shutdown waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// From a request's first byte to the end of its headers.
    pub header_timeout: Duration,
    /// To receive a request's whole body, once its headers are in.
    pub body_timeout: Duration,
    /// A connection with no request in progress and nothing arriving.
    pub idle_timeout: Duration,
    /// Connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// After SIGINT/SIGTERM, how long requests in flight may go on before their connections
    /// are closed (the drain's deadline).
    pub shutdown_timeout: Duration,
}

impl Limits {
    pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
    pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(60);
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            header_timeout: Limits::DEFAULT_HEADER_TIMEOUT,
            body_timeout: Limits::DEFAULT_BODY_TIMEOUT,
            idle_timeout: Limits::DEFAULT_IDLE_TIMEOUT,
            max_connections: Limits::DEFAULT_MAX_CONNECTIONS,
            shutdown_timeout: Limits::DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }
}

/// Descriptors kept free of connections: the model's shards, the runtime, standard streams.
pub const RESERVED_FILES: u64 = 128;

/// The connections the open-file limit allows, at most `want`: the soft limit is raised
/// towards the hard one first (as far as `want` needs), and [`RESERVED_FILES`] are left over.
// `rlim_t` is not u64 on every platform: the casts are needed there.
#[allow(clippy::unnecessary_cast)]
pub fn fit_connections(want: usize) -> usize {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct we pass.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 {
            return want;
        }
        let need = (want as u64).saturating_add(RESERVED_FILES);
        let mut soft = r.rlim_cur as u64;
        if soft < need && soft < r.rlim_max as u64 {
            let raised = libc::rlimit {
                rlim_cur: need.min(r.rlim_max as u64) as libc::rlim_t,
                rlim_max: r.rlim_max,
            };
            // SAFETY: setrlimit reads the struct we pass.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
                soft = raised.rlim_cur as u64;
            }
        }
        (soft.saturating_sub(RESERVED_FILES) as usize).clamp(1, want.max(1))
    }
    #[cfg(not(unix))]
    {
        want
    }
}

/// One connection's clock (see the module doc).
struct Clock {
    st: Mutex<ClockState>,
    wake: Notify,
    /// Told whenever a request begins or ends (the drain waits on it).
    changed: Arc<Notify>,
}

struct ClockState {
    /// Requests handed to the service whose responses are not yet sent.
    busy: usize,
    /// When the connection last had no request in progress.
    idle_since: Instant,
    /// When the next request's first byte arrived.
    head_at: Option<Instant>,
    /// Bytes handed to the socket since its last flush (a response's tail may be among them).
    write_pending: bool,
}

impl Clock {
    fn new(changed: Arc<Notify>) -> Clock {
        Clock {
            st: Mutex::new(ClockState {
                busy: 0,
                idle_since: Instant::now(),
                head_at: None,
                write_pending: false,
            }),
            wake: Notify::new(),
            changed,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ClockState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_read(&self) {
        let mut s = self.lock();
        if s.busy == 0 && s.head_at.is_none() {
            s.head_at = Some(Instant::now());
            drop(s);
            self.wake.notify_one();
        }
    }

    fn begin(&self) {
        self.lock().busy += 1;
        self.changed.notify_one();
    }

    fn on_write(&self) {
        self.lock().write_pending = true;
    }

    fn on_flush(&self) {
        let mut s = self.lock();
        if s.write_pending {
            s.write_pending = false;
            drop(s);
            self.wake.notify_one();
            self.changed.notify_one();
        }
    }

    /// No request in progress, none arriving, nothing left to send: closing loses nothing.
    fn quiet(&self) -> bool {
        let s = self.lock();
        s.busy == 0 && s.head_at.is_none() && !s.write_pending
    }

    /// No request in progress, but one's line or headers are arriving (not yet in flight).
    fn waiting_for_head(&self) -> bool {
        let s = self.lock();
        s.busy == 0 && s.head_at.is_some()
    }

    fn end(&self) {
        let mut s = self.lock();
        s.busy = s.busy.saturating_sub(1);
        if s.busy == 0 {
            s.idle_since = Instant::now();
            s.head_at = None;
            drop(s);
            self.wake.notify_one();
        }
        self.changed.notify_one();
    }

    /// When the connection is closed if nothing happens before; `None` while a request is in
    /// progress.
    fn deadline(&self, l: &Limits) -> Option<Instant> {
        let s = self.lock();
        if s.busy > 0 {
            return None;
        }
        Some(match s.head_at {
            Some(h) => h + l.header_timeout,
            None => s.idle_since + l.idle_timeout,
        })
    }
}

/// Marks a request busy until dropped (with the response body it travels in).
struct Busy(Arc<Clock>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A response body that keeps its request busy until it is sent or dropped.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A socket that tells its clock when bytes arrive.
struct Watched {
    io: TcpStream,
    clock: Arc<Clock>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.clock.on_read();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.clock.on_write();
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.io).poll_flush(cx);
        if matches!(r, Poll::Ready(Ok(()))) {
            this.clock.on_flush();
        }
        r
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.clock.on_write();
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The answer to a request that arrives while the server drains: 503, and the connection
/// closes after it.
fn draining(path: &str) -> axum::response::Response {
    let body = if path == "/health" {
        serde_json::json!({"status": crate::metrics::Stage::Draining.as_str()})
    } else {
        crate::api::error_body(
            "the server is shutting down (draining): send the request to another replica",
            "server_error",
            None,
        )
    };
    let mut r = axum::response::Response::new(Body::from(body.to_string()));
    *r.status_mut() = axum::http::StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    h.insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from_static("1"),
    );
    r
}

/// Serve one connection until it ends, its clock runs out, or shutdown closes it.
async fn connection(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
    clock: Arc<Clock>,
    _permit: OwnedSemaphorePermit,
) {
    let io = TokioIo::new(Watched {
        io: stream,
        clock: clock.clone(),
    });
    let svc_clock = clock.clone();
    let svc_stop = stop.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let mut router = router.clone();
        svc_clock.begin();
        let busy = Busy(svc_clock.clone());
        let drain = *svc_stop.borrow();
        async move {
            let resp = if drain {
                Ok(draining(req.uri().path()))
            } else {
                router.call(req.map(Body::new)).await
            };
            resp.map(|r| {
                r.map(|b| {
                    Body::new(Tracked {
                        inner: b,
                        _busy: busy,
                    })
                })
            })
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let mut stopping = *stop.borrow();
    if stopping {
        if clock.quiet() {
            return;
        }
        conn.as_mut().graceful_shutdown();
    }
    loop {
        let deadline = clock.deadline(&limits);
        let timer = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = timer => {
                if clock.deadline(&limits).is_some_and(|d| d <= Instant::now()) {
                    return;
                }
            }
            _ = clock.wake.notified() => {
                // Draining: a connection whose last response is sent closes now.
                if stopping && clock.quiet() {
                    return;
                }
            }
            _ = stop.changed(), if !stopping => {
                stopping = true;
                // Idle connections close at once; the others finish their request first
                // (keep-alive is off from here: hyper closes them after the response).
                if clock.quiet() {
                    return;
                }
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Answer 503 on a connection over the limit and close it, without waiting on the client.
fn refuse(stream: TcpStream, max: usize) {
    let body = crate::api::error_body(
        &format!(
            "the server has {max} connections open, its limit (--max-connections); try again later"
        ),
        "server_error",
        None,
    )
    .to_string();
    let msg = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(msg.as_bytes());
}

/// Accept connections on `listener` and serve `router` on each under `limits` until
/// `shutdown` completes; then drain (see the module doc): close the listener, close idle
/// connections, answer new requests 503, and return once no request is in flight or
/// `limits.shutdown_timeout` has passed, closing whatever is left.
pub async fn serve_connections(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    let changed = Arc::new(Notify::new());
    let mut tasks = JoinSet::new();
    let mut clocks: Vec<(tokio::task::AbortHandle, Arc<Clock>)> = vec![];
    tokio::pin!(shutdown);
    loop {
        while tasks.try_join_next().is_some() {}
        tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => match permits.clone().try_acquire_owned() {
                    Ok(p) => {
                        if clocks.len() >= limits.max_connections.max(1) {
                            clocks.retain(|(h, _)| !h.is_finished());
                        }
                        let clock = Arc::new(Clock::new(changed.clone()));
                        let h = tasks.spawn(connection(
                            stream,
                            router.clone(),
                            limits,
                            stop_rx.clone(),
                            clock.clone(),
                            p,
                        ));
                        clocks.push((h, clock));
                    }
                    Err(_) => refuse(stream, limits.max_connections),
                },
                // Out of descriptors or memory for a moment: the connections' clocks free
                // them; try again shortly rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            },
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let deadline = Instant::now() + limits.shutdown_timeout;
    loop {
        clocks.retain(|(h, _)| !h.is_finished());
        // Done when every connection left is only sending a request's headers (or none is
        // left): no request is in flight.
        if clocks.iter().all(|(_, c)| c.waiting_for_head()) {
            break;
        }
        tokio::select! {
            _ = tasks.join_next() => {}
            _ = changed.notified() => {}
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}
