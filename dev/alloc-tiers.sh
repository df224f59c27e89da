#!/usr/bin/env bash
# Precision tiers on the bundled model, at equal bytes of routed experts: the allocation
# (keep alloc) against a uniform rung (keep quant) and against REAP pruning to fit (keep select
# + keep eval --mask), then the per-token tiers (keep eval --tiers) over a τ sweep.
# Usage: dev/alloc-tiers.sh [WORKDIR]  (KEEP=path/to/keep to skip the build; a WORKDIR that
# already holds the calibration runs reuses them, and the scores it holds; ROWS, TAUS, CACHE
# narrow the sweep; TAUS= (empty) scores the allocations without tiers). Writes dev/evidence/alloc-tiers-bundled.json (or $EVIDENCE)
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
TAUS=${TAUS-0.15,0.25,0.35,0.5,0.7}
CACHE=${CACHE:-2M}
Q3="$W/q-e8p2+e81"
B2=$((N * E2)); B3=$((N * E3))
budget_of() { [ "$1" = e8p2 ] && echo $B2 || echo $B3; }
kl() { python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['students']; print([x for x in s if x.get('plan')][0]['mean_kl'] if sys.argv[2:] else s[0]['mean_kl'])" "$@"; }
# The measured points, each an allocation and its KL (every step kept when its output exists):
# the uniform rungs (keep quant's checkpoints; the allocation `--rungs R` describes the same
# model, bit for bit), REAP pruning to fit (keep select --keep N per layer, scored with
# --mask; the allocation marks its experts pruned or shipped) and the plain allocation
# (keep alloc without a loss model, scored with --alloc).
for uni in ${ROWS:-e8p2 e8p2+e81}; do
  B=$(budget_of $uni)
  KEEPN=$((B / LAYERS / SH))
  [ -f "$W/eval-uniform-$uni.json" ] || "$KEEP" eval --teacher "$W/teacher" --json "$W/q-$uni" > "$W/eval-uniform-$uni.json"
  "$KEEP" alloc "$W/run" --budget 1T --rungs "$uni" --quant-report "$Q3" --out "$W/pt-uniform-$uni.json" --force > /dev/null
  [ -f "$W/plan-$uni.json" ] || "$KEEP" select "$W/run" --keep "$KEEPN" --out "$W/plan-$uni.json" --force --no-plot > /dev/null
  [ -f "$W/eval-prune-$uni.json" ] || "$KEEP" eval --teacher "$W/teacher" --mask "$W/plan-$uni.json" --json > "$W/eval-prune-$uni.json"
  python3 - "$W/plan-$uni.json" "$W/probe.json" "$SH" "$W/pt-prune-$uni.json" <<'PY'
import json, sys
plan, probe, sh, out = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), int(sys.argv[3]), sys.argv[4]
layers = [{"layer": l["layer"], "rungs": ["shipped" if j in set(l["survivors"]) else "pruned"
                                         for j in range(plan["n_experts"])]} for l in plan["layers"]]
kept = sum(r == "shipped" for l in layers for r in l["rungs"])
json.dump({"format": "keep-alloc", "version": 1, "model": probe["model"],
           "model_fingerprint": probe["model_fingerprint"], "budget_bytes": kept * sh, "bytes": kept * sh,
           "rungs": [{"label": "pruned", "bytes_per_expert": 0}, {"label": "shipped", "bytes_per_expert": sh}],
           "solver": "keep-select", "grain_bytes": 1, "predicted_loss": 0.0, "saliency": plan["saliency"],
           "layers": layers}, open(out, "w"), indent=1)
PY
  [ -f "$W/alloc-plain-$uni.json" ] || "$KEEP" alloc "$W/run" --budget "$B" --quant-report "$Q3" --out "$W/alloc-plain-$uni.json" > /dev/null
  [ -f "$W/eval-alloc-plain-$uni.json" ] || "$KEEP" eval --teacher "$W/teacher" --alloc "$W/alloc-plain-$uni.json" --quant "$Q3" --json > "$W/eval-alloc-plain-$uni.json"
done
# the loss model: fitted on the uniform rungs and pruning to fit, checked on the plain allocations
fit=(); chk=()
for uni in ${ROWS:-e8p2 e8p2+e81}; do
  fit+=(--point "$W/pt-uniform-$uni.json=$(kl "$W/eval-uniform-$uni.json")" --point "$W/pt-prune-$uni.json=$(kl "$W/eval-prune-$uni.json" plan)")
  chk+=(--check "$W/alloc-plain-$uni.json=$(kl "$W/eval-alloc-plain-$uni.json")")
done
"$KEEP" alloc-fit "$W/run" --quant-report "$Q3" "${fit[@]}" "${chk[@]}" --out "$W/loss.json" --force | tee "$W/loss.txt"
echo "{\"load_start\": \"$(cat /proc/loadavg)\", \"rows\": [" > "$W/rows.json"
rm -f "$W/.row-written"
# (`row` runs at the end of a pipe, in a subshell: the separator state lives in a file.)
row() { if [ -e "$W/.row-written" ]; then echo "," >> "$W/rows.json"; fi; touch "$W/.row-written"; cat >> "$W/rows.json"; }
for uni in ${ROWS:-e8p2 e8p2+e81}; do
  B=$(budget_of $uni)
  KEEPN=$((B / LAYERS / SH))
  "$KEEP" alloc "$W/run" --budget "$B" --quant-report "$Q3" --loss-model "$W/loss.json" --out "$W/alloc-$uni.json" --force > /dev/null
  # an allocation identical to one already scored (TAUS="" : no tiers) takes that score
  same=$(python3 - "$W/alloc-$uni.json" "$W"/pt-uniform-*.json "$W"/alloc-plain-*.json <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))["layers"]
print(next((p for p in sys.argv[2:] if json.load(open(p))["layers"] == a), ""))
PY
)
  if [ -z "$TAUS" ] && [ -n "$same" ]; then
    case "$same" in
      */pt-uniform-*) ev="$W/eval-uniform-${same##*/pt-uniform-}" ;;
      *) ev="$W/eval-${same##*/}" ;;
    esac
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['rung_mix']=None; d['same_as']=sys.argv[3]; d['students']=d['students'][:1]; json.dump(d, open(sys.argv[2],'w'))" "$ev" "$W/eval-tiers-$uni.json" "$same"
  elif [ -z "$TAUS" ]; then
    "$KEEP" eval --teacher "$W/teacher" --alloc "$W/alloc-$uni.json" --quant "$Q3" --json > "$W/eval-tiers-$uni.json"
  else
    "$KEEP" eval --teacher "$W/teacher" --tiers "$W/alloc-$uni.json" --quant "$Q3" \
      --tau "$TAUS" --residual-cache "$CACHE" --plot "$W/tiers-$uni.svg" --force --json > "$W/eval-tiers-$uni.json"
  fi
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
  "alloc": {"bytes": a["bytes"], "mix": mix(a), "loss_model": "calibrated (loss.json)",
            "scored_as": t.get("same_as", "keep eval --tiers / --alloc"),
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
EVIDENCE=${EVIDENCE:-$ROOT/dev/evidence/alloc-tiers-bundled.json}
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['format']='keep-alloc-tiers-evidence'; d['version']=2; d['loss_model']=json.load(open(sys.argv[3])); json.dump(d, open(sys.argv[2],'w'), indent=1)" \
  "$W/rows.json" "$EVIDENCE" "$W/loss.json"
python3 - "$EVIDENCE" <<'PY'
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
