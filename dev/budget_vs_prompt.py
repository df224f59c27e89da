#!/usr/bin/env python3
"""dev/budget_vs_prompt.py: the memory-budget promise against prompt length.

    dev/budget_vs_prompt.py OUT.json [MODEL] [PROMPTS=16,64,256,1024,4096,8192,16384]

For each prompt length P (greedy, synthetic prompt, 8 generated tokens):
  1. `keep run MODEL --memory-budget 1 --prompt-tokens P` is refused naming the least budget
     that holds the run (residents + the context's cache and activations + top-k slots);
  2. `keep run` at exactly that budget: the child's peak RSS from wait4's rusage, its wall time,
     the load average before and after;
  3. with UNCHUNKED=1 (default up to 4096 tokens), the same run with --prefill-chunk P (one pass
     over the whole prompt, as keep ran before chunking) for comparison.
MODEL defaults to a copy of the bundled keep-tiny whose config allows 32768 positions (the
bundled one allows 4096; RoPE is plain, so the positions beyond only extrapolate). OUT gets
the table as JSON (format keep-budget-vs-prompt v1). KEEP=target/release/keep by default.
"""
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

KEEP = os.environ.get("KEEP", "target/release/keep")
FIXED_OVERHEAD = 64 << 20  # keep-runtime's FIXED_OVERHEAD


def run(args, cache):
    """Run keep with ARGS; (exit code, stderr, peak RSS bytes, wall seconds, load before/after)."""
    load0 = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            [KEEP] + args,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=dict(os.environ, KEEP_CACHE_DIR=cache),
        )
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t0
        err.seek(0)
        text = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    return code, text, ru.ru_maxrss * 1024, wall, [load0[0], os.getloadavg()[0]]


def long_context_copy(dst, cache):
    """A copy of the bundled model allowing 32768 positions."""
    code, text, *_ = run(["inspect", "--json"], cache)
    src = None
    for root, dirs, files in os.walk(os.path.join(cache, "models")):
        if "config.json" in files and os.path.basename(root).startswith("keep-tiny-") and "pack" not in root:
            src = root
    if src is None:
        sys.exit(f"no bundled model unpacked under {cache}: {text}")
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f not in ("SHA256SUMS", "config.json"):
            shutil.copy(os.path.join(src, f), dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["max_position_embeddings"] = 32768
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)
    return dst


def main():
    out = sys.argv[1]
    prompts = [16, 64, 256, 1024, 4096, 8192, 16384]
    if len(sys.argv) > 3:
        prompts = [int(v) for v in sys.argv[3].split(",")]
    unchunked_max = int(os.environ.get("UNCHUNKED_MAX", "4096"))
    work = tempfile.mkdtemp(prefix="keep-budget-vs-prompt-")
    cache = os.path.join(work, "cache")
    model = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else long_context_copy(os.path.join(work, "model"), cache)
    rows = []
    for p in prompts:
        base = ["run", model, "--prompt-tokens", str(p), "--max-tokens", "8", "--temperature", "0"]
        code, text, *_ = run(base + ["--memory-budget", "1"], cache)
        m = re.search(r"at least (\d+) bytes", text)
        if code != 1 or not m:
            sys.exit(f"prompt {p}: expected a refusal naming the budget, got {code}: {text}")
        need = int(m.group(1))
        ctx = re.search(r"context of (\d+) tokens takes (\d+) more \(decoding cache (\d+) \+ activations (\d+) of one (\d+)-token pass\)", text)
        stats = os.path.join(work, f"stats-{p}.json")
        code, text, peak, wall, load = run(base + ["--memory-budget", str(need), "--stats-json", stats, "--force"], cache)
        if code != 0:
            sys.exit(f"prompt {p} at budget {need}: exit {code}: {text}")
        st = json.load(open(stats))
        row = {
            "prompt_tokens": p,
            "budget": need,
            "context_tokens": int(ctx.group(1)),
            "context_bytes": int(ctx.group(2)),
            "cache_bytes": int(ctx.group(3)),
            "activation_bytes": int(ctx.group(4)),
            "prefill_chunk": int(ctx.group(5)),
            "peak_rss": peak,
            "overhead": peak - need,
            "within_budget_plus_fixed_overhead": peak <= need + FIXED_OVERHEAD,
            "wall_secs": wall,
            "prefill_secs": st["prefill_secs"],
            "prefill_tps": st["prefill_tps"],
            "loadavg_before_after": load,
        }
        if p <= unchunked_max:
            code, text, upeak, uwall, uload = run(
                base + ["--memory-budget", str(need), "--prefill-chunk", str(p)], cache
            )
            row["one_pass"] = {
                "exit": code,
                "peak_rss": upeak,
                "wall_secs": uwall,
                "loadavg_before_after": uload,
                "note": "the same run with --prefill-chunk = prompt (no chunking); refused when its activations do not fit the budget",
                "stderr_tail": text.strip().splitlines()[-1:] if code != 0 else [],
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    doc = {
        "format": "keep-budget-vs-prompt",
        "version": 1,
        "command": " ".join(sys.argv),
        "keep": KEEP,
        "model": model,
        "fixed_overhead": FIXED_OVERHEAD,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "rule": "peak_rss <= budget + fixed_overhead for every prompt length, the budget being the least keep accepts",
        "verdict": "PASS" if all(r["within_budget_plus_fixed_overhead"] for r in rows) else "FAIL",
        "rows": rows,
    }
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
