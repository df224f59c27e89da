//! `keep bench prune`: prune throughput against a plain copy of the kept bytes, side by side
//! in one run, cold reads for both.
//!
//! The plan keeps the first half of every layer's experts (the bytes moved do not depend on
//! which half). The baseline reads exactly the bytes the pruned checkpoint keeps, tensor by
//! tensor in file order, and writes them to one file with plain `read`/`write` — the least I/O
//! any pruner must do. Neither side fsyncs. Goal: median copy time / prune time ≥ 0.8.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use keep_artifacts::plan::{LayerPlan, PrunePlan};
use keep_checkpoint::naming::{self, Role};
use keep_checkpoint::Checkpoint;
use keep_convert::prune::{prune, PruneOptions};

use crate::side::{self, SideBySide, Spec};
use crate::{BenchError, Result};

/// The half-experts plan for a checkpoint.
pub fn half_plan(ck: &Checkpoint) -> Result<PrunePlan> {
    let cfg = ck
        .require_config()
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    let keep = (cfg.n_routed_experts / 2).max(cfg.num_experts_per_tok);
    let mut plan = PrunePlan {
        format: PrunePlan::FORMAT.into(),
        version: 1,
        n_experts: cfg.n_routed_experts,
        keep,
        saliency: "bench: first half".into(),
        layers: (0..cfg.num_hidden_layers)
            .map(|l| LayerPlan {
                layer: l,
                survivors: Some((0..keep).collect()),
                hash_routed: false,
                hash_remap: None,
            })
            .collect(),
        mtp_layers: vec![],
        extra: Default::default(),
    };
    plan.bind_to(ck.dir())
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    Ok(plan)
}

/// Run `rounds` interleaved rounds on checkpoint `src`, using `scratch` for outputs.
pub fn run(src: &Path, scratch: &Path, rounds: usize) -> Result<SideBySide> {
    let ck = Checkpoint::open(src).map_err(|e| BenchError::Invalid(e.to_string()))?;
    let plan = half_plan(&ck)?;
    // The extents the pruned checkpoint keeps: (shard path, offset, length).
    let mut extents = vec![];
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        let keep = match (&n.role, n.layer().and_then(|l| plan.survivors(l))) {
            (Role::RoutedExpert { expert, .. }, Some(s)) => s.contains(expert),
            _ => true,
        };
        if keep {
            extents.push((
                ck.shards()[t.shard].path().to_path_buf(),
                t.file_offset,
                t.bytes.len() as u64,
            ));
        }
    }
    drop(ck);
    let kept: u64 = extents.iter().map(|e| e.2).sum();
    let copy_out = scratch.join("bench-prune-copy.bin");
    let prune_out = scratch.join("bench-prune");
    let copy = || -> Result<()> {
        let io = |p: &Path, e| BenchError::Io {
            path: p.to_path_buf(),
            err: e,
        };
        let mut out = std::fs::File::create(&copy_out).map_err(|e| io(&copy_out, e))?;
        let mut buf = vec![0u8; 16 << 20];
        let mut cur: Option<(std::path::PathBuf, std::fs::File)> = None;
        for (path, off, len) in &extents {
            if cur.as_ref().is_none_or(|(p, _)| p != path) {
                cur = Some((
                    path.clone(),
                    std::fs::File::open(path).map_err(|e| io(path, e))?,
                ));
            }
            let f = &mut cur.as_mut().expect("opened").1;
            f.seek(SeekFrom::Start(*off)).map_err(|e| io(path, e))?;
            let mut left = *len as usize;
            while left > 0 {
                let n = left.min(buf.len());
                f.read_exact(&mut buf[..n]).map_err(|e| io(path, e))?;
                out.write_all(&buf[..n]).map_err(|e| io(&copy_out, e))?;
                left -= n;
            }
        }
        Ok(())
    };
    let opts = PruneOptions {
        force: false,
        sync: false,
    };
    side::run(
        src,
        rounds,
        Spec {
            bench: "prune-vs-copy-of-kept-bytes",
            baseline: "copy of kept bytes",
            subject: "prune",
            baseline_bytes: kept,
            subject_bytes: kept,
            goal: 0.8,
            run_baseline: &copy,
            run_subject: &|| {
                prune(src, &plan, &prune_out, &opts, &|_, _| {})
                    .map(|_| ())
                    .map_err(Into::into)
            },
            cleanup: &|| {
                let _ = std::fs::remove_file(&copy_out);
                let _ = std::fs::remove_dir_all(&prune_out);
            },
        },
    )
}
