//! `keep residency --model` prices each expert at the bytes keep-runtime's expert store reads
//! for it: for the E8P rungs with a residual stage (`e8p2+e81`, `e8p2+e8p2`) the base codes
//! and the residual together, not the base alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype};
use keep_quant::checkpoint::{quantize, ExpertSelection, QuantOptions, PARTS};
use keep_quant::QuantFormat;

fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny")
}

/// An imatrix of ones for every routed expert projection of the bundled model.
fn imatrix(dir: &Path) -> PathBuf {
    let ck = Checkpoint::open(&bundled()).unwrap();
    let cfg = ck.require_config().unwrap();
    let mut metas = vec![];
    for l in 0..cfg.num_hidden_layers {
        for e in 0..cfg.experts_in_layer(l) {
            for p in PARTS {
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
        let ones: Vec<u8> = (0..m.shape[0]).flat_map(|_| 1f32.to_le_bytes()).collect();
        w.write_tensor(&m.name, &ones).unwrap();
    }
    w.finish().unwrap();
    out.join("model.safetensors")
}

#[test]
fn residency_prices_each_rung_at_the_bytes_the_runtime_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let im = imatrix(tmp.path());
    for format in [
        QuantFormat::E8p2,
        QuantFormat::E8p2E81,
        QuantFormat::E8p2E8p2,
    ] {
        let out = tmp.path().join(format.label().replace('+', "-"));
        let opts = QuantOptions {
            format,
            experts: ExpertSelection::All,
            shard: (0, 1),
            force: false,
            mlx_bits: None,
        };
        quantize(&bundled(), &im, &out, &opts, &|_, _| {}).unwrap();
        let ck = Checkpoint::open(&out).unwrap();
        let cfg = keep_model::ModelConfig::from_checkpoint(&ck).unwrap();
        let store = keep_runtime::store::ExpertStore::open(&ck, &cfg, false).unwrap();
        let layers: Vec<usize> = (0..cfg.n_layers).collect();
        let mb = keep_residency::cost::model_bytes(&out, &layers, cfg.n_experts, true).unwrap();
        let priced: u64 = mb
            .expert_bytes
            .iter()
            .map(|b| b * cfg.n_experts as u64)
            .sum();
        assert_eq!(
            priced,
            store.total_bytes(),
            "{}: priced {priced} bytes of experts, the runtime reads {}",
            format.label(),
            store.total_bytes()
        );
    }
}
