#!/usr/bin/env bash
# keep's E8P2 against llama.cpp's IQ2_XXS and IQ2_XS on the same routed expert tensors with
# the same imatrix: the imatrix-weighted relative reconstruction error
# Σ_j h_j (w_rj − ŵ_rj)² / Σ_j h_j w_rj² per tensor, at each format's stored bits per weight.
# keep's E8P2+E81 (3 bits) is listed for reference.
# Usage: dev/quant-vs-iq2.sh MODEL IMATRIX OUT.json [N_EXPERTS]
#   MODEL's expert widths must be multiples of 256 (IQ2's super-block), e.g. the flash preset
#   (dev/quant-fit-speed.sh leaves one with its imatrix under its work dir when KEEP_MODEL=1;
#   dev/iq2/flash-1layer-config.json is one layer of it, vocabulary 4096, for
#   `keep synth --config` and a short `keep calibrate` + `keep finalize` on the bundled tokenizer).
#   Needs llama.cpp's ggml built as static libraries (LLAMA_SIDE_DIR, default
#   /tmp/keep-llama-cpp, as dev/llama-cpp-side-by-side.sh builds it), gcc, and a Python with
#   numpy (PY, default tools/oracle/.venv/bin/python).
# llama.cpp is given the same imatrix row (its quant_weights); its own rounding uses it as
# it does in llama-quantize. keep's side is examples/dump_experts (keep quant's fit).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=$1; IMATRIX=$2; OUT=$3; N=${4:-2}
PY=${PY:-$ROOT/tools/oracle/.venv/bin/python}
L=${LLAMA_SIDE_DIR:-/tmp/keep-llama-cpp}
GG=$(ls -d "$L"/llama_cpp_python-*/vendor/llama.cpp/ggml | head -1)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
gcc -O2 -I"$GG/include" "$ROOT/dev/iq2/iq2_harness.c" -o "$W/iq2_harness" \
  "$L/full/build/ggml/src/libggml-cpu.a" "$L/full/build/ggml/src/libggml-base.a" \
  -lstdc++ -lm -lpthread -fopenmp
(cd "$ROOT" && cargo run --release -q -p keep-quant --example dump_experts -- "$MODEL" "$IMATRIX" "$W/t" "$N")
while read -r line; do
  name=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["name"])' "$line")
  rc=$("$PY" -c 'import json,sys; d=json.loads(sys.argv[1]); print(d["rows"], d["cols"])' "$line")
  "$W/iq2_harness" $rc "$W/t/$name.w.f32" "$W/t/$name.h.f32" "$W/t/$name" > "$W/t/$name.bits"
done < "$W/t/tensors.jsonl"
"$PY" - "$W/t" "$OUT" "$MODEL" "$IMATRIX" <<'PYEOF'
import json, sys
import numpy as np
d, out, model, imatrix = sys.argv[1:5]
rows = []
for line in open(f"{d}/tensors.jsonl"):
    t = json.loads(line)
    n, r, c = t["name"], t["rows"], t["cols"]
    w = np.fromfile(f"{d}/{n}.w.f32", np.float32).reshape(r, c).astype(np.float64)
    h = np.fromfile(f"{d}/{n}.h.f32", np.float32).astype(np.float64)
    den = float((h * w * w).sum())
    bits = dict(l.split() for l in open(f"{d}/{n}.bits"))
    row = {"tensor": n, "rows": r, "cols": c}
    for fmt, b in (("e8p2", t["e8p2_bits_per_weight"]), ("e8p2+e81", t["e8p2+e81_bits_per_weight"]),
                   ("iq2_xxs", float(bits["iq2_xxs"])), ("iq2_xs", float(bits["iq2_xs"]))):
        q = np.fromfile(f"{d}/{n}.{fmt}.f32", np.float32).reshape(r, c).astype(np.float64)
        row[fmt] = {"bits_per_weight": b, "rel_weighted_error": float((h * (w - q) ** 2).sum()) / den}
    # the goal: E8P2's weighted error at most IQ2_XXS's, at no more bits
    row["e8p2_beats_iq2_xxs"] = (row["e8p2"]["rel_weighted_error"] <= row["iq2_xxs"]["rel_weighted_error"]
                                 and row["e8p2"]["bits_per_weight"] <= row["iq2_xxs"]["bits_per_weight"])
    rows.append(row)
fmts = ("e8p2", "e8p2+e81", "iq2_xxs", "iq2_xs")
mean = {f: float(np.mean([r[f]["rel_weighted_error"] for r in rows])) for f in fmts}
bits = {f: float(np.mean([r[f]["bits_per_weight"] for r in rows])) for f in fmts}
res = {"format": "keep-evidence", "version": 1,
       "what": "imatrix-weighted relative reconstruction error per tensor: keep E8P2 (and E8P2+E81 for reference) vs llama.cpp IQ2_XXS / IQ2_XS (ggml_quantize_chunk with the same imatrix), same expert tensors",
       "model": model, "imatrix": imatrix, "rerun": "dev/quant-vs-iq2.sh MODEL IMATRIX OUT.json [N_EXPERTS]",
       "mean_rel_weighted_error": mean, "mean_bits_per_weight": bits,
       "tensors_where_e8p2_beats_iq2_xxs": sum(r["e8p2_beats_iq2_xxs"] for r in rows),
       "tensors": rows}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({"mean_rel_weighted_error": mean, "mean_bits_per_weight": bits, "e8p2_beats_iq2_xxs": f'{res["tensors_where_e8p2_beats_iq2_xxs"]}/{len(rows)}'}))
PYEOF
