//! `keep-quant`: lattice quantization of routed experts.
//!
//! What it is: nearest-codeword searches for QuIP#'s E8P12 (2 bits per weight) and E81B
//! (1 bit per weight) codebooks, structured and exact, tested against exhaustive search
//! ([`lattice`]); imatrix-weighted fitting of one matrix with per-row scales and a nested
//! residual stage, with the weighted reconstruction error of every rung ([`fit`]); and the
//! quantized checkpoint `keep quant` writes ([`checkpoint`]); the precision-tier allocation
//! `keep alloc` solves, a multiple-choice knapsack over bytes ([`alloc`]). What it is not: the decoders
//! (keep-format's `e8p`, `e81`), the products (keep-kernels), flags or printing (keep-cli).
//! Depends on keep-format, keep-checkpoint, keep-kernels, keep-artifacts, rayon, serde.

pub mod alloc;
pub mod checkpoint;
pub mod error;
pub mod fit;
pub mod incoherence;
pub mod lattice;
pub mod mlx;

pub use error::{QuantError, Result};
pub use fit::{fit_matrix, FittedMatrix, QuantFormat, RungErrors};
