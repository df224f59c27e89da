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
    fn = jax.jit(lambda p, s, t: forward(cfg, p, s, t, qat=False, capacity_factor=0.0)[0])
    p = jax.tree_util.tree_map(jnp.asarray, params)
    st = jax.tree_util.tree_map(jnp.asarray, state)
    return [np.asarray(fn(p, st, jnp.asarray(t)[None]))[0] for t in seqs]


def mlx_logits(model_dir, seqs):
    with tempfile.TemporaryDirectory() as d:
        np.savez(f"{d}/in.npz", **{f"seq{i}": s for i, s in enumerate(seqs)})
        subprocess.run([str(ORACLE), str(HERE / "mlx_ref.py"), "--model", str(model_dir),
                        "--tokens", f"{d}/in.npz", "--out", f"{d}/out.npz"], check=True)
        z = np.load(f"{d}/out.npz")
        return [z[f"logits{i}"] for i in range(len(seqs))]


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
    report["sequences"] = [dict(length=len(s), **compare(x, y)) for s, x, y in zip(seqs, a, b)]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
