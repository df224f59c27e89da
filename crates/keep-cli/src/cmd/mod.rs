//! One module per verb; each exposes `XArgs` (clap) and `run(XArgs) -> anyhow::Result<()>`.

pub mod alloc;
pub mod bench;
pub mod calibrate;
pub mod chat_template;
pub mod eval;
pub mod finalize;
pub mod fit;
pub mod inspect;
pub mod logits;
pub mod pack;
pub mod prune;
pub mod quant;
pub mod repack;
pub mod residency;
pub mod run;
pub mod select;
pub mod serve;
pub mod sidecar;
pub mod synth;
pub mod tasks;
pub mod verify;

/// `--kernels exact|fast` (see `keep_model::Kernels`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelsArg {
    /// The exact f32 kernels (what `keep logits`, the fixtures and the conformance suite use).
    #[default]
    Exact,
    /// Integer dot products on int8-quantized activations where a format has them (MXFP4, E8P,
    /// MLX affine 4/8-bit, affine-8), bf16 dot products for MXFP8, FP8 blocks and bf16.
    Fast,
}

impl From<KernelsArg> for keep_model::Kernels {
    fn from(k: KernelsArg) -> Self {
        match k {
            KernelsArg::Exact => keep_model::Kernels::Exact,
            KernelsArg::Fast => keep_model::Kernels::Fast,
        }
    }
}
