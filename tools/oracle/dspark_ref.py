#!/usr/bin/env python3
"""DeepSeek-V4.1 DSpark (the drafter under `mtp.0.*` … `mtp.2.*`), transcribed for keep's oracle.

Followed copy (see docs/dspark.md for the pins and every disagreement between public copies):
NVIDIA-NeMo/Automodel `nemo_automodel/components/models/deepseek_v41/dspark.py`
(`_DeepseekV41DSparkAttention.forward`, `_DeepseekV41DSparkBlock.forward`,
`DeepseekV41DSparkBackbone.{forward, build_position_ids, build_attention_mask}`, the Markov and
confidence heads), commit 5cb4239453a14c426e3b36395ae9a12483c93a88, file SHA-256
e72088579c42444eccf24d2eea3ae933846a769b361fb1dec34b943d1582110e (git blob
3b082ce46d59e567e387a3c416fec1193150135d); the pieces it inherits from
`deepseek_v41/attention.py` at the same commit (`_RotaryEmbedding`, `_apply_rope`,
`DeepseekV41Attention._project_output`); the head wiring of
`speculative/dspark/draft_deepseek_v41.py` (commit 1ffdc35810512d35f7f60542e3f4a9d5777d32c2,
SHA-256 83213aeef931f407c7b1f61e110088a41169a38a3a83f1cba1a01b90947f87ac) and the greedy block
sampler of `speculative/dspark/markov_head.py` (`VanillaMarkov.sample_block_tokens`).

What one draft computes, for target context rows 0..C-1 at absolute positions start..start+C-1
(the anchor is the last row, position a = start + C - 1) and the token `first` of the first draft
slot (NeMo's trainer puts the anchor row's own token there; vLLM's and a serving engine's
proposers the token the target sampled from the anchor row — docs/dspark.md, "Which token"):

    main   = RMSNorm(main_proj · concat_L(target features)) ⊙ main_norm          [C, dim]
    x      = embed([first, noise, …, noise])  at positions a+1 … a+B              [B, dim]
    streams = x copied to hc streams, pre = one-hot(0)
    for each stage k: (streams, pre) = Block_k(streams, pre; main)
    hidden = Σ_s pre_s · streams_s ;  normed = RMSNorm(hidden) ⊙ norm            [B, dim]
    base   = head · normed                                                        [B, vocab]
    d_0 = first; for j = 1..B:
        e_j = markov_head.embed[d_{j-1}]
        logits_j = base_j + markov_head.head · e_j ;  d_j = argmax logits_j
        confidence_j = confidence_head.proj · [hidden_j ; e_j]   (a logit; sigmoid = P(accept))

Block_k is one V4.1 single-pass-mHC block whose attention queries sit at positions a+1..a+B and
see the context rows at positions (a − sliding_window, a] plus every row of their own block
(no causal mask inside the block), each stage projecting the same `main` rows with its own
`wkv`. Everything runs in float32 on CPU (torch), as keep computes; the NeMo copy runs bf16
weights with fp32 norms, gates and heads.

The training form (`training_form`) is the NeMo backbone as written — several anchors in one
pass over the whole context with `build_attention_mask` — and `check` requires it to agree with
the single-anchor inference form above for every anchor.

Usage:
  dspark_ref.py check [DIR]                       self-check (synthesises a module when no DIR)
  dspark_ref.py run DIR --inputs IN.safetensors --out OUT.safetensors
  dspark_ref.py fixture OUTDIR [--seed N]         synthetic module (OUTDIR/model) + inputs + expected
IN holds `target_hidden` f32 [C, L·dim], `first_token` i32 [1], `start_pos` i32 [1].
"""
import argparse
import json
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))

# `DeepseekV41TextConfig` defaults (deepseek_v41/config.py), for the keys DSpark reads.
DEFAULTS = {
    "num_hidden_layers": 40,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128,
    "dspark_num_experts_per_tok": 3,
    "sliding_window": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 1.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "o_groups": 8,
}
STREAM_DTYPES = ("F32", "BF16", "F16")


class Cfg:
    def __init__(self, c):
        c = c.get("text_config", c)
        g = lambda k: c.get(k, DEFAULTS.get(k))  # noqa: E731
        self.raw = c
        self.vocab = c["vocab_size"]
        self.dim = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.head_dim = c["head_dim"]
        self.rope_dim = c["qk_rope_head_dim"]
        self.q_lora = c["q_lora_rank"]
        self.o_lora = c["o_lora_rank"]
        self.o_groups = g("o_groups")
        self.window = g("sliding_window")
        self.hc = g("hc_mult")
        self.hc_iters = g("hc_sinkhorn_iters")
        self.hc_eps = g("hc_eps")
        self.eps = g("rms_norm_eps")
        self.theta = g("rope_theta")
        self.route_scale = g("routed_scaling_factor")
        self.norm_topk = g("norm_topk_prob")
        self.swiglu_limit = g("swiglu_limit") or 0.0
        self.stages = g("num_nextn_predict_layers")
        self.block = g("dspark_block_size")
        self.noise = g("dspark_noise_token_id")
        self.targets = list(g("dspark_target_layer_ids"))
        self.rank = g("dspark_markov_rank")
        self.experts = g("dspark_n_routed_experts")
        self.top_k = g("dspark_num_experts_per_tok")
        if self.stages <= 0 or self.block <= 0:
            raise ValueError("DSpark needs num_nextn_predict_layers > 0 and dspark_block_size > 0")
        if self.heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")


# ---------------------------------------------------------------------------------- weights
def _header(path: Path):
    with path.open("rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def load_tensors(d: Path):
    """Every `embed.weight`, `head.weight` and `mtp.*` tensor of DIR as float32 torch tensors.

    Float tensors load as they are; FP8/FP4 weights are dequantised with their `.scale` by
    tools/oracle/v4flash_ref.py's `dequant` (imported only then: it pulls in transformers)."""
    want = lambda n: n in ("embed.weight", "head.weight") or n.startswith("mtp.")  # noqa: E731
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files")
    quantized = any(
        info["dtype"] not in STREAM_DTYPES
        for f in files
        for n, info in _header(f).items()
        if n != "__metadata__" and want(n) and not n.endswith(".scale")
    )
    out = {}
    if quantized:
        import v4flash_ref as ref

        cfg = json.loads((d / "config.json").read_text())
        q = cfg.get("quantization_config") or {}
        if q.get("weight_block_size"):
            ref.BLOCK = tuple(q["weight_block_size"])
        T = ref.read_all(d)
        for n in T:
            if want(n) and not (n.endswith(".scale") and n[: -len(".scale")] + ".weight" in T):
                out[n] = torch.from_numpy(np.ascontiguousarray(ref.dequant(T, n), dtype=np.float32))
        return out
    from safetensors.torch import load_file as load_torch

    for f in files:
        for n, t in load_torch(str(f)).items():
            if want(n):
                out[n] = t.float()
    return out


class Weights:
    def __init__(self, T, cfg: Cfg):
        self.T = T
        missing = [n for n in self.required(cfg) if n not in T]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} DSpark tensor(s), e.g. {missing[:4]}")

    @staticmethod
    def required(cfg: Cfg):
        names = ["embed.weight", "head.weight"]
        for k in range(cfg.stages):
            p = f"mtp.{k}."
            names += [p + s for s in (
                "attn_norm.weight", "ffn_norm.weight", "attn.wq_a.weight", "attn.q_norm.weight",
                "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight", "attn.wo_a.weight",
                "attn.wo_b.weight", "attn.attn_sink", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "ffn.gate.weight", "ffn.gate.bias",
                "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                "ffn.shared_experts.w3.weight")]
            names += [f"{p}ffn.experts.{e}.w{i}.weight" for e in range(cfg.experts) for i in (1, 2, 3)]
        names += ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight"]
        last = f"mtp.{cfg.stages - 1}."
        names += [last + s for s in ("norm.weight", "markov_head.embed.weight", "markov_head.head.weight",
                                     "confidence_head.proj.weight")]
        return names

    def __getitem__(self, n):
        return self.T[n]


# ---------------------------------------------------------------------------------- pieces
def rms_norm(x, w, eps):
    """`DeepseekV41RMSNorm`: x · rsqrt(mean(x²) + eps) · w, in float32."""
    x = x.float()
    return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def rope_angles(cfg: Cfg, positions):
    """`_RotaryEmbedding(compressed=False)`: a DSpark layer has compress ratio 0, so rope_theta
    and no YaRN. positions: int64 [n] → float32 [n, rope_dim / 2]."""
    freqs = 1.0 / (cfg.theta ** (torch.arange(0, cfg.rope_dim, 2, dtype=torch.float32) / cfg.rope_dim))
    return positions.float().unsqueeze(-1) * freqs


def apply_rope(x, angles, inverse=False):
    """`_apply_rope`: adjacent pairs of the last 2·pairs channels rotated as complex numbers.
    x: [n, c] or [n, heads, c]; angles: [n, pairs]."""
    rd = angles.shape[-1] * 2
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    f = torch.polar(torch.ones_like(angles), angles)
    if x.ndim == 3:
        f = f.unsqueeze(1)
    if inverse:
        f = f.conj()
    rotated = torch.view_as_real(pairs * f).flatten(-2)
    return torch.cat((x[..., :-rd], rotated), dim=-1)


def hc_mix(cfg: Cfg, streams, fn, base, scale):
    """`DeepseekV41HyperConnection.compute_weights`: (pre [n, hc], post [n, hc], comb [n, hc, hc]).
    comb[i, a, b] mixes input stream a into output stream b (Sinkhorn: row softmax + eps, then
    the columns, then iters − 1 times the rows and the columns)."""
    hc = cfg.hc
    flat = streams.flatten(1)
    mixes = (flat @ fn.T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.eps)
    scales = torch.cat((scale[0].expand(hc), scale[1].expand(hc), scale[2].expand(hc * hc)))
    logits = base + mixes * scales
    pre = torch.sigmoid(logits[:, :hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(logits[:, hc:2 * hc])
    comb = logits[:, 2 * hc:].unflatten(-1, (hc, hc)).softmax(-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_iters - 1):
        comb = comb / (comb.sum(dim=2, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def hc_collapse(streams, pre):
    """Σ_s pre_s · streams_s: [n, hc, dim] × [n, hc] → [n, dim]."""
    return (pre.unsqueeze(-1) * streams).sum(1)


def hc_expand(y, residual, post, comb):
    """streams'_b = post_b · y + Σ_a comb[a, b] · residual_a."""
    return post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("nab,nad->nbd", comb, residual)


def attention(cfg: Cfg, W, p, x, main, q_pos, kv_pos, bias):
    """`_DeepseekV41DSparkAttention.forward` for one block of queries.

    x: [B, dim] normed draft rows at positions q_pos; main: [C', dim] projected context rows at
    kv_pos (context first, then the block is appended as keys); bias: [B, C' + B] additive mask."""
    H, hd = cfg.heads, cfg.head_dim
    qa, ka = rope_angles(cfg, q_pos), rope_angles(cfg, torch.cat((kv_pos, q_pos)))
    q = rms_norm(x @ W[p + "attn.wq_a.weight"].T, W[p + "attn.q_norm.weight"], cfg.eps)
    q = apply_rope((q @ W[p + "attn.wq_b.weight"].T).unflatten(-1, (H, hd)), qa)
    src = torch.cat((main, x), 0)
    kv = apply_rope(rms_norm(src @ W[p + "attn.wkv.weight"].T, W[p + "attn.kv_norm.weight"], cfg.eps), ka)
    # The zero key adds exp(sink) to each head's softmax denominator only.
    kv = torch.cat((kv, kv.new_zeros(1, hd)), 0)
    logits = torch.einsum("shd,td->hst", q, kv) * hd ** -0.5
    sink = W[p + "attn.attn_sink"].view(H, 1, 1).expand(H, x.shape[0], 1)
    logits = logits + torch.cat((bias.unsqueeze(0).expand(H, -1, -1), sink), -1)
    att = torch.einsum("hst,td->shd", logits.softmax(-1), kv)
    att = apply_rope(att, qa, inverse=True)
    # `_project_output`: grouped wo_a (group g reads its own heads' slice), then wo_b.
    G = cfg.o_groups
    grouped = att.reshape(x.shape[0], G, -1)
    wo_a = W[p + "attn.wo_a.weight"].view(G, cfg.o_lora, -1)
    oa = torch.einsum("sgi,gri->sgr", grouped, wo_a).flatten(1)
    return oa @ W[p + "attn.wo_b.weight"].T


def swiglu(x, w1, w2, w3, limit):
    g, u = x @ w1.T, x @ w3.T
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u) @ w2.T


def moe(cfg: Cfg, W, p, x):
    """The stage's MoE with `DeepseekV4VisionGate(hash_routing=False)` on text tokens:
    scores = sqrt(softplus(gate · x)); top-k of scores + `ffn.gate.bias`; weights = the chosen
    scores, renormalised (norm_topk_prob, k > 1), times routed_scaling_factor; plus the shared
    expert. Returns (output [n, dim], chosen experts [n, k])."""
    scores = torch.sqrt(torch.nn.functional.softplus(x @ W[p + "ffn.gate.weight"].T))
    chosen = (scores + W[p + "ffn.gate.bias"]).topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if cfg.norm_topk and cfg.top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.route_scale
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for s in range(cfg.top_k):
            e = int(chosen[i, s])
            q = f"{p}ffn.experts.{e}."
            out[i] += weights[i, s] * swiglu(x[i:i + 1], W[q + "w1.weight"], W[q + "w2.weight"],
                                             W[q + "w3.weight"], cfg.swiglu_limit)[0]
    q = p + "ffn.shared_experts."
    out = out + swiglu(x, W[q + "w1.weight"], W[q + "w2.weight"], W[q + "w3.weight"], cfg.swiglu_limit)
    return out, chosen


def stage(cfg: Cfg, W, k, streams, pre, main, q_pos, kv_pos, bias):
    """`_DeepseekV41DSparkBlock.forward`: single-pass mHC — the attention collapses with the
    pre-mix handed in, the FFN with the attention site's, and the FFN site's is handed on."""
    p = f"mtp.{k}."
    residual = streams
    a_pre, a_post, a_comb = hc_mix(cfg, streams, W[p + "hc_attn_fn"], W[p + "hc_attn_base"], W[p + "hc_attn_scale"])
    x = rms_norm(hc_collapse(streams, pre), W[p + "attn_norm.weight"], cfg.eps)
    streams = hc_expand(attention(cfg, W, p, x, main, q_pos, kv_pos, bias), residual, a_post, a_comb)
    residual = streams
    f_pre, f_post, f_comb = hc_mix(cfg, streams, W[p + "hc_ffn_fn"], W[p + "hc_ffn_base"], W[p + "hc_ffn_scale"])
    x = rms_norm(hc_collapse(streams, a_pre), W[p + "ffn_norm.weight"], cfg.eps)
    y, chosen = moe(cfg, W, p, x)
    return hc_expand(y, residual, f_post, f_comb), f_pre, chosen


def project_main(cfg: Cfg, W, target):
    """`main_norm(main_proj(target))`: [C, L·dim] → [C, dim]."""
    if target.shape[-1] != cfg.dim * len(cfg.targets):
        raise ValueError(f"target features have width {target.shape[-1]}, expected "
                         f"{len(cfg.targets)} layers × {cfg.dim}")
    return rms_norm(target @ W["mtp.0.main_proj.weight"].T, W["mtp.0.main_norm.weight"], cfg.eps)


def backbone(cfg: Cfg, W, x0, main, q_pos, kv_pos, bias):
    """Stages over draft rows x0 [n, dim]; returns (hidden [n, dim], per-stage streams and pre)."""
    streams = x0.unsqueeze(1).expand(-1, cfg.hc, -1).clone()
    pre = torch.zeros(x0.shape[0], cfg.hc)
    pre[:, 0] = 1
    per_stage = []
    for k in range(cfg.stages):
        streams, pre, chosen = stage(cfg, W, k, streams, pre, main, q_pos, kv_pos, bias)
        per_stage.append((streams, pre, chosen))
    return hc_collapse(streams, pre), per_stage


def heads(cfg: Cfg, W, hidden, prev):
    """Base logits (frozen target head on the final-normed rows), the Markov bias of the
    preceding tokens `prev` and the confidence logits. Returns (base, markov, confidence)."""
    last = f"mtp.{cfg.stages - 1}."
    normed = rms_norm(hidden, W[last + "norm.weight"], cfg.eps)
    base = normed @ W["head.weight"].T
    e = W[last + "markov_head.embed.weight"][prev]
    markov = e @ W[last + "markov_head.head.weight"].T
    conf = (torch.cat((hidden, e), -1) @ W[last + "confidence_head.proj.weight"].T).squeeze(-1)
    return normed, base, markov, conf


def draft(cfg: Cfg, W, target, first_token: int, start_pos: int = 0):
    """One DSpark draft after the target has processed rows start..start+C-1 (the anchor is the
    last). Returns a dict of every intermediate the fixture records."""
    target = torch.as_tensor(target, dtype=torch.float32)
    C, B = target.shape[0], cfg.block
    a = start_pos + C - 1
    lo = max(0, C - cfg.window)  # rows at positions (a − window, a]
    main = project_main(cfg, W, target)[lo:]
    kv_pos = torch.arange(start_pos + lo, start_pos + C)
    q_pos = torch.arange(a + 1, a + 1 + B)
    bias = torch.zeros(B, main.shape[0] + B)  # the window and the whole block are visible
    ids = torch.full((B,), cfg.noise, dtype=torch.long)
    ids[0] = first_token
    x0 = W["embed.weight"][ids]
    hidden, per_stage = backbone(cfg, W, x0, main, q_pos, kv_pos, bias)
    # `VanillaMarkov.sample_block_tokens`, greedy: each step's bias from the token before it.
    last = f"mtp.{cfg.stages - 1}."
    normed = rms_norm(hidden, W[last + "norm.weight"], cfg.eps)
    base = normed @ W["head.weight"].T
    prev, tokens, logits, conf = first_token, [], [], []
    for j in range(B):
        e = W[last + "markov_head.embed.weight"][prev]
        lj = base[j] + e @ W[last + "markov_head.head.weight"].T
        conf.append((torch.cat((hidden[j], e)) @ W[last + "confidence_head.proj.weight"].T).squeeze(-1))
        prev = int(lj.argmax())
        tokens.append(prev)
        logits.append(lj)
    out = {
        "main_x": main, "hidden": hidden, "normed": normed, "base_logits": base,
        "draft_logits": torch.stack(logits), "confidence": torch.stack(conf),
        "draft_tokens": torch.tensor(tokens, dtype=torch.int32),
        "markov_prev": torch.tensor([first_token] + tokens[:-1], dtype=torch.int32),
        "query_positions": q_pos.to(torch.int32), "draft_input_ids": ids.to(torch.int32),
    }
    for k, (s, p, chosen) in enumerate(per_stage):
        out[f"stage{k}.streams"] = s
        out[f"stage{k}.pre_mix"] = p
        out[f"stage{k}.experts"] = chosen.to(torch.int32)
    return out


# ---------------------------------------------------------------------------------- training form
def training_form(cfg: Cfg, W, target, input_ids, anchors):
    """The NeMo backbone as the trainer runs it: anchors [n] (context indices, start 0), every
    block's queries over the whole projected context with `build_attention_mask`
    (block_keep_mask all true) and `build_position_ids`, inputs from `create_noise_embed`.
    Returns (hidden [n·B, dim], normed, base logits, teacher-forced Markov logits and confidence
    with previous tokens [anchor, t_{a+1}, …, t_{a+B−1}] clamped as `draft_deepseek_v41.py` does)."""
    target = torch.as_tensor(target, dtype=torch.float32)
    C, B, n = target.shape[0], cfg.block, len(anchors)
    anchors = torch.as_tensor(anchors, dtype=torch.long)
    main = project_main(cfg, W, target)
    kv_pos = torch.arange(C)
    q_pos = (anchors.unsqueeze(-1) + torch.arange(1, B + 1)).reshape(-1)
    q_idx = torch.arange(n * B).view(-1, 1)
    key = torch.arange(C + n * B).view(1, -1)
    anchor = anchors.repeat_interleave(B).view(-1, 1)
    ctx = (key < C) & (key <= anchor) & (key > anchor - cfg.window)
    own = (key >= C) & ((key - C) // B == q_idx // B)
    bias = torch.where(ctx | own, 0.0, float("-inf"))
    ids = torch.full((n * B,), cfg.noise, dtype=torch.long)
    ids[torch.arange(n) * B] = torch.as_tensor(input_ids)[anchors]
    hidden, _ = backbone(cfg, W, W["embed.weight"][ids], main, q_pos, kv_pos, bias)
    labels = (anchors.unsqueeze(-1) + torch.arange(1, B + 1)).clamp(max=C - 1)
    target_ids = torch.as_tensor(input_ids)[labels]
    prev = torch.cat((torch.as_tensor(input_ids)[anchors].unsqueeze(-1), target_ids[:, :-1]), -1).reshape(-1)
    normed, base, markov, conf = heads(cfg, W, hidden, prev)
    return hidden, normed, base, base + markov, conf


# ---------------------------------------------------------------------------------- CLI
def load(d: Path):
    cfg = Cfg(json.loads((d / "config.json").read_text()))
    return cfg, Weights(load_tensors(d), cfg)


def to_numpy(out):
    return {k: np.ascontiguousarray(v.detach().numpy()) for k, v in out.items()}


def run(d: Path, inputs: Path, dest: Path):
    cfg, W = load(d)
    I = load_file(str(inputs))
    out = draft(cfg, W, torch.from_numpy(I["target_hidden"]), int(I["first_token"][0]), int(I["start_pos"][0]))
    save_file(to_numpy(out), str(dest))
    return out


def check(d: Path | None):
    """Self-check: shapes, determinism, the window and block-causality rules, the greedy chain,
    and agreement of the inference form with NeMo's multi-anchor training form."""
    import dspark_synth

    tmp = None
    if d is None:
        tmp = tempfile.TemporaryDirectory()
        d = Path(tmp.name)
        dspark_synth.write_checkpoint(d, seed=7)
    cfg, W = load(d)
    B, L = cfg.block, len(cfg.targets)
    g = torch.Generator().manual_seed(11)
    C = cfg.window + 4 if cfg.window < 64 else 9
    target = torch.randn(C, L * cfg.dim, generator=g)
    anchor = 3 % cfg.vocab
    failures = []

    def expect(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    out = draft(cfg, W, target, anchor, start_pos=5)
    expect(out["hidden"].shape == (B, cfg.dim) and out["draft_logits"].shape == (B, cfg.vocab)
           and out["confidence"].shape == (B,) and out["draft_tokens"].shape == (B,)
           and all(out[f"stage{k}.streams"].shape == (B, cfg.hc, cfg.dim) for k in range(cfg.stages)),
           f"shapes: block {B}, dim {cfg.dim}, vocab {cfg.vocab}, {cfg.hc} streams, {cfg.stages} stages")
    expect(all(torch.isfinite(v.float()).all() for v in out.values()), "every output finite")
    again = draft(cfg, W, target.clone(), anchor, start_pos=5)
    expect(all(torch.equal(out[k], again[k]) for k in out), "deterministic: a second run is bit-identical")

    # Rows older than the window do not matter; a row inside it does.
    old = target.clone()
    old[: C - cfg.window] += 3.0
    o2 = draft(cfg, W, old, anchor, start_pos=5)
    expect(torch.equal(o2["hidden"], out["hidden"]), f"rows before the {cfg.window}-row window change nothing")
    inside = target.clone()
    inside[C - cfg.window] += 3.0
    o3 = draft(cfg, W, inside, anchor, start_pos=5)
    expect(not torch.equal(o3["hidden"], out["hidden"]), "the oldest row inside the window changes the block")

    # Greedy chain: each token is the argmax of base + Markov bias of the token before it.
    _, base, markov, conf = heads(cfg, W, out["hidden"], out["markov_prev"].long())
    close = lambda x, y: bool(torch.allclose(x, y, rtol=1e-6, atol=1e-6))  # noqa: E731
    expect(close(base + markov, out["draft_logits"]) and close(conf, out["confidence"]),
           "teacher-forcing the greedy chain reproduces its logits and confidence")
    expect(torch.equal(out["draft_logits"].argmax(-1).to(torch.int32), out["draft_tokens"]),
           "draft tokens are the argmax of the corrected logits")

    # Block-causality of the training form: a block sees context up to its anchor only, and no
    # other block; the inference form (window rows only, one block) is the same computation.
    n_ctx = C + 6
    tgt = torch.randn(n_ctx, L * cfg.dim, generator=g)
    ids = torch.randint(0, cfg.vocab, (n_ctx,), generator=g)
    anchors = [2, C - 1, n_ctx - 3]
    th, tn, tb, tm, tc = training_form(cfg, W, tgt, ids, anchors)
    worst = 0.0
    for i, a in enumerate(anchors):
        one = draft(cfg, W, tgt[: a + 1], int(ids[a]), start_pos=0)
        rows = slice(i * B, (i + 1) * B)
        for mine, theirs in ((one["hidden"], th[rows]), (one["base_logits"], tb[rows]),
                             (one["confidence"][:1], tc[rows][:1]), (one["draft_logits"][:1], tm[rows][:1])):
            worst = max(worst, float((mine - theirs).abs().max() / theirs.abs().max()))
        expect(torch.equal(one["markov_prev"][:1].long(), ids[a:a + 1]), f"anchor {a}: first Markov input is the anchor token")
    expect(worst < 1e-5, f"inference form = NeMo training form for anchors {anchors}: hidden, base logits, first "
           f"Markov logits and confidence (max rel diff {worst:.2e})")
    future = tgt.clone()
    future[anchors[0] + 1:] += 5.0
    fh = training_form(cfg, W, future, ids, anchors)[0]
    expect(torch.equal(fh[:B], th[:B]), "a block ignores context rows after its anchor")
    expect(not torch.equal(fh[B:], th[B:]), "later blocks do see those rows")
    if tmp is not None:
        tmp.cleanup()
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


def fixture(dest: Path, seed: int):
    """A synthetic module (dspark_synth) in DEST/model, with inputs.safetensors and
    expected.safetensors in DEST (beside the checkpoint directory, not in it)."""
    import dspark_synth

    dest.mkdir(parents=True, exist_ok=True)
    dspark_synth.write_checkpoint(dest / "model", seed=seed)
    cfg, W = load(dest / "model")
    g = torch.Generator().manual_seed(seed + 1)
    C = cfg.window + 3
    inputs = {
        "target_hidden": torch.randn(C, len(cfg.targets) * cfg.dim, generator=g).numpy(),
        "first_token": np.array([int(torch.randint(0, cfg.vocab - 1, (1,), generator=g))], np.int32),
        "start_pos": np.array([17], np.int32),
    }
    save_file(inputs, str(dest / "inputs.safetensors"))
    run(dest / "model", dest / "inputs.safetensors", dest / "expected.safetensors")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("dir", nargs="?", type=Path)
    r = sub.add_parser("run")
    r.add_argument("dir", type=Path)
    r.add_argument("--inputs", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    f = sub.add_parser("fixture")
    f.add_argument("dir", type=Path)
    f.add_argument("--seed", type=int, default=5)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.cmd == "check":
        return check(a.dir)
    if a.cmd == "run":
        out = run(a.dir, a.inputs, a.out)
        print("draft tokens", out["draft_tokens"].tolist(), "confidence", [round(float(v), 4) for v in out["confidence"]])
        return 0
    fixture(a.dir, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
