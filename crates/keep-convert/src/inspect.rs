//! `keep inspect`: what a checkpoint is, what it weighs, and everything inconsistent in it.
//!
//! The report is data (serialisable to JSON); the CLI renders it as a table. Problems are
//! collected, not raised: a weight without its scale, an orphan scale, an expert count that
//! differs from the config, a tensor name keep does not know, index inconsistencies, NaN or
//! infinite values in every scale and in every tensor up to [`SCAN_BYTES`]. Formats are
//! keep-checkpoint's one layout classification, and [`Report::refused`] is the loader's own
//! check of the tensors against the config, so inspect and the loader cannot disagree.

use std::collections::{BTreeMap, BTreeSet};

use keep_checkpoint::naming::{self, Part, Role, Scope};
use keep_checkpoint::Checkpoint;
use serde::Serialize;

use crate::resident::{classify, label, scale_kind, scale_of};

/// Bytes and weights of one (role, format) cell.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Cell {
    pub tensors: u64,
    pub weights: u64,
    pub bytes: u64,
    pub bits_per_weight: f64,
}

/// The report of `keep inspect`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub format: &'static str,
    pub version: u32,
    pub dir: String,
    /// The model fingerprint that calibration files and prune plans record
    /// (`keep_checkpoint::fingerprint`); `None` when it cannot be computed (no config.json).
    pub model_fingerprint: Option<String>,
    pub model_type: Option<String>,
    pub layers: Option<usize>,
    pub routed_experts: Option<usize>,
    pub shared_experts: Option<usize>,
    pub top_k: Option<usize>,
    pub quantization_config: Option<serde_json::Value>,
    /// `keep_sidecar` of config.json (rank, ridge, layers of the low-rank sidecars `keep
    /// sidecar` added; their tensors are the `sidecar` role).
    pub sidecar: Option<serde_json::Value>,
    pub hash_layers: Vec<usize>,
    pub engram_layers: Vec<usize>,
    /// Engram tables (`layers.N.engram.embed.*`): rows read on demand, never resident.
    pub engram_tables: Vec<EngramTable>,
    pub mtp_layers: Vec<usize>,
    pub shards: usize,
    pub tensors: usize,
    pub total_bytes: u64,
    /// role → format label → cell.
    pub by_role_format: BTreeMap<String, BTreeMap<String, Cell>>,
    /// FP8 block shape and scale kind → number of weights stored that way.
    pub fp8_blocks: BTreeMap<String, u64>,
    /// Routed experts found per layer (decoder layers, then MTP layers as `mtp.N`).
    pub experts_per_layer: BTreeMap<String, usize>,
    /// Everything unknown or inconsistent.
    pub problems: Vec<String>,
    /// Why the model's loader refuses this checkpoint (`keep_checkpoint::layout::
    /// model_problems`, the check the loader runs before allocating): empty when it loads.
    pub refused: Vec<String>,
}

/// One Engram table.
#[derive(Debug, Clone, Serialize)]
pub struct EngramTable {
    pub layer: usize,
    pub rows: u64,
    pub head_dim: u64,
    /// FP8 channels plus E8M0 scales of one row.
    pub row_bytes: u64,
    /// Weight and scale tensors together.
    pub bytes: u64,
}

fn engram_tables(ck: &Checkpoint, problems: &mut Vec<String>) -> Vec<EngramTable> {
    let mut out = vec![];
    for t in ck.tensors() {
        let Some(l) = t
            .name
            .strip_prefix("layers.")
            .and_then(|r| r.strip_suffix(".engram.embed.weight"))
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        let (rows, hd) = match t.shape {
            [r, c] => (*r, *c),
            _ => {
                problems.push(format!(
                    "{} has shape {:?}, expected [rows, head_dim]",
                    t.name, t.shape
                ));
                continue;
            }
        };
        let scale = ck.get(&format!("layers.{l}.engram.embed.scale"));
        let sbytes = scale.map_or(0, |s| s.bytes.len() as u64);
        if scale.is_none_or(|s| s.shape != [rows, hd.div_ceil(32)]) {
            problems.push(format!(
                "layers.{l}.engram.embed.scale is missing or not [{rows}, {}] (one E8M0 scale per 32 channels)",
                hd.div_ceil(32)
            ));
        }
        out.push(EngramTable {
            layer: l,
            rows,
            head_dim: hd,
            row_bytes: hd + hd.div_ceil(32),
            bytes: t.bytes.len() as u64 + sbytes,
        });
    }
    out.sort_by_key(|t| t.layer);
    if let Some(c) = ck.config() {
        for (slot, &l) in c.engram_layer_ids.iter().enumerate() {
            let want = c.engram_num_embeddings.get(slot).copied();
            match out.iter().find(|t| t.layer == l) {
                None => problems.push(format!(
                    "engram_layer_ids names layer {l} but layers.{l}.engram.embed.weight is missing"
                )),
                Some(t) if want.is_some_and(|w| w != t.rows) => problems.push(format!(
                    "layers.{l}.engram.embed.weight has {} rows but engram_num_embeddings says {}",
                    t.rows,
                    want.unwrap_or(0)
                )),
                _ => {}
            }
        }
    }
    out
}

/// Largest tensor whose values `inspect` scans for NaN/infinity (scales are scanned whatever
/// their size; they are a small fraction of a weight).
pub const SCAN_BYTES: usize = 256 << 20;

/// How many of `t`'s values are NaN or infinite, for the dtypes that can hold them (E8M0 0xFF,
/// E4M3FN 0x7F/0xFF, IEEE exponent all ones); `None` when `t` is not scanned.
pub fn non_finite(t: &keep_checkpoint::TensorRef) -> Option<u64> {
    use keep_checkpoint::Dtype;
    let scale = naming::parse(t.name).part == Part::Scale;
    if t.bytes.len() > SCAN_BYTES && !scale {
        return None;
    }
    let b = t.bytes;
    let n = match t.dtype {
        Dtype::F8_E8M0 => b.iter().filter(|&&x| x == 0xFF).count(),
        Dtype::F8_E4M3 => b.iter().filter(|&&x| x & 0x7F == 0x7F).count(),
        Dtype::BF16 => b
            .chunks_exact(2)
            .filter(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7F80 == 0x7F80)
            .count(),
        Dtype::F16 => b
            .chunks_exact(2)
            .filter(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7C00 == 0x7C00)
            .count(),
        Dtype::F32 => b
            .chunks_exact(4)
            .filter(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7F80_0000 == 0x7F80_0000)
            .count(),
        _ => return None,
    };
    Some(n as u64)
}

/// Inspect an opened checkpoint.
pub fn inspect(ck: &Checkpoint) -> Report {
    let cfg = ck.config();
    let hint = cfg.and_then(|c| c.weight_block_size());
    let mut problems: Vec<String> = ck.warnings().to_vec();
    let mut by: BTreeMap<String, BTreeMap<String, Cell>> = BTreeMap::new();
    let mut fp8_blocks: BTreeMap<String, u64> = BTreeMap::new();
    let mut experts: BTreeMap<Scope, BTreeSet<usize>> = BTreeMap::new();
    let mut hash = BTreeSet::new();
    let mut engram = BTreeSet::new();
    let mut mtp = BTreeSet::new();
    let mut claimed_scales = BTreeSet::new();
    let mut total = 0u64;
    for t in ck.tensors() {
        total += t.bytes.len() as u64;
        let name = naming::parse(t.name);
        match name.scope {
            Scope::Mtp(n) => {
                mtp.insert(n);
            }
            Scope::Layer(l) if name.role == Role::RouterTid2eid => {
                hash.insert(l);
            }
            Scope::Layer(l) if name.role == Role::Engram => {
                engram.insert(l);
            }
            _ => {}
        }
        if let Role::RoutedExpert { expert, .. } = name.role {
            experts.entry(name.scope).or_default().insert(expert);
        }
        // mlx-lm's stacked `switch_mlp` (3-D) and the MXFP4 `*_blocks` stacks (4-D): every slice
        // of the first axis is an expert.
        let stacked = match (name.role.clone(), t.shape.first()) {
            (Role::StackedExperts(_), Some(&n))
                if name.part == Part::Weight && t.shape.len() >= 3 =>
            {
                experts.entry(name.scope).or_default().extend(0..n as usize);
                Some(n as usize)
            }
            _ => None,
        };
        if name.role == Role::Unknown {
            problems.push(format!("unknown tensor `{}`", t.name));
        }
        if let Some(n @ 1..) = non_finite(&t) {
            problems.push(format!(
                "`{}`: {n} non-finite values (NaN or infinity); the model would compute garbage from them",
                t.name
            ));
        }
        if name.part == Part::Scale {
            continue;
        }
        let scale = if name.part == Part::Weight {
            scale_of(ck, t.name)
        } else {
            None
        };
        if let Some(s) = scale {
            claimed_scales.insert(s.name.to_string());
        }
        let biases = keep_checkpoint::layout::biases_of(ck, t.name);
        if let Some(b) = biases {
            claimed_scales.insert(b.name.to_string());
        }
        // A registered format's other parts (compressed-tensors' `weight_shape`) are the
        // weight's too.
        let mut bias_bytes = biases.map_or(0, |b| b.bytes.len() as u64);
        for p in keep_checkpoint::layout::registered::parts_of(ck, t.name) {
            if scale.is_none_or(|s| s.name != p) {
                bias_bytes += ck.get(&p).map_or(0, |x| x.bytes.len() as u64);
            }
            claimed_scales.insert(p);
        }
        // A stacked tensor is classified by its first expert's slice (all have its shape).
        let sliced = stacked.map(|n| {
            let sl = |x| keep_checkpoint::layout::expert_slice(x, 0, n);
            Ok::<_, String>((sl(t)?, scale.map(sl).transpose()?, n as u64))
        });
        let classified = match sliced {
            Some(Ok((w, sc, n))) => classify(w, sc, hint).map(|c| (c, n)),
            Some(Err(e)) => Err(e),
            None => classify(t, scale, hint).map(|c| (c, 1)),
        };
        let (fmt, numel, bytes) = match classified {
            Ok((c, n)) => {
                let c = &c;
                if let (keep_checkpoint::layout::Layout::Fp8Block { block, .. }, Some(k)) =
                    (c.layout, scale_kind(c))
                {
                    *fp8_blocks
                        .entry(format!("{}x{} {}", block.0, block.1, k.label()))
                        .or_default() += c.numel() * n;
                }
                (label(c), c.numel() * n, c.bytes() * n + bias_bytes)
            }
            Err(r) => {
                problems.push(format!("`{}`: {r}", t.name));
                let bytes = t.bytes.len() as u64 + scale.map_or(0, |s| s.bytes.len() as u64);
                ("unknown".to_string(), t.numel(), bytes)
            }
        };
        let cell = by
            .entry(name.role.label().to_string())
            .or_default()
            .entry(fmt)
            .or_default();
        cell.tensors += 1;
        cell.weights += numel;
        cell.bytes += bytes;
    }
    for t in ck.tensors() {
        if naming::parse(t.name).part == Part::Scale && !claimed_scales.contains(t.name) {
            problems.push(format!(
                "orphan scale `{}`: no weight `{}`",
                t.name,
                naming::weight_of_scale(t.name).unwrap_or_default()
            ));
        }
    }
    for row in by.values_mut() {
        for cell in row.values_mut() {
            if cell.weights > 0 {
                cell.bits_per_weight = cell.bytes as f64 * 8.0 / cell.weights as f64;
            }
        }
    }
    let mut experts_per_layer = BTreeMap::new();
    for (scope, set) in &experts {
        let label = match scope {
            Scope::Layer(l) => format!("{l}"),
            Scope::Mtp(n) => format!("mtp.{n}"),
            Scope::Model => "model".into(),
        };
        experts_per_layer.insert(label.clone(), set.len());
        if let Some(c) = cfg {
            let want = match scope {
                Scope::Layer(l) => c.experts_in_layer(*l),
                Scope::Mtp(n) => c.experts_in_mtp(*n),
                Scope::Model => c.n_routed_experts,
            };
            if set.len() != want {
                problems.push(format!(
                    "layer {label} has {} routed experts but config.json declares {want}",
                    set.len(),
                ));
            }
            if let Some(&max) = set.iter().next_back() {
                if max + 1 != set.len() {
                    problems.push(format!(
                        "layer {label}: expert ids are not 0..{} (highest is {max})",
                        set.len()
                    ));
                }
            }
        }
    }
    if let Some(c) = cfg {
        let layers: BTreeSet<usize> = experts
            .keys()
            .filter_map(|s| match s {
                Scope::Layer(l) => Some(*l),
                _ => None,
            })
            .collect();
        if let Some(&l) = layers.iter().find(|&&l| l >= c.num_hidden_layers) {
            problems.push(format!(
                "layer {l} has experts but config.json declares num_hidden_layers = {}",
                c.num_hidden_layers
            ));
        }
        for l in 0..c.num_hidden_layers {
            let dense = !c.is_moe_layer(l);
            if !experts.contains_key(&Scope::Layer(l)) && c.n_routed_experts > 0 && !dense {
                problems.push(format!("layer {l} has no routed experts"));
            }
        }
        for &l in &c.engram_layer_ids {
            engram.insert(l);
        }
    } else {
        problems.push("no config.json".into());
    }
    let refused = cfg.map_or_else(Vec::new, |c| keep_checkpoint::layout::model_problems(ck, c));
    if !refused.is_empty() {
        problems.push(format!(
            "the model's loader refuses this checkpoint (keep run, keep logits): {} problem(s) with \
             the tensors it reads, listed under `refused`",
            refused.len()
        ));
    }
    Report {
        format: "keep-inspect",
        version: 1,
        dir: ck.dir().display().to_string(),
        model_fingerprint: keep_checkpoint::fingerprint::model_fingerprint(ck.dir()).ok(),
        model_type: cfg.map(|c| c.model_type.clone()),
        layers: cfg.map(|c| c.num_hidden_layers),
        routed_experts: cfg.map(|c| c.n_routed_experts),
        shared_experts: cfg.map(|c| c.n_shared_experts),
        top_k: cfg.map(|c| c.num_experts_per_tok),
        quantization_config: cfg.and_then(|c| c.raw.get("quantization_config").cloned()),
        sidecar: cfg.and_then(|c| c.raw.get("keep_sidecar").cloned()),
        hash_layers: hash.into_iter().collect(),
        engram_layers: engram.into_iter().collect(),
        engram_tables: engram_tables(ck, &mut problems),
        mtp_layers: mtp.into_iter().collect(),
        shards: ck.shards().len(),
        tensors: ck.len(),
        total_bytes: total,
        by_role_format: by,
        fp8_blocks,
        experts_per_layer,
        problems,
        refused,
    }
}
