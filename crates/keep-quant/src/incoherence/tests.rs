//! Tests of incoherence processing: the rotation against explicit matrices, its inverse, the
//! rotated imatrix against `Σ_j V_kj² D_j`, the reported errors against an f64 recomputation,
//! and that rotation pays on a matrix with outliers.

use super::*;
use crate::fit::dequantize_ref;
use keep_rng::Draw;

/// The rotation runs in f32 (log₂ n butterfly roundings); weights of order 0.02.
const ROT_TOL: f64 = 1e-7;
/// Reported errors (f32 decode and f32 un-rotation) against the f64 recomputation, relative.
const ERR_REL_TOL: f64 = 1e-3;

fn gauss(seed: u64, n: usize, sd: f64) -> Vec<f32> {
    let mut r = keep_rng::rng(seed);
    (0..n).map(|_| (r.gauss() * sd) as f32).collect()
}

fn opts(mode: Mode) -> IncoherenceOptions {
    IncoherenceOptions { mode, seed: 7 }
}

/// `V_out·W·V_inᵀ` from the explicit reference transforms, in f64.
fn rotate_ref(w: &[f32], rows: usize, cols: usize, input: &Rht, output: &Rht) -> Vec<f64> {
    let a: Vec<f64> = w
        .chunks(cols)
        .flat_map(|r| input.forward_ref(&r.iter().map(|&v| v as f64).collect::<Vec<_>>()))
        .collect();
    let mut out = vec![0f64; rows * cols];
    for c in 0..cols {
        let col: Vec<f64> = (0..rows).map(|r| a[r * cols + c]).collect();
        for (r, v) in output.forward_ref(&col).into_iter().enumerate() {
            out[r * cols + c] = v;
        }
    }
    out
}

#[test]
fn rotation_matches_explicit_matrices_and_inverts() {
    for (rows, cols, mode) in [
        (16, 32, Mode::Both),
        (24, 40, Mode::Both),
        (12, 96, Mode::Output),
        (8, 8, Mode::Both),
    ] {
        let w = gauss(rows as u64, rows * cols, 0.02);
        let (i, o) = transforms(opts(mode), "layers.0.ffn.experts.1.w1", rows, cols).unwrap();
        let rot = rotate(&w, rows, cols, &i, &o).unwrap();
        let want = rotate_ref(&w, rows, cols, &i, &o);
        for (a, b) in rot.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < ROT_TOL, "{rows}x{cols}: {a} vs {b}");
        }
        let back = unrotate(&rot, rows, cols, &i, &o).unwrap();
        for (a, b) in back.iter().zip(&w) {
            assert!(((a - b) as f64).abs() < ROT_TOL);
        }
        // orthogonal: the Frobenius norm is kept
        let n0: f64 = w.iter().map(|&v| (v as f64).powi(2)).sum();
        let n1: f64 = want.iter().map(|v| v.powi(2)).sum();
        assert!((n0 - n1).abs() < 1e-9 * n0.max(1e-30) + 1e-15);
    }
}

#[test]
fn rotated_imatrix_is_the_diagonal_of_v_d_vt() {
    for (n, mode) in [(64, Mode::Both), (96, Mode::Both), (40, Mode::Output)] {
        let h: Vec<f32> = gauss(n as u64, n, 1.0).iter().map(|v| v.exp()).collect();
        let (i, _) = transforms(opts(mode), "x", 8, n).unwrap();
        let fast = rotated_imatrix(&h, &i);
        let exact = rotated_imatrix_ref(&h, &i);
        for (a, b) in fast.iter().zip(&exact) {
            assert!((*a as f64 - b).abs() < 1e-5 * b.abs(), "{a} vs {b}");
        }
        match mode {
            // flat within each block: the block's mean
            Mode::Both => assert!(fast.chunks(i.block).all(|b| b.iter().all(|&v| v == b[0]))),
            // signs alone leave the diagonal as it was
            Mode::Output => assert_eq!(fast, h),
        }
    }
}

#[test]
fn reported_errors_recompute_in_the_original_basis() {
    let (rows, cols) = (16, 64);
    let w = gauss(3, rows * cols, 0.02);
    let im: Vec<f32> = gauss(4, cols, 1.2).iter().map(|v| v.exp()).collect();
    let h = column_weights(&im).unwrap();
    let mean = im.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
    for format in QuantFormat::ALL {
        for mode in [Mode::Both, Mode::Output] {
            let (i, o) = transforms(opts(mode), "t", rows, cols).unwrap();
            let f = fit_incoherent(&w, rows, cols, &im, format, i, o).unwrap();
            // decode the rotated fit in f64, un-rotate with the reference transforms
            let dt = dequantize_ref(&f.fit);
            let mut hat = vec![0f64; rows * cols];
            for c in 0..cols {
                let col: Vec<f64> = (0..rows).map(|r| dt[r * cols + c]).collect();
                for (r, v) in o.inverse_ref(&col).into_iter().enumerate() {
                    hat[r * cols + c] = v;
                }
            }
            let hat: Vec<f64> = hat.chunks(cols).flat_map(|r| i.inverse_ref(r)).collect();
            let err: f64 = w
                .iter()
                .zip(&hat)
                .enumerate()
                .map(|(k, (&a, b))| h[k % cols] as f64 * (a as f64 - b).powi(2))
                .sum::<f64>()
                * mean;
            let got = f.errors.full.unwrap_or(f.errors.base);
            assert!(
                (err - got).abs() <= ERR_REL_TOL * err,
                "{format:?} {mode:?}"
            );
            if let Some(full) = f.errors.full {
                assert!(full < f.errors.base, "{format:?}: residual did not help");
            }
        }
    }
}

#[test]
fn rotation_pays_on_a_matrix_with_outliers() {
    // Gaussian weights with a few large outliers, uniform imatrix: a per-row scale must
    // stretch to the outliers unrotated; rotated, they are spread over the row.
    let (rows, cols) = (32, 128);
    let mut w = gauss(5, rows * cols, 0.02);
    let mut r = keep_rng::rng(6);
    for _ in 0..rows {
        let k = r.below(w.len());
        w[k] = if r.unit() < 0.5 { 0.6 } else { -0.6 };
    }
    let im = vec![1f32; cols];
    let plain = fit_matrix(&w, rows, cols, &im, QuantFormat::E8p2).unwrap();
    let (i, o) = transforms(opts(Mode::Both), "t", rows, cols).unwrap();
    let rot = fit_incoherent(&w, rows, cols, &im, QuantFormat::E8p2, i, o).unwrap();
    assert!(
        rot.errors.base < 0.7 * plain.errors.base,
        "rotated {} vs plain {}",
        rot.errors.base,
        plain.errors.base
    );
}

#[test]
fn seeds_differ_per_tensor_and_repeat() {
    let o = opts(Mode::Both);
    let a = transforms(o, "layers.0.ffn.experts.0.w1", 8, 16).unwrap();
    let b = transforms(o, "layers.0.ffn.experts.0.w1", 8, 16).unwrap();
    let c = transforms(o, "layers.0.ffn.experts.0.w3", 8, 16).unwrap();
    assert_eq!(a, b);
    assert_ne!(a.0.seed, c.0.seed);
    assert_ne!(a.0.seed, a.1.seed);
    let m = marker(a.0, a.1);
    assert_eq!((m.block_in, m.block_out), (16, 8));
}

#[test]
fn bad_inputs_are_errors() {
    let (i, o) = transforms(opts(Mode::Both), "t", 8, 16).unwrap();
    assert!(rotate(&[0.0; 100], 8, 16, &i, &o).is_err());
    assert!(fit_incoherent(&[0.0; 128], 8, 16, &[1.0; 8], QuantFormat::E8p2, i, o).is_err());
    let mut w = vec![0.0f32; 128];
    w[3] = f32::NAN;
    assert!(fit_incoherent(&w, 8, 16, &[1.0; 16], QuantFormat::E8p2, i, o).is_err());
}
