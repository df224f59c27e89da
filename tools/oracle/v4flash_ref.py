#!/usr/bin/env python3
"""The reference forward pass of a DeepSeek-V4 / V4-Flash checkpoint in DeepSeek's published
format, through transformers 5.23.0's `DeepseekV4ForCausalLM` on CPU torch (float32).

The checkpoint (config.json + *.safetensors with DeepSeek's names: FP8 E4M3 residents with E8M0
or float32 power-of-two block scales, FP4 E2M1 routed experts with E8M0 scales per 32 inputs,
`ffn.gate.tid2eid` on hash-routed layers) is converted here, independently of keep: every weight
is dequantized to float32 from its definition (ml_dtypes for the element codes), renamed to
transformers' tree (the same renames as transformers' `conversion_mapping["deepseek_v4"]`,
written out one by one), experts stacked into `gate_up_proj` / `down_proj`, and loaded with
`load_state_dict(strict=True)` so that a missing or extra tensor fails. `mtp.*` tensors are
dropped (transformers does not build the MTP layers; neither does keep).

Config: `compress_ratios` become `layer_types` (0: sliding, 4: CSA, other: HCA) and
`compress_rates` (the HCA rate is the one non-4 ratio; transformers allows one per type);
`num_hash_layers` becomes `mlp_layer_types`; `rope_scaling` becomes the `compress` rope
(`attention_factor` 1, as transformers forces for V4); the `main` rope is plain `rope_theta`.
`n_routed_experts_per_layer` (keep prune leaving hash-routed layers whole) builds each layer
whose count differs as transformers' `DeepseekV4SparseMoeBlock` of that count.

Writes a safetensors file with

  tokens   int32  [T]             the input token ids
  logits   f32    [T, vocab]      one forward of all T tokens (no cache)
  routes   int32  [L, T, top_k]   (--routes) each layer's experts, sorted ascending
  route_weights f32 [L, T, top_k] (--routes) their gate weights (after routed scaling), same order
  greedy   int32  [N]             (--greedy N) N greedy tokens, each from a full forward (no cache)

Metadata: format=keep-model-ref, version=1, reference=transformers, command, versions.

Usage: v4flash_ref.py DIR --tokens 1,2,3 --out FILE.safetensors [--routes] [--greedy N]
                      [--save-hf DIR]   (also write the converted checkpoint transformers loads)
"""
import argparse
import copy
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdv4

BLOCK = (128, 128)  # set from quantization_config.weight_block_size in load()
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def read_all(d: Path):
    """Every tensor of the checkpoint as numpy, with its safetensors dtype."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            out[name] = (info["dtype"], info["shape"], raw[base + a:base + b])
    return out


def scale_f32(dtype, shape, buf):
    if dtype == "F8_E8M0":
        e = np.frombuffer(buf, np.uint8).astype(np.int32)
        if (e == 255).any():
            raise ValueError("NaN E8M0 scale")
        return np.ldexp(np.float32(1), e - 127).astype(np.float32).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(buf, np.float32).reshape(shape)
    raise ValueError(f"scale dtype {dtype}")


def dequant(T, name):
    """Weight `name` (`X.weight`) as float32, using `X.scale` when present."""
    dtype, shape, buf = T[name]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    sc = T.get(base + ".scale")
    if dtype == "F8_E4M3":
        q = np.frombuffer(buf, ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(shape)
        s = scale_f32(*sc)
        br, bc = BLOCK
        if list(s.shape) != [-(-shape[0] // br), -(-shape[1] // bc)]:
            if list(s.shape) != [shape[0], shape[1] // 32]:
                raise ValueError(f"{name}: scale shape {s.shape} fits neither {BLOCK} blocks nor MXFP8")
            br, bc = 1, 32  # MXFP8: one scale per row and 32 columns
        full = np.repeat(np.repeat(s, br, 0), bc, 1)[: shape[0], : shape[1]]
        return q * full
    if dtype == "I8":
        b = np.frombuffer(buf, np.uint8).reshape(shape)
        lo, hi = FP4[b & 15], FP4[b >> 4]
        v = np.stack([lo, hi], -1).reshape(shape[0], shape[1] * 2)
        s = scale_f32(*sc)
        return v * np.repeat(s, 32, 1)
    if dtype == "F32":
        return np.frombuffer(buf, np.float32).reshape(shape).copy()
    if dtype == "BF16":
        return np.frombuffer(buf, ml_dtypes.bfloat16).astype(np.float32).reshape(shape)
    if dtype in ("I32", "I64"):
        return np.frombuffer(buf, np.int32 if dtype == "I32" else np.int64).reshape(shape).copy()
    raise ValueError(f"{name}: dtype {dtype}")


def experts_per_layer(c):
    """Each decoder layer's routed experts: `n_routed_experts_per_layer` (written by keep prune
    when it leaves hash-routed layers whole), else `n_routed_experts` in every layer."""
    return c.get("n_routed_experts_per_layer") or [c["n_routed_experts"]] * c["num_hidden_layers"]


def hf_config(c):
    n = c["num_hidden_layers"]
    ratios = (c.get("compress_ratios") or []) + [0] * n
    ratios = ratios[:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise SystemExit(f"transformers takes one HCA rate; this config has {hca}")
    types = ["sliding_attention" if r == 0 else "compressed_sparse_attention" if r == 4
             else "heavily_compressed_attention" for r in ratios]
    nh = c.get("num_hash_layers", 0)
    prf = c["qk_rope_head_dim"] / c["head_dim"]
    rs = c.get("rope_scaling") or {}
    compress = {"rope_type": "default", "rope_theta": c.get("compress_rope_theta", 160000.0),
                "partial_rotary_factor": prf}
    if rs and float(rs.get("factor", 1.0)) != 1.0:
        compress.update({"rope_type": "yarn", "factor": float(rs["factor"]),
                         "original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                         "beta_fast": float(rs.get("beta_fast", 32)),
                         "beta_slow": float(rs.get("beta_slow", 1)), "attention_factor": 1.0})
    return DeepseekV4Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=n,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=1,
        head_dim=c["head_dim"], q_lora_rank=c["q_lora_rank"],
        num_experts_per_tok=c["num_experts_per_tok"], n_routed_experts=max(experts_per_layer(c)),
        n_shared_experts=1, scoring_func=c.get("scoring_func", "sqrtsoftplus"),
        norm_topk_prob=c.get("norm_topk_prob", True),
        routed_scaling_factor=c.get("routed_scaling_factor", 1.5),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        rope_theta=c.get("rope_theta", 10000.0),
        compress_rope_theta=c.get("compress_rope_theta", 160000.0),
        layer_types=types,
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": hca[0] if hca else 128},
        hc_mult=c["hc_mult"], hc_sinkhorn_iters=c["hc_sinkhorn_iters"], hc_eps=c["hc_eps"],
        mlp_layer_types=["hash_moe"] * min(nh, n) + ["moe"] * max(0, n - nh),
        swiglu_limit=c.get("swiglu_limit", 10.0), sliding_window=c["sliding_window"],
        o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
        index_n_heads=c["index_n_heads"], index_head_dim=c["index_head_dim"],
        index_topk=c["index_topk"], rms_norm_eps=c["rms_norm_eps"],
        partial_rotary_factor=prf,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": c.get("rope_theta", 10000.0),
                                  "partial_rotary_factor": prf},
                         "compress": compress},
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )


# DeepSeek's published names -> transformers' (the per-layer leaf renames).
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
GLOBAL = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
}


def convert(T, c):
    """transformers' state dict (float32 torch tensors; tid2eid int64) from the published tensors."""
    sd, experts = {}, {}
    for name in T:
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in T:
            continue
        if name.startswith("mtp.") or name.endswith("gate.bias_vl"):
            continue
        if name in GLOBAL:
            sd[GLOBAL[name]] = dequant(T, name)
            continue
        parts = name.split(".")
        if parts[0] != "layers":
            raise SystemExit(f"unexpected tensor {name}")
        l, rest = int(parts[1]), ".".join(parts[2:])
        if rest.startswith("ffn.experts."):
            e, w = int(parts[4]), parts[5]
            experts.setdefault(l, {}).setdefault(e, {})[w] = dequant(T, name)
            continue
        if rest not in LAYER:
            raise SystemExit(f"no transformers name for {name}")
        v = dequant(T, name)
        if rest == "ffn.gate.tid2eid":
            v = v.astype(np.int64)
        sd[f"model.layers.{l}.{LAYER[rest]}"] = v
    for l, ex in experts.items():
        E = experts_per_layer(c)[l]
        gu = np.stack([np.concatenate([ex[e]["w1"], ex[e]["w3"]], 0) for e in range(E)])
        dn = np.stack([ex[e]["w2"] for e in range(E)])
        sd[f"model.layers.{l}.mlp.experts.gate_up_proj"] = gu
        sd[f"model.layers.{l}.mlp.experts.down_proj"] = dn
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def load(d: Path):
    global BLOCK
    c = json.loads((d / "config.json").read_text())
    BLOCK = tuple((c.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    cfg = hf_config(c)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    # A layer with another expert count gets transformers' own MoE block built at that count
    # (its router, experts and one-hot width all follow the config it is built from).
    for l, n in enumerate(experts_per_layer(c)):
        if n != cfg.n_routed_experts:
            cl = copy.deepcopy(cfg)
            cl.n_routed_experts = n
            model.model.layers[l].mlp = mdv4.DeepseekV4SparseMoeBlock(cl, l).float().eval()
    sd = convert(read_all(d), c)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Rotary inv_freq buffers are computed, not stored.
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return model, cfg, sd


def stable_indexer_topk():
    """Make the indexer's top-k pick the lowest entry ids among exactly equal scores (keep's rule).

    Exact ties are common: an entry whose every head's `q·k` is negative scores exactly 0 after
    the ReLU. `torch.topk` orders tied values by an artifact of its selection algorithm (on CPU
    it returns e.g. ids 8, 6, 7, 5 of ten zeros), which no published semantics pins down; a
    stable descending sort gives the reference one defined answer. Only the indexer changes.
    """
    orig = mdv4.DeepseekV4Indexer.forward

    def stable_topk(x, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))

    def forward(self, *a, **kw):
        saved = torch.Tensor.topk
        torch.Tensor.topk = stable_topk
        try:
            return orig(self, *a, **kw)
        finally:
            torch.Tensor.topk = saved

    mdv4.DeepseekV4Indexer.forward = forward


class Routes:
    def __init__(self):
        self.calls = []
        self.weights = []
        self.orig = {}
        for cls in (mdv4.DeepseekV4TopKRouter, mdv4.DeepseekV4HashRouter):
            self.orig[cls] = cls.forward
            rec, f = self, cls.forward

            def hooked(router, *a, _f=f, **k):
                out = _f(router, *a, **k)
                idx = out[2].numpy()
                order = np.argsort(idx, -1, kind="stable")
                rec.calls.append(np.take_along_axis(idx, order, -1).astype(np.int32))
                w = out[1].float().numpy()
                rec.weights.append(np.take_along_axis(w, order, -1).astype(np.float32))
                return out

            cls.forward = hooked

    def close(self):
        for cls, f in self.orig.items():
            cls.forward = f


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--routes", action="store_true")
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--save-hf", type=Path)
    a = ap.parse_args(argv)
    toks = [int(t) for t in a.tokens.split(",") if t.strip()]
    model, cfg, sd = load(a.model)
    stable_indexer_topk()
    if a.save_hf:
        model.save_pretrained(a.save_hf)
    out = {"tokens": np.array(toks, np.int32)}
    rec = Routes() if a.routes else None
    ids = torch.tensor([toks])
    out["logits"] = model(input_ids=ids, use_cache=False).logits[0].float().numpy()
    if rec:
        rec.close()
        assert len(rec.calls) == cfg.num_hidden_layers, len(rec.calls)
        out["routes"] = np.stack([r.reshape(len(toks), -1) for r in rec.calls])
        out["route_weights"] = np.stack([w.reshape(len(toks), -1) for w in rec.weights])
    if a.greedy:
        seq, g = list(toks), []
        for _ in range(a.greedy):
            lg = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            g.append(int(lg.argmax()))
            seq.append(g[-1])
        out["greedy"] = np.array(g, np.int32)
    meta = {"format": "keep-model-ref", "version": "1", "reference": "transformers",
            "command": " ".join(["tools/oracle/v4flash_ref.py"] + (argv or sys.argv[1:])),
            "torch": torch.__version__, "transformers": transformers.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(a.out), metadata=meta)


if __name__ == "__main__":
    main()
