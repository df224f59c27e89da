"""A training-time DeepSeek-V4.1 text model in JAX.

It computes the same function as mlx-lm 0.32.2's `mlx_lm/models/deepseek_v41.py`
(full-sequence prefill from position 0) on the weights that `export.py` writes:
hyper-connections with sinkhorn, sqrtsoftplus routing with a correction bias,
clamped SwiGLU experts, a shared expert, the sliding window with sinks, the
compressor (ratio 1 and > 1), the indexer with top-k, candidate blocks, and
grouped output projection. `check_mlx.py` measures the difference.

Differences that exist only for training (switched by arguments):
- `qat=True` rounds the weights as the export does (FP8 32x32 blocks, FP4 per
  32 inputs, bf16), with a straight-through gradient;
- activation fake-quantization (FP8 window KV, FP4 compressed KV, FP4 index
  q/k) always runs, with a straight-through gradient;
- `capacity` > 0 dispatches the routed experts into fixed-size buffers
  (tokens over capacity are dropped); `capacity=0` is exact (no drops);
- the indexer gets a gradient from an auxiliary KL loss towards the main
  attention's distribution over the compressed entries (as DeepSeek trains its
  lightning indexer); the top-k selection itself has no gradient.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 64,
    "q_lora_rank": 128,
    "qk_rope_head_dim": 16,
    "o_groups": 2,
    "o_lora_rank": 64,
    "moe_intermediate_size": 128,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "sliding_window": 64,
    "compress_ratios": [0, 4, 1, 1, 2, 2, 2, 0],
    "kv_source_layer_ids": [1, 2, 4],
    "index_source_layer_ids": [1, 2, 4, 5],
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 8,
    "candidate_block_size": 4,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [],
    "bos_token_id": 0,
    "eos_token_id": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
    },
}


# ----------------------------------------------------------------------------
# number formats (shared with export.py, which must encode identically)

FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def round_fp4_idx(mag):
    """Magnitude code 0..7 of |x| <= 6, rounding as mlx-lm's _round_fp4."""
    idx = jnp.zeros(mag.shape, jnp.int32)
    for t in (0.25, 1.25, 2.5, 5.0):
        idx = idx + (mag > t).astype(jnp.int32)
    for t in (0.75, 1.75, 3.5):
        idx = idx + (mag >= t).astype(jnp.int32)
    return idx


def round_fp4(x):
    return jnp.sign(x) * jnp.asarray(FP4_LUT)[round_fp4_idx(jnp.abs(x))]


def ste(x, q):
    return x + jax.lax.stop_gradient(q - x)


def fq_act_fp8(x, block=32):
    """mlx-lm _fake_quant_fp8 (activations, last-axis blocks)."""
    shape = x.shape
    b = x.reshape(*shape[:-1], -1, block)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=-1, keepdims=True), 1e-4)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))
    q = jnp.clip(b / scale, -448.0, 448.0)
    q = q.astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(shape)


def fq_act_fp4(x, block, e4m3_scale=False):
    """mlx-lm _fake_quant_fp4 (activations, last-axis blocks)."""
    shape = x.shape
    b = x.reshape(*shape[:-1], -1, block)
    floor = 6.0 * 2.0**-9 if e4m3_scale else 6.0 * 2.0**-126
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=-1, keepdims=True), floor)
    if e4m3_scale:
        scale = (amax / 6.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 6.0)))
    q = round_fp4(jnp.clip(b / scale, -6.0, 6.0)) * scale
    return q.reshape(shape)


def fq_w_fp8(w):
    """FP8 E4M3 with one power-of-two scale per 32x32 tile (DeepSeek's ceil rule)."""
    o, i = w.shape[-2:]
    lead = w.shape[:-2]
    t = w.reshape(*lead, o // 32, 32, i // 32, 32)
    amax = jnp.max(jnp.abs(t), axis=(-3, -1), keepdims=True)
    amax = jnp.maximum(amax, 2.0**-120)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 448.0)))
    q = (t / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return q.reshape(w.shape)


def fq_w_fp4(w):
    """FP4 E2M1 with one power-of-two scale per 32 inputs (DeepSeek's ceil rule)."""
    shape = w.shape
    b = w.reshape(*shape[:-1], -1, 32)
    amax = jnp.maximum(jnp.max(jnp.abs(b), axis=-1, keepdims=True), 2.0**-120)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / 6.0)))
    q = round_fp4(jnp.clip(b / scale, -6.0, 6.0)) * scale
    return q.reshape(shape)


def fq_bf16(w):
    return w.astype(jnp.bfloat16).astype(jnp.float32)


# Which leaves are stored in which format (names as in the published checkpoint).
FP8_KEYS = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "idx_wq_b", "sh_w1", "sh_w2", "sh_w3")
FP4_KEYS = ("ex_w1", "ex_w2", "ex_w3")
F32_KEYS = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
            "hc_ffn_scale", "attn_sink", "cmp_wkv", "cmp_wgate", "cmp_norm")


def quantize_params(params, qat):
    """The weights as exported (rounded), with straight-through gradients."""
    if not qat:
        return params

    def leaf(name, w):
        if name in FP8_KEYS:
            return ste(w, fq_w_fp8(w))
        if name in FP4_KEYS:
            return ste(w, fq_w_fp4(w))
        if name in F32_KEYS:
            return w
        return ste(w, fq_bf16(w))

    out = {k: leaf(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = [{k: leaf(k, v) for k, v in lp.items()} for lp in params["layers"]]
    return out


# ----------------------------------------------------------------------------
# layout helpers


def layer_roles(cfg, i):
    ratios = cfg["compress_ratios"]
    ratio = ratios[i] if i < len(ratios) else 0
    kv = i in cfg["kv_source_layer_ids"]
    idx = i in cfg["index_source_layer_ids"]
    return {
        "ratio": ratio,
        "kv_source": bool(ratio) and kv,
        "index_source": bool(ratio) and idx,
        "has_compressor": kv,
        "has_indexer": idx,
        "indexer_has_k": idx and kv,
        "candidate_source": i == cfg["candidate_source_layer_id"],
    }


def init_params(cfg, seed):
    rng = np.random.default_rng(seed)
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, hd = cfg["num_attention_heads"], cfg["head_dim"]
    ql, G, ol = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    E, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    hc = cfg["hc_mult"]
    nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    L = cfg["num_hidden_layers"]
    std = 0.02
    out_std = 0.02 / math.sqrt(2 * L)

    def n(*shape, s=std):
        return rng.normal(0.0, s, shape).astype(np.float32)

    p = {
        "embed": n(V, D, s=1.0 / math.sqrt(D)),
        "head": n(V, D, s=1.0 / math.sqrt(D)),
        "norm": np.ones(D, np.float32),
        "layers": [],
    }
    mix = (2 + hc) * hc
    for i in range(L):
        r = layer_roles(cfg, i)
        lp = {
            "attn_norm": np.ones(D, np.float32),
            "ffn_norm": np.ones(D, np.float32),
            "wq_a": n(ql, D),
            "q_norm": np.ones(ql, np.float32),
            "wq_b": n(H * hd, ql),
            "wkv": n(hd, D),
            "kv_norm": np.ones(hd, np.float32),
            "wo_a": n(G * ol, H * hd // G),
            "wo_b": n(D, G * ol, s=out_std),
            "attn_sink": np.zeros(H, np.float32),
            "gate_w": n(E, D),
            "ex_w1": n(E, I, D),
            "ex_w3": n(E, I, D),
            "ex_w2": n(E, D, I, s=out_std),
            "sh_w1": n(I, D),
            "sh_w3": n(I, D),
            "sh_w2": n(D, I, s=out_std),
        }
        for which in ("attn", "ffn"):
            lp[f"hc_{which}_fn"] = n(mix, hc * D, s=0.01)
            lp[f"hc_{which}_base"] = np.zeros(mix, np.float32)
            lp[f"hc_{which}_scale"] = np.ones(3, np.float32)
        if r["has_compressor"]:
            lp["cmp_wkv"] = n(hd, D)
            if r["ratio"] > 1:
                lp["cmp_wgate"] = n(hd, D)
            lp["cmp_norm"] = np.ones(hd, np.float32)
        if r["has_indexer"]:
            lp["idx_wq_b"] = n(nh * ihd, ql)
            lp["idx_weights_proj"] = n(nh, D)
            if r["indexer_has_k"]:
                lp["idx_wk"] = n(ihd, hd)
                lp["idx_k_norm"] = np.ones(ihd, np.float32)
        p["layers"].append(lp)
    return jax.tree_util.tree_map(jnp.asarray, p)


def init_state(cfg):
    """Non-trained state: the routers' correction biases (and bias_vl, unused)."""
    E = cfg["n_routed_experts"]
    return {"gate_bias": jnp.zeros((cfg["num_hidden_layers"], E), jnp.float32)}


# ----------------------------------------------------------------------------
# the forward pass


def rms_norm(x, w, eps):
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def rope(x, pos, theta, rope_dim, inverse=False):
    """Interleaved RoPE on the trailing rope_dim features. x is [B, T, d] or
    [B, T, H, d]; pos [T] (float positions)."""
    freqs = np.float32(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim))
    ang = pos[:, None].astype(jnp.float32) * jnp.asarray((1.0 / freqs).astype(np.float32))
    if x.ndim == 4:
        ang = ang[:, None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if inverse:
        sin = -sin
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    x1, x2 = tail[..., 0::2], tail[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    tail = jnp.stack([o1, o2], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, tail], axis=-1)


def sinkhorn(comb, iters, eps):
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hyper(cfg, streams, fn, base, scale):
    hc = cfg["hc_mult"]
    B, T = streams.shape[:2]
    flat = rms_norm(streams.reshape(B, T, -1), None, cfg["rms_norm_eps"])
    ids = np.array([0] * hc + [1] * hc + [2] * hc * hc)
    mix = (flat @ fn.T) * scale[ids] + base
    pre, post, comb = mix[..., :hc], mix[..., hc:2 * hc], mix[..., 2 * hc:]
    pre = jax.nn.sigmoid(pre) + cfg["hc_eps"]
    post = 2.0 * jax.nn.sigmoid(post)
    comb = jax.nn.softmax(comb.reshape(B, T, hc, hc), axis=-1) + cfg["hc_eps"]
    return pre, post, sinkhorn(comb, cfg["hc_sinkhorn_iters"], cfg["hc_eps"])


def collapse(streams, mix):
    return jnp.sum(mix[..., None] * streams, axis=2)


def expand(x, residual, post, comb):
    mixed = jnp.sum(comb[..., None] * residual[..., :, None, :], axis=2)
    return post[..., None] * x[..., None, :] + mixed


def swiglu_clamped(up, gate, limit):
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def compressor(cfg, lp, x, ratio):
    eps = cfg["rms_norm_eps"]
    if ratio == 1:
        return rms_norm(x @ lp["cmp_wkv"].T, lp["cmp_norm"], eps)
    B, T, _ = x.shape
    n = T // ratio
    kv = (x @ lp["cmp_wkv"].T)[:, : n * ratio].reshape(B, n, ratio, -1)
    gate = (x @ lp["cmp_wgate"].T)[:, : n * ratio].reshape(B, n, ratio, -1)
    latent = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)
    return rms_norm(latent, lp["cmp_norm"], eps)


def indexer(cfg, lp, x, q_res, index_k, candidates, ratio, is_cand_source, theta, pos):
    """Returns (selection mask [B,T,N] bool, candidates or None, and the index
    scores over the visible entries, for the auxiliary loss)."""
    B, T, _ = x.shape
    nh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    N = index_k.shape[1]
    q = (q_res @ lp["idx_wq_b"].T).reshape(B, T, nh, ihd)
    q = rope(q, pos, theta, cfg["qk_rope_head_dim"])
    q = ste(q, fq_act_fp4(q, 32))
    w = (x @ lp["idx_weights_proj"].T) * (nh ** -0.5)
    s = jnp.einsum("bthd,bnd->bthn", q, index_k)
    s = jnp.maximum(s, 0.0) * (ihd ** -0.5)
    s = jnp.sum(s * w[..., None], axis=2)  # [B,T,N]
    lens = ((jnp.arange(T) + 1) // ratio)[:, None]  # [T,1]
    visible = jnp.arange(N)[None, :] < lens  # [T,N]
    s = jnp.where(visible[None], s, -jnp.inf)
    sel_scores = jax.lax.stop_gradient(s)
    if is_cand_source and cfg["candidate_topk_blocks"] > 0:
        blk = cfg["candidate_block_size"]
        pad = (-N) % blk
        padded = jnp.pad(sel_scores, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
        nb = padded.shape[-1] // blk
        bs = padded.reshape(B, T, nb, blk).max(axis=-1)
        last = jnp.where(lens > 0, (lens - 1) // blk, -1)  # [T,1]
        bs = jnp.where(jnp.arange(nb)[None, :] == last, jnp.inf, bs[...])
        kb = min(cfg["candidate_topk_blocks"], nb)
        vals, chosen = jax.lax.top_k(bs, kb)
        reachable = vals > -jnp.inf
        cb = jnp.sum(jax.nn.one_hot(chosen, nb, dtype=jnp.int32) * reachable[..., None], axis=-2) > 0
        candidates = jnp.repeat(cb, blk, axis=-1)[..., :N]
    elif candidates is not None:
        sel_scores = jnp.where(candidates, sel_scores, -jnp.inf)
    k = min(cfg["index_topk"], N)
    _, chosen = jax.lax.top_k(sel_scores, k)
    valid = chosen < lens[None]
    sel = jnp.sum(jax.nn.one_hot(chosen, N, dtype=jnp.int32) * valid[..., None], axis=-2) > 0
    return sel, candidates, s


def attention(cfg, lp, roles, x, shared, aux):
    B, T, _ = x.shape
    H, hd, rd = cfg["num_attention_heads"], cfg["head_dim"], cfg["qk_rope_head_dim"]
    eps = cfg["rms_norm_eps"]
    ratio = roles["ratio"]
    theta = cfg["compress_rope_theta"] if ratio else cfg["rope_theta"]
    pos = jnp.arange(T, dtype=jnp.float32)
    q_res = rms_norm(x @ lp["wq_a"].T, lp["q_norm"], eps)
    q = (q_res @ lp["wq_b"].T).reshape(B, T, H, hd)
    q = rope(q, pos, theta, rd)
    kv = rms_norm(x @ lp["wkv"].T, lp["kv_norm"], eps)
    kv = rope(kv, pos, theta, rd)
    kv = ste(kv, fq_act_fp8(kv, 32))
    scale = hd ** -0.5
    sw = jnp.einsum("bthd,bsd->bhts", q, kv) * scale
    ti = jnp.arange(T)[:, None]
    si = jnp.arange(T)[None, :]
    wmask = (si <= ti) & (si > ti - cfg["sliding_window"])
    sw = jnp.where(wmask[None, None], sw, -jnp.inf)
    parts, values = [sw], [kv]
    if ratio:
        if roles["kv_source"]:
            latent = compressor(cfg, lp, x, ratio)
            n = latent.shape[1]
            if n == 0:
                shared["compress_kv"] = None
                if roles["index_source"]:
                    shared["index_k"] = None
            gpos = jnp.arange(n, dtype=jnp.float32) * ratio
            ckv = rope(latent, gpos, theta, rd)
            ckv = ste(ckv, fq_act_fp4(ckv, 16, e4m3_scale=True))
        if roles["kv_source"] and latent.shape[1] > 0:
            shared["compress_kv"] = ckv
            if roles["index_source"]:
                ik = rms_norm(latent @ lp["idx_wk"].T, lp["idx_k_norm"], eps)
                ik = rope(ik, gpos, theta, rd)
                ik = ste(ik, fq_act_fp4(ik, 32))
                shared["index_k"] = ik
        if roles["index_source"]:
            index_k = shared.get("index_k")
            if index_k is None or index_k.shape[1] == 0:
                shared["topk_sel"] = None
                if roles["candidate_source"]:
                    shared["candidates"] = None
            else:
                sel, cand, iscores = indexer(
                    cfg, lp, x, q_res, index_k, shared.get("candidates"), ratio,
                    roles["candidate_source"], theta, pos)
                shared["topk_sel"] = sel
                if roles["candidate_source"]:
                    shared["candidates"] = cand
                # Auxiliary indexer loss: KL(main attention over the compressed
                # entries, head-mean || softmax of index scores).
                ckv_t = jax.lax.stop_gradient(shared["compress_kv"])
                if ckv_t.shape[1] == index_k.shape[1]:
                    lens = ((jnp.arange(T) + 1) // ratio)[:, None]
                    vis = jnp.arange(ckv_t.shape[1])[None, :] < lens
                    tl = jnp.einsum("bthd,bnd->bhtn", jax.lax.stop_gradient(q), ckv_t) * scale
                    tl = jnp.where(vis[None, None], tl, -jnp.inf)
                    tp = jnp.mean(jax.nn.softmax(tl, axis=-1), axis=1)
                    tp = jnp.where(vis[None], tp, 0.0)
                    ls = jax.nn.log_softmax(jnp.where(vis[None], iscores, -1e9), axis=-1)
                    ls = jnp.where(vis[None], ls, 0.0)
                    kl = jnp.sum(tp * (jnp.log(tp + 1e-9) - ls), axis=-1)
                    has = (lens[:, 0] > 0)[None, :]
                    aux["indexer_kl"].append(jnp.sum(kl * has) / (B * jnp.maximum(jnp.sum(has), 1)))
        ckv = shared.get("compress_kv")
        sel = shared.get("topk_sel")
        if ckv is not None and sel is not None:
            sc = jnp.einsum("bthd,bnd->bhtn", q, ckv) * scale
            sc = jnp.where(sel[:, None], sc, -jnp.inf)
            parts.append(sc)
            values.append(ckv)
    sink = jnp.broadcast_to(lp["attn_sink"][None, :, None, None], (B, H, T, 1))
    logits = jnp.concatenate(parts + [sink], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    out = 0.0
    off = 0
    for part, val in zip(parts, values):
        n = part.shape[-1]
        out = out + jnp.einsum("bhts,bsd->bthd", probs[..., off:off + n], val)
        off += n
    out = rope(out, pos, theta, rd, inverse=True)
    G, ol = cfg["o_groups"], cfg["o_lora_rank"]
    out = out.reshape(B, T, G, H * hd // G)
    wo_a = lp["wo_a"].reshape(G, ol, H * hd // G)
    out = jnp.einsum("btgi,goi->btgo", out, wo_a).reshape(B, T, G * ol)
    return out @ lp["wo_b"].T


def route(cfg, gate_w, bias, flat):
    logits = flat @ gate_w.T / cfg["gate_temp"]
    scores = jnp.sqrt(jax.nn.softplus(logits))
    biased = scores + bias
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(biased), cfg["num_experts_per_tok"])
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg["norm_topk_prob"] and cfg["num_experts_per_tok"] > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx, w * cfg["routed_scaling_factor"], scores


def moe(cfg, lp, bias, x, aux, capacity_factor):
    B, T, D = x.shape
    E, K = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    lim = cfg["swiglu_limit"]
    flat = x.reshape(-1, D)
    N = flat.shape[0]
    idx, w, scores = route(cfg, lp["gate_w"], bias, flat)
    fe = idx.reshape(-1)
    counts = jnp.bincount(fe, length=E)
    aux["load"].append(counts)
    aux["routes"].append((idx, w))
    # sequence-level balance term (DeepSeek-V3 form), over the batch
    f = counts.astype(jnp.float32) * E / (K * N)
    pn = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    aux["balance"].append(jnp.sum(f * jnp.mean(pn, axis=0)))
    C = N if capacity_factor <= 0 else int(math.ceil(capacity_factor * N * K / E))
    C = min(C, N)
    order = jnp.argsort(fe, stable=True)
    se = fe[order]
    starts = jnp.cumsum(counts) - counts
    pos_in = jnp.arange(N * K) - starts[se]
    keep = pos_in < C
    slot = jnp.where(keep, se * C + pos_in, E * C)
    tok = order // K
    buf = jnp.zeros((E * C + 1, D), flat.dtype).at[slot].set(flat[tok])
    buf = buf[:-1].reshape(E, C, D)
    up = jnp.einsum("ecd,eid->eci", buf, lp["ex_w3"])
    gate = jnp.einsum("ecd,eid->eci", buf, lp["ex_w1"])
    y = jnp.einsum("eci,edi->ecd", swiglu_clamped(up, gate, lim), lp["ex_w2"])
    y = jnp.concatenate([y.reshape(E * C, D), jnp.zeros((1, D), y.dtype)], axis=0)
    rows = y[slot] * keep[:, None]
    contrib = jnp.zeros((N * K, D), y.dtype).at[order].set(rows).reshape(N, K, D)
    aux["dropped"].append(jnp.sum(~keep))
    routed = jnp.sum(contrib * w[..., None], axis=1)
    sh = swiglu_clamped(flat @ lp["sh_w3"].T, flat @ lp["sh_w1"].T, lim) @ lp["sh_w2"].T
    return (routed + sh).reshape(B, T, D)


def block(cfg, lp, roles, bias, streams, pre_mix, shared, aux, capacity_factor):
    """One V4.1 decoder block: streams [B, T, hc, D] and the pre-mix the previous block handed
    on -> this block's output streams and the pre-mix it hands on (its FFN pre-mix)."""
    eps = cfg["rms_norm_eps"]
    a_pre, a_post, a_comb = hyper(cfg, streams, lp["hc_attn_fn"], lp["hc_attn_base"], lp["hc_attn_scale"])
    x = rms_norm(collapse(streams, pre_mix), lp["attn_norm"], eps)
    x = attention(cfg, lp, roles, x, shared, aux)
    streams = expand(x, streams, a_post, a_comb)
    f_pre, f_post, f_comb = hyper(cfg, streams, lp["hc_ffn_fn"], lp["hc_ffn_base"], lp["hc_ffn_scale"])
    x = rms_norm(collapse(streams, a_pre), lp["ffn_norm"], eps)
    x = moe(cfg, lp, bias, x, aux, capacity_factor)
    return expand(x, streams, f_post, f_comb), f_pre


def new_aux():
    return {"load": [], "balance": [], "indexer_kl": [], "dropped": [], "routes": []}


def trunk(cfg, p, state, tokens, *, capacity_factor=0.0):
    """The decoder layers on tokens [B, T] from position 0 (weights already rounded): the last
    layer's streams [B, T, hc, D] (before the final collapse), the pre-mix it hands on, aux."""
    hc = cfg["hc_mult"]
    h = p["embed"][tokens]
    B, T, D = h.shape
    streams = jnp.broadcast_to(h[:, :, None, :], (B, T, hc, D))
    pre_mix = jnp.zeros((B, T, hc), jnp.float32).at[..., 0].set(1.0)
    shared = {}
    aux = new_aux()
    for i, lp in enumerate(p["layers"]):
        streams, pre_mix = block(cfg, lp, layer_roles(cfg, i), state["gate_bias"][i], streams,
                                 pre_mix, shared, aux, capacity_factor)
    return streams, pre_mix, aux


def finish(cfg, p, streams, pre_mix):
    """V4.1's output: collapse with the last pre-mix, final norm, head -> logits."""
    out = rms_norm(collapse(streams, pre_mix), p["norm"], cfg["rms_norm_eps"])
    return out @ p["head"].T


def forward(cfg, params, state, tokens, *, qat=False, capacity_factor=0.0):
    """Logits [B, T, V] for tokens [B, T] from position 0, and aux outputs."""
    p = quantize_params(params, qat)
    streams, pre_mix, aux = trunk(cfg, p, state, tokens, capacity_factor=capacity_factor)
    return finish(cfg, p, streams, pre_mix), aux
