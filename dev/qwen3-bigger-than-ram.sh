#!/usr/bin/env bash
# Qwen3-MoE bigger than the memory it may use: `keep run --memory-budget` against llama.cpp's
# mmap (and keep's own plain mmap) on the same 4-bit weights, the same threads, interleaved
# rounds, the page cache dropped before every run, every run inside a memory cgroup.
#
# 1. `keep synth --family qwen3_moe --preset qwen3-30b-a3b --layers LAYERS --format mlx4`:
#    Qwen3-30B-A3B's real shapes at full depth (48 layers, about 17 GB) in mlx-community's MLX
#    affine 4-bit layout (experts stacked in `switch_mlp`, routers at 8 bits). keep runs it as is.
# 2. A q4_0 GGUF of the same weights, written by llama.cpp's own converter
#    (`convert_hf_to_gguf.py`, pinned sources from dev/llama-cpp-side-by-side.sh) run in-process
#    by dev/qwen3_mlx4_gguf.py with three small commented patches: its tensors are the MLX
#    checkpoint dequantized exactly (w = scale * q + bias per group of 64) under Hugging Face's
#    names, lazily (memory stays at one stacked tensor); its quantized type is Q4_0 instead of
#    Q8_0 (gguf-py's quantizer); the file type recorded is Q4_0. Why: the converter has no MLX
#    reader and no q4_0 outtype, and the bf16 source `llama-quantize` would need is 61 GB at
#    full depth; this way the disk holds only the two 4-bit copies (about 2 x 17 GB at its
#    peak). The GGUF is read back and checked against the MLX weights before it is used.
# 3. ROUNDS rounds; in each, three runs, each from a dropped page cache (`sync; echo 3 >
#    /proc/sys/vm/drop_caches`) inside a fresh child of this shell's cgroup-v1 memory cgroup
#    with memory.limit_in_bytes = MEM (dev/memcg_run.py: anonymous memory and the page cache
#    the run reads are both charged there, so a model larger than MEM cannot sit in memory):
#      llama-mmap:  llama-bench -m q4_0.gguf -t THREADS -p P -n N -r 1 -o json LLAMA_ARGS
#      keep-budget: keep run MLX4 --memory-budget BUDGET --prompt-tokens P --max-tokens N
#                   --temperature 0 --kernels fast --stats-json (RAYON_NUM_THREADS=THREADS)
#      keep-mmap:   the same without --memory-budget (keep's plain mmap).
#    LLAMA_ARGS defaults to `--repack 0`: on an AVX2/AVX-512 CPU llama.cpp's default copies
#    every Q4_0 matrix into an anonymous CPU_REPACK buffer (interleaved q4_0_8x8), so the whole
#    model must fit in memory and a model larger than MEM is OOM-killed in the cgroup; with
#    `--repack 0` the weights stay in the mmap'd file (CPU_Mapped), which is llama.cpp's mmap.
#    PROBE_DEFAULT=1 (default) first runs llama-bench once with its defaults in the same cgroup
#    and records what happened (exit status, OOM kills), so the JSON says so rather than this
#    comment.
# 4. OUT.json: command, machine, shape and file sizes, MEM, BUDGET, THREADS, every run
#    (prefill and decode tok/s, peak RSS — keep's own peak_rss_bytes and wait4's ru_maxrss —,
#    the cgroup's peak usage, failcnt, OOM kills and the page cache charged to it, bytes read by
#    the process and from the disk, the load average before it), medians, the ratios
#    keep-budget / llama-mmap and keep-budget / keep-mmap for decode and prefill, and the goal
#    (decode >= 2x llama.cpp's mmap at a peak RSS under the budget) with what was reached.
#
# Usage: dev/qwen3-bigger-than-ram.sh [ROUNDS] [OUT.json]
#   ROUNDS default 2; OUT default dev/evidence/qwen3-bigger-than-ram.json (refused if it exists
#   unless FORCE=1). LAYERS (48), MEM (8GiB), BUDGET (6GiB), THREADS (2), P (16), N (16),
#   LLAMA_ARGS ("--repack 0"), PROBE_DEFAULT (1), WORK (files, default /tmp/keep-qwen3-big),
#   KEEP (target/release/keep), PY (a Python with torch, numpy, pyyaml, tqdm for the
#   converter: default tools/oracle/.venv's). KEEP_FILES=1 keeps the checkpoint and the GGUF
#   for the next run (reused when present); PREPARE_ONLY=1 stops once both are written.
#   Must run as root (drop_caches, cgroup). Sizes take B/KiB/MiB/GiB suffixes.
# Disk: LAYERS=48 writes about 17 GB of MLX checkpoint and 17 GB of GGUF (refused if the disk
#   has less free than both need). Time, in CPU seconds of one core (measured at 2 and 4
#   layers): keep synth about 15 per layer, the conversion about 19 per layer plus 12 (so
#   about 12 and 16 minutes at 48 layers on a quiet machine); the conversion's peak RSS is
#   3.5 GB whatever the depth. The runs re-read what does not stay cached (4 layers, 1.7 GB,
#   in a 1 GiB cgroup: llama-bench read 11 GB per run, keep's mmap 2.6 GB, keep
#   --memory-budget 0.9 GB). Not part of .ci/run.
set -euo pipefail

ROUNDS="${1:-2}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${2:-$REPO/dev/evidence/qwen3-bigger-than-ram.json}"
W="${LLAMA_SIDE_DIR:-/tmp/keep-llama-cpp}"
WORK="${WORK:-/tmp/keep-qwen3-big}"
KEEP="${KEEP:-$REPO/target/release/keep}"
LAYERS="${LAYERS:-48}" THREADS="${THREADS:-2}" P="${P:-16}" N="${N:-16}"
MEM="${MEM:-8GiB}" BUDGET="${BUDGET:-6GiB}"
LLAMA_ARGS="${LLAMA_ARGS-"--repack 0"}"
PROBE_DEFAULT="${PROBE_DEFAULT:-1}"
PY="${PY:-$REPO/tools/oracle/.venv/bin/python}"
LCP_VERSION=0.3.36

bytes() {
  python3 -c '
import re, sys
m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?", sys.argv[1])
if not m: sys.exit(f"not a size: {sys.argv[1]}")
print(int(float(m[1]) * {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[m[2]]))' "$1"
}
MEMB="$(bytes "$MEM")" BUDGETB="$(bytes "$BUDGET")"

if [[ "${PREPARE_ONLY:-0}" != 1 && -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2
  exit 1
fi
if [[ "${PREPARE_ONLY:-0}" != 1 ]]; then
  [[ "$(id -u)" == 0 && -w /proc/sys/vm/drop_caches ]] || {
    echo "must run as root: drops the page cache and makes memory cgroups" >&2; exit 1; }
fi
[[ -x "$PY" ]] || { echo "no Python at $PY (set PY, or run .ci/run once to make tools/oracle/.venv)" >&2; exit 1; }
"$PY" -c 'import torch, numpy, yaml, tqdm' || { echo "$PY lacks torch/numpy/pyyaml/tqdm" >&2; exit 1; }

# --- llama.cpp -------------------------------------------------------------------------------
# (BUILD_ONLY stops before it writes its evidence file; FORCE=1 only skips its check for one.)
FORCE=1 BUILD_ONLY=1 LLAMA_SIDE_DIR="$W" "$REPO/dev/llama-cpp-side-by-side.sh" >&2
SRC="$W/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
CMAKE="$(command -v cmake || echo "$W/venv/bin/cmake")"
B="$W/full"
if [[ ! -f "$B/build/CMakeCache.txt" ]]; then
  mkdir -p "$B"
  nice -n 10 "$CMAKE" -S "$SRC" -B "$B/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >"$B/configure.log"
fi
nice -n 10 "$CMAKE" --build "$B/build" --target llama-bench -j "$(nproc)" >"$B/build-bench.log"
LB="$B/build/bin/llama-bench"
[[ -x "$LB" ]] || { echo "llama-bench missing (see $B/build-bench.log)" >&2; exit 1; }

# --- keep ------------------------------------------------------------------------------------
if [[ ! -x "$KEEP" ]]; then
  (cd "$REPO" && nice -n 10 cargo build --release -p keep-cli >&2)
fi

# --- the two 4-bit copies --------------------------------------------------------------------
Q="$WORK/qwen3-30b-a3b-L$LAYERS"
mkdir -p "$Q"
# About 0.35 GB per layer plus 0.35 GB of embedding and head, in either format.
EST=$(( (LAYERS + 1) * 350 * 1000 * 1000 ))
need_disk() { # bytes: refuse to start a write the disk cannot hold
  local avail; avail=$(( $(df --output=avail -B1 "$Q" | tail -1) ))
  if (( avail < $1 )); then
    echo "need $(( $1 / 1000000000 )) GB free under $Q for $2, have $(( avail / 1000000000 )) GB" >&2
    exit 1
  fi
}
if [[ ! -f "$Q/mlx4/config.json" ]]; then
  need_disk $(( 2 * EST + 1000000000 )) "the MLX checkpoint and the GGUF"
  "$KEEP" synth --family qwen3_moe --preset qwen3-30b-a3b --layers "$LAYERS" --format mlx4 \
    --out "$Q/mlx4" --force >&2
fi
if [[ ! -f "$Q/q4_0.gguf" ]]; then
  need_disk $(( EST + 1000000000 )) "the GGUF"
  echo "converting to $Q/q4_0.gguf (log: $Q/convert.log)" >&2
  nice -n 10 "$PY" "$REPO/dev/qwen3_mlx4_gguf.py" "$SRC" "$Q/mlx4" "$REPO/models/keep-tiny" \
    "$Q/q4_0.gguf" >"$Q/convert.log" 2>&1 || { tail -20 "$Q/convert.log" >&2; exit 1; }
  grep '^checked' "$Q/convert.log" >&2
fi
echo "MLX checkpoint: $Q/mlx4 ($(stat -c %s "$Q"/mlx4/* | awk '{s += $1} END {print s}') bytes); GGUF: $Q/q4_0.gguf ($(stat -c %s "$Q/q4_0.gguf") bytes)" >&2
if [[ "${PREPARE_ONLY:-0}" == 1 ]]; then
  exit 0
fi

# --- rounds ----------------------------------------------------------------------------------
RAW="$WORK/raw.$$"
rm -rf "$RAW"; mkdir -p "$RAW"
cleanup() { # a run interrupted mid-way leaves its cgroup behind: remove the empty ones
  local parent
  parent="/sys/fs/cgroup/memory$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)"
  for cg in "$parent"/memcg-run-*; do
    [[ -d "$cg" && ! -s "$cg/cgroup.procs" ]] && rmdir "$cg" 2>/dev/null || true
  done
}
trap cleanup EXIT
in_memcg() { # NAME COMMAND...: one run from a dropped page cache, in a MEM-bounded cgroup
  local name=$1; shift
  echo "+ [$name] $*" >&2
  python3 "$REPO/dev/memcg_run.py" --limit "$MEMB" --disk-of "$Q" --out "$RAW/$name.run.json" \
    --stdout "$RAW/$name.stdout" --stderr "$RAW/$name.stderr" -- "$@" \
    || echo "  [$name] exited with status $? (recorded)" >&2
}
read -r -a LLAMA_EXTRA <<<"$LLAMA_ARGS"
LLAMA=("$LB" -m "$Q/q4_0.gguf" -t "$THREADS" -p "$P" -n "$N" -r 1 -o json)
KEEPRUN=(env RAYON_NUM_THREADS="$THREADS" "$KEEP" run "$Q/mlx4" --prompt-tokens "$P"
  --max-tokens "$N" --temperature 0 --kernels fast --force)
if [[ "$PROBE_DEFAULT" == 1 ]]; then
  in_memcg llama-default "${LLAMA[@]}"
fi
for r in $(seq 1 "$ROUNDS"); do
  in_memcg "llama-mmap-$r" "${LLAMA[@]}" "${LLAMA_EXTRA[@]}"
  in_memcg "keep-budget-$r" "${KEEPRUN[@]}" --memory-budget "$BUDGET" --stats-json "$RAW/keep-budget-$r.stats.json"
  in_memcg "keep-mmap-$r" "${KEEPRUN[@]}" --stats-json "$RAW/keep-mmap-$r.stats.json"
done

python3 - "$RAW" "$OUT" "$Q" "$ROUNDS" "$LAYERS" "$THREADS" "$P" "$N" "$MEMB" "$BUDGETB" \
  "$LLAMA_ARGS" "$PROBE_DEFAULT" "$*" "$MEM" "$BUDGET" "$KEEP" "$LB" \
  "$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)" <<'PYEOF'
import hashlib, json, os, platform, statistics, subprocess, sys, time
(raw, out, q, rounds, layers, threads, p, n, mem, budget, llama_args, probe, args,
 mem_s, budget_s, keep_bin, llama_bin, repo_commit) = sys.argv[1:19]
rounds, mem, budget = int(rounds), int(mem), int(budget)

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()

def lscpu_model():
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("Model name")), None)

def llama_row(name):
    run = load(f"{raw}/{name}.run.json")
    bench = load(f"{raw}/{name}.stdout")
    row = {"engine": "llama.cpp", "run": run}
    if run and run["exit_code"] == 0 and bench:
        pp = next(x for x in bench if x["n_prompt"] > 0)
        tg = next(x for x in bench if x["n_gen"] > 0)
        row.update(prefill_tps=pp["avg_ts"], decode_tps=tg["avg_ts"], peak_rss_bytes=run["peak_rss_bytes"],
                   llama={k: pp.get(k) for k in ("build_commit", "model_type", "model_size", "repack",
                                                 "load_mode", "n_threads", "flash_attn")})
    return row

def keep_row(name):
    run = load(f"{raw}/{name}.run.json")
    stats = load(f"{raw}/{name}.stats.json")
    row = {"engine": "keep", "run": run}
    if run and run["exit_code"] == 0 and stats:
        row.update(prefill_tps=stats["prefill_tps"], decode_tps=stats["decode_tps"],
                   peak_rss_bytes=stats["peak_rss_bytes"],
                   keep={k: stats.get(k) for k in ("plan", "prefill_cache", "decode_cache", "load_secs",
                                                   "prefill_secs", "decode_secs", "decode_tokens")})
    return row

def stderr_tail(name):
    try:
        with open(f"{raw}/{name}.stderr", errors="replace") as f:
            return f.read()[-2000:]
    except OSError:
        return None

config = load(f"{q}/mlx4/config.json")
mlx_bytes = sum(os.path.getsize(os.path.join(q, "mlx4", f)) for f in os.listdir(f"{q}/mlx4"))
gguf_bytes = os.path.getsize(f"{q}/q4_0.gguf")
engines = {"llama-mmap": llama_row, "keep-budget": keep_row, "keep-mmap": keep_row}
runs = []
for r in range(1, rounds + 1):
    for eng, fn in engines.items():
        row = fn(f"{eng}-{r}")
        row = {"round": r, "mode": eng, **row}
        if "decode_tps" not in row:
            row["failed"] = True
            row["stderr_tail"] = stderr_tail(f"{eng}-{r}")
        runs.append(row)

def med(mode, key):
    xs = [x[key] for x in runs if x["mode"] == mode and key in x]
    return statistics.median(xs) if xs else None

median = {m: {"prefill_tps": med(m, "prefill_tps"), "decode_tps": med(m, "decode_tps"),
              "peak_rss_bytes": max((x["peak_rss_bytes"] for x in runs if x["mode"] == m and "peak_rss_bytes" in x),
                                    default=None),
              "memcg_max_usage_bytes": max((x["run"]["memcg"]["max_usage_bytes"] for x in runs
                                            if x["mode"] == m and x["run"]), default=None),
              "runs_ok": sum(1 for x in runs if x["mode"] == m and "decode_tps" in x)}
          for m in engines}
def ratio(a, b, key):
    x, y = median[a][key], median[b][key]
    return x / y if x is not None and y else None
ratios = {f"{a}/{b}": {"prefill": ratio(a, b, "prefill_tps"), "decode": ratio(a, b, "decode_tps")}
          for a, b in (("keep-budget", "llama-mmap"), ("keep-budget", "keep-mmap"))}

# The conditions that make the numbers mean "bigger than the memory it may use".
memcgs = [x["run"]["memcg"] for x in runs if x["run"]]
checks = {
    "model_larger_than_mem": {"mlx4_bytes": mlx_bytes, "gguf_bytes": gguf_bytes, "mem_bytes": mem,
                              "ok": mlx_bytes > mem and gguf_bytes > mem},
    "every_run_within_mem": all(m["max_usage_bytes"] <= m["limit_bytes"] for m in memcgs),
    "page_cache_charged_in_mmap_runs": all(
        x["run"]["memcg"]["cache_bytes_at_exit"] > 0 for x in runs if x["mode"] != "keep-budget" and x["run"]),
    "page_cache_dropped_before_every_run": all(x["run"]["page_cache_dropped_before"] for x in runs if x["run"]),
    "keep_budget_peak_rss_under_budget": all(
        x["peak_rss_bytes"] <= budget for x in runs if x["mode"] == "keep-budget" and "peak_rss_bytes" in x),
}
dec = ratios["keep-budget/llama-mmap"]["decode"]
goal = {"rule": "keep --memory-budget decode >= 2x llama.cpp's mmap (median tok/s), keep's peak RSS under the budget",
        "decode_ratio": dec, "peak_rss_under_budget": checks["keep_budget_peak_rss_under_budget"],
        "reached": bool(dec is not None and dec >= 2 and checks["keep_budget_peak_rss_under_budget"])}

probe_row = None
if probe == "1":
    pr = load(f"{raw}/llama-default.run.json")
    probe_row = {"what": "llama-bench with its defaults (repack on), same cgroup, before the rounds",
                 "run": pr, **({k: v for k, v in llama_row("llama-default").items() if k not in ("engine", "run")}),
                 "stderr_tail": stderr_tail("llama-default") if not (pr and pr["exit_code"] == 0) else None}

res = {"format": "keep-bigger-than-ram-qwen3", "version": 1,
       "command": f"dev/qwen3-bigger-than-ram.sh {args}".strip(),
       "env": {"LAYERS": layers, "MEM": mem_s, "BUDGET": budget_s, "THREADS": threads, "P": p, "N": n,
               "LLAMA_ARGS": llama_args, "PROBE_DEFAULT": probe},
       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "repo_commit": repo_commit,
       "binaries": {"keep": {"path": keep_bin, "sha256": sha256(keep_bin)},
                    "llama_bench": {"path": llama_bin, "sha256": sha256(llama_bin)}},
       "machine": {"lscpu_model": lscpu_model(), "nproc": os.cpu_count(),
                   "mem_total_bytes": int(open("/proc/meminfo").readline().split()[1]) * 1024,
                   "uname": platform.uname()._asdict()},
       "shape": {"preset": "qwen3-30b-a3b", "layers": int(layers),
                 **{k: config.get(k) for k in ("hidden_size", "num_experts", "num_experts_per_tok",
                                               "moe_intermediate_size", "vocab_size")},
                 "keep": "mlx-community MLX affine 4-bit, group 64, routers 8-bit, experts stacked in switch_mlp",
                 "llama": "q4_0 GGUF (llama.cpp's converter on the MLX weights dequantized; F32 routers and norms)",
                 "mlx4_bytes": mlx_bytes, "gguf_bytes": gguf_bytes},
       "mem_limit_bytes": mem, "budget_bytes": budget, "threads": int(threads),
       "prompt_tokens": int(p), "decode_tokens": int(n), "rounds": rounds,
       "llama_default_probe": probe_row,
       "runs": runs, "median": median, "ratios": ratios, "checks": checks, "goal": goal}
tmp = out + ".part"
with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
os.replace(tmp, out)
for m, v in median.items():
    print(f"{m}: prefill {v['prefill_tps']} tok/s, decode {v['decode_tps']} tok/s, peak RSS {v['peak_rss_bytes']}, "
          f"cgroup peak {v['memcg_max_usage_bytes']} ({v['runs_ok']}/{rounds} ok)")
for k, v in ratios.items():
    print(f"{k}: prefill {v['prefill']}, decode {v['decode']}")
print("checks:", json.dumps(checks))
print("goal:", json.dumps(goal))
if probe_row:
    pr = probe_row["run"] or {}
    print(f"llama-bench defaults in the cgroup: exit {pr.get('exit_code')}, signal {pr.get('signal')}, "
          f"OOM kills {(pr.get('memcg') or {}).get('oom_kills')}")
PYEOF
[[ "${KEEP_FILES:-0}" == 1 ]] || rm -rf "$Q"
rm -rf "$RAW"
