#!/usr/bin/env bash
# Precision tiers on the bundled model, at equal bytes of routed experts: the allocation
# (keep alloc) against a uniform rung (keep quant) and against REAP pruning to fit (keep select
# + keep eval --mask), then the per-token tiers (keep eval --tiers) over a τ sweep.
# Usage: dev/alloc-tiers.sh [WORKDIR]  (KEEP=path/to/keep to skip the build; a WORKDIR that
# already holds the calibration runs reuses them; ROWS, TAUS, CACHE narrow the sweep). Writes dev/evidence/alloc-tiers-bundled.json
# with every number, the commands and the load averages.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KEEP:-}" ]; then
  (cd "$ROOT" && cargo build --release -p keep-cli)
  KEEP="$ROOT/target/release/keep"
fi
W=${1:-/tmp/keep-alloc-tiers}
mkdir -p "$W"
[ -f "$W/run/reap-stats.safetensors" ] || { "$KEEP" calibrate --out "$W/run"; "$KEEP" finalize "$W/run"; }
[ -f "$W/teacher/run.json" ] || "$KEEP" calibrate --split eval --out "$W/teacher"
for f in e8p2 e8p2+e81; do
  [ -f "$W/q-$f/quant-report.json" ] || "$KEEP" quant --imatrix "$W/run" --format "$f" --out "$W/q-$f"
done
# bytes per expert at each rung (from the allocation file) and the experts of the model
"$KEEP" alloc "$W/run" --budget 1T --rungs e8p2,e8p2+e81,shipped --quant-report "$W/q-e8p2+e81" \
  --out "$W/probe.json" --force > /dev/null
read -r N E2 E3 SH LAYERS <<<"$(python3 - "$W/probe.json" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))
b = {r["label"]: r["bytes_per_expert"] for r in a["rungs"]}
n = sum(len(l["rungs"]) for l in a["layers"])
print(n, b["e8p2"], b["e8p2+e81"], b["shipped"], len(a["layers"]))
PY
)"
TAUS=${TAUS:-0.15,0.25,0.35,0.5,0.7}
CACHE=${CACHE:-2M}
echo "{\"load_start\": \"$(cat /proc/loadavg)\", \"rows\": [" > "$W/rows.json"
rm -f "$W/.row-written"
# (`row` runs at the end of a pipe, in a subshell: the separator state lives in a file.)
row() { if [ -e "$W/.row-written" ]; then echo "," >> "$W/rows.json"; fi; touch "$W/.row-written"; cat >> "$W/rows.json"; }
for uni in ${ROWS:-e8p2 e8p2+e81}; do
  B=$([ $uni = e8p2 ] && echo $((N * E2)) || echo $((N * E3)))
  KEEPN=$((B / LAYERS / SH))
  "$KEEP" eval --teacher "$W/teacher" --json "$W/q-$uni" > "$W/eval-uniform-$uni.json"
  "$KEEP" select "$W/run" --keep "$KEEPN" --out "$W/plan-$uni.json" --force --no-plot > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --mask "$W/plan-$uni.json" --json > "$W/eval-prune-$uni.json"
  "$KEEP" alloc "$W/run" --budget "$B" --quant-report "$W/q-e8p2+e81" --out "$W/alloc-$uni.json" --force > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --tiers "$W/alloc-$uni.json" --quant "$W/q-e8p2+e81" \
    --tau "$TAUS" --residual-cache "$CACHE" --plot "$W/tiers-$uni.svg" --force --json > "$W/eval-tiers-$uni.json"
  python3 - "$W" "$uni" "$B" "$KEEPN" <<'PY' | row
import json, sys
w, uni, b, keepn = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
u = json.load(open(f"{w}/eval-uniform-{uni}.json"))["students"][0]
p = [s for s in json.load(open(f"{w}/eval-prune-{uni}.json"))["students"] if s["plan"]][0]
t = json.load(open(f"{w}/eval-tiers-{uni}.json"))
a = json.load(open(f"{w}/alloc-{uni}.json"))
print(json.dumps({
  "budget_bytes": b, "equal_to": f"uniform {uni}",
  "uniform": {"rung": uni, "kl": u["mean_kl"], "top1": u["top1"]},
  "reap_prune_to_fit": {"experts_kept_per_layer": keepn, "kl": p["mean_kl"], "top1": p["top1"]},
  "alloc": {"bytes": a["bytes"], "mix": t["rung_mix"], "predicted_loss": a["predicted_loss"],
            "kl": t["students"][0]["mean_kl"], "top1": t["students"][0]["top1"]},
  "alloc_kl_over_uniform": t["students"][0]["mean_kl"] / u["mean_kl"],
  "alloc_kl_over_prune": t["students"][0]["mean_kl"] / p["mean_kl"],
  "tiers": [{"label": s["label"], "kl": s["mean_kl"], "top1": s["top1"], "mix": s["mix"]}
            for s in t["students"][1:]],
}))
PY
done
echo "], \"load_end\": \"$(cat /proc/loadavg)\", \"taus\": \"$TAUS\", \"residual_cache\": \"$CACHE\"," >> "$W/rows.json"
echo "\"command\": \"dev/alloc-tiers.sh $W\"}" >> "$W/rows.json"
mkdir -p "$ROOT/dev/evidence"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['format']='keep-alloc-tiers-evidence'; d['version']=1; json.dump(d, open(sys.argv[2],'w'), indent=1)" \
  "$W/rows.json" "$ROOT/dev/evidence/alloc-tiers-bundled.json"
python3 - "$ROOT/dev/evidence/alloc-tiers-bundled.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{'budget':>10} {'uniform':>16} {'prune-to-fit':>16} {'alloc':>10} {'a/u':>6} {'a/p':>6}  mix")
for r in d["rows"]:
    print(f"{r['budget_bytes']:>10} {r['uniform']['rung']:>8} {r['uniform']['kl']:.5f} "
          f"{r['reap_prune_to_fit']['experts_kept_per_layer']:>6}/L {r['reap_prune_to_fit']['kl']:.5f} "
          f"{r['alloc']['kl']:.5f} {r['alloc_kl_over_uniform']:.2f} {r['alloc_kl_over_prune']:.2f}  {r['alloc']['mix']}")
    for t in r["tiers"]:
        m = t["mix"]
        print(f"    {t['label']:<12} KL {t['kl']:.5f}  upper {m['slots_upper']}/{m['slots_upper']+m['slots_base']}"
              f"  hits {m['hits']} misses {m['misses']} admits {m['admissions']}  {m['bytes_read_per_token']:.0f} B/token")
PY
