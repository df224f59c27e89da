#!/usr/bin/env bash
# The rule that makes `--kernels fast` the default, measured as a user would: for each model,
# `keep calibrate MODEL --split eval --kernels exact` (the teacher) then `keep eval MODEL
# --teacher T --kernels fast --json` over the bundled pack's held-out split, on the machine's
# own kernels and again held to AVX2 (`KEEP_SIMD=avx2`: no bf16 projections, the AVX2 integer
# kernels). One JSON with every eval's fast student (mean KL, top-1, positions), the machine,
# the binary's hash and the commit. Not a test: `fast_kernels_rule` is the test.
#
# Usage: dev/fast-kernels-rule.sh OUT_JSON [MODEL ...]
#   models default: models/keep-tiny; KEEP (default target/release/keep,
#   built if absent); COMMIT recorded as given (default: git HEAD). Refuses to replace OUT_JSON
#   unless FORCE=1.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: dev/fast-kernels-rule.sh OUT_JSON [MODEL ...]}
shift
MODELS=("$@")
[[ ${#MODELS[@]} -gt 0 ]] || MODELS=(models/keep-tiny)
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2; exit 1
fi
KEEP=${KEEP:-target/release/keep}
[[ -x "$KEEP" ]] || cargo build --release -q -p keep-cli
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export KEEP_CACHE_DIR="$TMP/cache"
n=0
for m in "${MODELS[@]}"; do
  "$KEEP" calibrate "$m" --split eval --kernels exact --out "$TMP/teacher-$n" >/dev/null 2>&1
  for simd in native avx2; do
    if [[ $simd == native ]]; then
      "$KEEP" eval "$m" --teacher "$TMP/teacher-$n" --kernels fast --json >"$TMP/eval-$n-$simd.json"
    else
      KEEP_SIMD=avx2 "$KEEP" eval "$m" --teacher "$TMP/teacher-$n" --kernels fast --json >"$TMP/eval-$n-$simd.json"
    fi
    printf '%s\t%s\t%s\n' "$m" "$simd" "$TMP/eval-$n-$simd.json" >>"$TMP/list.tsv"
  done
  n=$((n + 1))
done
python3 - "$TMP/list.tsv" "$OUT" "$KEEP" <<'PY'
import json, os, subprocess, sys
lst, out, keep = sys.argv[1:4]
rows = []
for line in open(lst):
    model, simd, path = line.rstrip("\n").split("\t")
    rep = json.load(open(path))
    fast = next(s for s in rep["students"] if s["kernels"] == "fast" and s.get("plan") is None)
    rows.append({"model": model, "kernels_level": simd, "mean_kl": fast["mean_kl"],
                 "top1": fast["top1"], "positions": fast["positions"],
                 "meets_rule": fast["mean_kl"] <= 1e-3 and fast["top1"] >= 0.99})
sh = lambda c: subprocess.run(["sh", "-c", c], capture_output=True, text=True).stdout.strip()
doc = {"bench": "fast-kernels-rule", "command": "dev/fast-kernels-rule.sh OUT " + " ".join(r["model"] for r in rows[::2]),
       "rule": {"max_mean_kl": 1e-3, "min_top1": 0.99},
       "commit": os.environ.get("COMMIT") or sh("git rev-parse --short HEAD"),
       "keep_sha256_16": sh(f"sha256sum {keep}")[:16],
       "machine": {"cpu": sh("lscpu | sed -n 's/^Model name: *//p'"), "cpus": os.cpu_count(),
                   "avx512_bf16": "avx512_bf16" in open("/proc/cpuinfo").read()},
       "rows": rows}
with open(out + ".tmp", "w") as f:
    json.dump(doc, f, indent=1)
os.replace(out + ".tmp", out)
for r in rows:
    print(f"{r['model']:28} {r['kernels_level']:7} KL {r['mean_kl']:.3e}  top-1 {r['top1']:.4f}  {'meets' if r['meets_rule'] else 'misses'} the rule")
print("wrote", out)
PY
