"""mlx-lm's logits for token sequences, on an exported directory, in float32.

Runs with the oracle venv (mlx-lm 0.32.2), not the training venv:

    ../oracle/.venv/bin/python mlx_ref.py --model DIR --tokens in.npz --out out.npz

in.npz holds arrays seq0, seq1, ... (int32 [T]); out.npz gets logits0, ... (f32
[T, vocab]), and the indexer's top-k (idx{seq}_{call}) and the routers' chosen
experts (route{seq}_{layer}), captured by wrapping Indexer/Router.__call__. Quantized weights stay packed (mxfp8 / mxfp4, dequantized by
MLX's kernels); every other floating parameter (bf16 in the file) is cast to
float32 after loading, so the whole forward runs in float32.
"""
import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import deepseek_v41
from mlx_lm.utils import load_model


def load_f32(model_dir):
    model, config = load_model(Path(model_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, _ = load_f32(args.model)
    left = [k for k, v in tree_flatten(model.parameters()) if v.dtype == mx.bfloat16]
    assert not left, left
    seqs = np.load(args.tokens)
    out = {}
    cap = {"idx": [], "route": []}
    o_idx, o_route = deepseek_v41.Indexer.__call__, deepseek_v41.Router.__call__

    def h_idx(self, *a, **k):
        t, c = o_idx(self, *a, **k)
        cap["idx"].append(np.array(t))
        return t, c

    def h_route(self, x):
        c, w = o_route(self, x)
        cap["route"].append(np.array(c))
        return c, w

    deepseek_v41.Indexer.__call__, deepseek_v41.Router.__call__ = h_idx, h_route
    for k in sorted(seqs.files):
        cap["idx"].clear()
        cap["route"].clear()
        toks = mx.array(seqs[k].astype(np.int32))[None]
        logits = model(toks)
        n = k.removeprefix("seq")
        out[f"logits{n}"] = np.array(logits[0].astype(mx.float32))
        for i, a in enumerate(cap["idx"]):
            out[f"idx{n}_{i}"] = a[0]
        for i, a in enumerate(cap["route"]):
            out[f"route{n}_{i}"] = a
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()
