//! keep-kernels: the arithmetic of keep's model, straight from packed weight bytes.
//!
//! What it is: a [`WeightView`] over a weight in its shipped format (f32, bf16, FP8 E4M3 with
//! block scales, MXFP8, MXFP4) and `matmul` (`out[M×rows] = x[M×cols] · Wᵀ`) reading the packed
//! bytes directly, plus the small vector operations DeepSeek-V4.1 needs (RMSNorm, softmax,
//! sigmoid/SiLU/softplus, sinkhorn, interleaved RoPE, FP8/FP4 fake quantization). Every fast
//! path has a plain scalar `_ref` beside it, and the tests hold the two against each other on odd
//! shapes. The fast paths decode one weight row at a time and dot it against all M input rows,
//! with a runtime-selected AVX2+FMA dot where the CPU has it, and thread over output rows (rayon)
//! only when the work is big enough to pay for it. Every (input row, output row) dot product is
//! computed by the same instruction sequence whatever M is and however rows are split over
//! threads, so a decode step (M = 1) gives bit-identical results to the same row inside a
//! prefill (M = T).
//!
//! Beside these exact kernels, [`intdot`] and [`bf16dot`] hold the fast ones (int8 activation
//! blocks times integer weights with exact i32 sums; bf16-rounded activations times bf16 /
//! E4M3 weights through AVX-512 BF16), chosen per call with [`Kernels`].
//!
//! What it is not: no I/O, no tensor naming, no model logic, no printing. The element decode
//! tables are keep-format's ([`codec`] re-exports them); [`cpu`] (CPU features and operand
//! checks) and `rows` (the row-threading helpers) are the leaf modules every kernel shares, and
//! [`matmul`] is the dispatch on top of the kernels.
//!
//! [`profile`] is the forward profiler every family's forward and the kernels' parallel
//! regions report to (`keep run --profile`): exclusive time, bytes read and thread waits per
//! part of each forward pass, one relaxed atomic load per entry point when off.
//!
//! Buffers are kept between calls so that a warm decode step allocates nothing: the batched
//! kernels' bookkeeping (job lists, output pointers, row tasks, prepared inputs) lives in
//! per-thread buffers, and [`scratch::recycle`] keeps a buffer of borrowed views across calls.
//!
//! [`hadamard`] holds the fast Walsh–Hadamard transform and seeded random-sign transforms
//! that undo incoherence processing on the activations.
//!
//! Depends on: `keep-format` (element tables, E8P decode), `keep-rng` (the sign diagonals of
//! [`hadamard::Rht`]), `rayon`, `thiserror`.

pub mod affine;
pub mod attend;
pub mod bf16dot;
pub mod codec;
pub mod cpu;
pub mod e8p;
pub mod error;
pub mod hadamard;
pub mod intdot;
pub mod matmul;
pub mod ops;
pub mod profile;
pub mod registered;
pub(crate) mod rows;
pub mod scratch;
pub mod simd;
pub mod sinkhorn_fused;
#[cfg(test)]
mod test_rng;
pub mod weight;

pub use error::KernelError;
pub use intdot::ActLevels;
pub use matmul::{
    matmul, matmul_many_levels, matmul_many_with, matmul_ref, matmul_rows, matmul_with, Kernels,
};
pub use registered::RegView;
pub use weight::{BlockScales, E8pResidual, WeightKind, WeightView};

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, KernelError>;
