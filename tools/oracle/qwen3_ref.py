#!/usr/bin/env python3
"""Qwen3-MoE for keep's conformance: random checkpoints in the published layouts, and the
reference forward of mlx-lm 0.32.2's `qwen3_moe` on them.

  qwen3_ref.py synth OUT --config CFG.json --seed S --layout bf16|fp8|fp8-f32
      writes a random checkpoint with Hugging Face's names (`model.layers.N.mlp.experts.E.
      gate_proj.weight`, router `mlp.gate.weight`, `lm_head.weight` unless tied) in
        bf16  every tensor bfloat16 (as Qwen/Qwen3-30B-A3B ships);
        fp8   every attention, expert and dense-MLP projection FP8 E4M3 with a bfloat16
              `weight_scale_inv` per 128x128 block (ceil at the edges; `amax / 448` rounded up
              to bfloat16; Qwen's FP8 releases store these scales as BF16,
              `quantization_config` {quant_method fp8, fmt e4m3, weight_block_size
              [128, 128]}); embedding, head, norms and routers bfloat16;
        fp8-f32  the same with float32 scales (`amax / 448`, DeepSeek-V3's scale_inv dtype);
        mlx4, mlx8  the bf16 checkpoint quantized by mlx-lm itself, as `mlx_lm.convert
              --quantize --q-bits 4|8` does it (`load_model`, `quantize_model` at group 64 with
              the model's own `quant_predicate` — routers at 8 bits —, `save_model`,
              `save_config`): experts stacked in `mlp.switch_mlp.*`, every linear layer and the
              embedding whose input width is a multiple of 64 as uint32 codes with bfloat16
              `.scales`/`.biases` (the others stay bfloat16), `quantization` in config.json.
      Weights are drawn from N(0, 1/fan_in) (routers 4x wider, so routes are decisive), norms
      from 1 + N(0, 0.1).
  qwen3_ref.py quantize SRC OUT --bits 4|8
      mlx-lm's quantization (as in the mlx4/mlx8 layouts) of the bf16 checkpoint SRC.
  qwen3_ref.py fixtures [--root fixtures] [--only NAME]
      writes fixtures/qwen3-tiny-bf16, fixtures/qwen3-tiny-fp8 and fixtures/qwen3-tiny-mlx4
      (checkpoint + the reference's
      ref.safetensors on 48 tokens with routes and 8 greedy tokens) for keep-model's tests.
  qwen3_ref.py ref DIR --tokens 1,2,3 --out FILE [--routes] [--greedy N]
      loads DIR with `mlx_lm.utils.load_model` (an FP8 checkpoint, which mlx-lm's `qwen3_moe`
      cannot read, is first decoded here with ml_dtypes, `e4m3(q) * scale_inv` per block, into a
      float32 copy), casts every parameter to float32 and writes
        tokens int32 [T]; logits f32 [T, vocab] (one prefill from position 0);
        routes int32 [L, T, top_k] (--routes: each MoE layer's chosen experts sorted ascending,
          -1 for dense layers); greedy int32 [N] (--greedy: N tokens decoded greedily with
          mlx-lm's prompt cache after the prompt).
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from safetensors.numpy import save_file

import mlx_lm
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import switch_layers
from mlx_lm.utils import load_model

BLOCK = 128


def is_moe(cfg, layer):
    return (layer not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
            and (layer + 1) % cfg["decoder_sparse_step"] == 0)


def tensors(cfg, rng):
    """name -> (float32 array, quantizable) with Hugging Face's names."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    h, kv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    out = {}

    def lin(name, rows, cols, q=True, wide=1.0):
        out[name] = ((rng.standard_normal((rows, cols)) * wide / np.sqrt(cols)).astype(np.float32), q)

    def norm(name, n):
        out[name] = ((1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32), False)

    out["model.embed_tokens.weight"] = (rng.standard_normal((v, d)).astype(np.float32), False)
    if not cfg["tie_word_embeddings"]:
        lin("lm_head.weight", v, d, q=False)
    norm("model.norm.weight", d)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        norm(p + "input_layernorm.weight", d)
        norm(p + "post_attention_layernorm.weight", d)
        norm(p + "self_attn.q_norm.weight", hd)
        norm(p + "self_attn.k_norm.weight", hd)
        lin(p + "self_attn.q_proj.weight", h * hd, d)
        lin(p + "self_attn.k_proj.weight", kv * hd, d)
        lin(p + "self_attn.v_proj.weight", kv * hd, d)
        lin(p + "self_attn.o_proj.weight", d, h * hd)
        if is_moe(cfg, l):
            i = cfg["moe_intermediate_size"]
            lin(p + "mlp.gate.weight", cfg["num_experts"], d, q=False, wide=4.0)
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                lin(q + "gate_proj.weight", i, d)
                lin(q + "up_proj.weight", i, d)
                lin(q + "down_proj.weight", d, i)
        else:
            i = cfg["intermediate_size"]
            lin(p + "mlp.gate_proj.weight", i, d)
            lin(p + "mlp.up_proj.weight", i, d)
            lin(p + "mlp.down_proj.weight", d, i)
    return out


def bf16_at_least(x):
    """The smallest bfloat16 >= x (x > 0)."""
    b = np.array([x], np.float32).astype(ml_dtypes.bfloat16)
    if float(b[0]) < x:
        b = (b.view(np.uint16) + 1).view(ml_dtypes.bfloat16)
    return b[0]


def fp8_blocks(w, scale_dtype):
    """E4M3 codes and scale_inv per 128x128 block (amax / 448 as Qwen's FP8 export; for bf16
    scales the next bfloat16 up, so no element passes 448)."""
    r, c = w.shape
    sr, sc = -(-r // BLOCK), -(-c // BLOCK)
    scale = np.zeros((sr, sc), scale_dtype)
    q = np.zeros((r, c), ml_dtypes.float8_e4m3fn)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = np.float32(max(float(np.abs(blk).max()), 1e-12) / 448.0)
            if scale_dtype != np.float32:
                s = np.float32(bf16_at_least(s))
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).astype(
                ml_dtypes.float8_e4m3fn)
    return q, scale


def fp8_decode(q, scale):
    w = q.astype(np.float32)
    scale = scale.astype(np.float32)
    r, c = w.shape
    s = np.repeat(np.repeat(scale, BLOCK, 0), BLOCK, 1)[:r, :c]
    return w * s


def quantize(src, out, bits):
    """What `mlx_lm.convert --quantize --q-bits BITS --q-group-size 64` writes for the bf16
    checkpoint `src` (its steps without the tokenizer, which these random checkpoints do not
    have)."""
    from mlx_lm.utils import quantize_model, save_config, save_model
    model, config = load_model(src, lazy=True)
    model, config = quantize_model(model, config, 64, bits, mode="affine")
    save_model(out, model)
    save_config(config, config_path=out / "config.json")


def synth_mlx(out, cfg, seed, bits):
    with tempfile.TemporaryDirectory() as td:
        src = Path(td) / "bf16"
        synth(src, cfg, seed, "bf16")
        quantize(src, out, bits)


def synth(out, cfg, seed, layout):
    if layout.startswith("mlx"):
        return synth_mlx(out, cfg, seed, int(layout[3:]))
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=False)
    st = {}
    for name, (w, q) in tensors(cfg, rng).items():
        if layout.startswith("fp8") and q:
            codes, scale = fp8_blocks(w, np.float32 if layout == "fp8-f32" else ml_dtypes.bfloat16)
            st[name] = codes
            st[name + "_scale_inv"] = scale
        else:
            st[name] = w.astype(ml_dtypes.bfloat16)
    cfg = dict(cfg)
    if layout.startswith("fp8"):
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                      "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(st, str(out / "model.safetensors"), metadata={"format": "pt"})


DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F32": np.float32,
          "F16": np.float16}


def read_raw(path):
    """Every tensor of a shard from its header and bytes (numpy's safetensors loader cannot
    hold FP8)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        data = fh.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


def decoded_copy(d, tmp):
    """An FP8 checkpoint decoded to float32 (same names, no quantization_config)."""
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config", None)
    st = {}
    for f in sorted(d.glob("*.safetensors")):
        st.update(read_raw(f))
    out = {}
    for name, a in st.items():
        if name.endswith("_scale_inv"):
            continue
        if a.dtype == ml_dtypes.float8_e4m3fn:
            out[name] = fp8_decode(a, st[name + "_scale_inv"])
        else:
            out[name] = a.astype(np.float32)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    save_file(out, str(tmp / "model.safetensors"))
    return tmp


def load_f32(d, tmp):
    cfg = json.loads((d / "config.json").read_text())
    if (cfg.get("quantization_config") or {}).get("quant_method") == "fp8":
        d = decoded_copy(d, tmp / "decoded")
    model, config = load_model(d)
    cast = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())
            if v.dtype in (mx.bfloat16, mx.float16)]
    model.update(tree_unflatten(cast))
    mx.eval(model.parameters())
    return model, config


class RouteRecorder:
    """Wraps SwitchGLU.__call__ (called once per MoE layer with the chosen experts)."""

    def __init__(self):
        self.calls = []
        self._orig = switch_layers.SwitchGLU.__call__
        rec = self

        def hooked(mod, x, indices):
            rec.calls.append(np.sort(np.array(indices), axis=-1).astype(np.int32))
            return rec._orig(mod, x, indices)

        switch_layers.SwitchGLU.__call__ = hooked

    def close(self):
        switch_layers.SwitchGLU.__call__ = self._orig


def ref(args):
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    with tempfile.TemporaryDirectory() as td:
        model, cfg = load_f32(args.model, Path(td))
    out = {"tokens": np.array(tokens, dtype=np.int32)}
    rec = RouteRecorder() if args.routes else None
    logits = model(mx.array([tokens]))[0].astype(mx.float32)
    mx.eval(logits)
    out["logits"] = np.array(logits)
    if rec is not None:
        rec.close()
        n, k, t = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], len(tokens)
        routes = np.full((n, t, k), -1, np.int32)
        moe = [l for l in range(n) if is_moe(cfg, l)]
        assert len(rec.calls) == len(moe), (len(rec.calls), moe)
        for l, c in zip(moe, rec.calls):
            routes[l] = c.reshape(t, k)
        out["routes"] = routes
    if args.greedy:
        cache = mlx_cache.make_prompt_cache(model)
        step = model(mx.array([tokens]), cache=cache)[0, -1].astype(mx.float32)
        chosen = []
        for _ in range(args.greedy):
            mx.eval(step)
            nxt = int(mx.argmax(step).item())
            chosen.append(nxt)
            step = model(mx.array([[nxt]]), cache=cache)[0, -1].astype(mx.float32)
        out["greedy"] = np.array(chosen, dtype=np.int32)
    meta = {"format": "keep-model-ref", "version": "1",
            "command": " ".join(["tools/oracle/qwen3_ref.py"] + sys.argv[1:]),
            "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(args.out), metadata=meta)


FIXTURE_CONFIGS = {
    # Two layers: MoE (6 experts top-2, GQA 4 heads over 2) then dense (`mlp_only_layers`).
    "qwen3-tiny-bf16": ({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 48,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
        "vocab_size": 128, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "max_position_embeddings": 512, "norm_topk_prob": True,
        "bos_token_id": 1, "eos_token_id": 2}, "bf16", 21),
    # Odd widths in FP8 blocks of 128 (hidden 136: a partial block of 8), tied head.
    "qwen3-tiny-fp8": ({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 136, "num_hidden_layers": 2, "intermediate_size": 48,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
        "vocab_size": 128, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 512, "norm_topk_prob": True,
        "bos_token_id": 1, "eos_token_id": 2}, "fp8", 22),
    # mlx-lm's 4-bit quantization (`quantize_model`, group 64, routers at 8 bits): experts
    # stacked in `switch_mlp`, quantized embedding used as the tied head; the dense MLP's
    # 48-wide `down_proj` stays bfloat16 (48 is not a multiple of 64).
    "qwen3-tiny-mlx4": ({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 48,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "decoder_sparse_step": 1, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
        "vocab_size": 128, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 512, "norm_topk_prob": True,
        "bos_token_id": 1, "eos_token_id": 2}, "mlx4", 23),
}


def fixtures(root, only=None):
    """fixtures/qwen3-tiny-*: checkpoint + mlx-lm's `ref.safetensors` (48 tokens, routes, 8
    greedy tokens), what keep-model's tests/qwen3.rs checks without Python (`only`: that one)."""
    for name, (cfg, layout, seed) in FIXTURE_CONFIGS.items():
        if only and name != only:
            continue
        d = root / name
        if d.exists():
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        synth(d, cfg, seed, layout)
        toks = np.random.default_rng(seed).integers(0, cfg["vocab_size"], 48)
        ref(argparse.Namespace(model=d, tokens=",".join(map(str, toks)),
                               out=d / "ref.safetensors", routes=True, greedy=8))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth")
    s.add_argument("out", type=Path)
    s.add_argument("--config", type=Path, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--layout", choices=["bf16", "fp8", "fp8-f32", "mlx4", "mlx8"], default="bf16")
    r = sub.add_parser("ref")
    r.add_argument("model", type=Path)
    r.add_argument("--tokens", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--routes", action="store_true")
    r.add_argument("--greedy", type=int, default=0)
    q = sub.add_parser("quantize")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("--bits", type=int, choices=[4, 8], required=True)
    f = sub.add_parser("fixtures")
    f.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2] / "fixtures")
    f.add_argument("--only", choices=sorted(FIXTURE_CONFIGS), help="write this fixture only")
    a = ap.parse_args()
    if a.cmd == "fixtures":
        fixtures(a.root, a.only)
    elif a.cmd == "quantize":
        quantize(a.src, a.out, a.bits)
    elif a.cmd == "synth":
        synth(a.out, json.loads(a.config.read_text()), a.seed, a.layout)
    else:
        ref(a)


if __name__ == "__main__":
    main()
