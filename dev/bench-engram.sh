#!/usr/bin/env bash
# Engram overhead: decode time of one checkpoint with its Engram layers (rows from SSD through
# keep-runtime's EngramStore) against the same checkpoint without them (config without
# engram_layer_ids, shards shared by symlink), interleaved rounds, medians, JSON evidence. Both
# get the same expert slots per layer (the plain budget is cut by what the Engram variant's
# projections and row cache take), so expert misses do not count as Engram overhead.
#
# Usage: dev/bench-engram.sh MODEL_DIR OUT.json [ROUNDS] [BUDGET] [PROMPT] [TOKENS]
# MODEL_DIR: e.g. `keep synth --config CFG --engram-bytes 24GiB --out MODEL_DIR`.
set -euo pipefail
model=$1; out=$2; rounds=${3:-3}; budget=${4:-2GiB}; prompt=${5:-32}; tokens=${6:-17}
keep=${KEEP:-target/release/keep}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
plain="$work/no-engram"; mkdir "$plain"
for f in "$model"/*.safetensors "$model"/*.json; do
  [ "$(basename "$f")" = config.json ] || ln -s "$(realpath "$f")" "$plain/"
done
python3 - "$model/config.json" "$plain/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
t = c.get("text_config", c)
t["engram_layer_ids"] = []; t["engram_num_embeddings"] = []
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
# The same expert slots for both: the Engram variant's budget also holds the Engram
# projections and the row cache, so without this the plain variant would get more slots,
# fewer expert misses, and the difference would count expert reads as Engram overhead. A
# one-token run of each reads the budget splits; the plain budget is cut by the difference of
# their fixed parts.
"$keep" run "$model" --memory-budget "$budget" --prompt-tokens "$prompt" --max-tokens 2 --temperature 0 \
  --stats-json "$work/split-engram.json" > /dev/null 2> "$work/split.log" || { cat "$work/split.log" >&2; exit 1; }
"$keep" run "$plain" --memory-budget "$budget" --prompt-tokens "$prompt" --max-tokens 2 --temperature 0 \
  --stats-json "$work/split-plain.json" > /dev/null 2> "$work/split.log" || { cat "$work/split.log" >&2; exit 1; }
python3 - "$work/split-engram.json" "$work/split-plain.json" > "$work/plain-budget" <<'PY'
import json, sys
e, p = (json.load(open(f))["plan"] for f in sys.argv[1:3])
# Bytes the plain run's budget has beyond the Engram run's slots: give them up.
extra = (p["slots_per_layer"] - e["slots_per_layer"]) * p["slot_bytes"] * p["n_layers"]
print(p["budget"] - max(0, extra))
PY
budget_plain=$(cat "$work/plain-budget")
for r in $(seq 1 "$rounds"); do
  for which in engram plain; do
    dir=$model; b=$budget; [ $which = plain ] && { dir=$plain; b=$budget_plain; }
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
    "$keep" run "$dir" --memory-budget "$b" --prompt-tokens "$prompt" --max-tokens "$tokens" \
      --temperature 0 --stats-json "$work/$which-$r.json" > /dev/null 2> "$work/$which-$r.log" \
      || { cat "$work/$which-$r.log" >&2; exit 1; }
  done
done
python3 - "$work" "$rounds" "$out" "$model" "$budget" "$prompt" "$tokens" "$budget_plain" <<'PY'
import json, sys, statistics, platform, os, subprocess
work, rounds, out, model, budget, prompt, tokens, budget_plain = sys.argv[1:9]
runs = {w: [json.load(open(f"{work}/{w}-{r}.json")) for r in range(1, int(rounds) + 1)] for w in ("engram", "plain")}
med = lambda w, k: statistics.median(x[k] for x in runs[w])
e_dec, p_dec = med("engram", "decode_secs"), med("plain", "decode_secs")
waits = [x["decode_engram"]["wait_secs"] for x in runs["engram"]]
ev = {
  "format": "keep-bench-engram", "version": 1,
  "command": " ".join(["dev/bench-engram.sh"] + sys.argv[4:5] + [out, rounds, budget, prompt, tokens]),
  "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "platform": platform.platform()},
  "model": model,
  "rule": "Engram adds <= 5% to the median decode time of the same model without it; Engram wait near zero",
  "decode_secs_median": {"engram": e_dec, "plain": p_dec},
  "decode_overhead": e_dec / p_dec - 1.0,
  "budget_plain_bytes": int(budget_plain),
  "slots_per_layer": {w: [x["plan"]["slots_per_layer"] for x in runs[w]] for w in runs},
  "decode_expert_wait_secs": {w: [x["decode_cache"]["wait_secs"] for x in runs[w]] for w in runs},
  "decode_overhead_without_expert_waits": statistics.median(x["decode_secs"] - x["decode_cache"]["wait_secs"] for x in runs["engram"])
    / statistics.median(x["decode_secs"] - x["decode_cache"]["wait_secs"] for x in runs["plain"]) - 1.0,
  "decode_engram_wait_secs": waits,
  "runs": runs,
}
ev["verdict"] = "PASS" if ev["decode_overhead"] <= 0.05 else "FAIL"
json.dump(ev, open(out, "w"), indent=1)
print(f"decode median: engram {e_dec:.3f} s, plain {p_dec:.3f} s, overhead {100*ev['decode_overhead']:.1f}%, engram waits {waits}; {ev['verdict']}")
PY
