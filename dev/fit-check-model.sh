#!/usr/bin/env bash
# keep fit on any model without a calibration run (offload only): plan for a memory, run the
# plan once with `keep run --plan`, then `keep fit --check` (the plan's check set decoded
# again: predicted against measured tok/s, hit rate, peak RSS). Page cache dropped before each
# step when root. Writes one JSON evidence file. Rerun on a quiet machine with one command:
#   dev/fit-check-model.sh MODEL_DIR MEMORY OUT.json [TOKENS] [PROMPT] [SEQUENCES]
#   e.g. dev/fit-check-model.sh /tmp/bigflash/flash43 8GiB dev/evidence/fit-flash43-8g.json 16 16 4
# KEEP=path/to/keep skips the build; WORK=dir keeps the plan and logs.
set -euo pipefail
cd "$(dirname "$0")/.."
model=$1; mem=$2; out=$3; tokens=${4:-16}; prompt=${5:-16}; seqs=${6:-4}
KEEP=${KEEP:-}
if [ -z "$KEEP" ]; then
  cargo build --release -p keep-cli
  KEEP=target/release/keep
fi
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
plan="$WORK/plan.json"
drop
$KEEP fit "$model" --memory "$mem" --out "$plan" --force --probe-tokens "$tokens" \
  --prompt-tokens "$prompt" --sequences "$seqs" --context $((prompt + tokens + 8)) | tee "$WORK/fit.txt"
drop
$KEEP run --plan "$plan" --prompt-tokens "$prompt" --max-tokens "$tokens" --temperature 0 \
  --stats-json "$WORK/run.json" > /dev/null 2> "$WORK/run.log"
drop
$KEEP fit --check "$plan" --json > "$WORK/check.json"
mkdir -p "$(dirname "$out")"
python3 - "$model" "$mem" "$plan" "$WORK/run.json" "$WORK/check.json" "$out" "$*" <<'PY'
import json, os, sys
model, mem, plan, run, check, out, args = sys.argv[1:8]
p = json.load(open(plan))
ev = {
  "format": "keep-fit-evidence", "version": 1,
  "command": "dev/fit-check-model.sh " + args,
  "model": model, "memory": mem,
  "loadavg_at_end": os.getloadavg(),
  "probes": p["probes"],
  "prediction": {k: p["prediction"][k] for k in ("name", "policy", "hot_set", "hit_rate", "tokens_per_sec", "bytes_in_memory", "bytes_on_ssd")},
  "check_set": {"source": p["check_set"]["source"], "sequences": len(p["check_set"]["sequences"]),
                "prompt_tokens": p["check_set"]["prompt_tokens"]},
  "keep_run_plan": json.load(open(run)),
  "check": json.load(open(check)),
}
json.dump(ev, open(out, "w"), indent=1)
c = ev["check"]
print(f"predicted {c['predicted_tps']:.3f} tok/s, measured {c['measured_tps']:.3f} tok/s "
      f"({100 * c['tps_error']:+.1f}%), hit rate {c['predicted_hit_rate']:.3f} vs {c['measured_hit_rate']}, "
      f"peak RSS {c['peak_rss']} (ceiling: budget + fixed overhead {c['peak_rss_ceiling']})")
PY
echo "wrote $out"
