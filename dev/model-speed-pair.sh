#!/usr/bin/env bash
# Decode speed of two models of the same shapes (e.g. the bundled model and a retrained one) in
# one run: `keep run` greedy, interleaved rounds (odd rounds A first, even rounds B first), each
# model with --draft none (the main model alone) and --draft mtp (its MTP drafter: speed and
# acceptance). Decode tokens/s of each run from `--stats-json`; the evidence has every round's
# numbers, the medians, the ratios B / A, the machine, the load and the binary.
#
# Usage: dev/model-speed-pair.sh MODEL_A MODEL_B [ROUNDS] [MAX_TOKENS] [OUT_JSON]
#   ROUNDS 7, MAX_TOKENS 512, OUT dev/evidence/keep-tiny-retrained-speed.json (refused if it
#   exists unless FORCE=1). PROMPT (default "def parse(") is the prompt text; KEEP the binary
#   (default target/release/keep). Measure on a quiet machine: the script reports, it asserts
#   nothing about speed.
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-target/release/keep}
A=${1:?usage: dev/model-speed-pair.sh MODEL_A MODEL_B [ROUNDS] [MAX_TOKENS] [OUT_JSON]}
B=${2:?usage: dev/model-speed-pair.sh MODEL_A MODEL_B [ROUNDS] [MAX_TOKENS] [OUT_JSON]}
ROUNDS=${3:-7}
MAX=${4:-512}
OUT=${5:-dev/evidence/keep-tiny-retrained-speed.json}
PROMPT=${PROMPT:-def parse(}
[[ -x "$KEEP" ]] || nice -n 10 cargo build --release -q -p keep-cli
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2; exit 1
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat "$A"/*.safetensors "$B"/*.safetensors >/dev/null
LOAD_BEFORE=$(cat /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then order="a b"; else order="b a"; fi
  for m in $order; do
    dir=$A; [[ $m == b ]] && dir=$B
    for d in none mtp; do
      "$KEEP" run "$dir" --prompt "$PROMPT" --max-tokens "$MAX" --temperature 0 --draft "$d" \
        --stats-json "$TMP/$m-$d-$r.json" >/dev/null 2>&1
    done
  done
done
LOAD_AFTER=$(cat /proc/loadavg)
python3 - "$TMP" "$OUT" "$A" "$B" "$ROUNDS" "$MAX" "$PROMPT" "$LOAD_BEFORE" "$LOAD_AFTER" \
  "$(git rev-parse --short HEAD)" "$KEEP" "$(sha256sum "$KEEP" | cut -c1-16)" \
  "$(sha256sum "$A/model.safetensors" | cut -c1-16)" "$(sha256sum "$B/model.safetensors" | cut -c1-16)" <<'PY'
import json, pathlib, statistics, subprocess, sys
tmp = pathlib.Path(sys.argv[1])
out, a, b, rounds, mx, prompt, lb, la, commit, binary, binary_sha, sha_a, sha_b = sys.argv[2:15]
rounds = int(rounds)
def lscpu(key):
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None
runs = {}
for m in ("a", "b"):
    for d in ("none", "mtp"):
        rows = [json.loads((tmp / f"{m}-{d}-{r}.json").read_text()) for r in range(1, rounds + 1)]
        tps = [s["decode_tps"] for s in rows]
        runs[f"{m}_{d}"] = {"decode_tps": tps, "median_decode_tps": statistics.median(tps),
                            "decode_tokens": [s["decode_tokens"] for s in rows],
                            "tokens_per_forward": [(s.get("draft") or {}).get("tokens_per_forward") for s in rows],
                            "acceptance": (rows[-1].get("draft") or {}).get("acceptance")}
ratio = {d: runs[f"b_{d}"]["median_decode_tps"] / runs[f"a_{d}"]["median_decode_tps"] for d in ("none", "mtp")}
ev = {"format": "keep-model-speed-pair", "version": 1,
      "model_a": a, "model_a_sha256_16": sha_a, "model_b": b, "model_b_sha256_16": sha_b,
      "rounds": rounds, "max_tokens": int(mx), "prompt": prompt, "runs": runs,
      "ratio_b_over_a": ratio,
      "machine": {"cpu": lscpu("Model name"), "cores": lscpu("CPU(s)"), "l3": lscpu("L3 cache"),
                  "loadavg_before": lb, "loadavg_after": la},
      "binary": binary, "binary_sha256_16": binary_sha, "commit": commit,
      "command": f"dev/model-speed-pair.sh {a} {b} {rounds} {mx}"}
pathlib.Path(out).write_text(json.dumps(ev, indent=1) + "\n")
print(json.dumps({"ratio_b_over_a": ratio, **{k: v["median_decode_tps"] for k, v in runs.items()}}))
PY
