#!/usr/bin/env bash
# `keep run --draft auto` against `--draft none` on one model, greedy, interleaved rounds in one
# run: decode tokens/s of each round from `--stats-json`, the median of each side and the ratio
# auto / none, what auto did (verify forwards, tokens decoded with drafting off, switches), and
# that the greedy text is identical. Writes the evidence JSON with the machine and the load.
# Measure on a quiet machine; the script reports, it asserts only the identical text. Odd
# rounds run none first, even rounds auto first.
#
# Usage: dev/draft-auto-speed.sh [MODEL_DIR] [ROUNDS] [MAX_TOKENS] [OUT_JSON]
#   MODEL_DIR defaults to the bundled models/keep-tiny (its trained MTP drafter), ROUNDS 7,
#   MAX_TOKENS 256, OUT dev/evidence/draft-auto-keep-tiny.json (refused if it exists unless
#   FORCE=1). PROMPT (default "def parse(") is the prompt text. KEEP is the binary (default
#   target/release/keep) and COMMIT the commit it was built from (default the tree's HEAD); the
#   evidence records both and the binary's SHA-256.
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-target/release/keep}
MODEL=${1:-models/keep-tiny}
ROUNDS=${2:-7}
MAX=${3:-256}
OUT=${4:-dev/evidence/draft-auto-keep-tiny.json}
PROMPT=${PROMPT:-def parse(}
[[ -x "$KEEP" ]] || nice -n 10 cargo build --release -q -p keep-cli
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2; exit 1
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cat "$MODEL"/*.safetensors >/dev/null
LOAD_BEFORE=$(cat /proc/loadavg)
for r in $(seq 1 "$ROUNDS"); do
  # Alternate which side runs first: on this machine the second run of a back-to-back pair
  # is often the slower one, which a fixed order would charge to one side.
  if (( r % 2 )); then order="none auto"; else order="auto none"; fi
  for d in $order; do
    "$KEEP" run "$MODEL" --prompt "$PROMPT" --max-tokens "$MAX" --temperature 0 --draft "$d" \
      --stats-json "$TMP/$d-$r.json" >"$TMP/$d-$r.out" 2>/dev/null
  done
done
LOAD_AFTER=$(cat /proc/loadavg)
python3 - "$TMP" "$OUT" "$MODEL" "$ROUNDS" "$MAX" "$PROMPT" "$LOAD_BEFORE" "$LOAD_AFTER" \
  "${COMMIT:-$(git rev-parse --short HEAD)}" "$KEEP" "$(sha256sum "$KEEP" | cut -c1-16)" <<'PY'
import json, pathlib, statistics, subprocess, sys
tmp = pathlib.Path(sys.argv[1])
out, model, rounds, mx, prompt, lb, la, commit, binary, binary_sha = sys.argv[2:12]
rounds = int(rounds)
def lscpu(key):
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    return None
ref = (tmp / "none-1.out").read_text()
rows = {"none": [], "auto": []}
auto = []
for r in range(1, rounds + 1):
    for d in ("none", "auto"):
        s = json.loads((tmp / f"{d}-{r}.json").read_text())
        rows[d].append(s["decode_tps"])
        if (tmp / f"{d}-{r}.out").read_text() != ref:
            sys.exit(f"round {r}: greedy text with --draft {d} differs from --draft none")
        if d == "auto":
            dr = s.get("draft") or {}
            auto.append({k: dr.get(k) for k in ("verify_forwards", "plain_tokens", "auto_offs",
                                                  "auto_ons", "auto_stopped", "tokens_per_forward")})
ratios = [a / n for a, n in zip(rows["auto"], rows["none"])]
res = {
    "command": f"dev/draft-auto-speed.sh {model} {rounds} {mx}",
    "commit": commit,
    "binary": binary,
    "binary_sha256_16": binary_sha,
    "model": model,
    "prompt": prompt,
    "max_tokens": int(mx),
    "machine": {"cpu": lscpu("Model name"), "cpus": lscpu("CPU(s)"), "l3": lscpu("L3 cache"),
                "avx512": "avx512f" in (lscpu("Flags") or "").split()},
    "loadavg_before": lb,
    "loadavg_after": la,
    "decode_tps": rows,
    "auto_runs": auto,
    "median_tps": {d: statistics.median(v) for d, v in rows.items()},
    "ratio_auto_none": ratios,
    "order": ["none first" if r % 2 else "auto first" for r in range(1, rounds + 1)],
    "median_ratio_auto_none": statistics.median(ratios),
    "ratio_min": min(ratios),
    "ratio_max": max(ratios),
    "greedy_identical": True,
}
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps(res, indent=1) + "\n")
print(f"none {res['median_tps']['none']:.1f} tok/s, auto {res['median_tps']['auto']:.1f} tok/s, "
      f"auto/none median {res['median_ratio_auto_none']:.3f} (pairs {', '.join(f'{x:.2f}' for x in ratios)})")
print(f"load {lb} -> {la}; wrote {out}")
PY
