#!/usr/bin/env bash
# dev/bench-resident.sh: `keep run` with every weight resident (the plain model, no budget)
# against the memory-bandwidth line: decode tokens/s vs (bytes read per token / measured read
# bandwidth), everything measured in one run on this machine.
#
#   dev/bench-resident.sh MODEL OUT_DIR [PROMPT_TOKENS=4] [DECODE_TOKENS=16] [ROUNDS=2] [KERNELS="fast exact"]
#
# 1. The model's files are read once into the page cache (and must fit in available memory),
#    so the mmap'd weights are resident and no decode step waits on the disk.
# 2. ROUNDS rounds, interleaved: the memory read bandwidth (example `bandwidth` of
#    keep-runtime: a 1 GiB buffer summed on every core, best of 5), then `keep run MODEL
#    --prompt-tokens P --max-tokens D+1 --temperature 0 --kernels K --stats-json` for each K
#    (round 1 also records the routes).
# 3. Bytes read per decode token: `keep residency` replays the recorded routes with every
#    expert hot (static policy, frequency warm start: no misses), so per token it counts the
#    model's resident bytes (all but routed experts, embedding, MTP, Engram tables) plus
#    top-k expert bytes per MoE layer; its tokens/s bound is those bytes / the bandwidth.
# 4. OUT_DIR/bench.json: command, machine, load averages, every round's numbers, medians and
#    the ratio decode tok/s / bound per kernel choice (goal >= 0.8; reported, not asserted).
set -euo pipefail
MODEL=$1 OUT=$2 P=${3:-4} D=${4:-16} ROUNDS=${5:-2} KERNELS=${6:-fast exact}
KEEP=${KEEP:-target/release/keep}
BW=${BW:-target/release/examples/bandwidth}
[[ -x "$BW" ]] || nice -n 10 cargo build --release -q -p keep-runtime --example bandwidth
if [[ -e "$OUT/bench.json" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT/bench.json (FORCE=1 to replace)" >&2; exit 1
fi
mkdir -p "$OUT"
size=$(du -sb "$MODEL" | cut -f1)
avail=$(($(awk '/MemAvailable/ {print $2}' /proc/meminfo) * 1024))
if (( size > avail * 8 / 10 )); then
  echo "model $size bytes does not fit in 80% of available memory ($avail); refusing" >&2; exit 1
fi
# Page every shard in (twice: the second pass finds them cached).
for _ in 1 2; do cat "$MODEL"/*.safetensors >/dev/null; done
echo "start: $(uptime)" >"$OUT/loads.txt"
for r in $(seq 1 "$ROUNDS"); do
  echo "bandwidth $r: $(uptime)" >>"$OUT/loads.txt"
  "$BW" "$MODEL" 8 1 >"$OUT/bandwidth-$r.json"
  for k in $KERNELS; do
    rec=()
    [[ $r == 1 && $k == "${KERNELS%% *}" ]] && rec=(--record-routes "$OUT/routes.safetensors")
    echo "run $r $k: $(uptime)" >>"$OUT/loads.txt"
    cmd=("$KEEP" run "$MODEL" --prompt-tokens "$P" --max-tokens "$((D + 1))" --temperature 0
      --kernels "$k" "${rec[@]}" --stats-json "$OUT/run-$r-$k.json" --force)
    echo "+ ${cmd[*]}" >&2
    "${cmd[@]}" >/dev/null 2>"$OUT/run-$r-$k.log"
    tail -3 "$OUT/run-$r-$k.log" >&2
  done
done
echo "end: $(uptime)" >>"$OUT/loads.txt"
MEM=$(python3 -c "import json,glob,statistics;print(statistics.median(json.load(open(f))['mem_gbps'] for f in glob.glob('$OUT/bandwidth-*.json')))")
NEXP=$(python3 -c "
import json,sys
c=json.load(open('$MODEL/config.json'));print(c.get('n_routed_experts'))")
"$KEEP" residency "$OUT/routes.safetensors" --hot "$NEXP" --policy static --warm-start frequency \
  --model "$MODEL" --ssd-gbps 1 --mem-gbps "$MEM" --json >"$OUT/residency.json"
python3 - "$OUT" "$MODEL" "$*" "$KERNELS" <<'PY'
import glob, json, os, platform, statistics, subprocess, sys
out, model, args, kernels = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
res = json.load(open(f"{out}/residency.json"))
pol = res["sizes"][0]["policies"][0]
cost = pol["cost"]
bws = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/bandwidth-*.json"))]
mem = statistics.median(b["mem_gbps"] for b in bws)
bpt = cost["mem_bytes_per_token"]
bound = mem * 1e9 / bpt
rows = {}
for k in kernels:
    runs = [json.load(open(f)) for f in sorted(glob.glob(f"{out}/run-*-{k}.json"))]
    tps = statistics.median(r["decode_tps"] for r in runs)
    rows[k] = {"decode_tps": [r["decode_tps"] for r in runs], "decode_tps_median": tps,
               "prefill_tps": [r["prefill_tps"] for r in runs],
               "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in runs),
               "ratio_to_bound": tps / bound,
               "effective_read_gbps": tps * bpt / 1e9}
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
b = {
  "bench": "resident-decode-vs-bandwidth", "schema_version": 1,
  "command": f"dev/bench-resident.sh {args}",
  "model": model, "model_bytes": sum(os.path.getsize(f) for f in glob.glob(f"{model}/*.safetensors")),
  "machine": {"cpu": next((l.split(':',1)[1].strip() for l in lscpu.splitlines() if l.startswith('Model name')), None),
              "cores": os.cpu_count(), "kernel": platform.release()},
  "keep_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
  "loads": open(f"{out}/loads.txt").read().splitlines(),
  "mem_gbps_rounds": [b["mem_gbps"] for b in bws], "mem_gbps_median": mem,
  "bytes_per_token": bpt, "resident_bytes": res["inputs"]["cost"]["resident_bytes"], "expert_bytes": res["inputs"]["cost"]["expert_bytes"], "top_k": res["inputs"]["top_k"],
  "replay": {"policy": pol.get("policy"), "miss_rate": pol.get("miss_rate"), "cost": cost},
  "bound_tps": bound,
  "kernels": rows,
  "rule": "decode tokens/s >= 0.8 x (memory read bandwidth / bytes read per decode token); reported, not asserted",
}
json.dump(b, open(f"{out}/bench.json", "w"), indent=1)
print(f"bytes/token {bpt/1e9:.3f} GB, bandwidth {mem:.2f} GB/s, bound {bound:.2f} tok/s")
for k, r in rows.items():
    print(f"{k}: decode {r['decode_tps_median']:.3f} tok/s = {r['ratio_to_bound']:.2f} of the bound ({r['effective_read_gbps']:.2f} GB/s)")
PY
