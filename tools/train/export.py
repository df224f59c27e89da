"""Write a training checkpoint as a published-format DeepSeek-V4.1 directory.

    .venv/bin/python export.py --ckpt runs/keep-tiny/ckpt.pkl --out ../../models/keep-tiny
    .venv/bin/python export.py --init --out /tmp/keep-tiny-init      # the untrained model
    .venv/bin/python export.py --sums-only --out ../../models/keep-tiny

Formats (the inverse of mlx-lm's sanitize):
- FP8 E4M3FN residents (attn wq_a, wq_b, wkv, wo_a, wo_b, indexer.wq_b, shared
  experts), `.scale` F8_E8M0 [ceil(out/32), ceil(in/32)], exponent
  ceil(log2(amax/448)) per 32x32 tile;
- FP4 E2M1 routed experts, `.weight` I8 [out, in/2] (element 2j in the low
  nibble), `.scale` F8_E8M0 [out, in/32], exponent ceil(log2(amax/6));
- F32: hyper-connection fn/base/scale, attn_sink, compressor.*, gate.bias,
  gate.bias_vl; BF16 everything else.
The encoders round exactly as model.py's fake-quantization (the QAT phase), so
the shipped weights are the weights that were trained and evaluated.
"""
import argparse
import hashlib
import json
import pickle
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from model import CONFIG, FP4_LUT, init_params, init_state, layer_roles

HERE = Path(__file__).resolve().parent

DT_NAMES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I32": 4, "U8": 1}



CHAT_TEMPLATE = (
    "{%- for message in messages %}\n# {{ message['role'] }}:\n{{ message['content'] }}\n"
    "{% endfor %}\n{%- if add_generation_prompt %}\n# assistant:\n{% endif %}"
)

def _round_fp4_idx(mag):
    idx = np.zeros(mag.shape, np.int32)
    for t in (0.25, 1.25, 2.5, 5.0):
        idx += (mag > t)
    for t in (0.75, 1.75, 3.5):
        idx += (mag >= t)
    return idx


def _exponent(amax, max_elem):
    amax = np.maximum(amax.astype(np.float32), np.float32(2.0**-120))
    e = np.ceil(np.log2(amax / np.float32(max_elem)))
    return np.clip(e, -127, 127).astype(np.int32)


def encode_fp8_block(w):
    """w [out, in] f32 -> (E4M3 bytes [out, in] u8, E8M0 [ceil(out/32), ceil(in/32)] u8)."""
    o, i = w.shape
    assert o % 32 == 0 and i % 32 == 0, w.shape
    t = w.reshape(o // 32, 32, i // 32, 32)
    e = _exponent(np.max(np.abs(t), axis=(1, 3)), 448.0)  # [o/32, i/32]
    scale = np.exp2(e.astype(np.float32))[:, None, :, None]
    q = (t / scale).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(o, i).view(np.uint8), (e + 127).astype(np.uint8)


def decode_fp8_block(q, s):
    o, i = q.shape
    v = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(o // 32, 32, i // 32, 32)
    scale = np.exp2(s.astype(np.float32) - 127)[:, None, :, None]
    return (v * scale).reshape(o, i)


def encode_fp4(w):
    """w [..., out, in] f32 -> (packed [..., out, in/2] i8, E8M0 [..., out, in/32] u8)."""
    shape = w.shape
    b = w.reshape(*shape[:-1], -1, 32)
    e = _exponent(np.max(np.abs(b), axis=-1), 6.0)
    scale = np.exp2(e.astype(np.float32))[..., None]
    x = np.clip(b / scale, -6.0, 6.0)
    idx = _round_fp4_idx(np.abs(x))
    code = (idx | np.where((x < 0) & (idx > 0), 8, 0)).astype(np.uint8).reshape(shape)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(np.int8), (e + 127).astype(np.uint8)


def decode_fp4(packed, s):
    p = packed.view(np.uint8)
    lo, hi = p & 0xF, p >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    lut = np.concatenate([FP4_LUT, -FP4_LUT]).astype(np.float32)
    v = lut[codes]
    scale = np.exp2(s.astype(np.float32) - 127)
    return (v.reshape(*v.shape[:-1], -1, 32) * scale[..., None]).reshape(v.shape)


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (dtype_name, shape, bytes)}; writes the header by hand so
    that F8_E4M3 / F8_E8M0 can be named."""
    header = {}
    off = 0
    blobs = []
    for name in sorted(tensors):
        dt, shape, data = tensors[name]
        n = int(np.prod(shape)) * DT_NAMES[dt] if shape else DT_NAMES[dt]
        assert len(data) == n, (name, len(data), n)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        blobs.append(data)
        off += n
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """{name: (dtype_name, shape, numpy array of raw values)} and metadata."""
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    np_dt = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.int8, "BF16": ml_dtypes.bfloat16,
             "F32": np.float32, "I32": np.int32, "U8": np.uint8}
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a: 8 + n + b], dtype=np_dt[h["dtype"]]).reshape(h["shape"])
        out[name] = (h["dtype"], tuple(h["shape"]), arr)
    return out, meta


def _t(dt, arr):
    return (dt, arr.shape, np.ascontiguousarray(arr).tobytes())


def layer_tensors(prefix, lp, gate_bias, n_experts):
    """The published tensors of one decoder block stored under `prefix` ("layers.3.", "mtp.0.")."""
    out = {}

    def bf16(name, w):
        out[name] = _t("BF16", np.asarray(w, np.float32).astype(ml_dtypes.bfloat16))

    def f32(name, w):
        out[name] = _t("F32", np.asarray(w, np.float32))

    def fp8(prefix, w):
        q, s = encode_fp8_block(np.asarray(w, np.float32))
        out[prefix + ".weight"] = _t("F8_E4M3", q)
        out[prefix + ".scale"] = _t("F8_E8M0", s)

    E = n_experts
    lp = {k: np.asarray(v, np.float32) for k, v in lp.items()}
    L = prefix.rstrip(".")
    bf16(f"{L}.attn_norm.weight", lp["attn_norm"])
    bf16(f"{L}.ffn_norm.weight", lp["ffn_norm"])
    for which in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            f32(f"{L}.hc_{which}_{part}", lp[f"hc_{which}_{part}"])
    fp8(f"{L}.attn.wq_a", lp["wq_a"])
    bf16(f"{L}.attn.q_norm.weight", lp["q_norm"])
    fp8(f"{L}.attn.wq_b", lp["wq_b"])
    fp8(f"{L}.attn.wkv", lp["wkv"])
    bf16(f"{L}.attn.kv_norm.weight", lp["kv_norm"])
    fp8(f"{L}.attn.wo_a", lp["wo_a"])
    fp8(f"{L}.attn.wo_b", lp["wo_b"])
    f32(f"{L}.attn.attn_sink", lp["attn_sink"])
    if "cmp_wkv" in lp:
        f32(f"{L}.attn.compressor.wkv.weight", lp["cmp_wkv"])
        if "cmp_wgate" in lp:
            f32(f"{L}.attn.compressor.wgate.weight", lp["cmp_wgate"])
        f32(f"{L}.attn.compressor.norm.weight", lp["cmp_norm"])
    if "idx_wq_b" in lp:
        fp8(f"{L}.attn.indexer.wq_b", lp["idx_wq_b"])
        bf16(f"{L}.attn.indexer.weights_proj.weight", lp["idx_weights_proj"])
        if "idx_wk" in lp:
            bf16(f"{L}.attn.indexer.wk.weight", lp["idx_wk"])
            bf16(f"{L}.attn.indexer.k_norm.weight", lp["idx_k_norm"])
    bf16(f"{L}.ffn.gate.weight", lp["gate_w"])
    f32(f"{L}.ffn.gate.bias", np.asarray(gate_bias, np.float32))
    # Present as in V4.1 (routes image tokens); zero here: text only.
    f32(f"{L}.ffn.gate.bias_vl", np.zeros(E, np.float32))
    for w in ("w1", "w2", "w3"):
        q, s = encode_fp4(lp[f"ex_{w}"])
        for e in range(E):
            out[f"{L}.ffn.experts.{e}.{w}.weight"] = _t("I8", q[e])
            out[f"{L}.ffn.experts.{e}.{w}.scale"] = _t("F8_E8M0", s[e])
        fp8(f"{L}.ffn.shared_experts.{w}", lp[f"sh_{w}"])
    return out


def checkpoint_tensors(cfg, params, gate_bias):
    """The published tensors of a model: {name: (dtype, shape, bytes)}."""
    P = {k: np.asarray(v, np.float32) for k, v in params.items() if k != "layers"}
    out = {
        "embed.weight": _t("BF16", P["embed"].astype(ml_dtypes.bfloat16)),
        "head.weight": _t("BF16", P["head"].astype(ml_dtypes.bfloat16)),
        "norm.weight": _t("BF16", P["norm"].astype(ml_dtypes.bfloat16)),
    }

    for i, lp in enumerate(params["layers"]):
        out.update(layer_tensors(f"layers.{i}.", lp, gate_bias[i], cfg["n_routed_experts"]))
    return out


def _decoder(t):
    def val(name):
        dt, shape, arr = t[name]
        if dt == "F8_E4M3":
            return decode_fp8_block(arr, t[name.replace(".weight", ".scale")][2])
        return np.asarray(arr, np.float32)
    return val


def layer_params(t, L, E):
    """One exported block (`L` = "layers.i" or "mtp.0") decoded into model.py's layer tree
    (f32), and its router's correction bias."""
    val = _decoder(t)
    lp = {
        "attn_norm": val(f"{L}.attn_norm.weight"), "ffn_norm": val(f"{L}.ffn_norm.weight"),
        "wq_a": val(f"{L}.attn.wq_a.weight"), "q_norm": val(f"{L}.attn.q_norm.weight"),
        "wq_b": val(f"{L}.attn.wq_b.weight"), "wkv": val(f"{L}.attn.wkv.weight"),
        "kv_norm": val(f"{L}.attn.kv_norm.weight"), "wo_a": val(f"{L}.attn.wo_a.weight"),
        "wo_b": val(f"{L}.attn.wo_b.weight"), "attn_sink": val(f"{L}.attn.attn_sink"),
        "gate_w": val(f"{L}.ffn.gate.weight"),
    }
    for which in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            lp[f"hc_{which}_{part}"] = val(f"{L}.hc_{which}_{part}")
    opt = {"cmp_wkv": "attn.compressor.wkv.weight", "cmp_wgate": "attn.compressor.wgate.weight",
           "cmp_norm": "attn.compressor.norm.weight", "idx_wq_b": "attn.indexer.wq_b.weight",
           "idx_weights_proj": "attn.indexer.weights_proj.weight", "idx_wk": "attn.indexer.wk.weight",
           "idx_k_norm": "attn.indexer.k_norm.weight"}
    for k, n in opt.items():
        if f"{L}.{n}" in t:
            lp[k] = val(f"{L}.{n}")
    for w in ("w1", "w2", "w3"):
        lp[f"ex_{w}"] = np.stack([
            decode_fp4(t[f"{L}.ffn.experts.{e}.{w}.weight"][2], t[f"{L}.ffn.experts.{e}.{w}.scale"][2])
            for e in range(E)])
        lp[f"sh_{w}"] = val(f"{L}.ffn.shared_experts.{w}.weight")
    return lp, val(f"{L}.ffn.gate.bias")


def load_exported(model_dir):
    """Decode an exported directory into model.py's parameter tree (f32) and state."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    t, _ = read_safetensors(Path(model_dir) / "model.safetensors")
    val = _decoder(t)
    params = {"embed": val("embed.weight"), "head": val("head.weight"), "norm": val("norm.weight"), "layers": []}
    bias = []
    for i in range(cfg["num_hidden_layers"]):
        lp, b = layer_params(t, f"layers.{i}", cfg["n_routed_experts"])
        params["layers"].append(lp)
        bias.append(b)
    return cfg, params, {"gate_bias": np.stack(bias)}


def write_sums(out):
    out = Path(out)
    lines = []
    for p in sorted(out.iterdir()):
        if p.name == "SHA256SUMS" or not p.is_file():
            continue
        lines.append(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n")
    (out / "SHA256SUMS").write_text("".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=str(HERE / "runs" / "keep-tiny" / "ckpt.pkl"))
    ap.add_argument("--init", action="store_true", help="export the untrained model (seed from args)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default=str(HERE / "tokenizer.json"))
    ap.add_argument("--sums-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if args.sums_only:
        write_sums(out)
        return
    if args.init:
        cfg = CONFIG
        params = init_params(cfg, args.seed)
        bias = np.asarray(init_state(cfg)["gate_bias"])
        step = 0
    else:
        with open(args.ckpt, "rb") as f:
            c = pickle.load(f)
        cfg, params, bias, step = c["config"], c["params"], c["state"]["gate_bias"], c["step"]
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(cfg, params, bias)
    write_safetensors(out / "model.safetensors", tensors, {"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copyfile(args.tokenizer, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": None, "pad_token": "<|endoftext|>",
        "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        # A plain chat template of its own (the model never saw chat), so `keep serve` and
        # transformers' apply_chat_template can format conversations for it.
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    write_sums(out)
    total = sum((out / p).stat().st_size for p in ("model.safetensors",))
    print(f"exported step {step} -> {out} ({total} bytes model.safetensors)")


if __name__ == "__main__":
    main()
