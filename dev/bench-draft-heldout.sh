#!/usr/bin/env bash
# Speculative decoding with the bundled model's trained MTP module on held-out text: for
# several prompts taken from held-out files of tools/train's corpus (never trained on),
# `keep run --draft none` against `--draft mtp --draft-tokens K` (K = 1, 2, 3) and
# `--draft auto`, greedy, resident (no budget) and under --memory-budget BUDGET, and beside
# them `keep residency --draft-acceptance` predictions from the routes of the budgeted
# `--draft none` runs, with the measured acceptance of each K: reads only, and with the
# measured compute (`--draft-probe`). Greedy outputs must be identical to --draft none.
# Prints and writes JSON: acceptance per draft position (pooled over prompts), tokens per
# verify forward, decode tok/s (summed tokens over summed seconds) and the speedup over
# --draft none, predicted speedups, and the load average before and after.
#
# Usage: dev/bench-draft-heldout.sh [MODEL_DIR] [BUDGET] [MAX_TOKENS] [PROMPTS] [OUT_JSON]
#   defaults: models/keep-tiny, 24MiB (about 12 of 32 slots per layer with K = 3), 64 tokens, 6 prompts,
#   dev/evidence/draft-heldout-keep-tiny.json
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP=${KEEP:-target/release/keep}
MODEL=${1:-models/keep-tiny}
BUDGET=${2:-24MiB}
MAX=${3:-64}
NP=${4:-6}
OUT=${5:-dev/evidence/draft-heldout-keep-tiny.json}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/prompts" "$TMP/routes"
# Prompts: the first lines (about 600 characters, whole lines) after the module docstring of
# NP held-out files, in manifest order (tools/train/corpus.py checks their hashes).
python3 - "$NP" "$TMP/prompts" <<'PY'
import sys, pathlib
sys.path.insert(0, "tools/train")
from corpus import load_split
n, out = int(sys.argv[1]), pathlib.Path(sys.argv[2])
files = [(p, t) for p, t in load_split("heldout") if len(t) > 4000]
step = max(1, len(files) // n)
for i, (path, text) in enumerate(files[::step][:n]):
    lines = text.splitlines(keepends=True)
    start = len(lines) // 3
    chunk = ""
    for l in lines[start:]:
        if len(chunk) + len(l) > 600:
            break
        chunk += l
    (out / f"p{i}.txt").write_text(chunk)
    (out / f"p{i}.src").write_text(path)
PY
run() {  # name, prompt index, extra flags...
  local name=$1 i=$2; shift 2
  "$KEEP" run "$MODEL" --prompt="$(cat "$TMP/prompts/p$i.txt")" --max-tokens "$MAX" \
    --temperature 0 --stats-json "$TMP/$name.p$i.json" --force "$@" \
    >"$TMP/$name.p$i.out" 2>"$TMP/$name.p$i.err"
}
LOAD0=$(cat /proc/loadavg)
for ((i = 0; i < NP; i++)); do
  run none "$i" --draft none
  for k in 1 2 3; do run "mtp$k" "$i" --draft mtp --draft-tokens "$k"; done
  run auto "$i" --draft auto --draft-tokens 2
  run bnone "$i" --draft none --memory-budget "$BUDGET" --policy lru \
    --record-routes "$TMP/routes/p$i.safetensors"
  for k in 1 2 3; do
    run "bmtp$k" "$i" --draft mtp --draft-tokens "$k" --memory-budget "$BUDGET" --policy lru
  done
  run bauto "$i" --draft auto --draft-tokens 2 --memory-budget "$BUDGET" --policy lru
  run bnone2 "$i" --draft none --memory-budget "$BUDGET" --policy lru
done
LOAD1=$(cat /proc/loadavg)
# Pooled acceptance per K (resident runs; the budgeted ones decode the same tokens).
for k in 1 2 3; do
  python3 - "$TMP" "$NP" "$k" >"$TMP/acc$k" <<'PY'
import json, sys
tmp, n, k = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prop = acc = None
for i in range(n):
    d = json.load(open(f"{tmp}/mtp{k}.p{i}.json"))["draft"]
    prop = d["proposed"] if prop is None else [a + b for a, b in zip(prop, d["proposed"])]
    acc = d["accepted"] if acc is None else [a + b for a, b in zip(acc, d["accepted"])]
print(",".join(f"{a / p if p else 0.0:.4f}" for a, p in zip(acc, prop)))
PY
done
SLOTS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['plan']['slots_per_layer'])" "$TMP/bnone.p0.json")
NEXP=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['plan']['n_experts'])" "$TMP/bnone.p0.json")
for k in 1 2 3; do
  for probe in reads probe; do
    flags=()
    [ "$probe" = probe ] && flags=(--draft-probe)
    "$KEEP" residency "$TMP/routes" --model "$MODEL" --hot "$SLOTS,$NEXP" --policy lru \
      --warm-start none --draft-acceptance "$(cat "$TMP/acc$k")" "${flags[@]}" --json \
      >"$TMP/res$k.$probe.json"
  done
done
python3 - "$TMP" "$OUT" "$MODEL" "$LOAD0" "$LOAD1" "$BUDGET" "$NP" "$MAX" "$SLOTS" "$NEXP" <<'PY'
import json, sys, pathlib
tmp, out, model, load0, load1, budget, n, mx, slots, nexp = sys.argv[1:11]
tmp, n = pathlib.Path(tmp), int(n)
def stats(name):
    return [json.loads((tmp / f"{name}.p{i}.json").read_text()) for i in range(n)]
def same(name, ref):
    return all((tmp / f"{name}.p{i}.out").read_text() == (tmp / f"{ref}.p{i}.out").read_text()
               for i in range(n))
def tps(rows):
    # Summed decode tokens over summed decode seconds.
    tok = sum(r["decode_tokens"] for r in rows)
    sec = sum(r["decode_secs"] for r in rows)
    return tok / sec
def draft(rows):
    if not rows[0].get("draft"):
        return {}
    prop = [sum(x) for x in zip(*(r["draft"]["proposed"] for r in rows))]
    acc = [sum(x) for x in zip(*(r["draft"]["accepted"] for r in rows))]
    vf = sum(r["draft"]["verify_forwards"] for r in rows)
    plain = sum(r["draft"].get("plain_tokens", 0) for r in rows)
    dec = sum(r["decode_tokens"] for r in rows)
    return {"acceptance": [a / p if p else 0.0 for a, p in zip(acc, prop)], "proposed": prop,
            "accepted": acc, "verify_forwards": vf,
            "tokens_per_forward": (dec - plain) / vf if vf else 0.0,
            "window_experts": sum(r["draft"].get("window_experts", 0) for r in rows) / n,
            "auto_offs": sum(r["draft"].get("auto_offs", 0) for r in rows),
            "auto_ons": sum(r["draft"].get("auto_ons", 0) for r in rows),
            "plain_tokens": plain}
res = {}
for k in (1, 2, 3):
    for probe in ("reads", "probe"):
        r = json.loads((tmp / f"res{k}.{probe}.json").read_text())["drafting"]
        res[(k, probe)] = {s["hot"]: s for s in r["sizes"]}
        if probe == "probe":
            res[(k, "compute")] = r["spec"]["compute"]
report = {"command": "dev/bench-draft-heldout.sh " + " ".join(sys.argv[3:4] + [budget, mx, str(n)]),
          "model": model, "budget": budget, "max_tokens": int(mx), "prompts": n,
          "prompt_sources": [(tmp / "prompts" / f"p{i}.src").read_text() for i in range(n)],
          "slots_per_layer": int(slots), "n_experts": int(nexp),
          "loadavg_before": load0, "loadavg_after": load1, "rows": []}
print(f"load {load0} -> {load1}; {n} held-out prompts, {mx} tokens, budget {budget} "
      f"({slots} of {nexp} slots per layer)")
for mode, pre, hot in (("resident", "", int(nexp)), ("budget", "b", int(slots))):
    base = (tps(stats(pre + "none")) if mode == "resident"
            else (tps(stats("bnone")) + tps(stats("bnone2"))) / 2)
    for name in ("none", "mtp1", "mtp2", "mtp3", "auto"):
        rows = stats(pre + name)
        t = tps(rows)
        d = draft(rows)
        row = {"mode": mode, "run": name, "decode_tps": t, "speedup": t / base, **d,
               "greedy_identical": same(pre + name, "none")}
        if name.startswith("mtp"):
            k = int(name[3:])
            for probe in ("reads", "probe"):
                p = res[(k, probe)][hot]
                row[f"predicted_speedup_{probe}"] = p["speedup"]
                row[f"predicted_tokens_per_forward_{probe}"] = p["tokens_per_forward"]
            row["probe_compute"] = res[(k, "compute")]
        report["rows"].append(row)
        print(f"{mode:8} {name:5} {t:8.2f} tok/s  x{t / base:.3f}  "
              f"tokens/forward {d.get('tokens_per_forward', 0):.2f}  "
              f"acceptance {[round(a, 3) for a in d.get('acceptance', [])]}  "
              + (f"predicted x{row['predicted_speedup_reads']:.3f} (reads) "
                 f"x{row['predicted_speedup_probe']:.3f} (with compute)  " if "predicted_speedup_probe" in row else "")
              + (f"auto offs {d.get('auto_offs')} ons {d.get('auto_ons')} plain {d.get('plain_tokens')}  " if name == "auto" else "")
              + f"identical={row['greedy_identical']}")
        if not row["greedy_identical"]:
            sys.exit(f"greedy output of {mode} {name} differs from --draft none")
pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
pathlib.Path(out).write_text(json.dumps(report, indent=1) + "\n")
print(f"wrote {out}")
PY
