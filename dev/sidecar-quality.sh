#!/usr/bin/env bash
# Reduced-rank sidecars on the bundled model (or MODEL with PACK, a pack its vocabulary
# covers): REAP-pruned 75 / 50 / 25% (keeping 24 / 16 / 8 of 32 experts on the bundled model)
# without sidecars and with `keep sidecar` ranks 8 / 32 / 128, each scored by `keep eval` (mean
# KL and top-1 against the teacher on the pack's held-out split). At equal bytes: the same
# levels keeping 1 and 2 more experts per layer (REAP order), with each variant's bytes per
# layer beside it.
#
# Usage: dev/sidecar-quality.sh WORKDIR [OUT.json]
#   TOKENS=8192 (calibration tokens each sidecar is fitted on; validation: a quarter of that),
#   RIDGE=auto (or a relative ridge), RANKS="8 32 128",
#   LEVELS="75 50 25", MODEL=models/keep-tiny, PACK=models/keep-tiny-pack. Needs
#   target/release/keep (cargo build --release -p keep-cli).
# Writes OUT.json (default dev/evidence/sidecar-quality-NAME.json, NAME the model folder's
# name) and leaves every plan,
# checkpoint report and eval report in WORKDIR.
set -euo pipefail
cd "$(dirname "$0")/.."
W="$(realpath -m "${1:?usage: dev/sidecar-quality.sh WORKDIR [OUT.json]}")"
MODEL="${MODEL:-models/keep-tiny}"
OUT="${2:-dev/evidence/sidecar-quality-$(basename "$MODEL").json}"
K="${KEEP:-$(pwd)/target/release/keep}"
M="$(realpath "$MODEL")"
P="$(realpath "${PACK:-models/keep-tiny-pack}")"
TOKENS=${TOKENS:-8192}
RIDGE=${RIDGE:-auto}
RANKS=${RANKS:-8 32 128}
LEVELS=${LEVELS:-75 50 25}
NE=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['n_routed_experts'])" "$M/config.json")
mkdir -p "$W/plans" "$W/ck" "$W/eval" "$W/fit"
printf '{"cores": %s, "loadavg_before": "%s", "cpu": "%s", "commit": "%s"}\n' "$(nproc)" \
  "$(cut -d' ' -f1-3 /proc/loadavg)" "$(lscpu | sed -n 's/^Model name: *//p')" "$(git rev-parse HEAD)" \
  > "$W/machine.json"
[ -f "$W/run/reap-stats.safetensors" ] || { $K calibrate "$M" --pack "$P" --out "$W/run" >/dev/null; $K finalize "$W/run" >/dev/null; }
[ -f "$W/teacher/run.json" ] || $K calibrate "$M" --pack "$P" --split eval --out "$W/teacher" >/dev/null
score() { # NAME CHECKPOINT
  [ -f "$W/eval/$1.json" ] || $K eval "$2" --teacher "$W/teacher" --pack "$P" --json > "$W/eval/$1.json"
}
for lv in $LEVELS; do
  k=$((NE * lv / 100))
  for kk in $k $((k + 1)) $((k + 2)); do
    [ -f "$W/plans/reap-$kk.json" ] || $K select "$W/run" --keep "$kk" --saliency reap --no-plot \
      --out "$W/plans/reap-$kk.json" --json > "$W/plans/select-$kk.json"
    [ -d "$W/ck/pruned-$kk" ] || $K prune "$M" "$W/ck/pruned-$kk" --plan "$W/plans/reap-$kk.json" >/dev/null
    score "pruned-$kk" "$W/ck/pruned-$kk"
  done
  for r in $RANKS; do
    [ -d "$W/ck/sc-$k-r$r" ] || $K sidecar "$M" --teacher-run "$W/run" --pack "$P" --plan "$W/plans/reap-$k.json" \
      --rank "$r" --ridge "$RIDGE" --max-tokens "$TOKENS" --json --out "$W/ck/sc-$k-r$r" > "$W/fit/sc-$k-r$r.json"
    score "sc-$k-r$r" "$W/ck/sc-$k-r$r"
  done
done
printf '{"loadavg_after": "%s"}\n' "$(cut -d' ' -f1-3 /proc/loadavg)" > "$W/machine-after.json"
python3 - "$W" "$OUT" "$TOKENS" "$RIDGE" "$LEVELS" "$RANKS" "$MODEL" "${PACK:-models/keep-tiny-pack}" <<'EOF'
import json, os, sys
w, out, tokens, ridge, levels, ranks, model, pack = sys.argv[1:]
levels = [int(x) for x in levels.split()]
ranks = [int(x) for x in ranks.split()]
load = lambda p: json.load(open(os.path.join(w, p)))
cfg = json.load(open(os.path.join(model, "config.json")))
hidden, layers, n_exp = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["n_routed_experts"]
def ck_bytes(name):
    d = os.path.join(w, "ck", name)
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
def student(name):
    s = load(f"eval/{name}.json")
    return s, s["students"][0]
full = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model) if f.endswith(".safetensors"))
rows, equal = [], []
teacher_nll = None
for lv in levels:
    k = n_exp * lv // 100
    # Bytes of one routed expert of one layer: the difference of two pruned checkpoints / layers.
    expert_bytes = (ck_bytes(f"pruned-{k+1}") - ck_bytes(f"pruned-{k}")) / layers
    def row(name, kept, rank, extra):
        global teacher_nll
        rep, s = student(name)
        teacher_nll = rep["teacher_nll"]
        return {"name": name, "keep_pct": lv, "experts_kept": kept, "rank": rank,
                "sidecar_bytes_per_layer": extra, "checkpoint_bytes": ck_bytes(name),
                "positions": s["positions"], "mean_kl": s["mean_kl"], "top1": s["top1"],
                "mean_dnll": s["mean_dnll"], "sidecar_layers": 0}
    for kk in (k, k + 1, k + 2):
        rows.append(row(f"pruned-{kk}", kk, 0, 0))
    for r in ranks:
        fit = load(f"fit/sc-{k}-r{r}.json")
        per_layer = fit["sidecar_bytes"] / max(1, len(fit["layers"]))
        x = row(f"sc-{k}-r{r}", k, r, per_layer)
        x["fit_layers"] = fit["layers"]
        x["sidecar_layers"] = sum(1 for l in fit["layers"] if l["kept"])
        x["validation_tokens"] = fit["validation_tokens"]
        rows.append(x)
        more = [y for y in rows if y["keep_pct"] == lv and y["rank"] == 0 and y["experts_kept"] > k]
        equal.append({"keep_pct": lv, "experts_kept": k, "rank": r,
                      "sidecar_bytes_per_layer": per_layer,
                      "sidecar_in_experts": per_layer / expert_bytes,
                      "mean_kl_sidecar": x["mean_kl"], "top1_sidecar": x["top1"],
                      "more_experts": [{"experts_kept": y["experts_kept"],
                                        "extra_bytes_per_layer": (y["experts_kept"] - k) * expert_bytes,
                                        "mean_kl": y["mean_kl"], "top1": y["top1"]} for y in more]})
ev = {
    "format": "keep-sidecar-quality", "version": 1,
    "model": model, "pack": pack, "hidden": hidden, "layers": layers, "experts": n_exp,
    "model_bytes": full,
    "expert_bytes_per_layer": expert_bytes,
    "saliency": "reap", "fit_tokens": int(tokens), "ridge": ridge if ridge == "auto" else float(ridge),
    "sidecar_dtype": "F32",
    "teacher_nll": teacher_nll,
    "machine": load("machine.json") | load("machine-after.json"),
    "command": f"MODEL={model} PACK={pack} TOKENS={tokens} RIDGE={ridge} LEVELS=\"{' '.join(map(str, levels))}\" RANKS=\"{' '.join(map(str, ranks))}\" dev/sidecar-quality.sh WORKDIR",
    "rows": rows,
    "equal_bytes": equal,
}
json.dump(ev, open(out, "w"), indent=1)
print(f"{'variant':<16} {'kept':>4} {'rank':>4} {'KL':>9} {'top1':>7}")
for x in rows:
    print(f"{x['name']:<16} {x['experts_kept']:>4} {x['rank']:>4} {x['mean_kl']:>9.5f} {x['top1']:>7.4f}")
print("wrote", out)
EOF
