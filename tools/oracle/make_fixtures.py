"""Reference fixtures for keep-tiny from mlx-lm 0.32.2 (the oracle), in float32.

    tools/oracle/.venv/bin/python tools/oracle/make_fixtures.py \
        --model models/keep-tiny --out fixtures/keep-tiny
    tools/oracle/.venv/bin/python tools/oracle/make_fixtures.py \
        --model models/keep-tiny --out fixtures/keep-tiny --check

The model is loaded from the exported (published-format) directory with
`mlx_lm.utils.load_model`: FP8 32x32 residents stay packed as mxfp8 and FP4
experts as mxfp4 (MLX dequantizes them exactly in its kernels); every other
floating parameter, bf16 in the file, is cast to float32 after loading, so the
forward runs in float32 end to end.

Writes three safetensors files, each with metadata format=keep-fixture,
version=1, command=<the command above>, model_sha256, mlx_lm version:
- logits.safetensors: for three held-out sequences i (CPython stdlib files the
  training split never saw; see tools/train/corpus_manifest.tsv):
  `seq{i}.tokens` int32 [T], `seq{i}.positions` int32 [P] and
  `seq{i}.logits` f32 [P, vocab] (the logits at those positions of one
  full-sequence prefill). seq0 is 256 tokens long (> 4x the 64-token window,
  >> 2x the largest compress ratio 4); to stay small it stores every 8th
  position and the last 16. seq1 (64 tokens) and seq2 (19 tokens) store all.
  With them, each layer's window KV rows around their FP8 round trip (as
  `model_ref.py --fp8-kv` writes them): `seq{i}.kv_fp8_in` and
  `seq{i}.kv_fp8_out` f32 [layers, T, head_dim], `seq{i}.kv_fp8_scale_exp`
  int32 [layers, T, head_dim/32], so that a test can show that a divergence is
  a rounding flip (`fp8_flip.py`'s rule) rather than a fault.
- routes.safetensors: for seq0, per layer N `layer{N}.experts` int32 [T, k]
  and `layer{N}.weights` f32 [T, k] (after routed_scaling_factor), each row
  sorted by expert id; captured from mlx-lm's Router.__call__.
- greedy.safetensors: `prompt{j}` int32 and `greedy{j}` int32 [32]: greedy
  decoding, one token at a time with mlx-lm's LayerCache after a prefill of the
  prompt.
--check regenerates into a temporary directory and compares: token ids,
expert ids and greedy tokens exactly, floats with |a-b| <= atol + rtol*|b|.
"""
import argparse
import hashlib
import json
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models import deepseek_v41
from mlx_lm.utils import load_model
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_ref import KvFp8Recorder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "tools" / "train" / "corpus_manifest.tsv"
STDLIB = Path("/root/.pyenv/versions/3.11.7/lib/python3.11")
COMMAND = ("tools/oracle/.venv/bin/python tools/oracle/make_fixtures.py "
           "--model models/keep-tiny --out fixtures/keep-tiny")
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self",
]
LENGTHS = [256, 64, 19]
GREEDY_TOKENS = 32


def heldout_texts():
    for line in MANIFEST.read_text().splitlines():
        if line.startswith("#"):
            continue
        split, digest, _, rel = line.split("\t")
        if split != "heldout":
            continue
        data = (STDLIB / rel).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            sys.exit(f"{STDLIB / rel} does not match the manifest; refusing")
        yield rel, data.decode("utf-8")


def sequences(tok):
    """The first held-out files (manifest order) long enough for each length."""
    out = []
    used = set()
    for n in LENGTHS:
        for rel, text in heldout_texts():
            ids = tok.encode(text).ids
            if rel not in used and len(ids) >= n:
                used.add(rel)
                out.append((rel, np.asarray(ids[:n], np.int32)))
                break
    return out


def load_f32(model_dir):
    model, config = load_model(Path(model_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                          model.parameters()))
    mx.eval(model.parameters())
    return model, config


def generate(model_dir, out_dir):
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, config = load_f32(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    meta = {
        "format": "keep-fixture",
        "version": "1",
        "command": COMMAND,
        "model_sha256": hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest(),
        "mlx_lm": version("mlx-lm"),
        "mlx": version("mlx"),
        "compute_dtype": "float32",
    }

    # (a) logits
    seqs = sequences(tok)
    tensors = {}
    files = {}
    for i, (rel, ids) in enumerate(seqs):
        kv = KvFp8Recorder()
        try:
            logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
        finally:
            kv.close()
        T = len(ids)
        if T > 64:
            pos = sorted(set(range(0, T, 8)) | set(range(T - 16, T)))
        else:
            pos = list(range(T))
        pos = np.asarray(pos, np.int32)
        tensors[f"seq{i}.tokens"] = ids
        tensors[f"seq{i}.positions"] = pos
        tensors[f"seq{i}.logits"] = np.ascontiguousarray(logits[pos])
        for k, v in kv.tensors(len(model.layers)).items():
            tensors[f"seq{i}.{k}"] = np.ascontiguousarray(v)
        files[f"seq{i}"] = rel
    save_file(tensors, str(out_dir / "logits.safetensors"),
              metadata={**meta, "kind": "logits", "sources": json.dumps(files)})

    # (b) routes of seq0, captured from the router
    captured = []
    original = deepseek_v41.Router.__call__

    def hooked(self, x):
        chosen, weights = original(self, x)
        captured.append((np.array(chosen), np.array(weights.astype(mx.float32))))
        return chosen, weights

    deepseek_v41.Router.__call__ = hooked
    try:
        mx.eval(model(mx.array(seqs[0][1])[None]))
    finally:
        deepseek_v41.Router.__call__ = original
    assert len(captured) == config["num_hidden_layers"], len(captured)
    routes = {"tokens": seqs[0][1]}
    for n, (chosen, weights) in enumerate(captured):
        order = np.argsort(chosen, axis=-1, kind="stable")
        routes[f"layer{n}.experts"] = np.take_along_axis(chosen, order, -1).astype(np.int32)
        routes[f"layer{n}.weights"] = np.take_along_axis(weights, order, -1).astype(np.float32)
    save_file(routes, str(out_dir / "routes.safetensors"), metadata={**meta, "kind": "routes"})

    # (c) greedy decoding with the cache
    greedy = {}
    texts = {}
    for j, prompt in enumerate(PROMPTS):
        ids = np.asarray(tok.encode(prompt).ids, np.int32)
        cache = model.make_cache()
        logits = model(mx.array(ids)[None], cache=cache)
        out = []
        for _ in range(GREEDY_TOKENS):
            nxt = int(mx.argmax(logits[0, -1]).item())
            out.append(nxt)
            logits = model(mx.array([[nxt]], dtype=mx.int32), cache=cache)
        greedy[f"prompt{j}"] = ids
        greedy[f"greedy{j}"] = np.asarray(out, np.int32)
        texts[f"prompt{j}"] = prompt
        texts[f"completion{j}"] = tok.decode(out)
    save_file(greedy, str(out_dir / "greedy.safetensors"),
              metadata={**meta, "kind": "greedy", "texts": json.dumps(texts)})
    return texts


def compare(new_dir, old_dir, atol=1e-4, rtol=1e-4):
    ok = True
    for name in ("logits", "routes", "greedy"):
        a = load_file(str(Path(new_dir) / f"{name}.safetensors"))
        b = load_file(str(Path(old_dir) / f"{name}.safetensors"))
        if sorted(a) != sorted(b):
            print(f"{name}: different tensors {sorted(set(a) ^ set(b))}")
            ok = False
            continue
        for k in sorted(a):
            x, y = a[k], b[k]
            if x.shape != y.shape or x.dtype != y.dtype:
                print(f"{name}/{k}: shape/dtype {x.shape} {x.dtype} vs {y.shape} {y.dtype}")
                ok = False
            elif np.issubdtype(x.dtype, np.integer):
                if not np.array_equal(x, y):
                    print(f"{name}/{k}: {int((x != y).sum())} of {x.size} ids differ")
                    ok = False
            else:
                err = np.abs(x - y) - (atol + rtol * np.abs(y))
                if (err > 0).any():
                    print(f"{name}/{k}: max |diff| {float(np.abs(x - y).max()):.3g} over tolerance")
                    ok = False
                else:
                    print(f"{name}/{k}: max |diff| {float(np.abs(x - y).max()):.3g} ok")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "keep-tiny"))
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "keep-tiny"))
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as d:
            generate(args.model, d)
            ok = compare(d, args.out)
        print("fixtures match" if ok else "FIXTURES DIFFER")
        sys.exit(0 if ok else 1)
    texts = generate(args.model, args.out)
    print(json.dumps(texts, indent=1))


if __name__ == "__main__":
    main()
