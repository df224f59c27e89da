#!/usr/bin/env python3
"""keep's conformance suite: keep against independent references (ml_dtypes, MLX, mlx-lm,
transformers).

Run from the repository root with the pinned oracle venv (tools/oracle/requirements.txt):

    tools/oracle/.venv/bin/python tools/oracle/conformance.py [--keep target/release/keep] [--only NAME]

Sections (each prints PASS/FAIL lines; the last line is "N passed, M failed"; exit 1 on failure):
  codes      every FP8 E4M3FN / E5M2 / E8M0 / FP4 E2M1 code decoded by keep equals ml_dtypes
  repack     on `keep synth` checkpoints (V4.1 32x32; V4-Flash 128x128 E8M0 and float32
             power-of-two scales), mx.dequantize(mode="mxfp8", dtype=float32) of every repacked
             tensor equals the original block decode (done here with ml_dtypes) bit for bit, and
             mlx_lm.utils.load_model loads the repacked V4.1 directory and runs a forward pass;
             prints how many values mx.quantize(mode="mxfp8") of the bf16 decode changes
  prune      keep prune's output (keep synth tiny, bundled keep-tiny) loads and runs in mlx-lm
  model      (when tools/oracle/model_conformance.py exists) keep's forward against mlx-lm
  model-v4   keep's DeepSeek-V4 / V4-Flash forward against transformers' DeepseekV4ForCausalLM
             (tools/oracle/v4flash_conformance.py)
  model-qwen3  keep's Qwen3-MoE forward, pipeline and synth against mlx-lm's qwen3_moe
             (tools/oracle/qwen3_conformance.py)
  model-deepseek-v3  keep's DeepSeek-V3 forward (bf16 and FP8 `weight_scale_inv`) against
             transformers' DeepseekV3ForCausalLM and mlx-lm's deepseek_v3
             (tools/oracle/deepseek_v3_conformance.py)
  model-gpt-oss  keep's gpt-oss forward (MXFP4 experts as published, sinks, sliding and full
             layers, YaRN with and without `truncate`) against transformers' GptOssForCausalLM
             and mlx-lm's gpt_oss (tools/oracle/gpt_oss_conformance.py)
  chat-templates  `keep chat-template` (what keep serve sends) equals transformers' rendering
             of the chat templates DeepSeek-V3.1, Kimi-K2, gpt-oss, DeepSeek-V4-Flash and Qwen3
             are published with, on five chats (tools/oracle/chat_template_conformance.py)
  quant-mlx  keep quant --format mlx2|mlx3|mlx4 on the bundled model: every quantized routed
             expert's codes, scales and biases equal mx.quantize(bits=B, group_size=64) of the
             same weights (the shipped FP4 decoded, in bf16) byte for byte; the mlx4 model
             under --memory-budget decodes the whole model's greedy tokens
  fixtures   (when fixtures/keep-tiny exists) regenerate the bundled model's fixtures and compare
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import mlx.core as mx
import numpy as np
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def run(cmd, **kw):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ---------------------------------------------------------------- codes
def section_codes(args):
    out = subprocess.run(
        ["cargo", "run", "-q", "--release", "-p", "keep-format", "--example", "dump_codes"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    rows = [json.loads(l) for l in out.splitlines() if l.strip()]
    dtypes = {
        "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8),
        "float8_e5m2": (ml_dtypes.float8_e5m2, np.uint8),
        "float8_e8m0fnu": (ml_dtypes.float8_e8m0fnu, np.uint8),
        "float4_e2m1fn": (ml_dtypes.float4_e2m1fn, np.uint8),
    }
    for fmt, (dt, _) in dtypes.items():
        mine = [r for r in rows if r["format"] == fmt]
        n = 16 if fmt == "float4_e2m1fn" else 256
        codes = np.arange(n, dtype=np.uint8)
        ref = codes.view(dt) if fmt != "float4_e2m1fn" else codes.astype(np.uint8)
        if fmt == "float4_e2m1fn":
            # ml_dtypes stores one float4 per byte in the low nibble.
            ref = codes.view(ml_dtypes.float4_e2m1fn)
        ref32 = ref.astype(np.float32)
        bad = []
        for r in mine:
            got = np.array([r["bits"]], dtype=np.uint32).view(np.float32)[0]
            want = ref32[r["code"]]
            same = (np.isnan(got) and np.isnan(want)) or (
                np.array([got]).view(np.uint32)[0] == np.array([want]).view(np.uint32)[0]
            )
            if not same:
                bad.append((r["code"], float(got), float(want)))
        check(f"codes {fmt}: {len(mine)} of {n} codes equal ml_dtypes", len(mine) == n and not bad,
              f"first differences {bad[:4]}" if bad else "")


# ---------------------------------------------------------------- repack
def read_dir(d):
    tensors = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(f, "numpy") as sf:
            for k in sf.keys():
                tensors[k] = f
    return tensors


def raw_tensor(path, name):
    """Read a tensor's raw bytes and dtype/shape from the header (numpy cannot hold F8 types)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        meta = header[name]
        a, b = meta["data_offsets"]
        fh.seek(8 + n + a)
        data = fh.read(b - a)
    return meta["dtype"], meta["shape"], np.frombuffer(data, dtype=np.uint8)


def block_decode(q, scale_dtype, scale_bytes, shape, scale_shape):
    """Independent FP8-block decode with ml_dtypes: w[i,j] = e4m3(q) * s[i/br, j/bc]."""
    rows, cols = shape
    sr, sc = scale_shape
    w = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(rows, cols)
    if scale_dtype == "F8_E8M0":
        s = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32).reshape(sr, sc)
    else:
        s = scale_bytes.view(np.float32).reshape(sr, sc)
    br = -(-rows // sr)
    bc = -(-cols // sc)
    # The block shape is the one that tiles the grid; ceil division recovers it for tails.
    for b in (32, 64, 128, 256):
        if -(-rows // b) == sr:
            br = b
            break
    for b in (32, 64, 128, 256):
        if -(-cols // b) == sc:
            bc = b
            break
    full = np.repeat(np.repeat(s, br, axis=0), bc, axis=1)[:rows, :cols]
    return w * full


def section_repack(args):
    keep = args.keep
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [
            ("v41-32x32", ["--preset", "tiny"], True),
            ("v4flash-128x128-e8m0", ["--preset", "tiny-v4flash"], False),
            ("v4flash-128x128-f32pow2", ["--preset", "tiny-v4flash", "--f32-scales"], False),
        ]
        for tag, synth_args, load in cases:
            src, out = tmp / tag, tmp / f"{tag}-mxfp8"
            run([keep, "synth", *synth_args, "--out", src, "--seed", "11"])
            run([keep, "repack", src, out, "--resident-format", "mxfp8", "--verify"])
            report = json.loads((out / "repack-report.json").read_text())
            src_files, out_files = read_dir(src), read_dir(out)
            n_ok, bad = 0, []
            changed, total = 0, 0
            for t in report["repacked"]:
                name, scale = t["name"], t["source_scale"]
                _, shape, q = raw_tensor(src_files[name], name)
                sdt, sshape, sb = raw_tensor(src_files[scale], scale)
                want = block_decode(q, sdt, sb, shape, sshape)
                _, oshape, oq = raw_tensor(out_files[name], name)
                odt, osshape, osb = raw_tensor(out_files[t["created_scale"]], t["created_scale"])
                wq = mx.array(oq.reshape(oshape[0], -1)).view(mx.uint32)
                sc = mx.array(osb.reshape(osshape))
                got = np.array(mx.dequantize(wq, sc, group_size=32, bits=8, mode="mxfp8",
                                             dtype=mx.float32))
                if got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)):
                    n_ok += 1
                else:
                    bad.append(name)
                # What a round-trip through mx.quantize would change (the reason repack copies).
                bf = mx.array(want).astype(mx.bfloat16)
                wq2, s2 = mx.quantize(bf, group_size=32, bits=8, mode="mxfp8")
                rt = np.array(mx.dequantize(wq2, s2, group_size=32, bits=8, mode="mxfp8",
                                            dtype=mx.float32))
                changed += int(np.sum(rt != want))
                total += want.size
            check(f"repack {tag}: mx.dequantize(mxfp8) == block decode, bit for bit",
                  n_ok == len(report["repacked"]) and n_ok > 0,
                  f"{n_ok}/{len(report['repacked'])} tensors" + (f"; differ: {bad[:3]}" if bad else ""))
            print(f"INFO repack {tag}: mx.quantize(mode='mxfp8') of the bf16 decode changes "
                  f"{changed} of {total} values", flush=True)
            if load:
                from mlx_lm.utils import load_model
                for d in (src, out):
                    model, _ = load_model(d)
                    logits = model(mx.array([list(range(1, 41))]))
                    mx.eval(logits)
                    check(f"repack {tag}: mlx_lm.utils.load_model loads {d.name} and runs a forward",
                          logits.shape[-1] > 0 and bool(mx.all(mx.isfinite(logits)).item()),
                          f"logits {tuple(logits.shape)}")


def section_prune(args):
    """keep prune's output loads and runs in mlx-lm (a keep synth model and the bundled one)."""
    from mlx_lm.utils import load_model
    keep = args.keep
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "tiny"
        run([keep, "synth", "--preset", "tiny", "--out", src, "--seed", "3"])
        sources = [("synth tiny", src, 16), ("bundled keep-tiny", ROOT / "models/keep-tiny", 32)]
        for tag, model, n in sources:
            if not (model / "config.json").exists():
                print(f"SKIP prune {tag}: {model} is not there", flush=True)
                continue
            keep_n = n // 2
            # A hand-made plan names the model it was made for (`keep inspect --json` reports
            # the fingerprint `keep prune` checks).
            fp = json.loads(subprocess.run([str(keep), "inspect", str(model), "--json"], check=True,
                                           capture_output=True, text=True).stdout)["model_fingerprint"]
            plan = {"format": "keep-prune-plan", "version": 1, "n_experts": n, "keep": keep_n,
                    "saliency": "conformance", "model_fingerprint": fp,
                    "layers": [{"layer": l} for l in
                               range(json.loads((model / "config.json").read_text())["num_hidden_layers"])]}
            # Survivors: a scattered half of the experts in every layer.
            for l in plan["layers"]:
                l["survivors"] = sorted(((e * 5 + l["layer"] * 3) % n) for e in range(keep_n))
            pp = tmp / f"plan-{n}.json"
            pp.write_text(json.dumps(plan))
            out = tmp / f"pruned-{n}"
            run([keep, "prune", model, out, "--plan", pp])
            m, cfg = load_model(out)
            logits = m(mx.array([list(range(1, 41))]))
            mx.eval(logits)
            check(f"prune {tag}: mlx_lm.utils.load_model loads the pruned model ({cfg['n_routed_experts']} experts) and runs a forward",
                  cfg["n_routed_experts"] == keep_n and bool(mx.all(mx.isfinite(logits)).item()),
                  f"logits {tuple(logits.shape)}")


def section_model(args):
    script = ROOT / "tools/oracle/model_conformance.py"
    if not script.exists():
        print("SKIP model: tools/oracle/model_conformance.py is not there yet", flush=True)
        return
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("model: keep's forward agrees with mlx-lm (model_conformance.py)", r.returncode == 0)


def section_model_v4(args):
    script = ROOT / "tools/oracle/v4flash_conformance.py"
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("model-v4: keep's V4-Flash forward agrees with transformers (v4flash_conformance.py)",
          r.returncode == 0)


def section_model_qwen3(args):
    script = ROOT / "tools/oracle/qwen3_conformance.py"
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("model-qwen3: keep's Qwen3-MoE forward agrees with mlx-lm (qwen3_conformance.py)",
          r.returncode == 0)


def section_model_deepseek_v3(args):
    script = ROOT / "tools/oracle/deepseek_v3_conformance.py"
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("model-deepseek-v3: keep's DeepSeek-V3 forward agrees with transformers and mlx-lm "
          "(deepseek_v3_conformance.py)", r.returncode == 0)


def section_model_gpt_oss(args):
    script = ROOT / "tools/oracle/gpt_oss_conformance.py"
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("model-gpt-oss: keep's gpt-oss forward agrees with transformers and mlx-lm "
          "(gpt_oss_conformance.py)", r.returncode == 0)


def section_chat_templates(args):
    script = ROOT / "tools/oracle/chat_template_conformance.py"
    r = subprocess.run([sys.executable, str(script), "--keep", str(args.keep)], cwd=ROOT)
    check("chat-templates: keep renders the published chat templates as transformers does "
          "(chat_template_conformance.py)", r.returncode == 0)


def section_mtp(args):
    """keep's MTP module (`keep logits --mtp`) against tools/oracle/mtp_ref.py (transformers'
    decoder layer for the block, the MTP wrapper transcribed from DeepSeek's model.py) on random
    V4-Flash checkpoints with `mtp.0.*`: the tiny-v4flash preset (128x128 E8M0 blocks, two hash
    layers) and a 2-layer one with float32 power-of-two scales, each at two seeds; top-1
    agreement >= 99.5% and max |logit difference| <= 1e-4 over every position."""
    import numpy as np
    from safetensors.numpy import load_file
    keep = Path(args.keep)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        small = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                 "vocab_size": 300, "hidden_size": 96, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "head_dim": 64, "qk_rope_head_dim": 16,
                 "q_lora_rank": 48, "o_groups": 2, "o_lora_rank": 32,
                 "moe_intermediate_size": 64, "n_routed_experts": 6, "n_shared_experts": 1,
                 "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
                 "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
                 "sliding_window": 8, "compress_ratios": [4, 8], "index_n_heads": 2,
                 "index_head_dim": 32, "index_topk": 3, "rope_theta": 10000.0,
                 "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
                 "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
                 "num_nextn_predict_layers": 1}
        (tmp / "small.json").write_text(json.dumps(small))
        cases = []
        for seed in (1, 2):
            cases.append((f"tiny-v4flash-s{seed}", ["--preset", "tiny-v4flash", "--seed", str(seed)]))
            cases.append((f"small-f32scales-s{seed}", ["--config", str(tmp / "small.json"), "--block", "128",
                                                        "--f32-scales", "--seed", str(seed)]))
        for tag, flags in cases:
            model = tmp / tag
            run([keep, "synth", *flags, "--out", model])
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            toks = ",".join(str((i * 131 + 17) % vocab) for i in range(40))
            kf, rf = tmp / f"{tag}-keep.st", tmp / f"{tag}-ref.st"
            run([keep, "logits", model, "--tokens", toks, "--mtp", "--out", kf])
            run([sys.executable, ROOT / "tools/oracle/mtp_ref.py", model, "--tokens", toks, "--out", rf])
            a, b = load_file(str(kf))["mtp_logits"], load_file(str(rf))["mtp_logits"]
            top1 = float((a.argmax(1) == b.argmax(1)).mean())
            diff = float(np.abs(a - b).max())
            check(f"mtp {tag}: keep's MTP logits agree with the reference ({a.shape[0]} positions)",
                  a.shape == b.shape and top1 >= 0.995 and diff <= 1e-4,
                  f"top-1 {top1:.4f}, max |diff| {diff:.2e}")


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def fp4_decode(packed, scale_bytes, rows, cols):
    """MXFP4 (I8 pairs, element 2k in the low nibble; E8M0 scale per 32 columns) to f32."""
    p = packed.reshape(rows, cols // 2)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(rows, cols)
    s = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32).reshape(rows, cols // 32)
    return E2M1[codes] * np.repeat(s, 32, axis=1)


def section_quant_mlx(args):
    keep = Path(args.keep)
    model = ROOT / "models/keep-tiny"
    cfg = json.loads((model / "config.json").read_text())
    d, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # an all-ones imatrix (MLX's rule does not read it; keep quant wants one per tensor)
        im = {}
        for l in range(cfg["num_hidden_layers"]):
            for e in range(cfg["n_routed_experts"]):
                for part in ("w1", "w2", "w3"):
                    im[f"imatrix.{l}.ffn.experts.{e}.{part}"] = mx.ones(inter if part == "w2" else d)
        mx.save_safetensors(str(tmp / "imatrix.safetensors"), im, metadata={"format": "keep-imatrix"})
        src = read_dir(model)
        for bits in (2, 3, 4):
            out = tmp / f"mlx{bits}"
            run([keep, "quant", model, "--imatrix", tmp / "imatrix.safetensors", "--format",
                 f"mlx{bits}", "--out", out], stdout=subprocess.DEVNULL)
            got = read_dir(out)
            bad, n = [], 0
            # Decoder layers' experts; an MTP module's experts (`mtp.N.`) have no imatrix and
            # stay as shipped, byte for byte.
            for name in sorted(k for k in src if k.startswith("mtp.") and ".ffn.experts." in k):
                if name not in got or raw_tensor(got[name], name)[2].tobytes() != raw_tensor(src[name], name)[2].tobytes():
                    bad.append(name + " (MTP expert not copied as shipped)")
            for name in sorted(k for k in src if k.startswith("layers.") and ".ffn.experts." in k
                               and k.endswith(".weight")):
                base = name[: -len(".weight")]
                _, shape, packed = raw_tensor(src[name], name)
                _, _, sb = raw_tensor(src[base + ".scale"], base + ".scale")
                rows, cols = shape[0], shape[1] * 2
                w = mx.array(fp4_decode(packed, sb, rows, cols)).astype(mx.bfloat16)
                q, s, b = mx.quantize(w, group_size=64, bits=bits)
                kq = raw_tensor(got[name], name)
                ks = raw_tensor(got[base + ".scales"], base + ".scales")
                kb = raw_tensor(got[base + ".biases"], base + ".biases")
                ok = (kq[0] == "U32" and list(kq[1]) == list(q.shape)
                      and np.array_equal(kq[2], np.array(q).view(np.uint8).ravel())
                      and ks[0] == "BF16" and np.array_equal(ks[2], np.array(s.view(mx.uint16)).view(np.uint8).ravel())
                      and np.array_equal(kb[2], np.array(b.view(mx.uint16)).view(np.uint8).ravel()))
                n += 1
                if not ok:
                    bad.append(name)
            check(f"quant-mlx: keep quant --format mlx{bits} equals mx.quantize on {n} expert matrices",
                  n > 0 and not bad, f"{len(bad)} differ, first {bad[:3]}" if bad else "")
            if bits == 4:
                # The budgeted runtime reads each expert with its `.scales` and `.biases`.
                gen = lambda *extra: [l for l in subprocess.run(
                    [str(keep), "run", str(out), "--prompt-tokens", "16", "--max-tokens", "6",
                     "--temperature", "0", *extra], check=True, capture_output=True,
                    text=True).stdout.splitlines() if l[:1].isdigit()]
                whole, budget = gen(), gen("--memory-budget", "16MiB")
                check("quant-mlx: keep run --memory-budget on the mlx4 experts gives the whole "
                      "model's greedy tokens", bool(whole) and whole == budget,
                      f"{whole} vs {budget}")


def section_fixtures(args):
    script = ROOT / "tools/oracle/make_fixtures.py"
    fixtures = ROOT / "fixtures/keep-tiny"
    if not (script.exists() and fixtures.exists()):
        print("SKIP fixtures: fixtures/keep-tiny or make_fixtures.py is not there yet", flush=True)
        return
    r = subprocess.run([sys.executable, str(script), "--model", "models/keep-tiny",
                        "--out", "fixtures/keep-tiny", "--check"], cwd=ROOT)
    check("fixtures: regenerated keep-tiny fixtures equal the committed ones", r.returncode == 0)


SECTIONS = {"codes": section_codes, "repack": section_repack, "prune": section_prune,
            "model": section_model, "model-v4": section_model_v4,
            "model-qwen3": section_model_qwen3, "model-deepseek-v3": section_model_deepseek_v3,
            "model-gpt-oss": section_model_gpt_oss, "chat-templates": section_chat_templates,
            "mtp": section_mtp, "quant-mlx": section_quant_mlx,
            "fixtures": section_fixtures}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=str(ROOT / "target/release/keep"))
    ap.add_argument("--only", choices=sorted(SECTIONS), action="append")
    args = ap.parse_args()
    print(f"mlx {mx.__version__}, ml_dtypes {ml_dtypes.__version__}", flush=True)
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name}", flush=True)
        try:
            fn(args)
        except Exception as e:  # a crash in a section is a failure, not a skip
            check(f"{name}: section ran", False, repr(e))
    passed = sum(RESULTS)
    print(f"{passed} passed, {len(RESULTS) - passed} failed")
    sys.exit(0 if passed == len(RESULTS) and RESULTS else 1)


if __name__ == "__main__":
    main()
