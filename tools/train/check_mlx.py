"""Compare this tool's JAX implementation (model.py) with mlx-lm's deepseek_v41
on an exported directory: logits on held-out sequences, both in float32.

    .venv/bin/python export.py --init --out /tmp/keep-tiny-init
    .venv/bin/python check_mlx.py --model /tmp/keep-tiny-init --json logs/check-init.json
    .venv/bin/python check_mlx.py --model ../../models/keep-tiny --ckpt runs/keep-tiny/ckpt.pkl \
        --json logs/check-trained.json

With --ckpt it also checks that the exported weights decode to exactly the
weights the QAT forward of the checkpoint uses (max |diff| per tensor = 0).
"""
import argparse
import json
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from export import load_exported
from model import forward, quantize_params

HERE = Path(__file__).resolve().parent
ORACLE = HERE.parent / "oracle" / ".venv" / "bin" / "python"


def heldout_sequences(lengths, seed=11):
    from train import tokens_cached
    ids = tokens_cached(HERE / "tokenizer.json", "heldout")
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        s = int(rng.integers(0, len(ids) - n))
        out.append(ids[s:s + n].astype(np.int32))
    return out


def jax_logits(cfg, params, state, seqs):
    """Logits, indexer selections (bool [T, N] per index call) and routes."""
    import model as M
    sels = []
    orig = M.indexer

    def wrapped(*a, **k):
        r = orig(*a, **k)
        sels.append(r[0])
        return r

    def fwd(p, s, t):
        sels.clear()
        logits, aux = forward(cfg, p, s, t, qat=False, capacity_factor=0.0)
        return logits, list(sels), [idx for idx, _ in aux["routes"]]

    M.indexer = wrapped
    try:
        fn = jax.jit(fwd)
        p = jax.tree_util.tree_map(jnp.asarray, params)
        st = jax.tree_util.tree_map(jnp.asarray, state)
        outs = []
        for t in seqs:
            lg, sl, rt = fn(p, st, jnp.asarray(t)[None])
            outs.append((np.asarray(lg)[0], [np.asarray(x)[0] for x in sl], [np.asarray(x) for x in rt]))
        return outs
    finally:
        M.indexer = orig


def mlx_logits(model_dir, seqs):
    with tempfile.TemporaryDirectory() as d:
        np.savez(f"{d}/in.npz", **{f"seq{i}": s for i, s in enumerate(seqs)})
        subprocess.run([str(ORACLE), str(HERE / "mlx_ref.py"), "--model", str(model_dir),
                        "--tokens", f"{d}/in.npz", "--out", f"{d}/out.npz"], check=True)
        z = np.load(f"{d}/out.npz")
        return [(z[f"logits{i}"],
                 [z[k] for k in sorted((k for k in z.files if k.startswith(f"idx{i}_")), key=lambda k: int(k.split("_")[1]))],
                 [z[k] for k in sorted((k for k in z.files if k.startswith(f"route{i}_")), key=lambda k: int(k.split("_")[1]))])
                for i in range(len(seqs))]


def selection_diffs(jsel, msel):
    """Per indexer call: how many query positions select a different set."""
    out = []
    for s, t in zip(jsel, msel):
        m = np.zeros_like(s)
        for q in range(t.shape[0]):
            for j in t[q]:
                if j >= 0:
                    m[q, j] = True
        out.append(int((m != s).any(-1).sum()))
    return out


def route_diffs(jr, mr):
    return [int((np.sort(a, -1) != np.sort(b, -1)).any(-1).sum()) for a, b in zip(jr, mr)]


def compare(a, b):
    la = a - a.max(-1, keepdims=True)
    la = la - np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb = lb - np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(lb) * (lb - la)).sum(-1)  # KL(mlx || jax)
    return {"max_abs_diff": float(np.abs(a - b).max()), "mean_abs_diff": float(np.abs(a - b).mean()),
            "logit_scale_max_abs": float(np.abs(b).max()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
            "worst_positions": [int(x) for x in np.argsort(-np.abs(a - b).max(-1))[:5]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--lengths", default="256,256,37")
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg, params, state = load_exported(args.model)
    report = {"model": str(args.model)}
    if args.ckpt:
        with open(args.ckpt, "rb") as f:
            c = pickle.load(f)
        q = quantize_params(jax.tree_util.tree_map(jnp.asarray, c["params"]), True)
        worst = 0.0
        for (kp, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(q)[0],
                                   jax.tree_util.tree_flatten_with_path(params)[0]):
            worst = max(worst, float(np.abs(np.asarray(a) - np.asarray(b)).max()))
        report["qat_weights_vs_export_max_abs_diff"] = worst
        report["bias_max_abs_diff"] = float(np.abs(c["state"]["gate_bias"] - state["gate_bias"]).max())
    seqs = heldout_sequences([int(x) for x in args.lengths.split(",")])
    a = jax_logits(cfg, params, state, seqs)
    b = mlx_logits(args.model, seqs)
    report["sequences"] = [
        dict(length=len(s), **compare(x[0], y[0]),
             indexer_positions_selecting_differently=selection_diffs(x[1], y[1]),
             tokens_routed_differently_per_layer=route_diffs(x[2], y[2]))
        for s, x, y in zip(seqs, a, b)]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
