#!/usr/bin/env python3
"""Compare keep's logits (and routes) with the reference's: top-1 agreement, mean KL(ref||keep)
per position in nats, max |diff|, route agreement over (token, layer) pairs.

Usage: model_compare.py REF.safetensors KEEP.safetensors [--json]
Both files hold `logits [T, vocab]` f32; `routes [L, T, k]` int32 (sorted) when both have it.
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(ref, keep):
    a, b = ref["logits"], keep["logits"]
    assert a.shape == b.shape, (a.shape, b.shape)
    la, lb = log_softmax(a), log_softmax(b)
    kl = (np.exp(la) * (la - lb)).sum(-1)
    out = {
        "positions": int(a.shape[0]),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "max_abs_diff": float(np.abs(a - b).max()),
    }
    if "routes" in ref and "routes" in keep:
        ra, rb = ref["routes"], keep["routes"]
        out["route_agreement"] = float((ra == rb).all(-1).mean())
    return out


if __name__ == "__main__":
    r = compare(load_file(sys.argv[1]), load_file(sys.argv[2]))
    print(json.dumps(r, indent=1))
