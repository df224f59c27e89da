#!/usr/bin/env bash
# Decode speed of a model whose routed experts are E8P2 + E81 residual codes (`keep quant
# --format e8p2+e81`, or an allocation of such rungs), two builds of keep side by side in
# interleaved rounds, on the fast and on the exact kernels: decode tokens/s and the routed
# experts' ms per token (`--profile`) of each round from `--stats-json`, the medians, and the
# ratio new / old. Measure on a quiet machine; the script reports, it asserts nothing.
#
# Usage: OLD=path/to/old/keep NEW=path/to/new/keep dev/e8p-residual-decode.sh MODEL_DIR OUT_JSON [ROUNDS] [TOKENS]
#   (ROUNDS 5, TOKENS 16 decoded after an 8-token prompt; --draft none). The model the
#   evidence comes from is the allocated checkpoint of the small test of
#   dev/full-depth-pipeline.sh (16 layers, 16 routed experts per layer of 2560x1152).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; OUT=$2; ROUNDS=${3:-5}; TOKENS=${4:-16}
: "${OLD:?OLD=path to the old keep}" "${NEW:?NEW=path to the new keep}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat "$MODEL"/*.safetensors > /dev/null
LOAD_BEFORE=$(cat /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then order="old new"; else order="new old"; fi
  for k in fast exact; do
    for b in $order; do
      bin=$OLD; [ "$b" = new ] && bin=$NEW
      "$bin" run "$MODEL" --prompt-tokens 8 --max-tokens "$((TOKENS + 1))" --temperature 0 --draft none \
        --kernels "$k" --profile --stats-json "$TMP/$b-$k-$r.json" > /dev/null 2>&1
    done
  done
done
LOAD_AFTER=$(cat /proc/loadavg)
python3 - "$TMP" "$OUT" "$MODEL" "$ROUNDS" "$TOKENS" "$LOAD_BEFORE" "$LOAD_AFTER" "$OLD" "$NEW" \
  "$(git rev-parse --short HEAD)" <<'PY'
import json, pathlib, statistics, subprocess, sys
tmp = pathlib.Path(sys.argv[1])
out, model, rounds, tokens, lb, la, old, new, commit = sys.argv[2:11]
rounds = int(rounds)
cpu = next((l.split(":", 1)[1].strip() for l in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if l.startswith("Model name:")), None)
d = {"format": "keep-evidence", "version": 1,
     "what": "decode of a model with E8P2+E81 routed experts: two builds of keep, interleaved rounds",
     "command": f"OLD={old} NEW={new} dev/e8p-residual-decode.sh {model} {out} {rounds} {tokens}",
     "machine": {"cpu": cpu, "cores": __import__("os").cpu_count()},
     "model": model, "rounds": rounds, "decoded_tokens": tokens, "commit": commit,
     "loadavg_before": lb, "loadavg_after": la, "kernels": {}}
for k in ("fast", "exact"):
    row = {}
    for b in ("old", "new"):
        runs = [json.loads((tmp / f"{b}-{k}-{r}.json").read_text()) for r in range(1, rounds + 1)]
        parts = runs[0]["profile"]["parts"]
        i = parts.index("routed_experts")
        row[b] = {"decode_tps": [x["decode_tps"] for x in runs],
                  "routed_experts_ms_per_token": [x["profile"]["decode"]["ns"][i] / x["profile"]["decode"]["steps"] / 1e6 for x in runs]}
        row[b]["median_decode_tps"] = statistics.median(row[b]["decode_tps"])
        row[b]["median_routed_experts_ms"] = statistics.median(row[b]["routed_experts_ms_per_token"])
    row["decode_ratio"] = row["new"]["median_decode_tps"] / row["old"]["median_decode_tps"]
    d["kernels"][k] = row
    print(f"{k}: decode {row['old']['median_decode_tps']:.2f} -> {row['new']['median_decode_tps']:.2f} tok/s "
          f"({row['decode_ratio']:.2f}x); routed experts {row['old']['median_routed_experts_ms']:.1f} -> "
          f"{row['new']['median_routed_experts_ms']:.1f} ms/token")
json.dump(d, open(out, "w"), indent=1)
PY
echo "wrote $OUT"
