//! The quantized checkpoint `keep quant` writes: every selected routed expert's w1/w2/w3 fitted
//! with [`crate::fit`], everything else copied byte for byte.
//!
//! Which matrices an expert has, their shapes, the base names of their codes and the source
//! tensors the codes replace are the family's (keep-checkpoint's `coded_matrices`): DeepSeek
//! V4's `layers.{L}.ffn.experts.{E}.w{1,2,3}`, Hugging Face's per-expert
//! `model.layers.{L}.mlp.experts.{E}.{gate,down,up}_proj`, or, for a family whose experts are
//! MXFP4 stacks with gate and up interleaved, `model.layers.{L}.mlp.experts.{E}.{gate_up_proj,
//! down_proj}` read from its stacks (a
//! stack is dropped once every expert of its layer is coded). A source tensor the codes would
//! not replace (a stacked layout the model would go on reading) is refused by name.
//!
//! # Output tensors (for a quantized weight `<base>` = `layers.{L}.ffn.experts.{E}.w{1,2,3}`)
//! | tensor | dtype, shape | meaning |
//! |---|---|---|
//! | `<base>.weight` | `U16 [rows, cols/8]` | E8P12 codes (keep's layout, `keep_format::e8p`) |
//! | `<base>.scale` | `F32 [rows, 1]` | one scale per output row |
//! | `<base>.resid.weight` | `U8 [rows, cols/8]` (E81B) or `U16` (E8P12) | residual stage codes |
//! | `<base>.resid.scale` | `F32 [rows, 1]` | the residual stage's per-row scale |
//!
//! With `mlx_bits` set (`keep quant --format mlx2|mlx3|mlx4|mlx8`) a weight is written in
//! mlx-lm's affine layout instead ([`crate::mlx`]): `<base>.weight` `U32 [rows, cols·bits/32]`,
//! `<base>.scales` and `<base>.biases` `BF16 [rows, cols/64]`, exactly `mx.quantize`'s output.
//!
//! `w[r, 8g+i] = scale[r] · e8p(code[r, g])[i] + resid.scale[r] · resid(resid.code[r, g])[i]`.
//! The residual is a tensor of its own so that a runtime can hold the base rung and read the
//! residual separately. `config.json` gains a `keep_quantization` object (`format`
//! `keep-quant`, `version` 1, the method and, per quantized base name, its code format), and
//! every shard's metadata names the method. With incoherence processing
//! ([`quantize_with`], `keep quant --incoherence on|out`) the codes are those of the rotated
//! weight `W̃ = V_out·W·V_inᵀ` ([`crate::incoherence`]) and the entry's `incoherence` object
//! (keep-checkpoint's `incoherence` marker) holds each such weight's seeds and blocks; its
//! errors are measured on the un-rotated decode. `quant-report.json` holds the imatrix-weighted
//! reconstruction error of every rung of every quantized tensor (and per expert), the
//! numbers the tier allocator reads.
//!
//! # Parts, shards, resume
//! Work is done per decoder layer; each finished layer is written atomically as a part
//! (`.<out>.keep-quant-parts/layer-{L}`, a small checkpoint directory of its tensors plus
//! `errors.json`). `shard = (I, N)` does the layers with `L % N == I` (N at most the layer
//! count); a layer whose part exists is not redone (resume). The parts directory records the
//! source checkpoint's fingerprint and every argument that shapes a part's bytes
//! (`parts.json`: format, experts, incoherence mode and seed, the imatrix's SHA-256); a run
//! whose arguments differ is refused naming the argument, and with `force` the parts are
//! discarded. Claiming the directory, placing a part and joining are done holding a lock on
//! it, so concurrent writers never mix. A weight whose source holds a NaN or an infinity, or
//! whose fit is not finite, is an error naming it, and its layer's part is not stored. When
//! every layer's part exists the output is joined (source tensors in their order, quantized
//! ones replaced) through keep-checkpoint's atomic writer, and the parts are removed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::json;

use keep_checkpoint::layout::{self, Layout, ScaleDtype};
use keep_checkpoint::naming::ExpertMat;
use keep_checkpoint::safetensors::ShardFile;
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype, TensorRef};
use keep_kernels::{BlockScales, WeightView};

use crate::fit::{fit_matrix, FittedMatrix, QuantFormat, ResidualCodes};
use crate::{QuantError, Result};

/// `format` of the checkpoint's `keep_quantization` entry and of `quant-report.json`
/// (keep-checkpoint owns the entry and refuses versions it does not read).
pub const QUANT_FORMAT: &str = keep_checkpoint::incoherence::QUANT_FORMAT;
/// Their version.
pub const QUANT_VERSION: u32 = keep_checkpoint::incoherence::QUANT_VERSION;
/// The report's file name in the output.
pub const REPORT_FILE: &str = "quant-report.json";
/// The config key describing the quantization.
pub const CONFIG_KEY: &str = keep_checkpoint::incoherence::QUANT_KEY;
/// Expert projections that are quantized.
pub const PARTS: [&str; 3] = ["w1", "w2", "w3"];

/// Which experts to quantize.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertSelection {
    /// Every routed expert of every decoder layer.
    All,
    /// Per layer, the experts to quantize; layers not named are quantized whole, experts of a
    /// named layer that are not listed stay as shipped.
    Only(BTreeMap<usize, BTreeSet<usize>>),
    /// Each listed (layer, expert) at its own format (a precision-tier allocation, `keep quant
    /// --alloc`); experts not listed stay as shipped. [`QuantOptions::format`] is unused.
    PerExpert(BTreeMap<(usize, usize), QuantFormat>),
}

impl ExpertSelection {
    /// The survivors of a prune plan (`keep select`'s output): the experts it keeps.
    pub fn from_plan(path: &Path) -> Result<ExpertSelection> {
        let plan = keep_artifacts::plan::PrunePlan::read(path)
            .map_err(|e| QuantError::Input(format!("{}: {e}", path.display())))?;
        Ok(ExpertSelection::Only(
            plan.layers
                .iter()
                .filter_map(|l| {
                    l.survivors
                        .as_ref()
                        .map(|s| (l.layer, s.iter().copied().collect()))
                })
                .collect(),
        ))
    }

    /// The experts of a tier allocation (keep-artifacts' `alloc`): every expert at an E8P
    /// rung gets that format, `shipped` ones stay as they are. An allocation that prunes is
    /// refused: removing experts is `keep prune`'s (with a plan), and an allocation's pruned
    /// counts differ per layer, which a prune plan cannot express.
    pub fn from_alloc(a: &keep_artifacts::alloc::Alloc) -> Result<ExpertSelection> {
        let mut m = BTreeMap::new();
        let mut pruned = 0usize;
        for l in &a.layers {
            for (e, r) in l.rungs.iter().enumerate() {
                match r.as_str() {
                    keep_artifacts::alloc::SHIPPED => {}
                    keep_artifacts::alloc::PRUNED => pruned += 1,
                    q => {
                        let f = QuantFormat::parse(q).ok_or_else(|| {
                            QuantError::Input(format!("unknown rung `{q}` in the allocation"))
                        })?;
                        m.insert((l.layer, e), f);
                    }
                }
            }
        }
        if pruned > 0 {
            return Err(QuantError::Input(format!(
                "the allocation prunes {pruned} experts; keep quant --alloc writes rungs, it does \
                 not remove experts: solve it again without `pruned` (keep alloc --rungs \
                 e8p2,e8p2+e81,e8p2+e8p2,shipped), or score it in memory (keep eval --alloc)"
            )));
        }
        Ok(ExpertSelection::PerExpert(m))
    }

    /// The format expert `expert` of `layer` is coded at (`None`: left as shipped).
    fn format_of(&self, layer: usize, expert: usize, format: QuantFormat) -> Option<QuantFormat> {
        match self {
            ExpertSelection::All => Some(format),
            ExpertSelection::Only(m) => m
                .get(&layer)
                .is_none_or(|s| s.contains(&expert))
                .then_some(format),
            ExpertSelection::PerExpert(m) => m.get(&(layer, expert)).copied(),
        }
    }

    /// The method label written into the checkpoint: the format, or `mixed` for an allocation.
    fn method(&self, format: QuantFormat) -> &'static str {
        match self {
            ExpertSelection::PerExpert(_) => "mixed",
            _ => format.label(),
        }
    }
}

/// Options of [`quantize`].
#[derive(Debug, Clone)]
pub struct QuantOptions {
    pub format: QuantFormat,
    pub experts: ExpertSelection,
    /// `(I, N)`: only layers with `L % N == I`.
    pub shard: (usize, usize),
    pub force: bool,
    /// MLX affine codes of this width (2, 3, 4 or 8, group 64) instead of `format`'s lattice
    /// codes.
    pub mlx_bits: Option<u32>,
}

impl QuantOptions {
    /// The method's name in reports and the checkpoint (`e8p2+e81`, `mlx4`, ...).
    pub fn method(&self) -> String {
        match self.mlx_bits {
            Some(b) => format!("mlx{b}"),
            None => self.experts.method(self.format).to_string(),
        }
    }

    /// Stored bits per weight of a quantized `[rows, cols]` matrix, scales (and biases) included.
    /// `format` is the matrix's own rung (an allocation gives each expert its own).
    pub fn bits_per_weight(&self, format: QuantFormat, rows: usize, cols: usize) -> f64 {
        match self.mlx_bits {
            Some(b) => crate::mlx::bits_per_weight(b),
            None => format.bits_per_weight(rows, cols),
        }
    }
}

/// The tensors of one MLX affine weight, in write order.
fn mlx_tensors(base: &str, m: &crate::mlx::MlxMatrix) -> Vec<(TensorMeta, Vec<u8>)> {
    let (r, g) = (m.rows as u64, (m.cols / crate::mlx::MLX_GROUP) as u64);
    let words = (m.cols * m.bits as usize / 32) as u64;
    vec![
        (
            TensorMeta::new(format!("{base}.weight"), Dtype::U32, &[r, words]),
            m.packed.clone(),
        ),
        (
            TensorMeta::new(format!("{base}.scales"), Dtype::BF16, &[r, g]),
            u16_bytes(&m.scales),
        ),
        (
            TensorMeta::new(format!("{base}.biases"), Dtype::BF16, &[r, g]),
            u16_bytes(&m.biases),
        ),
    ]
}

/// Errors of one quantized tensor, per rung (relative = imatrix-weighted squared error over
/// the imatrix-weighted squared weight).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TensorErrors {
    pub name: String,
    pub layer: usize,
    pub expert: usize,
    pub part: String,
    pub rows: usize,
    pub cols: usize,
    /// Rung label → relative weighted error.
    pub rel_error: BTreeMap<String, f64>,
    /// Rung label → weighted squared error.
    pub error: BTreeMap<String, f64>,
    /// Σ h w² (the denominator).
    pub weight: f64,
}

/// One expert's errors per rung (its three projections summed).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ExpertErrors {
    pub layer: usize,
    pub expert: usize,
    pub rel_error: BTreeMap<String, f64>,
}

/// What [`quantize`] did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantReport {
    pub format: String,
    pub version: u32,
    pub method: String,
    pub source: String,
    /// Where this call wrote (the run record: this field, `layers_fitted`,
    /// `source_bytes_fitted` and `fit_seconds` describe the call, are printed by `keep quant
    /// --json` and are not stored in the checkpoint's `quant-report.json`, so that an output
    /// is the same bytes however its layers were shared out).
    #[serde(default)]
    pub output: String,
    /// Layers fitted by this call (others were done by earlier calls or other shards).
    #[serde(default)]
    pub layers_fitted: Vec<usize>,
    /// Layers whose part is still missing (empty once joined).
    pub layers_missing: Vec<usize>,
    /// Whether the output checkpoint was written by this call.
    pub joined: bool,
    pub tensors_quantized: usize,
    /// Bytes of the source expert weights (and their scales) fitted by this call.
    #[serde(default)]
    pub source_bytes_fitted: u64,
    /// Seconds spent fitting in this call.
    #[serde(default)]
    pub fit_seconds: f64,
    /// Quantized tensors stored rotated (incoherence processing), all parts included.
    #[serde(default)]
    pub incoherent_tensors: usize,
    /// Stored bits per weight of the quantized tensors, scales included.
    pub bits_per_weight: f64,
    pub experts: Vec<ExpertErrors>,
    pub tensors: Vec<TensorErrors>,
    /// Source shards the output took whole, linked or copied (by the joining call).
    #[serde(default)]
    pub reused: keep_checkpoint::writer::ReuseStats,
}

/// The fields of a [`QuantReport`] that describe one call rather than the output.
pub const RUN_RECORD: [&str; 5] = [
    "output",
    "layers_fitted",
    "source_bytes_fitted",
    "fit_seconds",
    "reused",
];

/// `quant-report.json` as stored in the checkpoint: the report without its run record, so a
/// checkpoint joined from shards (or resumed) is byte-identical to one made in one call.
pub fn report_file_json(report: &QuantReport) -> String {
    let mut v = serde_json::to_value(report).expect("a QuantReport is JSON");
    if let Some(o) = v.as_object_mut() {
        for k in RUN_RECORD {
            o.remove(k);
        }
    }
    serde_json::to_string_pretty(&v).expect("JSON")
}

/// The f32 values of a source weight (`[rows, cols]`, its scale tensor if any) in any layout
/// keep computes with.
pub fn decode_source(
    w: TensorRef,
    scale: Option<TensorRef>,
    rows: usize,
    cols: usize,
) -> Result<Vec<f32>> {
    let l = layout::classify_as(w, scale, rows, cols, None)
        .map_err(|e| QuantError::Input(format!("{}: {e}", w.name)))?;
    let sb = l.scale.map_or(&[][..], |s| s.bytes);
    let view = match l.layout {
        Layout::Plain(Dtype::F32) => WeightView::f32(w.bytes, rows, cols)?,
        Layout::Plain(Dtype::BF16) => WeightView::bf16(w.bytes, rows, cols)?,
        Layout::Mxfp4 => WeightView::mxfp4(w.bytes, sb, rows, cols)?,
        l @ Layout::Fp8Block { .. } if l.is_mxfp8() => WeightView::mxfp8(w.bytes, sb, rows, cols)?,
        Layout::Fp8Block { block, scale } => {
            let s = match scale {
                ScaleDtype::E8m0 => BlockScales::E8m0(sb),
                ScaleDtype::F32 => BlockScales::F32(sb),
                ScaleDtype::Bf16 => BlockScales::Bf16(sb),
            };
            WeightView::fp8_block(w.bytes, s, rows, cols, block.0, block.1)?
        }
        other => {
            return Err(QuantError::Input(format!(
                "{}: cannot quantize a weight stored as {}",
                w.name,
                other.label()
            )))
        }
    };
    let mut out = vec![0f32; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        view.decode_row(r, row);
    }
    Ok(out)
}

/// The f32 values of a routed expert's matrix wherever the family keeps it (keep-checkpoint's
/// `layout::expert_matrix`: its own tensors or its slice of a stack, MLX affine included).
pub fn decode_matrix(m: &layout::ExpertMatrix<'_>, rows: usize, cols: usize) -> Result<Vec<f32>> {
    let Some(b) = m.biases else {
        return decode_source(m.weight, m.scale, rows, cols);
    };
    let l = layout::expert_matrix_as(m, rows, cols, None).map_err(QuantError::Input)?;
    let Layout::MlxAffine { bits } = l.layout else {
        return Err(QuantError::Input(format!(
            "{}: cannot quantize a weight stored as {}",
            m.weight.name,
            l.layout.label()
        )));
    };
    let sb = l.scale.map_or(&[][..], |s| s.bytes);
    let view = WeightView::mlx_affine(bits, m.weight.bytes, sb, b.bytes, rows, cols)?;
    let mut out = vec![0f32; rows * cols];
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        view.decode_row(r, row);
    }
    Ok(out)
}

/// The imatrix file (`keep finalize`'s `imatrix.safetensors`, or a run directory holding it).
pub struct Imatrix {
    file: ShardFile,
    path: PathBuf,
}

impl Imatrix {
    /// Open `path` (a file, or a directory with `imatrix.safetensors`); refuses a file whose
    /// metadata `format` is not `keep-imatrix`.
    pub fn open(path: &Path) -> Result<Imatrix> {
        let p = if path.is_dir() {
            path.join("imatrix.safetensors")
        } else {
            path.to_path_buf()
        };
        let file = ShardFile::open(&p)?;
        match file.header().metadata.get("format").map(String::as_str) {
            Some("keep-imatrix") => Ok(Imatrix { file, path: p }),
            other => Err(QuantError::Input(format!(
                "{}: format {other:?} is not keep-imatrix (run keep finalize on the calibration run)",
                p.display()
            ))),
        }
    }

    /// The imatrix file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The per-column second moments (Σ x² / count) for key `imatrix.{L}.{key}`, if present
    /// with `cols` entries.
    pub fn get(&self, layer: usize, key: &str, cols: usize) -> Option<Vec<f32>> {
        let name = format!("imatrix.{layer}.{key}");
        let h = self.file.header();
        let t = h.tensors.iter().find(|t| t.name == name)?;
        if t.dtype != Dtype::F32 || t.numel() != cols as u64 {
            return None;
        }
        let b = self.file.data(t);
        Some(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }
}

struct Target {
    format: QuantFormat,
    layer: usize,
    expert: usize,
    part: &'static str,
    mat: ExpertMat,
    base: String,
    rows: usize,
    cols: usize,
    /// The source tensors dropped once every target listing them is coded.
    replaces: Vec<String>,
}

fn targets(ck: &Checkpoint, opts: &QuantOptions) -> Result<Vec<Target>> {
    let cfg = ck.require_config()?;
    let mut out = vec![];
    // A dense layer (DeepSeek-V3's first layers, Qwen3-MoE's `mlp_only_layers`) has no
    // routed experts to code.
    for layer in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for expert in 0..cfg.experts_in_layer(layer) {
            let Some(format) = opts.experts.format_of(layer, expert, opts.format) else {
                continue;
            };
            // The family's matrices of the expert, under the names their codes take.
            for m in cfg.coded_matrices(layer, expert) {
                // Read where the family keeps it (its own tensors or a slice of a stack); the
                // codes must take that tensor's place, or the model would go on reading it.
                let em = layout::expert_matrix(ck, cfg, layer, expert, m.mat).map_err(|e| {
                    QuantError::Input(format!(
                        "{}: layer {layer}, expert {expert}: {e}",
                        ck.dir().display()
                    ))
                })?;
                if !m.replaces.iter().any(|r| r == em.weight.name) {
                    return Err(QuantError::Input(format!(
                        "{}: layer {layer}, expert {expert} is read from `{}`, which keep quant \
                         does not replace (a stacked or already coded layout of {}); quantize \
                         the published per-expert weights",
                        ck.dir().display(),
                        em.weight.name,
                        cfg.model_type
                    )));
                }
                let part = PARTS[ExpertMat::ALL
                    .iter()
                    .position(|&x| x == m.mat)
                    .expect("one of the three")];
                out.push(Target {
                    format,
                    layer,
                    expert,
                    part,
                    mat: m.mat,
                    base: m.base,
                    rows: m.rows,
                    cols: m.cols,
                    replaces: m.replaces,
                });
            }
        }
    }
    Ok(out)
}

fn parts_dir(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| "out".into());
    out.with_file_name(format!(".{name}.keep-quant-parts"))
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The tensors of one fitted weight, in write order.
fn fitted_tensors(base: &str, f: &FittedMatrix) -> Vec<(TensorMeta, Vec<u8>)> {
    let (r, kc) = (f.rows as u64, (f.cols / 8) as u64);
    let mut v = vec![
        (
            TensorMeta::new(format!("{base}.weight"), Dtype::U16, &[r, kc]),
            u16_bytes(&f.codes),
        ),
        (
            TensorMeta::new(format!("{base}.scale"), Dtype::F32, &[r, 1]),
            f32_bytes(&f.scales),
        ),
    ];
    if let Some(st) = &f.residual {
        let (dt, bytes) = match &st.codes {
            ResidualCodes::E81(c) => (Dtype::U8, c.clone()),
            ResidualCodes::E8p(c) => (Dtype::U16, u16_bytes(c)),
        };
        v.push((
            TensorMeta::new(format!("{base}.resid.weight"), dt, &[r, kc]),
            bytes,
        ));
        v.push((
            TensorMeta::new(format!("{base}.resid.scale"), Dtype::F32, &[r, 1]),
            f32_bytes(&st.scales),
        ));
    }
    v
}

/// Progress callback: (tensors fitted so far in this call, tensors to fit in this call).
pub type Progress<'a> = &'a dyn Fn(usize, usize);

/// Quantize `model` into `out` (see the module docs). Checks everything it can before fitting:
/// the imatrix has every tensor it must quantize (else [`QuantError::MissingImatrix`] naming
/// the tensor), the output may be written, the shard is valid.
pub fn quantize(
    model: &Path,
    imatrix: &Path,
    out: &Path,
    opts: &QuantOptions,
    progress: Progress,
) -> Result<QuantReport> {
    quantize_with(model, imatrix, out, opts, None, progress)
}

/// The file of a layer's part listing its rotated weights' transforms.
const PART_INCOHERENCE: &str = "incoherence.json";

/// [`quantize`], with incoherence processing of every lattice-coded weight when
/// `incoherence` is given (refused with MLX affine codes). A resumed run must have the same
/// incoherence settings as the parts it joins; the marker is built from the parts.
pub fn quantize_with(
    model: &Path,
    imatrix: &Path,
    out: &Path,
    opts: &QuantOptions,
    incoherence: Option<crate::incoherence::IncoherenceOptions>,
    progress: Progress,
) -> Result<QuantReport> {
    if incoherence.is_some() && opts.mlx_bits.is_some() {
        return Err(QuantError::Input(
            "incoherence processing applies to the lattice formats, not MLX affine codes".into(),
        ));
    }
    let (si, sn) = opts.shard;
    if sn == 0 || si >= sn {
        return Err(QuantError::Input(format!(
            "shard {si}/{sn} is out of range: need 0 ≤ I < N"
        )));
    }
    let ck = Checkpoint::open(model)?;
    let cfg = ck.require_config()?;
    if sn > cfg.num_hidden_layers {
        return Err(QuantError::Input(format!(
            "shard {si}/{sn}: the model has {} layers, so at most {} shards do work",
            cfg.num_hidden_layers, cfg.num_hidden_layers
        )));
    }
    let im = Imatrix::open(imatrix)?;
    let targets = targets(&ck, opts)?;
    for t in &targets {
        let key = format!("ffn.experts.{}.{}", t.expert, t.part);
        if im.get(t.layer, &key, t.cols).is_none() {
            return Err(QuantError::MissingImatrix {
                tensor: format!("{}.weight", t.base),
                key: format!("imatrix.{}.{key}", t.layer),
            });
        }
    }
    keep_checkpoint::writer::check_dir_target(out, opts.force, &[model.to_path_buf()])?;
    let parts = parts_dir(out);
    std::fs::create_dir_all(&parts).map_err(|e| QuantError::Io {
        path: parts.display().to_string(),
        source: e,
    })?;
    let record = parts::Record::new(model, im.path(), opts, incoherence)?;
    {
        let _lock = parts::Lock::acquire(&parts)?;
        parts::claim(&parts, &record, opts.force)?;
    }
    let layers: BTreeSet<usize> = targets.iter().map(|t| t.layer).collect();
    let part_of = |l: usize| parts.join(format!("{}{l:05}", parts::PART_PREFIX));
    let todo: Vec<usize> = layers
        .iter()
        .copied()
        .filter(|l| l % sn == si && !part_of(*l).join("errors.json").is_file())
        .collect();
    let total: usize = targets.iter().filter(|t| todo.contains(&t.layer)).count();
    let mut done = 0usize;
    let mut source_bytes = 0u64;
    let t0 = std::time::Instant::now();
    progress(0, total);
    for &l in &todo {
        let mut tensors: Vec<(TensorMeta, Vec<u8>)> = vec![];
        let mut errs: Vec<TensorErrors> = vec![];
        let mut rotated: BTreeMap<String, keep_checkpoint::incoherence::Incoherence> =
            BTreeMap::new();
        for t in targets.iter().filter(|t| t.layer == l) {
            let wname = format!("{}.weight", t.base);
            let em = layout::expert_matrix(&ck, cfg, l, t.expert, t.mat)
                .map_err(|e| QuantError::Input(format!("{wname}: {e}")))?;
            source_bytes += em.bytes();
            let vals = decode_matrix(&em, t.rows, t.cols)?;
            if let Some(i) = vals.iter().position(|v| !v.is_finite()) {
                return Err(QuantError::Input(format!(
                    "{wname}: the source holds a non-finite value ({}) at row {}, column {}; \
                     the checkpoint is damaged (check it with keep verify), and nothing of \
                     layer {l} was stored",
                    vals[i],
                    i / t.cols,
                    i % t.cols
                )));
            }
            let key = format!("ffn.experts.{}.{}", t.expert, t.part);
            let h = im.get(l, &key, t.cols).expect("checked above");
            if let Some(bits) = opts.mlx_bits {
                let m = crate::mlx::quantize_matrix(&vals, t.rows, t.cols, &h, bits)
                    .map_err(|e| QuantError::Input(format!("{wname}: {e}")))?;
                let label = opts.method();
                errs.push(TensorErrors {
                    name: wname,
                    layer: l,
                    expert: t.expert,
                    part: t.part.to_string(),
                    rows: t.rows,
                    cols: t.cols,
                    rel_error: BTreeMap::from([(
                        label.clone(),
                        m.error / m.weight.max(f64::MIN_POSITIVE),
                    )]),
                    error: BTreeMap::from([(label, m.error)]),
                    weight: m.weight,
                });
                tensors.extend(mlx_tensors(&t.base, &m));
                done += 1;
                progress(done, total);
                continue;
            }
            let werr = |e: QuantError| QuantError::Input(format!("{wname}: {e}"));
            let (f, errors) = match incoherence {
                None => {
                    let f = fit_matrix(&vals, t.rows, t.cols, &h, t.format).map_err(werr)?;
                    let e = f.errors;
                    (f, e)
                }
                Some(io) => {
                    let (vi, vo) = crate::incoherence::transforms(io, &t.base, t.rows, t.cols)?;
                    let r = crate::incoherence::fit_incoherent(
                        &vals, t.rows, t.cols, &h, t.format, vi, vo,
                    )
                    .map_err(werr)?;
                    rotated.insert(t.base.clone(), crate::incoherence::marker(vi, vo));
                    (r.fit, r.errors)
                }
            };
            let mut rel = BTreeMap::new();
            let mut abs = BTreeMap::new();
            abs.insert(QuantFormat::E8p2.label().to_string(), errors.base);
            if let Some(e) = errors.full {
                abs.insert(t.format.label().to_string(), e);
            }
            for (k, v) in &abs {
                rel.insert(k.clone(), v / errors.weight.max(f64::MIN_POSITIVE));
            }
            errs.push(TensorErrors {
                name: wname,
                layer: l,
                expert: t.expert,
                part: t.part.to_string(),
                rows: t.rows,
                cols: t.cols,
                rel_error: rel,
                error: abs,
                weight: errors.weight,
            });
            tensors.extend(fitted_tensors(&t.base, &f));
            done += 1;
            progress(done, total);
        }
        check_finite(&errs, &tensors)?;
        let _lock = parts::Lock::acquire(&parts)?;
        parts::still_ours(&parts, &record)?;
        let metas = tensors.iter().map(|(m, _)| m.clone()).collect();
        let mut w = CheckpointWriter::create(
            &part_of(l),
            metas,
            WriterOptions {
                force: true,
                ..WriterOptions::default()
            },
        )?;
        for (m, b) in &tensors {
            w.write_tensor(&m.name, b)?;
        }
        if !rotated.is_empty() {
            w.add_file(
                PART_INCOHERENCE,
                serde_json::to_string(&rotated).expect("JSON").as_bytes(),
            )?;
        }
        w.add_file(
            "errors.json",
            serde_json::to_string(&errs).expect("JSON").as_bytes(),
        )?;
        w.finish()?;
    }
    let fit_seconds = t0.elapsed().as_secs_f64();
    let missing: Vec<usize> = layers
        .iter()
        .copied()
        .filter(|l| !part_of(*l).join("errors.json").is_file())
        .collect();
    let bits = {
        let (mut bits, mut n) = (0f64, 0f64);
        for t in &targets {
            let k = (t.rows * t.cols) as f64;
            bits += opts.bits_per_weight(t.format, t.rows, t.cols) * k;
            n += k;
        }
        if n > 0.0 {
            bits / n
        } else {
            0.0
        }
    };
    let mut report = QuantReport {
        format: QUANT_FORMAT.into(),
        version: QUANT_VERSION,
        method: opts.method(),
        source: model.display().to_string(),
        output: out.display().to_string(),
        layers_fitted: todo.clone(),
        layers_missing: missing.clone(),
        joined: false,
        tensors_quantized: targets.len(),
        source_bytes_fitted: source_bytes,
        fit_seconds,
        incoherent_tensors: 0,
        bits_per_weight: bits,
        experts: vec![],
        tensors: vec![],
        reused: Default::default(),
    };
    if !missing.is_empty() {
        return Ok(report);
    }
    // join
    let _lock = parts::Lock::acquire(&parts)?;
    parts::still_ours(&parts, &record)?;
    let mut part_cks = BTreeMap::new();
    let mut marker: BTreeMap<String, keep_checkpoint::incoherence::Incoherence> = BTreeMap::new();
    for &l in &layers {
        let p = part_of(l);
        let inc = p.join(PART_INCOHERENCE);
        if inc.is_file() {
            let text = keep_checkpoint::small_file::read_text(
                &inc,
                keep_checkpoint::small_file::MAX_SMALL_FILE,
            )?;
            let m: BTreeMap<String, keep_checkpoint::incoherence::Incoherence> =
                serde_json::from_str(&text)
                    .map_err(|e| QuantError::Input(format!("{}: {e}", inc.display())))?;
            marker.extend(m);
        }
        let text = keep_checkpoint::small_file::read_text(
            &p.join("errors.json"),
            keep_checkpoint::small_file::MAX_SMALL_FILE,
        )?;
        let e: Vec<TensorErrors> = serde_json::from_str(&text)
            .map_err(|e| QuantError::Input(format!("{}: {e}", p.display())))?;
        report.tensors.extend(e);
        part_cks.insert(l, Checkpoint::open(&p)?);
    }
    // Each quantized base name, at the source tensor it takes the place of: its own weight,
    // or (a stacked family) the first tensor it replaces. A replaced source tensor is dropped
    // once every matrix read from it is coded (a stack that still serves an uncoded expert
    // stays).
    let coded: BTreeSet<(usize, usize)> = targets.iter().map(|t| (t.layer, t.expert)).collect();
    let mut readers: BTreeMap<String, bool> = BTreeMap::new();
    for l in (0..cfg.num_hidden_layers).filter(|&l| cfg.is_moe_layer(l)) {
        for x in 0..cfg.experts_in_layer(l) {
            for m in cfg.coded_matrices(l, x) {
                for r in m.replaces {
                    *readers.entry(r).or_insert(true) &= coded.contains(&(l, x));
                }
            }
        }
    }
    let mut at: BTreeMap<&str, Vec<&Target>> = BTreeMap::new();
    for t in &targets {
        let anchor = t.replaces.first().map_or(t.base.as_str(), String::as_str);
        at.entry(anchor).or_default().push(t);
    }
    // Source shards none of whose tensors is replaced go into the output whole (linked).
    let dropped = |name: &str| readers.get(name).copied().unwrap_or(false);
    let reused = ck.whole_shards(|t| !dropped(t.name));
    let reused_names: BTreeSet<&str> = reused
        .iter()
        .flat_map(|r| r.tensors.iter().map(|t| t.name.as_str()))
        .collect();
    // output order: the source's, each quantized weight's tensors where its source was
    let mut plan: Vec<(TensorMeta, Option<(usize, String)>)> = vec![];
    for t in ck.tensors() {
        if !dropped(t.name) && !reused_names.contains(t.name) {
            plan.push((TensorMeta::new(t.name, t.dtype, t.shape), None));
        }
        for q in at.get(t.name).into_iter().flatten() {
            let pck = &part_cks[&q.layer];
            for suffix in [
                ".weight",
                ".scale",
                ".resid.weight",
                ".resid.scale",
                ".scales",
                ".biases",
            ] {
                let n = format!("{}{suffix}", q.base);
                if let Some(pt) = pck.get(&n) {
                    plan.push((
                        TensorMeta::new(n.clone(), pt.dtype, pt.shape),
                        Some((q.layer, n)),
                    ));
                }
            }
        }
    }
    let mut shard_meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    shard_meta.insert(CONFIG_KEY.into(), opts.method());
    let mut w = CheckpointWriter::create_reusing(
        out,
        plan.iter().map(|(m, _)| m.clone()).collect(),
        reused.clone(),
        WriterOptions {
            force: opts.force,
            shard_metadata: shard_meta,
            protect: vec![model.to_path_buf()],
            ..WriterOptions::default()
        },
    )?;
    report.reused = w.reuse_stats();
    for (m, src) in &plan {
        let bytes = match src {
            Some((l, n)) => part_cks[l].tensor(n)?.bytes,
            None => ck.tensor(&m.name)?.bytes,
        };
        w.write_tensor(&m.name, bytes)?;
    }
    let method = opts.method();
    let per_tensor: BTreeMap<&String, &str> = targets
        .iter()
        .map(|t| {
            let label = match opts.mlx_bits {
                Some(_) => method.as_str(),
                None => t.format.label(),
            };
            (&t.base, label)
        })
        .collect();
    let mut entry = json!({
        "format": QUANT_FORMAT,
        "version": QUANT_VERSION,
        "method": method,
        "tensors": per_tensor,
    });
    if !marker.is_empty() {
        entry[keep_checkpoint::incoherence::INCOHERENCE_KEY] =
            serde_json::to_value(&marker).expect("JSON");
    }
    report.incoherent_tensors = marker.len();
    let raw = cfg.raw_with(&[(CONFIG_KEY, entry)]);
    w.add_file(
        "config.json",
        serde_json::to_string_pretty(&raw).expect("JSON").as_bytes(),
    )?;
    for f in ck.aux_files()? {
        let name = f.file_name().expect("a file").to_string_lossy().to_string();
        if name == REPORT_FILE {
            continue;
        }
        w.copy_file(&name, &f)?;
    }
    // per-expert errors: the three projections' sums
    let mut by_expert: BTreeMap<(usize, usize), (BTreeMap<String, f64>, f64)> = BTreeMap::new();
    for t in &report.tensors {
        let e = by_expert.entry((t.layer, t.expert)).or_default();
        for (k, v) in &t.error {
            *e.0.entry(k.clone()).or_default() += v;
        }
        e.1 += t.weight;
    }
    report.experts = by_expert
        .into_iter()
        .map(|((layer, expert), (err, wsum))| ExpertErrors {
            layer,
            expert,
            rel_error: err
                .into_iter()
                .map(|(k, v)| (k, v / wsum.max(f64::MIN_POSITIVE)))
                .collect(),
        })
        .collect();
    report.joined = true;
    w.add_file(REPORT_FILE, report_file_json(&report).as_bytes())?;
    w.finish()?;
    drop(part_cks);
    let _ = std::fs::remove_dir_all(&parts);
    Ok(report)
}

/// Refuse a part whose errors or stored scales are not finite (a poisoned part would be
/// joined into every later run): the error names the tensor.
fn check_finite(errs: &[TensorErrors], tensors: &[(TensorMeta, Vec<u8>)]) -> Result<()> {
    for e in errs {
        let bad = e
            .error
            .values()
            .chain(e.rel_error.values())
            .chain(std::iter::once(&e.weight))
            .any(|v| !v.is_finite());
        if bad {
            return Err(QuantError::Input(format!(
                "{}: the fit's error is not finite; nothing of layer {} was stored",
                e.name, e.layer
            )));
        }
    }
    for (m, b) in tensors {
        let finite = match m.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
            Dtype::BF16 => b.chunks_exact(2).all(|c| {
                f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).is_finite()
            }),
            _ => true,
        };
        if !finite {
            return Err(QuantError::Input(format!(
                "{}: holds a non-finite value; nothing of its layer was stored",
                m.name
            )));
        }
    }
    Ok(())
}

mod parts;
pub use parts::{Record as PartsRecord, PARTS_FORMAT, PARTS_VERSION};

#[cfg(test)]
mod tests;
