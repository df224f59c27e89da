"""Random DeepSeek-V4.1 checkpoint in the published format, for keep-model's test data and conformance.

FP8 E4M3 residents with 32x32 E8M0 block scales (or, with `mxfp8`, the same bytes with one scale
per row and 32 columns, as `keep repack --resident-format mxfp8` writes), FP4 routed experts with
E8M0 scales per 32 inputs, f32 hyper-connections / sinks / router bias / compressor, bf16 elsewhere.
Independent of keep's own `keep synth` (numpy + ml_dtypes only), so the two can check each other.

Engram layers (when the overrides give `engram_layer_ids` and the engram shape keys): tables as
FP8 E4M3 rows with one E8M0 scale per 32 channels, `wkv` as the other FP8 residents, bf16
`q_weight`/`k_weight`; `engram_num_embeddings` (when not given) is the sum of each layer's bucket
primes plus 3 spare rows (tables may be larger than their buckets).

Usage: model_synth.py OUT_DIR SEED [fp8|mxfp8] [CONFIG_OVERRIDES_JSON]
The fixture in crates/keep-model/tests/data/ was made with the command in its README.
"""
import json, sys, os
import numpy as np, ml_dtypes
from safetensors.numpy import save_file

out = sys.argv[1]; seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
mx8 = len(sys.argv) > 3 and sys.argv[3] == "mxfp8"
cfgover = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
rng = np.random.default_rng(seed)
C = {
 "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
 "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
 "head_dim": 64, "q_lora_rank": 64, "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 32,
 "moe_intermediate_size": 64, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4,
 "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
 "swiglu_limit": 10.0, "rms_norm_eps": 1e-6, "sliding_window": 16,
 "compress_ratios": [0, 4, 1, 1, 2, 2, 2, 0], "kv_source_layer_ids": [1, 2, 4],
 "index_source_layer_ids": [1, 2, 4, 5], "candidate_source_layer_id": 4,
 "candidate_topk_blocks": 3, "candidate_block_size": 4, "index_n_heads": 4, "index_head_dim": 32,
 "index_topk": 6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rope_scaling": None,
 "max_position_embeddings": 4096, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
 "engram_layer_ids": [], "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False,
 "torch_dtype": "bfloat16",
 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
}
C.update(cfgover)
D = C["hidden_size"]; H = C["num_attention_heads"]; hd = C["head_dim"]; ql = C["q_lora_rank"]
G = C["o_groups"]; ol = C["o_lora_rank"]; I = C["moe_intermediate_size"]; E = C["n_routed_experts"]
hc = C["hc_mult"]; ih = C["index_n_heads"]; ihd = C["index_head_dim"]
T = {}
E4 = ml_dtypes.float8_e4m3fn
def bf16(w): return w.astype(ml_dtypes.bfloat16)
def fp8(name, w):
    o, i = w.shape
    bo, bi = -(-o // 32), -(-i // 32)
    sc = np.zeros((bo, bi), np.uint8); q = np.zeros_like(w)
    for a in range(bo):
        for b in range(bi):
            blk = w[a*32:(a+1)*32, b*32:(b+1)*32]
            amax = max(np.abs(blk).max(), 1e-30)
            e = int(np.ceil(np.log2(amax / 448.0)))
            sc[a, b] = e + 127
            q[a*32:(a+1)*32, b*32:(b+1)*32] = blk / 2.0**e
    T[name + ".weight"] = q.astype(E4)
    if mx8:
        T[name + ".scale"] = np.repeat(sc, 32, axis=0)[:o].view(ml_dtypes.float8_e8m0fnu)
    else:
        T[name + ".scale"] = sc.view(ml_dtypes.float8_e8m0fnu)
LUT = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
def fp4(name, w):
    o, i = w.shape
    g = w.reshape(o, i // 32, 32)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30)
    e = np.ceil(np.log2(amax / 6.0)).astype(np.int32)
    x = g / 2.0**e
    idx = np.abs(np.abs(x)[..., None] - LUT).argmin(-1)
    code = (idx | ((x < 0) & (idx > 0)) * 8).astype(np.uint8).reshape(o, i)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    T[name + ".weight"] = packed.view(np.int8)
    T[name + ".scale"] = (e[..., 0] + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
def n(*s, std=None):
    std = std if std is not None else 1.0 / np.sqrt(s[-1])
    return (rng.standard_normal(s) * std).astype(np.float32)
def norm(s): return bf16(1.0 + 0.1 * rng.standard_normal(s).astype(np.float32))
T["embed.weight"] = bf16(n(C["vocab_size"], D, std=1.0))
T["head.weight"] = bf16(n(C["vocab_size"], D))
T["norm.weight"] = norm(D)
ratios = C["compress_ratios"]
for L in range(C["num_hidden_layers"]):
    p = f"layers.{L}."
    T[p + "attn_norm.weight"] = norm(D); T[p + "ffn_norm.weight"] = norm(D)
    for k in ("attn", "ffn"):
        T[p + f"hc_{k}_fn"] = n((2 + hc) * hc, hc * D, std=0.5 / np.sqrt(hc * D))
        T[p + f"hc_{k}_base"] = n((2 + hc) * hc, std=0.5)
        T[p + f"hc_{k}_scale"] = (0.5 + rng.random(3)).astype(np.float32)
    fp8(p + "attn.wq_a", n(ql, D)); T[p + "attn.q_norm.weight"] = norm(ql)
    fp8(p + "attn.wq_b", n(H * hd, ql)); fp8(p + "attn.wkv", n(hd, D)); T[p + "attn.kv_norm.weight"] = norm(hd)
    fp8(p + "attn.wo_a", n(G * ol, H * hd // G)); fp8(p + "attn.wo_b", n(D, G * ol))
    T[p + "attn.attn_sink"] = n(H, std=1.0)
    r = ratios[L] if L < len(ratios) else 0
    if r and L in C["kv_source_layer_ids"]:
        T[p + "attn.compressor.wkv.weight"] = n(hd, D)
        if r > 1: T[p + "attn.compressor.wgate.weight"] = n(hd, D)
        T[p + "attn.compressor.norm.weight"] = norm(hd)
    if L in C["index_source_layer_ids"]:
        fp8(p + "attn.indexer.wq_b", n(ih * ihd, ql))
        T[p + "attn.indexer.weights_proj.weight"] = bf16(n(ih, D))
        if L in C["kv_source_layer_ids"]:
            T[p + "attn.indexer.wk.weight"] = bf16(n(ihd, hd)); T[p + "attn.indexer.k_norm.weight"] = norm(ihd)
    T[p + "ffn.gate.weight"] = bf16(n(E, D))
    T[p + "ffn.gate.bias"] = n(E, std=0.05)
    T[p + "ffn.gate.bias_vl"] = n(E, std=0.05)
    for e in range(E):
        fp4(p + f"ffn.experts.{e}.w1", n(I, D)); fp4(p + f"ffn.experts.{e}.w3", n(I, D)); fp4(p + f"ffn.experts.{e}.w2", n(D, I))
    fp8(p + "ffn.shared_experts.w1", n(I, D)); fp8(p + "ffn.shared_experts.w3", n(I, D)); fp8(p + "ffn.shared_experts.w2", n(D, I))
def is_prime(v):
    return v >= 2 and all(v % d for d in range(2, int(v ** 0.5) + 1))
if C["engram_layer_ids"]:
    NG, NH, EH = C["engram_max_ngram_size"], C["engram_n_heads"], C["engram_head_dim"]
    if "engram_num_embeddings" not in C:
        seen, rows = set(), []
        for _ in C["engram_layer_ids"]:
            tot = 0
            for _ in range(NG - 1):
                cur = C["engram_vocab_size"] - 1
                for _ in range(NH):
                    cur += 1
                    while not is_prime(cur) or cur in seen:
                        cur += 1
                    seen.add(cur); tot += cur
            rows.append(tot + 3)
        C["engram_num_embeddings"] = rows
    for k, L in enumerate(C["engram_layer_ids"]):
        p = f"layers.{L}.engram."
        R = C["engram_num_embeddings"][k]
        g = n(R, EH, std=1.0).reshape(R, EH // 32, 32)
        e = np.ceil(np.log2(np.maximum(np.abs(g).max(-1, keepdims=True), 1e-30) / 448.0))
        T[p + "embed.weight"] = (g / 2.0**e).reshape(R, EH).astype(E4)
        T[p + "embed.scale"] = (e[..., 0] + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
        fp8(p + "wkv", n((hc + 1) * D, (NG - 1) * NH * EH))
        T[p + "q_weight"] = norm((hc, D)); T[p + "k_weight"] = norm((hc, D))
os.makedirs(out, exist_ok=True)
save_file(T, os.path.join(out, "model.safetensors"))
json.dump(C, open(os.path.join(out, "config.json"), "w"), indent=1)
print("wrote", out, len(T), "tensors")
