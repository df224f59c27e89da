#!/usr/bin/env bash
# The calibration, pruning-cost and residency tables of docs/results.md on the bundled model and its bundled pack, in one go:
# calibrate (imatrix, REAP, routes), finalize, select (reap | frequency | ean_mean × 75 | 50 | 25%,
# plus the Jaccard table and plot), the teacher on the eval split, one eval of all nine students
# (KL table and plot), and the residency table and plot. Writes everything under OUT.
#
# Usage: dev/keep-tiny-tables.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:?usage: dev/keep-tiny-tables.sh OUT}")"
mkdir -p "$OUT/plans"
cargo build --release -q -p keep-cli
K="$(pwd)/target/release/keep"
P="$(pwd)/models/keep-tiny-pack"
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/machine.txt"
$K calibrate --pack "$P" --out "$OUT/run-cal" --json > "$OUT/calibrate.json"
$K finalize "$OUT/run-cal"
for sal in reap frequency ean_mean; do
  for k in 75 50 25; do
    $K select "$OUT/run-cal" --keep "$k%" --saliency "$sal" --out "$OUT/plans/$sal-$k.json" --no-plot \
      > "$OUT/select-$sal-$k.txt"
  done
done
$K select "$OUT/run-cal" --keep 50% --saliency reap --out "$OUT/plans/jaccard-50.json" \
  > "$OUT/select-jaccard.txt"   # and plans/jaccard-50.json.jaccard.{svg,png}
$K calibrate --pack "$P" --split eval --out "$OUT/run-eval" --json > "$OUT/calibrate-eval.json"
masks=()
for sal in reap frequency ean_mean; do for k in 75 50 25; do masks+=(--mask "$OUT/plans/$sal-$k.json"); done; done
$K eval --teacher "$OUT/run-eval" --pack "$P" "${masks[@]}" --plot "$OUT/kl.svg" > "$OUT/eval.txt"
$K residency "$OUT/run-cal" --hot 4,8,16,24 --model models/keep-tiny --plot "$OUT/residency.svg" > "$OUT/residency.txt"
echo "done: $OUT"
