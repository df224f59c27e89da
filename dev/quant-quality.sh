#!/usr/bin/env bash
# Quantize the bundled model's routed experts to every keep quant format and score each with
# keep eval against the teacher's held-out split. Usage: dev/quant-quality.sh [WORKDIR]
# (needs target/release/keep: cargo build --release -p keep-cli). Prints one line per format
# and leaves the eval JSON, the quant reports and the load averages in WORKDIR.
set -euo pipefail
KEEP=${KEEP:-$(dirname "$0")/../target/release/keep}
W=${1:-/tmp/keep-quant-quality}
mkdir -p "$W"
[ -f "$W/run/imatrix.safetensors" ] || { "$KEEP" calibrate --out "$W/run"; "$KEEP" finalize "$W/run"; }
[ -f "$W/eval/run.json" ] || "$KEEP" calibrate --split eval --out "$W/eval"
for f in e8p2 e8p2+e81 e8p2+e8p2; do
  cat /proc/loadavg > "$W/load-$f.txt"
  "$KEEP" quant --imatrix "$W/run" --format "$f" --force --out "$W/tiny-$f"
  "$KEEP" eval --teacher "$W/eval" --json "$W/tiny-$f" > "$W/eval-$f.json"
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['students'][0]; print(sys.argv[2], 'KL', s['mean_kl'], 'dNLL', s['mean_dnll'], 'top1', s['top1'])" "$W/eval-$f.json" "$f"
done
