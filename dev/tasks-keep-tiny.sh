#!/usr/bin/env bash
# `keep eval --tasks` on the bundled model (the teacher), its REAP-pruned half and its E8P2
# quantization, with the same seeds for every model, for each committed spec:
#   tasks/python-basics.json     the spec's own checks (parses, compiles, runs);
#   tasks/python-parses.json     the same prompts, each checked only for parsing;
#   tasks/heldout-functions.json bodies of real functions the model never trained on.
#
# Usage: dev/tasks-keep-tiny.sh WORKDIR [NAME]
#   MODEL=models/keep-tiny (the teacher), KEEP=target/release/keep, STUDENTS=1 (0: the teacher
#   alone). Writes dev/evidence/tasks-SPEC-NAME.json for each spec (NAME default keep-tiny; a
#   file that exists is refused unless FORCE=1) and, with students, the plot PLOT (default
#   docs/tasks-keep-tiny.svg) of python-basics; leaves the calibration run, the plan and both
#   students in WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
W="$(realpath -m "${1:?usage: dev/tasks-keep-tiny.sh WORKDIR [NAME]}")"
NAME="${2:-keep-tiny}"
K="${KEEP:-$(pwd)/target/release/keep}"
M="$(realpath "${MODEL:-models/keep-tiny}")"
P="$(pwd)/models/keep-tiny-pack"
mkdir -p "$W"
for spec in python-basics python-parses heldout-functions; do
  out="dev/evidence/tasks-$spec-$NAME.json"
  if [[ -e "$out" && "${FORCE:-0}" != 1 ]]; then
    echo "refusing to replace $out (FORCE=1 to replace)" >&2; exit 1
  fi
done
students=()
if [[ "${STUDENTS:-1}" == 1 ]]; then
  [ -f "$W/run/imatrix.safetensors" ] || { $K calibrate "$M" --pack "$P" --out "$W/run" >/dev/null; $K finalize "$W/run" >/dev/null; }
  [ -f "$W/plan-reap-50.json" ] || $K select "$W/run" --keep 50% --saliency reap --out "$W/plan-reap-50.json" --no-plot >/dev/null
  [ -d "$W/pruned-50" ] || $K prune --plan "$W/plan-reap-50.json" "$M" "$W/pruned-50" >/dev/null
  [ -d "$W/e8p2" ] || $K quant "$M" --imatrix "$W/run" --format e8p2 --out "$W/e8p2" >/dev/null
  students=(--student "$W/pruned-50" --student "$W/e8p2")
fi
for spec in python-basics python-parses heldout-functions; do
  out="dev/evidence/tasks-$spec-$NAME.json"
  plot=()
  if [[ $spec == python-basics && ${#students[@]} -gt 0 ]]; then plot=(--plot "${PLOT:-docs/tasks-keep-tiny.svg}" --force); fi
  $K eval "$M" --tasks "tasks/$spec.json" --kernels fast "${students[@]}" "${plot[@]}" --json > "$out.tmp"
  mv "$out.tmp" "$out"
  echo "wrote $out"
done
