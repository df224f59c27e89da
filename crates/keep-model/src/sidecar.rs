//! Reduced-rank sidecars of a pruned MoE block (written by `keep sidecar`): per layer a low-rank
//! linear map from the MoE block's input `x` (the normed, collapsed hidden state the router and
//! experts read) to an estimate of what the removed experts contributed, added to the block's
//! output: `out += (x · Aᵀ) · Bᵀ`.
//!
//! In a checkpoint a layer's sidecar is two tensors in the `[out, in]` layout of every linear
//! weight (PEFT's LoRA layout): `layers.{L}.ffn.sidecar.a.weight` `[rank × hidden]` and
//! `layers.{L}.ffn.sidecar.b.weight` `[hidden × rank]`, F32 or BF16; a layer without them has no
//! sidecar and runs exactly as it does in a checkpoint without any. The weights are held
//! decoded to f32 (2 · rank · hidden numbers per layer) and multiplied on the exact kernels.

use keep_checkpoint::{Checkpoint, Dtype};
use keep_kernels::{matmul, WeightView};

use crate::{ModelError, Result};

/// The tensor names of the sidecar of the block stored under `prefix` (`"layers.3."`).
pub fn tensor_names(prefix: &str) -> [String; 2] {
    [
        format!("{prefix}ffn.sidecar.a.weight"),
        format!("{prefix}ffn.sidecar.b.weight"),
    ]
}

/// One layer's sidecar: `A` `[rank × hidden]` and `B` `[hidden × rank]` as little-endian f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Sidecar {
    pub rank: usize,
    pub hidden: usize,
    a: Vec<u8>,
    b: Vec<u8>,
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Sidecar {
    /// A sidecar from `a` (`[rank × hidden]`, row-major) and `b` (`[hidden × rank]`).
    pub fn new(hidden: usize, rank: usize, a: &[f32], b: &[f32]) -> Result<Sidecar> {
        if rank == 0 || a.len() != rank * hidden || b.len() != rank * hidden {
            return Err(ModelError::Config(format!(
                "a sidecar of rank {rank} over hidden size {hidden} needs A [{rank} × {hidden}] \
                 and B [{hidden} × {rank}] (rank ≥ 1); got {} and {} numbers",
                a.len(),
                b.len()
            )));
        }
        if a.iter().chain(b).any(|v| !v.is_finite()) {
            return Err(ModelError::Config(
                "a sidecar holds a non-finite number".into(),
            ));
        }
        Ok(Sidecar {
            rank,
            hidden,
            a: le_bytes(a),
            b: le_bytes(b),
        })
    }

    /// The sidecar stored under `prefix`, or `None` when the checkpoint has none there. Both
    /// tensors or neither; shapes `[rank × hidden]` and `[hidden × rank]`; F32 or BF16.
    pub fn load(ck: &Checkpoint, prefix: &str, hidden: usize) -> Result<Option<Sidecar>> {
        let [na, nb] = tensor_names(prefix);
        let (ta, tb) = match (ck.get(&na), ck.get(&nb)) {
            (None, None) => return Ok(None),
            (Some(a), Some(b)) => (a, b),
            (a, _) => {
                let missing = if a.is_none() { &na } else { &nb };
                return Err(ModelError::Missing(format!(
                    "{missing} (a sidecar needs both {na} and {nb}; rewrite it with keep sidecar)"
                )));
            }
        };
        let rank = ta.shape.first().copied().unwrap_or(0) as usize;
        let shape_err = |name: &str, want: [usize; 2], got: &[u64]| {
            ModelError::Config(format!(
                "sidecar tensor {name}: shape {got:?}, expected {want:?} (hidden size {hidden})"
            ))
        };
        if ta.shape.len() != 2 || ta.shape[1] as usize != hidden || rank == 0 {
            return Err(shape_err(&na, [rank.max(1), hidden], ta.shape));
        }
        if tb.shape != [hidden as u64, rank as u64] {
            return Err(shape_err(&nb, [hidden, rank], tb.shape));
        }
        let decode = |name: &str, t: keep_checkpoint::TensorRef| -> Result<Vec<f32>> {
            let n = t.numel() as usize;
            match t.dtype {
                Dtype::F32 => Ok((0..n)
                    .map(|i| keep_kernels::codec::f32_at(t.bytes, i))
                    .collect()),
                Dtype::BF16 => Ok((0..n)
                    .map(|i| keep_kernels::codec::bf16_at(t.bytes, i))
                    .collect()),
                d => Err(ModelError::Config(format!(
                    "sidecar tensor {name}: dtype {d}, expected F32 or BF16"
                ))),
            }
        };
        let (a, b) = (decode(&na, ta)?, decode(&nb, tb)?);
        Sidecar::new(hidden, rank, &a, &b)
            .map(Some)
            .map_err(|e| ModelError::Config(format!("{na}, {nb}: {e}")))
    }

    /// `A` `[rank × hidden]`, row-major.
    pub fn a(&self) -> Vec<f32> {
        f32s(&self.a)
    }

    /// `B` `[hidden × rank]`, row-major.
    pub fn b(&self) -> Vec<f32> {
        f32s(&self.b)
    }

    /// Numbers held (2 · rank · hidden).
    pub fn numel(&self) -> usize {
        2 * self.rank * self.hidden
    }

    /// `out[t × hidden] += (x · Aᵀ) · Bᵀ` for the `t` rows of `x` `[t × hidden]`.
    pub fn add_to(&self, x: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let (r, d) = (self.rank, self.hidden);
        let a = WeightView::f32(&self.a, r, d)?;
        let b = WeightView::f32(&self.b, d, r)?;
        let mut z = vec![0f32; t * r];
        matmul(x, t, &a, &mut z)?;
        let mut y = vec![0f32; t * d];
        matmul(&z, t, &b, &mut y)?;
        for (o, v) in out.iter_mut().zip(&y) {
            *o += v;
        }
        Ok(())
    }
}
