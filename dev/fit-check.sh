#!/usr/bin/env bash
# keep fit, predicted against measured, on the bundled model: a calibration run (routes, REAP),
# an eval run (teacher), `keep eval --json` KL points at REAP levels, then for a memory below the
# model's size: the fitted plan (--min-quality KL), the best offload-only and prune-only plans
# (forced with --levels), each checked with `keep fit --check` (tok/s, hit rate, peak RSS, KL).
# The probes and the check decode the same held-out records of the bundled pack (the plan's
# check set), so the predicted routes are the routes the check makes.
# Writes dev/evidence/fit-bundled.json. Rerun on a quiet machine with one command:
#   dev/fit-check.sh            (KEEP=path/to/keep to skip the build; WORK=dir for the runs)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/fit}
KEEP=${KEEP:-}
if [ -z "$KEEP" ]; then
  cargo build --release -p keep-cli
  KEEP=target/release/keep
fi
export KEEP_CACHE_DIR=${KEEP_CACHE_DIR:-$WORK/cache}
mkdir -p "$WORK"
MIN_KL=${MIN_KL:-0.035}
TOKENS=${TOKENS:-64}
[ -f "$WORK/calib/reap-stats.safetensors" ] || { $KEEP calibrate --out "$WORK/calib"; $KEEP finalize "$WORK/calib"; }
[ -d "$WORK/evalrun" ] || $KEEP calibrate --split eval --out "$WORK/evalrun"
if [ ! -f "$WORK/eval-fast.json" ]; then
  masks=()
  for k in 28 24 20 16 12; do
    $KEEP select "$WORK/calib" --keep $k --hash-remap reap-next --no-plot --out "$WORK/mask-$k.json" --force >/dev/null
    masks+=(--mask "$WORK/mask-$k.json")
  done
  $KEEP eval --teacher "$WORK/evalrun" --kernels fast "${masks[@]}" --json > "$WORK/eval-fast.json"
fi
# The memory: the bundled model's routed experts do not fit, half of them do.
MEM=${MEM:-23MiB}
rows=()
for kind in fitted offload prune; do
  case $kind in
    fitted) extra=(--min-quality "$MIN_KL");;
    offload) extra=(--knob offload);;
    prune) extra=(--min-quality "$MIN_KL" --knob prune);;
  esac
  plan="$WORK/plan-$kind.json"
  # A single-knob plan may not exist at this quality and memory: say so and go on.
  if ! $KEEP fit --memory "$MEM" --run "$WORK/calib" --eval "$WORK/eval-fast.json" --out "$plan" --force \
    --context 128 --probe-tokens "$TOKENS" --derived-dir "$WORK/derived-$kind" "${extra[@]}" | tee "$WORK/fit-$kind.txt"; then
    echo "no $kind plan fits $MEM at KL <= $MIN_KL"; continue
  fi
  $KEEP fit --check "$plan" --build --teacher "$WORK/evalrun" --probe-tokens "$TOKENS" --json > "$WORK/check-$kind.json"
  rows+=("$WORK/check-$kind.json")
done
mkdir -p dev/evidence
python3 - "$MEM" "${rows[@]}" > dev/evidence/fit-bundled.json <<'PY'
import json, sys
mem = sys.argv[1]
rows = [json.load(open(p)) for p in sys.argv[2:]]
import os
print(json.dumps({"format": "keep-fit-evidence", "version": 1, "model": "bundled keep-tiny",
                  "memory": mem, "loadavg_at_end": os.getloadavg(), "checks": rows}, indent=2))
PY
echo "wrote dev/evidence/fit-bundled.json"
