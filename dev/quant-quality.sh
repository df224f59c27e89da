#!/usr/bin/env bash
# Quantize the bundled model's routed experts to every keep quant format (the E8P lattice rungs
# and MLX affine 2/3/4-bit, group 64) and score each with keep eval against the teacher's
# held-out split. Usage: dev/quant-quality.sh [WORKDIR] (FORMATS="mlx2 mlx4" to run a subset)
# (needs target/release/keep: cargo build --release -p keep-cli). Prints one line per format
# and leaves the eval JSON, the quant reports and the load averages in WORKDIR.
set -euo pipefail
KEEP=${KEEP:-$(dirname "$0")/../target/release/keep}
W=${1:-/tmp/keep-quant-quality}
mkdir -p "$W"
[ -f "$W/run/imatrix.safetensors" ] || { "$KEEP" calibrate --out "$W/run"; "$KEEP" finalize "$W/run"; }
[ -f "$W/eval/run.json" ] || "$KEEP" calibrate --split eval --out "$W/eval"
for f in ${FORMATS:-e8p2 e8p2+e81 e8p2+e8p2 mlx2 mlx3 mlx4}; do
  cat /proc/loadavg > "$W/load-$f.txt"
  "$KEEP" quant --imatrix "$W/run" --format "$f" --force --json --out "$W/tiny-$f" > "$W/quant-$f.json"
  "$KEEP" eval --teacher "$W/eval" --json "$W/tiny-$f" > "$W/eval-$f.json"
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['students'][0]; q=json.load(open(sys.argv[3])); print(sys.argv[2], 'bits/weight', q['bits_per_weight'], 'KL', s['mean_kl'], 'dNLL', s['mean_dnll'], 'top1', s['top1'])" "$W/eval-$f.json" "$f" "$W/quant-$f.json"
done
