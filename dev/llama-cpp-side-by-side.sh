#!/usr/bin/env bash
# llama.cpp's CPU matmul kernels side by side with keep's, one thread each, same shapes, one run.
#
# Builds llama.cpp's CPU backend (ggml-base + ggml-cpu, GGML_NATIVE=ON) and its
# `test-backend-ops` from the sources vendored in the llama-cpp-python source distribution
# (pinned below, checked by sha256), with MUL_MAT perf cases added at keep's shapes (the
# harness is unchanged otherwise; the kernels are llama.cpp's own). Then, for ROUNDS rounds,
# alternates per format: `test-backend-ops perf -o MUL_MAT` (one thread: it uses half the
# hardware threads) and `keep bench matmul --threads 1` at the same shapes and M = 1, 8, 32.
#
#   llama.cpp mxfp4   vs keep MXFP4  (fast: int8 dots)       2304x5120 and 5120x2304 (routed expert)
#   llama.cpp iq2_xxs vs keep E8P    (fast: int8 dots)       the same two shapes
#   llama.cpp q8_0    vs keep affine-8 (fast) and MXFP8 (exact, fast)   4096x4096 (resident)
#   llama.cpp bf16    vs keep bf16   (exact, fast)           4096x4096
#
# Both sides time the same weight over and over (test-backend-ops repeats one node in a graph
# for >= 1 s; keep bench matmul does the same), so the weight sits in the last-level cache:
# this compares kernels per thread, not memory bandwidth. Every time is converted to the
# same unit: weight bytes of that side's own format per second (ggml_nbytes of the weight
# divided by its us/run; keep's packed bytes divided by its seconds per call), and the speed
# ratio is llama.cpp's time / keep's time at the same shape and M.
#
# Usage: dev/llama-cpp-side-by-side.sh [ROUNDS] [OUT.json]
#   ROUNDS default 3; OUT default dev/evidence/llama-cpp-side-by-side.json (refused if it
#   exists unless FORCE=1). Work dir: $LLAMA_SIDE_DIR (default /tmp/keep-llama-cpp); the
#   build is reused when present. KEEP defaults to target/release/keep (built if missing).
#   ONLY=mxfp4,iq2_xxs,q8_0,bf16 limits the formats; MS="1 8 32" the M values.
# Not part of .ci/run: it downloads ~77 MB and compiles for several minutes.
set -euo pipefail

ROUNDS="${1:-3}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${2:-$REPO/dev/evidence/llama-cpp-side-by-side.json}"
W="${LLAMA_SIDE_DIR:-/tmp/keep-llama-cpp}"
KEEP="${KEEP:-$REPO/target/release/keep}"
ONLY="${ONLY:-mxfp4,iq2_xxs,q8_0,bf16}"
MS="${MS:-1 8 32}"

# Pins.
LCP_VERSION=0.3.36
LCP_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LCP_URL="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${LCP_VERSION}.tar.gz"
CMAKE_PIN=4.2.1

if [[ -e "$OUT" && "${FORCE:-0}" != 1 && "${BUILD_ONLY:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2
  exit 1
fi
mkdir -p "$W"
SRC="$W/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"

# --- sources -------------------------------------------------------------------------------
# The sdist is fetched as a file and checked against its published sha256. (`pip download
# --no-binary :all:` would also build the package's metadata, which builds CMake from source.)
if [[ ! -d "$SRC/ggml" ]]; then
  tgz="$W/llama_cpp_python-$LCP_VERSION.tar.gz"
  if [[ ! -f "$tgz" ]]; then
    curl -sSL -o "$tgz.part" "$LCP_URL"
    mv "$tgz.part" "$tgz"
  fi
  echo "$LCP_SHA256  $tgz" | sha256sum -c - >&2
  tar -C "$W" -xzf "$tgz"
fi
# The commit llama-cpp-python vendors: its changelog entry for this version (and the
# submodule HEAD the sdist carries, when it does).
LLAMA_COMMIT_CHANGELOG="$(awk -v v="## [$LCP_VERSION]" '$0==v{f=1;next} f&&/^## /{exit} f&&/llama.cpp@/{sub(/.*llama.cpp@/,"");print;exit}' "$W/llama_cpp_python-$LCP_VERSION/CHANGELOG.md")"
LLAMA_COMMIT_HEAD="$(cat "$W/llama_cpp_python-$LCP_VERSION/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || true)"

# --- cmake ---------------------------------------------------------------------------------
CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]]; then
  if [[ ! -x "$W/venv/bin/cmake" ]]; then
    python3 -m venv "$W/venv"
    "$W/venv/bin/pip" install -q --only-binary :all: "cmake==$CMAKE_PIN"
  fi
  CMAKE="$W/venv/bin/cmake"
fi

# --- the perf cases at keep's shapes ---------------------------------------------------------
# (type, out rows m, in cols k); n = M tokens.
CASES=()
for t in mxfp4 iq2_xxs; do CASES+=("$t 2304 5120" "$t 5120 2304"); done
for t in q8_0 bf16; do CASES+=("$t 4096 4096"); done
ggml_type() { case "$1" in mxfp4) echo MXFP4;; iq2_xxs) echo IQ2_XXS;; q8_0) echo Q8_0;; bf16) echo BF16;; esac; }

B="$W/side"
mkdir -p "$B"
{
  echo "    // keep side by side: MUL_MAT at keep's shapes"
  for c in "${CASES[@]}"; do
    read -r t m k <<<"$c"
    for n in 1 4 8 32; do
      echo "    test_cases.emplace_back(new test_mul_mat(GGML_TYPE_$(ggml_type "$t"), GGML_TYPE_F32, $m, $n, $k, {1, 1}, {1, 1}));"
    done
  done
} >"$B/cases.inc.new"
# Insert the cases at the top of make_test_cases_perf() in a copy of the harness.
awk -v inc="$B/cases.inc.new" '
  { print }
  /^static std::vector<std::unique_ptr<test_case>> make_test_cases_perf\(\) \{/ { want=1; next }
  want && /std::vector<std::unique_ptr<test_case>> test_cases;/ {
    while ((getline line < inc) > 0) print line; want=0; done=1 }
  END { if (!done) exit 3 }' "$SRC/tests/test-backend-ops.cpp" >"$B/test-backend-ops.cpp.new"
if ! cmp -s "$B/test-backend-ops.cpp.new" "$B/test-backend-ops.cpp" 2>/dev/null; then
  mv "$B/test-backend-ops.cpp.new" "$B/test-backend-ops.cpp"
fi
cat >"$B/CMakeLists.txt" <<CM
cmake_minimum_required(VERSION 3.14)
project(keep_llama_side C CXX)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
add_subdirectory("$SRC/ggml" ggml)
add_executable(test-backend-ops test-backend-ops.cpp)
target_link_libraries(test-backend-ops PRIVATE ggml)
CM

# --- build (ggml-base + ggml-cpu + the harness only) -----------------------------------------
if [[ ! -f "$B/build/CMakeCache.txt" ]]; then
  nice -n 10 "$CMAKE" -S "$B" -B "$B/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF >"$B/configure.log"
fi
nice -n 10 "$CMAKE" --build "$B/build" --target test-backend-ops -j "$(nproc)" >"$B/build.log"
TBO="$B/build/test-backend-ops"
[[ -x "$TBO" ]] || { echo "no $TBO (see $B/build.log)" >&2; exit 1; }
if [[ "${BUILD_ONLY:-0}" == 1 ]]; then echo "built $TBO"; exit 0; fi

# --- keep ------------------------------------------------------------------------------------
if [[ ! -x "$KEEP" ]]; then
  (cd "$REPO" && nice -n 10 cargo build --release -p keep-cli >&2)
fi

RAW="$W/raw.$$"
rm -rf "$RAW"; mkdir -p "$RAW"
load1() { cut -d' ' -f1 /proc/loadavg; }
ms_csv="$(echo $MS | tr ' ' ',')"
ms_re="$(echo $MS | tr ' ' '|')"

# One llama.cpp step: all of a format's cases in one test-backend-ops run.
llama_step() { # fmt round
  local t="$1" r="$2" shapes
  case "$t" in mxfp4|iq2_xxs) shapes='m=2304,n=('"$ms_re"'),k=5120|m=5120,n=('"$ms_re"'),k=2304';;
               *) shapes='m=4096,n=('"$ms_re"'),k=4096';; esac
  echo "llama $r $t load $(load1)" >>"$RAW/steps.log"
  "$TBO" perf -o MUL_MAT -b CPU -p "^type_a=$t,type_b=f32,($shapes),bs=\[1,1\],nr=\[1,1\],per=\[0,1,2,3\],k_v=0,o=1," \
    | sed 's/\x1b\[[0-9;]*m//g' | grep 'us/run' \
    | sed "s/^/round=$r load=$(load1) /" >>"$RAW/llama.txt"
}
# One keep step: the matching keep formats at the same shapes, one thread.
keep_step() { # fmt round
  local t="$1" r="$2" args
  case "$t" in
    mxfp4)   args=(--format mxfp4 --shape 2304x5120,5120x2304 --kernels fast,exact);;
    iq2_xxs) args=(--format e8p --shape 2304x5120,5120x2304 --kernels fast,exact);;
    q8_0)    args=(--format affine8,mxfp8 --shape 4096x4096 --kernels fast,exact);;
    bf16)    args=(--format bf16 --shape 4096x4096 --kernels fast,exact);;
  esac
  echo "keep $r $t load $(load1)" >>"$RAW/steps.log"
  "$KEEP" bench matmul "${args[@]}" --m "$ms_csv" --threads 1 --seconds 1 --json \
    | sed "s/^{/{\"round\":$r,\"pair\":\"$t\",\"load_before\":$(load1),/" >>"$RAW/keep.jsonl"
}

IFS=',' read -r -a FMTS <<<"$ONLY"
START="$(date -u +%FT%TZ)"
echo "start: $(uptime)" >>"$RAW/steps.log"
for ((r = 1; r <= ROUNDS; r++)); do
  for t in "${FMTS[@]}"; do
    # Alternate which side goes first, round by round.
    if (( r % 2 )); then llama_step "$t" "$r"; keep_step "$t" "$r"
    else keep_step "$t" "$r"; llama_step "$t" "$r"; fi
    echo "round $r $t done (load $(load1))" >&2
  done
done

echo "end: $(uptime)" >>"$RAW/steps.log"

# --- evidence --------------------------------------------------------------------------------
python3 - "$RAW" "$OUT.part" <<PY
import json, re, statistics, subprocess, sys
raw, out = sys.argv[1], sys.argv[2]
def sh(c):
    try: return subprocess.run(c, shell=True, capture_output=True, text=True).stdout.strip()
    except Exception: return None
# ggml block sizes and bytes per block (ggml-common.h): weight bytes of llama.cpp's own format.
GGML = {"mxfp4": (32, 17), "iq2_xxs": (256, 66), "q8_0": (32, 34), "bf16": (1, 2)}
KEEP_OF = {"mxfp4": ["mxfp4"], "iq2_xxs": ["e8p"], "q8_0": ["affine8", "mxfp8"], "bf16": ["bf16"]}
pat = re.compile(r"round=(\d+) load=([\d.]+)\s+MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+),.*?\):\s+(\d+) runs -\s+([\d.]+) us/run")
llama = {}
for line in open(f"{raw}/llama.txt"):
    g = pat.search(line)
    if not g: continue
    r, load, t, m, n, k, runs, us = g.groups()
    llama.setdefault((t, int(m), int(k), int(n)), []).append({"round": int(r), "load_after": float(load), "runs": int(runs), "us_per_run": float(us)})
keep = {}
for line in open(f"{raw}/keep.jsonl"):
    d = json.loads(line)
    keep.setdefault((d["pair"], d["format"], d["kernels"], d["rows"], d["cols"], d["m"]), []).append(d)
med = statistics.median
rows = []
for (t, m, k, n), ls in sorted(llama.items()):
    blk, bpb = GGML[t]
    lbytes = m * k // blk * bpb
    l_us = med(x["us_per_run"] for x in ls)
    base = {"llama_type": t, "out_rows": m, "in_cols": k, "m_tokens": n,
            "llama_weight_bytes": lbytes, "llama_us_per_run": [x["us_per_run"] for x in ls],
            "llama_runs": [x["runs"] for x in ls], "llama_us_median": l_us,
            "llama_weight_gbps": lbytes / 1e3 / l_us, "llama_gflops": 2 * m * k * n / 1e3 / l_us}
    for f in KEEP_OF[t]:
        for kern in ("fast", "exact"):
            ks = keep.get((t, f, kern, m, k, n))
            if not ks: continue
            k_us = med(x["us_per_call"] for x in ks)
            rows.append(dict(base, keep_format=f, keep_kernels=kern,
                keep_weight_bytes=ks[0]["weight_bytes"],
                keep_us_per_call=[x["us_per_call"] for x in ks], keep_us_median=k_us,
                keep_weight_gbps=ks[0]["weight_bytes"] / 1e3 / k_us,
                keep_gflops=2 * m * k * n / 1e3 / k_us,
                keep_levels={"simd": ks[0]["simd_level"], "int": ks[0]["int_level"], "bf": ks[0]["bf_level"]},
                speed_ratio_keep_over_llama=l_us / k_us,
                per_round_ratio=[a["us_per_run"] / b["us_per_call"] for a, b in zip(sorted(ls, key=lambda x: x["round"]), sorted(ks, key=lambda x: x["round"]))],
                keep_load_before=[x["load_before"] for x in ks], llama_load_after=[x["load_after"] for x in ls]))
            rows[-1]["per_round_ratio_median"] = med(rows[-1]["per_round_ratio"])
lscpu = sh("lscpu")
model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), None)
flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
ev = {
  "bench": "llama-cpp-side-by-side", "schema_version": 1,
  "command": "dev/llama-cpp-side-by-side.sh ${ROUNDS} (ONLY=${ONLY} MS='${MS}')",
  "started": "${START}", "finished": sh("date -u +%FT%TZ"),
  "rounds": ${ROUNDS},
  "machine": {"lscpu_model": model, "cores": sh("nproc"),
              "isa_flags": [f for f in flags if f.startswith(("avx512", "avx2", "avx_vnni", "amx", "fma"))],
              "l3": next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("L3")), None),
              },
  "loads_per_step": open(f"{raw}/steps.log").read().splitlines(),
  "llama_cpp": {"source": "llama-cpp-python ${LCP_VERSION} sdist (PyPI), vendor/llama.cpp, sha256 ${LCP_SHA256}",
                "commit_changelog": "${LLAMA_COMMIT_CHANGELOG}", "commit_submodule_head": "${LLAMA_COMMIT_HEAD}",
                "build": "ggml-base + ggml-cpu + test-backend-ops, CMAKE_BUILD_TYPE=Release GGML_NATIVE=ON, static",
                "cmake": sh("'${CMAKE}' --version | head -1"), "compiler": sh("c++ --version | head -1"),
                "harness": "test-backend-ops perf -o MUL_MAT -b CPU (one thread: half the hardware threads); MUL_MAT(type_a, f32) cases at keep's shapes added to make_test_cases_perf, bs=[1,1] nr=[1,1]"},
  "keep": {"commit": sh("git -C '${REPO}' rev-parse HEAD"), "dirty": bool(sh("git -C '${REPO}' status --porcelain --untracked-files=no")),
           "harness": "keep bench matmul --threads 1 --seconds 1 (same weight every call, one warm-up call)"},
  "units": "us per call of one product out[M x rows] = x[M x cols] . W^T, both sides on one thread with the weight cache-resident (the same weight every call); weight_gbps = that side's own packed weight bytes (codes + scales) / time of one call, 1e9 bytes; speed_ratio_keep_over_llama = median llama us / median keep us (same shape and M, >1 means keep is faster); per_round_ratio = llama us / keep us of each round (the two steps of a round ran back to back), per_round_ratio_median its median",
  "rows": rows,
}
json.dump(ev, open(out, "w"), indent=1)
print(f"{'llama':>8} {'keep':>8} {'kern':>5} {'shape':>10} {'M':>3} {'llama GB/s':>10} {'keep GB/s':>10} {'keep/llama speed':>16} {'paired median':>13}")
for x in rows:
    print(f"{x['llama_type']:>8} {x['keep_format']:>8} {x['keep_kernels']:>5} {str(x['out_rows'])+'x'+str(x['in_cols']):>10} {x['m_tokens']:>3} {x['llama_weight_gbps']:>10.2f} {x['keep_weight_gbps']:>10.2f} {x['speed_ratio_keep_over_llama']:>16.2f} {x['per_round_ratio_median']:>13.2f}")
PY
mv "$OUT.part" "$OUT"
echo "evidence: $OUT (raw steps in $RAW)" >&2
