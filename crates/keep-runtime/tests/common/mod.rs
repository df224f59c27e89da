//! Shared helpers of keep-runtime's integration tests: synthetic checkpoints written with
//! `keep synth`'s library (tiny preset, optionally with more and wider experts).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use keep_convert::presets;
use keep_convert::synth::{synth, SynthOptions};

/// Write the `tiny` preset to `dir/name`, with `n_experts` experts of width `inter` when given.
pub fn synth_tiny(
    dir: &Path,
    name: &str,
    n_experts: Option<usize>,
    inter: Option<usize>,
) -> PathBuf {
    let (mut cfg, storage) = presets::preset("tiny").unwrap();
    if let Some(n) = n_experts {
        cfg.n_routed_experts = n;
        cfg.raw["n_routed_experts"] = n.into();
    }
    if let Some(i) = inter {
        cfg.moe_intermediate_size = i;
        cfg.raw["moe_intermediate_size"] = i.into();
    }
    let opts = SynthOptions {
        seed: 7,
        storage,
        force: true,
        max_shard_bytes: 64 << 20,
    };
    synth(&cfg, &dir.join(name), &opts, &|_, _| {}).unwrap()
}

/// A deterministic prompt of `n` token ids below `vocab`.
pub fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    use keep_rng::Draw;
    let mut r = keep_rng::rng(12345);
    (0..n).map(|_| r.below(vocab) as u32).collect()
}
