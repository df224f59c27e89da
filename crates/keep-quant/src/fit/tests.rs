//! Tests of the matrix fit: decode against the f64 reference, reported errors against a
//! recomputation, rung order, the imatrix weighting, refusals.

use super::*;
use keep_rng::Draw;

/// f32 decode (`s₁q₁ + s₂q₂`, two roundings) against the f64 reference: relative to the
/// row's largest magnitude, two f32 roundings.
const DECODE_REL_TOL: f64 = 4.0 * f32::EPSILON as f64;
/// Reported errors are sums in a different order from the recomputation (f64).
const ERR_REL_TOL: f64 = 1e-9;

fn gauss_matrix(seed: u64, rows: usize, cols: usize) -> Vec<f32> {
    let mut rng = keep_rng::rng(seed);
    (0..rows * cols)
        .map(|_| (rng.gauss() * 0.02) as f32)
        .collect()
}

fn imatrix(seed: u64, cols: usize) -> Vec<f32> {
    let mut rng = keep_rng::rng(seed);
    (0..cols)
        .map(|_| (rng.gauss() * 1.2).exp() as f32)
        .collect()
}

fn weighted_err(w: &[f32], hat: &[f64], h: &[f32], cols: usize) -> f64 {
    w.iter()
        .zip(hat)
        .enumerate()
        .map(|(j, (&a, &b))| h[j % cols] as f64 * (a as f64 - b).powi(2))
        .sum()
}

#[test]
fn decode_matches_f64_reference_and_errors_recompute() {
    let (rows, cols) = (12, 64);
    let w = gauss_matrix(1, rows, cols);
    let im = imatrix(2, cols);
    let h = column_weights(&im).unwrap();
    let mean = im.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
    for format in QuantFormat::ALL {
        let f = fit_matrix(&w, rows, cols, &im, format).unwrap();
        assert_eq!(f.codes.len(), rows * cols / 8);
        let fast = dequantize(&f);
        let exact = dequantize_ref(&f);
        for r in 0..rows {
            let big = exact[r * cols..(r + 1) * cols]
                .iter()
                .fold(0f64, |m, v| m.max(v.abs()));
            for j in r * cols..(r + 1) * cols {
                assert!(
                    (fast[j] as f64 - exact[j]).abs() <= DECODE_REL_TOL * big,
                    "{format:?} {j}"
                );
            }
        }
        let err = weighted_err(&w, &exact, &h, cols) * mean;
        let reported = f.errors.full.unwrap_or(f.errors.base);
        assert!((err - reported).abs() <= ERR_REL_TOL * err, "{format:?}");
        // the base rung of a residual format is the E8P2 fit alone
        let mut base = f.clone();
        base.residual = None;
        let e = weighted_err(&w, &dequantize_ref(&base), &h, cols) * mean;
        assert!((e - f.errors.base).abs() <= ERR_REL_TOL * e);
    }
}

#[test]
fn rungs_improve_and_gaussian_error_is_as_published() {
    let (rows, cols) = (32, 256);
    let w = gauss_matrix(3, rows, cols);
    let ones = vec![1.0f32; cols];
    let rel = |f: &FittedMatrix| f.errors.full.unwrap_or(f.errors.base) / f.errors.weight;
    let e2 = fit_matrix(&w, rows, cols, &ones, QuantFormat::E8p2).unwrap();
    let e3 = fit_matrix(&w, rows, cols, &ones, QuantFormat::E8p2E81).unwrap();
    let e4 = fit_matrix(&w, rows, cols, &ones, QuantFormat::E8p2E8p2).unwrap();
    // QuIP#: 0.0921 per coordinate for unit Gaussians at the fixed scale; the refitted scale
    // can only do better, and 8192 weights estimate it to about ±3%
    assert!(rel(&e2) < 0.0921 * 1.03 && rel(&e2) > 0.07, "{}", rel(&e2));
    assert_eq!(e3.errors.base, e2.errors.base, "stage 1 is shared");
    assert!(rel(&e3) < rel(&e2) * 0.6, "{} {}", rel(&e3), rel(&e2));
    assert!(rel(&e4) < rel(&e3), "{} {}", rel(&e4), rel(&e3));
}

#[test]
fn imatrix_weighting_pays_under_the_weighted_error() {
    let (rows, cols) = (16, 128);
    let w = gauss_matrix(4, rows, cols);
    // a strongly uneven imatrix: a few channels carry most of the activation energy
    let im: Vec<f32> = (0..cols)
        .map(|j| if j % 16 == 3 { 200.0 } else { 1.0 })
        .collect();
    let h = column_weights(&im).unwrap();
    let weighted = fit_matrix(&w, rows, cols, &im, QuantFormat::E8p2).unwrap();
    let plain = fit_matrix(&w, rows, cols, &vec![1.0; cols], QuantFormat::E8p2).unwrap();
    let ew = weighted_err(&w, &dequantize_ref(&weighted), &h, cols);
    let ep = weighted_err(&w, &dequantize_ref(&plain), &h, cols);
    assert!(ew < ep * 0.9, "weighted {ew} vs plain {ep}");
}

#[test]
fn zero_rows_zero_imatrix_and_refusals() {
    let (rows, cols) = (3, 16);
    let mut w = gauss_matrix(5, rows, cols);
    w[cols..2 * cols].fill(0.0);
    let f = fit_matrix(&w, rows, cols, &[0.0; 16], QuantFormat::E8p2E81).unwrap();
    assert_eq!(f.scales[1], 0.0);
    assert!(dequantize(&f)[cols..2 * cols].iter().all(|&v| v == 0.0));
    assert!(fit_matrix(&w, rows, 12, &[1.0; 12], QuantFormat::E8p2).is_err());
    assert!(fit_matrix(&w, rows, cols, &[1.0; 8], QuantFormat::E8p2).is_err());
    w[5] = f32::NAN;
    assert!(fit_matrix(&w, rows, cols, &[1.0; 16], QuantFormat::E8p2).is_err());
    assert!(column_weights(&[1.0, -1.0]).is_err());
    assert!(column_weights(&[1.0, f32::INFINITY]).is_err());
}

#[test]
fn formats_and_bits() {
    for f in QuantFormat::ALL {
        assert_eq!(QuantFormat::parse(f.label()), Some(f));
    }
    assert_eq!(QuantFormat::parse("e8p3"), None);
    assert_eq!(QuantFormat::E8p2.bits_per_weight(128, 256), 2.125);
    assert_eq!(QuantFormat::E8p2E81.bits_per_weight(128, 256), 3.25);
    assert_eq!(QuantFormat::E8p2E8p2.bits_per_weight(256, 128), 4.5);
}

#[test]
fn grouped_scales_decode_and_match_per_row_at_full_width() {
    let (rows, cols) = (6, 64);
    let w = gauss_matrix(11, rows, cols);
    let im = imatrix(12, cols);
    let h = column_weights(&im).unwrap();
    let mean = im.iter().map(|&v| v as f64).sum::<f64>() / cols as f64;
    for format in QuantFormat::ALL {
        // a group as wide as the row is the per-row fit
        let row = fit_matrix(&w, rows, cols, &im, format).unwrap();
        assert_eq!(
            fit_matrix_grouped(&w, rows, cols, &im, format, cols).unwrap(),
            row
        );
        let f = fit_matrix_grouped(&w, rows, cols, &im, format, 16).unwrap();
        assert_eq!((f.group, f.scales.len()), (16, rows * cols / 16));
        let exact = dequantize_ref(&f);
        let fast = dequantize(&f);
        let big = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
        for j in 0..exact.len() {
            assert!((fast[j] as f64 - exact[j]).abs() <= DECODE_REL_TOL * big);
        }
        // the reported error is that of the grouped decode
        let err = weighted_err(&w, &exact, &h, cols) * mean;
        let reported = f.errors.full.unwrap_or(f.errors.base);
        assert!((err - reported).abs() <= ERR_REL_TOL * err, "{format:?}");
    }
    for bad in [0, 12, 24, 128] {
        assert!(fit_matrix_grouped(&w, rows, cols, &im, QuantFormat::E8p2, bad).is_err());
    }
}
