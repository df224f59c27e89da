#!/usr/bin/env python3
"""keep's Qwen3-MoE forward against mlx-lm 0.32.2's `qwen3_moe` on random checkpoints in the
published layouts.

Run from the repository root with the pinned oracle venv:

    tools/oracle/.venv/bin/python tools/oracle/qwen3_conformance.py [--keep target/release/keep]

Checkpoints (in a temporary directory), written by tools/oracle/qwen3_ref.py:
  - odd-bf16: hidden 160, 6 query heads over 2 KV heads of 32, 12 experts top-3 of width 72,
    layer 1 dense (`mlp_only_layers`, width 200), untied head, `norm_topk_prob`;
  - odd-bf16-tied-step2: hidden 96, 3 query heads = 3 KV heads of 16, 10 experts top-1, every
    second layer sparse (`decoder_sparse_step` 2), tied head, no `norm_topk_prob`;
  - odd-fp8: the first shapes in Qwen's FP8 layout (128x128 bfloat16 `weight_scale_inv`
    blocks, partial blocks at every edge); the reference decodes them itself (ml_dtypes);
  - odd-fp8-f32-tied-step2: the second shapes with float32 `amax / 448` scales;
  - mlx4-odd, mlx8-odd, mlx4-tied-step2: mlx-lm's own quantization of a bf16 checkpoint
    (`quantize_model` as `mlx_lm.convert --quantize` runs it, group 64, routers at 8 bits):
    experts stacked in `switch_mlp`, MLX affine `.scales`/`.biases`, a quantized embedding;
    hidden 192 quantizes every projection but the 72-wide experts' `down_proj`, which mlx-lm
    leaves bfloat16 (72 is not a multiple of 64) — mixed layouts in one model; the tied case
    multiplies by the quantized embedding;
For each: a pseudo-random sequence through `keep logits --routes` (one prefill) and the
reference (one forward without cache); top-1 agreement >= 99.5%, mean KL(ref||keep) <= 1e-4
nats per position, routed experts equal on >= 99.9% of (token, MoE layer) pairs; the
reference's 16 greedy tokens (mlx-lm's prompt cache) equal keep's argmax when keep decodes the
prompt and those tokens one at a time with its cache (`keep logits --decode`); keep's decode
logits equal its prefill logits bit for bit.
keep's own `keep synth --format mlx4` of the tiny preset runs against mlx-lm loading it too.
Then the pipeline: `keep synth --family qwen3_moe --preset qwen3-tiny --format fp8` (bf16
power-of-two block scales), `keep repack --resident-format mxfp8` of it (compared with the
reference on its source: the repack is lossless), and a checkpoint calibrated, selected (REAP,
8 of 16 experts) and pruned by keep, which mlx-lm then loads — in bf16, and in the MLX 4-bit
layout (stacked experts, their scales and biases and the quantized router sliced).
Prints PASS/FAIL lines; exit 1 on any failure.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from model_compare import compare  # noqa: E402

MIN_TOP1, MAX_KL, MIN_ROUTES = 0.995, 1e-4, 0.999
PY = sys.executable
REF = ROOT / "tools/oracle/qwen3_ref.py"
FAILS = []

ODD = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 160, "num_hidden_layers": 3, "intermediate_size": 200,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
    "num_experts": 12, "num_experts_per_tok": 3, "moe_intermediate_size": 72,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
    "vocab_size": 300, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "norm_topk_prob": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
TIED_STEP2 = {
    **ODD, "hidden_size": 96, "num_hidden_layers": 4, "intermediate_size": 80,
    "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16,
    "num_experts": 10, "num_experts_per_tok": 1, "moe_intermediate_size": 40,
    "decoder_sparse_step": 2, "mlp_only_layers": [], "tie_word_embeddings": True,
    "norm_topk_prob": False, "rope_theta": 10000.0,
}

# Hidden 192 (a multiple of the group, 64): every projection reading the hidden state is
# quantized; the experts' 72-wide down_proj is not.
MLX_ODD = {**ODD, "hidden_size": 192}
MLX_TIED = {**TIED_STEP2, "hidden_size": 128, "moe_intermediate_size": 64,
            "intermediate_size": 128}


def check(name, ok, detail=""):
    if not ok:
        FAILS.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def run(cmd):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def synth(tmp, tag, cfg, seed, layout):
    c = tmp / f"{tag}.json"
    c.write_text(json.dumps(cfg))
    d = tmp / tag
    run([PY, REF, "synth", d, "--config", c, "--seed", seed, "--layout", layout])
    return d


def case(keep, d, tag, seed, n_tokens, tmp, ref_dir=None):
    """keep on `d` against the reference on `ref_dir` (default `d`: the same checkpoint; a
    lossless repack is compared with the reference on its source)."""
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    toks = np.random.default_rng(seed).integers(0, vocab, n_tokens)
    t = ",".join(map(str, toks))
    ref, mine = tmp / f"{tag}-ref.safetensors", tmp / f"{tag}-keep.safetensors"
    run([PY, REF, "ref", ref_dir or d, "--tokens", t, "--out", ref, "--routes", "--greedy", "16"])
    run([keep, "logits", d, "--tokens", t, "--out", mine, "--routes"])
    r, k = load_file(str(ref)), load_file(str(mine))
    c = compare(r, k)
    # Routes are compared on MoE layers only (dense layers are -1 on both sides).
    moe = (r["routes"] >= 0).all(-1)
    c["route_agreement"] = float((r["routes"] == k["routes"]).all(-1)[moe].mean())
    detail = (f"top1 {c['top1_agreement']:.4f} mean KL {c['mean_kl']:.2e} max|diff| "
              f"{c['max_abs_diff']:.2e} routes {c['route_agreement']:.4f}")
    ok = (c["top1_agreement"] >= MIN_TOP1 and c["mean_kl"] <= MAX_KL
          and c["route_agreement"] >= MIN_ROUTES)
    check(f"qwen3 {tag}: logits and routes agree with mlx-lm", ok, detail)
    greedy = r["greedy"]
    seq = ",".join(map(str, list(toks) + list(greedy[:-1])))
    dec = tmp / f"{tag}-decode.safetensors"
    run([keep, "logits", d, "--tokens", seq, "--out", dec, "--decode"])
    dl = load_file(str(dec))["logits"]
    mine_greedy = dl[len(toks) - 1:].argmax(-1)
    check(f"qwen3 {tag}: 16 greedy tokens (keep's cache decode) equal mlx-lm's",
          np.array_equal(mine_greedy, greedy), f"{mine_greedy.tolist()} vs {greedy.tolist()}")
    same = np.array_equal(dl[: len(toks)], k["logits"])
    check(f"qwen3 {tag}: keep's decode logits equal its prefill logits", same,
          f"max|diff| {float(np.abs(dl[:len(toks)] - k['logits']).max()):.2e}")
    return c


def raw_tensors(d):
    """name -> (dtype, shape, bytes) of every tensor of a checkpoint directory."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            data = fh.read()
        for name, meta in header.items():
            if name != "__metadata__":
                a, b = meta["data_offsets"]
                out[name] = (meta["dtype"], meta["shape"], data[a:b])
    return out


def mlx_bytes_case(keep, tmp, bits):
    """`keep synth --format mlxN` against mlx-lm quantizing `keep synth --format bf16` of the
    same seed: the same tensor names, dtypes, shapes and bytes, and the same `quantization`."""
    src, mine, theirs = tmp / f"bytes-bf16-{bits}", tmp / f"bytes-keep-mlx{bits}", tmp / f"bytes-mlx-lm-{bits}"
    for d, fmt in [(src, "bf16"), (mine, f"mlx{bits}")]:
        run([keep, "synth", "--family", "qwen3_moe", "--preset", "qwen3-tiny", "--format", fmt,
             "--out", d, "--seed", "11"])
    run([PY, REF, "quantize", src, theirs, "--bits", bits])
    a, b = raw_tensors(mine), raw_tensors(theirs)
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    check(f"qwen3 keep synth --format mlx{bits}: every tensor byte-equal to mlx-lm's quantization "
          f"of keep's bf16 synth ({len(b)} tensors)", not differ, f"differ: {differ[:5]}")
    qa = json.loads((mine / "config.json").read_text())["quantization"]
    qb = json.loads((theirs / "config.json").read_text())["quantization"]
    check(f"qwen3 keep synth --format mlx{bits}: config.json quantization equals mlx-lm's",
          qa == qb, f"{qa} vs {qb}")


def pruned_case(keep, tmp, fmt="bf16"):
    """Calibrate a Qwen3-MoE checkpoint on a pack of this repository's docs (keep-tiny's
    tokenizer, so a 4096-token vocabulary), select 8 of 16 experts per MoE layer by REAP, prune;
    the pruned checkpoint (router rows sliced, experts renumbered, num_experts 8) is then
    compared with mlx-lm loading it."""
    cfg = json.loads(json.dumps(ODD))
    cfg.update({"vocab_size": 4096, "num_experts": 16, "num_experts_per_tok": 4,
                "num_hidden_layers": 3, "mlp_only_layers": [1]})
    if fmt != "bf16":
        # Hidden 192: the projections reading the hidden state are MLX affine.
        cfg["hidden_size"] = 192
    tmp = tmp / f"prune-{fmt}"
    tmp.mkdir()
    c = tmp / "prune-src.json"
    c.write_text(json.dumps(cfg))
    d = tmp / "prune-src"
    run([keep, "synth", "--config", c, "--out", d, "--seed", "6", "--format", fmt])
    pack, calib = tmp / "prune-pack", tmp / "prune-run"
    run([keep, "pack", "--from", ROOT / "ARCHITECTURE.md", "--tokenizer",
         ROOT / "models/keep-tiny/tokenizer.json", "--out", pack, "--max-tokens", "256",
         "--held-out-frac", "0"])
    run([keep, "calibrate", d, "--pack", pack, "--out", calib])
    run([keep, "finalize", calib])
    plan, pruned = tmp / "prune-plan.json", tmp / "pruned"
    run([keep, "select", calib, "--keep", "8", "--out", plan, "--no-plot"])
    run([keep, "prune", d, pruned, "--plan", plan])
    run([keep, "verify", pruned])
    pc = json.loads((pruned / "config.json").read_text())
    check(f"qwen3 pruned {fmt}: the pruned checkpoint has num_experts 8", pc["num_experts"] == 8,
          str(pc["num_experts"]))
    tag = "pruned-reap-8-of-16" + ("" if fmt == "bf16" else f"-{fmt}")
    return (pruned, tag, 150)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=str(ROOT / "target/release/keep"))
    ap.add_argument("--json", type=Path, help="also write the numbers of every case here")
    a = ap.parse_args()
    keep = Path(a.keep).resolve()
    results = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        cases = [
            (synth(tmp, "odd-bf16", ODD, 1, "bf16"), "odd-bf16", 150),
            (synth(tmp, "odd-bf16-tied-step2", TIED_STEP2, 2, "bf16"), "odd-bf16-tied-step2", 150),
            (synth(tmp, "odd-fp8", ODD, 3, "fp8"), "odd-fp8", 150),
            (synth(tmp, "odd-fp8-f32", TIED_STEP2, 4, "fp8-f32"), "odd-fp8-f32-tied-step2", 150),
            (synth(tmp, "mlx4-odd", MLX_ODD, 7, "mlx4"), "mlx4-odd", 150),
            (synth(tmp, "mlx8-odd", MLX_ODD, 8, "mlx8"), "mlx8-odd", 150),
            (synth(tmp, "mlx4-tied-step2", MLX_TIED, 9, "mlx4"), "mlx4-tied-step2", 150),
        ]
        d = tmp / "synth-mlx4"
        run([keep, "synth", "--family", "qwen3_moe", "--preset", "qwen3-tiny", "--format", "mlx4",
             "--out", d, "--seed", "5"])
        cases.append((d, "keep-synth-qwen3-tiny-mlx4", 150))
        for bits in (4, 8):
            mlx_bytes_case(keep, tmp, bits)
        # keep synth's own Qwen3-MoE checkpoints (FP8 with bf16 power-of-two block scales),
        # read by mlx-lm through the oracle's FP8 decode; the FP8 one repacked to MXFP8.
        d = tmp / "synth-fp8"
        run([keep, "synth", "--family", "qwen3_moe", "--preset", "qwen3-tiny", "--format", "fp8",
             "--out", d, "--seed", "5"])
        cases.append((d, "keep-synth-qwen3-tiny-fp8", 150))
        run([keep, "repack", d, tmp / "synth-mx", "--resident-format", "mxfp8", "--verify"])
        cases.append((tmp / "synth-mx", "keep-synth-qwen3-tiny-fp8-repacked-mxfp8", 150, d))
        cases.append(pruned_case(keep, tmp))
        cases.append(pruned_case(keep, tmp, "mlx4"))
        for i, (d, tag, n, *ref_dir) in enumerate(cases):
            results[tag] = case(keep, d, tag, 100 + i, n, tmp, *ref_dir)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print(f"qwen3 conformance: {len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
