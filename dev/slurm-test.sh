#!/usr/bin/env bash
# The Slurm pipeline of deploy/slurm/ on a real single-node cluster: installs Debian's slurm-wlm
# and munge when missing, starts munged, slurmctld and slurmd (2 CPUs, as root, on this machine,
# with a configuration of its own under WORK), submits the calibration and quantization arrays on
# the bundled model with N tasks through deploy/slurm/submit.sh, cancels one task of each array
# while it runs and requeues it, waits for the pipeline, and checks that the finalized imatrix and
# REAP statistics and every file of the quantized model are byte-identical to an unsharded run's.
# Writes the evidence JSON (stage times, the cancelled tasks' restarts, every compared file).
# Stops the daemons it started. Not part of .ci/run (it takes minutes).
#
# Usage: dev/slurm-test.sh [OUT.json]   (root; env: WORK=/tmp/keep-slurm N=4 FORMAT=e8p2 KEEP=...)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
OUT_JSON="$(realpath -m "${1:-dev/evidence/slurm-array-byte-identical.json}")"
WORK="$(realpath -m "${WORK:-/tmp/keep-slurm}")"
N="${N:-4}"
FORMAT="${FORMAT:-e8p2}"
[ "$(id -u)" = 0 ] || { echo "run as root (it starts slurmctld and slurmd)" >&2; exit 1; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
if [ -z "${KEEP:-}" ]; then
  cargo build --release -q -p keep-cli
  KEEP="$REPO/target/release/keep"
fi
KEEP="$(realpath "$KEEP")"

rm -rf "$WORK"
mkdir -p "$WORK"/{state,spool,log,ref,shared}
started=()
cleanup() {
  set +e
  [ -f "$WORK/slurm.conf" ] && SLURM_CONF="$WORK/slurm.conf" scancel --user=root >/dev/null 2>&1
  for p in "${started[@]}"; do kill "$p" 2>/dev/null; done
  sleep 1
  for p in "${started[@]}"; do kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT

# munge: a key of this test's own, a daemon of its own (socket under WORK).
mkdir -p "$WORK/munge"
chmod 700 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$WORK/munge/munge.key"
MUNGE_SOCKET="$WORK/munge/munge.socket"
munged --force --key-file="$WORK/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$WORK/munge/munged.pid" --log-file="$WORK/log/munged.log" --seed-file="$WORK/munge/seed"
started+=("$(cat "$WORK/munge/munged.pid")")

HOST="$(hostname -s)"
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$WORK/slurm.conf" <<CONF
ClusterName=keep-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MinJobAge=3600
SlurmctldPort=16817
SlurmdPort=16818
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=2 RealMemory=$MEM_MB State=UNKNOWN
PartitionName=keep Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$WORK/slurm.conf"
slurmctld -f "$SLURM_CONF" -i
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  [ -f "$WORK/slurmctld.pid" ] && [ -f "$WORK/slurmd.pid" ] && sinfo -h -o %T 2>/dev/null | grep -q idle && break
  sleep 1
done
started+=("$(cat "$WORK/slurmctld.pid")" "$(cat "$WORK/slurmd.pid")")
sinfo -h -o "%P %D %c %T" | grep -q idle || { echo "the node did not come up: $(sinfo 2>&1)" >&2; exit 1; }
echo "slurm up: $(sinfo -h -o '%P %D nodes %c CPUs %T')"

now() { date +%s.%N; }
# The unsharded reference, outside Slurm.
t0=$(now)
"$KEEP" calibrate --out "$WORK/ref/run" >/dev/null
"$KEEP" finalize "$WORK/ref/run" >/dev/null
t1=$(now)
"$KEEP" quant --imatrix "$WORK/ref/run" --format "$FORMAT" --out "$WORK/ref/q" >/dev/null
t2=$(now)

# The pipeline through Slurm.
export KEEP RUN="$WORK/shared/run" OUT="$WORK/shared/q" FORMAT N
SBATCH_ARGS="--output=$WORK/log/%x-%A_%a.out" bash deploy/slurm/submit.sh > "$WORK/jobs.txt"
cat "$WORK/jobs.txt"
job() { sed -n "s/^$1=//p" "$WORK/jobs.txt"; }
state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -1; }
# Cancel one task of an array once it runs, then requeue it (a preempted node's task, by hand).
# A task that finishes before the cancel lands (quantizing the bundled model's layers takes
# about a second) is requeued all the same and must find its work done.
kill_one() {
  local arr=$1 idx=$2 id="${1}_${2}"
  for _ in $(seq 1200); do
    [ "$(state "$id")" = RUNNING ] && break
    sleep 0.5
  done
  [ "$(state "$id")" = RUNNING ] || { echo "$id never ran" >&2; exit 1; }
  sleep 2   # mid-run
  scancel "$id"
  for _ in $(seq 60); do
    case "$(state "$id")" in CANCELLED|COMPLETED|FAILED) break ;; esac
    sleep 0.5
  done
  echo "$id: $(state "$id") after scancel"
  scontrol requeue "$id"
  echo "$id: requeued ($(state "$id"))"
}
t3=$(now)
kill_one "$(job calibrate)" 1
kill_one "$(job quant)" 2
for _ in $(seq 3600); do
  [ -z "$(squeue -h -u root)" ] && break
  sleep 1
done
[ -z "$(squeue -h -u root)" ] || { echo "the pipeline did not finish: $(squeue)" >&2; exit 1; }
t4=$(now)

# What Slurm recorded of each job.
scontrol show job "$(job calibrate)" > "$WORK/log/calibrate-jobs.txt"
scontrol show job "$(job quant)" > "$WORK/log/quant-jobs.txt"
scontrol show job "$(job finalize)" > "$WORK/log/finalize-job.txt"
scontrol show job "$(job quant_join)" > "$WORK/log/quant-join-job.txt"

python3 - "$WORK" "$OUT_JSON" "$N" "$FORMAT" "$t0" "$t1" "$t2" "$t3" "$t4" "$(sinfo -V)" "$(git rev-parse HEAD)" <<'PY'
import hashlib, json, os, re, sys
work, out, n, fmt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t0, t1, t2, t3, t4 = map(float, sys.argv[5:10])
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()
def jobs(name):
    text = open(os.path.join(work, "log", name)).read()
    out = []
    for block in text.strip().split("\n\n"):
        f = dict(re.findall(r"(\w+)=(\S+)", block))
        out.append({k: f.get(k) for k in ("JobId", "ArrayJobId", "ArrayTaskId", "JobName", "JobState", "ExitCode", "Restarts", "RunTime")})
    return out
files = []
for rel in ["run/imatrix.safetensors", "run/reap-stats.safetensors"]:
    files.append((rel, os.path.join(work, "ref", rel), os.path.join(work, "shared", rel)))
qref = os.path.join(work, "ref", "q")
qs = os.path.join(work, "shared", "q")
names = sorted(set(os.listdir(qref)) | set(os.listdir(qs)))
for name in names:
    files.append(("q/" + name, os.path.join(qref, name), os.path.join(qs, name)))
rows, identical = [], True
for rel, a, b in files:
    ha = sha(a) if os.path.isfile(a) else None
    hb = sha(b) if os.path.isfile(b) else None
    same = ha is not None and ha == hb
    identical &= same
    rows.append({"file": rel, "unsharded_sha256": ha, "slurm_sha256": hb, "identical": same})
cal, q = jobs("calibrate-jobs.txt"), jobs("quant-jobs.txt")
restarted = [j for j in cal + q if j["Restarts"] not in (None, "0")]
ok = identical and len(restarted) == 2 and all(j["JobState"] == "COMPLETED" for j in cal + q)
doc = {
    "format": "keep-slurm-test", "version": 1,
    "command": "dev/slurm-test.sh",
    "keep_commit": sys.argv[11], "slurm": sys.argv[10],
    "machine": {"cpus": os.cpu_count(), "loadavg_end": open("/proc/loadavg").read().split()[:3]},
    "tasks": n, "format_quantized": fmt,
    "seconds": {"unsharded_calibrate_finalize": t1 - t0, "unsharded_quant": t2 - t1, "slurm_pipeline": t4 - t3},
    "cancelled_and_requeued": restarted,
    "jobs": {"calibrate": cal, "finalize": jobs("finalize-job.txt"), "quant": q, "quant_join": jobs("quant-join-job.txt")},
    "files": rows, "files_compared": len(rows), "identical": identical,
    "rule": "PASS if every finalized calibration file and every file of the quantized model is byte-identical to the unsharded run's, exactly the two cancelled tasks were requeued (Restarts > 0), and every array task completed",
    "verdict": "PASS" if ok else "FAIL",
}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
os.replace(tmp, out)
print(f"{doc['verdict']}: {sum(r['identical'] for r in rows)}/{len(rows)} files byte-identical, "
      f"{len(restarted)} tasks requeued; evidence {out}")
sys.exit(0 if ok else 1)
PY
