//! The vector operations of DeepSeek-V4.1, in f32, written to follow mlx-lm's
//! `deepseek_v41.py` (and MLX's CPU fallbacks for `mx.fast.*`) operation by operation:
//! RMSNorm, softmax, sigmoid/SiLU/softplus, sinkhorn, interleaved (traditional) YaRN RoPE on the
//! trailing dims, FP8/FP4 fake quantization, clamped SwiGLU.
//!
//! These are already the plain scalar versions (no SIMD, no threads), so they are their own
//! reference; the tests hold them against f64 formulas and the reference's documented rules.

use crate::codec::round_e4m3;

/// `x * rsqrt(mean(x²) + eps) [* w]` per row of `n`, in place (MLX `fast.rms_norm`).
pub fn rms_norm(x: &mut [f32], n: usize, w: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(n) {
        // The mean of squares in f64: a long f32 running sum (n = hc·hidden for the
        // hyper-connection norm) would add avoidable noise against the reference.
        let mut ss = 0f64;
        for &v in row.iter() {
            ss += (v as f64) * (v as f64);
        }
        let r = 1.0 / ((ss / n as f64) as f32 + eps).sqrt();
        match w {
            Some(w) => {
                for (v, wi) in row.iter_mut().zip(w) {
                    *v = (*v * r) * wi;
                }
            }
            None => {
                for v in row.iter_mut() {
                    *v *= r;
                }
            }
        }
    }
}

/// Softmax of one row in place (max-subtracted, f32).
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut s = 0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in x.iter_mut() {
        *v /= s;
    }
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU `x · sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `softplus(x) = logaddexp(x, 0)` as MLX computes it: `max + log1p(exp(-|x|))`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// DeepSeek-V4.1's clamped SwiGLU: `silu(min(gate, limit)) · clip(up, ±limit)` (limit ≤ 0: none).
#[inline]
pub fn swiglu_clamped(gate: f32, up: f32, limit: f32) -> f32 {
    let (g, u) = if limit > 0.0 {
        (gate.min(limit), up.clamp(-limit, limit))
    } else {
        (gate, up)
    };
    silu(g) * u
}

/// Sinkhorn on one `hc × hc` matrix (row-major `m[a*hc+b]`), as `_sinkhorn`: divide each column
/// by its sum + eps, then `iters − 1` times the rows, then the columns.
pub fn sinkhorn(m: &mut [f32], hc: usize, iters: usize, eps: f32) {
    let cols = |m: &mut [f32]| {
        for b in 0..hc {
            let mut s = 0f32;
            for a in 0..hc {
                s += m[a * hc + b];
            }
            let d = s + eps;
            for a in 0..hc {
                m[a * hc + b] /= d;
            }
        }
    };
    let rows = |m: &mut [f32]| {
        for a in 0..hc {
            let mut s = 0f32;
            for b in 0..hc {
                s += m[a * hc + b];
            }
            let d = s + eps;
            for b in 0..hc {
                m[a * hc + b] /= d;
            }
        }
    };
    if iters == 0 {
        return;
    }
    cols(m);
    for _ in 1..iters {
        rows(m);
        cols(m);
    }
}

/// mlx-lm's `YarnRoPE` frequencies, applied MLX-`fast.rope`-style with `traditional=True`
/// (adjacent pairs rotate) to the trailing `dims` features of a vector.
#[derive(Debug, Clone)]
pub struct Rope {
    pub dims: usize,
    /// `1 / freqs` per pair (f32, as MLX takes the reciprocal of the given periods).
    pub inv_freq: Vec<f32>,
    /// YaRN attention scale applied to the rotated part (1 for V4.1).
    pub mscale: f32,
}

impl Rope {
    /// `YarnRoPE(dims, base, scaling_factor, original_max_position_embeddings, beta_fast,
    /// beta_slow, mscale, mscale_all_dim)`, computing `_freqs` in f32 like the reference.
    #[allow(clippy::too_many_arguments)]
    pub fn yarn(
        dims: usize,
        base: f64,
        scaling_factor: f64,
        original_max: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: f64,
        mscale_all_dim: f64,
    ) -> Rope {
        let corr = |rot: f64| {
            (dims as f64 * (original_max / (rot * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * base.ln())
        };
        let low = (corr(beta_fast).floor()).max(0.0);
        let high = (corr(beta_slow).ceil()).min(dims as f64 - 1.0);
        let get_m = |scale: f64, m: f64| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        let ms = get_m(scaling_factor, mscale) / get_m(scaling_factor, mscale_all_dim);
        let half = dims / 2;
        let (low32, mut high32) = (low as f32, high as f32);
        if low32 == high32 {
            high32 += 0.001;
        }
        let b = base as f32;
        let sf = scaling_factor as f32;
        let inv_freq = (0..half)
            .map(|i| {
                let e = (2 * i) as f32 / dims as f32;
                let extra = b.powf(e);
                let inter = sf * extra;
                let ramp = ((i as f32 - low32) / (high32 - low32)).clamp(0.0, 1.0);
                let mask = 1.0 - ramp;
                let f = (inter * extra) / (inter * mask + extra * (1.0 - mask));
                1.0 / f
            })
            .collect();
        Rope {
            dims,
            inv_freq,
            mscale: ms as f32,
        }
    }

    /// Plain RoPE with base `theta` (YarnRoPE's defaults: factor 1, no YaRN ramp effect).
    pub fn plain(dims: usize, theta: f64) -> Rope {
        Rope::yarn(dims, theta, 1.0, 4096.0, 32.0, 1.0, 1.0, 0.0)
    }

    /// Rotate the trailing `dims` features of `x` by position `pos` (already `(offset+t)·scale`);
    /// `inverse` rotates back (negated frequencies).
    #[inline]
    pub fn apply(&self, x: &mut [f32], pos: f32, inverse: bool) {
        if self.dims == 0 {
            return;
        }
        let n = x.len();
        let tail = &mut x[n - self.dims..];
        if self.mscale != 1.0 {
            let s = if inverse {
                1.0 / self.mscale
            } else {
                self.mscale
            };
            for v in tail.iter_mut() {
                *v *= s;
            }
        }
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let f = if inverse { -f } else { f };
            let theta = pos * f;
            let (s, c) = (theta.sin(), theta.cos());
            let x1 = tail[2 * i];
            let x2 = tail[2 * i + 1];
            tail[2 * i] = x1 * c - x2 * s;
            tail[2 * i + 1] = x1 * s + x2 * c;
        }
    }
}

/// The power-of-two scale [`fake_quant_fp8`] gives one block: `2^ceil(log2(max(amax, 1e-4) /
/// 448))`, so that the block's largest magnitude lands at or under E4M3's 448.
pub fn fp8_block_scale(b: &[f32]) -> f32 {
    let amax = b.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-4);
    2f32.powf((amax / 448.0).log2().ceil())
}

/// `_fake_quant_fp8(x, block)` on one row in place: power-of-two scale per block from
/// `ceil(log2(max(amax, 1e-4) / 448))`, clip to ±448, round to E4M3 (RNE). Rows whose length is
/// not a multiple of `block` are left alone, as in the reference.
pub fn fake_quant_fp8(x: &mut [f32], block: usize) {
    if !x.len().is_multiple_of(block) {
        return;
    }
    for b in x.chunks_exact_mut(block) {
        let scale = fp8_block_scale(b);
        for v in b.iter_mut() {
            *v = round_e4m3((*v / scale).clamp(-448.0, 448.0)) * scale;
        }
    }
}

/// mlx-lm's `_round_fp4`: nearest E2M1 magnitude with its threshold rule (ties at 0.25, 1.25,
/// 2.5, 5 go down; at 0.75, 1.75, 3.5 go up), sign kept (`sign(0) = 0`).
#[inline]
pub fn round_fp4(x: f32) -> f32 {
    const LUT: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = x.abs();
    let mut i = 0usize;
    for t in [0.25f32, 1.25, 2.5, 5.0] {
        i += (m > t) as usize;
    }
    for t in [0.75f32, 1.75, 3.5] {
        i += (m >= t) as usize;
    }
    let s = if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    };
    s * LUT[i]
}

/// `_fake_quant_fp4(x, block_size, e4m3_scale)` on one row in place.
pub fn fake_quant_fp4(x: &mut [f32], block: usize, e4m3_scale: bool) {
    if !x.len().is_multiple_of(block) {
        return;
    }
    let floor = if e4m3_scale {
        6.0 * 2f32.powi(-9)
    } else {
        6.0 * 2f32.powi(-126)
    };
    for b in x.chunks_exact_mut(block) {
        let amax = b.iter().fold(0f32, |a, v| a.max(v.abs())).max(floor);
        let scale = if e4m3_scale {
            round_e4m3(amax / 6.0)
        } else {
            2f32.powf((amax / 6.0).log2().ceil())
        };
        for v in b.iter_mut() {
            *v = round_fp4((*v / scale).clamp(-6.0, 6.0)) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tolerance for f32 vs f64 formulas on short vectors: a few ulps of accumulation.
    const TOL: f32 = 1e-5;

    #[test]
    fn rms_norm_matches_f64() {
        let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let w: Vec<f32> = (0..37).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut y = x.clone();
        rms_norm(&mut y, 37, Some(&w), 1e-6);
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 37.0;
        for i in 0..37 {
            let e = x[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64;
            assert!((y[i] as f64 - e).abs() < TOL as f64 * e.abs().max(1.0));
        }
    }

    #[test]
    fn softmax_and_sinkhorn() {
        let mut s = vec![1.0f32, 2.0, -3.0, 0.5];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < TOL);
        let mut m: Vec<f32> = (0..16)
            .map(|i| 0.1 + (i as f32 * 0.7).sin().abs())
            .collect();
        sinkhorn(&mut m, 4, 20, 1e-6);
        for a in 0..4 {
            let r: f32 = (0..4).map(|b| m[a * 4 + b]).sum();
            let c: f32 = (0..4).map(|b| m[b * 4 + a]).sum();
            assert!((r - 1.0).abs() < 1e-3 && (c - 1.0).abs() < TOL, "{r} {c}");
        }
    }

    #[test]
    fn rope_inverse_undoes_forward() {
        let r = Rope::plain(16, 10000.0);
        let x: Vec<f32> = (0..24).map(|i| i as f32 * 0.1 - 1.0).collect();
        let mut y = x.clone();
        r.apply(&mut y, 37.0, false);
        assert_eq!(&y[..8], &x[..8]);
        r.apply(&mut y, 37.0, true);
        for i in 0..24 {
            assert!((y[i] - x[i]).abs() < 1e-5);
        }
        // Pair 0 rotates by pos · 1.
        let mut z = vec![1.0f32, 0.0];
        Rope::plain(2, 10000.0).apply(&mut z, 0.5, false);
        assert!((z[0] - 0.5f32.cos()).abs() < 1e-7 && (z[1] - 0.5f32.sin()).abs() < 1e-7);
    }

    #[test]
    fn fp4_rounding_rule() {
        let cases = [
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (0.74, 0.5),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.1, 6.0),
            (-0.75, -1.0),
            (0.0, 0.0),
        ];
        for (x, e) in cases {
            assert_eq!(round_fp4(x), e, "{x}");
        }
    }

    #[test]
    fn fake_quant_values_are_on_the_grid() {
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 * 1.3).sin() * 10.0).collect();
        let orig = x.clone();
        fake_quant_fp8(&mut x, 32);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() <= b.abs() / 16.0 + 1e-6);
        }
        let mut y = orig.clone();
        fake_quant_fp4(&mut y, 32, false);
        let amax = orig[..32].iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = 2f32.powf((amax / 6.0).log2().ceil());
        for v in &y[..32] {
            let q = v / scale;
            assert!(
                [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0].contains(&q.abs()),
                "{q}"
            );
        }
        let mut z = vec![1.0f32; 33];
        fake_quant_fp8(&mut z, 32);
        assert_eq!(z, vec![1.0f32; 33]);
    }
}
