//! How a weight is stored — the one classification that `keep inspect`, `keep repack`, the
//! model's weight loader and the runtime's budget all use, so that inspect never accepts a
//! checkpoint the loader refuses, nor the reverse — and the one check of a checkpoint's
//! tensors against its config ([`model_problems`]) that inspect reports and the loader refuses
//! with, before anything is allocated.
//!
//! A layout is read from the weight's dtype and its scale partner's dtype and shape, never
//! assumed (only names and shapes are looked at; no weight byte is decoded here):
//!
//! | weight | scale | layout |
//! |---|---|---|
//! | any dtype, `[rows, cols]` | none | plain (the model computes with F32 and BF16) |
//! | `F8_E4M3 [rows, cols]` | `F8_E8M0 [rows, cols/32]` | MXFP8 (FP8 block 1×32, E8M0) |
//! | `F8_E4M3 [rows, cols]` | `F8_E8M0` or `F32` `[ceil(rows/b), ceil(cols/b)]` | FP8 b×b blocks; b from `quantization_config.weight_block_size` when it fits, else 32, 64, 128 or 256 |
//! | `I8 [rows, cols/2]` | `F8_E8M0 [rows, cols/32]` | MXFP4 (DeepSeek's FP4 experts) |
//! | `U8 [.., rows, cols/32, 16]` named `*_blocks` | `U8 [.., rows, cols/32]` named `*_scales` | MXFP4 (OpenAI's expert stacks; [`naming::MXFP4_BLOCKS`]) |
//! | `U16 [rows, cols/8]` | `F32 [rows, 1]` | E8P12 lattice codes (`keep quant`) |
//! | `U8 [rows, cols/8]`, named `*.resid.weight` | `F32 [rows, 1]` | E81B residual stage codes (`keep quant`) |
//! | `U32 [rows, cols·bits/32]` | `BF16 [rows, cols/64]` named `*.scales` | MLX affine, `bits` ∈ {2, 3, 4, 8}, group 64 (mlx-lm's files, `keep quant --format mlxN`) |
//! | named by a registered format's main suffix (`I32 [rows, cols/8]` `*.weight_packed`) | its second part (`BF16 [rows, cols/32]` `*.weight_scale`) | that format (`layout::registered`; INT4 group 32, compressed-tensors' `pack-quantized`) |
//!
//! An MLX affine weight also has `<base>.biases` (the scales' dtype and shape; [`biases_of`]),
//! checked by [`weight_as`]. Its width follows from the two shapes at group 64; other group
//! sizes (and F16/F32 parameters) are refused.
//!
//! A `keep quant` weight's residual stage is a tensor of its own, `<base>.resid.weight` (E8P12
//! or E81B codes) with `<base>.resid.scale`; [`residual_of`] finds it and the classification
//! of both is checked together by [`classify_as`]'s callers.
//!
//! Refused, with the reason: an FP8 or I8 weight without a scale, a scale on any other weight
//! dtype, a scale that is not 2-D, a scale grid no block shape fits, and `U8` scales or packed
//! weights (DeepSeek and mlx-lm's loader store E8M0 scales as `F8_E8M0` and FP4 as `I8`; a
//! `U8` tensor says nothing about what its bytes are, except in the named stacked MXFP4
//! `*_blocks` / `*_scales` pairs). Scales are looked up as `<base>.scale`,
//! then `<base>.weight_scale_inv` (V3 naming) ([`scale_of`]).

use crate::naming;

pub(crate) mod qwen3;
pub mod registered;
use crate::{Checkpoint, DeepSeekConfig, Dtype, TensorRef};

/// Block sides tried, smallest first, when the config declares none that fits. For powers of
/// two two sides can only give the same grid when the grid is 1 along that side, where they
/// decode identically.
pub const BLOCK_SIDES: [usize; 4] = [32, 64, 128, 256];

/// The dtype of an FP8 block scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScaleDtype {
    /// `F8_E8M0`: `2^(b − 127)`, 0xFF is NaN.
    E8m0,
    /// `F32` multipliers (V4-Flash-Base's powers of two, or V3's `scale_inv`).
    F32,
    /// `BF16` multipliers (Qwen3's FP8 `weight_scale_inv`).
    Bf16,
}

impl ScaleDtype {
    /// Report label.
    pub fn label(self) -> &'static str {
        match self {
            ScaleDtype::E8m0 => "e8m0",
            ScaleDtype::F32 => "f32",
            ScaleDtype::Bf16 => "bf16",
        }
    }
}

/// How a weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    /// Unscaled elements of this dtype.
    Plain(Dtype),
    /// FP8 E4M3 with one scale per `block.0 × block.1` block (`(1, 32)` with E8M0 is MXFP8).
    Fp8Block {
        block: (usize, usize),
        scale: ScaleDtype,
    },
    /// FP4 E2M1, two per `I8` byte (element `2j` in the low nibble), one E8M0 scale per row and
    /// 32 columns.
    Mxfp4,
    /// E8P12 lattice codes, one u16 per 8 weights, one f32 scale per row.
    E8p,
    /// E81B lattice codes (a residual stage only), one byte per 8 weights, one f32 scale per row.
    E81,
    /// MLX affine codes of `bits` bits packed in `uint32` words, a bf16 scale and a bf16 bias
    /// per row and 64 columns.
    MlxAffine { bits: u32 },
    /// A format of keep-format's registry, by its entry's name (`layout::registered`).
    Registered(&'static str),
}

impl Layout {
    /// Whether this is MXFP8 (FP8 blocks of one row × 32 columns with E8M0 scales).
    pub fn is_mxfp8(self) -> bool {
        self == Layout::Fp8Block {
            block: (1, 32),
            scale: ScaleDtype::E8m0,
        }
    }

    /// Whether keep's kernels multiply by a matrix stored this way.
    pub fn computable(self) -> bool {
        !matches!(self, Layout::E81)
            && !matches!(self, Layout::Plain(d) if !matches!(d, Dtype::F32 | Dtype::BF16))
    }

    /// The registry entry of a [`Layout::Registered`] layout.
    pub fn spec(self) -> Option<&'static keep_format::registry::FormatSpec> {
        match self {
            Layout::Registered(name) => keep_format::registry::find_by_name(name),
            _ => None,
        }
    }

    /// Report label (`"mxfp8"`, `"fp8-block 128x128 e8m0"`, `"fp4 (mxfp4)"`, `"bf16"`).
    pub fn label(self) -> String {
        match self {
            Layout::Plain(d) => d.name().to_ascii_lowercase(),
            l if l.is_mxfp8() => "mxfp8".into(),
            Layout::Fp8Block { block, scale } => {
                format!("fp8-block {}x{} {}", block.0, block.1, scale.label())
            }
            Layout::Mxfp4 => "fp4 (mxfp4)".into(),
            Layout::E8p => "e8p2".into(),
            Layout::E81 => "e81 (residual)".into(),
            Layout::MlxAffine { bits } => format!("mlx-affine{bits} g64"),
            Layout::Registered(name) => keep_format::registry::find_by_name(name)
                .map_or(name, |f| f.label)
                .to_string(),
        }
    }
}

/// A weight (and its scale) classified.
#[derive(Debug, Clone, Copy)]
pub struct WeightLayout<'a> {
    pub weight: TensorRef<'a>,
    pub scale: Option<TensorRef<'a>>,
    pub layout: Layout,
    /// Logical `[rows, cols]` (FP4 counts two elements per byte; a 1-D weight is one row).
    pub rows: usize,
    pub cols: usize,
}

impl WeightLayout<'_> {
    /// Logical number of weights.
    pub fn numel(&self) -> u64 {
        self.rows as u64 * self.cols as u64
    }

    /// Stored bytes, the scale's included.
    pub fn bytes(&self) -> u64 {
        self.weight.bytes.len() as u64 + self.scale.map_or(0, |s| s.bytes.len() as u64)
    }
}

/// How a residual stage's weight name ends (`<base>.resid.weight`).
pub const RESIDUAL_SUFFIX: &str = ".resid.weight";

/// The residual stage of weight `weight_name` (`<base>.weight`): `<base>.resid.weight` and its
/// scale, if the checkpoint has them.
pub fn residual_of<'a>(
    ck: &'a Checkpoint,
    weight_name: &str,
) -> Option<(TensorRef<'a>, Option<TensorRef<'a>>)> {
    let base = weight_name.strip_suffix(".weight")?;
    let name = format!("{base}{RESIDUAL_SUFFIX}");
    let t = ck.get(&name)?;
    Some((t, scale_of(ck, &name)))
}

/// Classify a residual stage of a `[rows, cols]` E8P weight: E8P12 or E81B codes of that shape.
pub fn classify_residual<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    rows: usize,
    cols: usize,
) -> Result<WeightLayout<'a>, String> {
    let l = classify(weight, scale, None)?;
    if !matches!(l.layout, Layout::E8p | Layout::E81) || (l.rows, l.cols) != (rows, cols) {
        return Err(format!(
            "a residual stage must be E8P12 or E81B codes of a [{rows}, {cols}] matrix, \
             this is {} {}x{}",
            l.layout.label(),
            l.rows,
            l.cols
        ));
    }
    Ok(l)
}

/// The MLX affine biases of weight `weight_name` (`<base>.biases`), if the checkpoint has them.
pub fn biases_of<'a>(ck: &'a Checkpoint, weight_name: &str) -> Option<TensorRef<'a>> {
    ck.get(&naming::biases_name(weight_name)?)
}

/// Check an MLX affine weight's biases against its scales: present, same dtype and shape.
pub fn check_biases(scale: Option<TensorRef>, biases: Option<TensorRef>) -> Result<(), String> {
    match (scale, biases) {
        (Some(s), Some(b)) if s.dtype == b.dtype && s.shape == b.shape => Ok(()),
        (Some(s), Some(b)) => Err(format!(
            "its biases `{}` ({} {:?}) do not match its scales `{}` ({} {:?})",
            b.name, b.dtype, b.shape, s.name, s.dtype, s.shape
        )),
        _ => Err("an MLX affine weight needs its `.biases` tensor".into()),
    }
}

/// The scale partner of weight `weight_name`, if the checkpoint has one.
pub fn scale_of<'a>(ck: &'a Checkpoint, weight_name: &str) -> Option<TensorRef<'a>> {
    naming::scale_candidates(weight_name)
        .iter()
        .find_map(|n| ck.get(n))
}

fn dims(t: &TensorRef) -> Vec<usize> {
    t.shape.iter().map(|&d| d as usize).collect()
}

/// The classification of a stacked MXFP4 weight (or one expert's slice of it): `*_blocks`
/// ([`naming::MXFP4_BLOCKS`]) `U8 [.., rows, cols/32, 16]` with its `*_scales`
/// ([`naming::MXFP4_SCALES`]) `U8 [.., rows, cols/32]` is MXFP4 of `prod(..)·rows` rows and
/// `cols` columns (`None`: not such a pair; the general classification decides). A `U8` tensor
/// says what its bytes are by these names, as OpenAI publishes its expert stacks.
fn mxfp4_stack<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
) -> Option<Result<WeightLayout<'a>, String>> {
    let s = scale?;
    let base = weight.name.strip_suffix(naming::MXFP4_BLOCKS)?;
    if s.name.strip_suffix(naming::MXFP4_SCALES) != Some(base) {
        return None;
    }
    let (w, sc) = (weight.shape, s.shape);
    let ok = matches!(weight.dtype, Dtype::U8 | Dtype::I8)
        && matches!(s.dtype, Dtype::U8 | Dtype::F8_E8M0)
        && w.len() >= 3
        && w.last() == Some(&16)
        && sc == &w[..w.len() - 1];
    if !ok {
        return Some(Err(format!(
            "MXFP4 blocks {} {:?} with scales `{}` {} {:?}: expected U8 [.., rows, columns/32, \
             16] and U8 [.., rows, columns/32]",
            weight.dtype, w, s.name, s.dtype, sc
        )));
    }
    let g = sc[sc.len() - 1] as usize;
    let rows = sc[..sc.len() - 1].iter().product::<u64>() as usize;
    Some(Ok(WeightLayout {
        weight,
        scale,
        layout: Layout::Mxfp4,
        rows,
        cols: g * 32,
    }))
}

/// Classify a weight from its dtype and its scale's dtype and shape (`block_hint`: the config's
/// `weight_block_size`). The error says why keep cannot read it.
pub fn classify<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightLayout<'a>, String> {
    if let Some(l) = mxfp4_stack(weight, scale) {
        return l;
    }
    if let Some(l) = registered::classify(weight, scale) {
        return l;
    }
    let wd = dims(&weight);
    let (rows, cols) = match wd.as_slice() {
        [r, c] => (*r, *c),
        [n] => (1, *n),
        _ if scale.is_none() => (wd.iter().product(), 1),
        _ => {
            return Err(format!(
                "a scaled weight must be 2-D, this one has shape {:?}",
                weight.shape
            ))
        }
    };
    let done = |layout, rows, cols| {
        Ok(WeightLayout {
            weight,
            scale,
            layout,
            rows,
            cols,
        })
    };
    let Some(s) = scale else {
        return match weight.dtype {
            Dtype::F8_E4M3 | Dtype::I8 => Err(format!(
                "{} weight without a scale tensor (`.scale` or `.weight_scale_inv`)",
                weight.dtype
            )),
            d => done(Layout::Plain(d), rows, cols),
        };
    };
    let sd = dims(&s);
    let [sr, sc] = sd[..] else {
        return Err(format!(
            "its scale `{}` has shape {:?}, not [rows, columns]",
            s.name, s.shape
        ));
    };
    // MLX affine: uint32 words of packed codes, bf16 scales per 64 columns
    if weight.dtype == Dtype::U32 {
        let logical = sc * 64;
        let bits = (cols * 32).checked_div(logical).unwrap_or(0);
        let ok = sr == rows
            && s.dtype == Dtype::BF16
            && bits * logical == cols * 32
            && matches!(bits, 2 | 3 | 4 | 8);
        if !ok {
            return Err(format!(
                "U32 weight [{rows}, {cols}] with scale `{}` {} {:?}: not MLX affine codes of \
                 2, 3, 4 or 8 bits in groups of 64 with BF16 scales [{rows}, columns/64]",
                s.name, s.dtype, s.shape
            ));
        }
        return done(Layout::MlxAffine { bits: bits as u32 }, rows, logical);
    }
    // lattice codes: one f32 scale per row
    if s.dtype == Dtype::F32 && sc == 1 && sr == rows {
        match weight.dtype {
            Dtype::U16 => return done(Layout::E8p, rows, cols * 8),
            Dtype::U8 if weight.name.ends_with(RESIDUAL_SUFFIX) => {
                return done(Layout::E81, rows, cols * 8)
            }
            _ => {}
        }
    }
    let scale_dtype = match s.dtype {
        Dtype::F8_E8M0 => ScaleDtype::E8m0,
        Dtype::F32 => ScaleDtype::F32,
        Dtype::BF16 => ScaleDtype::Bf16,
        Dtype::U8 => {
            return Err(format!(
                "its scale `{}` has dtype U8, which does not say what the bytes are: \
                 E8M0 scales are stored as F8_E8M0 (as DeepSeek publishes them and mlx-lm reads them)",
                s.name
            ))
        }
        d => {
            return Err(format!(
                "its scale `{}` has dtype {d}; block scales are F8_E8M0, F32 or BF16",
                s.name
            ))
        }
    };
    match weight.dtype {
        Dtype::I8 => {
            let cols = cols * 2;
            if scale_dtype != ScaleDtype::E8m0 {
                return Err(format!(
                    "FP4 weight with a {} scale; FP4 scales are F8_E8M0",
                    s.dtype
                ));
            }
            if !cols.is_multiple_of(32) || sr != rows || sc != cols / 32 {
                return Err(format!(
                    "FP4 weight of {rows}x{cols} needs a scale of [{rows}, {}] (one per 32 columns), found {:?}",
                    cols / 32,
                    s.shape
                ));
            }
            done(Layout::Mxfp4, rows, cols)
        }
        Dtype::U8 => Err(format!(
            "packed weight of dtype U8 with a scale: FP4 weights are stored as I8 (scale `{}`)",
            s.name
        )),
        Dtype::F8_E4M3 => {
            let fits = |(br, bc): (usize, usize)| {
                br > 0 && bc > 0 && rows.div_ceil(br) == sr && cols.div_ceil(bc) == sc
            };
            let mx = (1, 32);
            let block = block_hint
                .filter(|&b| fits(b))
                .or_else(|| {
                    (scale_dtype == ScaleDtype::E8m0 && cols.is_multiple_of(32) && fits(mx))
                        .then_some(mx)
                })
                .or_else(|| BLOCK_SIDES.iter().map(|&b| (b, b)).find(|&b| fits(b)));
            match block {
                Some(block) => done(
                    Layout::Fp8Block {
                        block,
                        scale: scale_dtype,
                    },
                    rows,
                    cols,
                ),
                None => Err(format!(
                    "FP8 weight of {rows}x{cols} with a {sr}x{sc} scale grid: neither MXFP8 \
                     [{rows}, {}] nor square blocks of {}{}",
                    cols / 32,
                    BLOCK_SIDES.map(|b| b.to_string()).join(", "),
                    block_hint.map_or(String::new(), |(a, b)| format!(
                        " nor the config's weight_block_size [{a}, {b}]"
                    ))
                )),
            }
        }
        d => Err(format!("{d} weight with a scale tensor `{}`", s.name)),
    }
}

/// Classify a weight the model multiplies by as `[rows, cols]`: [`classify`], and the logical
/// shape must be exactly that and the layout one keep computes with.
pub fn classify_as<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightLayout<'a>, String> {
    // A stacked MXFP4 weight's blocks are `[rows, cols/32, 16]` an expert ([`mxfp4_stack`]).
    let stack = weight.shape.len() == 3 && weight.name.ends_with(naming::MXFP4_BLOCKS);
    if weight.shape.len() != 2 && !stack {
        return Err(format!(
            "has shape {:?}, expected a [{rows}, {cols}] matrix",
            weight.shape
        ));
    }
    let l = classify(weight, scale, block_hint)?;
    if !l.layout.computable() {
        return Err(format!(
            "dtype {} is not a weight format keep computes with (F32, BF16, FP8 E4M3 + scale, \
             FP4 I8 + E8M0 scale)",
            weight.dtype
        ));
    }
    if (l.rows, l.cols) != (rows, cols) {
        return Err(format!(
            "holds a {}x{} {} matrix, expected [{rows}, {cols}] (shape {:?})",
            l.rows,
            l.cols,
            l.layout.label(),
            weight.shape
        ));
    }
    Ok(l)
}

/// Look up `<base>.weight` (and its scale) in `ck` and [`classify_as`] it.
pub fn weight_as<'a>(
    ck: &'a Checkpoint,
    base: &str,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightLayout<'a>, String> {
    let name = format!("{base}.weight");
    let w =
        registered::main_tensor(ck, &name).ok_or_else(|| format!("tensor `{name}` is missing"))?;
    let name = w.name;
    let l = classify_as(w, scale_of(ck, name), rows, cols, block_hint)
        .map_err(|e| format!("tensor `{name}`: {e}"))?;
    if let Some(e) = registered::metadata_problem(ck, &l) {
        return Err(e);
    }
    if let Some((rw, rs)) = residual_of(ck, name) {
        if l.layout != Layout::E8p {
            return Err(format!(
                "tensor `{}`: a residual stage of a {} weight (only E8P12 weights take one)",
                rw.name,
                l.layout.label()
            ));
        }
        classify_residual(rw, rs, rows, cols).map_err(|e| format!("tensor `{}`: {e}", rw.name))?;
    }
    if matches!(l.layout, Layout::MlxAffine { .. }) {
        check_biases(l.scale, biases_of(ck, name)).map_err(|e| format!("tensor `{name}`: {e}"))?;
    }
    Ok(l)
}

/// One routed expert's matrix as stored: its weight, its scale partner, (MLX affine) its
/// biases and (a registered format) the further parts the kernels read, each a tensor of the
/// checkpoint or expert `e`'s slice of the layer's stacked tensor (mlx-lm's `switch_mlp`,
/// [`expert_slice`]): the same mapped bytes either way, nothing copied.
#[derive(Debug, Clone)]
pub struct ExpertMatrix<'a> {
    pub weight: TensorRef<'a>,
    pub scale: Option<TensorRef<'a>>,
    pub biases: Option<TensorRef<'a>>,
    /// The parts of a registered format the kernels read past the weight and its scale, in
    /// the entry's order, those the checkpoint has ([`registered::further_parts`]: NVFP4's
    /// per-tensor `weight_global_scale`); empty for every other format.
    pub further: Vec<TensorRef<'a>>,
}

impl ExpertMatrix<'_> {
    /// Stored bytes of the weight, scale, biases and further parts the kernels read.
    pub fn bytes(&self) -> u64 {
        [Some(self.weight), self.scale, self.biases]
            .iter()
            .flatten()
            .chain(&self.further)
            .map(|t| t.bytes.len() as u64)
            .sum()
    }

    /// Bytes a run reads for this matrix when its residual stage is read with it: [`Self::bytes`]
    /// plus the residual stage's codes and scale ([`residual_of`]) where the checkpoint has one
    /// (`e8p2+e81`, `e8p2+e8p2`). keep-runtime's expert store reads exactly these tensors per
    /// expert (checked by keep-cli's tests), and `keep residency --model` prices them.
    pub fn read_bytes(&self, ck: &Checkpoint) -> u64 {
        self.bytes()
            + residual_of(ck, self.weight.name).map_or(0, |(r, s)| {
                r.bytes.len() as u64 + s.map_or(0, |s| s.bytes.len() as u64)
            })
    }
}

/// Slice `e` of a tensor whose first axis stacks `n` experts (`[n, ...]`): a tensor of shape
/// `shape[1..]` over the `e`-th `1/n` of the bytes, at its own file offset (views only).
pub fn expert_slice(t: TensorRef<'_>, e: usize, n: usize) -> Result<TensorRef<'_>, String> {
    let stacked = t.shape.first().copied() == Some(n as u64) && t.shape.len() >= 2;
    if !stacked || e >= n || !t.bytes.len().is_multiple_of(n) {
        return Err(format!(
            "tensor `{}` has shape {:?}; stacked experts are [num_experts = {n}, rows, columns]",
            t.name, t.shape
        ));
    }
    let per = t.bytes.len() / n;
    Ok(TensorRef {
        name: t.name,
        dtype: t.dtype,
        shape: &t.shape[1..],
        bytes: &t.bytes[e * per..(e + 1) * per],
        shard: t.shard,
        file_offset: t.file_offset + (e * per) as u64,
    })
}

/// Matrix `mat` of routed expert `expert` of `layer`, wherever the checkpoint keeps it:
/// DeepSeek's `layers.L.ffn.experts.E.wN`, Hugging Face's Qwen3-MoE `mlp.experts.E.*_proj`, or
/// the `E`-th slice of mlx-lm's stacked `mlp.switch_mlp.*_proj` (weight, `.scales` and
/// `.biases` sliced alike), or a family's slices of its MXFP4 stacks (`W1` the interleaved
/// gate-up matrix, no `W3`), as the family answers ([`crate::family::Family::expert_matrix`]).
/// Names and shapes only; the layout is checked by the caller.
pub fn expert_matrix<'a>(
    ck: &'a Checkpoint,
    cfg: &DeepSeekConfig,
    layer: usize,
    expert: usize,
    mat: naming::ExpertMat,
) -> Result<ExpertMatrix<'a>, String> {
    cfg.family().expert_matrix(ck, cfg, layer, expert, mat)
}

/// The `expert`-th of `n` slices of mlx-lm's stacked `stacked` weight, with its `.scales` and
/// `.biases` sliced alike (`None`: the checkpoint has no such stack).
pub(crate) fn stacked_expert_matrix<'a>(
    ck: &'a Checkpoint,
    stacked: &str,
    expert: usize,
    n: usize,
) -> Result<Option<ExpertMatrix<'a>>, String> {
    let Some(w) = ck.get(stacked) else {
        return Ok(None);
    };
    let part = |t: Option<TensorRef<'a>>| t.map(|t| expert_slice(t, expert, n)).transpose();
    Ok(Some(ExpertMatrix {
        weight: expert_slice(w, expert, n)?,
        scale: part(scale_of(ck, stacked))?,
        biases: part(biases_of(ck, stacked))?,
        further: vec![],
    }))
}

/// An expert matrix stored under its own name (`name` its `.weight`, or a registered format's
/// main part of the same base), with its scale and biases.
pub(crate) fn named_expert_matrix<'a>(
    ck: &'a Checkpoint,
    name: &str,
) -> Result<ExpertMatrix<'a>, String> {
    let w =
        registered::main_tensor(ck, name).ok_or_else(|| format!("tensor `{name}` is missing"))?;
    Ok(ExpertMatrix {
        weight: w,
        scale: scale_of(ck, w.name),
        biases: biases_of(ck, w.name),
        further: registered::further_parts(ck, &w),
    })
}

/// [`expert_matrix`], classified as a `[rows, cols]` matrix keep computes with (an MLX affine
/// one with biases matching its scales).
pub fn expert_matrix_as<'a>(
    m: &ExpertMatrix<'a>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightLayout<'a>, String> {
    let l = classify_as(m.weight, m.scale, rows, cols, block_hint)
        .map_err(|e| format!("tensor `{}`: {e}", m.weight.name))?;
    match (l.layout, m.biases) {
        (Layout::MlxAffine { .. }, b) => {
            check_biases(l.scale, b).map_err(|e| format!("tensor `{}`: {e}", m.weight.name))?
        }
        (other, Some(b)) => {
            return Err(format!(
                "tensor `{}`: biases belong to MLX affine weights, `{}` is {}",
                b.name,
                m.weight.name,
                other.label()
            ))
        }
        (_, None) => {}
    }
    Ok(l)
}

/// A vector the model reads whole: present, F32 or BF16, `len` values.
pub(crate) fn vector_problem(ck: &Checkpoint, name: &str, len: usize) -> Option<String> {
    match ck.get(name) {
        None => Some(format!("tensor `{name}` is missing")),
        Some(t) if !matches!(t.dtype, Dtype::F32 | Dtype::BF16) => Some(format!(
            "tensor `{name}` has dtype {}, expected F32 or BF16",
            t.dtype
        )),
        Some(t) if t.numel() != len as u64 => Some(format!(
            "tensor `{name}` has shape {:?}, expected {len} values",
            t.shape
        )),
        Some(_) => None,
    }
}

/// A hyper-connection mix (`{prefix}fn` `[mix·hc, hc·dim]` unscaled, `{prefix}base` `[mix·hc]`,
/// `{prefix}scale` `[scales]`).
fn hc_problems(
    ck: &Checkpoint,
    cfg: &DeepSeekConfig,
    prefix: &str,
    mix: usize,
    scales: usize,
    out: &mut Vec<String>,
) {
    let hc = cfg.hc_mult;
    let name = format!("{prefix}fn");
    match ck.get(&name) {
        None => out.push(format!("tensor `{name}` is missing")),
        Some(t) => {
            if let Err(e) = classify_as(t, None, mix * hc, hc * cfg.hidden_size, None) {
                out.push(format!("tensor `{name}`: {e}"));
            }
        }
    }
    out.extend(vector_problem(ck, &format!("{prefix}base"), mix * hc));
    out.extend(vector_problem(ck, &format!("{prefix}scale"), scales));
}

/// Most problems [`model_problems`] lists (the first ones say what is wrong; the rest repeat).
pub const MAX_PROBLEMS: usize = 64;

/// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read: the
/// embedding, head and final norm, and in every decoder layer the router (weight, bias or
/// `tid2eid` table), the routed experts (as many as the layer's count,
/// [`DeepSeekConfig::experts_in_layer`], each matrix in a
/// layout keep computes with and of the config's shape), the shared expert, the attention
/// projections and the norms. Only names, dtypes and shapes are read. `keep inspect` reports
/// these and the model's loader refuses a checkpoint that has any, so the two always agree.
pub fn model_problems(ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
    cfg.family().model_problems(ck, cfg)
}

/// DeepSeek V4 / V4.1's part of [`model_problems`].
pub(crate) fn deepseek_v4_problems(ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
    let mut out = vec![];
    let hint = cfg.weight_block_size();
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let mat = |out: &mut Vec<String>, base: &str, r: usize, c: usize| {
        if let Err(e) = weight_as(ck, base, r, c, hint) {
            out.push(e);
        }
    };
    mat(&mut out, "embed", v, d);
    mat(&mut out, "head", v, d);
    let vector = |out: &mut Vec<String>, name: &str, len: usize| {
        out.extend(vector_problem(ck, name, len));
    };
    vector(&mut out, "norm.weight", d);
    if cfg.model_type == "deepseek_v4" {
        hc_problems(ck, cfg, "hc_head_", 1, 1, &mut out);
    }
    let (h, hd, i) = (
        cfg.num_attention_heads,
        cfg.head_dim,
        cfg.moe_intermediate_size,
    );
    let (ql, og, ol) = (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank);
    let v4 = cfg.model_type == "deepseek_v4";
    for l in 0..cfg.num_hidden_layers {
        if out.len() >= MAX_PROBLEMS {
            break;
        }
        let p = format!("layers.{l}.");
        let e = cfg.experts_in_layer(l);
        for (n, len) in [
            ("attn_norm.weight", d),
            ("ffn_norm.weight", d),
            ("attn.q_norm.weight", ql),
            ("attn.kv_norm.weight", hd),
            ("attn.attn_sink", h),
        ] {
            vector(&mut out, &format!("{p}{n}"), len);
        }
        for k in ["attn", "ffn"] {
            hc_problems(
                ck,
                cfg,
                &format!("{p}hc_{k}_"),
                2 + cfg.hc_mult,
                3,
                &mut out,
            );
        }
        for (n, r, c) in [
            ("attn.wq_a", ql, d),
            ("attn.wq_b", h * hd, ql),
            ("attn.wkv", hd, d),
            ("attn.wo_a", og * ol, (h * hd).checked_div(og).unwrap_or(0)),
            ("attn.wo_b", d, og * ol),
            ("ffn.gate", e, d),
            ("ffn.shared_experts.w1", i, d),
            ("ffn.shared_experts.w2", d, i),
            ("ffn.shared_experts.w3", i, d),
        ] {
            mat(&mut out, &format!("{p}{n}"), r, c);
        }
        let tid = format!("{p}ffn.gate.tid2eid");
        if v4 && l < cfg.num_hash_layers {
            match ck.get(&tid) {
                None => out.push(format!(
                    "tensor `{tid}` is missing (layer {l} is hash-routed: num_hash_layers = {})",
                    cfg.num_hash_layers
                )),
                Some(t) if t.shape != [v as u64, cfg.num_experts_per_tok as u64] => {
                    out.push(format!(
                        "tensor `{tid}` has shape {:?}, expected [vocab_size {v}, num_experts_per_tok {}]",
                        t.shape, cfg.num_experts_per_tok
                    ))
                }
                Some(t) if !matches!(t.dtype, Dtype::I32 | Dtype::I64) => out.push(format!(
                    "tensor `{tid}` has dtype {}, expected I32 or I64",
                    t.dtype
                )),
                Some(_) => {}
            }
        } else {
            if ck.contains(&tid) {
                out.push(format!(
                    "tensor `{tid}` makes layer {l} hash-routed but the config makes only layers 0..{} hash-routed{}",
                    if v4 { cfg.num_hash_layers } else { 0 },
                    if v4 { "" } else { " (hash routing is model_type deepseek_v4's)" }
                ));
            }
            vector(&mut out, &format!("{p}ffn.gate.bias"), e);
        }
        let present = (0..e)
            .take_while(|x| ck.contains(&format!("{p}ffn.experts.{x}.w1.weight")))
            .count();
        if present < e {
            let key = if cfg.n_routed_experts_per_layer.is_some() {
                format!("n_routed_experts_per_layer[{l}]")
            } else {
                "n_routed_experts".to_string()
            };
            out.push(format!(
                "layer {l} has routed experts 0..{present} but config.json declares {key} = {e} \
                 (`{p}ffn.experts.{present}.w1.weight` is missing)"
            ));
            continue;
        }
        for x in 0..e {
            let before = out.len();
            for (m, r, c) in [("w1", i, d), ("w2", d, i), ("w3", i, d)] {
                mat(&mut out, &format!("{p}ffn.experts.{x}.{m}"), r, c);
            }
            if out.len() > before {
                // One bad expert says what is wrong; the others are usually the same.
                break;
            }
        }
    }
    out.truncate(MAX_PROBLEMS);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t<'a>(name: &'a str, dtype: Dtype, shape: &'a [u64], bytes: &'a [u8]) -> TensorRef<'a> {
        TensorRef {
            name,
            dtype,
            shape,
            bytes,
            shard: 0,
            file_offset: 0,
        }
    }

    #[test]
    fn layouts_from_dtype_and_scale_shape() {
        let b = [0u8; 0];
        let w = t("a.weight", Dtype::F8_E4M3, &[64, 256], &b);
        type Case<'a> = (TensorRef<'a>, Option<(usize, usize)>, Layout);
        let cases: Vec<Case> = vec![
            (
                t("a.scale", Dtype::F8_E8M0, &[64, 8], &b),
                None,
                Layout::Fp8Block {
                    block: (1, 32),
                    scale: ScaleDtype::E8m0,
                },
            ),
            (
                t("a.scale", Dtype::F8_E8M0, &[1, 2], &b),
                None,
                Layout::Fp8Block {
                    block: (128, 128),
                    scale: ScaleDtype::E8m0,
                },
            ),
            (
                t("a.scale", Dtype::F32, &[2, 8], &b),
                None,
                Layout::Fp8Block {
                    block: (32, 32),
                    scale: ScaleDtype::F32,
                },
            ),
            // The config's block size wins when it fits.
            (
                t("a.scale", Dtype::F8_E8M0, &[4, 16], &b),
                Some((16, 16)),
                Layout::Fp8Block {
                    block: (16, 16),
                    scale: ScaleDtype::E8m0,
                },
            ),
        ];
        for (s, hint, want) in cases {
            let l = classify(w, Some(s), hint).unwrap();
            assert_eq!(l.layout, want, "{:?}", s.shape);
            assert_eq!((l.rows, l.cols), (64, 256));
        }
        let fp4 = t("e.weight", Dtype::I8, &[8, 32], &b);
        let s4 = t("e.scale", Dtype::F8_E8M0, &[8, 2], &b);
        let l = classify(fp4, Some(s4), None).unwrap();
        assert_eq!((l.layout, l.rows, l.cols), (Layout::Mxfp4, 8, 64));
        let plain = t("n.weight", Dtype::BF16, &[4, 4], &b);
        assert_eq!(
            classify(plain, None, None).unwrap().layout,
            Layout::Plain(Dtype::BF16)
        );
    }

    #[test]
    fn mlx_affine_widths_from_the_two_shapes() {
        let b = [0u8; 0];
        for (bits, words) in [(2u64, 16u64), (3, 24), (4, 32), (8, 64)] {
            let shape = [8, words];
            let w = t("m.weight", Dtype::U32, &shape, &b);
            let s = t("m.scales", Dtype::BF16, &[8, 4], &b);
            let l = classify(w, Some(s), None).unwrap();
            assert_eq!(
                (l.layout, l.rows, l.cols),
                (Layout::MlxAffine { bits: bits as u32 }, 8, 256)
            );
            assert!(classify_as(w, Some(s), 8, 256, None).is_ok());
        }
        // 5 bits, F16 scales, a row count that differs: refused with the reason.
        let w = t("m.weight", Dtype::U32, &[8, 40], &b);
        let s = t("m.scales", Dtype::BF16, &[8, 4], &b);
        assert!(classify(w, Some(s), None)
            .unwrap_err()
            .contains("2, 3, 4 or 8"));
        let w = t("m.weight", Dtype::U32, &[8, 32], &b);
        let s = t("m.scales", Dtype::F16, &[8, 4], &b);
        assert!(classify(w, Some(s), None).is_err());
        let s = t("m.scales", Dtype::BF16, &[4, 4], &b);
        assert!(classify(w, Some(s), None).is_err());
        // Biases must match the scales.
        let s = t("m.scales", Dtype::BF16, &[8, 4], &b);
        assert!(check_biases(Some(s), Some(t("m.biases", Dtype::BF16, &[8, 4], &b))).is_ok());
        assert!(check_biases(Some(s), Some(t("m.biases", Dtype::F32, &[8, 4], &b))).is_err());
        assert!(check_biases(Some(s), None).unwrap_err().contains("biases"));
    }

    #[test]
    fn unreadable_layouts_are_refused_with_the_reason() {
        let b = [0u8; 0];
        let w = t("a.weight", Dtype::F8_E4M3, &[64, 256], &b);
        for (s, why) in [
            (t("a.scale", Dtype::U8, &[64, 8], &b), "U8"),
            (t("a.scale", Dtype::F16, &[64, 8], &b), "F16"),
            (t("a.scale", Dtype::F8_E8M0, &[3, 5], &b), "3x5 scale grid"),
            (t("a.scale", Dtype::F8_E8M0, &[512], &b), "not [rows"),
        ] {
            let e = classify(w, Some(s), None).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        assert!(classify(w, None, None)
            .unwrap_err()
            .contains("without a scale"));
        let fp4 = t("e.weight", Dtype::I8, &[8, 32], &b);
        let e = classify(fp4, Some(t("e.scale", Dtype::F32, &[8, 2], &b)), None).unwrap_err();
        assert!(e.contains("F8_E8M0"), "{e}");
        let e = classify(fp4, Some(t("e.scale", Dtype::F8_E8M0, &[8, 4], &b)), None).unwrap_err();
        assert!(e.contains("[8, 2]"), "{e}");
        let u4 = t("e.weight", Dtype::U8, &[8, 32], &b);
        let s4 = t("e.scale", Dtype::F8_E8M0, &[8, 2], &b);
        assert!(classify(u4, Some(s4), None).unwrap_err().contains("I8"));
        // A plain F16 matrix is a layout, but not one the model multiplies by.
        let f16 = t("h.weight", Dtype::F16, &[4, 4], &b);
        assert!(classify(f16, None, None).is_ok());
        let e = classify_as(f16, None, 4, 4, None).unwrap_err();
        assert!(e.contains("F16"), "{e}");
        let e = classify_as(fp4, Some(s4), 8, 32, None).unwrap_err();
        assert!(e.contains("expected [8, 32]"), "{e}");
    }
}
