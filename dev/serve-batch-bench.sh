#!/usr/bin/env bash
# Aggregate decode tokens/s with 8 sequences batched vs 1 alone, on the `flash` preset's shapes
# (keep synth; weights, not compute, dominate decode there), then the bundled model; writes
# dev/evidence/serve-batch-decode.json. Run on a quiet machine:
#   bash dev/serve-batch-bench.sh [EXPERT_BYTES (default 1GiB)] [WORKDIR (default /tmp/keep-serve-bench)]
set -euo pipefail
cd "$(dirname "$0")/.."
bytes="${1:-1GiB}"
work="${2:-/tmp/keep-serve-bench}"
mkdir -p "$work" dev/evidence
cargo build --release -p keep-cli -p keep-model --example batch_decode
if [ ! -f "$work/flash/config.json" ]; then
  target/release/keep synth --preset flash --experts-bytes "$bytes" --out "$work/flash"
fi
load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
flash="$(target/release/examples/batch_decode "$work/flash" --batches 1,8 --steps 8 --prompt 16 --reps 3)"
tiny="$(target/release/examples/batch_decode models/keep-tiny --batches 1,8 --steps 32 --prompt 16 --reps 3)"
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$flash" "$tiny" "$load_before" "$load_after" "$bytes" <<'PY'
import json, sys, platform
flash, tiny = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def ratio(r):
    rows = {x["batch"]: x["aggregate_tokens_per_s"] for x in r["rows"]}
    return rows[8] / rows[1]
out = {
    "format": "keep-bench-serve-batch", "version": 1,
    "command": "bash dev/serve-batch-bench.sh " + sys.argv[5],
    "machine": platform.machine(), "nproc": __import__("os").cpu_count(),
    "loadavg_before": sys.argv[3], "loadavg_after": sys.argv[4],
    "verdict_rule": "aggregate decode tokens/s at 8 batched sequences >= 4x one sequence's on the flash shapes",
    "flash": flash, "flash_ratio_8_vs_1": ratio(flash),
    "keep_tiny": tiny, "keep_tiny_ratio_8_vs_1": ratio(tiny),
}
out["verdict"] = "met" if out["flash_ratio_8_vs_1"] >= 4 else "not met"
json.dump(out, open("dev/evidence/serve-batch-decode.json", "w"), indent=2)
print(json.dumps(out, indent=2))
PY
