//! Engram addressing: which table rows a position reads, from the token ids alone.
//!
//! As DeepSeek-V4.1's published `NgramHashState` / `EngramLayout` (see `docs/engram.md`): every
//! (engram layer, n-gram size, head) owns a distinct prime number of buckets, drawn in that order
//! from one ascending sequence above `engram_vocab_size - 1` (each n-gram size restarts the search
//! and skips primes already handed out); a layer's table is its buckets side by side (offsets are
//! the exclusive prefix sum). Each engram layer has one odd multiplier per look-back, drawn by
//! NumPy's `default_rng(10007 * layer_id).integers(0, bound, N) * 2 + 1` with
//! `bound = (i64::MAX / compressed_vocab) / 2`; [`numpy_multipliers`] reproduces NumPy's
//! SeedSequence, PCG64 and Lemire bounded draw bit for bit. Position `p` with compressed ids
//! `c[p], c[p-1], …` (look-back before the sequence start reads the compressed pad id) hashes
//! the n-gram of size n as `(c[p]·m0 ^ c[p-1]·m1 ^ … ^ c[p-n+1]·m(n-1)) mod prime + offset`.
//!
//! What it is not: no table bytes, no arithmetic on activations (that is `engram`).

use keep_checkpoint::DeepSeekConfig;

use crate::engram_tokens::CompressedTokens;
use crate::{ModelError, Result};

/// Most hash columns (layers × n-gram sizes × heads) a config may ask for (V4.1-Flash: 48);
/// the bound is the config validation's.
pub const MAX_BUCKETS: usize = keep_checkpoint::config::MAX_ENGRAM_COLUMNS;
/// Largest `engram_vocab_size` accepted (V4.1-Flash: 1.6·10⁷); keeps bucket ids far from u64
/// overflow (the config validation's bound).
pub const MAX_ENGRAM_VOCAB: u64 = keep_checkpoint::config::MAX_ENGRAM_VOCAB;

/// The multiplier of a layer's hash RNG seed (`default_rng(10007 * layer_id)`).
pub const LAYER_SEED_PRIME: u64 = 10007;

// --- NumPy's SeedSequence (numpy/random/bit_generator.pyx) ---------------------------------
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
const POOL_SIZE: usize = 4;

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// `SeedSequence(entropy).generate_state(n_words, np.uint64)`.
pub fn seed_sequence_state(entropy: u128, n_words: usize) -> Vec<u64> {
    let mut ent = Vec::new();
    let mut n = entropy;
    if n == 0 {
        ent.push(0u32);
    }
    while n > 0 {
        ent.push((n & 0xffff_ffff) as u32);
        n >>= 32;
    }
    let mut pool = [0u32; POOL_SIZE];
    let mut hc = INIT_A;
    for (i, p) in pool.iter_mut().enumerate() {
        *p = hashmix(ent.get(i).copied().unwrap_or(0), &mut hc);
    }
    for src in 0..POOL_SIZE {
        for dst in 0..POOL_SIZE {
            if src != dst {
                let h = hashmix(pool[src], &mut hc);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    for &e in ent.iter().skip(POOL_SIZE) {
        for p in pool.iter_mut() {
            let h = hashmix(e, &mut hc);
            *p = mix(*p, h);
        }
    }
    let mut hb = INIT_B;
    let words32: Vec<u32> = (0..2 * n_words)
        .map(|i| {
            let mut v = pool[i % POOL_SIZE] ^ hb;
            hb = hb.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hb);
            v ^ (v >> XSHIFT)
        })
        .collect();
    words32
        .chunks(2)
        .map(|w| w[0] as u64 | ((w[1] as u64) << 32))
        .collect()
}

/// NumPy's `PCG64` bit generator (XSL-RR 128/64), seeded as `PCG64(SeedSequence(entropy))`.
pub struct Pcg64 {
    state: u128,
    inc: u128,
}

const PCG_MULT: u128 = (2549297995355413924u128 << 64) | 4865540595714422341u128;

impl Pcg64 {
    /// `np.random.default_rng(entropy)`'s bit generator.
    pub fn from_entropy(entropy: u128) -> Pcg64 {
        let v = seed_sequence_state(entropy, 4);
        let seed = ((v[0] as u128) << 64) | v[1] as u128;
        let inc = ((v[2] as u128) << 64) | v[3] as u128;
        let mut g = Pcg64 {
            state: 0,
            inc: (inc << 1) | 1,
        };
        g.step();
        g.state = g.state.wrapping_add(seed);
        g.step();
        g
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// The next 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let rot = (self.state >> 122) as u32;
        (((self.state >> 64) as u64) ^ (self.state as u64)).rotate_right(rot)
    }

    /// `integers(0, high)` for an int64 draw whose range exceeds 32 bits (Lemire's method as
    /// NumPy's `bounded_lemire_uint64`); `None` for ranges NumPy draws with its buffered
    /// 32-bit path, which this does not reproduce.
    pub fn integers_below(&mut self, high: u64) -> Option<u64> {
        let rng = high.checked_sub(1)?;
        if rng <= 0xffff_ffff {
            return None;
        }
        if rng == u64::MAX {
            return Some(self.next_u64());
        }
        let excl = rng + 1;
        let mut m = self.next_u64() as u128 * excl as u128;
        let mut left = m as u64;
        if left < excl {
            let threshold = (u64::MAX - rng) % excl;
            while left < threshold {
                m = self.next_u64() as u128 * excl as u128;
                left = m as u64;
            }
        }
        Some((m >> 64) as u64)
    }
}

/// The published hash multipliers of one engram layer: `default_rng(10007 * layer_id)
/// .integers(0, bound, max_ngram, dtype=int64) * 2 + 1`, `bound = max(1, (i64::MAX / vocab) / 2)`.
pub fn numpy_multipliers(
    layer_id: usize,
    max_ngram: usize,
    compressed_vocab: u64,
) -> Result<Vec<u64>> {
    let bound = ((i64::MAX as u64) / compressed_vocab.max(1) / 2).max(1);
    let mut g = Pcg64::from_entropy(LAYER_SEED_PRIME as u128 * layer_id as u128);
    (0..max_ngram)
        .map(|_| {
            g.integers_below(bound).map(|v| v * 2 + 1).ok_or_else(|| {
                ModelError::Config(format!(
                    "engram_compressed_vocab_size {compressed_vocab} is too large: the hash \
                     multipliers would come from NumPy's 32-bit bounded draw, which keep does not \
                     reproduce"
                ))
            })
        })
        .collect()
}

/// Deterministic Miller-Rabin for every u64 (these 12 bases are exact below 3.3·10²⁴).
pub fn is_prime(n: u64) -> bool {
    const BASES: [u64; 12] = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37];
    if n < 2 {
        return false;
    }
    for p in BASES {
        if n.is_multiple_of(p) {
            return n == p;
        }
    }
    let mul = |a: u64, b: u64| ((a as u128 * b as u128) % n as u128) as u64;
    let pow = |mut b: u64, mut e: u64| {
        let mut r = 1u64;
        while e > 0 {
            if e & 1 == 1 {
                r = mul(r, b);
            }
            b = mul(b, b);
            e >>= 1;
        }
        r
    };
    let (mut d, mut s) = (n - 1, 0);
    while d.is_multiple_of(2) {
        d /= 2;
        s += 1;
    }
    'base: for a in BASES {
        let mut x = pow(a, d);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..s {
            x = mul(x, x);
            if x == n - 1 {
                continue 'base;
            }
        }
        return false;
    }
    true
}

/// `[engram layer][n-gram size − 2][head]` bucket primes, as the published `EngramLayout`.
pub fn bucket_primes(
    n_layers: usize,
    max_ngram: usize,
    heads: usize,
    vocab: u64,
) -> Vec<Vec<Vec<u64>>> {
    let mut seen = std::collections::HashSet::new();
    (0..n_layers)
        .map(|_| {
            (0..max_ngram.saturating_sub(1))
                .map(|_| {
                    let mut cur = vocab.saturating_sub(1);
                    (0..heads)
                        .map(|_| {
                            cur += 1;
                            while !is_prime(cur) || seen.contains(&cur) {
                                cur += 1;
                            }
                            seen.insert(cur);
                            cur
                        })
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Everything needed to turn token ids into table row ids.
#[derive(Debug, Clone)]
pub struct EngramLayout {
    /// Decoder layers with an engram, in config order (index = the engram's slot).
    pub layer_ids: Vec<usize>,
    pub num_embeddings: Vec<u64>,
    pub max_ngram: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// `[slot][col]` bucket primes, `col = (n − 2)·heads + head`.
    pub primes: Vec<Vec<u64>>,
    /// `[slot][col]` first row of each bucket range.
    pub offsets: Vec<Vec<u64>>,
    /// `[slot][look-back]` odd multipliers.
    pub multipliers: Vec<Vec<u64>>,
    /// Raw token id → compressed id (`None`: identity, when the compressed vocabulary is the
    /// model's vocabulary).
    pub token_map: Option<Vec<u32>>,
    pub compressed_vocab: u64,
    /// The raw pad id (its compressed id fills look-back before the sequence start).
    pub pad_id: usize,
    pub vocab: usize,
}

impl EngramLayout {
    /// The layout of a config's engram layers; `None` when it has none. Refuses, naming the key,
    /// a config whose tables are smaller than their buckets or whose engram keys are missing.
    pub fn from_config(c: &DeepSeekConfig) -> Result<Option<EngramLayout>> {
        if c.engram_layer_ids.is_empty() {
            return Ok(None);
        }
        // The config's one validation (keep-checkpoint) bounds every engram key; a config
        // built by hand rather than read is checked here the same way.
        c.validate().map_err(ModelError::Config)?;
        let bad = |key: &str, msg: String| {
            Err(ModelError::Unsupported {
                key: key.into(),
                msg,
            })
        };
        let n = c.engram_layer_ids.len();
        let compressed_vocab = if c.engram_compressed_vocab_size == 0 {
            c.vocab_size as u64
        } else {
            c.engram_compressed_vocab_size as u64
        };
        let primes3 = bucket_primes(
            n,
            c.engram_max_ngram_size,
            c.engram_n_heads,
            c.engram_vocab_size,
        );
        let mut primes = Vec::with_capacity(n);
        let mut offsets = Vec::with_capacity(n);
        let mut multipliers = Vec::with_capacity(n);
        for (slot, per) in primes3.into_iter().enumerate() {
            let flat: Vec<u64> = per.into_iter().flatten().collect();
            let mut off = Vec::with_capacity(flat.len());
            let mut acc = 0u64;
            for &p in &flat {
                off.push(acc);
                acc += p;
            }
            if acc > c.engram_num_embeddings[slot] {
                return bad(
                    "engram_num_embeddings",
                    format!(
                        "layer {} needs {acc} rows for its hash buckets but the table has {}",
                        c.engram_layer_ids[slot], c.engram_num_embeddings[slot]
                    ),
                );
            }
            primes.push(flat);
            offsets.push(off);
            multipliers.push(numpy_multipliers(
                c.engram_layer_ids[slot],
                c.engram_max_ngram_size,
                compressed_vocab,
            )?);
        }
        Ok(Some(EngramLayout {
            layer_ids: c.engram_layer_ids.clone(),
            num_embeddings: c.engram_num_embeddings.clone(),
            max_ngram: c.engram_max_ngram_size,
            heads: c.engram_n_heads,
            head_dim: c.engram_head_dim,
            primes,
            offsets,
            multipliers,
            token_map: None,
            compressed_vocab,
            pad_id: c.engram_pad_id,
            vocab: c.vocab_size,
        }))
    }

    /// Hash columns per position: `(max_ngram − 1) · heads`.
    pub fn cols(&self) -> usize {
        (self.max_ngram - 1) * self.heads
    }

    /// The engram slot of decoder layer `layer`.
    pub fn slot_of(&self, layer: usize) -> Option<usize> {
        self.layer_ids.iter().position(|&l| l == layer)
    }

    /// Whether hashing needs the tokenizer's compression map (the compressed vocabulary is not
    /// the model's and no map is attached yet).
    pub fn needs_token_map(&self) -> bool {
        self.token_map.is_none() && self.compressed_vocab != self.vocab as u64
    }

    /// Attach the tokenizer-derived compressed id of every raw token id. The map may be shorter
    /// than the model's vocabulary (a tokenizer with fewer ids than embedding rows); ids past it
    /// are refused when hashed. It must cover the pad id.
    pub fn set_token_map(&mut self, map: Vec<u32>) -> Result<()> {
        if map.len() <= self.pad_id {
            return Err(ModelError::Config(format!(
                "engram token map covers {} ids, not engram_pad_id {}",
                map.len(),
                self.pad_id
            )));
        }
        if let Some(bad) = map.iter().find(|&&v| v as u64 >= self.compressed_vocab) {
            return Err(ModelError::Config(format!(
                "engram token map has compressed id {bad}, outside engram_compressed_vocab_size {}",
                self.compressed_vocab
            )));
        }
        self.token_map = Some(map);
        Ok(())
    }

    /// Attach a tokenizer's compression map, refusing (with both numbers) one whose size is not
    /// `engram_compressed_vocab_size`: the multipliers were drawn for that size, so a map of
    /// another size means another tokenizer or another normaliser.
    pub fn set_compressed_tokens(&mut self, tokens: CompressedTokens) -> Result<()> {
        if tokens.size as u64 != self.compressed_vocab {
            return Err(ModelError::Unsupported {
                key: "engram_compressed_vocab_size".into(),
                msg: format!(
                    "{} but the tokenizer compresses its {} ids to {} (a different tokenizer or \
                     normaliser)",
                    self.compressed_vocab,
                    tokens.map.len(),
                    tokens.size
                ),
            });
        }
        self.set_token_map(tokens.map)
    }

    /// The compressed id of a raw token id.
    pub fn compress(&self, id: u32) -> Result<u32> {
        match &self.token_map {
            Some(m) => m
                .get(id as usize)
                .copied()
                .filter(|_| (id as usize) < self.vocab)
                .ok_or(ModelError::Token {
                    id,
                    vocab: self.vocab,
                }),
            None if self.compressed_vocab == self.vocab as u64 => {
                if (id as usize) < self.vocab {
                    Ok(id)
                } else {
                    Err(ModelError::Token {
                        id,
                        vocab: self.vocab,
                    })
                }
            }
            None => Err(ModelError::Config(format!(
                "engram_compressed_vocab_size {} differs from vocab_size {}: the engram hash needs \
                 the tokenizer's compressed token map (tokenizer.json next to config.json)",
                self.compressed_vocab, self.vocab
            ))),
        }
    }

    /// Row ids `[t][slot][col]` of `tokens` (raw ids) that follow `history` (the compressed ids
    /// of the sequence so far; only its last `max_ngram − 1` matter). Appends the new compressed
    /// ids to `history`, keeping at most `max_ngram − 1`.
    pub fn hash(&self, history: &mut Vec<u32>, tokens: &[u32]) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        self.hash_into(history, tokens, &mut out)?;
        Ok(out)
    }

    /// [`EngramLayout::hash`] into `out` (cleared first), allocating nothing once `out` and
    /// `history` have the room (decode: one token at a time). `history` is unchanged when a
    /// token is refused.
    pub fn hash_into(
        &self,
        history: &mut Vec<u32>,
        tokens: &[u32],
        out: &mut Vec<u64>,
    ) -> Result<()> {
        let keep = self.max_ngram - 1;
        let pad = self.compress(self.pad_id as u32)? as u64;
        // The new compressed ids go after the history: position `p` of the sequence the
        // n-grams see (the kept history, then the tokens) is `history[base + p]`.
        let h0 = history.len();
        let before = h0.min(keep);
        let base = h0 - before;
        for &t in tokens {
            match self.compress(t) {
                Ok(c) => history.push(c),
                Err(e) => {
                    history.truncate(h0);
                    return Err(e);
                }
            }
        }
        let (ns, cols) = (self.layer_ids.len(), self.cols());
        out.clear();
        out.resize(tokens.len() * ns * cols, 0);
        for i in 0..tokens.len() {
            let p = before + i;
            // Look-back before the sequence start reads the pad id (`history` always keeps
            // `max_ngram − 1` ids once the sequence is that long, so `s > p` only there).
            let looked = |s: usize| {
                if s <= p {
                    history[base + p - s] as u64
                } else {
                    pad
                }
            };
            for slot in 0..ns {
                let m = &self.multipliers[slot];
                let mut rolling = looked(0).wrapping_mul(m[0]);
                for (n, &mn) in m.iter().enumerate().take(self.max_ngram).skip(1) {
                    rolling ^= looked(n).wrapping_mul(mn);
                    for h in 0..self.heads {
                        let col = (n - 1) * self.heads + h;
                        out[(i * ns + slot) * cols + col] =
                            rolling % self.primes[slot][col] + self.offsets[slot][col];
                    }
                }
            }
        }
        if history.len() > keep {
            history.drain(..history.len() - keep);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Regenerate with (NumPy 2.4.6):
    /// `python -c "import numpy as np; b=max(1,(2**63-1)//V//2);
    ///  print(np.random.default_rng(10007*L).integers(0,b,size=N,dtype=np.int64)*2+1)"`
    /// and `np.random.default_rng(123456789012345678901234567890).bit_generator.random_raw(3)`.
    #[test]
    fn multipliers_equal_numpy() {
        for (layer, n, v, want) in [
            (
                0,
                3,
                64,
                vec![91795853365445891u64, 38880362994447277, 5904907108195281],
            ),
            (
                1,
                4,
                99092,
                vec![
                    76632096046245,
                    4839876093313,
                    35959672319349,
                    73987337458391,
                ],
            ),
            (
                14,
                4,
                99092,
                vec![
                    67716810739261,
                    51510806800915,
                    30921347202721,
                    82619226485591,
                ],
            ),
            (
                3,
                3,
                1000,
                vec![2727703110629359, 8091777532450917, 1077915957631161],
            ),
            (
                7,
                5,
                129280,
                vec![
                    63139386536667,
                    53482456196597,
                    57351232796749,
                    5309996521935,
                    1295907630197,
                ],
            ),
        ] {
            assert_eq!(
                numpy_multipliers(layer, n, v).unwrap(),
                want,
                "layer {layer}"
            );
        }
        let mut g = Pcg64::from_entropy(123456789012345678901234567890);
        let raw: Vec<u64> = (0..3).map(|_| g.next_u64()).collect();
        assert_eq!(
            raw,
            vec![
                6372204611448533116,
                6194109736856590592,
                2785364361467880444
            ]
        );
    }

    #[test]
    fn miller_rabin_equals_trial_division() {
        let slow = |n: u64| {
            n >= 2
                && (2..)
                    .take_while(|d| d * d <= n)
                    .all(|d| !n.is_multiple_of(d))
        };
        for n in (0..5000u64).chain(16_000_000..16_002_000) {
            assert_eq!(is_prime(n), slow(n), "{n}");
        }
        assert!(is_prime(18_446_744_073_709_551_557));
    }

    #[test]
    fn published_flash_table_sizes_follow_from_the_prime_rule() {
        // DeepSeek-V4.1-Flash: engram_layer_ids (1, 14), vocab 16,000,000, 8 heads, n-grams 2..4.
        let p = bucket_primes(2, 4, 8, 16_000_000);
        let sums: Vec<u64> = p.iter().map(|l| l.iter().flatten().sum()).collect();
        assert_eq!(sums, vec![384_006_168, 384_016_682]);
    }

    #[test]
    fn short_history_is_the_sequence_start() {
        let json = r#"{"num_hidden_layers":3,"vocab_size":50,"engram_layer_ids":[1],
            "engram_num_embeddings":[400],"engram_max_ngram_size":3,"engram_n_heads":2,
            "engram_vocab_size":50,"engram_head_dim":32,"engram_pad_id":2}"#;
        let c = DeepSeekConfig::from_json(Path::new("config.json"), json).unwrap();
        let l = EngramLayout::from_config(&c).unwrap().unwrap();
        let toks = [5u32, 9, 11, 7, 3];
        let mut h = vec![];
        let all = l.hash(&mut h, &toks).unwrap();
        let mut h2 = vec![];
        let mut parts = l.hash(&mut h2, &toks[..2]).unwrap();
        for &t in &toks[2..] {
            parts.extend(l.hash(&mut h2, &[t]).unwrap());
        }
        assert_eq!(all, parts, "prefill and token-by-token hashing agree");
        assert!(all.iter().all(|&r| r < 400));
        assert_eq!(h, vec![7, 3]);
    }
}
