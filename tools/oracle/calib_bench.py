#!/usr/bin/env python3
"""mlx-lm's side of keep's calibration benchmark (not a test): run the plain forward of mlx-lm
over the records of a keep pack (one call per record from an empty cache, logits evaluated),
the same records `keep calibrate` runs, and print one JSON line with tokens/s.

Records: the groups of --split in pack order whose index is ≡ I (mod N) for --shard I/N (the
same rule as `keep calibrate --shard`). Usage: calib_bench.py MODEL PACK [--split calibration]
[--shard 0/1]
"""
import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from mlx_lm.utils import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("pack", type=Path)
    ap.add_argument("--split", default="calibration")
    ap.add_argument("--shard", default="0/1")
    a = ap.parse_args()
    i, n = (int(x) for x in a.shard.split("/"))
    mx.set_default_device(mx.cpu)
    manifest = json.loads((a.pack / "pack.json").read_text())
    groups = [g["id"] for g in manifest["groups"] if g["split"] == a.split]
    mine = {g for k, g in enumerate(groups) if k % n == i}
    recs = []
    for line in (a.pack / manifest["records_file"]).read_text().splitlines():
        r = json.loads(line)
        if r["group"] in mine:
            recs.append(r["tokens"])
    model, _ = load_model(a.model)
    t0 = time.perf_counter()
    tokens = 0
    for r in recs:
        cache = model.make_cache()
        out = model(mx.array([r]), cache=cache)
        mx.eval(out)
        tokens += len(r)
    s = time.perf_counter() - t0
    print(json.dumps({"impl": "mlx-lm", "records": len(recs), "tokens": tokens,
                      "seconds": round(s, 3), "tok_s": round(tokens / s, 1)}))


if __name__ == "__main__":
    main()
