#!/usr/bin/env python3
"""The reference forward pass of a DeepSeek-V4.1 checkpoint, for keep's model conformance.

Loads a checkpoint directory exactly as mlx-lm 0.32.2 does (`mlx_lm.utils.load_model`, which
runs `deepseek_v41.Model.sanitize` and keeps FP8 32x32 / MXFP8 / FP4 weights packed), casts every
non-quantized parameter to float32 (quantized layers then dequantize to float32 because their
input is float32), and writes a safetensors file with

  tokens   int32  [T]               the input token ids
  logits   f32    [T, vocab]        one prefill of all T tokens from position 0
  routes   int32  [L, T, top_k]     (--routes) each layer's chosen experts, sorted ascending
  route_weights f32 [L, T, top_k]   (--routes) their gate weights, in the same order
  greedy   int32  [N]               (--greedy N) N tokens decoded greedily with the reference cache
                                    after the prompt (prefill of the prompt, then one token a step)
  greedy_logits f32 [N, vocab]      (--greedy N) the logits each greedy step chose from
  kv_fp8_in  f32  [L, T, head_dim]  (--fp8-kv) each layer's window KV rows of the prefill as they
                                    enter mlx-lm's `_fake_quant_fp8` (after the norm and RoPE)
  kv_fp8_out f32  [L, T, head_dim]  (--fp8-kv) the same rows after the FP8 round trip
  kv_fp8_scale_exp int32 [L, T, head_dim/32]  (--fp8-kv) each block's power-of-two scale,
                                    computed with the round trip's own ops

Metadata: format=keep-model-ref, version=1, command=<this command line>, mlx / mlx-lm versions.

Engram layers (`engram_layer_ids`), which mlx-lm refuses, are added from engram_ref.py (the
published module transcribed to torch): mlx-lm's refusal is lifted while loading (it only
guards the missing module; its sanitize drops `.engram.` tensors), every call hashes its tokens
first (the released inference's stateful hash, so the greedy decode with the reference cache
hashes as the released code does), and each Engram layer's module is applied to the streams
right before that decoder layer runs, as the released `Transformer.forward` does.

Usage: model_ref.py DIR --tokens 1,2,3 --out FILE.safetensors [--routes] [--greedy N] [--fp8-kv]
       model_ref.py DIR --tokens-file ids.npy ...   (int array, 1-D)
"""
import argparse
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from safetensors.numpy import save_file

import mlx_lm
from mlx_lm.models import deepseek_v41
from mlx_lm.utils import load_model


ENGRAM = None  # engram_ref.EngramModel of the loaded checkpoint, when it has Engram layers


def _install_engram_hooks():
    if getattr(deepseek_v41, "_keep_engram_hooked", False):
        return
    deepseek_v41._keep_engram_hooked = True
    model_call = deepseek_v41.Model.__call__
    layer_call = deepseek_v41.DecoderLayer.__call__

    def call(self, inputs, cache=None):
        if ENGRAM is not None:
            start = cache[0].offset if cache else 0
            ENGRAM.step(np.array(inputs), start)
        return model_call(self, inputs, cache)

    def layer(self, streams, pre_mix, **kw):
        if ENGRAM is not None and self.layer_idx in ENGRAM.layers:
            streams = mx.array(ENGRAM.apply(self.layer_idx, np.array(streams.astype(mx.float32))))
        return layer_call(self, streams, pre_mix, **kw)

    deepseek_v41.Model.__call__ = call
    deepseek_v41.DecoderLayer.__call__ = layer


def load_f32(path: Path):
    global ENGRAM
    import json

    cfg = json.loads((Path(path) / "config.json").read_text())
    if {**cfg, **cfg.get("text_config", {})}.get("engram_layer_ids"):
        from engram_ref import EngramModel

        guard = deepseek_v41.ModelArgs.__post_init__
        deepseek_v41.ModelArgs.__post_init__ = lambda self: None
        try:
            model, config = load_model(Path(path))
        finally:
            deepseek_v41.ModelArgs.__post_init__ = guard
        ENGRAM = EngramModel(Path(path))
        _install_engram_hooks()
    else:
        ENGRAM = None
        model, config = load_model(Path(path))
    params = tree_flatten(model.parameters())
    cast = [
        (k, v.astype(mx.float32))
        for k, v in params
        if v.dtype in (mx.bfloat16, mx.float16)
    ]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())
    return model, config


class RouteRecorder:
    """Wraps Router.__call__ and records the chosen experts per call (one call per layer)."""

    def __init__(self):
        self.calls = []
        self.weights = []
        self._orig = deepseek_v41.Router.__call__
        rec = self

        def hooked(router, x):
            chosen, weights = rec._orig(router, x)
            c = np.array(chosen)
            order = np.argsort(c, axis=-1, kind="stable")
            rec.calls.append(np.take_along_axis(c, order, -1).astype(np.int32))
            rec.weights.append(np.take_along_axis(np.array(weights.astype(mx.float32)), order, -1))
            return chosen, weights

        deepseek_v41.Router.__call__ = hooked

    def close(self):
        deepseek_v41.Router.__call__ = self._orig


class KvFp8Recorder:
    """Wraps `_fake_quant_fp8` (called once per layer on the window KV rows) and keeps its input,
    output and block scale exponents, unevaluated until the forward is done."""

    def __init__(self):
        self.calls = []
        self._orig = deepseek_v41._fake_quant_fp8
        rec = self

        def hooked(x, block_size=32):
            out = rec._orig(x, block_size)
            blocks = x.astype(mx.float32).reshape(*x.shape[:-1], -1, block_size)
            amax = mx.maximum(mx.max(mx.abs(blocks), axis=-1), 1e-4)
            rec.calls.append((x.astype(mx.float32), out.astype(mx.float32),
                              mx.ceil(mx.log2(amax / 448.0))))
            return out

        deepseek_v41._fake_quant_fp8 = hooked

    def close(self):
        deepseek_v41._fake_quant_fp8 = self._orig

    def tensors(self, n_layers):
        assert len(self.calls) == n_layers, (len(self.calls), n_layers)
        mx.eval([a for c in self.calls for a in c])
        return {
            "kv_fp8_in": np.stack([np.array(c[0])[0] for c in self.calls]),
            "kv_fp8_out": np.stack([np.array(c[1])[0] for c in self.calls]),
            "kv_fp8_scale_exp": np.stack([np.array(c[2])[0] for c in self.calls]).astype(np.int32),
        }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=str, default=None)
    ap.add_argument("--tokens-file", type=Path, default=None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--routes", action="store_true")
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--fp8-kv", action="store_true")
    args = ap.parse_args(argv)
    if args.tokens is not None:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    elif args.tokens_file is not None:
        tokens = [int(t) for t in np.load(args.tokens_file).reshape(-1)]
    else:
        ap.error("give --tokens or --tokens-file")
    model, _ = load_f32(args.model)
    if ENGRAM is not None:
        from engram_ref import check_hashers

        check_hashers(ENGRAM.layout, tokens)
    n_layers = len(model.layers)
    out = {"tokens": np.array(tokens, dtype=np.int32)}

    rec = RouteRecorder() if args.routes else None
    kv = KvFp8Recorder() if args.fp8_kv else None
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    mx.eval(logits)
    out["logits"] = np.array(logits)
    if kv is not None:
        kv.close()
        out.update(kv.tensors(n_layers))
    if rec is not None:
        rec.close()
        assert len(rec.calls) == n_layers
        out["routes"] = np.stack([c.reshape(len(tokens), -1) for c in rec.calls])
        out["route_weights"] = np.stack([w.reshape(len(tokens), -1) for w in rec.weights])

    if args.greedy:
        if ENGRAM is not None:
            ENGRAM.reset()
        cache = model.make_cache()
        step = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        chosen, step_logits = [], []
        for _ in range(args.greedy):
            mx.eval(step)
            step_logits.append(np.array(step))
            nxt = int(mx.argmax(step).item())
            chosen.append(nxt)
            step = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
        out["greedy"] = np.array(chosen, dtype=np.int32)
        out["greedy_logits"] = np.stack(step_logits).astype(np.float32)

    meta = {
        "format": "keep-model-ref",
        "version": "1",
        "command": " ".join(["tools/oracle/model_ref.py"] + (argv or sys.argv[1:])),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)


if __name__ == "__main__":
    main()
