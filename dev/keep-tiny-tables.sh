#!/usr/bin/env bash
# The calibration, pruning-cost and residency tables of docs/results.md on the bundled model and its bundled pack, in one go:
# calibrate (imatrix, REAP, routes), finalize, select (reap | frequency | ean_mean × 75 | 50 | 25%,
# plus the Jaccard table and plot), the teacher on the eval split, one eval of all nine students
# (KL table and plot), and the residency table and plot. Writes everything under OUT.
#
# Every report is written as JSON (the evidence docs/results.md renders its tables from).
#
# Usage: dev/keep-tiny-tables.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "${1:?usage: dev/keep-tiny-tables.sh OUT}")"
mkdir -p "$OUT/plans"
cargo build --release -q -p keep-cli
K="$(pwd)/target/release/keep"
P="$(pwd)/models/keep-tiny-pack"
printf '{"cores": %s, "loadavg_before": "%s", "cpu": "%s", "commit": "%s"}\n' "$(nproc)" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" "$(lscpu | sed -n 's/^Model name: *//p')" "$(git rev-parse HEAD)" \
  > "$OUT/machine.json"
$K calibrate --pack "$P" --out "$OUT/run-cal" --json > "$OUT/calibrate.json"
$K finalize "$OUT/run-cal"
for sal in reap frequency ean_mean; do
  for k in 75 50 25; do
    $K select "$OUT/run-cal" --keep "$k%" --saliency "$sal" --out "$OUT/plans/$sal-$k.json" --no-plot \
      --json > "$OUT/select-$sal-$k.json"
  done
done
$K select "$OUT/run-cal" --keep 50% --saliency reap --out "$OUT/plans/jaccard-50.json" \
  --json > "$OUT/select-jaccard.json"   # and plans/jaccard-50.json.jaccard.{svg,png}
$K calibrate --pack "$P" --split eval --out "$OUT/run-eval" --json > "$OUT/calibrate-eval.json"
masks=()
for sal in reap frequency ean_mean; do for k in 75 50 25; do masks+=(--mask "$OUT/plans/$sal-$k.json"); done; done
$K eval --teacher "$OUT/run-eval" --pack "$P" "${masks[@]}" --plot "$OUT/kl.svg" --json > "$OUT/eval.json"
$K residency "$OUT/run-cal" --hot 4,8,16,24 --model models/keep-tiny --plot "$OUT/residency.svg" --json > "$OUT/residency.json"
printf '{"loadavg_after": "%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT/machine-after.json"
echo "done: $OUT"
