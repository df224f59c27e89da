#!/usr/bin/env python3
"""Write seed inputs for keep's multi-file fuzz targets (checkpoint, model-config, plan,
routes, pack) and real configs for the config target into fuzz/corpus/<target>/seed-*; plain Python 3, no packages.

    python3 fuzz/make_seeds.py

Multi-file inputs join their files with the separator of keep_checkpoint::fuzzing
(FILE_SEPARATOR); an empty part means the file is absent. Seeds are small, valid (or nearly
valid) files in keep's formats, built from the committed test configs, so that the fuzzer
starts past the first checks of every parser.
"""
import hashlib
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "fuzz/corpus"
SEP = b"\n--keep-fuzz-file--\n"


def st(tensors, metadata=None):
    """A safetensors file: tensors = [(name, dtype, shape, bytes)]."""
    header, body = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def write(target, seeds, prefix="seed"):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(seeds):
        (d / f"{prefix}-{i:02d}").write_bytes(s)


def small_config(**edits):
    c = json.loads((ROOT / "crates/keep-model/tests/data/small/config.json").read_text())
    c.update(edits)
    return json.dumps(c, separators=(",", ":")).encode()


def configs():
    data = ROOT / "crates/keep-model/tests/data"
    out = [p.read_bytes() for p in [
        data / "small/config.json", data / "small-engram/config.json",
        data / "small-v4flash/config.json", data / "small-v4flash-config.json",
        ROOT / "models/keep-tiny/config.json", ROOT / "dev/configs/flash-vocab32k.json"]]
    out.append(small_config(scoring_func="sigmoid", compress_ratios=[0, 4, 4, 0, 0, 0]))
    nested = json.loads(out[0])
    out.append(json.dumps({"model_type": "deepseek_v41", "text_config": nested}).encode())
    return out


def checkpoint():
    f32 = lambda n, v=0.5: struct.pack(f"<{n}f", *([v] * n))
    cfg = small_config()
    s1 = st([("embed.weight", "BF16", [4, 2], b"\x80\x3f" * 8),
             ("layers.0.attn.wkv.weight", "F8_E4M3", [2, 4], bytes([0x38] * 8)),
             ("layers.0.attn.wkv.scale", "F8_E8M0", [1, 1], b"\x7f")],
            {"format": "pt"})
    s2 = st([("layers.0.ffn.experts.3.w1.weight", "I8", [2, 4], bytes(range(8))),
             ("layers.0.ffn.experts.3.w1.scale", "F8_E8M0", [2, 1], b"\x7f\x80"),
             ("layers.0.ffn.gate.weight", "F32", [2, 2], f32(4))])
    s3 = st([("norm.weight", "F32", [2], f32(2, 1.0)), ("head.weight", "BF16", [4, 2], b"\x00\x3f" * 8),
             ("mtp.0.ffn.experts.0.w2.weight", "F32", [1, 2], f32(2))])
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    wm = {}
    for n, s in zip(names, (s1, s2, s3)):
        hl = struct.unpack("<Q", s[:8])[0]
        for k in json.loads(s[8:8 + hl]):
            if k != "__metadata__":
                wm[k] = n
    idx = json.dumps({"metadata": {"total_size": 123}, "weight_map": wm}).encode()
    return [
        SEP.join([cfg, idx, s1, s2, s3]),
        SEP.join([cfg, b"", s1, s2, s3]),  # no index: every shard is read
        SEP.join([b"", b"", s1]),  # one shard, no config
        SEP.join([cfg, idx, s1, s2]),  # the index names a missing shard
        SEP.join([cfg, json.dumps({"weight_map": {"ghost": names[0]}}).encode(), s1]),
    ]


def plans():
    base = {"format": "keep-prune-plan", "version": 1, "n_experts": 8, "keep": 4,
            "saliency": "reap", "layers": [{"layer": 0, "survivors": [0, 2, 5, 7]},
                                            {"layer": 1, "survivors": None, "hash_routed": True},
                                            {"layer": 3, "survivors": [1, 2, 3, 4]}],
            "mtp_layers": [{"layer": 0, "survivors": [0, 1, 2, 3]}],
            "model_fingerprint": "0" * 64}
    out = [json.dumps(base, indent=1).encode()]
    b = dict(base, mtp_layers=[])
    del b["model_fingerprint"]
    out.append(json.dumps(b).encode())
    out.append(json.dumps(dict(base, keep=8, layers=[{"layer": 2, "survivors": list(range(8))}])).encode())
    out.append(json.dumps(dict(base, n_experts=384, keep=2, layers=[{"layer": 60, "survivors": [5, 383]}],
                               jaccard=[0.5, 0.25], selection={"method": "reap"})).encode())
    out.append(b'{"format":"keep-prune-plan","version":1,"n_experts":1,"keep":1,"layers":[]}')
    return out


def routes():
    def session(layers, top_k, n_experts, tokens, meta_extra=None, wdtype="F16"):
        ts = []
        for l in layers:
            ids = [(t * 3 + k + l) % n_experts for t in range(tokens) for k in range(top_k)]
            ts.append((f"routes.{l}.experts", "I16", [tokens, top_k], struct.pack(f"<{len(ids)}h", *ids)))
            if wdtype == "F16":
                w = struct.pack(f"<{len(ids)}e", *([0.25] * len(ids)))
            else:
                w = struct.pack(f"<{len(ids)}f", *([0.25] * len(ids)))
            ts.append((f"routes.{l}.weights", wdtype, [tokens, top_k], w))
        meta = {"format": "keep-routes", "version": "1", "n_experts": str(n_experts), "top_k": str(top_k),
                "n_layers": str(len(layers)), "layers": ",".join(map(str, layers)), "session": "s"}
        meta.update(meta_extra or {})
        return st(ts, meta)
    a = session([0, 1, 3], 2, 8, 5)
    b = session([0, 1, 3], 2, 8, 3, {"model_fingerprint": "ab" * 32, "hash_layers": "0"})
    c = session([0, 1, 3], 2, 8, 1, wdtype="F32")
    per_layer = session([2, 4], 3, 16, 4, {"n_experts": "16,12"})
    calib = session([0], 1, 4, 2, {"format": "keep-calib-session"})
    return [SEP.join([a, b, c]), a, SEP.join([a, per_layer]), SEP.join([calib, st([("x", "F32", [1], b"\0" * 4)])]),
            SEP.join([per_layer, per_layer, per_layer])]


def packs():
    records = [{"id": f"r{i}", "group": "g0" if i < 3 else "g1", "tokens": [1 + i, 2, 3, 4 + i]} for i in range(5)]
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    man = {"format": "keep-pack", "version": 1, "tokenizer_sha256": "0" * 64, "vocab_size": 256,
           "max_tokens": 64, "held_out_frac": 0.25, "seed": 1, "records_file": "records.jsonl",
           "records_sha256": hashlib.sha256(text).hexdigest(), "n_records": 5, "n_tokens": 20,
           "groups": [{"id": "g0", "source": "a.txt", "split": "calibration", "records": 3, "tokens": 12},
                      {"id": "g1", "source": "b.txt", "split": "eval", "records": 2, "tokens": 8}]}
    real = ROOT / "models/keep-tiny-pack"
    tiny_records = b"".join((real / "records.jsonl").read_bytes().splitlines(keepends=True)[:3])
    tiny = json.loads((real / "pack.json").read_text())
    tiny["records_sha256"] = "fuzz"
    placeholder = lambda m: json.dumps(dict(m, records_sha256="fuzz"), separators=(",", ":")).encode()
    return [
        SEP.join([json.dumps(man).encode(), text]),
        SEP.join([placeholder(man), text]),
        SEP.join([json.dumps(tiny, separators=(",", ":")).encode(), tiny_records]),
        SEP.join([placeholder(dict(man, vocab_size=4)), text]),
        SEP.join([placeholder(dict(man, records_file="../x")), text]),
    ]


if __name__ == "__main__":
    write("checkpoint", checkpoint())
    write("model-config", configs())
    write("config", configs(), "seed-model")  # keep-checkpoint's parser gets the same files
    write("plan", plans())
    write("routes", routes())
    write("pack", packs())
    for t in ("checkpoint", "model-config", "plan", "routes", "pack"):
        n = sum(p.stat().st_size for p in (OUT / t).iterdir())
        print(f"{t}: {len(list((OUT / t).iterdir()))} seeds, {n} bytes")
