#!/usr/bin/env python3
"""keep's gpt-oss forward (`model_type` `gpt_oss`: gpt-oss-20b, gpt-oss-120b) against
transformers 5.23's `GptOssForCausalLM` (the MXFP4 experts dequantized on the CPU with
transformers' own `convert_moe_packed_tensors`), and mlx-lm 0.32.2's `gpt_oss` as a second
reference, on a random checkpoint of odd shapes written in the published layout.

Run from the repository root with the pinned oracle venv:

    tools/oracle/.venv/bin/python tools/oracle/gpt_oss_conformance.py [--keep target/release/keep]
    tools/oracle/.venv/bin/python tools/oracle/gpt_oss_conformance.py --fixture fixtures/gpt-oss

The checkpoint (`ODD` below): hidden 96 (three MXFP4 blocks), intermediate 160, 4 layers
alternating sliding (window 7, shorter than the sequence) and full attention, 6 query heads
over 2 KV heads of 20, random attention sinks, q/k/v/o biases, 10 experts top-3 with router
and expert biases, YaRN RoPE as published (theta 150000, factor 32, original context 4096,
`"truncate": false`), untied head. Dense weights bf16; the experts MXFP4 exactly as OpenAI
publishes them (`gate_up_proj_blocks` U8 [E, 2I, D/32, 16] with gate and up rows interleaved,
`_scales` U8 [E, 2I, D/32], `_bias` bf16; `down_proj_*` likewise), the expert scales large enough
that the SwiGLU clamp (limit 7) bites. A second variant says `"truncate": true`.

For each: a pseudo-random sequence through `keep logits --routes` (one prefill) and transformers
(one forward without cache): top-1 agreement >= 99.5%, mean KL(ref||keep) <= 1e-4 nats per
position, routed experts equal on >= 99.9% of (token, layer) pairs; keep's logits decoding the
sequence one token at a time (`keep logits --decode`) equal its prefill logits bit for bit;
`keep run` (greedy, exact kernels; the checkpoint carries a word-level `tokenizer.json`, token
`i` the word `t<i>`) continues a 20-token prompt with transformers' greedy tokens; mlx-lm against
keep and transformers. mlx-lm's `YarnRoPE` always rounds the correction range
(it does not read `truncate`), OpenAI's code never does: on the `truncate: false` checkpoint
mlx-lm runs once as shipped (reported, expected to differ) and once with its frequencies
recomputed without the rounding (checked); on the `truncate: true` one it runs as shipped.

`--fixture DIR` writes a small checkpoint (`TINY`) and transformers' logits and routes of a
fixed sequence (`reference.safetensors`: `tokens`, `logits`, `routes`) for keep-model's test.
Prints PASS/FAIL lines; exit 1 on any failure.
"""
import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file as np_save_file
from safetensors.torch import load_file as torch_load, save_file as torch_save

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from model_compare import compare  # noqa: E402

MIN_TOP1, MAX_KL, MIN_ROUTES = 0.995, 1e-4, 0.999
FAILS = []

ODD = dict(
    vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
    num_attention_heads=6, num_key_value_heads=2, head_dim=20,
    num_local_experts=10, num_experts_per_tok=3, sliding_window=7,
    layer_types=["sliding_attention", "full_attention"] * 2,
    rope_theta=150000.0, max_position_embeddings=4096,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1,
)

# The smallest shapes that still exercise every part (the committed fixture).
TINY = dict(ODD, vocab_size=67, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


def run(cmd):
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def bf16(a):
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)


def write(cfg_kw, seed, d):
    """A random gpt-oss checkpoint of `cfg_kw` in the published layout, in directory `d`."""
    rng = np.random.default_rng(seed)
    c = cfg_kw
    D, I, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    H, KV, HD, V = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]
    t = {}

    def mat(name, r, cols, scale=1.0):
        t[name] = bf16(rng.standard_normal((r, cols)) * scale / math.sqrt(cols))

    def vec(name, n, mean=0.0, std=0.1):
        t[name] = bf16(mean + std * rng.standard_normal(n))

    mat("model.embed_tokens.weight", V, D, math.sqrt(D))
    mat("lm_head.weight", V, D)
    vec("model.norm.weight", D, 1.0)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        vec(p + "input_layernorm.weight", D, 1.0)
        vec(p + "post_attention_layernorm.weight", D, 1.0)
        for n, r, cols in [("q_proj", H * HD, D), ("k_proj", KV * HD, D), ("v_proj", KV * HD, D),
                           ("o_proj", D, H * HD)]:
            mat(p + f"self_attn.{n}.weight", r, cols, 2.0 if n in ("q_proj", "k_proj") else 1.0)
            vec(p + f"self_attn.{n}.bias", r)
        vec(p + "self_attn.sinks", H, 0.5, 1.0)
        mat(p + "mlp.router.weight", E, D, 2.0)
        vec(p + "mlp.router.bias", E, 0.0, 0.5)
        for stem, r, cols in [("gate_up_proj", 2 * I, D), ("down_proj", D, I)]:
            g = cols // 32
            t[p + f"mlp.experts.{stem}_blocks"] = torch.from_numpy(
                rng.integers(0, 256, (E, r, g, 16), dtype=np.uint8))
            # 2^-3 .. 2^-1 on gate-up (the clamp at 7 bites), smaller on down.
            lo, hi = (124, 127) if stem == "gate_up_proj" else (120, 123)
            t[p + f"mlp.experts.{stem}_scales"] = torch.from_numpy(
                rng.integers(lo, hi, (E, r, g), dtype=np.uint8))
            vec(p + f"mlp.experts.{stem}_bias", (E, r), 0.0, 0.5)
    d.mkdir(parents=True, exist_ok=True)
    torch_save(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(c, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
               quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                   "model.layers.*.self_attn", "model.layers.*.mlp.router",
                   "model.embed_tokens", "lm_head"]})
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    # A word-level tokenizer (token i is the word `t<i>`), so that `keep run` can take a prompt.
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def reference_model(d):
    """transformers' GptOssForCausalLM in float32 with checkpoint `d`'s weights, the MXFP4
    experts dequantized by transformers' `convert_moe_packed_tensors`."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    kw = json.loads((d / "config.json").read_text())
    kw.pop("quantization_config")
    kw["rope_parameters"] = dict(kw.pop("rope_scaling"), rope_theta=kw.pop("rope_theta"))
    cfg = GptOssConfig(**{k: v for k, v in kw.items() if k not in ("model_type", "architectures")})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = GptOssForCausalLM(cfg).float().eval()
    sd = torch_load(str(d / "model.safetensors"))
    dec = {}
    for k, v in sd.items():
        if k.endswith("_scales"):
            continue
        if k.endswith("_blocks"):
            base = k[: -len("_blocks")]
            dec[base] = convert_moe_packed_tensors(v, sd[base + "_scales"], dtype=torch.float32)
        else:
            dec[k] = v.float()
    missing, unexpected = model.load_state_dict(dec, strict=False)
    assert not [m for m in missing if "rotary" not in m], missing
    assert not unexpected, unexpected
    return model


def reference(model, tokens):
    """transformers' logits [T, vocab] and sorted routes [layers, T, k]."""
    routes = {}
    hooks = [layer.mlp.router.register_forward_hook(
        lambda m, i, o, l=l: routes.__setitem__(l, o[2].detach().numpy()))
        for l, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    for h in hooks:
        h.remove()
    r = np.stack([np.sort(routes[l], -1) for l in range(len(model.model.layers))]).astype(np.int32)
    return logits, r


def untruncated_freqs(dims, base, y):
    """mlx-lm YarnRoPE's `_freqs` (periods) without its floor / ceil: OpenAI's frequencies."""
    import mlx.core as mx

    def corr(rot):
        return dims * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (
            2 * math.log(base))
    low, high = max(corr(y["beta_fast"]), 0), min(corr(y["beta_slow"]), dims - 1)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inter = y["factor"] * extra
    return (inter * extra) / (inter * mask + extra * (1 - mask))


def mlx_logits(d, tokens, untruncate=False):
    """mlx-lm's logits on checkpoint `d` (its own loader and MXFP4 kernels), or None when
    mlx-lm cannot run here; `untruncate` recomputes its YaRN frequencies without rounding."""
    try:
        import mlx.core as mx
        from mlx_lm.utils import load_model
    except Exception as e:  # noqa: BLE001
        print(f"mlx-lm unavailable: {e}")
        return None
    model, cfg = load_model(Path(d))
    model.set_dtype(mx.float32)
    if untruncate:
        y = cfg["rope_scaling"]
        f = untruncated_freqs(cfg["head_dim"], cfg["rope_theta"], y)
        for layer in model.model.layers:
            layer.self_attn.rope._freqs = f
    out = model(mx.array([tokens]))
    return np.array(out[0].astype(mx.float32))


def case(keep, d, tag, tokens, tmp, truncated):
    ref_logits, ref_routes = reference(reference_model(d), tokens)
    t = ",".join(map(str, tokens))
    mine = tmp / f"{tag}-keep.safetensors"
    run([keep, "logits", d, "--tokens", t, "--out", mine, "--routes"])
    k = load_file(str(mine))
    c = compare({"logits": ref_logits, "routes": ref_routes}, k)
    detail = (f"top1 {c['top1_agreement']:.4f} mean KL {c['mean_kl']:.2e} max|diff| "
              f"{c['max_abs_diff']:.2e} routes {c.get('route_agreement', 0):.4f}")
    ok = (c["top1_agreement"] >= MIN_TOP1 and c["mean_kl"] <= MAX_KL
          and c.get("route_agreement", 0) >= MIN_ROUTES)
    check(f"gpt_oss {tag}: keep's logits and routes agree with transformers", ok, detail)
    dec = tmp / f"{tag}-decode.safetensors"
    run([keep, "logits", d, "--tokens", t, "--out", dec, "--decode"])
    dl = load_file(str(dec))["logits"]
    check(f"gpt_oss {tag}: keep's decode logits equal its prefill logits",
          np.array_equal(dl, k["logits"]),
          f"max|diff| {float(np.abs(dl - k['logits']).max()):.2e}")
    # `keep run` (greedy, exact kernels) against transformers' greedy continuation.
    prompt, n = tokens[:20], 12
    model = reference_model(d)
    want = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([want])).logits[0, -1].argmax())
            want.append(nxt)
            if nxt in (json.loads((d / "config.json").read_text()).get("eos_token_id"),):
                break
    r = subprocess.run([str(keep), "run", str(d), "--prompt", " ".join(f"t{i}" for i in prompt),
                        "--max-tokens", str(n), "--temperature", "0", "--kernels", "exact"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    import re
    # keep run prints the prompt, then the generated text.
    got = [int(x) for x in re.findall(r"t(\d+)", r.stdout)]
    check(f"gpt_oss {tag}: keep run's greedy tokens equal transformers' greedy continuation",
          got == want, f"keep {got[len(prompt):]} transformers {want[len(prompt):]}")
    m = mlx_logits(d, tokens, untruncate=not truncated)
    if m is not None:
        cm = compare({"logits": ref_logits}, {"logits": m})
        ck = compare({"logits": m}, {"logits": k["logits"]})
        how = "as shipped" if truncated else "with its YaRN rounding removed"
        check(f"gpt_oss {tag}: mlx-lm ({how}) agrees with keep and transformers",
              min(cm["top1_agreement"], ck["top1_agreement"]) >= MIN_TOP1
              and max(cm["mean_kl"], ck["mean_kl"]) <= MAX_KL,
              f"vs transformers top1 {cm['top1_agreement']:.4f} mean KL {cm['mean_kl']:.2e}; "
              f"vs keep top1 {ck['top1_agreement']:.4f} mean KL {ck['mean_kl']:.2e}")
        if not truncated:
            s = compare({"logits": ref_logits}, {"logits": mlx_logits(d, tokens)})
            print(f"INFO gpt_oss {tag}: mlx-lm as shipped (rounds the YaRN correction range) vs "
                  f"transformers: top1 {s['top1_agreement']:.4f} mean KL {s['mean_kl']:.2e}")
    return c


def fixture(out):
    """The committed fixture: TINY and transformers' logits and routes of a fixed sequence."""
    out = Path(out)
    write(TINY, 7, out)
    tokens = np.random.default_rng(7).integers(0, TINY["vocab_size"], 24).tolist()
    logits, routes = reference(reference_model(out), tokens)
    np_save_file({"tokens": np.array(tokens, np.int32), "logits": logits, "routes": routes},
                 str(out / "reference.safetensors"))
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", default=str(ROOT / "target/release/keep"))
    ap.add_argument("--fixture", help="write the small fixture checkpoint to this directory")
    a = ap.parse_args()
    if a.fixture:
        fixture(a.fixture)
        return
    keep = Path(a.keep).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokens = np.random.default_rng(11).integers(0, ODD["vocab_size"], 150).tolist()
        d = tmp / "odd"
        write(ODD, 3, d)
        case(keep, d, "odd", tokens, tmp, truncated=False)
        dt = tmp / "odd-truncate"
        write(dict(ODD, rope_scaling=dict(ODD["rope_scaling"], truncate=True)), 3, dt)
        case(keep, dt, "odd-truncate", tokens, tmp, truncated=True)
    if FAILS:
        print(f"{len(FAILS)} failed")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
