#!/usr/bin/env bash
# Two `keep serve` replicas of the bundled model behind Debian's nginx with deploy/nginx/keep.conf,
# all on loopback: installs nginx when missing, starts the replicas (ports 0: free ones, read from
# their "loading ... on" lines), runs nginx with the config's upstream list and listen port
# rewritten into a temporary config (`nginx -p TMP -c TMP/nginx.conf`, pid, logs and temp paths
# under TMP), waits for both replicas' /health to say ready, asks one replica directly for the
# greedy answer of each prompt, then drives CLIENTS concurrent OpenAI-client workers through
# nginx (PER_CLIENT greedy completions each, every other one streamed) while one replica is
# restarted mid-load (SIGTERM, wait for its exit, start it again on the same port). Checks: no
# request failed, every answer equals the single server's, the restarted replica exited 0, and
# /metrics was scraped from each replica. Writes the evidence JSON and exits non-zero on failure.
# Not part of .ci/run.
#
# Usage: dev/replicas-test.sh [OUT.json]
#        (env: WORK=/tmp/keep-replicas CLIENTS=8 PER_CLIENT=6 MAX_TOKENS=48 KEEP=path/to/keep)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_JSON="$(realpath -m "${1:-dev/evidence/replicas-restart-under-load.json}")"
WORK="$(realpath -m "${WORK:-/tmp/keep-replicas}")"
CLIENTS="${CLIENTS:-8}"
PER_CLIENT="${PER_CLIENT:-6}"
MAX_TOKENS="${MAX_TOKENS:-48}"

if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx >/dev/null
fi
NGINX="$(command -v nginx || echo /usr/sbin/nginx)"
if [ -z "${KEEP:-}" ]; then
  cargo build --release -q -p keep-cli
  KEEP="$REPO/target/release/keep"
fi
KEEP="$(realpath "$KEEP")"
VENV="$REPO/tools/serve-test/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -r tools/serve-test/requirements.txt

rm -rf "$WORK"
mkdir -p "$WORK"/{logs,temp}
cleanup() {
  set +e
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null
  for f in "$WORK"/replica-*.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  wait 2>/dev/null
}
trap cleanup EXIT

# The driver does the rest (it starts and restarts the replicas, so that it knows their pids).
"$VENV/bin/python" - "$KEEP" "$NGINX" "$WORK" "$REPO/deploy/nginx/keep.conf" "$OUT_JSON" \
  "$CLIENTS" "$PER_CLIENT" "$MAX_TOKENS" <<'PY'
import json, os, re, signal, socket, subprocess, sys, threading, time, urllib.request

import openai

KEEP, NGINX, WORK, CONF, OUT, CLIENTS, PER_CLIENT, MAX_TOKENS = sys.argv[1:9]
CLIENTS, PER_CLIENT, MAX_TOKENS = int(CLIENTS), int(PER_CLIENT), int(MAX_TOKENS)
PROMPTS = ["def main(", "import os\n", "class Foo:\n    def", "# Copyright", "for i in range(",
           "return self.", "if __name__ ==", "x = [", "while True:\n", "try:\n    ", "print(", "#!/usr/bin/env"]
HANG = 120  # hang guard for any one wait, seconds (never a measurement)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Replica:
    def __init__(self, name, port):
        self.name, self.port, self.proc, self.starts = name, port, None, 0

    def start(self):
        log = open(os.path.join(WORK, "logs", f"{self.name}.{self.starts}.log"), "w")
        self.proc = subprocess.Popen(
            [KEEP, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--max-batch", "4",
             "--allowed-host", "keep_replicas", "--shutdown-timeout", "60"],
            stdout=log, stderr=subprocess.STDOUT)
        self.starts += 1
        with open(os.path.join(WORK, f"{self.name}.pid"), "w") as f:
            f.write(str(self.proc.pid))

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def health(self):
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError:
            return None, None

    def wait_ready(self):
        seen, t0 = [], time.time()
        while time.time() - t0 < HANG:
            st, body = self.health()
            label = (st, (body or {}).get("status"))
            if not seen or seen[-1] != label:
                seen.append(label)
            if st == 200 and body.get("status") == "ready":
                return seen
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} while starting")
            time.sleep(0.1)
        raise SystemExit(f"{self.name}: /health did not say ready (hang guard)")

    def metrics(self):
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            text = r.read().decode()
        assert "# TYPE keep_requests counter" in text, text
        count = 0
        for line in text.splitlines():
            m = re.match(r'keep_requests_total\{endpoint="(/v1/[a-z/]+)",status="(\d+)"\} (\S+)', line)
            if m and m.group(2) == "200":
                count += int(float(m.group(3)))
        def value(name):
            return next((float(l.split()[-1]) for l in text.splitlines()
                         if l.startswith(name + " ")), 0.0)
        return {"completions_200": count, "generated_tokens": value("keep_generated_tokens_total"),
                "active_sequences": value("keep_active_sequences"),
                "queue_depth": value("keep_queue_depth")}


a, b = Replica("replica-a", free_port()), Replica("replica-b", free_port())
for r in (a, b):
    r.start()
startup = {r.name: r.wait_ready() for r in (a, b)}

# nginx: the deploy config with this run's upstream list and listen port, wrapped in a whole
# configuration whose pid, logs and temp paths are under WORK.
conf = open(CONF).read()
nginx_port = free_port()
conf, n = re.subn(r"upstream keep_replicas \{.*?\n\}",
                  lambda m: re.sub(r"(?m)^\s*server 127\.0\.0\.1:\d+ (.*)$", "", m.group(0)).replace(
                      "least_conn;", f"least_conn;\n    server 127.0.0.1:{a.port} max_fails=2 fail_timeout=10s;"
                                     f"\n    server 127.0.0.1:{b.port} max_fails=2 fail_timeout=10s;"),
                  conf, flags=re.S)
assert n == 1, "no `upstream keep_replicas { ... }` block in " + CONF
conf, n = re.subn(r"(?m)^(\s*)listen \d+;", rf"\1listen 127.0.0.1:{nginx_port};", conf)
assert n == 1, "no `listen PORT;` line in " + CONF
temp = os.path.join(WORK, "temp")
whole = f"""daemon off;
pid {WORK}/nginx.pid;
error_log {WORK}/logs/nginx-error.log info;
worker_processes 1;
events {{ worker_connections 1024; }}
http {{
    access_log {WORK}/logs/nginx-access.log;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
{conf}
}}
"""
open(os.path.join(WORK, "nginx.conf"), "w").write(whole)
nginx_version = subprocess.run([NGINX, "-v"], capture_output=True, text=True).stderr.strip()
subprocess.run([NGINX, "-p", WORK, "-c", os.path.join(WORK, "nginx.conf"), "-t"], check=True,
               capture_output=True)
nginx = subprocess.Popen([NGINX, "-p", WORK, "-c", os.path.join(WORK, "nginx.conf")])
t0 = time.time()
while True:
    try:
        socket.create_connection(("127.0.0.1", nginx_port), timeout=2).close()
        break
    except OSError:
        assert time.time() - t0 < HANG and nginx.poll() is None, "nginx did not start"
        time.sleep(0.1)

# The single server's greedy answers (one replica asked directly, before the load).
direct = openai.OpenAI(base_url=a.url("/v1"), api_key="none", max_retries=0, timeout=300)
expected = {}
for p in PROMPTS:
    r = direct.completions.create(model="keep-tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
    expected[p] = r.choices[0].text

lb = openai.OpenAI(base_url=f"http://127.0.0.1:{nginx_port}/v1", api_key="none", max_retries=0,
                   timeout=300)
results, lock = [], threading.Lock()
progress = threading.Event()  # set once a quarter of the requests are done
rejoined = threading.Event()  # set once the restarted replica has answered REJOIN completions
REJOIN = 4


def worker(i):
    j = 0
    # PER_CLIENT completions each, and on until the restarted replica is back in the balance.
    while j < PER_CLIENT or not rejoined.is_set():
        p = PROMPTS[(i * PER_CLIENT + j) % len(PROMPTS)]
        j += 1
        stream = (i + j) % 2 == 1
        rec = {"client": i, "prompt": p, "stream": stream}
        try:
            if stream:
                text, done = "", False
                for c in lb.completions.create(model="keep-tiny", prompt=p, max_tokens=MAX_TOKENS,
                                               temperature=0, stream=True):
                    if c.choices:
                        text += c.choices[0].text or ""
                        done = done or c.choices[0].finish_reason is not None
                rec["ok"] = done and text == expected[p]
                rec["error"] = None if done else "the stream ended without a finish_reason"
            else:
                r = lb.completions.create(model="keep-tiny", prompt=p, max_tokens=MAX_TOKENS,
                                          temperature=0)
                text = r.choices[0].text
                rec["ok"] = text == expected[p]
                rec["error"] = None
            if not rec["ok"] and rec["error"] is None:
                rec["error"] = f"answer differs from the single server's: {text!r} vs {expected[p]!r}"
        except Exception as e:  # any failure counts
            rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"
        with lock:
            results.append(rec)
            if len(results) >= CLIENTS * PER_CLIENT // 4:
                progress.set()


load_start = time.time()
threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
for t in threads:
    t.start()
# Restart replica b mid-load: SIGTERM, wait for its exit, start it again on the same port.
assert progress.wait(HANG), "the load made no progress (hang guard)"
metrics_b_before = b.metrics()
b.proc.send_signal(signal.SIGTERM)
b_exit = b.proc.wait(timeout=HANG)
restart = {"replica": b.name, "exit_code": b_exit, "requests_done_at_sigterm": None}
with lock:
    restart["requests_done_at_sigterm"] = len(results)
b.start()
restart["health_after_restart"] = b.wait_ready()
t_back = time.time()
while time.time() - t_back < HANG:
    if b.metrics()["completions_200"] >= REJOIN:
        break
    time.sleep(0.5)
restart["completions_after_restart_before_load_ended"] = b.metrics()["completions_200"]
rejoined.set()
for t in threads:
    t.join(timeout=600)
load_secs = time.time() - load_start

scraped = {r.name: r.metrics() for r in (a, b)}
nginx.send_signal(signal.SIGQUIT)
nginx.wait(timeout=HANG)
for r in (a, b):
    r.proc.send_signal(signal.SIGTERM)
    r.proc.wait(timeout=HANG)

failures = [r for r in results if not r["ok"]]
per_replica = {a.name: scraped[a.name]["completions_200"],
               b.name + " before its restart": metrics_b_before["completions_200"],
               b.name + " after its restart": scraped[b.name]["completions_200"]}
ok = (not failures and len(results) >= CLIENTS * PER_CLIENT and b_exit == 0
      and all(n > 0 for n in per_replica.values()))
evidence = {
    "format": "keep-evidence", "version": 1,
    "test": "dev/replicas-test.sh: two keep serve replicas behind nginx (deploy/nginx/keep.conf), "
            "one restarted (SIGTERM, exit, start) under load",
    "passed": ok,
    "nginx_version": nginx_version,
    "model": "keep-tiny (bundled)",
    "load": {"clients": CLIENTS, "completions_per_client_at_least": PER_CLIENT,
             "clients_go_on_until_the_restarted_replica_answered": REJOIN, "max_tokens": MAX_TOKENS,
             "temperature": 0, "streamed_every_other": True, "prompts": len(PROMPTS),
             "replica_flags": "--max-batch 4 --allowed-host keep_replicas --shutdown-timeout 60",
             "wall_seconds": round(load_secs, 1)},
    "requests": len(results),
    "streamed": sum(r["stream"] for r in results),
    "failures": len(failures),
    "failed": failures[:20],
    "greedy_equal_to_single_server": sum(r["ok"] for r in results),
    "restarts": [restart],
    "startup_health": startup,
    "metrics": {"replica-b before its restart": metrics_b_before, "after the load": scraped},
    "per_replica_completions_200_from_metrics": per_replica,
    "note": f"replica-a's count includes the {len(PROMPTS)} direct requests for the single "
            "server's answers; replica-b's before its restart were scraped just before SIGTERM",
}
tmp = OUT + ".tmp"
os.makedirs(os.path.dirname(OUT), exist_ok=True)
with open(tmp, "w") as f:
    json.dump(evidence, f, indent=1, default=str)
    f.write("\n")
os.replace(tmp, OUT)
print(json.dumps({k: evidence[k] for k in ("passed", "requests", "failures", "restarts",
                                          "per_replica_completions_200_from_metrics", "nginx_version")},
                 default=str))
sys.exit(0 if ok else 1)
PY
