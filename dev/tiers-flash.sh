#!/usr/bin/env bash
# Precision tiers end to end on a flash-shaped model larger than its memory budget, every step
# through the CLI: keep synth (V4.1-Flash expert shapes, vocabulary 32k, LAYERS layers, about
# EXPERTS_BYTES of routed experts), keep pack (a short text), keep calibrate + finalize (imatrix,
# REAP), keep calibrate --split eval (teacher logits), keep quant --format e8p2+e81 (every
# expert's error at E8P2 and E8P2+E81, and a checkpoint that carries every expert's residual
# codes), keep alloc --rungs e8p2,e8p2+e81 --budget (between all-E8P2 and all-E8P2+E81), keep
# eval --tiers --tau (its first student is the allocation in memory, as keep eval --alloc scores
# it), then keep run --memory-budget --tiers --tau on the E8P2+E81 checkpoint against keep
# residency --alloc --tau on the run's own routes (dev/bench-tiers.sh).
#
# The tier rule (keep-residency's `upper_stage`, shared by eval, run and residency): an expert's
# base is its allocated rung; an `e8p2` expert's upper stage is the residual codes the
# checkpoint carries, an `e8p2+e81` expert's (its residual is part of its base) is its shipped
# expert in the original model (--upper-from, given to eval, run and residency alike).
# The memory budget holds SLOTS expert slots per layer (below the 8 routed experts, so decode
# reads experts from SSD) plus the residual cache.
#
#   dev/tiers-flash.sh [WORKDIR]    (default /tmp/keep-tiers-flash; steps whose output exists are
#                                    reused, so a rerun after a fix redoes only what is missing;
#                                    delete WORKDIR/bench to measure the run again)
#
# Knobs (environment): KEEP (a built keep; else cargo build --release), LAYERS (2),
# EXPERTS_BYTES (280MiB: 8 experts per layer at 2 layers), TAUS (0.25), TAU (the run's; 0.25),
# CACHE (residual cache, 16MiB), BUDGET_FRAC (the allocation's budget between all-E8P2 (0) and
# all-E8P2+E81 (1), 0.5), PROMPT / DECODE tokens for keep run (4, 16), SLOTS (expert slots per
# layer the run's memory budget holds, 6: at least top-k, below the 8 routed experts).
# Writes dev/evidence/tiers-flash-synthetic-streaming.json (EVIDENCE overrides): budget, rung
# mix, KL (allocation, uniform, tiers), serving mix of eval, runtime and simulator, tok/s against
# the simulator's prediction, residual wait, load averages and the commands.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KEEP:-}" ]; then
  (cd "$ROOT" && cargo build --release -p keep-cli && cargo build --release -p keep-runtime --example bandwidth)
  KEEP="$ROOT/target/release/keep"
fi
export KEEP
export BW=${BW:-$(dirname "$KEEP")/examples/bandwidth}
W=${1:-/tmp/keep-tiers-flash}
LAYERS=${LAYERS:-2}
EXPERTS_BYTES=${EXPERTS_BYTES:-280MiB}
TAUS=${TAUS:-0.25}
TAU=${TAU:-0.25}
CACHE=${CACHE:-16MiB}
BUDGET_FRAC=${BUDGET_FRAC:-0.5}
PROMPT=${PROMPT:-4}
DECODE=${DECODE:-16}
SLOTS=${SLOTS:-6}
EVIDENCE=${EVIDENCE:-tiers-flash-synthetic-streaming.json}
mkdir -p "$W"
LOG="$W/steps.log"
T0=$(date +%s)
echo "{\"load_start\": \"$(cat /proc/loadavg)\"}" > "$W/load-start.json"
step() { # step NAME OUTPUT-THAT-MARKS-DONE -- command...
  local name=$1 done=$2; shift 3
  if [ -e "$done" ]; then echo "= $name (kept: $done)" | tee -a "$LOG" >&2; return; fi
  local t=$(date +%s)
  echo "+ $*" | tee -a "$LOG" >&2
  "$@"
  echo "  $name: $(( $(date +%s) - t )) s, load $(cat /proc/loadavg)" | tee -a "$LOG" >&2
}

# 1. the model: V4.1-Flash shapes, vocabulary 32k, LAYERS layers
python3 - "$ROOT/dev/configs/flash-vocab32k.json" "$LAYERS" "$W/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
n = int(sys.argv[2])
c["num_hidden_layers"] = n
c["compress_ratios"] = c["compress_ratios"][:n]
for k in ("kv_source_layer_ids", "index_source_layer_ids"):
    c[k] = [i for i in c[k] if i < n]
json.dump(c, open(sys.argv[3], "w"), indent=1)
PY
step synth "$W/model/config.json" -- "$KEEP" synth --config "$W/config.json" --experts-bytes "$EXPERTS_BYTES" --out "$W/model"

# 2. a short text: the start of the repository's ARCHITECTURE.md cut into 10 groups of about 200
#    characters (this tokenizer's tokens are about a character; 40% of the groups held out)
python3 - "$ROOT/ARCHITECTURE.md" "$W/text.jsonl" <<'PY'
import json, sys
t = open(sys.argv[1]).read()
with open(sys.argv[2], "w") as f:
    for i in range(10):
        f.write(json.dumps({"text": t[i * 200:(i + 1) * 200], "group": f"architecture-{i:02d}"}) + "\n")
PY
step pack "$W/pack/pack.json" -- "$KEEP" pack --from "$W/text.jsonl" --tokenizer "$ROOT/models/keep-tiny/tokenizer.json" \
  --max-tokens 128 --held-out-frac 0.4 --out "$W/pack"

# 3. calibration (imatrix + REAP) and the teacher
step calibrate "$W/run/calibrated" -- bash -c "'$KEEP' calibrate '$W/model' --pack '$W/pack' --out '$W/run' && '$KEEP' finalize '$W/run' && touch '$W/run/calibrated'"
step teacher "$W/teacher/run.json" -- "$KEEP" calibrate "$W/model" --pack "$W/pack" --split eval --out "$W/teacher"

# 4. every expert's error per rung
step quant "$W/q-e8p2+e81/quant-report.json" -- "$KEEP" quant "$W/model" --imatrix "$W/run" --format e8p2+e81 --out "$W/q-e8p2+e81"

# 5. the allocation between all-E8P2 and all-E8P2+E81 (the rungs the E8P2+E81 checkpoint holds)
"$KEEP" alloc "$W/run" --model "$W/model" --budget 1T --rungs e8p2,e8p2+e81,shipped \
  --quant-report "$W/q-e8p2+e81" --out "$W/probe.json" --force > /dev/null
read -r N E2 E3 SH <<<"$(python3 - "$W/probe.json" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))
b = {r["label"]: r["bytes_per_expert"] for r in a["rungs"]}
print(sum(len(l["rungs"]) for l in a["layers"]), b["e8p2"], b["e8p2+e81"], b["shipped"])
PY
)"
B=$(python3 -c "print(int($N * ($E2 + $BUDGET_FRAC * ($E3 - $E2))))")
step alloc "$W/alloc-e8p.json" -- "$KEEP" alloc "$W/run" --model "$W/model" --budget "$B" --rungs e8p2,e8p2+e81 \
  --quant-report "$W/q-e8p2+e81" --out "$W/alloc-e8p.json"

# 6. quality against the teacher: the uniform E8P2+E81 checkpoint, then keep eval --tiers (the
#    allocation in memory first, the score keep eval --alloc gives, then the per-token tiers at
#    each τ, each record's first PROMPT tokens one prefill forward as keep run computes them)
step eval-uniform "$W/eval-uniform.json" -- bash -c "'$KEEP' eval '$W/q-e8p2+e81' --teacher '$W/teacher' --pack '$W/pack' --json > '$W/eval-uniform.json.tmp' && mv '$W/eval-uniform.json.tmp' '$W/eval-uniform.json'"
step eval-tiers "$W/eval-tiers-e8p.json" -- bash -c "'$KEEP' eval '$W/model' --teacher '$W/teacher' --pack '$W/pack' --tiers '$W/alloc-e8p.json' --quant '$W/q-e8p2+e81' --tau '$TAUS' --residual-cache '$CACHE' --upper-from '$W/model' --prefill-tokens '$PROMPT' --plot '$W/tiers-e8p.svg' --force --json > '$W/eval-tiers-e8p.json.tmp' && mv '$W/eval-tiers-e8p.json.tmp' '$W/eval-tiers-e8p.json'"

# 7. the budgeted runtime with tiers against the simulator: the memory budget holds SLOTS slots
#    per layer (a probe run of the same prompt and length reads the plan's resident bytes,
#    context bytes and slot size)
if [ ! -e "$W/mem-plan.json" ]; then
  "$KEEP" run "$W/q-e8p2+e81" --memory-budget 1T --tau "$TAU" --tiers "$W/alloc-e8p.json" --upper-from "$W/model" --residual-cache "$CACHE" \
    --prompt-tokens "$PROMPT" --max-tokens "$((DECODE + 1))" --temperature 0 --stats-json "$W/mem-probe.json" --force \
    >/dev/null 2>"$W/mem-probe.log" || { cat "$W/mem-probe.log" >&2; exit 1; }
  python3 - "$W/mem-probe.json" "$SLOTS" "$W/mem-plan.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["plan"]
slots = int(sys.argv[2])
# planned = residents (with the residual cache) + context (decoding cache + activations) + slots
fixed = p["residents"] + p["cache_bytes"] + p["activation_bytes"]
mem = fixed + slots * p["n_layers"] * p["slot_bytes"] + (1 << 20)
json.dump({"fixed": fixed, "slot_bytes": p["slot_bytes"], "slots": slots, "memory_budget": mem}, open(sys.argv[3], "w"))
PY
fi
MEM=$(python3 -c "import json;print(json.load(open('$W/mem-plan.json'))['memory_budget'])")
MODEL_BYTES=$(du -sbL "$W/q-e8p2+e81" | cut -f1)
step run "$W/bench/bench.json" -- "$ROOT/dev/bench-tiers.sh" "$W/q-e8p2+e81" "$MEM" "$TAU" "$CACHE" "$W/bench" "$PROMPT" "$DECODE" "$W/alloc-e8p.json" "$W/model"

# 8. evidence
mkdir -p "$ROOT/dev/evidence"
python3 - "$W" "$ROOT/dev/evidence/$EVIDENCE" "$B" "$MEM" "$MODEL_BYTES" "$T0" "$*" "$TAU" "$CACHE" <<'PY'
import json, os, sys, time
w, out, budget, mem, model_bytes, t0, args, tau, cache = sys.argv[1:10]
j = lambda f: json.load(open(f"{w}/{f}"))
cfg, alloc, probe = j("model/config.json"), j("alloc-e8p.json"), j("probe.json")
rb = {r["label"]: r["bytes_per_expert"] for r in probe["rungs"]}
n = sum(len(l["rungs"]) for l in alloc["layers"])
uni, et = j("eval-uniform.json"), j("eval-tiers-e8p.json")
ea = et
bench = j("bench/bench.json")
mix = {}
for l in alloc["layers"]:
    for r in l["rungs"]:
        mix[r] = mix.get(r, 0) + 1
s0 = lambda e: e["students"][0]
d = {
  "format": "keep-tiers-flash-evidence", "version": 1,
  "command": "dev/tiers-flash.sh " + args,
  "model": {"layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
            "moe_intermediate_size": cfg["moe_intermediate_size"], "vocab_size": cfg["vocab_size"],
            "routed_experts_per_layer": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "routed_experts": n, "bytes_per_expert": rb,
            "expert_bytes_shipped": n * rb["shipped"], "checkpoint_bytes_e8p2_e81": int(model_bytes)},
  "teacher_positions": s0(ea).get("positions"),
  "alloc": {"budget_bytes": int(budget), "bytes": alloc["bytes"], "mix": mix,
            "predicted_loss": alloc["predicted_loss"], "solver": alloc["solver"],
            "kl_in_memory": s0(ea)["mean_kl"], "top1_in_memory": s0(ea)["top1"],
            "upper_stages": et.get("upper_stages")},
  "uniform_e8p2+e81": {"bytes": n * rb["e8p2+e81"], "kl": s0(uni)["mean_kl"], "top1": s0(uni)["top1"]},
  "tiers_eval": [{"label": s["label"], "kl": s["mean_kl"], "top1": s["top1"], "mix": s.get("mix")}
                 for s in et["students"][1:]],
  "run": {"memory_budget_bytes": int(mem), "mem_plan": j("mem-plan.json"), "tau": float(tau), "residual_cache": cache,
          "decode_hit_rate": bench["keep_run"]["decode_cache"]["hit_rate"],
          "decode_expert_bytes_read": bench["keep_run"]["decode_cache"]["bytes_read"],
          "decode_expert_wait_secs": bench["keep_run"]["decode_cache"]["wait_secs"],
          "decode_tps": bench["decode_tps"], "bound_tps": bench["bound_tps"], "ratio": bench["ratio"],
          "compute_inclusive_bound_tps": bench["compute_inclusive_bound_tps"],
          "ratio_compute_inclusive": bench["ratio_compute_inclusive"],
          "serving_mix": bench["serving_mix"], "residual_wait_secs": bench["residual_wait_secs"],
          "slots_per_layer": bench["keep_run"]["plan"]["slots_per_layer"],
          "loadavg_before": bench["loadavg_before"], "loadavg_after": bench["loadavg_after"],
          "bench_file": f"{w}/bench/bench.json"},
  "steps_log": open(f"{w}/steps.log").read().splitlines(),
  "load_start": j("load-start.json")["load_start"], "load_end": open("/proc/loadavg").read().strip(),
  "wall_secs": int(time.time()) - int(t0),
}
json.dump(d, open(out, "w"), indent=1)
a, u = d["alloc"], d["uniform_e8p2+e81"]
print(f"model: {n} routed experts ({cfg['n_routed_experts']}/layer x {cfg['num_hidden_layers']}), "
      f"{d['model']['expert_bytes_shipped']/2**20:.0f} MiB shipped, checkpoint {int(model_bytes)/2**20:.0f} MiB")
print(f"alloc: budget {a['budget_bytes']/2**20:.1f} MiB, mix {a['mix']}, upper stages {a['upper_stages']}, KL {a['kl_in_memory']:.5f}; "
      f"uniform e8p2+e81 {u['bytes']/2**20:.1f} MiB KL {u['kl']:.5f}")
for t in d["tiers_eval"]:
    print(f"tiers {t['label']}: KL {t['kl']:.5f}, mix {t['mix']}")
r = d["run"]
print(f"run at {r['memory_budget_bytes']/2**20:.0f} MiB ({r['slots_per_layer']} slots/layer, decode hit rate {r['decode_hit_rate']:.3f}): {r['decode_tps']:.3f} tok/s, bound {r['bound_tps']:.3f} "
      f"(ratio {r['ratio']:.2f}; compute-inclusive {r['ratio_compute_inclusive']:.2f}); residual wait {r['residual_wait_secs']}")
PY
