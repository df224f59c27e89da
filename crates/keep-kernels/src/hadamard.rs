//! Randomized Hadamard transforms (incoherence processing, as QuIP# does it): a fast
//! Walsh–Hadamard transform and a seeded random-sign transform `V = H·S` built on it.
//!
//! What it is: [`fwht`], the normalised Walsh–Hadamard transform of a power-of-two vector in
//! place (`n log n` butterflies, then `1/√n`), with [`fwht_ref`], the explicit Sylvester
//! matrix product `H_ij = (−1)^popcount(i & j) / √n` in f64, as its reference; [`Rht`], the
//! orthogonal transform `V = H_B·S` of a size-`n` vector, where `S` is a diagonal of ±1 drawn
//! from a stored seed (keep-rng's Xoshiro256++ stream, one bit per coordinate) and `H_B` is
//! block-diagonal with normalised Hadamard blocks of `B` = the largest power of two dividing
//! `n` ([`hadamard_block`]; `B = n` when `n` is a power of two, as every DeepSeek and Qwen
//! expert width is). `V` is orthogonal, so `Vᵀ = S·H_B` undoes it ([`Rht::inverse`]). A weight
//! stored as `W̃ = V_out · W · V_inᵀ` is computed as `y = V_outᵀ · W̃ · (V_in · x)`: `forward`
//! on the activation rows, the product, `inverse` on the output rows.
//!
//! Each row is transformed by the same instruction sequence whatever the number of rows, so a
//! decode step equals the same row of a prefill bit for bit. What it is not: the choice of
//! which weights carry a transform (the checkpoint's `keep_quantization` entry) or the product.

use crate::{KernelError, Result};

/// The Hadamard block of a transform of size `n`: the largest power of two dividing `n`
/// (`n` itself for a power of two; 1, a sign flip only, for odd `n`; 0 for `n = 0`).
pub fn hadamard_block(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        1 << n.trailing_zeros()
    }
}

/// Normalised Walsh–Hadamard transform of `x` in place (`x.len()` a power of two; other
/// lengths are left unchanged). `H` is symmetric and orthogonal, so applying it twice gives
/// `x` back (up to rounding).
pub fn fwht(x: &mut [f32]) {
    let n = x.len();
    if n < 2 || !n.is_power_of_two() {
        return;
    }
    let mut h = 1;
    while h < n {
        for base in (0..n).step_by(2 * h) {
            let (lo, hi) = x[base..base + 2 * h].split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// Reference for [`fwht`]: the explicit product with the Sylvester matrix in f64.
pub fn fwht_ref(x: &[f64]) -> Vec<f64> {
    let n = x.len();
    let s = 1.0 / (n as f64).sqrt();
    (0..n)
        .map(|i| {
            (0..n)
                .map(|j| {
                    let sign = if (i & j).count_ones() % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    };
                    sign * x[j]
                })
                .sum::<f64>()
                * s
        })
        .collect()
}

/// A seeded random-sign Hadamard transform `V = H_B·S` of size `n` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rht {
    /// Vector size.
    pub n: usize,
    /// Hadamard block (a power of two dividing `n`).
    pub block: usize,
    /// Seed of the sign diagonal.
    pub seed: u64,
}

impl Rht {
    /// The transform of size `n` with Hadamard blocks of `block` (a power of two dividing `n`).
    pub fn new(n: usize, block: usize, seed: u64) -> Result<Rht> {
        if n == 0 || block == 0 || !block.is_power_of_two() || !n.is_multiple_of(block) {
            return Err(KernelError::Shape {
                what: "Hadamard transform",
                msg: format!("block {block} is not a power of two dividing the size {n}"),
            });
        }
        Ok(Rht { n, block, seed })
    }

    /// The transform of size `n` over the largest power-of-two block ([`hadamard_block`]).
    pub fn for_size(n: usize, seed: u64) -> Result<Rht> {
        Rht::new(n, hadamard_block(n), seed)
    }

    /// The sign diagonal `S` (±1): bit `j % 64` of the `j / 64`-th word of its seed's
    /// Xoshiro256++ stream, set meaning −1.
    pub fn signs(&self) -> Vec<f32> {
        use keep_rng::RngCore;
        let mut r = keep_rng::rng(self.seed);
        let words: Vec<u64> = (0..self.n.div_ceil(64)).map(|_| r.next_u64()).collect();
        (0..self.n)
            .map(|j| {
                if words[j / 64] >> (j % 64) & 1 == 1 {
                    -1.0
                } else {
                    1.0
                }
            })
            .collect()
    }

    fn check(&self, len: usize) -> Result<()> {
        if self.n == 0 || !len.is_multiple_of(self.n) {
            return Err(KernelError::Operand {
                what: "rows of the Hadamard transform",
                expected: len.div_ceil(self.n.max(1)) * self.n,
                got: len,
            });
        }
        Ok(())
    }

    /// `x ← V·x` for every row of `x` (`x.len()` a multiple of `n`): signs, then the blocks.
    pub fn forward(&self, x: &mut [f32]) -> Result<()> {
        self.check(x.len())?;
        let s = self.signs();
        for row in x.chunks_exact_mut(self.n) {
            for (v, &si) in row.iter_mut().zip(&s) {
                *v *= si;
            }
            for b in row.chunks_exact_mut(self.block) {
                fwht(b);
            }
        }
        Ok(())
    }

    /// `y ← Vᵀ·y = S·H_B·y` for every row of `y`: the blocks, then the signs.
    pub fn inverse(&self, y: &mut [f32]) -> Result<()> {
        self.check(y.len())?;
        let s = self.signs();
        for row in y.chunks_exact_mut(self.n) {
            for b in row.chunks_exact_mut(self.block) {
                fwht(b);
            }
            for (v, &si) in row.iter_mut().zip(&s) {
                *v *= si;
            }
        }
        Ok(())
    }

    /// Reference for [`Rht::forward`] on one vector: the explicit block matrices in f64.
    pub fn forward_ref(&self, x: &[f64]) -> Vec<f64> {
        let s = self.signs();
        let sx: Vec<f64> = x.iter().zip(&s).map(|(&v, &si)| v * si as f64).collect();
        sx.chunks(self.block).flat_map(fwht_ref).collect()
    }

    /// Reference for [`Rht::inverse`] on one vector.
    pub fn inverse_ref(&self, y: &[f64]) -> Vec<f64> {
        let s = self.signs();
        let hy: Vec<f64> = y.chunks(self.block).flat_map(fwht_ref).collect();
        hy.iter().zip(&s).map(|(&v, &si)| v * si as f64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::Rng;

    /// f32 butterflies against the f64 matrix: log₂(n) roundings of values of order 1.
    const FWHT_TOL: f64 = 1e-5;

    fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| r.f()).collect()
    }

    #[test]
    fn block_is_largest_power_of_two_divisor() {
        assert_eq!(hadamard_block(256), 256);
        assert_eq!(hadamard_block(96), 32);
        assert_eq!(hadamard_block(1536), 512);
        assert_eq!(hadamard_block(7), 1);
        assert_eq!(hadamard_block(0), 0);
    }

    #[test]
    fn fwht_matches_the_matrix() {
        for n in [1, 2, 4, 8, 64, 256] {
            let x = rand_vec(n as u64, n);
            let mut f = x.clone();
            fwht(&mut f);
            let r = fwht_ref(&x.iter().map(|&v| v as f64).collect::<Vec<_>>());
            for (a, b) in f.iter().zip(&r) {
                assert!((*a as f64 - b).abs() < FWHT_TOL, "n={n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn the_matrix_is_orthogonal() {
        for n in [1, 2, 8, 32] {
            let cols: Vec<Vec<f64>> = (0..n)
                .map(|j| fwht_ref(&(0..n).map(|i| (i == j) as u8 as f64).collect::<Vec<_>>()))
                .collect();
            for a in 0..n {
                for b in 0..n {
                    let d: f64 = (0..n).map(|i| cols[a][i] * cols[b][i]).sum();
                    let want = (a == b) as u8 as f64;
                    assert!((d - want).abs() < 1e-12, "n={n} ({a},{b}): {d}");
                }
            }
        }
    }

    #[test]
    fn random_transform_is_orthogonal_on_odd_sizes() {
        for (n, seed) in [(96, 1u64), (24, 2), (7, 3), (256, 4), (1, 5)] {
            let t = Rht::for_size(n, seed).unwrap();
            // columns of V: V·e_j; their Gram matrix is the identity
            let cols: Vec<Vec<f64>> = (0..n)
                .map(|j| t.forward_ref(&(0..n).map(|i| (i == j) as u8 as f64).collect::<Vec<_>>()))
                .collect();
            for a in 0..n {
                for b in 0..n {
                    let d: f64 = (0..n).map(|i| cols[a][i] * cols[b][i]).sum();
                    assert!((d - (a == b) as u8 as f64).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn forward_and_inverse_match_reference_and_round_trip() {
        for (n, m) in [(256usize, 3usize), (96, 5), (24, 1), (7, 2), (128, 33)] {
            let t = Rht::for_size(n, 0xC0FFEE ^ n as u64).unwrap();
            let x = rand_vec(n as u64 + 10, n * m);
            let mut f = x.clone();
            t.forward(&mut f).unwrap();
            for r in 0..m {
                let xr: Vec<f64> = x[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect();
                let want = t.forward_ref(&xr);
                for (a, b) in f[r * n..(r + 1) * n].iter().zip(&want) {
                    assert!((*a as f64 - b).abs() < FWHT_TOL);
                }
                let back = t.inverse_ref(&want);
                for (a, b) in back.iter().zip(&xr) {
                    assert!((a - b).abs() < 1e-12);
                }
            }
            let mut g = f.clone();
            t.inverse(&mut g).unwrap();
            for (a, b) in g.iter().zip(&x) {
                assert!((a - b).abs() < 1e-5, "n={n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rows_are_independent_of_how_many() {
        // decode equals prefill: row r of an M-row call equals that row alone, bit for bit
        let t = Rht::for_size(192, 9).unwrap();
        let x = rand_vec(77, 192 * 4);
        let mut all = x.clone();
        t.forward(&mut all).unwrap();
        for r in 0..4 {
            let mut one = x[r * 192..(r + 1) * 192].to_vec();
            t.forward(&mut one).unwrap();
            assert_eq!(one, all[r * 192..(r + 1) * 192]);
        }
    }

    #[test]
    fn signs_are_seeded_and_balanced() {
        let a = Rht::for_size(4096, 1).unwrap().signs();
        let b = Rht::for_size(4096, 1).unwrap().signs();
        let c = Rht::for_size(4096, 2).unwrap().signs();
        assert_eq!(a, b);
        assert_ne!(a, c);
        let neg = a.iter().filter(|&&s| s < 0.0).count();
        assert!((1800..2300).contains(&neg), "{neg} of 4096 negative");
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(Rht::new(96, 64, 0).is_err());
        assert!(Rht::new(96, 3, 0).is_err());
        assert!(Rht::new(0, 1, 0).is_err());
        let t = Rht::for_size(8, 0).unwrap();
        assert!(t.forward(&mut [0.0; 12]).is_err());
        assert!(t.inverse(&mut [0.0; 7]).is_err());
    }
}
