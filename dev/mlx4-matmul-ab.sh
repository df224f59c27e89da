#!/usr/bin/env bash
# MLX affine 4-bit weights, exact kernels against fast ones (`keep bench matmul --format mlx4
# --kernels exact,fast`), at Qwen3-30B-A3B's expert shapes (gate/up 768x2048 and down 2048x768,
# OUTxIN) and its head (151936x2048), M = 1, 8, 32, 64, one thread. Rounds are interleaved: in
# each round every (shape, M) runs exact then fast back to back; every row records wall time
# and the thread's CPU time per call (the number to read on a busy machine) and the load
# average beside it.
#
# Usage: dev/mlx4-matmul-ab.sh [ROUNDS] [OUT.json]
#   ROUNDS default 3; OUT default dev/evidence/mlx4-matmul-exact-vs-fast.json (refused if it exists
#   unless FORCE=1). KEEP (target/release/keep), SECONDS_PER_CASE (1), THREADS (1),
#   SHAPES ("768x2048,2048x768,151936x2048"), MS ("1,8,32,64").
set -euo pipefail
ROUNDS="${1:-3}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${2:-$REPO/dev/evidence/mlx4-matmul-exact-vs-fast.json}"
KEEP="${KEEP:-$REPO/target/release/keep}"
SECS="${SECONDS_PER_CASE:-1}" THREADS="${THREADS:-1}"
SHAPES="${SHAPES:-768x2048,2048x768,151936x2048}" MS="${MS:-1,8,32,64}"
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2
  exit 1
fi
[[ -x "$KEEP" ]] || (cd "$REPO" && cargo build --release -p keep-cli >&2)
TMP="$(mktemp)"
trap 'rm -f "$TMP"' EXIT
for ((r = 1; r <= ROUNDS; r++)); do
  IFS=, read -ra SH <<<"$SHAPES"
  IFS=, read -ra MM <<<"$MS"
  for s in "${SH[@]}"; do
    for m in "${MM[@]}"; do
      load="$(cut -d' ' -f1-3 /proc/loadavg)"
      "$KEEP" bench matmul --format mlx4 --shape "$s" --m "$m" --kernels exact,fast \
        --threads "$THREADS" --seconds "$SECS" --json |
        while read -r line; do echo "{\"round\":$r,\"loadavg\":\"$load\",\"row\":$line}"; done >>"$TMP"
    done
  done
done
python3 - "$TMP" "$OUT" "$ROUNDS" "$THREADS" <<'PY'
import json, os, statistics, sys, platform
tmp, out, rounds, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(tmp)]
cases = {}
for x in rows:
    r = x["row"]
    cases.setdefault((r["rows"], r["cols"], r["m"]), {}).setdefault(r["kernels"], []).append(
        r["thread_cpu_us_per_call"] or r["us_per_call"])
summary = []
for (o, i, m), k in sorted(cases.items()):
    e, f = statistics.median(k["exact"]), statistics.median(k["fast"])
    summary.append({"shape": f"{o}x{i}", "m": m, "exact_cpu_us": e, "fast_cpu_us": f,
                    "fast_speedup": e / f})
    print(f"{o:>6}x{i:<5} m={m:<3} exact {e:10.1f} us  fast {f:10.1f} us  fast/exact speed {e/f:5.2f}x")
doc = {"bench": "mlx4-matmul-ab", "command": " ".join(["dev/mlx4-matmul-ab.sh"] + sys.argv[3:4]),
       "rounds": rounds, "threads": threads, "machine": platform.processor() or platform.machine(),
       "cpu_model": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
       "metric": "median over rounds of thread CPU us per call", "summary": summary, "rows": rows}
tmp_out = out + ".tmp"
with open(tmp_out, "w") as f:
    json.dump(doc, f, indent=1)
os.replace(tmp_out, out)
PY
echo "wrote $OUT" >&2
