#!/usr/bin/env bash
# Reduced-rank sidecars on a flash-shaped model: `keep synth` of DeepSeek-V4.1-Flash's real
# layer shapes (hidden 5120, 64 heads of 512, 16 routed experts of 2304 top-6, one shared
# expert, hc_mult 4; a sliding-window layer and a compress-4 layer with the indexer: the `flash`
# preset cut to 2 layers) with random weights, calibrated on the first 22 lines of 12 CPython
# standard-library files (a pack of 2,838 tokens by the bundled tokenizer, 2 groups held out),
# then `dev/sidecar-quality.sh` at 50% kept (8 of 16 experts). The model is random: this
# measures what a linear low-rank map recovers of removed experts at flash's width, not what
# it recovers on a trained model. About an hour on 2 cores (the model runs at about 13 tokens/s
# under calibration; one sidecar fit takes about 18 minutes).
#
# Usage: dev/sidecar-flash.sh WORKDIR [OUT.json]   (OUT default
#   dev/evidence/sidecar-quality-flash-2-layers.json; TOKENS default 2048, RANKS "8 32")
set -euo pipefail
cd "$(dirname "$0")/.."
W="$(realpath -m "${1:?usage: dev/sidecar-flash.sh WORKDIR [OUT.json]}")"
OUT="${2:-dev/evidence/sidecar-quality-flash-2-layers.json}"
K="${KEEP:-$(pwd)/target/release/keep}"
STDLIB="${STDLIB:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')}"
mkdir -p "$W"
cat > "$W/config.json" <<'JSON'
{
  "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
  "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 2,
  "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
  "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
  "moe_intermediate_size": 2304, "n_routed_experts": 16, "n_shared_experts": 1,
  "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": true,
  "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
  "sliding_window": 128, "compress_ratios": [0, 4],
  "kv_source_layer_ids": [1], "index_source_layer_ids": [1], "candidate_source_layer_id": -1,
  "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
  "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
  "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
  "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                          "weight_block_size": [32, 32]}
}
JSON
[ -f "$W/flash-2-layers/config.json" ] || $K synth --config "$W/config.json" --out "$W/flash-2-layers" >/dev/null
if [ ! -f "$W/pack/pack.json" ]; then
  mkdir -p "$W/src"
  for f in bisect colorsys keyword fnmatch sched stat genericpath heapq glob shlex textwrap queue; do
    head -22 "$STDLIB/$f.py" > "$W/src/$f.py"
  done
  $K pack --from "$W/src" --out "$W/pack" --max-tokens 256 --held-out-frac 0.3 --seed 4 >/dev/null
fi
MODEL="$W/flash-2-layers" PACK="$W/pack" LEVELS="${LEVELS:-50}" TOKENS="${TOKENS:-2048}" RANKS="${RANKS:-8 32}" \
  dev/sidecar-quality.sh "$W/run" "$OUT"
