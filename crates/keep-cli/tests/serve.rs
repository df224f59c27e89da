//! `keep serve` as a process on 127.0.0.1 (port 0: a free one), driven as a hostile client
//! would drive it: an empty API key is refused at startup; 2,000 connections that send part of
//! a request line and then nothing neither stop `/health` from answering nor keep SIGTERM
//! from ending the server; a cross-site `text/plain` POST and a foreign `Host` are refused;
//! and a shard truncated under the running server (mapped or under a memory budget) is
//! answered 503 naming it while the server goes on.
//!
//! Every wait here is a hang guard (generous, never a measurement): a server that does not
//! answer or does not stop fails the test instead of hanging it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long any one step may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(90);
/// Connections that send part of a request line and then nothing.
const SLOW_CLIENTS: usize = 2000;
/// How long one connect may wait for the server's backlog (hang guard).
const CONNECT: Duration = Duration::from_secs(5);

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

fn keep_bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("keep")
}

/// Raise this process's open-file limit to its hard limit (the slow clients need 2,000).
fn raise_nofile() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// A running `keep serve`.
struct Server {
    child: Child,
    addr: String,
    /// What it wrote to stderr (read on a thread so that it never blocks on a full pipe).
    stderr: mpsc::Receiver<String>,
}

impl Server {
    /// `keep serve MODEL --port 0 ARGS`, with the open-file limit `nofile` when given; waits
    /// for its address.
    fn start(model: &Path, args: &[&str], nofile: Option<u32>) -> Server {
        let mut cmd = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(keep_bin());
                c
            }
            None => Command::new(keep_bin()),
        };
        cmd.arg("serve")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env_remove("KEEP_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (etx, erx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = BufReader::new(stderr).read_to_string(&mut s);
            let _ = etx.send(s);
        });
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(url) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(url.trim().to_string());
                }
            }
        });
        let addr = match rx.recv_timeout(HANG) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "keep serve did not start: {}",
                    erx.recv_timeout(HANG).unwrap_or_default()
                );
            }
        };
        Server {
            child,
            addr,
            stderr: erx,
        }
    }

    /// One request on a connection of its own: status and body.
    fn request(&self, raw: &str) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(&self.addr).ok()?;
        s.set_read_timeout(Some(HANG)).ok()?;
        s.write_all(raw.as_bytes()).ok()?;
        let mut out = vec![];
        s.read_to_end(&mut out).ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text.split(' ').nth(1)?.parse().ok()?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
        Some((status, body))
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        self.request(&format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.addr
        ))
    }

    fn post(&self, path: &str, content_type: &str, host: &str, body: &str) -> (u16, String) {
        self.request(&format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ))
        .unwrap_or_else(|| panic!("no answer to POST {path}: the server is gone?"))
    }

    /// `/health` answers 200, retried while the server refuses or does not answer yet.
    fn wait_healthy(&self) {
        let start = Instant::now();
        loop {
            if let Some((200, body)) = self.get("/health") {
                assert!(body.contains(r#""status":"ready""#), "{body}");
                return;
            }
            assert!(
                start.elapsed() < HANG,
                "/health did not answer 200 (hang guard)"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Open up to `n` connections that each send part of a request line, then nothing;
    /// stops at the first connection the server's backlog no longer takes (a server that
    /// stopped accepting).
    fn slow_clients(&self, n: usize) -> Vec<TcpStream> {
        let addr: std::net::SocketAddr = self.addr.parse().unwrap();
        let mut out = vec![];
        for _ in 0..n {
            let Ok(mut s) = TcpStream::connect_timeout(&addr, CONNECT) else {
                break;
            };
            // A connection refused over the cap may be closed already: ignore the error.
            let _ = s.write_all(b"GET /health HT");
            out.push(s);
        }
        out
    }

    /// SIGTERM, then wait (hang guard) for the exit; whether it exited.
    fn terminate(&mut self) -> bool {
        // SAFETY: a signal to the child we started.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let start = Instant::now();
        while start.elapsed() < HANG {
            if self.child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn an_empty_api_key_is_refused_at_startup() {
    for (args, env, says) in [
        (vec!["--api-key", ""], None, "--api-key is empty"),
        (vec!["--api-key", "  "], None, "--api-key is empty"),
        (vec![], Some(""), "KEEP_API_KEY is set but empty"),
    ] {
        let mut c = assert_cmd::Command::new(keep_bin());
        c.arg("serve")
            .arg(tiny())
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(&args)
            .env_remove("KEEP_API_KEY")
            .timeout(HANG);
        if let Some(v) = env {
            c.env("KEEP_API_KEY", v);
        }
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && out.status.code().is_some(),
            "{args:?} {env:?}: served (or hung) instead of refusing: {stdout} {stderr}"
        );
        assert!(!stdout.contains("listening"), "{stdout}");
        assert!(stderr.contains(says), "{args:?} {env:?}: {stderr}");
    }
}

#[test]
fn slow_clients_neither_stop_health_nor_shutdown() {
    raise_nofile();
    // Under an open-file limit of 1024, 2,000 half-sent requests: the connections beyond the
    // cap are refused at once, the others close at the header timeout, and /health answers.
    let s = Server::start(&tiny(), &["--header-timeout", "2"], Some(1024));
    let slow = s.slow_clients(SLOW_CLIENTS);
    assert_eq!(
        slow.len(),
        SLOW_CLIENTS,
        "the server stopped taking connections after {}",
        slow.len()
    );
    s.wait_healthy();
    drop(slow);
    drop(s);
    // With timeouts far away and room for them all, the same clients are held open while
    // /health answers, and they do not keep SIGTERM from ending the server: it closes them at
    // the shutdown deadline.
    let mut s = Server::start(
        &tiny(),
        &[
            "--header-timeout",
            "3600",
            "--idle-timeout",
            "3600",
            "--max-connections",
            "4096",
            "--shutdown-timeout",
            "1",
        ],
        None,
    );
    let slow = s.slow_clients(SLOW_CLIENTS);
    s.wait_healthy();
    assert!(
        s.terminate(),
        "keep serve did not stop after SIGTERM with {} slow clients",
        slow.len()
    );
    let status = s.child.wait().unwrap();
    assert!(status.success(), "{status}");
    let err = s.stderr.recv_timeout(HANG).unwrap_or_default();
    assert!(err.contains("stopped"), "{err}");
}

#[test]
fn cross_site_requests_are_refused() {
    let s = Server::start(&tiny(), &[], None);
    let body = r#"{"prompt": "def ", "max_tokens": 2, "temperature": 0}"#;
    let host = s.addr.clone();
    let (st, b) = s.post("/v1/completions", "text/plain", &host, body);
    assert_eq!(st, 415, "{b}");
    assert!(b.contains("application/json"), "{b}");
    let (st, b) = s.post("/v1/completions", "application/json", &host, body);
    assert_eq!(st, 200, "{b}");
    let (st, b) = s.post("/v1/completions", "application/json", "localhost", body);
    assert_eq!(st, 200, "{b}");
    // DNS rebinding: a page of evil.example whose name now points at 127.0.0.1.
    let (st, b) = s.post("/v1/completions", "application/json", "evil.example", body);
    assert_eq!(st, 421, "{b}");
    assert!(b.contains("--allowed-host evil.example"), "{b}");
    drop(s);
    let s = Server::start(&tiny(), &["--allowed-host", "keep.example"], None);
    let (st, b) = s.post(
        "/v1/completions",
        "application/json",
        "keep.example:8080",
        body,
    );
    assert_eq!(st, 200, "{b}");
}

/// A copy of the bundled model in a directory of its own.
fn model_copy(dir: &Path) -> PathBuf {
    let m = dir.join("keep-tiny");
    std::fs::create_dir_all(&m).unwrap();
    for e in std::fs::read_dir(tiny()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
    }
    m
}

#[test]
fn a_shard_truncated_under_the_server_is_503_and_the_server_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, args) in [
        ("mapped", vec![]),
        ("budgeted", vec!["--memory-budget", "64MiB"]),
    ] {
        let m = model_copy(&tmp.path().join(name));
        let mut s = Server::start(&m, &args, None);
        let host = s.addr.clone();
        let body = r#"{"prompt": "def ", "max_tokens": 4, "temperature": 0}"#;
        let (st, b) = s.post("/v1/completions", "application/json", &host, body);
        assert_eq!(st, 200, "{name}: {b}");
        let shard = m.join("model.safetensors");
        let len = std::fs::metadata(&shard).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap()
            .set_len(len / 3)
            .unwrap();
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = if path == "/v1/completions" {
                body.to_string()
            } else {
                r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": true}"#
                    .to_string()
            };
            let (st, b) = s.post(path, "application/json", &host, &body);
            assert_eq!(st, 503, "{name} {path}: {b}");
            assert!(b.contains("model.safetensors"), "{name}: {b}");
        }
        s.wait_healthy();
        assert!(
            s.child.try_wait().unwrap().is_none(),
            "{name}: keep serve died"
        );
        assert!(s.terminate(), "{name}: keep serve did not stop");
    }
}

/// Read from `s` until the peer closes it (or the hang guard); what arrived.
fn read_until_closed(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(HANG)).unwrap();
    let mut out = vec![];
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn a_stalled_body_is_408_and_an_idle_connection_is_closed() {
    let s = Server::start(
        &tiny(),
        &["--body-timeout", "1", "--idle-timeout", "1"],
        None,
    );
    // Headers promise 100 bytes of body; 10 arrive.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\":",
            s.addr
        )
        .as_bytes(),
    )
    .unwrap();
    let got = read_until_closed(&mut c);
    assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
    assert!(got.contains("--body-timeout"), "{got}");
    // A connection that sends nothing is closed.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    let got = read_until_closed(&mut c);
    assert_eq!(got, "");
    // After a request, a keep-alive connection that sends nothing more is closed.
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.write_all(format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", s.addr).as_bytes())
        .unwrap();
    let got = read_until_closed(&mut c);
    assert!(got.starts_with("HTTP/1.1 200"), "{got:?}");
    s.wait_healthy();
}

/// The text of a stream's `data:` chunks (completions), and whether it ended with [DONE].
fn stream_text(raw: &str) -> (String, bool) {
    let mut text = String::new();
    let mut done = false;
    for l in raw.lines() {
        let Some(d) = l.trim().strip_prefix("data: ") else {
            continue;
        };
        if d == "[DONE]" {
            done = true;
            continue;
        }
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(d) {
            if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
            }
        }
    }
    (text, done)
}

/// Read one response with a `content-length` body from a keep-alive connection.
fn read_one_response(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(HANG)).unwrap();
    let mut out = vec![];
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before a whole response");
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

#[test]
fn sigterm_lets_a_stream_in_flight_finish() {
    let mut s = Server::start(&tiny(), &[], None);
    // Ready and live once "listening" is printed.
    let (st, b) = s.get("/health").unwrap();
    assert_eq!(st, 200, "{b}");
    assert!(b.contains(r#""status":"ready""#), "{b}");
    let (st, _) = s.get("/health/live").unwrap();
    assert_eq!(st, 200);
    let prompt = r#""prompt": "def ", "max_tokens": 200, "temperature": 0"#;
    let host = s.addr.clone();
    let (st, whole) = s.post(
        "/v1/completions",
        "application/json",
        &host,
        &format!("{{{prompt}}}"),
    );
    assert_eq!(st, 200, "{whole}");
    let whole: serde_json::Value = serde_json::from_str(&whole).unwrap();
    let want = whole["choices"][0]["text"].as_str().unwrap().to_string();
    // An idle keep-alive connection.
    let mut idle = TcpStream::connect(&s.addr).unwrap();
    idle.write_all(format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", s.addr).as_bytes())
        .unwrap();
    let got = read_one_response(&mut idle);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let mut c = TcpStream::connect(&s.addr).unwrap();
    let body = format!("{{{prompt}, \"stream\": true}}");
    c.write_all(
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            s.addr,
            body.len()
        )
        .as_bytes(),
    )
    .unwrap();
    // The stream has begun (its first bytes are here) before the signal.
    c.set_read_timeout(Some(HANG)).unwrap();
    let mut first = [0u8; 64];
    let n = c.read(&mut first).unwrap();
    assert!(n > 0);
    // SAFETY: a signal to the child we started.
    unsafe {
        libc::kill(s.child.id() as libc::pid_t, libc::SIGTERM);
    }
    // New connections are refused (the listener is closed), and the idle one is closed.
    let start = Instant::now();
    while TcpStream::connect_timeout(&s.addr.parse().unwrap(), CONNECT).is_ok() {
        assert!(start.elapsed() < HANG, "still accepting after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(read_until_closed(&mut idle), "");
    // The stream runs to its end: the same text as the whole answer, then [DONE].
    let rest = read_until_closed(&mut c);
    let raw = String::from_utf8_lossy(&first[..n]).into_owned() + &rest;
    let (text, done) = stream_text(&raw);
    assert!(done, "{raw}");
    assert_eq!(text, want, "{raw}");
    assert!(s.terminate(), "keep serve did not exit after SIGTERM");
    assert!(s.child.wait().unwrap().success());
}

#[test]
fn a_drain_ends_with_the_last_request_not_at_the_deadline() {
    // Timeouts and the drain's deadline an hour away: an idle keep-alive connection and a
    // client that never finishes its headers hold no request in flight, so SIGTERM ends the
    // server at once.
    let mut s = Server::start(
        &tiny(),
        &[
            "--header-timeout",
            "3600",
            "--idle-timeout",
            "3600",
            "--shutdown-timeout",
            "3600",
        ],
        None,
    );
    let mut idle = TcpStream::connect(&s.addr).unwrap();
    idle.write_all(format!("GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", s.addr).as_bytes())
        .unwrap();
    let got = read_one_response(&mut idle);
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    let slow = s.slow_clients(3);
    assert_eq!(slow.len(), 3);
    s.wait_healthy();
    assert!(
        s.terminate(),
        "keep serve waited for idle and half-sent connections after SIGTERM"
    );
    assert!(s.child.wait().unwrap().success());
}

#[test]
fn metrics_are_scraped_with_the_api_key() {
    let s = Server::start(&tiny(), &["--api-key", "sesame"], None);
    let host = s.addr.clone();
    let (st, _) = s.get("/metrics").unwrap();
    assert_eq!(st, 401);
    let body = r#"{"prompt": "def ", "max_tokens": 4, "temperature": 0}"#;
    let (st, b) = s
        .request(&format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sesame\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ))
        .unwrap();
    assert_eq!(st, 200, "{b}");
    let (st, m) = s
        .request(&format!(
            "GET /metrics HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sesame\r\nConnection: close\r\n\r\n"
        ))
        .unwrap();
    assert_eq!(st, 200, "{m}");
    assert!(m.contains("# TYPE keep_requests counter"), "{m}");
    assert!(
        m.contains(r#"keep_requests_total{endpoint="/v1/completions",status="200"} 1"#),
        "{m}"
    );
    let tokens = m
        .lines()
        .find_map(|l| l.strip_prefix("keep_generated_tokens_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(tokens >= 1.0, "{m}");
}

/// `keep chat-template` prints exactly the prompt `/v1/chat/completions` renders (the bundled
/// model's template: what transformers' apply_chat_template renders for it), reads a request
/// body as well as a bare list, prints the ids with `--ids`, and refuses bad messages by name.
#[test]
fn chat_template_prints_the_prompt_serve_renders() {
    let run = |args: &[&str], stdin: &str| {
        let mut c = Command::new(keep_bin())
            .arg("chat-template")
            .arg(tiny())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
        let o = c.wait_with_output().unwrap();
        (
            o.status.success(),
            String::from_utf8(o.stdout).unwrap(),
            String::from_utf8(o.stderr).unwrap(),
        )
    };
    let list = r#"[{"role":"user","content":"sort a list"}]"#;
    let (ok, out, err) = run(&["--messages", "-"], list);
    assert!(ok, "{err}");
    assert_eq!(out, "# user:\nsort a list\n# assistant:\n");
    // A request body, content as parts.
    let body = r#"{"model":"x","messages":[{"role":"user","content":[{"type":"text","text":"sort "},{"type":"text","text":"a list"}]}]}"#;
    assert_eq!(run(&["--messages", "-"], body).1, out);
    // The ids, alone and beside the text.
    let (ok, ids, err) = run(&["--messages", "-", "--ids"], list);
    assert!(ok, "{err}");
    let ids: Vec<u32> = serde_json::from_str(ids.trim()).unwrap();
    assert!(!ids.is_empty());
    let (ok, both, err) = run(&["--messages", "-", "--json"], list);
    assert!(ok, "{err}");
    let both: serde_json::Value = serde_json::from_str(both.trim()).unwrap();
    assert_eq!(both["prompt"], out);
    assert_eq!(both["ids"], serde_json::json!(ids));
    // Bad input: named, nothing printed.
    let (ok, out, err) = run(&["--messages", "-"], r#"{"messages": 3}"#);
    assert!(!ok && out.is_empty() && err.contains("role"), "{err}");
    let (ok, _, err) = run(&["--messages", "-"], "[]");
    assert!(!ok && err.contains("no messages"), "{err}");
}
