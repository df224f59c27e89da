//! The connection layer's drain, on a socket with a router whose `/slow` answers only when the
//! test lets it: after the shutdown signal the listener refuses connections, an idle
//! keep-alive connection is closed while a request is still in flight, a request whose
//! headers complete after the signal is answered 503 `draining` with `Connection: close`, the
//! request in flight gets its whole answer, and serving ends once it has, although a client
//! is still sending headers and the shutdown deadline is an hour away.
//!
//! Every wait here is a hang guard (generous, never a measurement).

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use keep_serve::conn::{serve_connections, Limits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, Notify};

const HANG: Duration = Duration::from_secs(90);
const HOUR: Duration = Duration::from_secs(3600);

async fn guard<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(HANG, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no progress within the hang guard"))
}

/// Read until the peer closes.
async fn read_all(s: &mut TcpStream) -> String {
    let mut out = vec![];
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Read one response with a `content-length` body (the connection stays open).
async fn read_response(s: &mut TcpStream) -> String {
    let mut out = vec![];
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before a whole response: {out:?}");
        out.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&out).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            if body.len() >= len {
                return text;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_finishes_the_request_in_flight_refuses_the_rest_and_ends() {
    let release = Arc::new(Notify::new());
    let r = release.clone();
    let router = Router::new()
        .route(
            "/slow",
            get(move || {
                let r = r.clone();
                async move {
                    r.notified().await;
                    "the whole answer"
                }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = Limits {
        header_timeout: HOUR,
        idle_timeout: HOUR,
        shutdown_timeout: HOUR,
        ..Limits::default()
    };
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(serve_connections(listener, router, limits, async {
        let _ = stop_rx.await;
    }));

    // An idle keep-alive connection (one request answered).
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let got = guard("keep-alive /health", read_response(&mut idle)).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // A request in flight.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    // A request whose headers are still arriving.
    let mut late = TcpStream::connect(addr).await.unwrap();
    late.write_all(b"GET /health HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    // And one whose headers never complete.
    let mut dawdler = TcpStream::connect(addr).await.unwrap();
    dawdler.write_all(b"GET /he").await.unwrap();
    // Let the server read them all before the signal (an ordering wait, not a measurement).
    tokio::time::sleep(Duration::from_millis(500)).await;

    stop_tx.send(()).unwrap();
    // The listener closes: a new connection is refused.
    guard("the listener to close", async {
        loop {
            match TcpStream::connect(addr).await {
                Err(_) => break,
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
    // The idle connection is closed while /slow is still in flight.
    let rest = guard("the idle connection to close", read_all(&mut idle)).await;
    assert_eq!(rest, "");
    // Headers completed after the signal: 503 draining, and the connection closes.
    late.write_all(b"\r\n").await.unwrap();
    let got = guard("the late request's answer", read_all(&mut late)).await;
    assert!(got.starts_with("HTTP/1.1 503"), "{got}");
    assert!(
        got.to_ascii_lowercase().contains("connection: close"),
        "{got}"
    );
    assert!(got.contains(r#"{"status":"draining"}"#), "{got}");
    assert!(!server.is_finished(), "serving ended with /slow in flight");

    // A client still sending headers is not in flight: once /slow is answered, serving ends
    // without waiting for it (or for the hour-long deadline).
    release.notify_one();
    let got = guard("the request in flight to end", read_all(&mut slow)).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.ends_with("the whole answer"), "{got}");
    guard("serving to end", server).await.unwrap();
    assert_eq!(read_all(&mut dawdler).await, "");
}
