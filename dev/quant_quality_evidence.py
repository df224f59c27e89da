"""Write the evidence of `dev/quant-quality.sh` from its work directory: one file for the E8P
lattice rungs and one for MLX affine 2/3/4-bit, each row a format's bits per weight, keep eval's
KL, ΔNLL and top-1 against the teacher, the mean weighted relative error per expert of each
stage, the fit's seconds and speed, and the load averages read before the fit and the eval.

    python3 dev/quant_quality_evidence.py WORKDIR E8P_OUT.json MLX_OUT.json
"""
import json
import subprocess
import sys
from pathlib import Path

E8P = ["e8p2", "e8p2+e81", "e8p2+e8p2"]
MLX = ["mlx2", "mlx3", "mlx4"]
SHIPPED = {"bits_per_weight_routed_experts": 4.25, "mean_kl": 0.0, "notes": "the teacher itself"}


def row(w: Path, f: str) -> dict:
    q = json.loads((w / f"quant-{f}.json").read_text())
    s = json.loads((w / f"eval-{f}.json").read_text())["students"][0]
    errs: dict = {}
    for e in q["experts"]:
        for k, v in e["rel_error"].items():
            errs.setdefault(k, []).append(v)
    mb = q["source_bytes_fitted"] / 1e6
    return {
        "format": f,
        "bits_per_weight_routed_experts": q["bits_per_weight"],
        "mean_kl": s["mean_kl"],
        "mean_dnll": s["mean_dnll"],
        "top1": s["top1"],
        "positions": s["positions"],
        "mean_rel_weighted_error_per_expert": {k: sum(v) / len(v) for k, v in errs.items()},
        "fit_seconds": q["fit_seconds"],
        "source_expert_MB": mb,
        "fit_MB_per_s": mb / max(q["fit_seconds"], 1e-9),
        "fit_loadavg_before": (w / f"load-{f}.txt").read_text().strip(),
    }


def machine() -> dict:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    import os
    return {"cores": os.cpu_count(), "cpu": name, "commit": commit}


def main() -> None:
    w, e8p_out, mlx_out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    common = {
        "format": "keep-evidence",
        "version": 1,
        "machine": machine(),
        "commands": [
            "keep calibrate --out RUN",
            "keep finalize RUN",
            "keep calibrate --split eval --out EVAL",
            "keep quant --imatrix RUN --format F --force --json --out OUT",
            "keep eval --teacher EVAL --json OUT",
        ],
        "rerun": "dev/quant-quality.sh WORKDIR, then python3 dev/quant_quality_evidence.py WORKDIR E8P_OUT MLX_OUT",
        "shipped_fp4": SHIPPED,
    }
    for out, fmts, what in [
        (e8p_out, E8P, "keep quant's E8P lattice rungs on the bundled model's routed experts, scored by keep eval against the teacher's held-out split (the bundled pack's eval split); the teacher is the shipped model (FP4 experts), so the shipped FP4 row is KL 0 by construction; fit speeds depend on the machine's load (recorded per row)"),
        (mlx_out, MLX, "MLX affine 2/3/4-bit (group 64, bf16 scale and bias per group, mx.quantize's exact output computed by keep) on the bundled model's routed experts, scored the same way"),
    ]:
        rows = [row(w, f) for f in fmts if (w / f"eval-{f}.json").exists()]
        Path(out).write_text(json.dumps({**common, "what": what, "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
