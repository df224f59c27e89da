#!/usr/bin/env bash
# Qwen3-MoE decode and prefill, keep against llama.cpp on the same checkpoint, same threads,
# interleaved rounds, one run.
#
# 1. llama.cpp's sources come from the pinned, sha256-checked llama-cpp-python sdist that
#    dev/llama-cpp-side-by-side.sh fetches (run with BUILD_ONLY=1); `llama-bench` and
#    `llama-quantize` are built from them (CPU backend, GGML_NATIVE=ON).
# 2. `keep synth --family qwen3_moe --preset qwen3-30b-a3b --layers LAYERS` writes random
#    weights at Qwen3-30B-A3B's real shapes (hidden 2048, 128 experts, top-8, moe_inter 768,
#    32 heads / 4 KV heads, vocab 151936), as bf16, in Qwen's FP8 layout and as MLX 4-bit; keep runs
#    the FP8 one with its residents repacked to MXFP8 (`keep repack`, lossless; the routed
#    experts stay in Qwen's 128x128 FP8 blocks).
# 3. llama.cpp's own converter (`convert_hf_to_gguf.py`) turns the bf16 checkpoint into a bf16
#    GGUF; `llama-quantize` makes q8_0 from it. The synthetic checkpoint carries the bundled
#    model's tokenizer, whose pre-tokenizer llama.cpp does not know; the converter is run with
#    that one check answered "qwen2" (the vocabulary plays no part in the timings).
# 4. ROUNDS rounds, interleaved per pair: `llama-bench -t THREADS -p P -n N` (its own prompt
#    and generation timings), then `keep run --prompt-tokens P --max-tokens N --temperature 0
#    --kernels fast --threads THREADS --stats-json`. The files are read into the
#    page cache first (resident comparison: the whole model must fit in memory).
#    Each side reads the head in the same format: the q8_0 GGUF keeps a bf16 head
#    (`--output-tensor-type bf16`, as Qwen's FP8 release and keep read it), the q4_0 GGUF a q4_0
#    one (`--output-tensor-type q4_0`, as the MLX 4-bit checkpoint quantizes its head).
#    Pairs: bf16 vs keep bf16; q8_0 vs keep FP8 (8 bits per weight on both sides); q4_0 vs
#    keep on mlx-community's MLX affine 4-bit layout (`keep synth --format mlx4` of the same seed:
#    mlx-lm's quantization of the same bf16 weights, experts stacked in `switch_mlp`; 4.5 bits
#    per weight on both sides: q4_0 is 4 bits + an f16 scale per 32, MLX 4 bits + bf16 scale
#    and bias per 64).
# 5. OUT.json: command, machine, load averages, every round's tokens/s and the median ratios
#    keep / llama.cpp for prefill and decode.
#
# Usage: dev/qwen3-llama-cpp.sh [ROUNDS] [OUT.json]
#   LLAMA_AMX=1 builds llama.cpp with AMX where -march=native has it (default off; see below).
#   ROUNDS default 3; OUT default dev/evidence/qwen3-llama-cpp.json (refused if it exists unless
#   FORCE=1). LAYERS (default 4: about 5 GiB bf16 + 2.6 GiB per 8-bit and 1.4 GiB per 4-bit copy),
#   THREADS (1), P (64), N (32), PAIRS ("bf16 q8 q4"), KEEP (target/release/keep), PY (a Python
#   with torch, transformers, numpy, pyyaml, tqdm: default tools/oracle/.venv's).
#   KEEP_BASE=PATH runs a second keep build (say, the commit before a change) right after keep in
#   every round, on the same checkpoint and flags: its medians and the ratios keep / base and
#   base / llama.cpp are added to the pair (KEEP_BASE_COMMIT names it in the evidence).
#   LLAMA_DECODE_AT_PROMPT=1 times llama-bench's decode after a P-token context (`-d P`, two
#   llama-bench runs: prefill from position 0, then decode at depth P), as keep decodes after
#   its prompt; without it llama-bench generates from an empty context (recorded either way).
#   LLAMA_NO_REPACK=1 runs llama-bench a second time in every round with `--repack 0` (the
#   GGUF's blocks as stored, without the CPU backend's interleaved copy of q4_0/q8_0 weights):
#   its medians and the ratios keep / that and repack / no repack are added to the pair.
#   KEEP_FILES=1 keeps the checkpoints and GGUFs for the next run; PREPARE_ONLY=1 writes them and
#   stops (run the rounds later, on a quiet machine, with the same LAYERS/PAIRS). CONFIG=FILE synthesises that
#   Qwen3-MoE config.json instead of the preset (a quick check of the script at small shapes).
# Not part of .ci/run: it compiles llama.cpp for several minutes and writes several GiB.
set -euo pipefail

ROUNDS="${1:-3}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${2:-$REPO/dev/evidence/qwen3-llama-cpp.json}"
W="${LLAMA_SIDE_DIR:-/tmp/keep-llama-cpp}"
KEEP="${KEEP:-$REPO/target/release/keep}"
LAYERS="${LAYERS:-4}" THREADS="${THREADS:-1}" P="${P:-64}" N="${N:-32}"
PAIRS="${PAIRS:-bf16 q8 q4}"
PY="${PY:-$REPO/tools/oracle/.venv/bin/python}"
LCP_VERSION=0.3.36

if [[ -e "$OUT" && "${FORCE:-0}" != 1 && "${PREPARE_ONLY:-0}" != 1 ]]; then
  echo "refusing to replace $OUT (FORCE=1 to replace)" >&2
  exit 1
fi
[[ -x "$PY" ]] || { echo "no Python at $PY (set PY, or run .ci/run once to make tools/oracle/.venv)" >&2; exit 1; }
"$PY" -c 'import torch, transformers, numpy, yaml, tqdm' || {
  echo "$PY lacks torch/transformers/numpy/pyyaml/tqdm" >&2; exit 1; }

# --- llama.cpp -------------------------------------------------------------------------------
BUILD_ONLY=1 LLAMA_SIDE_DIR="$W" "$REPO/dev/llama-cpp-side-by-side.sh" >&2
SRC="$W/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp"
CMAKE="$(command -v cmake || echo "$W/venv/bin/cmake")"
# AMX: keep does not use it, and where a virtual machine lists the AMX flags without enabling the
# tile state (this project's machines), -march=native code faults on its first tile instruction.
# LLAMA_AMX=0 (the default) builds llama.cpp without it (-mno-amx-*); LLAMA_AMX=1 keeps
# -march=native's choice, for a machine where AMX runs. The evidence records which.
LLAMA_AMX="${LLAMA_AMX:-0}"
NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if [[ "$LLAMA_AMX" == 1 ]]; then B="$W/full"; FLAGS=(); else B="$W/full-noamx"; FLAGS=(-DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX"); fi
if [[ ! -f "$B/build/CMakeCache.txt" ]]; then
  mkdir -p "$B"
  nice -n 10 "$CMAKE" -S "$SRC" -B "$B/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF "${FLAGS[@]}" >"$B/configure.log"
fi
nice -n 10 "$CMAKE" --build "$B/build" --target llama-bench llama-quantize -j "$(nproc)" >"$B/build.log"
LB="$B/build/bin/llama-bench" LQ="$B/build/bin/llama-quantize"
[[ -x "$LB" && -x "$LQ" ]] || { echo "llama-bench/llama-quantize missing (see $B/build.log)" >&2; exit 1; }

# --- keep ------------------------------------------------------------------------------------
if [[ ! -x "$KEEP" ]]; then
  (cd "$REPO" && nice -n 10 cargo build --release -p keep-cli >&2)
fi

# --- checkpoints -----------------------------------------------------------------------------
SHAPE=(--preset qwen3-30b-a3b)
[[ -n "${CONFIG:-}" ]] && SHAPE=(--config "$CONFIG")
Q="$W/qwen3-L$LAYERS${CONFIG:+-$(basename "$CONFIG" .json)}"
mkdir -p "$Q"
# The bf16 checkpoint is the source of every GGUF: made only when the bf16 pair runs or a GGUF
# is missing (12 GB at 4 layers).
need_bf16=0
[[ " $PAIRS " == *" bf16 "* ]] && need_bf16=1
[[ " $PAIRS " == *" q8 "* && ! -f "$Q/q8_0.gguf" ]] && need_bf16=1
[[ " $PAIRS " == *" q4 "* && ! -f "$Q/q4_0.gguf" ]] && need_bf16=1
if [[ "$need_bf16" == 1 && ! -f "$Q/bf16/config.json" ]]; then
  "$KEEP" synth --family qwen3_moe "${SHAPE[@]}" --layers "$LAYERS" --format bf16 \
    --out "$Q/bf16" --force >&2
  cp "$REPO/models/keep-tiny/tokenizer.json" "$Q/bf16/"
  [[ -f "$REPO/models/keep-tiny/tokenizer_config.json" ]] && cp "$REPO/models/keep-tiny/tokenizer_config.json" "$Q/bf16/"
fi
if [[ "$need_bf16" == 1 && ! -f "$Q/bf16.gguf" ]]; then
  PYTHONPATH="$SRC/gguf-py:$SRC" nice -n 10 "$PY" - "$SRC" "$Q/bf16" "$Q/bf16.gguf" >&2 <<'PYEOF'
import runpy, sys
src, model, out = sys.argv[1:4]
sys.path.insert(0, src)
import conversion.base as base
# The synthetic checkpoint carries the bundled model's tokenizer; the converter only needs a
# known pre-tokenizer name for it.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "bf16", "--outfile", out + ".part"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
PYEOF
  mv "$Q/bf16.gguf.part" "$Q/bf16.gguf"
fi
if [[ " $PAIRS " == *" q8 "* ]]; then
  if [[ ! -f "$Q/q8_0.gguf" ]]; then
    nice -n 10 "$LQ" --output-tensor-type bf16 "$Q/bf16.gguf" "$Q/q8_0.gguf.part" Q8_0 "$(nproc)" \
      >"$Q/quantize.log" 2>&1
    mv "$Q/q8_0.gguf.part" "$Q/q8_0.gguf"
  fi
  if [[ ! -f "$Q/mxfp8/config.json" ]]; then
    "$KEEP" synth --family qwen3_moe "${SHAPE[@]}" --layers "$LAYERS" --format fp8 \
      --out "$Q/fp8" --force >&2
    "$KEEP" repack --resident-format mxfp8 "$Q/fp8" "$Q/mxfp8" --force >&2
    rm -rf "$Q/fp8"
  fi
fi

if [[ " $PAIRS " == *" q4 "* ]]; then
  if [[ ! -f "$Q/q4_0.gguf" ]]; then
    nice -n 10 "$LQ" --output-tensor-type q4_0 "$Q/bf16.gguf" "$Q/q4_0.gguf.part" Q4_0 "$(nproc)" \
      >"$Q/quantize-q4.log" 2>&1
    mv "$Q/q4_0.gguf.part" "$Q/q4_0.gguf"
  fi
  if [[ ! -f "$Q/mlx4/config.json" ]]; then
    "$KEEP" synth --family qwen3_moe "${SHAPE[@]}" --layers "$LAYERS" --format mlx4 \
      --out "$Q/mlx4" --force >&2
  fi
fi

if [[ "${PREPARE_ONLY:-0}" == 1 ]]; then
  echo "checkpoints and GGUFs ready under $Q" >&2
  exit 0
fi

# --- rounds ----------------------------------------------------------------------------------
RAW="$W/qwen3-raw.$$"
rm -rf "$RAW"; mkdir -p "$RAW"
load1() { cut -d' ' -f1 /proc/loadavg; }
page_in() { cat "$@" >/dev/null; cat "$@" >/dev/null; }
for r in $(seq 1 "$ROUNDS"); do
  for pair in $PAIRS; do
    case "$pair" in
      bf16) g="$Q/bf16.gguf"; k="$Q/bf16" ;;
      q8) g="$Q/q8_0.gguf"; k="$Q/mxfp8" ;;
      q4) g="$Q/q4_0.gguf"; k="$Q/mlx4" ;;
      *) echo "unknown pair $pair" >&2; exit 1 ;;
    esac
    page_in "$g"
    echo "$(load1)" >"$RAW/$pair-$r.llama.load"
    bench() { # OUT-STEM EXTRA-ARGS...: llama-bench's prefill and decode into OUT-STEM.json
      local stem=$1; shift
      if [[ "${LLAMA_DECODE_AT_PROMPT:-0}" == 1 ]]; then
        # Decode after a prompt of P tokens (-d P), as keep decodes; prefill from position 0.
        "$LB" -m "$g" -t "$THREADS" -p "$P" -n 0 -r 1 -o json "$@" >"$stem.pp.json" 2>"$stem.err"
        "$LB" -m "$g" -t "$THREADS" -p 0 -n "$N" -d "$P" -r 1 -o json "$@" >"$stem.tg.json" 2>>"$stem.err"
        python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1])) + json.load(open(sys.argv[2]))))' \
          "$stem.pp.json" "$stem.tg.json" >"$stem.json"
      else
        "$LB" -m "$g" -t "$THREADS" -p "$P" -n "$N" -r 1 -o json "$@" >"$stem.json" 2>"$stem.err"
      fi
    }
    bench "$RAW/$pair-$r.llama"
    if [[ "${LLAMA_NO_REPACK:-0}" == 1 ]]; then
      echo "$(load1)" >"$RAW/$pair-$r.llama0.load"
      bench "$RAW/$pair-$r.llama0" --repack 0
    fi
    page_in "$k"/*.safetensors
    echo "$(load1)" >"$RAW/$pair-$r.keep.load"
    "$KEEP" run "$k" --threads "$THREADS" --prompt-tokens "$P" --max-tokens "$N" \
      --temperature 0 --kernels fast --stats-json "$RAW/$pair-$r.keep.json" --force \
      >"$RAW/$pair-$r.keep.out" 2>&1
    if [[ -n "${KEEP_BASE:-}" ]]; then
      echo "$(load1)" >"$RAW/$pair-$r.base.load"
      "$KEEP_BASE" run "$k" --threads "$THREADS" --prompt-tokens "$P" --max-tokens "$N" \
        --temperature 0 --kernels fast --stats-json "$RAW/$pair-$r.base.json" --force \
        >"$RAW/$pair-$r.base.out" 2>&1
    fi
  done
done

BASE_DESC=""
if [[ -n "${KEEP_BASE:-}" ]]; then
  BASE_DESC="$("$KEEP_BASE" --version 2>/dev/null || true) ${KEEP_BASE_COMMIT:-}"
fi
LLAMA_BUILD="llama.cpp vendored in llama-cpp-python $LCP_VERSION; GGML_NATIVE=ON (-march=native), Release, static"
[[ "$LLAMA_AMX" == 1 ]] || LLAMA_BUILD="$LLAMA_BUILD, AMX off ($NOAMX)"
python3 - "$RAW" "$OUT" "$ROUNDS" "$PAIRS" "$LAYERS" "$THREADS" "$P" "$N" "$*" "${CONFIG:-qwen3-30b-a3b}" "$BASE_DESC" "$LLAMA_BUILD" <<'PYEOF'
import json, os, platform, statistics, subprocess, sys, time
raw, out, rounds, pairs, layers, threads, p, n, args, shape, base, llama_build = sys.argv[1:13]
rounds = int(rounds)
def lscpu():
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
res = {"format": "keep-side-by-side-qwen3", "version": 1,
       "command": f"dev/qwen3-llama-cpp.sh {args}".strip(),
       "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "machine": {"uname": platform.uname()._asdict(), "nproc": os.cpu_count(),
                   "lscpu_model": next((l.split(":", 1)[1].strip() for l in lscpu().splitlines()
                                        if l.startswith("Model name")), None)},
       "llama_build": llama_build,
       "llama_decode_context": (f"after {p} tokens (llama-bench -d {p})"
                                if os.environ.get("LLAMA_DECODE_AT_PROMPT") == "1"
                                else "from an empty context (llama-bench -n without -d)"),
       "shape": {"preset_or_config": shape, "layers": int(layers), "threads": int(threads),
                 "prompt_tokens": int(p), "decode_tokens": int(n)},
       "pairs": {}}
for pair in pairs.split():
    rows = []
    for r in range(1, rounds + 1):
        lj = json.load(open(f"{raw}/{pair}-{r}.llama.json"))
        pp = next(x for x in lj if x["n_prompt"] > 0)
        tg = next(x for x in lj if x["n_gen"] > 0)
        kj = json.load(open(f"{raw}/{pair}-{r}.keep.json"))
        extra = {}
        if os.path.exists(f"{raw}/{pair}-{r}.llama0.json"):
            l0 = json.load(open(f"{raw}/{pair}-{r}.llama0.json"))
            extra = {"llama_no_repack_load": float(open(f"{raw}/{pair}-{r}.llama0.load").read()),
                     "llama_no_repack_prefill_tps": next(x for x in l0 if x["n_prompt"] > 0)["avg_ts"],
                     "llama_no_repack_decode_tps": next(x for x in l0 if x["n_gen"] > 0)["avg_ts"]}
        if os.path.exists(f"{raw}/{pair}-{r}.base.json"):
            bj = json.load(open(f"{raw}/{pair}-{r}.base.json"))
            extra.update({"base_load": float(open(f"{raw}/{pair}-{r}.base.load").read()),
                          "base_prefill_tps": bj["prefill_tps"], "base_decode_tps": bj["decode_tps"]})
        rows.append({"round": r, **extra,
                     "llama_load": float(open(f"{raw}/{pair}-{r}.llama.load").read()),
                     "keep_load": float(open(f"{raw}/{pair}-{r}.keep.load").read()),
                     "llama_type": pp.get("model_type"),
                     "llama_prefill_tps": pp["avg_ts"], "llama_decode_tps": tg["avg_ts"],
                     "keep_prefill_tps": kj["prefill_tps"], "keep_decode_tps": kj["decode_tps"]})
    med = lambda key: statistics.median(x[key] for x in rows)
    res["pairs"][pair] = {
        "llama": {"bf16": "bf16 GGUF", "q8": "q8_0 GGUF", "q4": "q4_0 GGUF"}[pair],
        "keep": {"bf16": "bf16 (fast kernels)",
                 "q8": "Qwen FP8 128x128 experts, MXFP8 residents (fast kernels)",
                 "q4": "mlx-community MLX affine 4-bit, group 64, stacked switch_mlp experts "
                       "(fast kernels)"}[pair],
        "head": {"bf16": "bf16 on both sides",
                 "q8": "bf16 on both sides (Qwen's FP8 release ships a bf16 head; the GGUF is "
                       "quantized with --output-tensor-type bf16)",
                 "q4": "4.5 bits on both sides (MLX affine 4-bit head; the GGUF is quantized "
                       "with --output-tensor-type q4_0)"}[pair],
        "rounds": rows,
        "median": {k: med(k) for k in ("llama_prefill_tps", "llama_decode_tps",
                                        "keep_prefill_tps", "keep_decode_tps")},
        "ratio_keep_over_llama": {"prefill": med("keep_prefill_tps") / med("llama_prefill_tps"),
                                  "decode": med("keep_decode_tps") / med("llama_decode_tps")},
    }
    if all("llama_no_repack_decode_tps" in x for x in rows):
        v = res["pairs"][pair]
        v["llama_no_repack"] = ("llama-bench --repack 0: the GGUF's blocks as stored (by default "
                                "the CPU backend repacks q4_0/q8_0 weights into interleaved rows "
                                "for its GEMV/GEMM kernels)")
        for k in ("llama_no_repack_prefill_tps", "llama_no_repack_decode_tps"):
            v["median"][k] = med(k)
        v["ratio_keep_over_llama_no_repack"] = {
            "prefill": med("keep_prefill_tps") / med("llama_no_repack_prefill_tps"),
            "decode": med("keep_decode_tps") / med("llama_no_repack_decode_tps")}
        v["ratio_llama_repack_over_no_repack"] = {
            "prefill": med("llama_prefill_tps") / med("llama_no_repack_prefill_tps"),
            "decode": med("llama_decode_tps") / med("llama_no_repack_decode_tps")}
    if all("base_decode_tps" in x for x in rows):
        v = res["pairs"][pair]
        v["base"] = base.strip()
        for k in ("base_prefill_tps", "base_decode_tps"):
            v["median"][k] = med(k)
        v["ratio_keep_over_base"] = {"prefill": med("keep_prefill_tps") / med("base_prefill_tps"),
                                     "decode": med("keep_decode_tps") / med("base_decode_tps")}
        v["ratio_base_over_llama"] = {"prefill": med("base_prefill_tps") / med("llama_prefill_tps"),
                                      "decode": med("base_decode_tps") / med("llama_decode_tps")}
tmp = out + ".part"
with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
    f.write("\n")
os.replace(tmp, out)
for pair, v in res["pairs"].items():
    print(f"{pair}: keep/llama.cpp prefill {v['ratio_keep_over_llama']['prefill']:.2f}x "
          f"decode {v['ratio_keep_over_llama']['decode']:.2f}x  ({v['median']})")
PYEOF
[[ "${KEEP_FILES:-0}" == 1 ]] || rm -rf "$Q"
rm -rf "$RAW"
