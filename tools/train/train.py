"""Train keep-tiny (DeepSeek-V4.1 architecture) on the corpus of corpus.py, on CPU.

    .venv/bin/python train.py --out runs/keep-tiny --stdlib-only      # the first stage
    .venv/bin/python train.py --out runs/keep-tiny --resume           # continue a run
    .venv/bin/python train.py --out runs/stage2 --init-from DIR       # continued training

Writes runs/.../ckpt.pkl every --ckpt-every steps (params, optimizer, router
biases, data RNG) and a JSON line per logged step to runs/.../log.jsonl.
The last --qat-steps steps train with the export's weight quantization in the
loop (FP8 32x32 residents, FP4 experts, bf16 elsewhere; straight-through).
"""
import argparse
import hashlib
import json
import math
import os
import pickle
import time
from pathlib import Path


import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer

from corpus import MANIFEST, PACKAGES, load_split
from model import CONFIG, forward, init_params, init_state

HERE = Path(__file__).resolve().parent
EOS = "<|endoftext|>"


def encode_split(tok, split, packages=True):
    eos = tok.token_to_id(EOS)
    ids = []
    for _, text in load_split(split, packages):
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def tokens_cached(tok_path, split, packages=True):
    if packages:
        key = hashlib.sha256(MANIFEST.read_bytes() + PACKAGES.read_bytes() + Path(tok_path).read_bytes()).hexdigest()[:12]
    else:
        key = "stdlib-" + hashlib.sha256(MANIFEST.read_bytes() + Path(tok_path).read_bytes()).hexdigest()[:12]
    cache = HERE / "runs" / f"tokens-{split}-{key}.npy"
    tok = Tokenizer.from_file(str(tok_path))
    if cache.exists():
        return np.load(cache)
    arr = encode_split(tok, split, packages)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, arr)
    return arr


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def load_entropy_ratios(load):
    """Per-layer entropy of this batch's expert load over its uniform maximum."""
    f = np.asarray(load, dtype=np.float64)
    f = f / np.maximum(f.sum(-1, keepdims=True), 1.0)
    h = -(np.where(f > 0, f * np.log(np.where(f > 0, f, 1.0)), 0.0)).sum(-1)
    return [round(float(x), 4) for x in h / np.log(f.shape[-1])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "runs" / "keep-tiny"))
    ap.add_argument("--tokenizer", default=str(HERE / "tokenizer.json"))
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--qat-steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--capacity", type=float, default=2.0)
    ap.add_argument("--bias-rate", type=float, default=1e-4)
    ap.add_argument("--balance", type=float, default=1e-3)
    ap.add_argument("--indexer-kl", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stdlib-only", action="store_true",
                    help="train on the standard library alone (the first stage's corpus)")
    ap.add_argument("--init-from", help="start from the weights and router biases of an exported model directory "
                    "(continued training) instead of a random initialisation")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = CONFIG

    train_ids = tokens_cached(args.tokenizer, "train", not args.stdlib_only)
    held_ids = tokens_cached(args.tokenizer, "heldout", not args.stdlib_only)
    print(f"train tokens {len(train_ids)}, heldout tokens {len(held_ids)}", flush=True)

    # The learning rate is applied by hand so that resume needs no schedule state.
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        optax.add_decayed_weights(args.wd, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)),
    )

    ckpt = out / "ckpt.pkl"
    if args.resume and ckpt.exists():
        with open(ckpt, "rb") as f:
            c = pickle.load(f)
        params = jax.tree_util.tree_map(jnp.asarray, c["params"])
        opt_state = jax.tree_util.tree_map(jnp.asarray, c["opt_state"])
        state = jax.tree_util.tree_map(jnp.asarray, c["state"])
        step0, rng, elapsed0 = c["step"], c["rng"], c["elapsed"]
        print(f"resumed at step {step0}", flush=True)
    elif args.init_from:
        from export import load_exported
        cfg0, p0, st0 = load_exported(args.init_from)
        if any(cfg0.get(k) != v for k, v in cfg.items() if k in cfg0 and k != "num_nextn_predict_layers"):
            raise SystemExit(f"--init-from {args.init_from}: its config differs from model.py's CONFIG")
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), p0)
        state = jax.tree_util.tree_map(jnp.asarray, st0)
        opt_state = opt.init(params)
        step0, rng, elapsed0 = 0, np.random.default_rng(args.seed + 1), 0.0
        print(f"initialised from {args.init_from}", flush=True)
    else:
        params = init_params(cfg, args.seed)
        state = init_state(cfg)
        opt_state = opt.init(params)
        step0, rng, elapsed0 = 0, np.random.default_rng(args.seed + 1), 0.0
    with open(out / "args.json", "w") as f:
        json.dump(vars(args), f, indent=1)

    def loss_fn(p, st, batch, qat):
        logits, aux = forward(cfg, p, st, batch[:, :-1], qat=qat, capacity_factor=args.capacity)
        tgt = batch[:, 1:]
        ce = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])
        kl = sum(aux["indexer_kl"])
        bal = sum(aux["balance"])
        loss = ce + args.indexer_kl * kl + args.balance * bal
        return loss, (ce, kl, bal, jnp.stack(aux["load"]), sum(aux["dropped"]))

    def make_step(qat):
        def step_fn(p, o, st, batch, lr):
            (loss, (ce, kl, bal, load, dropped)), g = jax.value_and_grad(loss_fn, has_aux=True)(p, st, batch, qat)
            gnorm = optax.global_norm(g)
            upd, o = opt.update(g, o, p)
            p = jax.tree_util.tree_map(lambda a, u: a - lr * u, p, upd)
            # DeepSeek's auxiliary-loss-free balancing: nudge the correction
            # bias of overloaded experts down and underloaded ones up.
            mean = jnp.mean(load.astype(jnp.float32), axis=-1, keepdims=True)
            st = {"gate_bias": st["gate_bias"] - args.bias_rate * jnp.sign(load - mean)}
            return p, o, st, (loss, ce, kl, bal, dropped, gnorm, load)
        return jax.jit(step_fn)

    def make_eval(qat):
        def ev(p, st, batch):
            logits, _ = forward(cfg, p, st, batch[:, :-1], qat=qat, capacity_factor=0.0)
            tgt = batch[:, 1:]
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])
        return jax.jit(ev)

    steps = {False: make_step(False), True: make_step(True)}
    evals = {}
    erng = np.random.default_rng(7)
    eval_starts = erng.integers(0, len(held_ids) - args.seq - 1, 8)
    eval_batch = jnp.asarray(np.stack([held_ids[s:s + args.seq + 1] for s in eval_starts]))

    def save(step, elapsed):
        tmp = out / "ckpt.pkl.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({
                "params": jax.tree_util.tree_map(np.asarray, params),
                "opt_state": jax.tree_util.tree_map(np.asarray, opt_state),
                "state": jax.tree_util.tree_map(np.asarray, state),
                "step": step, "rng": rng, "elapsed": elapsed, "config": cfg,
            }, f)
        os.replace(tmp, ckpt)

    log = open(out / "log.jsonl", "a")
    t_start = time.time() - elapsed0
    tokens_per_step = args.batch * args.seq
    qat_from = args.steps - args.qat_steps
    t_last = time.time()
    for step in range(step0, args.steps):
        qat = step >= qat_from
        starts = rng.integers(0, len(train_ids) - args.seq - 1, args.batch)
        batch = jnp.asarray(np.stack([train_ids[s:s + args.seq + 1] for s in starts]))
        lr = lr_at(step, args)
        params, opt_state, state, m = steps[qat](params, opt_state, state, batch, jnp.float32(lr))
        if step % 10 == 0 or step == args.steps - 1:
            loss, ce, kl, bal, dropped, gnorm, load = [np.asarray(x) for x in m]
            now = time.time()
            rec = {"step": step, "loss": float(loss), "ce": float(ce), "indexer_kl": float(kl),
                   "balance": float(bal), "dropped_frac": float(dropped) / (tokens_per_step * cfg["num_experts_per_tok"] * cfg["num_hidden_layers"]),
                   "gnorm": float(gnorm), "lr": lr, "qat": qat, "elapsed_s": now - t_start,
                   "tok_per_s_recent": (10 if step > step0 else 1) * tokens_per_step / (now - t_last),
                   "load_entropy_ratio": load_entropy_ratios(load)}
            t_last = now
            if step % args.eval_every == 0 or step == args.steps - 1:
                if qat not in evals:
                    evals[qat] = make_eval(qat)
                rec["heldout_ce"] = float(evals[qat](params, state, eval_batch))
                t_last = time.time()
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if (step + 1) % args.ckpt_every == 0 or step == args.steps - 1:
            save(step + 1, time.time() - t_start)
    total = time.time() - t_start
    with open(out / "done.json", "w") as f:
        json.dump({"steps": args.steps, "train_seconds": total,
                   "tokens": args.steps * tokens_per_step,
                   "tokens_per_second": args.steps * tokens_per_step / total}, f, indent=1)
    print("done", total, flush=True)


if __name__ == "__main__":
    main()
