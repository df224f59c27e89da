//! `keep prune`: write a smaller checkpoint by byte copy, following a [`PrunePlan`].
//!
//! Pruned experts are dropped and survivors renumbered `0..E'-1` in their original order; the
//! router's `gate.weight` rows and `gate.bias` / `gate.bias_vl` entries (DeepSeek-V3's
//! `e_score_correction_bias`, a `router.bias`) are sliced to the survivors; the family's expert
//! count in config.json (its `experts_key`: `n_routed_experts`, Qwen3-MoE's `num_experts`,
//! `num_local_experts`) becomes `E'`. The family names the experts' tensors
//! ([`keep_checkpoint::DeepSeekConfig::expert_prefix`]) and says whether its router takes the
//! survivors ([`keep_checkpoint::DeepSeekConfig::check_survivors`]: DeepSeek-V3's
//! group-limited router needs each group to keep the same number, and keeps `n_group` and
//! `topk_group`). Experts stacked on a first axis
//! (mlx-lm's `switch_mlp` weight, `.scales` and `.biases`) are sliced to the survivors the same
//! way. FP8, FP4 and E8M0 bytes are never
//! decoded: every tensor is either copied whole or sliced along its first dimension. Tensors
//! keep does not understand are copied untouched and listed in the report. A pruned hash-routed
//! layer (`gate.tid2eid`) needs the plan's remap for it ([`keep_artifacts::hashremap`]): its table is
//! rewritten — every removed expert's id replaced by the remap, then every id renumbered — in
//! its own dtype and shape; a hash layer pruned without a remap is refused. The id map is
//! written as `prune-map.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keep_checkpoint::naming::{self, Role, Scope};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype, TensorRef};
use serde::Serialize;
use serde_json::json;

use crate::copy::{copy_range, copy_tensor};
use crate::{ConvertError, Result};
use keep_artifacts::hashremap::{remap_table, HashRemap};
use keep_artifacts::plan::PrunePlan;

/// Options of [`prune`].
#[derive(Debug, Clone, Default)]
pub struct PruneOptions {
    pub force: bool,
    /// fsync outputs (benchmarks compare against a copy that does not sync).
    pub sync: bool,
}

/// What `keep prune` did (`prune-map.json` holds it too).
#[derive(Debug, Clone, Serialize)]
pub struct PruneReport {
    pub format: &'static str,
    pub version: u32,
    pub source: String,
    pub output: String,
    pub n_experts_before: usize,
    pub n_experts_after: usize,
    /// Per pruned scope ("3", "mtp.0"): old id → new id for survivors.
    pub id_map: BTreeMap<String, BTreeMap<usize, usize>>,
    pub tensors_copied: usize,
    pub tensors_sliced: usize,
    pub tensors_dropped: usize,
    /// `tid2eid` tables rewritten through a remap and the renumbering.
    pub tensors_rewritten: usize,
    /// Hash-routed layers whose `tid2eid` was rewritten, with the remap policy.
    pub hash_remapped: BTreeMap<usize, String>,
    /// Tensors copied untouched because keep does not know their role.
    pub unknown_copied: Vec<String>,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Source shards the output took whole, linked or copied (how depends on the file
    /// system, so it is reported, not stored in `prune-map.json`).
    #[serde(skip)]
    pub reused: keep_checkpoint::writer::ReuseStats,
}

enum Action<'a> {
    Copy(TensorRef<'a>, String),
    /// Write these bytes in place of the tensor (a rewritten `tid2eid`).
    Write(TensorRef<'a>, Vec<u8>),
    /// Keep rows `rows` of a tensor whose first dimension is the expert axis.
    Slice(TensorRef<'a>, &'a [usize]),
}

fn survivors_for(plan: &PrunePlan, scope: Scope) -> Option<&[usize]> {
    match scope {
        Scope::Layer(l) => plan.survivors(l),
        Scope::Mtp(n) => plan.mtp_survivors(n),
        Scope::Model => None,
    }
}

fn scope_label(scope: Scope) -> String {
    match scope {
        Scope::Layer(l) => l.to_string(),
        Scope::Mtp(n) => format!("mtp.{n}"),
        Scope::Model => "model".into(),
    }
}

/// Decode a `tid2eid` tensor (I32 or I64 `[vocab, top_k]`), replace removed experts through
/// `remap`, renumber to the survivors' new ids and encode it again in its own dtype.
fn rewrite_tid2eid(
    t: &TensorRef,
    top_k: usize,
    n_experts: usize,
    survivors: &[usize],
    remap: &HashRemap,
) -> Result<Vec<u8>> {
    let bad = |msg: String| ConvertError::Invalid(format!("{}: {msg}", t.name));
    if t.shape.len() != 2 || t.shape[1] != top_k as u64 {
        return Err(bad(format!(
            "shape {:?} is not [vocab, num_experts_per_tok = {top_k}]",
            t.shape
        )));
    }
    let width = match t.dtype {
        Dtype::I32 => 4,
        Dtype::I64 => 8,
        d => return Err(bad(format!("dtype {d}, expected I32 or I64 expert ids"))),
    };
    let n = (t.shape[0] * t.shape[1]) as usize;
    if t.bytes.len() != n * width {
        return Err(bad(format!("{} bytes for {n} ids", t.bytes.len())));
    }
    let mut ids = Vec::with_capacity(n);
    for c in t.bytes.chunks_exact(width) {
        let v = if width == 4 {
            i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64
        } else {
            i64::from_le_bytes(c.try_into().expect("8 bytes"))
        };
        if v < 0 || v as usize >= n_experts {
            return Err(bad(format!("names expert {v}, outside 0..{n_experts}")));
        }
        ids.push(v as u32);
    }
    let remapped = remap_table(&ids, top_k, survivors, remap).map_err(bad)?;
    let mut out = Vec::with_capacity(t.bytes.len());
    for j in remapped {
        let new = survivors
            .binary_search(&(j as usize))
            .map_err(|_| bad(format!("remap left removed expert {j}")))? as i64;
        if width == 4 {
            out.extend_from_slice(&(new as i32).to_le_bytes());
        } else {
            out.extend_from_slice(&new.to_le_bytes());
        }
    }
    Ok(out)
}

/// Tensors and `config.json` fields written into the pruned checkpoint beside the copied ones
/// (`keep sidecar`'s low-rank maps and its `keep_sidecar` field).
#[derive(Debug, Clone, Default)]
pub struct PruneExtra {
    /// Whole tensors in their own bytes, written after the copied ones.
    pub tensors: Vec<(TensorMeta, Vec<u8>)>,
    /// Top-level `config.json` fields set (added or replaced).
    pub config: Vec<(String, serde_json::Value)>,
}

/// Prune `src` into `out`. `progress(bytes_done, bytes_total)` is called as it copies.
pub fn prune(
    src: &Path,
    plan: &PrunePlan,
    out: &Path,
    opts: &PruneOptions,
    progress: &dyn Fn(u64, u64),
) -> Result<(PathBuf, PruneReport)> {
    prune_with(src, plan, out, opts, &PruneExtra::default(), progress)
}

/// [`prune`] that also writes `extra`'s tensors and `config.json` fields into the output. An
/// extra tensor named like one of the source's is refused.
pub fn prune_with(
    src: &Path,
    plan: &PrunePlan,
    out: &Path,
    opts: &PruneOptions,
    extra: &PruneExtra,
    progress: &dyn Fn(u64, u64),
) -> Result<(PathBuf, PruneReport)> {
    keep_checkpoint::writer::check_dir_target(out, opts.force, &[src.to_path_buf()])?;
    let ck = Checkpoint::open(src)?;
    let cfg = ck.require_config()?;
    plan.validate().map_err(ConvertError::Invalid)?;
    plan.check_model(src, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)?;
    if plan.n_experts != cfg.n_routed_experts {
        return Err(ConvertError::Invalid(format!(
            "the plan is for {} experts per layer but {} has n_routed_experts = {}",
            plan.n_experts,
            src.display(),
            cfg.n_routed_experts
        )));
    }
    // A checkpoint pruned before with hash-routed layers left whole has layers of another
    // count (`n_routed_experts_per_layer`): the plan may prune only layers of its count.
    if let Some(l) = (0..cfg.num_hidden_layers)
        .find(|&l| plan.survivors(l).is_some() && cfg.experts_in_layer(l) != plan.n_experts)
    {
        return Err(ConvertError::Invalid(format!(
            "the plan prunes layer {l} as a layer of {} experts but {} has {} there \
             (n_routed_experts_per_layer)",
            plan.n_experts,
            src.display(),
            cfg.experts_in_layer(l)
        )));
    }
    // Hash-routed layers (gate.tid2eid) and whether the plan prunes them.
    let mut hash_layers = std::collections::BTreeSet::new();
    let mut hash_pruned = vec![];
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        if n.role == Role::RouterTid2eid {
            if let Scope::Layer(l) = n.scope {
                hash_layers.insert(l);
            }
            if survivors_for(plan, n.scope).is_some() {
                hash_pruned.push(scope_label(n.scope));
            }
        }
    }
    // Routed decoder layers must end up with one expert count (config.json has one
    // n_routed_experts); hash-routed layers left whole are the one exception.
    let mut counts = std::collections::BTreeSet::new();
    let mut per_layer = vec![];
    for l in 0..cfg.num_hidden_layers {
        let n = plan
            .survivors(l)
            .map_or(cfg.experts_in_layer(l), <[usize]>::len);
        per_layer.push(n);
        // A dense layer (Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's first layers) has no
        // routed experts to count.
        if !hash_layers.contains(&l) && cfg.is_moe_layer(l) {
            counts.insert(n);
        }
        // The family's router must run the survivors as it ran the masked original.
        if let Some(s) = plan.survivors(l) {
            cfg.check_survivors(s).map_err(|e| {
                ConvertError::Invalid(format!(
                    "the plan cannot prune layer {l} of {}: {e}",
                    src.display()
                ))
            })?;
        }
    }
    if counts.len() > 1 {
        return Err(ConvertError::Invalid(format!(
            "the plan leaves layers with different expert counts {counts:?}; config.json has one \
             n_routed_experts, so every routed layer must keep the same number"
        )));
    }
    let e_after = *counts.iter().next().unwrap_or(&cfg.n_routed_experts);
    if cfg.num_experts_per_tok > e_after {
        return Err(ConvertError::Invalid(format!(
            "the plan keeps {e_after} experts per layer, fewer than num_experts_per_tok = {}",
            cfg.num_experts_per_tok
        )));
    }
    // An MTP module's block has its own router and experts: pruned by its own survivors when
    // the plan has them, else left whole (calibration runs the main model only, so there is no
    // saliency to prune it by, and the last layer's survivors say nothing about its experts).
    let mut per_mtp = vec![];
    for n in 0..cfg.num_nextn_predict_layers {
        let k = plan
            .mtp_survivors(n)
            .map_or(cfg.experts_in_mtp(n), <[usize]>::len);
        if k < cfg.num_experts_per_tok {
            return Err(ConvertError::Invalid(format!(
                "the plan keeps {k} experts of MTP module mtp.{n}, fewer than num_experts_per_tok = {}",
                cfg.num_experts_per_tok
            )));
        }
        per_mtp.push(k);
    }
    let no_remap: Vec<&String> = hash_pruned
        .iter()
        .filter(|l| {
            l.parse()
                .map_or(true, |l: usize| plan.hash_remap(l).is_none())
        })
        .collect();
    if !no_remap.is_empty() {
        return Err(ConvertError::Refused {
            tensor: format!(
                "gate.tid2eid of layers {}",
                no_remap
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            reason: "these layers are hash-routed: their expert ids come from the token id, so \
                     the plan must say what replaces each removed expert (\"hash_remap\": make \
                     the plan with `keep select --hash-remap reap-next|nearest|frequency`), or \
                     leave them whole (\"survivors\": null)"
                .into(),
        });
    }
    for l in &hash_layers {
        if let (Some(s), Some(r)) = (plan.survivors(*l), plan.hash_remap(*l)) {
            r.validate(plan.n_experts, s, cfg.num_experts_per_tok)
                .map_err(|e| ConvertError::Invalid(format!("layer {l}: hash_remap: {e}")))?;
        }
    }

    let mut actions = vec![];
    let mut unknown_copied = vec![];
    let mut dropped = 0usize;
    let mut hash_rewritten = vec![];
    let mut id_map: BTreeMap<String, BTreeMap<usize, usize>> = BTreeMap::new();
    for t in ck.tensors() {
        let n = naming::parse(t.name);
        let surv = survivors_for(plan, n.scope);
        match (&n.role, surv) {
            (Role::RoutedExpert { expert, .. }, Some(s)) => match s.binary_search(expert) {
                Ok(new) => {
                    // The family names the expert's tensors (the old prefix swapped for the
                    // new id's).
                    let renamed = cfg.expert_prefix(n.scope, *expert).and_then(|old| {
                        let rest = t.name.strip_prefix(&old)?;
                        Some(format!("{}{rest}", cfg.expert_prefix(n.scope, new)?))
                    });
                    let name = renamed.ok_or_else(|| {
                        ConvertError::Invalid(format!("unexpected expert tensor name `{}`", t.name))
                    })?;
                    id_map
                        .entry(scope_label(n.scope))
                        .or_default()
                        .insert(*expert, new);
                    actions.push(Action::Copy(t, name));
                }
                Err(_) => dropped += 1,
            },
            (Role::RouterTid2eid, Some(s)) => {
                let Scope::Layer(l) = n.scope else {
                    return Err(ConvertError::Refused {
                        tensor: t.name.to_string(),
                        reason: "a hash-routed MTP layer cannot be pruned".into(),
                    });
                };
                let remap = plan
                    .hash_remap(l)
                    .ok_or_else(|| ConvertError::Invalid(format!("layer {l}: no hash_remap")))?;
                let bytes = rewrite_tid2eid(&t, cfg.num_experts_per_tok, plan.n_experts, s, remap)?;
                hash_rewritten.push(l);
                actions.push(Action::Write(t, bytes));
            }
            (Role::StackedExperts(_), Some(s)) => {
                // mlx-lm's `switch_mlp`: the experts are the first axis (weight, scales and
                // biases alike), so the survivors are its slices, in order.
                if t.shape.first().copied() != Some(plan.n_experts as u64) || t.shape.len() < 2 {
                    return Err(ConvertError::Refused {
                        tensor: t.name.to_string(),
                        reason: format!(
                            "shape {:?} does not stack the {} experts of the plan on its first axis",
                            t.shape, plan.n_experts
                        ),
                    });
                }
                let ids = id_map.entry(scope_label(n.scope)).or_default();
                for (new, &old) in s.iter().enumerate() {
                    ids.insert(old, new);
                }
                actions.push(Action::Slice(t, s));
            }
            (Role::RouterWeight | Role::RouterBias | Role::RouterBiasVl, Some(s)) => {
                if t.shape.first().copied() != Some(plan.n_experts as u64) {
                    return Err(ConvertError::Refused {
                        tensor: t.name.to_string(),
                        reason: format!(
                            "shape {:?} does not lead with the {} experts of the plan",
                            t.shape, plan.n_experts
                        ),
                    });
                }
                actions.push(Action::Slice(t, s));
            }
            (role, _) => {
                if *role == Role::Unknown {
                    unknown_copied.push(t.name.to_string());
                }
                actions.push(Action::Copy(t, t.name.to_string()));
            }
        }
    }
    // Every survivor must exist (an expert missing from the source is an error, not a hole).
    for l in plan.layers.iter().chain(&plan.mtp_layers) {
        if let Some(s) = &l.survivors {
            let is_mtp = plan.mtp_layers.iter().any(|m| std::ptr::eq(m, l));
            let label = if is_mtp {
                format!("mtp.{}", l.layer)
            } else {
                l.layer.to_string()
            };
            let found = id_map.get(&label).map_or(0, BTreeMap::len);
            if found != s.len() {
                return Err(ConvertError::Invalid(format!(
                    "layer {label}: the plan keeps {} experts but the checkpoint has {found} of them",
                    s.len()
                )));
            }
        }
    }

    let mut metas: Vec<TensorMeta> = actions
        .iter()
        .map(|a| match a {
            Action::Copy(t, name) => TensorMeta::new(name.clone(), t.dtype, t.shape),
            Action::Write(t, _) => TensorMeta::new(t.name, t.dtype, t.shape),
            Action::Slice(t, s) => {
                let mut shape = t.shape.to_vec();
                shape[0] = s.len() as u64;
                TensorMeta::new(t.name, t.dtype, &shape)
            }
        })
        .collect();
    for (m, bytes) in &extra.tensors {
        if metas.iter().any(|t| t.name == m.name) {
            return Err(ConvertError::Invalid(format!(
                "tensor `{}` is already in {}: an added tensor cannot replace one of the source's",
                m.name,
                src.display()
            )));
        }
        if m.nbytes() != bytes.len() as u64 {
            return Err(ConvertError::Invalid(format!(
                "added tensor `{}`: {} bytes for {} {:?}",
                m.name,
                bytes.len(),
                m.dtype,
                m.shape
            )));
        }
        metas.push(m.clone());
    }
    let total: u64 = metas.iter().map(TensorMeta::nbytes).sum();
    let max_shard = ck.shards().iter().map(|s| s.len()).max().unwrap_or(0);
    let wopts = WriterOptions {
        max_shard_bytes: max_shard.max(1 << 20),
        force: opts.force,
        sync: opts.sync,
        protect: vec![src.to_path_buf()],
        ..Default::default()
    };
    // Source shards whose every tensor is copied under its own name go into the output whole
    // (linked); the rest is streamed.
    let unchanged: std::collections::HashSet<&str> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Copy(t, name) if t.name == name => Some(t.name),
            _ => None,
        })
        .collect();
    let reused = ck.whole_shards(|t| unchanged.contains(t.name));
    let reused_names: std::collections::HashSet<String> = reused
        .iter()
        .flat_map(|r| r.tensors.iter().map(|t| t.name.clone()))
        .collect();
    metas.retain(|m| !reused_names.contains(m.name.as_str()));
    for s in ck.shards() {
        s.advise_sequential();
    }
    let mut w = CheckpointWriter::create_reusing(out, metas, reused, wopts)?;
    let mut done = 0u64;
    let (mut copied, mut sliced, mut rewritten) = (0usize, 0usize, 0usize);
    for a in &actions {
        match a {
            Action::Copy(t, _) if reused_names.contains(t.name) => {
                done += t.bytes.len() as u64;
                copied += 1;
            }
            Action::Copy(t, name) => {
                copy_tensor(&ck, &mut w, name, t)?;
                done += t.bytes.len() as u64;
                copied += 1;
            }
            Action::Write(t, bytes) => {
                w.write_tensor(t.name, bytes)?;
                done += bytes.len() as u64;
                rewritten += 1;
            }
            Action::Slice(t, s) => {
                let row = t.bytes.len() / plan.n_experts;
                for &e in *s {
                    copy_range(&ck, &mut w, t.name, t, e * row, row)?;
                }
                done += (row * s.len()) as u64;
                sliced += 1;
            }
        }
        progress(done, total);
    }
    for (m, bytes) in &extra.tensors {
        w.write_tensor(&m.name, bytes)?;
        done += bytes.len() as u64;
        progress(done, total);
    }
    let mut edits = vec![(cfg.experts_key(), json!(e_after))];
    // Per-layer and MTP counts are DeepSeek V4's keys (its hash-routed layers left whole).
    if cfg.is_deepseek_v4() && per_layer.iter().any(|&n| n != e_after) {
        edits.push(("n_routed_experts_per_layer", json!(per_layer)));
    }
    if cfg.is_deepseek_v4()
        && (per_mtp.iter().any(|&n| n != e_after) || cfg.n_routed_experts_mtp.is_some())
    {
        edits.push(("n_routed_experts_mtp", json!(per_mtp)));
    }
    for (k, v) in &extra.config {
        edits.push((k.as_str(), v.clone()));
    }
    let raw = cfg.raw_with(&edits);
    w.add_file(
        "config.json",
        serde_json::to_string_pretty(&raw).expect("JSON").as_bytes(),
    )?;
    for f in ck.aux_files()? {
        let name = f.file_name().expect("a file").to_string_lossy().to_string();
        if name == "prune-map.json" || name == "repack-report.json" {
            continue;
        }
        w.copy_file(&name, &f)?;
    }
    let report = PruneReport {
        format: "keep-prune-map",
        version: 1,
        source: src.display().to_string(),
        output: out.display().to_string(),
        n_experts_before: cfg.n_routed_experts,
        n_experts_after: e_after,
        id_map,
        tensors_copied: copied,
        tensors_sliced: sliced,
        tensors_dropped: dropped,
        tensors_rewritten: rewritten,
        hash_remapped: hash_rewritten
            .iter()
            .map(|&l| {
                let p = plan
                    .hash_remap(l)
                    .map_or(String::new(), |r| r.policy.clone());
                (l, p)
            })
            .collect(),
        unknown_copied,
        bytes_before: ck.tensors().map(|t| t.bytes.len() as u64).sum(),
        bytes_after: total,
        reused: w.reuse_stats(),
    };
    w.add_file(
        "prune-map.json",
        serde_json::to_string_pretty(&report)
            .expect("JSON")
            .as_bytes(),
    )?;
    Ok((w.finish()?, report))
}
