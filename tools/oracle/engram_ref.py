#!/usr/bin/env python3
"""DeepSeek-V4.1 Engram, transcribed line by line from the published module, for keep's oracle.

Followed copy (see docs/engram.md for the pin and every disagreement between public copies):
NVIDIA-NeMo/Automodel `nemo_automodel/components/models/deepseek_v41/engram.py`
(`EngramLayout`, `compute_hash_multipliers`, `DeepseekV41EngramHasher.forward`,
`DeepseekV41Engram.forward`), itself ported from DeepSeek's released `inference/engram.py`;
commit 044410b503e204b49d613471fc24a1c1bc57e07e, file SHA-256
e8b22782277d884fe7c1da3592996aaf1283be6c0bba9d4757f73da88db9d811 (git blob
3e0026d776fa179087c2c037bbe0118fc1072bc7; docs/engram.md says how it was taken).
The decode-time hash state follows the released inference `NgramHashState` (a cache of
compressed ids across the prefill/decode split); `check_hashers` runs both on the same tokens
and they must agree.

Everything runs in float32 on CPU (torch), as keep computes; the released inference dequantizes
table rows to bf16 (exact: an E4M3 value times a power of two is a bf16 value) and rounds the
streams to the model dtype, which keep's f32 conformance does not do anywhere.

The token map: when engram_compressed_vocab_size equals vocab_size the ids are hashed raw (the
identity map the NeMo copy uses then); otherwise `build_compressed_token_map` builds it from the
checkpoint's tokenizer (transformers' AutoTokenizer, as the published `CompressedTokenizer`):
the normaliser sequence and the first-seen numbering of `_build_lookup_table`.
"""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

_MULTIPLIER_SEED = 10007
# Private-use character protecting a lone space from the strip step.
_SENTINEL = "\uE000"


def compressed_normalizer():
    """`CompressedTokenizer`'s normaliser (the tokenizers library's normalizers)."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def build_compressed_token_map(tokenizer):
    """`CompressedTokenizer._build_lookup_table`: (lookup[raw id] = compressed id, size)."""
    normalizer = compressed_normalizer()
    old2new, key2new, new_tokens = {}, {}, []
    vocab_size = len(tokenizer)
    for tid in range(vocab_size):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.convert_ids_to_tokens(tid)
        else:
            norm = normalizer.normalize_str(text)
            key = norm if norm else text
        nid = key2new.get(key)
        if nid is None:
            nid = len(new_tokens)
            key2new[key] = nid
            new_tokens.append(key)
        old2new[tid] = nid
    lookup = np.empty(vocab_size, dtype=np.int64)
    for tid in range(vocab_size):
        lookup[tid] = old2new[tid]
    return lookup, len(new_tokens)


def load_compressed_token_map(tokenizer_dir):
    """The map of a checkpoint directory's tokenizer (tokenizer.json + tokenizer_config.json).

    An empty model config is passed so transformers picks the tokenizer from tokenizer_config.json
    alone (it cannot parse every checkpoint config keep writes; the tokenizer does not need it).
    """
    from transformers import AutoTokenizer, PreTrainedConfig

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), config=PreTrainedConfig())
    return build_compressed_token_map(tok)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (as the NeMo copy; the released code calls sympy.isprime)."""
    if n < 2:
        return False
    small_primes = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small_primes:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in small_primes:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_next_prime(start: int, seen_primes: set) -> int:
    candidate = start + 1
    while not _is_prime(candidate) or candidate in seen_primes:
        candidate += 1
    return candidate


def compute_hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    max_long = np.iinfo(np.int64).max
    multiplier_bound = max(1, (max_long // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        generator = np.random.default_rng(_MULTIPLIER_SEED * layer_id)
        values = generator.integers(low=0, high=multiplier_bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(torch.tensor(values * 2 + 1))
    return torch.stack(rows)


class Layout:
    """`EngramLayout.from_config`."""

    def __init__(self, cfg: dict, ckpt=None):
        self.layer_ids = tuple(int(i) for i in cfg["engram_layer_ids"])
        self.max_ngram_size = int(cfg["engram_max_ngram_size"])
        self.n_heads = int(cfg["engram_n_heads"])
        self.head_dim = int(cfg["engram_head_dim"])
        self.num_embeddings = tuple(int(n) for n in cfg["engram_num_embeddings"])
        primes, seen = [], set()
        for _ in self.layer_ids:
            per_ngram = []
            for _ in range(self.max_ngram_size - 1):
                sizes, current = [], int(cfg["engram_vocab_size"]) - 1
                for _ in range(self.n_heads):
                    current = find_next_prime(current, seen)
                    seen.add(current)
                    sizes.append(current)
                per_ngram.append(tuple(sizes))
            primes.append(tuple(per_ngram))
        self.primes = tuple(primes)
        for i, layer_primes in enumerate(self.primes):
            span = sum(sum(p) for p in layer_primes)
            assert span <= self.num_embeddings[i], (span, self.num_embeddings[i])
        self.n_hash_cols = (self.max_ngram_size - 1) * self.n_heads
        self.vocab_size = int(cfg["vocab_size"])
        self.compressed_vocab_size = int(cfg.get("engram_compressed_vocab_size") or self.vocab_size)
        if self.compressed_vocab_size == self.vocab_size:
            self.token_map = torch.arange(self.vocab_size, dtype=torch.int64)
        else:
            lookup, size = load_compressed_token_map(ckpt)
            assert size == self.compressed_vocab_size, (size, self.compressed_vocab_size)
            self.token_map = torch.from_numpy(lookup)
        self.pad_id = int(self.token_map[int(cfg.get("engram_pad_token_id", cfg.get("engram_pad_id", 2)))])
        self.multipliers = compute_hash_multipliers(self.layer_ids, self.max_ngram_size, self.compressed_vocab_size)
        p = torch.tensor(self.primes, dtype=torch.int64)  # [n_layers, n_ngrams, n_heads]
        flat = p.flatten(1)
        self.primes_t = p
        self.offsets = flat.cumsum(1) - flat


def hash_stateless(lay: Layout, input_ids: torch.Tensor) -> torch.Tensor:
    """`DeepseekV41EngramHasher.forward` (NeMo) for one segment from position 0, no mask:
    [B, L] -> [B, L, n_engram_layers, n_hash_cols]."""
    batch, sequence = input_ids.shape
    compressed = lay.token_map[input_ids.long()]
    positions = torch.arange(sequence).expand(batch, sequence)
    segment_start = torch.zeros_like(positions)
    tokens = []
    blocked = torch.zeros_like(positions, dtype=torch.bool)
    for shift in range(lay.max_ngram_size):
        source_positions = positions - shift
        source = compressed.gather(1, source_positions.clamp_min(0))
        blocked = blocked | (source_positions < segment_start)
        tokens.append(torch.where(blocked, lay.pad_id, source))
    tokens = torch.stack(tokens, dim=-1)
    products = tokens.unsqueeze(2) * lay.multipliers
    rolling, hashes = products[..., 0], []
    for i in range(1, lay.max_ngram_size):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % lay.primes_t[:, i - 1])
    return torch.cat(hashes, dim=-1) + lay.offsets


class HashState:
    """The released inference `NgramHashState`: compressed ids cached across calls."""

    DEAD = -1

    def __init__(self, lay: Layout, max_seq_len: int = 4096):
        self.lay = lay
        self.cache = torch.empty(1, max_seq_len, dtype=torch.int64)

    def __call__(self, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        lay = self.lay
        batch, seqlen = input_ids.shape
        compressed = lay.token_map[input_ids]
        self.cache[:batch, start_pos:start_pos + seqlen] = compressed
        positions = torch.arange(start_pos, start_pos + seqlen).expand(batch, seqlen)
        tokens, blocked = [], torch.zeros_like(positions, dtype=torch.bool)
        for shift in range(lay.max_ngram_size):
            source = self.cache[:batch].gather(1, (positions - shift).clamp_min(0))
            blocked = blocked | (positions < shift) | (source == self.DEAD)
            tokens.append(torch.where(blocked, lay.pad_id, source))
        tokens = torch.stack(tokens, dim=-1)
        products = tokens.unsqueeze(2) * lay.multipliers
        rolling, hashes = products[..., 0], []
        for i in range(1, lay.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            hashes.append(rolling.unsqueeze(-1) % lay.primes_t[:, i - 1])
        return torch.cat(hashes, dim=-1) + lay.offsets


def check_hashers(lay: Layout, tokens) -> None:
    """The two public hashers agree: NeMo's stateless one on the whole sequence and the released
    stateful one fed a prefill and then one token at a time."""
    ids = torch.tensor([tokens], dtype=torch.int64)
    whole = hash_stateless(lay, ids)
    st = HashState(lay)
    k = max(1, len(tokens) // 2)
    parts = [st(ids[:, :k], 0)] + [st(ids[:, i:i + 1], i) for i in range(k, len(tokens))]
    assert torch.equal(whole, torch.cat(parts, dim=1)), "the two public Engram hashers disagree"


def _tensor(ckpt: Path, name: str) -> torch.Tensor:
    idx = ckpt / "model.safetensors.index.json"
    if idx.exists():
        shard = json.loads(idx.read_text())["weight_map"][name]
    else:
        shard = "model.safetensors"
    with safe_open(str(ckpt / shard), framework="pt") as f:
        return f.get_tensor(name)


def _fp8_rows(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """`EngramEmbedding.forward`'s dequantization of whole tables (1x32 E8M0 scales)."""
    values = w.float().unflatten(-1, (-1, 32)) * s.float().unsqueeze(-1)
    return values.flatten(-2)


def _linear_weight(ckpt: Path, base: str, rows: int, cols: int) -> torch.Tensor:
    """A linear's weight as f32: FP8 with a block scale (32x32 or 1x32) or bf16/f32."""
    w = _tensor(ckpt, base + ".weight")
    try:
        s = _tensor(ckpt, base + ".scale")
    except KeyError:
        return w.float()
    sf = s.float()
    br, bc = -(-rows // sf.shape[0]), -(-cols // sf.shape[1])
    full = sf.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w.float() * full


class Engram:
    """`DeepseekV41Engram` for one layer, f32."""

    def __init__(self, ckpt: Path, cfg: dict, lay: Layout, layer_id: int):
        self.layer_hash_index = lay.layer_ids.index(layer_id)
        self.dim, self.hc_mult = int(cfg["hidden_size"]), int(cfg.get("hc_mult", 4))
        self.eps = float(cfg.get("rms_norm_eps", 1e-20))
        self.clamp_value = 1e-6
        p = f"layers.{layer_id}.engram."
        self.table = _fp8_rows(_tensor(ckpt, p + "embed.weight"), _tensor(ckpt, p + "embed.scale"))
        assert self.table.shape == (lay.num_embeddings[self.layer_hash_index], lay.head_dim)
        self.wkv = _linear_weight(ckpt, p + "wkv", self.dim * (self.hc_mult + 1), lay.n_hash_cols * lay.head_dim)
        self.q_weight = _tensor(ckpt, p + "q_weight").reshape(self.hc_mult, self.dim)
        self.k_weight = _tensor(ckpt, p + "k_weight").reshape(self.hc_mult, self.dim)

    def __call__(self, x: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(hash_ids, self.table)  # [B, L, n_hash_cols, head_dim]
        kv = torch.nn.functional.linear(rows.flatten(-2), self.wkv)
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))
        weight = self.q_weight.float() * self.k_weight.float()
        h = x.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * weight * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(self.clamp_value).sqrt(), dot))
        return h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)


class EngramModel:
    """All Engram layers of a checkpoint plus the hash state of one generation."""

    def __init__(self, ckpt: Path):
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        cfg = {**cfg, **cfg.get("text_config", {})}
        self.layout = Layout(cfg, ckpt)
        self.layers = {l: Engram(Path(ckpt), cfg, self.layout, l) for l in self.layout.layer_ids}
        self.reset()

    def reset(self):
        self.state = HashState(self.layout)
        self.hashes = None

    def step(self, input_ids, start_pos: int):
        """Hash a call's tokens (before any layer runs)."""
        self.hashes = self.state(torch.as_tensor(np.asarray(input_ids), dtype=torch.int64), start_pos)

    def apply(self, layer_id: int, streams: np.ndarray) -> np.ndarray:
        e = self.layers[layer_id]
        ids = self.hashes[:, :, e.layer_hash_index, :]
        return e(torch.from_numpy(np.ascontiguousarray(streams, dtype=np.float32)), ids).numpy()
