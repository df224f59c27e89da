#!/usr/bin/env bash
# Submit keep's preparation pipeline to Slurm as array jobs on a shared filesystem:
#   calibration array (N tasks) → finalize (afterany) → quantization array (N tasks, afterok)
#   → join (afterany); with TEACHER set, the eval split as an array too → its completion
#   (afterany) → keep eval of the quantized model (afterok of both).
# Every step resumes: a requeued or preempted task redoes only its unfinished part, and the
# afterany steps finish whatever a cancelled task left, so the outputs equal an unsharded run's.
#
# Usage: RUN=/shared/run OUT=/shared/model-e8p2 [MODEL=/shared/V4.1-Flash] [PACK=/shared/pack]
#        [FORMAT=e8p2] [N=8] [TEACHER=/shared/teacher EVAL_JSON=/shared/eval.json]
#        [KEEP=/path/to/keep] [SBATCH_ARGS="--partition=cpu --mem=..."] deploy/slurm/submit.sh
# Prints the job ids, one `name=id` per line.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${RUN:?RUN is required}" "${OUT:?OUT is required}"
N="${N:-4}"
KEEP="$(command -v "${KEEP:-keep}")" || { echo "keep not found (set KEEP)" >&2; exit 1; }
export KEEP RUN OUT MODEL="${MODEL:-}" PACK="${PACK:-}" FORMAT="${FORMAT:-e8p2}"
sb() { sbatch --parsable --export=ALL ${SBATCH_ARGS:-} "$@"; }
cal=$(SPLIT=calibration sb --array=0-$((N - 1)) "$here/calibrate.sbatch")
fin=$(SPLIT=calibration sb --dependency=afterany:"$cal" "$here/finalize.sbatch")
qa=$(sb --array=0-$((N - 1)) --dependency=afterok:"$fin" "$here/quant.sbatch")
qj=$(sb --dependency=afterany:"$qa" "$here/quant-join.sbatch")
echo "calibrate=$cal"; echo "finalize=$fin"; echo "quant=$qa"; echo "quant_join=$qj"
if [ -n "${TEACHER:-}" ]; then
  : "${EVAL_JSON:?EVAL_JSON is required with TEACHER}"
  export TEACHER EVAL_JSON
  ta=$(RUN="$TEACHER" SPLIT=eval sb --array=0-$((N - 1)) "$here/calibrate.sbatch")
  tf=$(RUN="$TEACHER" SPLIT=eval sb --dependency=afterany:"$ta" "$here/finalize.sbatch")
  ev=$(sb --dependency=afterok:"$tf":"$qj" "$here/eval.sbatch")
  echo "teacher=$ta"; echo "teacher_finish=$tf"; echo "eval=$ev"
fi
