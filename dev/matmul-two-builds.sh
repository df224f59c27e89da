#!/usr/bin/env bash
# One weight product on two builds of keep, side by side (`keep bench matmul`): for every
# (shape, M, threads) and every round, the BEFORE binary's kernels, then the AFTER binary's,
# then the AFTER binary's exact kernels as the yardstick, back to back, so that both builds
# see the same machine. Wall microseconds per call (several threads run the product) with the
# load average beside each row; the summary takes the median over rounds of each side and of
# the per-round ratio before ÷ after time.
#
# Usage: dev/matmul-two-builds.sh BEFORE AFTER [ROUNDS] [OUT.json]
#   BEFORE, AFTER: keep binaries (copy them aside first); ROUNDS default 5; OUT default
#   dev/evidence/matmul-two-builds.json (refused if it exists unless FORCE=1). FORMAT (bf16),
#   KERNELS (fast), SHAPES ("4096x4096,151936x2048"), MS ("1"), THREADS ("1,2"),
#   SECONDS_PER_CASE (2), BEFORE_COMMIT / AFTER_COMMIT (recorded as given); KEEP_SIMD (e.g.
#   avx2, to time the AVX2 kernels on an AVX-512 machine) is passed on and recorded.
set -euo pipefail
BEFORE="$1" AFTER="$2"
ROUNDS="${3:-5}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${4:-$REPO/dev/evidence/matmul-two-builds.json}"
FORMAT="${FORMAT:-bf16}" KERNELS="${KERNELS:-fast}" SECS="${SECONDS_PER_CASE:-2}"
SHAPES="${SHAPES:-4096x4096,151936x2048}" MS="${MS:-1}" THREADS="${THREADS:-1,2}"
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2
  exit 1
fi
TMP="$(mktemp)"
trap 'rm -f "$TMP"' EXIT
IFS=, read -ra SH <<<"$SHAPES"
IFS=, read -ra MM <<<"$MS"
IFS=, read -ra TT <<<"$THREADS"
LOAD_BEFORE="$(cat /proc/loadavg)"
for ((r = 1; r <= ROUNDS; r++)); do
  for s in "${SH[@]}"; do
    for m in "${MM[@]}"; do
      for t in "${TT[@]}"; do
        for side in before after yardstick; do
          case $side in
            before) bin="$BEFORE" k="$KERNELS" ;;
            after) bin="$AFTER" k="$KERNELS" ;;
            yardstick) bin="$AFTER" k=exact ;;
          esac
          load="$(cut -d' ' -f1-3 /proc/loadavg)"
          "$bin" bench matmul --format "$FORMAT" --shape "$s" --m "$m" --kernels "$k" \
            --threads "$t" --seconds "$SECS" --json |
            while read -r line; do
              echo "{\"round\":$r,\"side\":\"$side\",\"loadavg\":\"$load\",\"row\":$line}"
            done >>"$TMP"
        done
      done
    done
  done
done
LOAD_AFTER="$(cat /proc/loadavg)"
python3 - "$TMP" "$OUT" "$ROUNDS" "$LOAD_BEFORE" "$LOAD_AFTER" "$BEFORE" "$AFTER" <<'PY'
import json, os, statistics, subprocess, sys
tmp, out, rounds, lb, la, before, after = sys.argv[1:8]
rows = [json.loads(l) for l in open(tmp)]
cases = {}
for x in rows:
    r = x["row"]
    key = (r["rows"], r["cols"], r["m"], r["threads"])
    cases.setdefault(key, {}).setdefault(x["side"], {})[x["round"]] = r
summary = []
for (o, i, m, t), sides in sorted(cases.items()):
    med = {s: statistics.median(v["us_per_call"] for v in sides[s].values()) for s in sides}
    gbps = {s: statistics.median(v["weight_gbps"] for v in sides[s].values()) for s in sides}
    ratios = [sides["before"][k]["us_per_call"] / sides["after"][k]["us_per_call"]
              for k in sides["before"] if k in sides["after"]]
    summary.append({"shape": f"{o}x{i}", "m": m, "threads": t, "us_per_call": med,
                    "weight_gbps": gbps, "after_speedup": statistics.median(ratios),
                    "after_speedup_min": min(ratios), "after_speedup_max": max(ratios),
                    "after_vs_exact": med["yardstick"] / med["after"]})
    print(f"{o:>6}x{i:<5} m={m:<3} t={t}  before {gbps['before']:6.2f}  after {gbps['after']:6.2f}"
          f"  exact {gbps['yardstick']:6.2f} GB/s  after/before {statistics.median(ratios):.3f}")
def sha(p):
    return subprocess.run(["sha256sum", p], capture_output=True, text=True).stdout[:16]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
l3 = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^L3 cache: *//p'"], capture_output=True, text=True).stdout.strip()
doc = {"bench": "matmul-two-builds",
       "command": f"dev/matmul-two-builds.sh BEFORE AFTER {rounds}",
       "format": os.environ.get("FORMAT", "bf16"), "kernels": os.environ.get("KERNELS", "fast"),
       "before_commit": os.environ.get("BEFORE_COMMIT", ""), "after_commit": os.environ.get("AFTER_COMMIT", ""),
       "before_sha256_16": sha(before), "after_sha256_16": sha(after),
       "rounds": int(rounds), "machine": {"cpu": cpu, "cpus": os.cpu_count(), "l3": l3},
       "keep_simd": os.environ.get("KEEP_SIMD", ""),
       "loadavg_before": lb, "loadavg_after": la,
       "metric": "median over rounds of wall us per call; after_speedup is the median of per-round before/after time",
       "summary": summary, "rows": rows}
with open(out + ".tmp", "w") as f:
    json.dump(doc, f, indent=1)
os.replace(out + ".tmp", out)
print("wrote", out)
PY
