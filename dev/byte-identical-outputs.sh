#!/usr/bin/env bash
# Byte-identical outputs of two keep binaries (not a test): runs the same verbs with OLD_KEEP and
# NEW_KEEP in the same scratch path (so paths recorded in the outputs agree) and compares every
# file each wrote. Verbs: pack, calibrate (calibration and eval split, keep-tiny and a synthetic
# V4-Flash with hash-routed layers, so sessions carry `reap.{L}.dist`), finalize, select, prune,
# verify, eval, logits (prefill with --routes and --fp8-kv, and --decode), run (whole model, and
# --memory-budget with --record-routes and --stats-json), residency (report, warm start, and
# --make-synthetic), synth, repack.
#
# A file passes when it is byte-identical. Two kinds of file are compared by content instead
# and say so: `keep-run-stats` JSON (and calibrate's/eval's --json reports), whose timings and
# peak RSS differ run to run — every other field must be equal; and a safetensors file whose
# only difference is the key order inside `__metadata__` (the old `keep logits` wrote it in
# the order of a hash map, which differs from run to run) — header length, every tensor entry
# in order, every metadata pair and the data must be equal; and `keep run --record-routes`'
# trace, whose `session` is `keep-run-<process id>` — every other byte of it must be equal.
#
# Usage: dev/byte-identical-outputs.sh OLD_KEEP NEW_KEEP [OUT.json]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD="$(realpath "$1")"; NEW="$(realpath "$2")"; REPORT="${3:-}"
MODEL="$(pwd)/models/keep-tiny"
V4CFG="$(pwd)/dev/configs/v4flash-hash-vocab4k.json"
W="$(mktemp -d)"; trap 'rm -rf "$W"' EXIT
mkdir -p "$W/in"
# A fixed text for the pack: independent of the repository's files.
python3 - "$W/in/text" <<'PY'
import os, sys
os.makedirs(sys.argv[1])
words = ("the expert cache holds hot experts and reads the rest from disk while a layer "
         "waits for its routes so that a model larger than memory still runs").split()
for f in range(4):
    with open(os.path.join(sys.argv[1], f"doc{f}.txt"), "w") as fh:
        for i in range(60):
            fh.write(" ".join(words[(i * 7 + f * 3 + j) % len(words)] for j in range(12)) + ".\n")
PY

run_all() {
  local K="$1" D="$W/out"
  rm -rf "$D"; mkdir -p "$D"
  "$K" pack --from "$W/in/text" --out "$D/pack" --model "$MODEL" --max-tokens 64 --json > "$D/pack.stdout.json"
  "$K" calibrate "$MODEL" --pack "$D/pack" --out "$D/calib" --json > "$D/calibrate.stdout.json"
  "$K" calibrate "$MODEL" --pack "$D/pack" --out "$D/teacher" --split eval --json > "$D/teacher.stdout.json"
  "$K" finalize "$D/calib" > "$D/finalize.stdout"
  "$K" select "$D/calib" --keep 16 --out "$D/plan.json" --no-plot --json > "$D/select.stdout.json"
  "$K" prune "$MODEL" "$D/pruned" --plan "$D/plan.json" > "$D/prune.stdout"
  "$K" verify "$D/pruned" > "$D/verify.stdout"
  "$K" eval "$MODEL" --teacher "$D/teacher" --pack "$D/pack" --mask "$D/plan.json" --json > "$D/eval.stdout.json"
  "$K" logits "$MODEL" --tokens 1,2,3,4,5,6,7,8 --routes --fp8-kv --out "$D/logits.safetensors" 2> "$D/logits.stderr"
  "$K" logits "$MODEL" --prompt "Once upon a time" --decode --out "$D/logits-decode.safetensors" 2> "$D/logits-decode.stderr"
  "$K" run "$MODEL" --prompt "Once upon a time" --max-tokens 12 > "$D/run.stdout"
  "$K" run "$MODEL" --prompt "Once upon a time" --max-tokens 12 --memory-budget 16MiB \
    --record-routes "$D/run-routes.safetensors" --stats-json "$D/run-stats.json" > "$D/run-budget.stdout"
  "$K" run "$MODEL" --prompt "Once upon a time" --max-tokens 12 --memory-budget 16MiB \
    --warm-start "$D/calib/reap-stats.safetensors" --stats-json "$D/run-stats-warm.json" > "$D/run-warm.stdout"
  "$K" residency "$D/calib" --json > "$D/residency.stdout.json"
  "$K" residency "$D/run-routes.safetensors" --json > "$D/residency-run.stdout.json"
  "$K" residency "$D/synthetic" --make-synthetic layers=4,experts=16,top_k=2 --json > "$D/residency-synthetic.stdout.json"
  "$K" synth --preset tiny --out "$D/synth" --seed 3 > "$D/synth.stdout"
  "$K" repack "$D/synth" "$D/repacked" --resident-format mxfp8 > "$D/repack.stdout"
  "$K" repack "$D/synth" "$D/repacked-bf16" --resident-format bf16 > "$D/repack-bf16.stdout"
  "$K" synth --config "$V4CFG" --out "$D/v4" --seed 1 --block 128 --hash-layers 3 > "$D/synth-v4.stdout"
  "$K" calibrate "$D/v4" --pack "$D/pack" --out "$D/v4-calib" --json > "$D/v4-calibrate.stdout.json"
  "$K" finalize "$D/v4-calib" > "$D/v4-finalize.stdout"
  "$K" select "$D/v4-calib" --keep 16 --hash-remap nearest --out "$D/v4-plan.json" --no-plot --json > "$D/v4-select.stdout.json"
  "$K" prune "$D/v4" "$D/v4-pruned" --plan "$D/v4-plan.json" > "$D/v4-prune.stdout"
}

run_all "$OLD"; mv "$W/out" "$W/old"
run_all "$NEW"; mv "$W/out" "$W/new"

python3 - "$W/old" "$W/new" "$REPORT" "$OLD" "$NEW" <<'PY'
import json, os, re, struct, sys
old, new, report, ob, nb = sys.argv[1:]
# Fields measured per run (wall times, rates, bytes/s, peak RSS) and the command line (it names
# the binary); in reports, the process id in a recorded run's session name.
TIMING = ("secs", "seconds", "tps", "per_s", "gbps", "peak_rss", "elapsed", "command")
def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if not any(t in k for t in TIMING)}
    if isinstance(v, list):
        return [strip(x) for x in v]
    if isinstance(v, str):
        # The session name `keep run --record-routes` gives its trace (the process id).
        return re.sub(r"keep-run-[0-9]+", "keep-run-PID", v)
    return v
def st_parts(b):
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n], object_pairs_hook=list)
    return n, h, b[8 + n:]
rows, bad = [], 0
names = sorted({os.path.relpath(os.path.join(r, f), old) for r, _, fs in os.walk(old) for f in fs}
               | {os.path.relpath(os.path.join(r, f), new) for r, _, fs in os.walk(new) for f in fs})
for rel in names:
    a, b = os.path.join(old, rel), os.path.join(new, rel)
    if not (os.path.exists(a) and os.path.exists(b)):
        rows.append((rel, "MISSING in " + ("new" if os.path.exists(a) else "old"))); bad += 1; continue
    x, y = open(a, "rb").read(), open(b, "rb").read()
    if x == y:
        rows.append((rel, "identical")); continue
    verdict = "DIFFERENT"
    if rel.endswith(".json"):
        try:
            if strip(json.loads(x)) == strip(json.loads(y)):
                verdict = "equal except timings"
        except ValueError:
            pass
    elif rel.endswith(".safetensors"):
        nx, hx, dx = st_parts(x); ny, hy, dy = st_parts(y)
        tx = [e for e in hx if e[0] != "__metadata__"]; ty = [e for e in hy if e[0] != "__metadata__"]
        mx = dict(next((e[1] for e in hx if e[0] == "__metadata__"), []))
        my = dict(next((e[1] for e in hy if e[0] == "__metadata__"), []))
        keys_x, keys_y = [e[0] for e in hx], [e[0] for e in hy]
        pid = lambda m: {k: v for k, v in m.items()
                         if not (k == "session" and v.startswith("keep-run-") and v[9:].isdigit())}
        if nx == ny and tx == ty and mx == my and dx == dy and keys_x == keys_y:
            verdict = "equal except the key order inside __metadata__"
        elif tx == ty and dx == dy and keys_x == keys_y and pid(mx) == pid(my) and mx != my:
            # `keep run --record-routes` names its session after the process id.
            verdict = "equal except the process id in `session`"
    if verdict == "DIFFERENT":
        bad += 1
    rows.append((rel, verdict))
for rel, v in rows:
    print(f"{v:50s} {rel}")
ident = sum(v == "identical" for _, v in rows)
print(f"{len(rows)} files: {ident} identical, {len(rows) - ident - bad} equal up to the stated differences, {bad} different")
if report:
    with open(report, "w") as f:
        json.dump({"what": "outputs of the same keep commands run with two binaries, compared file by file",
                   "command": f"dev/byte-identical-outputs.sh {ob} {nb}",
                   "old": ob, "new": nb, "load_average": open("/proc/loadavg").read().split()[:3],
                   "files": [{"file": r, "result": v} for r, v in rows],
                   "identical": ident, "different": bad}, f, indent=1)
sys.exit(1 if bad else 0)
PY
