#!/usr/bin/env bash
# The Engram overhead and `keep fit` on a V4.1-Flash-shaped model whose Engram tables are
# larger than the machine's memory, in one command (what docs/results.md's Engram rows and
# the large-model `keep fit` row come from):
#   1. keep synth CONFIG --engram-bytes ENGRAM_BYTES  (default: dev/configs/flash43-half-engram.json,
#      43 decoder layers, Engram before layers 1 and 14 as V4.1-Flash, 24 GiB of tables; see
#      below for the shapes), refused unless the disk has the model's size plus 2 GB free;
#   2. dev/bench-engram.sh on it: decode with and without the Engram layers, interleaved
#      rounds, page cache dropped before each, under --memory-budget BUDGET;
#   3. dev/fit-check-model.sh on it: keep fit --memory MEM (offload only, no calibration run),
#      keep run --plan, keep fit --check (predicted against measured tok/s, hit rate, peak RSS);
#   4. the model deleted (KEEP_MODEL=1 keeps it).
# Usage: dev/engram-big.sh [OUT_PREFIX]   (default dev/evidence/engram-big)
# Environment: CONFIG, ENGRAM_BYTES (24GiB), BUDGET (8GiB), MEM (8GiB), ROUNDS (3), PROMPT (32),
#   TOKENS (17), SEQS (4, the check set's sequences), MODEL_DIR (/tmp/bigflash/model), KEEP (skip the build), KEEP_MODEL.
# The small test of the procedure (minutes, ~2.4 GB):
#   CONFIG=dev/configs/flash16-half-engram.json ENGRAM_BYTES=256MiB BUDGET=1800MiB MEM=1800MiB \
#     ROUNDS=1 TOKENS=8 PROMPT=8 SEQS=2 dev/engram-big.sh /tmp/bigflash/engram-small
#
# The big config's shapes: V4.1-Flash's layer count (43), Engram placement (1, 14), Engram
# hashing (n-grams 2..4 over 8 heads, hc 4) and attention kinds, with the hidden size and the
# attention / expert widths halved (hidden 2560, 32 heads of 512, q rank 640, o rank 512,
# experts 1152 wide, 8 per layer, top-6) so that the non-table part is ~3.7 GiB (29.7 GB in all), and Engram rows
# of 128 channels (132 bytes with scales) instead of 256: halving the hidden size doubles the
# Engram projection's share of a token's weight bytes, halving the row width halves it back,
# so the Engram share of decode work stays V4.1-Flash's (~2.5% of the weight bytes a token
# touches) while a token reads as many rows (24 per Engram layer) as on V4.1-Flash.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-dev/evidence/engram-big}
CONFIG=${CONFIG:-dev/configs/flash43-half-engram.json}
ENGRAM_BYTES=${ENGRAM_BYTES:-24GiB}
BUDGET=${BUDGET:-8GiB}; MEM=${MEM:-8GiB}
ROUNDS=${ROUNDS:-3}; PROMPT=${PROMPT:-32}; TOKENS=${TOKENS:-17}
MODEL_DIR=${MODEL_DIR:-/tmp/bigflash/model}
KEEP=${KEEP:-}
if [ -z "$KEEP" ]; then
  cargo build --release -p keep-cli
  KEEP=target/release/keep
fi
export KEEP
bytes() { python3 -c "import re,sys; m=re.fullmatch(r'(\d+)([KMG]iB)?', sys.argv[1]); print(int(m[1]) << {None: 0, 'KiB': 10, 'MiB': 20, 'GiB': 30}[m[2]])" "$1"; }
need=$(( $(bytes "$ENGRAM_BYTES") + (6 << 30) ))
mkdir -p "$(dirname "$MODEL_DIR")"
free=$(df -B1 --output=avail "$(dirname "$MODEL_DIR")" | tail -1)
if [ ! -d "$MODEL_DIR" ] && [ "$free" -lt "$need" ]; then
  echo "refusing: $free bytes free at $(dirname "$MODEL_DIR"), the model needs about $need with 2 GB to spare" >&2
  exit 1
fi
[ -d "$MODEL_DIR" ] || "$KEEP" synth --config "$CONFIG" --engram-bytes "$ENGRAM_BYTES" --out "$MODEL_DIR"
"$KEEP" inspect "$MODEL_DIR" > "$prefix-inspect.txt" 2>&1 || true
du -sb "$MODEL_DIR" | tee -a "$prefix-inspect.txt"
dev/bench-engram.sh "$MODEL_DIR" "$prefix-overhead.json" "$ROUNDS" "$BUDGET" "$PROMPT" "$TOKENS"
WORK=$(mktemp -d) dev/fit-check-model.sh "$MODEL_DIR" "$MEM" "$prefix-fit.json" "$TOKENS" "$PROMPT" "${SEQS:-4}"
[ -n "${KEEP_MODEL:-}" ] || rm -rf "$MODEL_DIR"
echo "wrote $prefix-overhead.json $prefix-fit.json"
