#!/usr/bin/env bash
# The whole pipeline once on a DeepSeek-V4.1-Flash-shaped model at full depth (43 layers) that
# is larger than this machine's memory, every step through the CLI, each step's wall time and
# peak RSS recorded (/usr/bin/time), and what `keep fit` predicted against what the run measured:
#   1. keep synth --config CONFIG --engram-bytes ENGRAM_BYTES --draft dspark  (V4.1-Flash's layer
#      count, attention kinds, Engram placement and hashing, a DSpark drafter; widths as CONFIG
#      says: dev/configs/flash43-half-engram.json halves them, see dev/engram-big.sh)
#   2. keep pack: a short text (this repository's ARCHITECTURE.md in TEXT_GROUPS groups)
#   3. keep calibrate + keep finalize (imatrix, REAP, routes)
#   4. keep select --keep SELECT_KEEP --saliency reap (the prune plan and its agreement with frequency)
#   5. keep quant --format e8p2+e81 (every expert's error at E8P2 and E8P2+E81)
#   6. keep alloc --rungs e8p2,e8p2+e81,shipped at BUDGET_FRAC between all-E8P2 (0) and
#      all-shipped (1) bytes of routed experts
#   7. keep quant --alloc (the allocated checkpoint; Engram shards linked, not copied)
#   8. keep fit --memory MEM on the allocated checkpoint (offload; the machine probed)
#   9. keep run --plan (as planned, no drafting) and keep run --plan with the plan's `draft`
#      set to dspark; keep fit --check (the plan's check set decoded again against its prediction)
# Page cache dropped before the fit, run and check steps when root. Steps whose output exists
# are kept, so a rerun after a fix redoes only what is missing.
# Usage: dev/full-depth-pipeline.sh [WORKDIR]   (default /tmp/keep-full-depth)
# Environment: KEEP (a built keep), CONFIG, ENGRAM_BYTES (22GiB), MEM (8GiB), BUDGET_FRAC (0.5),
#   SELECT_KEEP (75%), TEXT_GROUPS (24), PROMPT (16), TOKENS (16), SEQS (2), EVIDENCE
#   (dev/evidence/full-depth-pipeline.json), KEEP_MODEL=1 keeps WORKDIR's checkpoints at the end,
#   UNTIL=STEP stops after that step (a rerun goes on from there).
# The small test of the procedure (minutes, ~3 GB):
#   CONFIG=dev/configs/flash16-half-engram.json ENGRAM_BYTES=256MiB MEM=1800MiB \
#     EVIDENCE=/tmp/full-depth-small.json dev/full-depth-pipeline.sh /tmp/keep-full-depth-small
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${KEEP:-}" ]; then
  (cd "$ROOT" && cargo build --release -p keep-cli)
  KEEP="$ROOT/target/release/keep"
fi
W=${1:-/tmp/keep-full-depth}
CONFIG=${CONFIG:-$ROOT/dev/configs/flash43-half-engram.json}
ENGRAM_BYTES=${ENGRAM_BYTES:-22GiB}
MEM=${MEM:-8GiB}
BUDGET_FRAC=${BUDGET_FRAC:-0.5}
SELECT_KEEP=${SELECT_KEEP:-75%}
TEXT_GROUPS=${TEXT_GROUPS:-24}
PROMPT=${PROMPT:-16}; TOKENS=${TOKENS:-16}; SEQS=${SEQS:-2}
EVIDENCE=${EVIDENCE:-$ROOT/dev/evidence/full-depth-pipeline.json}
mkdir -p "$W"
STEPS="$W/steps.jsonl"
T0=$(date +%s)
drop() { sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }
step() { # step NAME OUTPUT-THAT-MARKS-DONE -- command...
  local name=$1 done=$2; shift 3
  if [ -e "$done" ]; then echo "= $name (kept: $done)" >&2; return; fi
  local before t
  before=$(cat /proc/loadavg)
  echo "+ $*" >&2
  /usr/bin/time -f '%e %M' -o "$W/time-$name" "$@"
  python3 - "$name" "$W/time-$name" "$before" "$*" >> "$STEPS" <<'PY'
import json, sys
name, tf, before, cmd = sys.argv[1:5]
secs, rss = open(tf).read().split()[-2:]
print(json.dumps({"step": name, "seconds": float(secs), "peak_rss_bytes": int(rss) * 1024,
                  "load_before": before, "load_after": open("/proc/loadavg").read().strip(),
                  "command": cmd}))
PY
  tail -1 "$STEPS" >&2
  if [ "${UNTIL:-}" = "$name" ]; then echo "stopping after $name (UNTIL)" >&2; exit 0; fi
}

# 1. the model
bytes() { python3 -c "import re,sys; m=re.fullmatch(r'(\d+)([KMG]iB)?', sys.argv[1]); print(int(m[1]) << {None: 0, 'KiB': 10, 'MiB': 20, 'GiB': 30}[m[2]])" "$1"; }
if [ ! -d "$W/model" ]; then
  need=$(( $(bytes "$ENGRAM_BYTES") + (12 << 30) ))
  free=$(df -B1 --output=avail "$W" | tail -1)
  if [ "$free" -lt "$need" ]; then
    echo "refusing: $free bytes free at $W; the model and its quantized copies need about $need" >&2
    exit 1
  fi
fi
step synth "$W/model/config.json" -- "$KEEP" synth --config "$CONFIG" --engram-bytes "$ENGRAM_BYTES" \
  --draft dspark --out "$W/model"

# 2. a short text
python3 - "$ROOT/ARCHITECTURE.md" "$W/text.jsonl" "$TEXT_GROUPS" <<'PY'
import json, sys
t, n = open(sys.argv[1]).read(), int(sys.argv[3])
with open(sys.argv[2], "w") as f:
    for i in range(n):
        f.write(json.dumps({"text": t[i * 400:(i + 1) * 400], "group": f"architecture-{i:02d}"}) + "\n")
PY
step pack "$W/pack/pack.json" -- "$KEEP" pack --from "$W/text.jsonl" --tokenizer "$ROOT/models/keep-tiny/tokenizer.json" \
  --max-tokens 128 --held-out-frac 0.25 --out "$W/pack"

# 3. calibration
step calibrate "$W/run/run.json" -- "$KEEP" calibrate "$W/model" --pack "$W/pack" --out "$W/run"
step finalize "$W/run/reap-stats.safetensors" -- "$KEEP" finalize "$W/run"

# 4. selection
step select "$W/select.json" -- "$KEEP" select "$W/run" --keep "$SELECT_KEEP" --saliency reap --out "$W/select.json"

# 5. every expert's error per rung
step quant "$W/q3/quant-report.json" -- "$KEEP" quant "$W/model" --imatrix "$W/run" --format e8p2+e81 --out "$W/q3"

# 6. the allocation
"$KEEP" alloc "$W/run" --model "$W/model" --budget 1T --rungs e8p2,e8p2+e81,shipped \
  --quant-report "$W/q3" --out "$W/probe.json" --force > /dev/null
B=$(python3 - "$W/probe.json" "$BUDGET_FRAC" <<'PY'
import json, sys
a = json.load(open(sys.argv[1]))
b = {r["label"]: r["bytes_per_expert"] for r in a["rungs"]}
n = sum(len(l["rungs"]) for l in a["layers"])
print(int(n * (b["e8p2"] + float(sys.argv[2]) * (b["shipped"] - b["e8p2"]))))
PY
)
step alloc "$W/alloc.json" -- "$KEEP" alloc "$W/run" --model "$W/model" --budget "$B" --rungs e8p2,e8p2+e81,shipped \
  --quant-report "$W/q3" --out "$W/alloc.json"

# 7. the allocated checkpoint
step quant-alloc "$W/qa/quant-report.json" -- "$KEEP" quant "$W/model" --imatrix "$W/run" --alloc "$W/alloc.json" --out "$W/qa"

# 8. the plan
drop
step fit "$W/plan.json" -- "$KEEP" fit "$W/qa" --memory "$MEM" --out "$W/plan.json" --force --probe-tokens "$TOKENS" \
  --prompt-tokens "$PROMPT" --sequences "$SEQS" --context $((PROMPT + TOKENS + 8))
# The same plan drafting with DSpark: its budget grows by the drafter's tensors (mtp.*) and
# 64 MiB for the drafter's cache copy, so the hot set stays the plan's.
python3 - "$W/plan.json" "$W/plan-dspark.json" "$W/qa" <<'PY'
import json, os, sys
p = json.load(open(sys.argv[1]))
draft = 0
for f in os.listdir(sys.argv[3]):
    if f.endswith(".safetensors"):
        with open(os.path.join(sys.argv[3], f), "rb") as h:
            head = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        draft += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items() if k.startswith("mtp."))
p["draft"] = "dspark"
p["budget"] += draft + (64 << 20)
json.dump(p, open(sys.argv[2], "w"), indent=1)
PY

# 9. the runs
drop
step run "$W/run-plan.json" -- bash -c "'$KEEP' run --plan '$W/plan.json' --prompt-tokens '$PROMPT' --max-tokens '$TOKENS' \
  --temperature 0 --stats-json '$W/run-plan.json' > '$W/run-plan.out'"
drop
step run-dspark "$W/run-dspark.json" -- bash -c "'$KEEP' run --plan '$W/plan-dspark.json' --prompt-tokens '$PROMPT' \
  --max-tokens '$TOKENS' --temperature 0 --stats-json '$W/run-dspark.json' > '$W/run-dspark.out'"
drop
step check "$W/check.json" -- bash -c "'$KEEP' fit --check '$W/plan.json' --json > '$W/check.json.tmp' && mv '$W/check.json.tmp' '$W/check.json'"

# evidence
mkdir -p "$(dirname "$EVIDENCE")"
python3 - "$W" "$EVIDENCE" "$T0" "$MEM" "$B" <<'PY'
import json, os, subprocess, sys, time
w, out, t0, mem, budget = sys.argv[1:6]
j = lambda f: json.load(open(f"{w}/{f}"))
# one du over the three directories: a file linked into several is counted once, in the first
_du = subprocess.check_output(["du", "-sb", f"{w}/model", f"{w}/q3", f"{w}/qa"], text=True).split()
du = lambda d: int(_du[_du.index(f"{w}/{d}") - 1])
cfg = j("model/config.json")
alloc, qa, plan, check = j("alloc.json"), j("qa/quant-report.json"), j("plan.json"), j("check.json")
mix = {}
for l in alloc["layers"]:
    for r in l["rungs"]:
        mix[r] = mix.get(r, 0) + 1
mem_total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
def engram_table_bytes(d):
    n = 0
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as h:
                head = json.loads(h.read(int.from_bytes(h.read(8), "little")))
            n += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in head.items()
                     if k.startswith("layers.") and ".engram.embed." in k)
    return n
engram = engram_table_bytes(f"{w}/model")
d = {
  "format": "keep-evidence", "version": 1,
  "what": "the whole pipeline on a V4.1-Flash-shaped model at full depth, larger than the machine's memory",
  "command": "dev/full-depth-pipeline.sh " + w,
  "machine": {"mem_total_bytes": mem_total, "cpus": os.cpu_count()},
  "model": {k: cfg.get(k) for k in ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts",
                                     "num_experts_per_tok", "num_attention_heads", "head_dim", "vocab_size",
                                     "engram_layer_ids", "dspark_block_size", "dspark_target_layer_ids",
                                     "dspark_n_routed_experts")},
  "bytes": {"model": du("model"), "engram_tables": engram, "q3_not_linked": du("q3"),
            "allocated_not_linked": du("qa"),
            "allocated": int(subprocess.check_output(["du", "-sbL", f"{w}/qa"]).split()[0])},
  "steps": [json.loads(l) for l in open(f"{w}/steps.jsonl")],
  "select": {k: v for k, v in j("select.json").items() if k in ("keep", "n_experts", "saliency", "jaccard_vs_frequency")},
  "alloc": {"budget_bytes": int(budget), "bytes": alloc["bytes"], "mix": mix, "predicted_loss": alloc["predicted_loss"]},
  "quant_alloc": {"bits_per_weight": qa["bits_per_weight"], "tensors_quantized": qa["tensors_quantized"]},
  "fit": {"memory": mem, "prediction": {k: plan["prediction"][k] for k in ("name", "policy", "hot_set", "hit_rate",
                                                                             "tokens_per_sec", "bytes_in_memory", "bytes_on_ssd")},
          "probes": plan["probes"]},
  "run_plan": j("run-plan.json"),
  "run_dspark": j("run-dspark.json"),
  "greedy_identical_with_dspark": open(f"{w}/run-plan.out").read() == open(f"{w}/run-dspark.out").read(),
  "check": check,
  "wall_secs_of_the_last_call": int(time.time()) - int(t0),
  "commit": subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(out)), "rev-parse", "HEAD"],
                           capture_output=True, text=True).stdout.strip(),
}
json.dump(d, open(out, "w"), indent=1)
c = d["check"]
print(f"model {d['bytes']['model']/2**30:.2f} GiB ({d['bytes']['engram_tables']/2**30:.2f} GiB of Engram tables), "
      f"memory {mem_total/2**30:.2f} GiB; allocated checkpoint {d['bytes']['allocated']/2**30:.2f} GiB, mix {mix}")
for s in d["steps"]:
    print(f"  {s['step']:<12} {s['seconds']:8.1f} s  peak RSS {s['peak_rss_bytes']/2**30:6.2f} GiB")
print(f"fit predicted {c['predicted_tps']:.3f} tok/s, measured {c['measured_tps']:.3f} ({100 * c['tps_error']:+.1f}%), "
      f"hit rate {c['predicted_hit_rate']:.3f} vs {c['measured_hit_rate']}, peak RSS {c['peak_rss']} (ceiling {c['peak_rss_ceiling']})")
PY
if [ -z "${KEEP_MODEL:-}" ]; then rm -rf "$W/model" "$W/q3" "$W/qa"; fi
echo "wrote $EVIDENCE"
