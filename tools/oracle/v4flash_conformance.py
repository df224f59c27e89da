#!/usr/bin/env python3
"""keep's DeepSeek-V4 / V4-Flash forward against transformers 5.23.0's `DeepseekV4ForCausalLM`
(CPU torch 2.15.0, float32) on random checkpoints in DeepSeek's published format.

Run from the repository root with the pinned oracle venv:

    tools/oracle/.venv/bin/python tools/oracle/v4flash_conformance.py [--keep target/release/keep]

Checkpoints (in a temporary directory), each converted to transformers' tree by
tools/oracle/v4flash_ref.py (its own FP8/FP4 decoding, strict state-dict load):
  - `keep synth --preset tiny-v4flash` (ratios 0, 4, 8, 4, 8, 0; two hash-routed layers; 128x128
    E8M0 FP8 blocks over a 192-wide hidden state; YaRN on the compressed layers);
  - the same after `keep repack --resident-format mxfp8`;
  - an odd-sized config (hidden 160, 3 heads, 12 experts top-3, window 12, ratios 0, 4, 16, 4,
    0, one hash layer, no YaRN) with float32 power-of-two scales (V4-Flash-Base storage) and
    scoring_func sigmoid;
  - the same shapes with two hash layers, routed_scaling_factor 2.5 and YaRN (factor 8).
Pruned hash-routed layers: an odd-shaped checkpoint (vocabulary 4096, two hash layers, 12 experts
top-3) is calibrated on a small pack of this repository's docs (keep-tiny's tokenizer), and for
each remap policy (reap-next, nearest, frequency) `keep select --keep 6 --hash-remap POLICY`,
`keep prune` (tid2eid rewritten) and `keep verify`; and `keep select --keep 6` without a remap,
which leaves the hash-routed layers whole (12 experts there, 6 elsewhere:
`n_routed_experts_per_layer`; the reference builds each layer at its own count). Each pruned
checkpoint then goes through the same checks against transformers loading it (logits, routes,
greedy tokens).
(transformers 5.23 cannot score with `softmax`: `ACT2FN` has no such activation, so that
scoring function, which keep implements for V4.1, is not checked against it for V4.)
For each: a pseudo-random sequence through `keep logits --routes` (one prefill) and the
reference (one forward without cache); top-1 agreement >= 99.5%, mean KL(ref||keep) <= 1e-4 nats
per position, routed experts equal on >= 99.9% of (token, layer) pairs; the reference's 16
greedy tokens (each from a full forward) equal keep's argmax when keep decodes the prompt and
those tokens one at a time with its cache (`keep logits --decode`); keep's decode logits equal
its prefill logits bit for bit.

The reference's indexer top-k breaks exact ties by the lowest entry id (see
`stable_indexer_topk` in v4flash_ref.py); nothing else in the reference is changed.
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
FAILS = []

ODD = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 300, "hidden_size": 160, "num_hidden_layers": 5,
    "num_attention_heads": 3, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 80, "o_groups": 3, "o_lora_rank": 24,
    "moe_intermediate_size": 96, "n_routed_experts": 12, "n_shared_experts": 1,
    "num_experts_per_tok": 3, "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "sliding_window": 12, "num_hash_layers": 1, "compress_ratios": [0, 4, 16, 4, 0],
    "index_n_heads": 3, "index_head_dim": 32, "index_topk": 5,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "max_position_embeddings": 4096,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
}


def check(name, ok, detail=""):
    if not ok:
        FAILS.append(name)
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def run(cmd):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def case(keep, d, tag, seed, n_tokens, tmp):
    vocab = json.loads((d / "config.json").read_text())["vocab_size"]
    toks = np.random.default_rng(seed).integers(0, vocab, n_tokens)
    t = ",".join(map(str, toks))
    ref, mine = tmp / f"{tag}-ref.safetensors", tmp / f"{tag}-keep.safetensors"
    run([PY, ROOT / "tools/oracle/v4flash_ref.py", d, "--tokens", t, "--out", ref, "--routes",
         "--greedy", "16"])
    run([keep, "logits", d, "--tokens", t, "--out", mine, "--routes"])
    r, k = load_file(str(ref)), load_file(str(mine))
    c = compare(r, k)
    detail = (f"top1 {c['top1_agreement']:.4f} mean KL {c['mean_kl']:.2e} max|diff| "
              f"{c['max_abs_diff']:.2e} routes {c['route_agreement']:.4f}")
    ok = (c["top1_agreement"] >= MIN_TOP1 and c["mean_kl"] <= MAX_KL
          and c["route_agreement"] >= MIN_ROUTES)
    check(f"v4 {tag}: logits and routes agree with transformers", ok, detail)
    greedy = r["greedy"]
    seq = ",".join(map(str, list(toks) + list(greedy[:-1])))
    dec = tmp / f"{tag}-decode.safetensors"
    run([keep, "logits", d, "--tokens", seq, "--out", dec, "--decode"])
    dl = load_file(str(dec))["logits"]
    mine_greedy = dl[len(toks) - 1:].argmax(-1)
    check(f"v4 {tag}: 16 greedy tokens (keep's cache decode) equal transformers'",
          np.array_equal(mine_greedy, greedy), f"{mine_greedy.tolist()} vs {greedy.tolist()}")
    same = np.array_equal(dl[: len(toks)], k["logits"])
    check(f"v4 {tag}: keep's decode logits equal its prefill logits", same,
          f"max|diff| {float(np.abs(dl[:len(toks)] - k['logits']).max()):.2e}")
    return c


def pruned_cases(keep, tmp):
    """Checkpoints pruned with each hash-remap policy (see the module doc)."""
    cfg = tmp / "hashprune.json"
    cfg.write_text(json.dumps({**ODD, "vocab_size": 4096, "num_hash_layers": 2,
                               "scoring_func": "sqrtsoftplus"}))
    d = tmp / "hashprune"
    run([keep, "synth", "--config", cfg, "--out", d, "--seed", "4", "--block", "128",
         "--hash-layers", "2"])
    pack, calib = tmp / "hashprune-pack", tmp / "hashprune-run"
    run([keep, "pack", "--from", ROOT / "docs/v4flash.md", ROOT / "ARCHITECTURE.md",
         "--tokenizer", ROOT / "models/keep-tiny/tokenizer.json", "--out", pack,
         "--max-tokens", "256", "--held-out-frac", "0"])
    run([keep, "calibrate", d, "--pack", pack, "--out", calib])
    run([keep, "finalize", calib])
    out = []
    for policy in ["reap-next", "nearest", "frequency"]:
        plan, pruned = tmp / f"plan-{policy}.json", tmp / f"hashprune-{policy}"
        run([keep, "select", calib, "--keep", "6", "--hash-remap", policy, "--out", plan,
             "--no-plot"])
        run([keep, "prune", d, pruned, "--plan", plan])
        run([keep, "verify", pruned])
        pc = json.loads((pruned / "config.json").read_text())
        check(f"v4 pruned-{policy}: the pruned checkpoint has 6 experts per layer",
              pc["n_routed_experts"] == 6, str(pc["n_routed_experts"]))
        out.append((pruned, f"pruned-hash-remap-{policy}", 150))
    # No remap: the hash-routed layers stay whole (12 experts), the others keep 6, and the
    # reference builds each layer at its own count.
    plan, pruned = tmp / "plan-hash-whole.json", tmp / "hashprune-hash-whole"
    run([keep, "select", calib, "--keep", "6", "--out", plan, "--no-plot"])
    run([keep, "prune", d, pruned, "--plan", plan])
    run([keep, "verify", pruned])
    pc = json.loads((pruned / "config.json").read_text())
    per = pc.get("n_routed_experts_per_layer")
    check("v4 pruned-hash-whole: hash layers keep 12 experts, the others 6",
          per == [12, 12] + [6] * (len(per or []) - 2) and pc["n_routed_experts"] == 6, str(per))
    out.append((pruned, "pruned-hash-layers-whole", 150))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", default=str(ROOT / "target/release/keep"))
    ap.add_argument("--json", type=Path, help="also write the numbers of every case here")
    a = ap.parse_args()
    keep = Path(a.keep).resolve()
    results = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        cases = []
        d = tmp / "tiny-v4flash"
        run([keep, "synth", "--preset", "tiny-v4flash", "--out", d, "--seed", "1"])
        cases.append((d, "keep-synth-tiny-v4flash-e8m0", 150))
        run([keep, "repack", d, tmp / "tiny-v4flash-mx", "--resident-format", "mxfp8"])
        cases.append((tmp / "tiny-v4flash-mx", "keep-synth-tiny-v4flash-mxfp8", 150))
        yarn = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                "beta_fast": 32, "beta_slow": 1}
        for tag, over, seed, hash_layers in [
                ("odd-sigmoid-f32scales", {}, 2, 1),
                ("odd-sqrtsoftplus-yarn-f32scales",
                 {"scoring_func": "sqrtsoftplus", "routed_scaling_factor": 2.5,
                  "rope_scaling": yarn, "num_hash_layers": 2}, 3, 2)]:
            cfg = tmp / f"{tag}.json"
            cfg.write_text(json.dumps({**ODD, **over}))
            d = tmp / tag
            run([keep, "synth", "--config", cfg, "--out", d, "--seed", str(seed), "--block", "128",
                 "--f32-scales", "--hash-layers", str(hash_layers)])
            cases.append((d, tag, 200))
        cases += pruned_cases(keep, tmp)
        for i, (d, tag, n) in enumerate(cases):
            results[tag] = case(keep, d, tag, 100 + i, n, tmp)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    print(f"v4 conformance: {len(FAILS)} failed")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
