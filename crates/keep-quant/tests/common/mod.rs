//! Helpers shared by keep-quant's integration tests: the bundled model's path and a flat
//! importance matrix for all of its routed experts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype};

pub fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// A flat importance matrix for every routed expert of the bundled model.
#[allow(dead_code)] // each test file uses one of the two
pub fn imatrix(dir: &Path) -> PathBuf {
    imatrix_with(dir, |_| 1.0)
}

/// An importance matrix for every routed expert of the bundled model, `value(j)` at input
/// channel `j`.
pub fn imatrix_with(dir: &Path, value: impl Fn(usize) -> f32) -> PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
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
        let v: Vec<u8> = (0..m.shape[0] as usize)
            .flat_map(|j| value(j).to_le_bytes())
            .collect();
        w.write_tensor(&m.name, &v).unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}
