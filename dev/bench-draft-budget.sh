#!/usr/bin/env bash
# Speculative decoding under a memory budget, measured and predicted: `keep run
# --memory-budget B` with --draft none (its routes recorded), --draft mtp and --draft auto
# (K drafts, greedy, the same synthetic prompt), then `keep residency` replays the recorded
# trace with and without drafting (LRU slots of the run's size, cold, the mtp run's measured
# acceptance) and predicts the speedup. Prints decode tokens/s, measured and predicted
# speedups, acceptance, experts per layer per verify forward and how often --draft auto
# switched, with the load average; writes the evidence JSON. Greedy outputs must be identical.
#
# Usage: dev/bench-draft-budget.sh [MODEL_DIR] [BUDGET] [MAX_TOKENS] [K] [OUT_JSON]
#   MODEL_DIR defaults to a synthetic V4-Flash with an MTP module: `tiny-v4flash` shapes with
#   64 routed experts of moe_intermediate_size 2048 per layer and no hash-routed layers (about
#   250 MB, written to a temporary directory); BUDGET defaults to 128MiB (about half of the
#   experts in slots). Random weights: the MTP module's drafts are almost never accepted, so
#   this is the case where drafting loses (the one --draft auto must catch).
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-target/release/keep}
BUDGET=${2:-128MiB}
MAX=${3:-96}
K=${4:-2}
OUT=${5:-dev/evidence/draft-budget.json}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$TMP/model
  "$KEEP" synth --preset tiny-v4flash --out "$TMP/base" --seed 1 >/dev/null
  python3 - "$TMP/base/config.json" "$TMP/cfg.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(n_routed_experts=64, moe_intermediate_size=2048, num_hash_layers=0)
json.dump(c, open(sys.argv[2], "w"))
PY
  rm -rf "$TMP/base"
  "$KEEP" synth --config "$TMP/cfg.json" --out "$MODEL" --seed 1 >/dev/null
fi
run() {  # name, extra flags...
  local name=$1; shift
  "$KEEP" run "$MODEL" --prompt-tokens 32 --max-tokens "$MAX" --temperature 0 \
    --memory-budget "$BUDGET" --policy lru \
    --stats-json "$TMP/$name.json" --force "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
}
LOAD0=$(cat /proc/loadavg)
run none --draft none --record-routes "$TMP/routes.safetensors"
run mtp --draft mtp --draft-tokens "$K"
run auto --draft auto --draft-tokens "$K"
run none2 --draft none
LOAD1=$(cat /proc/loadavg)
ACC=$(python3 -c "import json,sys; print(','.join(f'{a:.4f}' for a in json.load(open(sys.argv[1]))['draft']['acceptance']))" "$TMP/mtp.json")
SLOTS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['plan']['slots_per_layer'])" "$TMP/mtp.json")
"$KEEP" residency "$TMP/routes.safetensors" --model "$MODEL" --hot "$SLOTS" --policy lru \
  --warm-start none --draft-acceptance "$ACC" --json >"$TMP/residency.json"
python3 - "$TMP" "$OUT" "$MODEL" "$LOAD0" "$LOAD1" "$BUDGET" "$K" <<'PY'
import json, sys, pathlib
tmp, out, model, load0, load1, budget, k = sys.argv[1:8]
tmp = pathlib.Path(tmp)
st = {n: json.loads((tmp / f"{n}.json").read_text()) for n in ("none", "mtp", "auto", "none2")}
outs = {n: (tmp / f"{n}.out").read_text() for n in st}
for n in ("mtp", "auto", "none2"):
    if outs[n] != outs["none"]:
        sys.exit(f"greedy output of {n} differs from --draft none")
base = (st["none"]["decode_tps"] + st["none2"]["decode_tps"]) / 2
res = json.loads((tmp / "residency.json").read_text())
pred = res["drafting"]["sizes"][0]
rows = []
print(f"load {load0} -> {load1}; budget {budget}, K = {k}, slots/layer {st['mtp']['plan']['slots_per_layer']} of {st['mtp']['plan']['n_experts']}")
for n in ("none", "none2", "mtp", "auto"):
    s = st[n]; d = s.get("draft") or {}
    row = {"run": n, "decode_tps": s["decode_tps"], "speedup_vs_none": s["decode_tps"] / base,
           "decode_cache": s.get("decode_cache"), "draft": d}
    rows.append(row)
    print(f"{n:6}: {s['decode_tps']:8.2f} tok/s  x{row['speedup_vs_none']:.3f}  "
          f"tokens/forward {d.get('tokens_per_forward', 0):.2f}  acceptance {d.get('acceptance')}  "
          f"experts/layer/forward {d.get('window_experts', 0):.2f}  "
          f"auto offs {d.get('auto_offs', 0)} ons {d.get('auto_ons', 0)} stopped {d.get('auto_stopped', False)} "
          f"plain tokens {d.get('plain_tokens', 0)}")
measured = st["mtp"]["decode_tps"] / base
print(f"predicted (keep residency, reads only): none {pred['plain']['tokens_per_sec']:.2f} tok/s, "
      f"drafting {pred['drafting']['tokens_per_sec']:.2f} tok/s, speedup {pred['speedup']:.3f}; "
      f"measured speedup {measured:.3f}; experts/layer/forward predicted {pred['drafting']['experts_per_layer_forward']:.2f}")
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps({
    "command": "dev/bench-draft-budget.sh", "model": model, "budget": budget, "k": int(k),
    "loadavg_before": load0, "loadavg_after": load1, "rows": rows,
    "predicted": pred, "measured_speedup": measured,
    "auto_vs_none": st["auto"]["decode_tps"] / base}, indent=1) + "\n")
print(f"wrote {out}")
PY
