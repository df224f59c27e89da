#!/usr/bin/env bash
# dev/bench-budget.sh: `keep run --memory-budget` decode speed against the residency bound,
# everything measured in one run on this machine.
#
#   dev/bench-budget.sh MODEL BUDGET OUT [PROMPT_TOKENS=4] [DECODE_TOKENS=32] [MMAP=0] [ROUNDS=1]
#
# 1. keep run MODEL --memory-budget BUDGET (greedy, synthetic prompt), recording its routes
#    and its numbers (run.json).
# 2. The bandwidths the cost model needs, measured now: the expert store's O_DIRECT read
#    bandwidth over 64 random experts and memory read bandwidth (bandwidth.json; example
#    `bandwidth` of keep-runtime). The bound uses the faster of that probe and the run's own
#    decode read rate.
# 3. keep residency replays the recorded routes with LRU at the run's slots per layer and
#    gives its tokens/s bound at those bandwidths (residency.json).
# 4. bench.json: the command, machine, both runs' numbers and the verdict
#    (rule: decode tokens/s >= 0.8 x the residency bound). Also a compute-inclusive bound:
#    1 / (compute seconds per token measured in the run + SSD bytes per token / SSD GB/s).
# EXTRA="--prefetch-next --policy decay" adds flags to the budgeted runs.
# With MMAP=1 the same prompt also runs through the plain mmap model (no budget), after
#    dropping the model's pages from the page cache, for a side-by-side (mmap-R.json); the two
#    alternate for ROUNDS rounds (keep, mmap, keep, mmap, ...) and medians are compared.
set -euo pipefail
MODEL=$1 BUDGET=$2 OUT=$3 P=${4:-4} D=${5:-32} MMAP=${6:-0} ROUNDS=${7:-1}
KEEP=${KEEP:-target/release/keep}
BW=${BW:-target/release/examples/bandwidth}
mkdir -p "$OUT"
evict() {
  # Drop the shards from the page cache (fadvise DONTNEED; no root needed).
  python3 - "$MODEL" <<'PY'
import os, sys, glob
for f in glob.glob(os.path.join(sys.argv[1], "*.safetensors")):
    fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
PY
}
for r in $(seq 1 "$ROUNDS"); do
  rec=()
  [ "$r" = 1 ] && rec=(--record-routes "$OUT/routes.safetensors")
  run_cmd=("$KEEP" run "$MODEL" --memory-budget "$BUDGET" --prompt-tokens "$P" --max-tokens "$((D + 1))"
    --temperature 0 "${rec[@]}" ${EXTRA:-} --stats-json "$OUT/run-$r.json")
  echo "+ ${run_cmd[*]}" >&2
  "${run_cmd[@]}" >/dev/null 2>"$OUT/run-$r.log"
  cat "$OUT/run-$r.log" >&2
  if [ "$MMAP" = 1 ]; then
    evict
    mm_cmd=("$KEEP" run "$MODEL" --prompt-tokens "$P" --max-tokens "$((D + 1))" --temperature 0 --stats-json "$OUT/mmap-$r.json")
    echo "+ ${mm_cmd[*]}" >&2
    "${mm_cmd[@]}" >/dev/null 2>"$OUT/mmap-$r.log"
    cat "$OUT/mmap-$r.log" >&2
  fi
done
cp "$OUT/run-1.json" "$OUT/run.json"
"$BW" "$MODEL" 64 8 >"$OUT/bandwidth.json"
# The SSD rate of the bound: the faster of the probe and what the run's own decode reads got
# (a probe that under-reads the disk would make a "bound" the run beats).
SSD=$(python3 -c "import json;print(max(json.load(open('$OUT/bandwidth.json'))['ssd_gbps'], json.load(open('$OUT/run.json'))['decode_cache']['read_gbps']))")
MEM=$(python3 -c "import json;print(json.load(open('$OUT/bandwidth.json'))['mem_gbps'])")
SLOTS=$(python3 -c "import json;print(json.load(open('$OUT/run.json'))['plan']['slots_per_layer'])")
"$KEEP" residency "$OUT/routes.safetensors" --hot "$SLOTS" --policy lru --warm-start none \
  --model "$MODEL" --ssd-gbps "$SSD" --mem-gbps "$MEM" --json >"$OUT/residency.json"
python3 - "$OUT" "$*" <<'PY'
import json, os, platform, sys
out, args = sys.argv[1], sys.argv[2]
run = json.load(open(f"{out}/run.json"))
bw = json.load(open(f"{out}/bandwidth.json"))
res = json.load(open(f"{out}/residency.json"))
row = res["sizes"][0]["policies"][0]
bound = row["cost"]["tokens_per_sec"]
plan, dec = run["plan"], run["decode_cache"]
n = max(run["decode_tokens"], 1)
ssd_per_tok = dec["misses"] / n * plan["expert_bytes"]
compute_per_tok = max(run["decode_secs"] - dec["wait_secs"], 0) / n
ssd_gbps = max(bw["ssd_gbps"], dec["read_gbps"])
bound_c = 1 / (compute_per_tok + ssd_per_tok / (ssd_gbps * 1e9))
import glob, statistics
runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/run-*.json"))]
mms = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/mmap-*.json"))]
keep_tps = statistics.median(r["decode_tps"] for r in runs)
mm = {"rounds": mms, "decode_tps": statistics.median(m["decode_tps"] for m in mms),
      "peak_rss_bytes": max(m["peak_rss_bytes"] for m in mms)} if mms else None
b = {
  "format": "keep-bench-budget", "version": 1,
  "command": "dev/bench-budget.sh " + args,
  "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
              "mem_total_kib": int(open("/proc/meminfo").readline().split()[1])},
  "keep_run": run, "keep_rounds": runs, "keep_decode_tps_median": keep_tps, "bandwidth": bw,
  "ssd_gbps_for_bound": ssd_gbps,
  "residency": {"policy": row["policy"], "hot": res["sizes"][0]["hot"], "miss_rate": row["miss_rate"],
                "cost": row["cost"]},
  "decode_tps": run["decode_tps"],
  "bound_tps": bound, "ratio": run["decode_tps"] / bound if bound else None,
  "compute_inclusive_bound_tps": bound_c, "ratio_compute_inclusive": run["decode_tps"] / bound_c,
  "mmap": mm, "speedup_vs_mmap": (keep_tps / mm["decode_tps"]) if mm and mm["decode_tps"] else None,
  "verdict_rule": "PASS if decode tokens/s >= 0.8 x keep residency's bound (LRU at the run's slots per layer, replaying the run's own routes, memory bandwidth measured in the same run, SSD the faster of the probe and the run's own decode reads)",
}
b["verdict"] = "PASS" if b["ratio"] and b["ratio"] >= 0.8 else "FAIL"
json.dump(b, open(f"{out}/bench.json", "w"), indent=2)
print(f"decode {run['decode_tps']:.3f} tok/s; residency bound {bound:.3f} tok/s (ratio {b['ratio']:.2f}, {b['verdict']}); "
      f"compute-inclusive bound {bound_c:.3f} tok/s (ratio {b['ratio_compute_inclusive']:.2f}); "
      f"hit rate {dec['hit_rate']:.3f}, read {dec['read_gbps']:.2f} GB/s in-run, store probe {bw['ssd_gbps']:.2f} GB/s, bound at {ssd_gbps:.2f} GB/s, memory {bw['mem_gbps']:.2f} GB/s; "
      f"peak RSS {run['peak_rss_bytes']/2**30:.2f} GiB" + (f"; keep median {keep_tps:.3f} tok/s vs mmap median {mm['decode_tps']:.3f} tok/s, peak RSS {mm['peak_rss_bytes']/2**30:.2f} GiB, speedup {b['speedup_vs_mmap']:.2f}x" if mm else ""))
PY
