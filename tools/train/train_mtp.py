"""Train keep-tiny's MTP module (`mtp.0.*`) on the frozen main model, and add it to the model.

    nice -n 10 .venv/bin/python train_mtp.py --model ../../models/keep-tiny \
        --log logs/train-mtp.jsonl --json logs/train-mtp.json

The module is DeepSeek-V4's `MTPBlock` with a V4.1 block, exactly as keep runs it
(docs/mtp.md, crates/keep-model/src/mtp.rs): for position p with the main model's last-layer
streams H_p (before the final collapse) and the next token t_{p+1},

    e   = RMSNorm(embed(t_{p+1})) * enorm;   X_k = h_proj(RMSNorm(H_{p,k}) * hnorm) + e_proj(e)
    X'  = Block(X; position p; the pre-mix the last main layer handed on)  (window only)
    pre = sigmoid(hc_head_fn . vec(X') / rms(vec(X')) * hc_head_scale + hc_head_base) + hc_eps
    logits(t_{p+2}) = head(RMSNorm(sum_k pre_k X'_k) * norm)

with the main model's embedding and head (frozen). Steps:
1. decode the exported main model; sample --train-seqs windows of --seq + 2 tokens from the
   training split and --heldout-seqs from the held-out split (seeded); run the main model once
   over each (exact MoE: no capacity drops) and keep its last-layer streams and pre-mix;
2. train only the MTP parameters on those streams (AdamW, cosine), initialised from the last
   decoder layer's weights (the block), `h_proj` the identity plus noise, small random `e_proj`, the main
   `norm`; every weight is rounded in the loop exactly as it is exported (FP8 E4M3 32x32
   blocks, FP4 E2M1 experts per 32, bf16), with a straight-through gradient;
3. the loss is self-distillation: cross-entropy of the module's logits at p against the main
   model's distribution at p + 1 (what the module must predict to be accepted). The
   cross-entropy against the true token t_{p+2} and the top-1 agreement with the main model
   (the greedy acceptance of the first draft on real text) are logged on held-out windows;
4. write `mtp.0.*` into model.safetensors beside the main tensors (copied byte for byte, so
   the main model's logits cannot change), `num_nextn_predict_layers: 1` into config.json, and
   SHA256SUMS. The files are written to temporary siblings and renamed.
"""
import argparse
import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from export import (decode_fp8_block, layer_params, layer_tensors, load_exported, read_safetensors,
                    write_safetensors, write_sums, _t, encode_fp8_block)
from model import (F32_KEYS, FP4_KEYS, FP8_KEYS, block, collapse, finish, fq_bf16, fq_w_fp4,
                   fq_w_fp8, new_aux, rms_norm, ste, trunk)
from train import tokens_cached

HERE = Path(__file__).resolve().parent
PREFIX = "mtp.0."
# The MTP block is a window-only block (compress ratio 0), score-routed.
BLOCK_ROLES = {"ratio": 0, "kv_source": False, "index_source": False, "has_compressor": False,
               "has_indexer": False, "indexer_has_k": False, "candidate_source": False}
# Capacity used for the frozen main model's streams; a batch that drops any assignment at this
# capacity is recomputed without a capacity limit (exact), so the streams are always exact.
MAIN_CAPACITY = 3.0


def round_mtp(mp):
    """The module's parameters as exported, with straight-through gradients."""
    def leaf(name, w):
        if name in FP8_KEYS or name in ("e_proj", "h_proj"):
            return ste(w, fq_w_fp8(w))
        if name in FP4_KEYS:
            return ste(w, fq_w_fp4(w))
        if name in F32_KEYS or name.startswith("hc_head"):
            return w
        return ste(w, fq_bf16(w))
    out = {k: leaf(k, v) for k, v in mp.items() if k != "block"}
    out["block"] = {k: leaf(k, v) for k, v in mp["block"].items()}
    return out


def mtp_forward(cfg, mp, bias, main, H, pre_mix, nxt, capacity):
    """Logits [B, T, V] of the token two after each position, and aux."""
    eps = cfg["rms_norm_eps"]
    e = rms_norm(main["embed"][nxt], mp["enorm"], eps)
    ep = e @ mp["e_proj"].T
    h = rms_norm(H, mp["hnorm"], eps)
    x = h @ mp["h_proj"].T + ep[:, :, None, :]
    aux = new_aux()
    streams, _ = block(cfg, mp["block"], BLOCK_ROLES, bias, x, pre_mix, {}, aux, capacity)
    B, T = streams.shape[:2]
    flat = rms_norm(streams.reshape(B, T, -1), None, eps)
    mix = (flat @ mp["hc_head_fn"].T) * mp["hc_head_scale"][0] + mp["hc_head_base"]
    pre = jax.nn.sigmoid(mix) + cfg["hc_eps"]
    y = rms_norm(collapse(streams, pre), mp["norm"], eps)
    return y @ main["head"].T, aux


def init_mtp(cfg, main, rng):
    D, hc = cfg["hidden_size"], cfg["hc_mult"]
    last = main["layers"][-1]
    return {
        "e_proj": jnp.asarray(rng.normal(0.0, 0.02, (D, D)).astype(np.float32)),
        # Identity plus noise: an all-zero 32x32 tile has no FP8 scale to round with.
        "h_proj": jnp.asarray(np.eye(D, dtype=np.float32) + rng.normal(0.0, 0.01, (D, D)).astype(np.float32)),
        "enorm": jnp.ones(D, jnp.float32),
        "hnorm": jnp.ones(D, jnp.float32),
        "norm": jnp.asarray(main["norm"]),
        "hc_head_fn": jnp.zeros((hc, hc * D), jnp.float32),
        "hc_head_base": jnp.zeros(hc, jnp.float32),
        "hc_head_scale": jnp.ones(1, jnp.float32),
        "block": {k: jnp.asarray(v) for k, v in last.items()},
    }


def load_mtp(model_dir, cfg):
    """The mtp.0.* module of an exported model decoded into init_mtp's tree, and its router bias."""
    t, _ = read_safetensors(Path(model_dir) / "model.safetensors")
    if f"{PREFIX}e_proj.weight" not in t:
        raise SystemExit(f"--init-from {model_dir}: the model has no {PREFIX}* module")
    block_p, bias = layer_params(t, PREFIX.rstrip("."), cfg["n_routed_experts"])
    f32 = lambda n: jnp.asarray(np.asarray(t[n][2], np.float32))
    fp8 = lambda n: jnp.asarray(decode_fp8_block(t[n + ".weight"][2], t[n + ".scale"][2]))
    mp = {"e_proj": fp8(f"{PREFIX}e_proj"), "h_proj": fp8(f"{PREFIX}h_proj"),
          "enorm": f32(f"{PREFIX}enorm.weight"), "hnorm": f32(f"{PREFIX}hnorm.weight"),
          "norm": f32(f"{PREFIX}norm.weight"),
          "hc_head_fn": f32(f"{PREFIX}hc_head_fn"), "hc_head_base": f32(f"{PREFIX}hc_head_base"),
          "hc_head_scale": f32(f"{PREFIX}hc_head_scale"),
          "block": {k: jnp.asarray(v) for k, v in block_p.items()}}
    return mp, jnp.asarray(bias)


def main_streams(cfg, main, state, windows, batch, label):
    """The frozen main model's last-layer streams and pre-mix over windows [N, S] (exact)."""
    def streams_of(tok, capacity):
        H, P, aux = trunk(cfg, main, state, tok, capacity_factor=capacity)
        return H, P, sum(aux["dropped"])

    run = {c: jax.jit(lambda t, c=c: streams_of(t, c)) for c in (MAIN_CAPACITY, 0.0)}
    Hs, Ps, exact_reruns = [], [], 0
    t0 = time.time()
    for i in range(0, len(windows), batch):
        tok = jnp.asarray(windows[i:i + batch])
        H, P, dropped = run[MAIN_CAPACITY](tok)
        if int(dropped) > 0:
            H, P, _ = run[0.0](tok)
            exact_reruns += 1
        Hs.append(np.asarray(H))
        Ps.append(np.asarray(P))
    print(f"{label}: main streams of {len(windows)} windows in {time.time() - t0:.0f} s "
          f"({exact_reruns} batches rerun without capacity)", flush=True)
    return np.concatenate(Hs), np.concatenate(Ps), exact_reruns


def export_mtp(cfg, mp, bias, model_dir):
    """Write mtp.0.* beside the main tensors (copied byte for byte); config; SHA256SUMS."""
    model_dir = Path(model_dir)
    raw, meta = read_safetensors(model_dir / "model.safetensors")
    tensors = {n: (dt, shape, np.ascontiguousarray(arr).tobytes())
               for n, (dt, shape, arr) in raw.items() if not n.startswith("mtp.")}
    mp = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), mp)
    out = layer_tensors(PREFIX, mp["block"], np.asarray(bias), cfg["n_routed_experts"])
    for name in ("e_proj", "h_proj"):
        q, s = encode_fp8_block(mp[name])
        out[f"{PREFIX}{name}.weight"] = _t("F8_E4M3", q)
        out[f"{PREFIX}{name}.scale"] = _t("F8_E8M0", s)
    for name in ("enorm", "hnorm", "norm"):
        out[f"{PREFIX}{name}.weight"] = _t("BF16", mp[name].astype(ml_dtypes.bfloat16))
    for name in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
        out[f"{PREFIX}{name}"] = _t("F32", mp[name])
    tensors.update(out)
    tmp = model_dir / "model.safetensors.tmp"
    write_safetensors(tmp, tensors, meta or {"format": "pt"})
    os.replace(tmp, model_dir / "model.safetensors")
    conf = json.loads((model_dir / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 1
    tmp = model_dir / "config.json.tmp"
    tmp.write_text(json.dumps(conf, indent=2) + "\n")
    os.replace(tmp, model_dir / "config.json")
    write_sums(model_dir)
    return len(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(HERE.parent.parent / "models" / "keep-tiny"))
    ap.add_argument("--tokenizer", default=str(HERE / "tokenizer.json"))
    ap.add_argument("--train-seqs", type=int, default=192)
    ap.add_argument("--heldout-seqs", type=int, default=24)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=260)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--capacity", type=float, default=2.0)
    ap.add_argument("--bias-rate", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--eval-every", type=int, default=65)
    ap.add_argument("--log", default=str(HERE / "logs" / "train-mtp.jsonl"))
    ap.add_argument("--json", default=str(HERE / "logs" / "train-mtp.json"))
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--init-from", help="start from the mtp.0.* module of this exported model directory "
                    "(one trained on an earlier main model) instead of the last decoder layer")
    args = ap.parse_args()
    t_start = time.time()
    cfg, params, state = load_exported(args.model)
    main_p = jax.tree_util.tree_map(jnp.asarray, params)
    state = jax.tree_util.tree_map(jnp.asarray, state)
    rng = np.random.default_rng(args.seed)
    S = args.seq + 2

    def windows(split, n):
        ids = tokens_cached(args.tokenizer, split)
        starts = rng.integers(0, len(ids) - S, n)
        return np.stack([ids[s:s + S] for s in starts]).astype(np.int32)

    tr_tok, ho_tok = windows("train", args.train_seqs), windows("heldout", args.heldout_seqs)
    # Streams of positions 0..seq (seq + 1 rows): row p feeds the module, row p + 1 is the teacher.
    tr_H, tr_P, tr_rerun = main_streams(cfg, main_p, state, tr_tok[:, :-1], args.batch, "train")
    ho_H, ho_P, ho_rerun = main_streams(cfg, main_p, state, ho_tok[:, :-1], args.batch, "heldout")
    t_streams = time.time() - t_start

    mp = init_mtp(cfg, params, rng)
    bias = jnp.asarray(state["gate_bias"][-1])
    if args.init_from:
        mp, bias = load_mtp(args.init_from, cfg)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.95),
        optax.add_decayed_weights(args.wd, mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)),
    )
    opt_state = opt.init(mp)
    T = args.seq

    def metrics(m, bias, H, P, tok, capacity):
        r = round_mtp(m)
        logits, aux = mtp_forward(cfg, r, bias, main_p, H[:, :T], P[:, :T], tok[:, 1:T + 1], capacity)
        teacher = jax.lax.stop_gradient(finish(cfg, main_p, H[:, 1:T + 1], P[:, 1:T + 1]))
        lp = jax.nn.log_softmax(logits, -1)
        distill = -jnp.mean(jnp.sum(jax.nn.softmax(teacher, -1) * lp, -1))
        true_ce = -jnp.mean(jnp.take_along_axis(lp, tok[:, 2:T + 2, None], -1)[..., 0])
        agree = jnp.mean((jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32))
        tp = jax.nn.log_softmax(teacher, -1)
        teacher_ce = -jnp.mean(jnp.take_along_axis(tp, tok[:, 2:T + 2, None], -1)[..., 0])
        return distill, (true_ce, agree, teacher_ce, aux["load"][0], aux["dropped"][0])

    @jax.jit
    def step_fn(m, o, bias, H, P, tok, lr):
        (loss, (ce, agree, _, load, dropped)), g = jax.value_and_grad(
            lambda m: metrics(m, bias, H, P, tok, args.capacity), has_aux=True)(m)
        upd, o = opt.update(g, o, m)
        m = jax.tree_util.tree_map(lambda a, u: a - lr * u, m, upd)
        bias = bias - args.bias_rate * jnp.sign(load - jnp.mean(load.astype(jnp.float32)))
        return m, o, bias, (loss, ce, agree, dropped, optax.global_norm(g))

    @jax.jit
    def eval_fn(m, bias, H, P, tok):
        loss, (ce, agree, teacher_ce, _, _) = metrics(m, bias, H, P, tok, 0.0)
        return loss, ce, agree, teacher_ce

    def evaluate(m, bias):
        acc = np.zeros(4)
        n = 0
        for i in range(0, len(ho_tok), args.batch):
            sl = slice(i, i + args.batch)
            r = eval_fn(m, bias, jnp.asarray(ho_H[sl]), jnp.asarray(ho_P[sl]), jnp.asarray(ho_tok[sl]))
            acc += np.asarray([float(x) for x in r]) * len(ho_tok[sl])
            n += len(ho_tok[sl])
        d, ce, ag, tce = acc / n
        return {"heldout_distill": d, "heldout_ce_t2": ce, "heldout_top1_agree": ag,
                "heldout_main_ce_t1": tce}

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))

    Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    log = open(args.log, "w")
    first = evaluate(mp, bias)
    rec = {"step": 0, **first, "elapsed_s": time.time() - t_start}
    print(json.dumps(rec), flush=True)
    log.write(json.dumps(rec) + "\n")
    t_train = time.time()
    for step in range(args.steps):
        idx = rng.integers(0, len(tr_tok), args.batch)
        mp, opt_state, bias, m = step_fn(mp, opt_state, bias, jnp.asarray(tr_H[idx]),
                                         jnp.asarray(tr_P[idx]), jnp.asarray(tr_tok[idx]),
                                         jnp.float32(lr_at(step)))
        if step % 10 == 0 or step == args.steps - 1:
            loss, ce, agree, dropped, gnorm = [float(x) for x in m]
            rec = {"step": step + 1, "loss": loss, "ce_t2": ce, "top1_agree": agree,
                   "dropped_frac": dropped / (args.batch * T * cfg["num_experts_per_tok"]),
                   "gnorm": gnorm, "lr": lr_at(step), "elapsed_s": time.time() - t_start}
            if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
                rec.update(evaluate(mp, bias))
            print(json.dumps(rec), flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
    final = evaluate(mp, bias)
    summary = {
        "model": str(args.model), "args": vars(args),
        "train_tokens_positions": int(args.train_seqs * T), "heldout_positions": int(args.heldout_seqs * T),
        "main_stream_batches_rerun_exact": {"train": tr_rerun, "heldout": ho_rerun},
        "streams_seconds": t_streams, "train_seconds": time.time() - t_train,
        "total_seconds": time.time() - t_start, "init": first, "final": final,
    }
    if not args.no_export:
        summary["mtp_tensors_written"] = export_mtp(cfg, mp, bias, args.model)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
