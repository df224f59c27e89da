#!/usr/bin/env bash
# dev/bench-tiers.sh: `keep run --memory-budget --tau` (precision tiers) decode speed and serving
# mix against `keep residency --tau`'s prediction for the same trace, measured in one run.
#
#   dev/bench-tiers.sh MODEL BUDGET TAU RESIDUAL_CACHE OUT [PROMPT_TOKENS=4] [DECODE_TOKENS=32] [ALLOC] [ORIGINAL]
#
# MODEL is a checkpoint with E8P experts (`keep quant --format e8p2+e81`, or `keep quant
# --alloc`), ALLOC the allocation it holds: an expert's base is its allocated rung, and an
# `e8p2` expert whose residual codes MODEL carries has them as its upper stage (without ALLOC,
# every E8P expert's base is its `e8p2` codes); ORIGINAL the checkpoint MODEL was quantized
# from, whose experts are the upper stages of the `e8p2+e81`/`e8p2+e8p2` ones (--upper-from;
# keep run refuses such an allocation without it).
# 1. keep run MODEL --memory-budget BUDGET --tau TAU --residual-cache RESIDUAL_CACHE [--tiers
#    ALLOC] [--upper-from ORIGINAL] (greedy, synthetic prompt), recording its routes and numbers
#    (run.json).
# 2. The bandwidths the cost model needs, measured now (bandwidth.json; keep-runtime's example
#    `bandwidth`); the SSD rate is the faster of the probe and the run's own decode reads.
# 3. keep residency replays the recorded routes with LRU at the run's slots per layer and the
#    same tiers (the same allocation, τ, residual cache, admission 1 token after the miss, the
#    prompt as one prefill forward) -> residency.json.
# 4. bench.json: both runs' numbers, the serving mix side by side (routed slots upper/base,
#    residual admissions, pooled over prompt and decode), and the verdict
#    (rule: decode tokens/s >= 0.8 x the tiered residency bound), plus a compute-inclusive bound.
set -euo pipefail
MODEL=$1 BUDGET=$2 TAU=$3 RC=$4 OUT=$5 P=${6:-4} D=${7:-32} ALLOC=${8:-} ORIGINAL=${9:-}
KEEP=${KEEP:-target/release/keep}
BW=${BW:-target/release/examples/bandwidth}
mkdir -p "$OUT"
tiers=(--tau "$TAU" --residual-cache "$RC")
res_alloc=()
if [ -n "$ALLOC" ]; then tiers+=(--tiers "$ALLOC"); res_alloc=(--alloc "$ALLOC"); fi
if [ -n "$ORIGINAL" ]; then tiers+=(--upper-from "$ORIGINAL"); res_alloc+=(--upper-from "$ORIGINAL"); fi
run_cmd=("$KEEP" run "$MODEL" --memory-budget "$BUDGET" "${tiers[@]}" --prompt-tokens "$P"
  --max-tokens "$((D + 1))" --temperature 0 --record-routes "$OUT/routes.safetensors"
  --stats-json "$OUT/run.json" --force)
echo "+ ${run_cmd[*]}" >&2
load_before=$(cat /proc/loadavg)
"${run_cmd[@]}" >/dev/null 2>"$OUT/run.log"
load_after=$(cat /proc/loadavg)
cat "$OUT/run.log" >&2
"$BW" "$MODEL" 64 8 >"$OUT/bandwidth.json"
SSD=$(python3 -c "import json;print(max(json.load(open('$OUT/bandwidth.json'))['ssd_gbps'], json.load(open('$OUT/run.json'))['decode_cache']['read_gbps']))")
MEM=$(python3 -c "import json;print(json.load(open('$OUT/bandwidth.json'))['mem_gbps'])")
SLOTS=$(python3 -c "import json;print(json.load(open('$OUT/run.json'))['plan']['slots_per_layer'])")
"$KEEP" residency "$OUT/routes.safetensors" --hot "$SLOTS" --policy lru --warm-start none \
  --model "$MODEL" --ssd-gbps "$SSD" --mem-gbps "$MEM" --tau "$TAU" --residual-cache "$RC" \
  --admit-delay 1 --prefill-tokens "$P" "${res_alloc[@]}" --json >"$OUT/residency.json"
python3 - "$OUT" "$*" "$load_before" "$load_after" <<'PY'
import json, os, platform, sys
out, args, lb, la = sys.argv[1:5]
run = json.load(open(f"{out}/run.json"))
bw = json.load(open(f"{out}/bandwidth.json"))
res = json.load(open(f"{out}/residency.json"))
t = res["tiers"]
row = t["rows"][0]
bound = row["tokens_per_sec"]
plan, dec = run["plan"], run["decode_cache"]
pre = run["prefill_cache"]
n = max(run["decode_tokens"], 1)
rt = {k: pre["tiers"][k] + dec["tiers"][k] for k in ("upper", "base", "upper_misses", "in_flight", "admissions", "no_room", "evictions", "above_tau", "bytes_read")}
ssd_gbps = max(bw["ssd_gbps"], dec["read_gbps"])
ssd_per_tok = dec["bytes_read"] / n + dec["tiers"]["bytes_read"] / n
compute_per_tok = max(run["decode_secs"] - dec["wait_secs"], 0) / n
bound_c = 1 / (compute_per_tok + ssd_per_tok / (ssd_gbps * 1e9))
sim = {k: t[k] for k in ("upper", "base", "upper_misses", "in_flight", "admissions", "no_room", "evictions", "above_tau", "residual_bytes_read", "slots", "tokens")}
b = {
  "format": "keep-bench-tiers", "version": 1,
  "command": "dev/bench-tiers.sh " + args,
  "loadavg_before": lb, "loadavg_after": la,
  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
              "mem_total_kib": int(open("/proc/meminfo").readline().split()[1])},
  "keep_run": run, "bandwidth": bw, "ssd_gbps_for_bound": ssd_gbps,
  "residency": {"hot": row["hot"], "policy": row["policy"], "tiers": t},
  "serving_mix": {"runtime_prefill_plus_decode": rt, "simulator_whole_trace": sim},
  "residual_wait_secs": {"prefill": pre["tiers"]["wait_secs"], "decode": dec["tiers"]["wait_secs"]},
  "decode_tps": run["decode_tps"], "bound_tps": bound,
  "ratio": run["decode_tps"] / bound if bound else None,
  "compute_inclusive_bound_tps": bound_c, "ratio_compute_inclusive": run["decode_tps"] / bound_c,
  "verdict_rule": "PASS if decode tokens/s >= 0.8 x keep residency's tiered bound (LRU at the run's slots per layer, residual LRU of the run's bytes with admission 1 token after the miss, replaying the run's own routes; memory bandwidth measured in the same run, SSD the faster of the probe and the run's own decode reads)",
}
b["verdict"] = "PASS" if b["ratio"] and b["ratio"] >= 0.8 else "FAIL"
json.dump(b, open(f"{out}/bench.json", "w"), indent=2)
print(f"decode {run['decode_tps']:.3f} tok/s; tiered residency bound {bound:.3f} tok/s (ratio {b['ratio']:.2f}, {b['verdict']}); "
      f"compute-inclusive bound {bound_c:.3f} tok/s (ratio {b['ratio_compute_inclusive']:.2f}); "
      f"slots upper/base runtime {rt['upper']}/{rt['base']} vs simulator {sim['upper']}/{sim['base']}; "
      f"admissions {rt['admissions']} vs {sim['admissions']}; residual wait {dec['tiers']['wait_secs']} s; load {lb} -> {la}")
PY
