"""Measure the exported keep-tiny model with mlx-lm (the oracle venv):

    ../oracle/.venv/bin/python report.py --model ../../models/keep-tiny --json logs/report.json

- held-out loss (nats/token) of the exported, quantized model run by mlx-lm in
  float32 (bf16 parameters cast to f32 after loading; FP8/FP4 stay packed), on
  --windows non-overlapping 256-token windows spread evenly over the held-out
  token stream (each window scored from position 0: 255 predictions);
- the unigram baseline (token frequencies of the training split, add-one
  smoothed) on exactly the same predicted tokens, and on the whole held-out split;
- the same two on the `foreign` split: projects the model never saw (corpus.py), and the
  strictest unigram baseline there: the entropy of the scored tokens under their own
  frequencies (a unigram fitted on the very text it scores);
- per-layer expert-load entropy over those windows against log(E), the mean
  per-window entropy (locality: what one 256-token window uses), and how much
  the choice depends on the token: H(expert | token id) and I(expert; token id)
  over the token ids seen at least 20 times;
- bytes by format from the safetensors header;
- two greedy samples through mlx_lm.load + mlx_lm.generate (native dtypes).
"""
import argparse
import hashlib
import json
import math
import struct
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models import deepseek_v41
from mlx_lm.utils import load_model
from tokenizers import Tokenizer

from corpus import load_split

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"
PROMPTS = ["import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, item):\n"]


def split_ids(tok, split):
    """One split of the corpus (corpus.py; hashes checked there) as one token stream."""
    eos = tok.token_to_id(EOS)
    ids = []
    for _, text in load_split(split):
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return np.asarray(ids, np.int64)


def window_starts(n, windows, seq):
    """Non-overlapping windows spread evenly over a stream of n tokens."""
    n_win = min(windows, n // seq)
    starts = np.linspace(0, n - seq, n_win).astype(np.int64)
    return (starts // seq) * seq


def self_entropy(ids):
    """Entropy (nats/token) of a token sequence under its own unigram frequencies."""
    c = np.bincount(ids).astype(np.float64)
    p = c[c > 0] / c.sum()
    return float(-(p * np.log(p)).sum())


def score(model, stream, starts, seq, logp_uni):
    """(model nats, unigram nats, predictions) over the windows: each scored from position 0."""
    nll, nll_uni, ntok = 0.0, 0.0, 0
    for s in starts:
        ids = stream[s:s + seq]
        logits = model(mx.array(ids[None].astype(np.int32)))[0].astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        tgt = mx.array(ids[1:].astype(np.int32))
        lp = mx.take_along_axis(logits[:-1], tgt[:, None], axis=-1)[:, 0] - lse[:-1]
        nll -= float(mx.sum(lp).item())
        nll_uni -= float(logp_uni[ids[1:]].sum())
        ntok += len(ids) - 1
    return nll / ntok, nll_uni / ntok, ntok


def bytes_by_format(path):
    raw = open(path, "rb").read(8)
    n = struct.unpack("<Q", raw)[0]
    with open(path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = Counter()
    for name, h in header.items():
        a, b = h["data_offsets"]
        dt = h["dtype"]
        if dt == "I8":
            key = "FP4 E2M1 routed experts (I8, 2 per byte)"
        elif dt == "F8_E4M3":
            key = "FP8 E4M3 residents"
        elif dt == "F8_E8M0":
            key = ("E8M0 scales of FP4 experts" if ".experts." in name else "E8M0 scales of FP8 residents")
        else:
            key = dt
        out[key] += b - a
    out["safetensors header"] = 8 + n
    return dict(out)


def routing_table(rep, config):
    """The model card's routing table (markdown) from a report."""
    E = config["n_routed_experts"]
    ratios = config.get("compress_ratios") or [0] * len(rep["expert_load"])
    rows = ["| layer | ratio | load entropy / log %d | most / least used expert (× uniform) | top %d experts' share | "
            "mean per-window entropy | H(expert \\| token) | I(expert; token) |" % (E, max(1, E // 4)),
            "|---|---|---|---|---|---|---|---|"]
    for r in rep["expert_load"]:
        rows.append("| %d | %d | %.3f (%.3f) | %.2f / %.2f | %.1f%% | %.3f | %.3f | %.3f |" % (
            r["layer"], ratios[r["layer"]], r["load_entropy"], r["ratio"],
            r["max_load_share"] * E, r["min_load_share"] * E, 100 * r["top_quarter_share"],
            r["mean_window_entropy"], r["entropy_given_token"], r["mutual_information_expert_token"]))
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(HERE.parent.parent / "models" / "keep-tiny"))
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    model_dir = Path(args.model)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    V = tok.get_vocab_size()
    rep = {"model": str(model_dir)}

    train = split_ids(tok, "train")
    held = split_ids(tok, "heldout")
    counts = np.bincount(train, minlength=V).astype(np.float64) + 1.0
    logp_uni = np.log(counts / counts.sum())
    rep["train_tokens"] = int(len(train))
    rep["heldout_tokens"] = int(len(held))
    rep["unigram_heldout_full_nats"] = float(-logp_uni[held[1:]].mean())
    foreign = split_ids(tok, "foreign")
    rep["foreign_tokens"] = int(len(foreign))
    rep["unigram_foreign_full_nats"] = float(-logp_uni[foreign[1:]].mean())

    model, config = load_model(model_dir)
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                          model.parameters()))
    mx.eval(model.parameters())
    E = config["n_routed_experts"]
    cfg_k = config["num_experts_per_tok"]
    L = config["num_hidden_layers"]

    captured = []
    original = deepseek_v41.Router.__call__

    def hooked(self, x):
        chosen, weights = original(self, x)
        captured.append(np.array(chosen))
        return chosen, weights

    starts = window_starts(len(held), args.windows, args.seq)
    n_win = len(starts)
    nll, nll_uni, ntok = 0.0, 0.0, 0
    load_total = np.zeros((L, E))
    # (layer, token id) -> expert counts, for the mutual information I(expert; token)
    by_token = [dict() for _ in range(L)]
    win_entropy = np.zeros(L)
    t0 = time.time()
    deepseek_v41.Router.__call__ = hooked
    try:
        for s in starts:
            ids = held[s:s + args.seq]
            captured.clear()
            logits = model(mx.array(ids[None].astype(np.int32)))[0].astype(mx.float32)
            lse = mx.logsumexp(logits, axis=-1)
            tgt = mx.array(ids[1:].astype(np.int32))
            lp = mx.take_along_axis(logits[:-1], tgt[:, None], axis=-1)[:, 0] - lse[:-1]
            nll -= float(mx.sum(lp).item())
            nll_uni -= float(logp_uni[ids[1:]].sum())
            ntok += len(ids) - 1
            for layer, chosen in enumerate(captured):
                for t, row in zip(ids, chosen.reshape(len(ids), -1)):
                    acc = by_token[layer].setdefault(int(t), np.zeros(E))
                    acc[row] += 1
                c = np.bincount(chosen.reshape(-1), minlength=E)
                load_total[layer] += c
                p = c / c.sum()
                win_entropy[layer] += -(p[p > 0] * np.log(p[p > 0])).sum()
    finally:
        deepseek_v41.Router.__call__ = original
    rep["eval_seconds"] = time.time() - t0
    rep["eval_windows"] = int(n_win)
    rep["eval_predicted_tokens"] = int(ntok)
    rep["heldout_nats_mlx_f32"] = nll / ntok
    rep["unigram_nats_same_tokens"] = nll_uni / ntok
    f_starts = window_starts(len(foreign), args.windows, args.seq)
    f_nll, f_uni, f_tok = score(model, foreign, f_starts, args.seq, logp_uni)
    rep["foreign_windows"] = int(len(f_starts))
    rep["foreign_predicted_tokens"] = int(f_tok)
    rep["foreign_nats_mlx_f32"] = f_nll
    rep["foreign_unigram_nats_same_tokens"] = f_uni
    # The strictest unigram: fitted on the very tokens it scores (their own frequencies, no
    # smoothing needed), over the scored windows and over the whole foreign split.
    scored = np.concatenate([foreign[s + 1:s + args.seq] for s in f_starts])
    rep["foreign_unigram_self_nats_same_tokens"] = self_entropy(scored)
    rep["foreign_unigram_self_nats_full"] = self_entropy(foreign[1:])
    layers = []
    for layer in range(L):
        p = load_total[layer] / load_total[layer].sum()
        ent = float(-(p[p > 0] * np.log(p[p > 0])).sum())
        # H(expert | token id) over token ids seen >= 20 times (less biased),
        # and I(expert; token) = H(expert) - H(expert | token) on the same tokens.
        freq = {t: c for t, c in by_token[layer].items() if c.sum() >= 20 * cfg_k}
        tot = sum(c.sum() for c in freq.values())
        pm = sum(freq.values()) / tot
        h_m = float(-(pm[pm > 0] * np.log(pm[pm > 0])).sum())
        h_c = 0.0
        for c in freq.values():
            q = c / c.sum()
            h_c += c.sum() / tot * float(-(q[q > 0] * np.log(q[q > 0])).sum())
        layers.append({"layer": layer, "load_entropy": ent, "max": math.log(E),
                       "ratio": ent / math.log(E),
                       "mean_window_entropy": float(win_entropy[layer] / n_win),
                       "max_load_share": float(p.max()), "min_load_share": float(p.min()),
                       # share of routed slots taken by the most-used quarter of the experts
                       "top_quarter_share": float(np.sort(p)[::-1][:max(1, E // 4)].sum()),
                       "unused_experts": int((p == 0).sum()),
                       "frequent_tokens": len(freq),
                       "entropy_given_token": h_c,
                       "mutual_information_expert_token": h_m - h_c})
    rep["expert_load"] = layers
    rep["bytes_by_format"] = bytes_by_format(model_dir / "model.safetensors")
    rep["files"] = {p.name: p.stat().st_size for p in sorted(model_dir.iterdir()) if p.is_file()}
    rep["total_bytes"] = sum(rep["files"].values())

    from mlx_lm import generate, load
    m2, tk = load(str(model_dir))
    rep["greedy_samples"] = []
    for prompt in PROMPTS:
        text = generate(m2, tk, prompt, max_tokens=48, verbose=False)
        rep["greedy_samples"].append({"prompt": prompt, "completion": text})
    print(json.dumps(rep, indent=1))
    print(routing_table(rep, config))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")


if __name__ == "__main__":
    main()
