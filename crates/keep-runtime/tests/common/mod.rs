//! Shared helpers of keep-runtime's integration tests: synthetic checkpoints written with
//! `keep synth`'s library (tiny preset, optionally with more and wider experts).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype};

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

/// An imatrix of ones for every routed expert matrix of `model` (plain least squares).
pub fn flat_imatrix(model: &Path, dir: &Path) -> PathBuf {
    let ck = Checkpoint::open(model).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut metas = vec![];
    for l in 0..cfg.num_hidden_layers {
        for e in 0..cfg.experts_in_layer(l) {
            for p in ["w1", "w2", "w3"] {
                let cols = if p == "w2" {
                    cfg.moe_intermediate_size
                } else {
                    cfg.hidden_size
                };
                metas.push(TensorMeta::new(
                    format!("imatrix.{l}.ffn.experts.{e}.{p}"),
                    Dtype::F32,
                    &[cols as u64],
                ));
            }
        }
    }
    let out = dir.join("im");
    let mut w = CheckpointWriter::create(
        &out,
        metas.clone(),
        WriterOptions {
            shard_metadata: BTreeMap::from([("format".into(), "keep-imatrix".into())]),
            ..WriterOptions::default()
        },
    )
    .unwrap();
    for m in &metas {
        w.write_tensor(&m.name, &1.0f32.to_le_bytes().repeat(m.shape[0] as usize))
            .unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}
