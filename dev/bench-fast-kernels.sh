#!/usr/bin/env bash
# The fast (integer / bf16) decode kernels at decode shapes, in one command (not a test):
#  1. `keep bench kill-tests --quick --only fast-kernels,fast-residents`: the routed FFN
#     (MXFP4, E8P) and the square resident GEMVs (MXFP8, bf16, affine-8) at M = 1, 4, 8, 32,
#     GB/s of weight bytes against the read bandwidth measured in the same run;
#  2. the one-thread CPU-time breakdown (`intdot::tests::print_cpu_time_breakdown`): the E8P
#     row decode alone (512 KiB table vs the AVX-512 register decoder), the activation
#     quantization, and whole products per level (E8P, MXFP4, MXFP8), timed by thread CPU time so it still means
#     something on a shared machine.
# The load average is recorded before and after; numbers taken with a load above the core
# count are indicative only (the kill-test rows then say BUSY instead of PASS).
#
# Usage: dev/bench-fast-kernels.sh [OUT_DIR]
#   default OUT_DIR: dev/evidence/fast-kernels-<date>; KEEP=path/to/keep skips the build.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-dev/evidence/fast-kernels-$(date +%Y%m%d-%H%M)}"
if [ -e "$OUT" ] && [ -z "${FORCE:-}" ]; then
  echo "$OUT exists (FORCE=1 to overwrite)" >&2
  exit 1
fi
if [ -z "${KEEP:-}" ]; then
  cargo build --release -q -p keep-cli
  KEEP=target/release/keep
fi
mkdir -p "$OUT"
echo "{\"when\":\"before\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\",\"cores\":$(nproc),\"git\":\"$(git rev-parse --short HEAD)\"}" > "$OUT/load.jsonl"
"$KEEP" bench kill-tests --quick --only fast-kernels,fast-residents --out "$OUT"
KEEP_PRINT_M="${MS:-1,8,32}" cargo test --release -q -p keep-kernels --lib \
  intdot::tests::print_cpu_time_breakdown -- --ignored --nocapture | tee "$OUT/cpu-time-breakdown.txt"
echo "{\"when\":\"after\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}" >> "$OUT/load.jsonl"
echo "evidence in $OUT"
