#!/usr/bin/env bash
# Prefill GEMM benchmark (not a test): `keep bench peak` (the measured f32-FMA and int8-dot
# peak) and `keep bench matmul` for every format, exact and fast kernels, at prefill M in one
# run on THREADS threads, with the load average before and after. Each case's GFLOP/s
# (2·M·rows·cols per call) is read against the peak of the same run: int8 GOP/s for the
# integer formats (mxfp4, e8p, affine8), and the f32 FMA peak for the bf16 formats
# (`vdpbf16ps` does two multiply-adds per f32 lane, so its own peak is twice the f32 line).
#
# Usage: dev/bench-gemm.sh [THREADS] [OUT.jsonl]
#   defaults: 1 thread, dev/evidence/prefill-gemm-vs-peak.jsonl
#   env: KEEP=path/to/keep (else target/release/keep, built first) MS='32 64 128 512' (32: the row kernels, the last M below the GEMM) FORMATS=mxfp4,e8p,affine8,mxfp8,bf16 SHAPE=2304x5120 SECONDS=1
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-1}"
OUT="${2:-dev/evidence/prefill-gemm-vs-peak.jsonl}"
MS="${MS:-32 64 128 512}"
FORMATS="${FORMATS:-mxfp4,e8p,affine8,mxfp8,bf16}"
SHAPE="${SHAPE:-2304x5120}"
SECONDS_PER="${SECONDS:-1}"
if [ -z "${KEEP:-}" ]; then
  cargo build --release -q -p keep-cli
  KEEP=target/release/keep
fi
tmp="$(mktemp)"
{
  echo "{\"bench\":\"load\",\"when\":\"before\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\",\"cores\":$(nproc),\"command\":\"dev/bench-gemm.sh $THREADS\",\"git\":\"$(git rev-parse --short HEAD)\"}"
  "$KEEP" bench peak --threads "$THREADS" --json
  "$KEEP" bench matmul --format "$FORMATS" --shape "$SHAPE" --m "$(echo $MS | tr ' ' ',')" \
    --kernels exact,fast --threads "$THREADS" --seconds "$SECONDS_PER" --json
  "$KEEP" bench peak --threads "$THREADS" --json
  echo "{\"bench\":\"load\",\"when\":\"after\",\"loadavg\":\"$(cut -d' ' -f1-3 /proc/loadavg)\"}"
} | tee "$tmp"
mkdir -p "$(dirname "$OUT")"
mv "$tmp" "$OUT"
python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
peaks = [r for r in rows if r.get("bench") == "peak"]
f32 = max(p["f32_gflops"] for p in peaks)
i8 = max((p.get("int8_gops") or 0) for p in peaks) or None
print(f"peak: f32 {f32:.1f} GFLOP/s, int8 {i8 and round(i8, 1)} GOP/s (best of {len(peaks)})")
for r in rows:
    if r.get("bench") != "matmul":
        continue
    fast = r["kernels"] == "fast"
    if fast and r["format"] in ("mxfp4", "e8p", "affine8") and i8:
        ref, name = i8, "int8"
    elif fast and r["format"] in ("mxfp8", "bf16") and r.get("bf_level"):
        ref, name = 2 * f32, "bf16 (2x f32)"
    else:
        ref, name = f32, "f32"
    print(f'{r["format"]:8} {r["kernels"]:5} M={r["m"]:4} {r["gflops"]:7.1f} GFLOP/s = {r["gflops"]/ref:6.1%} of the {name} peak')
PY
