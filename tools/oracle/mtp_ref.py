#!/usr/bin/env python3
"""The reference of a DeepSeek-V4 checkpoint's MTP module (`mtp.0.*`) after one prefill, in
float32 CPU torch, independently of keep.

The main model and the MTP block's decoder layer are transformers 5.23.0's
`DeepseekV4ForCausalLM` / `DeepseekV4DecoderLayer`, loaded by tools/oracle/v4flash_ref.py's own
decoding of the published tensors (strict names). transformers does not build the MTP module,
so its wrapper is transcribed here from `MTPBlock.forward` of DeepSeek's published
`inference/model.py` (DeepSeek-V4-Flash), which the ATOM port (`MTPBlock`, "port of
inference/model.py:739-767") repeats line for line:

    e = enorm(embed(input_ids))                 # shared embedding
    x = hnorm(h)                                # h: main model's last-layer streams [T, hc, D]
    x = e_proj(e)[:, None] + h_proj(x)          # e added to every stream
    x = Block(x)                                # one decoder layer, window only (ratio 0)
    logits = head(hc_head(x; mtp.hc_head_{fn,base,scale}), mtp.norm)   # shared head

with `hc_head` as `ParallelHead.hc_head` (RMS over the flattened streams, sigmoid(mix · scale
+ base) + hc_eps, weighted sum of the streams) and the block run at the main positions 0..T-2
(row i pairs the streams of token i with the embedding of token i + 1).

Writes a safetensors file with `tokens` int32 [T] and `mtp_logits` f32 [T-1, vocab].

Usage: mtp_ref.py DIR --tokens 1,2,3 --out FILE.safetensors
"""
import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent))
import v4flash_ref as ref  # noqa: E402
from v4flash_ref import mdv4  # noqa: E402


def rms(x, w, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def mtp_block(c, T, main_cfg):
    """transformers' decoder layer for the MTP block (layer id n_layers, window only), with the
    `mtp.0.` tensors loaded strictly under transformers' names."""
    n = c["num_hidden_layers"]
    c2 = copy.deepcopy(c)
    c2["num_hidden_layers"] = n + 1
    c2["compress_ratios"] = ((c.get("compress_ratios") or []) + [0] * n)[:n] + [0]
    cfg = ref.hf_config(c2)
    cfg._attn_implementation = "eager"
    layer = mdv4.DeepseekV4DecoderLayer(cfg, n).float().eval()
    sd, experts = {}, {}
    for name in T:
        if not name.startswith("mtp.0.") or name.endswith(".scale") and name[:-6] + ".weight" in T:
            continue
        rest = name[len("mtp.0."):]
        if rest in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                    "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
            continue
        if rest.startswith("ffn.experts."):
            p = rest.split(".")
            experts.setdefault(int(p[2]), {})[p[3]] = ref.dequant(T, name)
            continue
        if rest not in ref.LAYER:
            raise SystemExit(f"no transformers name for {name}")
        sd[ref.LAYER[rest]] = ref.dequant(T, name)
    E = c["n_routed_experts"]
    sd["mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([experts[e]["w1"], experts[e]["w3"]], 0) for e in range(E)])
    sd["mlp.experts.down_proj"] = np.stack([experts[e]["w2"] for e in range(E)])
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "inv_freq" not in m]
    if missing or unexpected:
        raise SystemExit(f"MTP block: missing {missing}, unexpected {unexpected}")
    return layer, cfg


@torch.no_grad()
def mtp_logits(d: Path, toks):
    c = json.loads((d / "config.json").read_text())
    model, cfg, _ = ref.load(d)
    ref.stable_indexer_topk()
    T = ref.read_all(d)
    block, bcfg = mtp_block(c, T, cfg)
    eps, hc_eps = cfg.rms_norm_eps, cfg.hc_eps
    g = lambda n: torch.from_numpy(ref.dequant(T, n))  # noqa: E731
    # The main model's last-layer streams (before its own hc_head collapse).
    got = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: got.__setitem__("h", o))
    model(input_ids=torch.tensor([toks]), use_cache=False)
    hook.remove()
    h = got["h"][:, :-1].float()  # [1, T-1, hc, D]
    nxt = torch.tensor([toks[1:]])
    e = rms(model.model.embed_tokens(nxt), g("mtp.0.enorm.weight"), eps)
    x = rms(h, g("mtp.0.hnorm.weight"), eps)
    x = (e @ g("mtp.0.e_proj.weight").T).unsqueeze(2) + x @ g("mtp.0.h_proj.weight").T
    # One decoder layer at positions 0..T-2, as DeepseekV4Model.forward runs its layers.
    pos = torch.arange(len(toks) - 1).unsqueeze(0)
    emb = model.model.embed_tokens(nxt)
    mask = mdv4.create_sliding_window_causal_mask(
        config=bcfg, inputs_embeds=emb, attention_mask=None, past_key_values=None,
        position_ids=pos)
    rot = model.model.rotary_emb
    pe = {"main": rot(emb, position_ids=pos, layer_type="main"),
          "compress": rot(emb, position_ids=pos, layer_type="compress")}
    y = block(x, position_embeddings=pe, position_ids=pos, attention_mask=mask,
              input_ids=nxt, past_key_values=None)
    # ParallelHead.hc_head with the module's own parameters, then mtp.norm and the shared head.
    flat = y.flatten(2).float()
    mixes = (flat @ g("mtp.0.hc_head_fn").T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(mixes * g("mtp.0.hc_head_scale") + g("mtp.0.hc_head_base")) + hc_eps
    col = (pre.unsqueeze(-1) * y).sum(2)
    out = rms(col, g("mtp.0.norm.weight"), eps) @ g("head.weight").T
    return out[0].numpy().astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    toks = [int(t) for t in a.tokens.split(",") if t.strip()]
    out = {"tokens": np.array(toks, np.int32), "mtp_logits": mtp_logits(a.model, toks)}
    meta = {"format": "keep-model-ref", "version": "1", "reference": "transformers+mtp",
            "command": " ".join(["tools/oracle/mtp_ref.py"] + (argv or sys.argv[1:])),
            "torch": torch.__version__, "transformers": transformers.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(a.out), metadata=meta)


if __name__ == "__main__":
    main()
