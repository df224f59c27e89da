#!/usr/bin/env bash
# Incoherence processing on the bundled model: quantize the routed experts to E8P2 and E8P2+E81
# with `keep quant --incoherence off|on|out` (off: the plain imatrix-weighted fit; on: random-sign
# Hadamard transforms on both sides, QuIP#'s; out: the output side only) and score each with
# keep eval against the teacher's held-out split (KL with the tail bucket, ΔNLL, top-1), beside
# the imatrix-weighted relative reconstruction error of the un-rotated decode from the quant report.
# Usage: dev/quant-incoherence.sh [WORKDIR] [EVIDENCE.json]
#   RUN=DIR   a finalized calibration run (imatrix.safetensors); default: made in WORKDIR
#   TEACHER=DIR  `keep calibrate --split eval` output; default: made in WORKDIR
#   FORMATS="e8p2 e8p2+e81"  MODES="off on out"  SEED=N (default: keep quant's)
#   REUSE=1   keep a (format, mode) whose eval JSON is already in WORKDIR (resume)
# Needs target/release/keep (cargo build --release -p keep-cli). Quality does not depend on
# the machine's load; the fit times in the evidence do (the load average is recorded beside each).
set -euo pipefail
KEEP=${KEEP:-$(dirname "$0")/../target/release/keep}
W=${1:-/tmp/keep-quant-incoherence}
EVIDENCE=${2:-$W/quant-incoherence-keep-tiny.json}
mkdir -p "$W"
RUN=${RUN:-$W/run}
TEACHER=${TEACHER:-$W/eval}
[ -f "$RUN/imatrix.safetensors" ] || { "$KEEP" calibrate --out "$RUN"; "$KEEP" finalize "$RUN"; }
[ -f "$TEACHER/run.json" ] || "$KEEP" calibrate --split eval --out "$TEACHER"
SEEDARG=()
[ -n "${SEED:-}" ] && SEEDARG=(--incoherence-seed "$SEED")
ROWS=()
for f in ${FORMATS:-e8p2 e8p2+e81}; do
  for m in ${MODES:-off on out}; do
    tag="$f-$m"
    ROWS+=("$f" "$m")
    if [ -n "${REUSE:-}" ] && [ -s "$W/eval-$tag.json" ]; then continue; fi
    cat /proc/loadavg > "$W/load-$tag.txt"
    "$KEEP" quant --imatrix "$RUN" --format "$f" --incoherence "$m" "${SEEDARG[@]}" --force --json \
      --out "$W/tiny-$tag" > "$W/quant-$tag.json"
    "$KEEP" eval --teacher "$TEACHER" --json "$W/tiny-$tag" > "$W/eval-$tag.json.tmp"
    mv "$W/eval-$tag.json.tmp" "$W/eval-$tag.json"
    rm -rf "$W/tiny-$tag"
  done
done
python3 - "$W" "$EVIDENCE" "$RUN" "$TEACHER" "${ROWS[@]}" <<'PY'
import json, sys
w, evidence, run, teacher, rest = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
rows = []
for f, m in zip(rest[::2], rest[1::2]):
    tag = f"{f}-{m}"
    q = json.load(open(f"{w}/quant-{tag}.json"))
    s = json.load(open(f"{w}/eval-{tag}.json"))["students"][0]
    err, wt = {}, 0.0
    for t in q["tensors"]:
        wt += t["weight"]
        for k, v in t["error"].items():
            err[k] = err.get(k, 0.0) + v
    per_expert = {}
    for e in q["experts"]:
        for k, v in e["rel_error"].items():
            per_expert.setdefault(k, []).append(v)
    rows.append({
        "format": f, "incoherence": m,
        "bits_per_weight_routed_experts": q["bits_per_weight"],
        "incoherent_tensors": q.get("incoherent_tensors", 0),
        "mean_kl": s["mean_kl"], "mean_dnll": s["mean_dnll"], "top1": s["top1"],
        "rel_weighted_error_total": {k: v / wt for k, v in err.items()},
        "mean_rel_weighted_error_per_expert": {k: sum(v) / len(v) for k, v in per_expert.items()},
        "fit_seconds": q["fit_seconds"],
        "loadavg_before": open(f"{w}/load-{tag}.txt").read().strip(),
    })
    print(f"{f:10s} incoherence {m:3s}  bits {q['bits_per_weight']:.3f}  KL {s['mean_kl']:.5f}  "
          f"dNLL {s['mean_dnll']:.5f}  top1 {s['top1']:.4f}  rel.err "
          + " ".join(f"{k} {v / wt:.4f}" for k, v in sorted(err.items())))
json.dump({
    "format": "keep-evidence", "version": 1,
    "what": "incoherence processing (seeded random-sign Hadamard transforms; on = both sides as QuIP#, out = output side only) against the plain imatrix-weighted fit, E8P2 and E8P2+E81 on the bundled model's routed experts, scored by keep eval against the teacher's held-out split; relative errors are imatrix-weighted, of the un-rotated decode against the source weights",
    "commands": ["keep quant --imatrix RUN --format F --incoherence M --json --out OUT",
                 "keep eval --teacher TEACHER --json OUT"],
    "run": run, "teacher": teacher,
    "rerun": "dev/quant-incoherence.sh [WORKDIR] [EVIDENCE.json]  (RUN=, TEACHER=, FORMATS=, MODES=, SEED=)",
    "rows": rows,
}, open(evidence, "w"), indent=1)
PY
