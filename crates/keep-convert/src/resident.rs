//! The scale kinds of FP8-block weights, on top of keep-checkpoint's one layout classification
//! ([`keep_checkpoint::layout`], re-exported here): a float32 scale grid is either all exact
//! powers of two (V4-Flash-Base; each has an E8M0 byte, so repack can rewrite it losslessly) or
//! V3-style `scale_inv` multipliers (repack refuses them). Telling the two apart reads the scale
//! values, which the checkpoint layer never does; everything else about how a weight is stored
//! is decided by the layout alone.

pub use keep_checkpoint::layout::{
    classify, classify_as, scale_of, Layout, ScaleDtype, WeightLayout,
};
use keep_format::e8m0::e8m0_from_pow2_f32;

/// The kind of an FP8 block scale, values included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScaleKind {
    /// E8M0 bytes (`F8_E8M0`).
    E8m0,
    /// float32 values that are all exact powers of two (V4-Flash-Base).
    F32Pow2,
    /// float32 multipliers that are not all powers of two (V3 `scale_inv`).
    F32ScaleInv,
    /// bfloat16 values that are all exact powers of two.
    Bf16Pow2,
    /// bfloat16 multipliers that are not all powers of two (Qwen's FP8 `weight_scale_inv`).
    Bf16ScaleInv,
}

impl ScaleKind {
    /// Report label.
    pub fn label(self) -> &'static str {
        match self {
            ScaleKind::E8m0 => "e8m0",
            ScaleKind::F32Pow2 => "f32-pow2",
            ScaleKind::F32ScaleInv => "f32-scale-inv",
            ScaleKind::Bf16Pow2 => "bf16-pow2",
            ScaleKind::Bf16ScaleInv => "bf16-scale-inv",
        }
    }
}

/// Whether every float32 scale is an exact power of two.
pub fn f32_scales_are_pow2(bytes: &[u8]) -> bool {
    bytes
        .chunks_exact(4)
        .all(|c| e8m0_from_pow2_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).is_some())
}

/// The scale kind of an FP8-block weight (`None` for other layouts).
pub fn scale_kind(l: &WeightLayout) -> Option<ScaleKind> {
    match (l.layout, l.scale) {
        (
            Layout::Fp8Block {
                scale: ScaleDtype::E8m0,
                ..
            },
            _,
        ) => Some(ScaleKind::E8m0),
        (
            Layout::Fp8Block {
                scale: ScaleDtype::F32,
                ..
            },
            Some(s),
        ) => Some(if f32_scales_are_pow2(s.bytes) {
            ScaleKind::F32Pow2
        } else {
            ScaleKind::F32ScaleInv
        }),
        (
            Layout::Fp8Block {
                scale: ScaleDtype::Bf16,
                ..
            },
            Some(s),
        ) => Some(if f32_scales_are_pow2(&bf16_scales_as_f32(s.bytes)) {
            ScaleKind::Bf16Pow2
        } else {
            ScaleKind::Bf16ScaleInv
        }),
        _ => None,
    }
}

/// bfloat16 scale bytes widened to float32 bytes (exact).
pub fn bf16_scales_as_f32(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(2)
        .flat_map(|c| [0, 0, c[0], c[1]])
        .collect()
}

/// Report label of a layout with its scale kind (`"fp8-block 128x128 f32-pow2"`, `"mxfp8"`).
pub fn label(l: &WeightLayout) -> String {
    match (l.layout, scale_kind(l)) {
        (Layout::Fp8Block { block, .. }, Some(k)) if !l.layout.is_mxfp8() => {
            format!("fp8-block {}x{} {}", block.0, block.1, k.label())
        }
        (layout, _) => layout.label(),
    }
}
