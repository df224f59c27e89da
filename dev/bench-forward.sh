#!/usr/bin/env bash
# Forward-pass benchmark (not a test): keep vs mlx-lm (CPU build) on the same checkpoint, in one
# run. Prefill of a 512-token deterministic pseudo-random prompt, then greedy decode of 64 tokens
# one at a time through each implementation's cache. mlx-lm runs twice per round: as it loads the
# checkpoint (bf16 activations) and with weights cast to f32 (keep's arithmetic, and the faster
# of the two on this CPU). Rounds are interleaved (keep, mlx bf16, mlx f32, keep, ...) so machine
# load hits all alike; medians over rounds. Prints every JSON line, then the ratios.
#
# Usage: dev/bench-forward.sh [MODEL_DIR] [ROUNDS]     (default: models/keep-tiny, 3)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-models/keep-tiny}"
ROUNDS="${2:-3}"
MODEL_ABS="$(realpath "$MODEL")"
PY="$(pwd)/tools/oracle/.venv/bin/python"
cargo build --release -q -p keep-model --example model_bench
KEEP=target/release/examples/model_bench
field() { echo "$1" | sed "s/.*\"$2\": *\([0-9.]*\).*/\1/"; }
declare -A vals
for i in $(seq "$ROUNDS"); do
  k=$("$KEEP" "$MODEL_ABS" --prompt-len 512 --decode 64 --reps 1); echo "$k"
  m=$(cd tools/oracle && "$PY" model_bench.py "$MODEL_ABS" --prompt-len 512 --decode 64 --reps 1); echo "$m"
  f=$(cd tools/oracle && "$PY" model_bench.py "$MODEL_ABS" --prompt-len 512 --decode 64 --reps 1 --f32); echo "$f"
  for pair in "keep:$k" "mlx:$m" "mlxf32:$f"; do
    name="${pair%%:*}"; line="${pair#*:}"
    vals[$name.pre]+="$(field "$line" prefill_tok_s) "
    vals[$name.dec]+="$(field "$line" decode_tok_s) "
  done
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1fx", a/b}'; }
kp=$(median "${vals[keep.pre]}"); kd=$(median "${vals[keep.dec]}")
mp=$(median "${vals[mlx.pre]}"); md=$(median "${vals[mlx.dec]}")
fp=$(median "${vals[mlxf32.pre]}"); fd=$(median "${vals[mlxf32.dec]}")
echo "model: $MODEL  machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "prefill(512) tokens/s: keep $kp | mlx-lm $mp ($(ratio "$kp" "$mp")) | mlx-lm f32 $fp ($(ratio "$kp" "$fp"))"
echo "decode       tokens/s: keep $kd | mlx-lm $md ($(ratio "$kd" "$md")) | mlx-lm f32 $fd ($(ratio "$kd" "$fd"))"
echo "goal: keep >= 10x mlx-lm for both"
