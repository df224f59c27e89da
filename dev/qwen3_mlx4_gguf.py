"""A q4_0 GGUF of an MLX affine 4-bit Qwen3-MoE checkpoint, written by llama.cpp's own converter.

llama.cpp's `convert_hf_to_gguf.py` reads Hugging Face float tensors and writes at most Q8_0
(`--outtype` f32/f16/bf16/q8_0/tq1_0/tq2_0); it has no reader for MLX's affine layout (its
`dequant_model` knows FP8, GPTQ, bitnet, compressed-tensors and ModelOpt; an mlx-community
`quantization_config` has no `quant_method`, so nothing is dequantized). The only way to a q4_0
GGUF of a model through its own tools is a bf16 source and `llama-quantize`, and a full-depth
Qwen3-30B-A3B in bf16 is 61 GB. So the converter is run in this process, unchanged except for
three patches, each the smallest that does the job:

(a) its tensor index (`index_tensors`) lists the MLX checkpoint under Hugging Face's names
    (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` for expert E of the stacked
    `mlp.switch_mlp.*`, router `mlp.gate.weight`, `self_attn.*`, `embed_tokens`, `lm_head`,
    norms), each a lazy tensor (the converter's own `LazyTorchTensor`) that dequantizes only
    its slice when the writer reaches it: `w = scale * q + bias` per group of 64 in float32, a
    multiply then an add (MLX's affine rule, the value keep's `mlx_affine` decode computes),
    codes unpacked from MLX's little-endian uint32 bit stream. Memory stays at about one
    stacked tensor (a few GiB), whatever the depth;
(b) its per-tensor type hook (`tensor_force_quant`, the one it uses for `--fp8-as-q8`) answers
    Q4_0 where it would have answered "use the file type" for a matrix, so everything the
    converter writes in its quantized type under `--outtype q8_0` is written Q4_0 by gguf-py's
    numpy quantizer (the same rule as ggml's `quantize_row_q4_0_ref`), token embedding and
    output included (the MLX checkpoint has those at 4 bits too); what the converter keeps in
    F32 (routers `ffn_gate_inp`, norms) stays F32;
(c) the file type it records (`general.file_type`) is MOSTLY_Q4_0, not MOSTLY_Q8_0;
plus, as in dev/qwen3-llama-cpp.sh, the pre-tokenizer check is answered "qwen2" (the synthetic
checkpoint carries the bundled tiny model's tokenizer; the vocabulary plays no part in timings).

The converter sees a staging directory holding the checkpoint's config.json without its
`quantization` / `quantization_config` (the tensors it is handed are floats) and the tokenizer
files; the MLX checkpoint itself is only read. The GGUF is written to OUT.part and renamed.
Afterwards the GGUF is read back with gguf-py and checked: every tensor Q4_0 or F32, F32 only
for norms and routers, and for a few experts of the first and last layers, llama.cpp's Q4_0
dequantized against the MLX dequantization (relative RMS error under Q4_0's) — a wrong name,
transpose or expert order fails here.

Usage: PYTHON qwen3_mlx4_gguf.py LLAMA_CPP_SRC MLX4_DIR TOKENIZER_DIR OUT.gguf
PYTHON needs torch, numpy, pyyaml, tqdm (what the converter imports). Used by
dev/qwen3-bigger-than-ram.sh; not part of .ci/run.
"""

import json
import os
import re
import runpy
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

GROUP = 64  # MLX affine group size (mlx-community's default; checked against the shapes below)
# Q4_0 of random Gaussian-like weights has a relative RMS error of about 0.1 (4 bits, absmax
# scale per 32); 0.2 leaves room and still fails a transposed or misnamed tensor (error ~1.4).
Q4_0_REL_RMS_MAX = 0.2


class MlxCheckpoint:
    """The tensors of an MLX safetensors checkpoint (one file or an index), memory-mapped."""

    def __init__(self, root: Path):
        self.root = root
        index = root / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
                 if index.is_file() else ["model.safetensors"])
        self.where: dict[str, tuple[Path, dict]] = {}
        for f in files:
            path = root / f
            with open(path, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(n))
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                self.where[name] = (path, {**info, "base": base})

    def names(self):
        return self.where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name][1]["shape"])

    def array(self, name: str) -> np.ndarray:
        path, info = self.where[name]
        dtype = {"U32": np.uint32, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}[info["dtype"]]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = (end - start) // np.dtype(dtype).itemsize
        assert count == int(np.prod(shape, dtype=np.int64)), name
        return np.memmap(path, dtype=dtype, mode="r", offset=info["base"] + start, shape=shape)

    def floats(self, name: str, index=()) -> np.ndarray:
        """A float tensor (or its `index` slice) widened exactly to float32."""
        a = self.array(name)[index]
        if self.where[name][1]["dtype"] == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a.astype(np.float32)

    def bits(self, prefix: str) -> int:
        """The code width of quantized `prefix` from its shapes (words · 32 / (groups · 64))."""
        words = self.shape(prefix + ".weight")[-1]
        groups = self.shape(prefix + ".scales")[-1]
        bits, rem = divmod(words * 32, groups * GROUP)
        if rem or bits not in (2, 4, 8):
            raise ValueError(f"{prefix}: {words} words for {groups} groups is not 2/4/8-bit affine")
        return bits

    def dequant(self, prefix: str, index=()) -> np.ndarray:
        """`w = scale * q + bias` per group of 64, float32 (multiply, then add)."""
        bits = self.bits(prefix)
        words = np.ascontiguousarray(self.array(prefix + ".weight")[index])
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
        codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
        cols = words.shape[-1] * per
        codes = codes.reshape(*words.shape[:-1], cols // GROUP, GROUP).astype(np.float32)
        scale = self.floats(prefix + ".scales", index)[..., None]
        bias = self.floats(prefix + ".biases", index)[..., None]
        w = codes * scale
        w += bias
        return w.reshape(*words.shape[:-1], cols)


def hf_tensors(ck: MlxCheckpoint, n_experts: int):
    """(Hugging Face name, shape, loader) for every tensor the converter should see."""
    out = []
    for name in sorted(ck.names()):
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name.removesuffix(".weight")
        quantized = prefix + ".scales" in ck.where
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp)\.switch_mlp\.(gate_proj|up_proj|down_proj)", prefix)
        if m:
            stacked = ck.shape(name)
            if stacked[0] != n_experts:
                raise ValueError(f"{name}: {stacked[0]} experts, config says {n_experts}")
            rows, cols = stacked[1], stacked[2] * 32 // ck.bits(prefix)
            for e in range(n_experts):
                out.append((f"{m.group(1)}.experts.{e}.{m.group(2)}.weight", (rows, cols),
                            lambda p=prefix, e=e: ck.dequant(p, e)))
        elif quantized:
            rows, words = ck.shape(name)
            out.append((name, (rows, words * 32 // ck.bits(prefix)), lambda p=prefix: ck.dequant(p)))
        else:
            out.append((name, ck.shape(name), lambda n=name: ck.floats(n)))
    return out


def convert(src: Path, mlx: Path, tok: Path, out: Path) -> None:
    sys.path.insert(0, str(src))
    sys.path.insert(0, str(src / "gguf-py"))
    import torch
    import gguf
    import conversion.base as base
    from conversion.qwen import Qwen3MoeModel

    config = json.loads((mlx / "config.json").read_text())
    ck = MlxCheckpoint(mlx)
    tensors = hf_tensors(ck, config["num_experts"])

    stage = out.parent / (out.name + ".hf")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    hf_config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (stage / "config.json").write_text(json.dumps(hf_config, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tok / f).is_file():
            shutil.copy(tok / f, stage / f)

    # Patch (a): the tensor index is the MLX checkpoint, dequantized lazily, under HF names.
    def index_tensors(self, remote_hf_model_id=None):
        del remote_hf_model_id
        index = {}
        for name, shape, load in tensors:
            def gen(shape=shape, load=load):
                return base.LazyTorchTensor(
                    meta=base.LazyTorchTensor.meta_with_dtype_and_shape(torch.float32, shape),
                    func=lambda: torch.from_numpy(load()))
            if item := self.filter_tensors((name, gen)):
                index[item[0]] = item[1]
        return index
    Qwen3MoeModel.index_tensors = index_tensors

    # Patch (b): Q4_0 wherever the converter would use the file type's quantized type for a
    # matrix; its own choices (F32 routers and norms, any forced type) are kept.
    force = base.ModelBase.tensor_force_quant

    def tensor_force_quant(self, name, new_name, bid, n_dims):
        forced = force(self, name, new_name, bid, n_dims)
        if forced is not False or n_dims < 2 or self.match_model_tensor_name(
                new_name, gguf.MODEL_TENSOR.FFN_GATE_INP, bid):
            return forced
        return gguf.GGMLQuantizationType.Q4_0
    Qwen3MoeModel.tensor_force_quant = tensor_force_quant

    # Patch (c): record the file type the tensors have.
    add_file_type = gguf.GGUFWriter.add_file_type
    gguf.GGUFWriter.add_file_type = lambda self, ftype: add_file_type(
        self, gguf.LlamaFileType.MOSTLY_Q4_0 if ftype == gguf.LlamaFileType.MOSTLY_Q8_0 else ftype)

    # The synthetic checkpoint carries the bundled model's tokenizer; the converter only needs a
    # known pre-tokenizer name for it.
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"

    part = out.parent / (out.name + ".part")
    sys.argv = ["convert_hf_to_gguf.py", str(stage), "--outtype", "q8_0", "--outfile", str(part)]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
    shutil.rmtree(stage)
    check(gguf, ck, config, part)
    os.replace(part, out)


def check(gguf, ck: MlxCheckpoint, config: dict, path: Path) -> None:
    """Read the GGUF back: types, and a few experts' Q4_0 values against the MLX values."""
    reader = gguf.GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    q4, f32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.F32
    for t in reader.tensors:
        if t.tensor_type == f32:
            if not (t.name.endswith("norm.weight") or t.name.endswith("ffn_gate_inp.weight")):
                raise ValueError(f"{t.name} is F32 in the GGUF; expected Q4_0")
        elif t.tensor_type != q4:
            raise ValueError(f"{t.name} is {t.tensor_type.name} in the GGUF; expected Q4_0 or F32")
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    worst = 0.0
    for layer in sorted({0, layers - 1}):
        for proj, ggml in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                           ("down_proj", "ffn_down_exps")):
            t = by_name[f"blk.{layer}.{ggml}.weight"]
            # GGUF stores ggml's ne reversed from numpy: numpy [experts, rows, cols].
            data = np.asarray(t.data).reshape(experts, -1)
            for e in sorted({0, 1, experts - 1}):
                want = ck.dequant(f"model.layers.{layer}.mlp.switch_mlp.{proj}", e)
                got = gguf.quants.dequantize(data[e], q4).reshape(want.shape)
                rel = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
                worst = max(worst, rel)
                if not rel < Q4_0_REL_RMS_MAX:
                    raise ValueError(f"blk.{layer}.{ggml} expert {e}: relative RMS error {rel:.3f} "
                                     f"against the MLX weights (limit {Q4_0_REL_RMS_MAX})")
    q4_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type == q4)
    print(f"checked {path.name}: {len(reader.tensors)} tensors, {q4_bytes / 2**30:.2f} GiB of Q4_0; "
          f"experts of layers 0 and {layers - 1} against the MLX weights: worst relative RMS "
          f"error {worst:.4f} (limit {Q4_0_REL_RMS_MAX})", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    convert(*(Path(a).resolve() for a in sys.argv[1:5]))
