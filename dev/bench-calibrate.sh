#!/usr/bin/env bash
# Calibration benchmark (not a test): `keep calibrate` (layer-streamed forward with every
# observer attached: imatrix, REAP, routes) vs mlx-lm's plain forward over the same records, in
# one run, rounds interleaved (keep, mlx-lm, keep, ...) so machine load hits both alike; medians.
# Also keep's peak RSS (VmHWM) against the model's size on disk. Prints every JSON line, then
# the ratio and the goal (keep >= 10x mlx-lm; peak RSS about one layer plus activations).
#
# Usage: dev/bench-calibrate.sh MODEL_DIR PACK_DIR [SHARD=0/4] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="$(realpath "$1")"; PACK="$(realpath "$2")"; SHARD="${3:-0/4}"; ROUNDS="${4:-3}"
PY="$(pwd)/tools/oracle/.venv/bin/python"
cargo build --release -q -p keep-cli
KEEP="$(pwd)/target/release/keep"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
field() { echo "$1" | tr -d '\n ' | sed "s/.*\"$2\":\([0-9.e+-]*\).*/\1/"; }
k_tps=""; m_tps=""; rss=""
for i in $(seq "$ROUNDS"); do
  k=$("$KEEP" calibrate "$MODEL" --pack "$PACK" --out "$TMP/run-$i" --shard "$SHARD" --json)
  echo "$k" | tr -d '\n'; echo
  k_tps+="$(field "$k" tokens_per_s) "; rss+="$(field "$k" peak_rss_bytes) "
  m=$(cd tools/oracle && "$PY" calib_bench.py "$MODEL" "$PACK" --shard "$SHARD"); echo "$m"
  m_tps+="$(field "$m" tok_s) "
done
median() { printf '%s\n' $1 | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
kt=$(median "$k_tps"); mt=$(median "$m_tps"); r=$(median "$rss")
size=$(du -cb "$MODEL"/*.safetensors | tail -1 | cut -f1)
echo "model: $MODEL ($size bytes of safetensors)  pack: $PACK shard $SHARD  machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "calibration tokens/s: keep $kt | mlx-lm forward $mt ($(awk -v a="$kt" -v b="$mt" 'BEGIN{printf "%.1fx", a/b}'))  goal: >= 10x"
echo "keep peak RSS: $r bytes = $(awk -v a="$r" -v b="$size" 'BEGIN{printf "%.2f", a/b}') x the model's safetensors"
