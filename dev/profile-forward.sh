#!/usr/bin/env bash
# dev/profile-forward.sh: where a forward pass's time goes on one model, with the evidence to
# read it by: `keep run --profile --stats-json` (every prefill chunk and decoded token split by
# part, bytes read per part, thread waits) plus the command, the machine and the load.
#
#   dev/profile-forward.sh MODEL OUT.json [TOKENS=32] [KERNELS=fast] [PROMPT_TOKENS=16]
#
# Runs `keep run MODEL --prompt-tokens PROMPT_TOKENS --max-tokens TOKENS+1 --temperature 0
# --kernels KERNELS --draft none --profile --stats-json` (greedy; the TOKENS decode steps are
# the ones fed back) after paging the model's shards in, so that a resident run waits on no
# disk. Extra `keep run` flags go in KEEP_RUN_FLAGS (e.g. "--memory-budget 4GiB", which makes
# io_wait the expert reads). OUT.json is the run's keep-run-stats file with an `evidence`
# object added: the command, the commit of the tree it ran from and the keep binary's path and SHA-256, the machine (lscpu model, cores, threads, L3),
# load averages before and after, and the profile table `keep run --profile` printed.
# Threads: RAYON_NUM_THREADS (recorded). Measure on a quiet machine; this script reports, it
# asserts nothing.
set -euo pipefail
MODEL=$1 OUT=$2 TOKENS=${3:-32} KERNELS=${4:-fast} P=${5:-16}
KEEP=${KEEP:-target/release/keep}
[[ -x "$KEEP" ]] || nice -n 10 cargo build --release -q -p keep-cli
if [[ -e "$OUT" && "${FORCE:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2; exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Page every shard in (twice: the second pass finds them cached) unless a budget is given.
if [[ "${KEEP_RUN_FLAGS:-}" != *--memory-budget* ]]; then
  for _ in 1 2; do cat "$MODEL"/*.safetensors >/dev/null; done
fi
load_before=$(cat /proc/loadavg)
# shellcheck disable=SC2206
extra=(${KEEP_RUN_FLAGS:-})
cmd=("$KEEP" run "$MODEL" --prompt-tokens "$P" --max-tokens "$((TOKENS + 1))" --temperature 0
  --kernels "$KERNELS" --draft none --profile --stats-json "$tmp/stats.json" "${extra[@]}")
echo "+ ${cmd[*]}" >&2
"${cmd[@]}" >/dev/null 2>"$tmp/run.log"
load_after=$(cat /proc/loadavg)
cat "$tmp/run.log" >&2
python3 - "$tmp" "$OUT" "${cmd[*]}" "$load_before" "$load_after" "$*" "$KEEP" <<'PY'
import hashlib, json, os, subprocess, sys
tmp, out, cmd, before, after, args, keep_bin = sys.argv[1:8]
stats = json.load(open(f"{tmp}/stats.json"))
lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
field = lambda k: next((l.split(":", 1)[1].strip() for l in lscpu.splitlines()
                        if l.startswith(k + ":")), None)
def git(*a):
    r = subprocess.run(["git", *a], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None
log = open(f"{tmp}/run.log").read().splitlines()
table = [l for l in log if l.startswith(("profile:", "part ")) or
         (l.split() and l.split()[0] in set(stats["profile"]["parts"]) | {"total"})]
stats["evidence"] = {
    "script": f"dev/profile-forward.sh {args}",
    "command": cmd,
    # The tree the script ran from; KEEP may name a binary built elsewhere, so the binary
    # itself is recorded by its path and SHA-256 too.
    "keep_commit": git("rev-parse", "HEAD"),
    "keep_binary": keep_bin,
    "keep_binary_sha256": hashlib.sha256(open(keep_bin, "rb").read()).hexdigest(),
    "keep_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    "machine": {
        "model_name": field("Model name"),
        "cpus": field("CPU(s)"),
        "threads_per_core": field("Thread(s) per core"),
        "cores_per_socket": field("Core(s) per socket"),
        "sockets": field("Socket(s)"),
        "l3": field("L3 cache"),
        "numa_nodes": field("NUMA node(s)"),
    },
    "rayon_num_threads": os.environ.get("RAYON_NUM_THREADS"),
    "loadavg_before": before,
    "loadavg_after": after,
    "profile_table": table,
}
tmp_out = out + ".tmp"
with open(tmp_out, "w") as f:
    json.dump(stats, f, indent=1)
    f.write("\n")
os.replace(tmp_out, out)
print(f"wrote {out}", file=sys.stderr)
PY
