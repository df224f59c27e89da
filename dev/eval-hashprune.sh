#!/usr/bin/env bash
# Pruning a synthetic DeepSeek-V4-Flash's hash-routed layers (not a test): synth
# dev/configs/v4flash-hash-vocab4k.json (V4-Flash structure at toy width: 6 layers with ratios
# 0, 0, 4, 128, 4, 0, the first three hash-routed, 32 experts top-6, keep-tiny's 4096-token
# vocabulary), calibrate it on a pack (calibration split; eval split = the teacher), finalize,
# then `keep select --keep KEEP` with every remap policy, twice: pruning only the hash layers
# (the other layers' survivors nulled, so the remap alone is measured) and pruning every layer;
# plus the plan that leaves hash layers whole and a plain frequency plan. Every plan is scored
# by `keep eval` (KL, ΔNLL, top-1 against the unpruned teacher); the every-layer `nearest` plan is
# also pruned, verified and the pruned checkpoint scored directly (it must equal its plan's student).
#
# Usage: dev/eval-hashprune.sh OUT.json [PACK=models/keep-tiny-pack] [KEEP=16] [SEED=1]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="$(realpath -m "$1")"; PACK="$(realpath "${2:-models/keep-tiny-pack}")"
KEEPN="${3:-16}"; SEED="${4:-1}"
[ -n "${KEEP_BIN:-}" ] || cargo build --release -q -p keep-cli
KEEP="$(pwd)/target/release/keep"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
M="$TMP/model"
"$KEEP" synth --config dev/configs/v4flash-hash-vocab4k.json --out "$M" --seed "$SEED" \
  --block 128 --hash-layers 3 >/dev/null
t0=$(date +%s.%N)
"$KEEP" calibrate "$M" --pack "$PACK" --out "$TMP/calib" --json > "$TMP/calibrate.json"
t1=$(date +%s.%N)
"$KEEP" calibrate "$M" --pack "$PACK" --out "$TMP/teacher" --split eval --json > "$TMP/teacher.json"
"$KEEP" finalize "$TMP/calib" >/dev/null
plans=()
"$KEEP" select "$TMP/calib" --keep "$KEEPN" --out "$TMP/hash-whole.json" --no-plot >/dev/null
plans+=("$TMP/hash-whole.json")
"$KEEP" select "$TMP/calib" --keep "$KEEPN" --saliency frequency --hash-remap frequency \
  --out "$TMP/all-frequency-saliency-frequency.json" --no-plot >/dev/null
plans+=("$TMP/all-frequency-saliency-frequency.json")
for p in reap-next nearest frequency; do
  "$KEEP" select "$TMP/calib" --keep "$KEEPN" --hash-remap "$p" --out "$TMP/all-$p.json" \
    --no-plot >/dev/null
  python3 - "$TMP/all-$p.json" "$TMP/hashonly-$p.json" <<'PY'
import json, sys
plan = json.load(open(sys.argv[1]))
for l in plan["layers"]:
    if not l.get("hash_routed"):
        l["survivors"] = None
json.dump(plan, open(sys.argv[2], "w"), indent=1)
PY
  plans+=("$TMP/hashonly-$p.json" "$TMP/all-$p.json")
done
# One plan pruned for real (bit-equality of every policy is crates/keep-calib/tests/hash_prune.rs).
for p in nearest; do
  "$KEEP" prune "$M" "$TMP/pruned-$p" --plan "$TMP/all-$p.json" >/dev/null
  "$KEEP" verify "$TMP/pruned-$p" >/dev/null
done
args=(); for p in "${plans[@]}"; do args+=(--mask "$p"); done
t2=$(date +%s.%N)
"$KEEP" eval "$M" --teacher "$TMP/teacher" --pack "$PACK" "${args[@]}" --json > "$TMP/eval.json"
t3=$(date +%s.%N)
for p in nearest; do
  "$KEEP" eval "$TMP/pruned-$p" --teacher "$TMP/teacher" --pack "$PACK" --json \
    > "$TMP/eval-pruned-$p.json"
done
python3 - "$OUT" "$TMP" "$PACK" "$KEEPN" "$SEED" "$t0" "$t1" "$t2" "$t3" <<'PY'
import json, os, sys
out, tmp, pack, keepn, seed, t0, t1, t2, t3 = sys.argv[1:]
ev = json.load(open(f"{tmp}/eval.json"))
rows = []
for s in ev["students"]:
    rows.append({k: s[k] for k in ["label", "experts_kept", "experts_total", "saliency",
                                   "positions", "mean_kl", "mean_dnll", "top1"]})
pruned = {}
for p in ["nearest"]:
    e = json.load(open(f"{tmp}/eval-pruned-{p}.json"))["students"][0]
    st = next(s for s in ev["students"] if s["label"] == f"all-{p}.json")
    pruned[p] = {"pruned_checkpoint_mean_kl": e["mean_kl"], "student_mean_kl": st["mean_kl"],
                 "pruned_checkpoint_top1": e["top1"], "student_top1": st["top1"],
                 "equal": e["mean_kl"] == st["mean_kl"] and e["top1"] == st["top1"]}
cal = json.load(open(f"{tmp}/calibrate.json"))
res = {
    "what": "keep eval of prune plans on a synthetic DeepSeek-V4-Flash (dev/configs/v4flash-hash-vocab4k.json, 3 hash-routed layers of 32 experts top-6), teacher = the unpruned model on the pack's eval split",
    "command": f"dev/eval-hashprune.sh OUT {pack} {keepn} {seed}",
    "keep": int(keepn), "seed": int(seed), "pack": pack,
    "calibration_tokens": cal.get("tokens"), "calibrate_seconds": float(t1) - float(t0),
    "eval_seconds": float(t3) - float(t2),
    "teacher_nll": ev["teacher_nll"], "records": ev["records"],
    "students": rows, "pruned_checkpoints_vs_students": pruned,
    "machine": {"cores": os.cpu_count(), "loadavg": open("/proc/loadavg").read().split()[:3]},
}
json.dump(res, open(out, "w"), indent=1)
print(f"{'plan':44} {'kept':>6} {'mean KL':>10} {'ΔNLL':>9} {'top-1':>7}")
for r in rows:
    print(f"{r['label']:44} {r['experts_kept']:>3}/{r['experts_total']:<3} {r['mean_kl']:>10.5f} {r['mean_dnll']:>9.5f} {r['top1']:>7.4f}")
for p, v in pruned.items():
    print(f"pruned checkpoint ({p}) = its plan's student: {v['equal']}")
print(f"calibration {cal.get('tokens')} tokens in {float(t1)-float(t0):.1f} s; eval {float(t3)-float(t2):.1f} s; load {res['machine']['loadavg']}")
PY
