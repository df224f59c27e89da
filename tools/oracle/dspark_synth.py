#!/usr/bin/env python3
"""A random, small DeepSeek-V4.1 DSpark module under the published tensor names, for keep's
oracle and fixtures (tools/oracle/dspark_ref.py reads it; docs/dspark.md lists the names).

The shapes are deliberately odd and mutually distinct (hidden 22, 4 heads of 10 in 2 output
groups, 4 rotary channels, q rank 9, o rank 7, 3 streams, 5 experts of width 13 with 2 active,
Markov rank 6, vocabulary 41, a 6-row window), so a transposed or mis-sliced weight cannot go
unnoticed. Every tensor is float32: the fixture is exact, and FP8 decoding is covered elsewhere.
A `config.json` in V4.1 form (window-only layers, the three draft layers at the end of
`compress_ratios`) is written beside `model.safetensors`; the main model itself is not written,
only the shared `embed.weight` and `head.weight` the drafter uses.

Usage: dspark_synth.py DIR [--seed N]
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

SHAPE = {
    "vocab_size": 41,
    "hidden_size": 22,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 10,
    "qk_rope_head_dim": 4,
    "q_lora_rank": 9,
    "o_lora_rank": 7,
    "o_groups": 2,
    "moe_intermediate_size": 13,
    "n_routed_experts": 6,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 0.9,
    "rms_norm_eps": 1e-6,
    "hc_mult": 3,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": 6,
    "compress_ratios": [0] * 10,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 40,
    "dspark_target_layer_ids": [3, 4, 6],
    "dspark_markov_rank": 6,
    "dspark_n_routed_experts": 5,
    "dspark_num_experts_per_tok": 2,
}


def tensors(c, rng):
    """Every tensor DSpark reads, float32, under the published names."""
    f = lambda *s, std=0.3: (rng.standard_normal(s) * std).astype(np.float32)  # noqa: E731
    ones = lambda n: (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)  # noqa: E731
    d, V, H, hd = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["head_dim"]
    G, ol, ql, hc = c["o_groups"], c["o_lora_rank"], c["q_lora_rank"], c["hc_mult"]
    inter, E, R = c["moe_intermediate_size"], c["dspark_n_routed_experts"], c["dspark_markov_rank"]
    nm = (2 + hc) * hc
    T = {"embed.weight": f(V, d, std=1.0), "head.weight": f(V, d)}
    n = c["num_nextn_predict_layers"]
    for k in range(n):
        p = f"mtp.{k}."
        T.update({
            p + "attn_norm.weight": ones(d), p + "ffn_norm.weight": ones(d),
            p + "attn.wq_a.weight": f(ql, d), p + "attn.q_norm.weight": ones(ql),
            p + "attn.wq_b.weight": f(H * hd, ql), p + "attn.wkv.weight": f(hd, d),
            p + "attn.kv_norm.weight": ones(hd), p + "attn.wo_a.weight": f(G * ol, H * hd // G),
            p + "attn.wo_b.weight": f(d, G * ol), p + "attn.attn_sink": f(H, std=1.0),
            p + "ffn.gate.weight": f(E, d), p + "ffn.gate.bias": f(E, std=0.1),
        })
        for site in ("attn", "ffn"):
            T[f"{p}hc_{site}_fn"] = f(nm, hc * d, std=0.1)
            T[f"{p}hc_{site}_base"] = f(nm, std=0.5)
            T[f"{p}hc_{site}_scale"] = (0.5 + rng.random(3)).astype(np.float32)
        for e in [f"experts.{e}" for e in range(E)] + ["shared_experts"]:
            T[f"{p}ffn.{e}.w1.weight"] = f(inter, d)
            T[f"{p}ffn.{e}.w3.weight"] = f(inter, d)
            T[f"{p}ffn.{e}.w2.weight"] = f(d, inter)
    T["mtp.0.main_proj.weight"] = f(d, d * len(c["dspark_target_layer_ids"]))
    T["mtp.0.main_norm.weight"] = ones(d)
    last = f"mtp.{n - 1}."
    T[last + "norm.weight"] = ones(d)
    T[last + "markov_head.embed.weight"] = f(V, R, std=1.0)
    T[last + "markov_head.head.weight"] = f(V, R)
    T[last + "confidence_head.proj.weight"] = f(1, d + R)
    return T


def write_checkpoint(dest: Path, seed: int = 0, shape=None):
    """config.json + model.safetensors in DEST (created); returns the config dict."""
    c = dict(SHAPE if shape is None else shape)
    c.update({"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "torch_dtype": "float32"})
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(c, indent=1) + "\n")
    save_file(tensors(c, np.random.default_rng(seed)), str(dest / "model.safetensors"))
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    write_checkpoint(a.dir, a.seed)
    print(f"wrote a DSpark module to {a.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
