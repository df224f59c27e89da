"""MLX affine quantization fixtures: `mx.quantize` / `mx.dequantize` (mlx 0.32.4, CPU) at
2, 3, 4 and 8 bits, group 64, on small f32 and bf16 matrices, for keep-format's tests.

    tools/oracle/.venv/bin/python tools/oracle/mlx_affine_fixture.py \
        --out fixtures/mlx-affine/mlx-affine.safetensors

Writes one safetensors file (metadata format=keep-fixture-mlx-affine, version=1, command,
mlx version). For each case `c{i}` (the list is in the metadata `cases` as JSON: bits, source
dtype, shape):
- `c{i}.w`: the source matrix (F32 or BF16) `[rows, cols]`;
- `c{i}.q`: `mx.quantize`'s codes, U32 `[rows, cols * bits / 32]`;
- `c{i}.scales`, `c{i}.biases`: its parameters, in the source dtype, `[rows, cols / 64]`;
- `c{i}.deq`: `mx.dequantize(..., dtype=float32)` of them, F32 `[rows, cols]`.
The matrices mix magnitudes (1e-4 .. 10), offsets, and special groups: all equal, all zero,
min and max of equal magnitude, a range below MLX's 1e-7 floor.
"""
import argparse
import json
import sys
from importlib.metadata import version

import mlx.core as mx
import numpy as np

GROUP = 64


def matrix(rng, rows, cols, case):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w *= np.float32(10.0 ** rng.integers(-4, 2))
    if case % 2:
        w += np.float32(rng.standard_normal() * np.abs(w).max())
    g = w.reshape(rows, cols // GROUP, GROUP)
    g[0, 0, :] = np.float32(0.37)  # all equal
    if rows > 1:
        g[1, 0, :] = 0.0  # all zero
        g[1, -1, :] = np.linspace(-1.0, 1.0, GROUP, dtype=np.float32)  # |min| == |max|
    if rows > 2:
        g[2, 0, :] = np.float32(1.0) + np.arange(GROUP, dtype=np.float32) * np.float32(1e-9)
    return g.reshape(rows, cols)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(20261202)
    arrays, cases = {}, []
    i = 0
    for bits in (2, 3, 4, 8):
        for dt in ("float32", "bfloat16"):
            for rows, cols in ((3, 192), (5, 320)):
                w = matrix(rng, rows, cols, i)
                wa = mx.array(w)
                if dt == "bfloat16":
                    wa = wa.astype(mx.bfloat16)
                q, s, b = mx.quantize(wa, group_size=GROUP, bits=bits)
                deq = mx.dequantize(q, s, b, group_size=GROUP, bits=bits, dtype=mx.float32)
                arrays[f"c{i}.w"] = wa
                arrays[f"c{i}.q"] = q
                arrays[f"c{i}.scales"] = s
                arrays[f"c{i}.biases"] = b
                arrays[f"c{i}.deq"] = deq
                cases.append({"name": f"c{i}", "bits": bits, "dtype": dt, "rows": rows, "cols": cols})
                i += 1
    meta = {
        "format": "keep-fixture-mlx-affine",
        "version": "1",
        "command": "tools/oracle/.venv/bin/python " + " ".join(sys.argv),
        "mlx": version("mlx"),
        "cases": json.dumps(cases),
    }
    mx.save_safetensors(args.out, arrays, metadata=meta)


if __name__ == "__main__":
    main()
