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
Q3="$W/q-e8p2+e81"
# one measured point: an allocation (keep alloc --rungs R --budget B) and its KL (keep eval --alloc)
point() { # NAME RUNGS BUDGET
  [ -f "$W/pt-$1.eval.json" ] && [ "$W/pt-$1.eval.json" -nt "$W/pt-$1.json" ] && return
  "$KEEP" alloc "$W/run" --budget "$3" --rungs "$2" --quant-report "$Q3" --out "$W/pt-$1.json" --force > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --alloc "$W/pt-$1.json" --quant "$Q3" --json > "$W/pt-$1.eval.json"
}
kl() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['students'][0]['mean_kl'])" "$W/pt-$1.eval.json"; }
B2=$((N * E2)); B3=$((N * E3))
point u-e8p2 e8p2 1T
point u-e8p2+e81 e8p2+e81 1T
point prune-b2 pruned,shipped $B2
point prune-b3 pruned,shipped $B3
point mix-prune-e8p2 pruned,e8p2 $((B2 * 9 / 10))
point plain-b2 pruned,e8p2,e8p2+e81,e8p2+e8p2,shipped $B2
point plain-b3 pruned,e8p2,e8p2+e81,e8p2+e8p2,shipped $B3
"$KEEP" alloc-fit "$W/run" --quant-report "$Q3" \
  --point "$W/pt-u-e8p2.json=$(kl u-e8p2)" --point "$W/pt-u-e8p2+e81.json=$(kl u-e8p2+e81)" \
  --point "$W/pt-prune-b2.json=$(kl prune-b2)" --point "$W/pt-prune-b3.json=$(kl prune-b3)" \
  --check "$W/pt-mix-prune-e8p2.json=$(kl mix-prune-e8p2)" --check "$W/pt-plain-b2.json=$(kl plain-b2)" \
  --check "$W/pt-plain-b3.json=$(kl plain-b3)" --out "$W/loss.json" --force | tee "$W/loss.txt"
echo "{\"load_start\": \"$(cat /proc/loadavg)\", \"rows\": [" > "$W/rows.json"
rm -f "$W/.row-written"
# (`row` runs at the end of a pipe, in a subshell: the separator state lives in a file.)
row() { if [ -e "$W/.row-written" ]; then echo "," >> "$W/rows.json"; fi; touch "$W/.row-written"; cat >> "$W/rows.json"; }
for uni in ${ROWS:-e8p2 e8p2+e81}; do
  B=$([ $uni = e8p2 ] && echo $B2 || echo $B3)
  KEEPN=$((B / LAYERS / SH))
  "$KEEP" eval --teacher "$W/teacher" --json "$W/q-$uni" > "$W/eval-uniform-$uni.json"
  "$KEEP" select "$W/run" --keep "$KEEPN" --out "$W/plan-$uni.json" --force --no-plot > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --mask "$W/plan-$uni.json" --json > "$W/eval-prune-$uni.json"
  "$KEEP" alloc "$W/run" --budget "$B" --quant-report "$Q3" --out "$W/alloc-plain-$uni.json" --force > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --alloc "$W/alloc-plain-$uni.json" --quant "$Q3" --json > "$W/eval-alloc-plain-$uni.json"
  "$KEEP" alloc "$W/run" --budget "$B" --quant-report "$Q3" --loss-model "$W/loss.json" --out "$W/alloc-$uni.json" --force > /dev/null
  "$KEEP" eval --teacher "$W/teacher" --tiers "$W/alloc-$uni.json" --quant "$Q3" \
    --tau "$TAUS" --residual-cache "$CACHE" --plot "$W/tiers-$uni.svg" --force --json > "$W/eval-tiers-$uni.json"
  python3 - "$W" "$uni" "$B" "$KEEPN" <<'PY' | row
import json, sys
w, uni, b, keepn = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
u = json.load(open(f"{w}/eval-uniform-{uni}.json"))["students"][0]
p = [s for s in json.load(open(f"{w}/eval-prune-{uni}.json"))["students"] if s["plan"]][0]
t = json.load(open(f"{w}/eval-tiers-{uni}.json"))
a = json.load(open(f"{w}/alloc-{uni}.json"))
ap = json.load(open(f"{w}/alloc-plain-{uni}.json"))
ep = json.load(open(f"{w}/eval-alloc-plain-{uni}.json"))["students"][0]
mix = lambda al: {r: sum(x == r for l in al["layers"] for x in l["rungs"]) for r in sorted({x for l in al["layers"] for x in l["rungs"]})}
print(json.dumps({
  "budget_bytes": b, "equal_to": f"uniform {uni}",
  "uniform": {"rung": uni, "kl": u["mean_kl"], "top1": u["top1"]},
  "reap_prune_to_fit": {"experts_kept_per_layer": keepn, "kl": p["mean_kl"], "top1": p["top1"]},
  "alloc_plain_loss": {"bytes": ap["bytes"], "mix": mix(ap), "predicted_loss": ap["predicted_loss"],
                       "kl": ep["mean_kl"], "top1": ep["top1"]},
  "alloc": {"bytes": a["bytes"], "mix": t["rung_mix"], "loss_model": "calibrated (loss.json)",
            "predicted_kl": a["predicted_loss"],
            "kl": t["students"][0]["mean_kl"], "top1": t["students"][0]["top1"]},
  "alloc_kl_over_uniform": t["students"][0]["mean_kl"] / u["mean_kl"],
  "alloc_kl_over_prune": t["students"][0]["mean_kl"] / p["mean_kl"],
  "alloc_plain_kl_over_uniform": ep["mean_kl"] / u["mean_kl"],
  "tiers": [{"label": s["label"], "kl": s["mean_kl"], "top1": s["top1"], "mix": s["mix"]}
            for s in t["students"][1:]],
}))
PY
done
echo "], \"load_end\": \"$(cat /proc/loadavg)\", \"taus\": \"$TAUS\", \"residual_cache\": \"$CACHE\"," >> "$W/rows.json"
echo "\"command\": \"dev/alloc-tiers.sh $W\"}" >> "$W/rows.json"
mkdir -p "$ROOT/dev/evidence"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['format']='keep-alloc-tiers-evidence'; d['version']=2; d['loss_model']=json.load(open(sys.argv[3])); json.dump(d, open(sys.argv[2],'w'), indent=1)" \
  "$W/rows.json" "$ROOT/dev/evidence/alloc-tiers-bundled.json" "$W/loss.json"
python3 - "$ROOT/dev/evidence/alloc-tiers-bundled.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
lm = d["loss_model"]
print("loss model multipliers:", {k: round(v, 6) for k, v in lm["multipliers"].items()})
for what in ("fitted", "held_out"):
    for p in lm[what]:
        print(f"  {what:<8} {p['alloc'].split('/')[-1]:<28} KL {p['kl']:.5f} predicted {p['predicted']:.5f} ({p['predicted']/p['kl']:.2f}x)")
print(f"{'budget':>10} {'uniform':>16} {'prune-to-fit':>16} {'alloc':>10} {'a/u':>6} {'a/p':>6}  mix")
for r in d["rows"]:
    print(f"{'':>10} plain loss model: KL {r['alloc_plain_loss']['kl']:.5f} ({r['alloc_plain_kl_over_uniform']:.2f}x uniform) mix {r['alloc_plain_loss']['mix']}; calibrated predicted KL {r['alloc']['predicted_kl']:.5f}")
    print(f"{r['budget_bytes']:>10} {r['uniform']['rung']:>8} {r['uniform']['kl']:.5f} "
          f"{r['reap_prune_to_fit']['experts_kept_per_layer']:>6}/L {r['reap_prune_to_fit']['kl']:.5f} "
          f"{r['alloc']['kl']:.5f} {r['alloc_kl_over_uniform']:.2f} {r['alloc_kl_over_prune']:.2f}  {r['alloc']['mix']}")
    for t in r["tiers"]:
        m = t["mix"]
        print(f"    {t['label']:<12} KL {t['kl']:.5f}  upper {m['slots_upper']}/{m['slots_upper']+m['slots_base']}"
              f"  hits {m['hits']} misses {m['misses']} admits {m['admissions']}  {m['bytes_read_per_token']:.0f} B/token")
PY
