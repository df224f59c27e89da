//! How a weight is stored: element dtype, scale partner, block shape and scale kind.
//!
//! A weight's format is read from its dtype and its scale tensor's dtype and shape, never
//! assumed: FP8 E4M3 with a `[ceil(rows/br), ceil(cols/bc)]` scale grid is FP8-block (br×bc;
//! `1×32` is MXFP8), `I8 [rows, cols/2]` with an E8M0 `[rows, cols/32]` scale is FP4 (MXFP4),
//! and unscaled BF16/F16/F32 are plain. The config's `weight_block_size` breaks ties when a
//! scale grid fits several block shapes.

use keep_checkpoint::{naming, Checkpoint, Dtype, TensorRef};
use keep_format::e8m0::e8m0_from_pow2_f32;

/// The kind of an FP8 block scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScaleKind {
    /// E8M0 bytes (`F8_E8M0`, or `U8` holding E8M0).
    E8m0,
    /// float32 values that are all exact powers of two (V4-Flash-Base).
    F32Pow2,
    /// float32 multipliers that are not all powers of two (V3 `scale_inv`).
    F32ScaleInv,
}

impl ScaleKind {
    /// Report label.
    pub fn label(self) -> &'static str {
        match self {
            ScaleKind::E8m0 => "e8m0",
            ScaleKind::F32Pow2 => "f32-pow2",
            ScaleKind::F32ScaleInv => "f32-scale-inv",
        }
    }
}

/// A weight's storage format.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightFormat {
    /// Unscaled elements of this dtype.
    Plain(Dtype),
    /// FP8 E4M3 with one scale per `block.0 × block.1` block.
    Fp8Block {
        block: (usize, usize),
        scale: ScaleKind,
    },
    /// FP4 E2M1 two per byte with one E8M0 scale per row and 32 columns.
    Fp4,
    /// Something keep does not recognise (the reason says what).
    Unknown(String),
}

impl WeightFormat {
    /// Report label (`"fp8-block 32x32 e8m0"`, `"mxfp8"`, `"fp4"`, `"bf16"`).
    pub fn label(&self) -> String {
        match self {
            WeightFormat::Plain(d) => d.name().to_ascii_lowercase(),
            WeightFormat::Fp8Block {
                block: (1, 32),
                scale: ScaleKind::E8m0,
            } => "mxfp8".into(),
            WeightFormat::Fp8Block { block, scale } => {
                format!("fp8-block {}x{} {}", block.0, block.1, scale.label())
            }
            WeightFormat::Fp4 => "fp4 (mxfp4)".into(),
            WeightFormat::Unknown(r) => format!("unknown ({r})"),
        }
    }
}

/// A weight and its scale, classified.
#[derive(Debug, Clone)]
pub struct Classified<'a> {
    pub weight: TensorRef<'a>,
    pub scale: Option<TensorRef<'a>>,
    pub format: WeightFormat,
    /// Logical `[rows, cols]` of the weight (FP4 counts two elements per byte).
    pub logical: (usize, usize),
}

impl Classified<'_> {
    /// Logical number of weights.
    pub fn numel(&self) -> u64 {
        self.logical.0 as u64 * self.logical.1 as u64
    }
    /// Stored bytes including the scale.
    pub fn bytes(&self) -> u64 {
        self.weight.bytes.len() as u64 + self.scale.map_or(0, |s| s.bytes.len() as u64)
    }
}

/// Find the scale tensor of a weight, if any.
pub fn scale_of<'a>(ck: &'a Checkpoint, weight_name: &str) -> Option<TensorRef<'a>> {
    naming::scale_candidates(weight_name)
        .iter()
        .find_map(|n| ck.get(n))
}

fn infer_block(len: usize, grid: usize, preferred: Option<usize>) -> Option<usize> {
    if grid == 0 {
        return None;
    }
    if let Some(p) = preferred {
        if p > 0 && len.div_ceil(p) == grid {
            return Some(p);
        }
    }
    if grid == len {
        return Some(1);
    }
    for b in [32usize, 64, 128, 256] {
        if len.div_ceil(b) == grid {
            return Some(b);
        }
    }
    len.is_multiple_of(grid).then(|| len / grid)
}

/// Whether every float32 scale is an exact power of two.
pub fn f32_scales_are_pow2(bytes: &[u8]) -> bool {
    bytes
        .chunks_exact(4)
        .all(|c| e8m0_from_pow2_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).is_some())
}

/// Classify a 2-D weight (with the checkpoint's declared block size as a hint).
pub fn classify<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    block_hint: Option<(usize, usize)>,
) -> Classified<'a> {
    let dims: Vec<usize> = weight.shape.iter().map(|&d| d as usize).collect();
    let (rows, cols) = match dims.as_slice() {
        [r, c] => (*r, *c),
        [n] => (1, *n),
        _ => (dims.iter().product(), 1),
    };
    let unknown = |r: String, logical| Classified {
        weight,
        scale,
        format: WeightFormat::Unknown(r),
        logical,
    };
    let Some(s) = scale else {
        let format = match weight.dtype {
            Dtype::F8_E4M3 | Dtype::I8 => {
                return unknown(
                    format!("{} weight without a scale tensor", weight.dtype),
                    (rows, cols),
                )
            }
            d => WeightFormat::Plain(d),
        };
        return Classified {
            weight,
            scale,
            format,
            logical: (rows, cols),
        };
    };
    let sdims: Vec<usize> = s.shape.iter().map(|&d| d as usize).collect();
    let [sr, sc] = sdims.as_slice() else {
        return unknown(format!("scale has shape {sdims:?}"), (rows, cols));
    };
    let (sr, sc) = (*sr, *sc);
    match weight.dtype {
        Dtype::I8 | Dtype::U8 => {
            let logical = (rows, cols * 2);
            if !matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
                return unknown(format!("FP4 scale of dtype {}", s.dtype), logical);
            }
            if sr != rows || sc * 32 != cols * 2 {
                return unknown(
                    format!("FP4 weight {rows}x{} with scale {sr}x{sc}", cols * 2),
                    logical,
                );
            }
            Classified {
                weight,
                scale,
                format: WeightFormat::Fp4,
                logical,
            }
        }
        Dtype::F8_E4M3 => {
            let kind = match s.dtype {
                Dtype::F8_E8M0 | Dtype::U8 => ScaleKind::E8m0,
                Dtype::F32 if f32_scales_are_pow2(s.bytes) => ScaleKind::F32Pow2,
                Dtype::F32 => ScaleKind::F32ScaleInv,
                d => return unknown(format!("FP8 scale of dtype {d}"), (rows, cols)),
            };
            let (hr, hc) = match block_hint {
                Some((a, b)) => (Some(a), Some(b)),
                None => (None, None),
            };
            match (infer_block(rows, sr, hr), infer_block(cols, sc, hc)) {
                (Some(br), Some(bc)) => Classified {
                    weight,
                    scale,
                    format: WeightFormat::Fp8Block {
                        block: (br, bc),
                        scale: kind,
                    },
                    logical: (rows, cols),
                },
                _ => unknown(
                    format!("FP8 weight {rows}x{cols} with a {sr}x{sc} scale grid"),
                    (rows, cols),
                ),
            }
        }
        d => unknown(format!("{d} weight with a scale tensor"), (rows, cols)),
    }
}
