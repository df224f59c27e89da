#!/usr/bin/env python3
"""mlx-lm's side of keep's forward benchmark (not a test): prefill a deterministic pseudo-random
prompt (the same generator as keep's `model_bench` example), then decode greedily one token at a
time through the reference cache; print one JSON line with median prefill and decode tokens/s.

The model is loaded as mlx-lm loads it (`mlx_lm.utils.load_model`, default dtypes), on the CPU.
Usage: model_bench.py DIR [--prompt-len 512] [--decode 64] [--reps 3] [--f32]
"""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from mlx_lm.utils import load_model


def prompt_tokens(n, vocab):
    s, out = 12345, []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((s >> 33) % vocab)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--f32", action="store_true", help="cast non-quantized weights to f32")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu)
    if a.f32:
        import model_ref

        model, config = model_ref.load_f32(a.model)
    else:
        model, config = load_model(a.model)
    prompt = mx.array([prompt_tokens(a.prompt_len, model.args.vocab_size)])
    pre, dec = [], []
    for _ in range(a.reps):
        cache = model.make_cache()
        t0 = time.perf_counter()
        last = model(prompt, cache=cache)[0, -1]
        mx.eval(last)
        pre.append(a.prompt_len / (time.perf_counter() - t0))
        t1 = time.perf_counter()
        for _ in range(a.decode):
            nxt = mx.argmax(last)
            last = model(nxt.reshape(1, 1), cache=cache)[0, -1]
            mx.eval(last)
        dec.append(a.decode / (time.perf_counter() - t1))
    med = lambda v: sorted(v)[len(v) // 2]
    print(json.dumps({"impl": "mlx-lm", "prompt_len": a.prompt_len, "decode_tokens": a.decode,
                      "reps": a.reps, "f32": a.f32, "prefill_tok_s": round(med(pre), 1),
                      "decode_tok_s": round(med(dec), 1)}))


if __name__ == "__main__":
    main()
