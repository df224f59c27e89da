#!/usr/bin/env bash
# Speculative decoding with the MTP module, end to end: `keep run --draft none` against
# `--draft mtp --draft-tokens K` (K = 1, 2, 3) on one model, greedy, the same synthetic prompt,
# resident (no budget). Prints decode tokens/s, the speedup over no drafting, tokens per verify
# forward and the acceptance by draft position, with the load average; writes the evidence
# JSON. Greedy outputs are compared (they must be identical).
#
# Usage: dev/bench-draft.sh [MODEL_DIR] [MAX_TOKENS] [OUT_JSON]
#   MODEL_DIR defaults to a `keep synth --preset tiny-v4flash` checkpoint (random weights, so
#   acceptance is near zero: this measures the cost of drafting; a trained MTP module is
#   needed for a speedup).
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-target/release/keep}
MAX=${2:-64}
OUT=${3:-dev/evidence/draft-speed.json}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$TMP/model
  "$KEEP" synth --preset tiny-v4flash --out "$MODEL" --seed 1 >/dev/null
fi
run() {  # name, extra flags...
  local name=$1; shift
  "$KEEP" run "$MODEL" --prompt-tokens 32 --max-tokens "$MAX" --temperature 0 \
    --stats-json "$TMP/$name.json" --force "$@" >"$TMP/$name.out" 2>/dev/null
}
run none --draft none
for k in 1 2 3; do run "mtp$k" --draft mtp --draft-tokens "$k"; done
LOAD=$(cat /proc/loadavg)
python3 - "$TMP" "$OUT" "$MODEL" "$LOAD" <<'PY'
import json, sys, pathlib
tmp, out, model, load = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
base = json.loads((tmp / "none.json").read_text())
ref = (tmp / "none.out").read_text()
rows = [{"draft": "none", "decode_tps": base["decode_tps"], "speedup": 1.0}]
print(f"load {load}")
print(f"none : {base['decode_tps']:8.2f} tok/s")
for k in (1, 2, 3):
    s = json.loads((tmp / f"mtp{k}.json").read_text())
    d = s.get("draft") or {}
    same = (tmp / f"mtp{k}.out").read_text() == ref
    sp = s["decode_tps"] / base["decode_tps"] if base["decode_tps"] else 0.0
    rows.append({"draft": f"mtp K={k}", "decode_tps": s["decode_tps"], "speedup": sp,
                 "tokens_per_forward": d.get("tokens_per_forward"),
                 "acceptance": d.get("acceptance"), "greedy_identical": same})
    print(f"mtp K={k}: {s['decode_tps']:8.2f} tok/s  x{sp:.2f}  "
          f"{d.get('tokens_per_forward', 0):.2f} tokens/forward  acceptance {d.get('acceptance')}  "
          f"identical={same}")
    if not same:
        sys.exit(f"greedy output with --draft mtp --draft-tokens {k} differs from --draft none")
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps({"model": model, "loadavg": load, "rows": rows,
                                         "command": "dev/bench-draft.sh " + " ".join(sys.argv[1:2])},
                                        indent=1) + "\n")
print(f"wrote {out}")
PY
