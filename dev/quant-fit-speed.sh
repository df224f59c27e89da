#!/usr/bin/env bash
# Fitting speed of keep quant on the flash preset's routed experts (real V4.1-Flash expert
# shapes: w1/w3 [2304, 5120], w2 [5120, 2304], FP4 with a scale per 32 inputs).
# Usage: dev/quant-fit-speed.sh [WORKDIR] [EXPERTS_BYTES]   (default /tmp/keep-quant-speed, 160MiB;
# FORMATS="e8p2 e8p2+e81 e8p2+e8p2" by default; MODEL=DIR uses that checkpoint instead of a
# synthetic one; KEEP_SIMD=scalar|avx2 caps the search's instruction set)
# Needs target/release/keep (cargo build --release -p keep-cli) and a Python with numpy and
# safetensors (PY, default tools/oracle/.venv/bin/python). The imatrix is synthetic (log-normal
# per-column second moments, sigma 1.2, seeded): a calibration pass at these shapes would take
# longer than the fit, and the search's work depends on the imatrix only through its spread.
# Writes WORKDIR/quant-fit-speed.json (MB of FP4 source per second, wall and per CPU second,
# with the load average before and after each format) and removes the large checkpoints.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KEEP=${KEEP:-$ROOT/target/release/keep}
PY=${PY:-$ROOT/tools/oracle/.venv/bin/python}
W=${1:-/tmp/keep-quant-speed}
BYTES=${2:-160MiB}
mkdir -p "$W"
# MODEL=DIR fits an existing flash-shaped checkpoint instead (linked as WORKDIR/flash, kept)
if [ -n "${MODEL:-}" ]; then ln -sfn "$(cd "$MODEL" && pwd)" "$W/flash"; KEEP_MODEL=1; fi
[ -f "$W/flash/config.json" ] || "$KEEP" synth --preset flash --experts-bytes "$BYTES" --out "$W/flash"
"$PY" - "$W/flash" "$W/imatrix.safetensors" <<'PYEOF'
import json, sys
import numpy as np
from safetensors.numpy import save_file
cfg = json.load(open(f"{sys.argv[1]}/config.json"))
hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
rng = np.random.default_rng(18)
t = {}
for l in range(cfg["num_hidden_layers"]):
    for e in range(cfg["n_routed_experts"]):
        for part, cols in (("w1", hidden), ("w2", inter), ("w3", hidden)):
            t[f"imatrix.{l}.ffn.experts.{e}.{part}"] = np.exp(rng.normal(0, 1.2, cols)).astype(np.float32)
save_file(t, sys.argv[2], metadata={"format": "keep-imatrix", "version": "1"})
PYEOF
rows=()
for f in ${FORMATS:-e8p2 e8p2+e81 e8p2+e8p2}; do
  l0=$(cat /proc/loadavg)
  /usr/bin/time -f "%e %U %S" -o "$W/time-$f.txt" "$KEEP" quant "$W/flash" --imatrix "$W/imatrix.safetensors" --format "$f" --force --json --out "$W/q-$f" > "$W/report-$f.json" 2> "$W/quant-$f.log"
  l1=$(cat /proc/loadavg)
  rm -rf "$W/q-$f"
  rows+=("$f|$l0|$l1")
done
"$PY" - "$W" "${rows[@]}" <<'PYEOF'
import json, os, sys
w = sys.argv[1]
out = {"format": "keep-evidence", "version": 1,
       "what": "keep quant fitting speed on the flash preset's routed experts (real V4.1-Flash expert shapes, FP4 source), synthetic log-normal imatrix",
       "machine": f"{os.cpu_count()} cores", "rerun": "dev/quant-fit-speed.sh", "rows": []}
for r in sys.argv[2:]:
    f, l0, l1 = r.split("|")
    rep = json.load(open(f"{w}/report-{f}.json"))
    wall, user, sys_ = map(float, open(f"{w}/time-{f}.txt").read().split()[-3:])
    mb = rep["source_bytes_fitted"] / 1e6
    out["rows"].append({"format": f, "tensors": rep["tensors_quantized"], "source_MB": mb,
        "fit_seconds": rep["fit_seconds"], "MB_per_s_fit_wall": mb / rep["fit_seconds"],
        "process_wall_s": wall, "process_cpu_s": user + sys_, "keep_simd": os.environ.get("KEEP_SIMD", "detected"),
        "MB_per_cpu_s_whole_process": mb / (user + sys_),
        "loadavg_before": l0, "loadavg_after": l1})
json.dump(out, open(f"{w}/quant-fit-speed.json", "w"), indent=1)
for r in out["rows"]:
    print(f'{r["format"]:10} {r["source_MB"]:.0f} MB: {r["MB_per_s_fit_wall"]:.2f} MB/s fit wall, {r["MB_per_cpu_s_whole_process"]:.2f} MB per CPU s (load {r["loadavg_before"][:14]})')
PYEOF
# the synthetic model is a few GB: removed unless KEEP_MODEL=1 (dev/quant-vs-iq2.sh can use it)
[ "${KEEP_MODEL:-0}" = 1 ] || rm -rf "$W/flash"
