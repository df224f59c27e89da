#!/usr/bin/env bash
# Decode speed of one model on two builds of keep, side by side: `keep run` greedy with
# `--draft none`, interleaved rounds (odd rounds BEFORE first, even rounds AFTER first), at each
# thread count. Decode (and prefill) tokens/s of every run from `--stats-json`; the evidence has every round,
# the medians, the median of the per-round ratios AFTER / BEFORE, the machine, the load and both
# binaries' hashes. Measure on a quiet machine: the script reports, it asserts nothing.
#
# Usage: dev/decode-two-builds.sh BEFORE AFTER MODEL [ROUNDS] [OUT_JSON]
#   BEFORE, AFTER: keep binaries (copy them aside first); ROUNDS 6; OUT
#   dev/evidence/decode-two-builds.json (refused if it exists unless FORCE=1). THREADS ("1,2"),
#   PROMPT_TOKENS (16), MAX_TOKENS (32), BEFORE_COMMIT / AFTER_COMMIT (recorded as given);
#   KEEP_SIMD (e.g. avx2) is passed on and recorded. MODEL_AFTER (default MODEL): the model the
#   AFTER binary runs, to set one model on one build beside another on another.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: dev/decode-two-builds.sh BEFORE AFTER MODEL [ROUNDS] [OUT_JSON]}
AFTER=${2:?usage: dev/decode-two-builds.sh BEFORE AFTER MODEL [ROUNDS] [OUT_JSON]}
MODEL=${3:?usage: dev/decode-two-builds.sh BEFORE AFTER MODEL [ROUNDS] [OUT_JSON]}
ROUNDS=${4:-6}
MODEL_AFTER=${MODEL_AFTER:-$MODEL}
OUT=${5:-dev/evidence/decode-two-builds.json}
THREADS=${THREADS:-1,2}
PT=${PROMPT_TOKENS:-16}
MAX=${MAX_TOKENS:-32}
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2; exit 1
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat "$MODEL"/*.safetensors "$MODEL_AFTER"/*.safetensors >/dev/null
IFS=, read -ra TT <<<"$THREADS"
# One warm-up run of each build (page cache, first-touch costs) before the timed rounds.
"$BEFORE" run "$MODEL" --prompt-tokens "$PT" --max-tokens 4 --temperature 0 --draft none >/dev/null 2>&1
"$AFTER" run "$MODEL_AFTER" --prompt-tokens "$PT" --max-tokens 4 --temperature 0 --draft none >/dev/null 2>&1
LOAD_BEFORE=$(cat /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then order="before after"; else order="after before"; fi
  for t in "${TT[@]}"; do
    for side in $order; do
      if [[ $side == before ]]; then bin=$BEFORE m=$MODEL; else bin=$AFTER m=$MODEL_AFTER; fi
      cut -d' ' -f1-3 /proc/loadavg >"$TMP/$side-$t-$r.load"
      "$bin" run "$m" --prompt-tokens "$PT" --max-tokens "$MAX" --temperature 0 \
        --draft none --threads "$t" --stats-json "$TMP/$side-$t-$r.json" >/dev/null 2>&1
    done
  done
done
LOAD_AFTER=$(cat /proc/loadavg)
python3 - "$TMP" "$OUT" "$ROUNDS" "$THREADS" "$LOAD_BEFORE" "$LOAD_AFTER" "$BEFORE" "$AFTER" "$MODEL" "$PT" "$MAX" "$MODEL_AFTER" <<'PY'
import json, os, statistics, subprocess, sys
tmp, out, rounds, threads, lb, la, before, after, model, pt, mx, model_after = sys.argv[1:13]
rounds = int(rounds)
res = []
for t in [int(x) for x in threads.split(",")]:
    runs = {s: [json.load(open(f"{tmp}/{s}-{t}-{r}.json"))["decode_tps"] for r in range(1, rounds + 1)]
            for s in ("before", "after")}
    loads = [open(f"{tmp}/before-{t}-{r}.load").read().strip() for r in range(1, rounds + 1)]
    ratios = [a / b for a, b in zip(runs["after"], runs["before"])]
    pre = {s: [json.load(open(f"{tmp}/{s}-{t}-{r}.json"))["prefill_tps"] for r in range(1, rounds + 1)]
           for s in ("before", "after")}
    pre_ratios = [a / b for a, b in zip(pre["after"], pre["before"])]
    res.append({"threads": t, "decode_tps": runs, "loadavg_per_round": loads,
                "prefill_tps": pre, "prefill_median_tps": {s: statistics.median(v) for s, v in pre.items()},
                "prefill_median_ratio_after_before": statistics.median(pre_ratios),
                "prefill_ratio_min": min(pre_ratios), "prefill_ratio_max": max(pre_ratios),
                "median_tps": {s: statistics.median(v) for s, v in runs.items()},
                "median_ratio_after_before": statistics.median(ratios),
                "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print(f"threads {t}: before {statistics.median(runs['before']):.2f} tok/s, after "
          f"{statistics.median(runs['after']):.2f} tok/s, after/before {statistics.median(ratios):.3f}"
          f" ({min(ratios):.2f}-{max(ratios):.2f})")
def sha(p):
    return subprocess.run(["sha256sum", p], capture_output=True, text=True).stdout[:16]
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
l3 = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^L3 cache: *//p'"], capture_output=True, text=True).stdout.strip()
doc = {"bench": "decode-two-builds", "command": f"dev/decode-two-builds.sh BEFORE AFTER MODEL {rounds}",
       "model": model, "model_after": model_after, "prompt_tokens": int(pt), "max_tokens": int(mx),
       "before_commit": os.environ.get("BEFORE_COMMIT", ""), "after_commit": os.environ.get("AFTER_COMMIT", ""),
       "before_sha256_16": sha(before), "after_sha256_16": sha(after),
       "machine": {"cpu": cpu, "cpus": os.cpu_count(), "l3": l3},
       "keep_simd": os.environ.get("KEEP_SIMD", ""),
       "loadavg_before": lb, "loadavg_after": la, "rounds": rounds, "threads": res}
with open(out + ".tmp", "w") as f:
    json.dump(doc, f, indent=1)
os.replace(out + ".tmp", out)
print("wrote", out)
PY
