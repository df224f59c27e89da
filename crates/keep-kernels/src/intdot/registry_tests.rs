//! The format harness, in the spirit of llama.cpp's `test-backend-ops`: every format of
//! keep-format's registry, on every integer level this CPU has, at M ∈ {1, 8, 32, 64} (64 runs
//! the GEMM on the VNNI levels) and on odd shapes, against the scalar reference written here
//! from the entry's definitions (its `_ref` integer decode and block factors, the contract's
//! [`dot_blocks_ref`] and [`finish_ref`]), bit for bit; and the exact f32 path of the same
//! weights against [`matmul_ref`] (the f64 sum of the entry's element decode); a format
//! without an integer form, its fast entry point against the exact path. A format is covered
//! by being registered: nothing here names one.

use super::*;
use crate::matmul::{matmul, matmul_ref, matmul_with};
use crate::test_rng::Rng;
use keep_format::registry::{FormatSpec, REGISTRY};

/// The M values every (format, level) runs at.
const MS: [usize; 4] = [1, 8, 32, 64];

/// Shapes: rows not a multiple of any row tile, columns with and without blocks past the last
/// whole group of four.
fn shapes(f: &FormatSpec) -> Vec<(usize, usize)> {
    [(1, 1), (37, 7), (5, 16), (19, 12)]
        .iter()
        .map(|&(r, k)| (r, k * f.col_multiple.max(QBLOCK)))
        .collect()
}

/// A random `[rows, cols]` weight encoded by the entry; the parts it wrote.
fn encoded(f: &FormatSpec, rows: usize, cols: usize, rng: &mut Rng) -> Vec<Vec<u8>> {
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.f() * 0.1).collect();
    (f.encode_ref)(&w, rows, cols).expect("encodes")
}

/// The contract for every (input row, weight row), from the entry's `_ref` definitions.
fn reference(f: &FormatSpec, parts: &[&[u8]], rows: usize, a: &Q8Acts) -> Vec<f32> {
    let int = f.int.expect("an integer form");
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    let mut out = vec![0f32; a.m * rows];
    let (mut w, mut fac) = (vec![0i8; cols], vec![0f32; nb]);
    for r in 0..rows {
        (int.decode_ref)(parts, cols, r, &mut w);
        (int.block_factors)(parts, cols, r, &mut fac);
        for i in 0..a.m {
            let (q, d) = (&a.q[i * cols..(i + 1) * cols], &a.d[i * nb..(i + 1) * nb]);
            let mut acc = [[0f32; 8]; 4];
            dot_blocks_ref(&w, q, |b| fac[b] * d[b], &mut acc, 0, nb);
            out[i * rows + r] = finish_ref(&acc);
        }
    }
    out
}

#[test]
fn every_registered_format_on_every_level_and_m_equals_its_reference() {
    let mut rng = Rng::new(0x4E6_0032);
    let levels = int_levels_available();
    let (mut runs, mut decoded_runs) = (0, 0);
    for f in REGISTRY {
        for (rows, cols) in shapes(f) {
            let enc = encoded(f, rows, cols, &mut rng);
            let parts: Vec<&[u8]> = f.computed().map(|(i, _)| &enc[i][..]).collect();
            let view = WeightView::registered(f, &parts, rows, cols).unwrap();
            let Some(src) = IntSrc::from_view(&view) else {
                assert!(f.int.is_none(), "{}: has an integer form", f.name);
                // No integer form: the fast entry point runs the exact decoded-row path.
                for m in MS {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
                    let (mut fast, mut exact) = (vec![0f32; m * rows], vec![0f32; m * rows]);
                    matmul_with(crate::Kernels::Fast, &x, m, &view, &mut fast).unwrap();
                    matmul(&x, m, &view, &mut exact).unwrap();
                    assert_eq!(fast, exact, "{} matmul_with(Fast) M={m}", f.name);
                    decoded_runs += 1;
                }
                continue;
            };
            for m in MS {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
                let a = Q8Acts::quantize_ref(&x, m, cols).unwrap();
                let want = reference(f, &parts, rows, &a);
                for &lv in &levels {
                    let mut got = vec![f32::NAN; m * rows];
                    int_matmul_at(lv, &src, rows, &a, &mut got).unwrap();
                    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            w.to_bits(),
                            "{} {lv:?} {rows}x{cols} M={m}: output ({}, {}) is {g}, the \
                             reference {w}",
                            f.name,
                            k / rows,
                            k % rows
                        );
                    }
                    runs += 1;
                }
                // The fast entry point (quantizes, picks the CPU's level) gives the same.
                let mut fast = vec![0f32; m * rows];
                matmul_with(crate::Kernels::Fast, &x, m, &view, &mut fast).unwrap();
                assert_eq!(fast, want, "{} matmul_with(Fast) M={m}", f.name);
                // The reference is the exact product of the dequantized activations, within
                // f32 accumulation.
                let xd = a.dequantize();
                let mut exact = vec![0f32; m * rows];
                matmul_ref(&xd, m, &view, &mut exact).unwrap();
                for (k, (p, q)) in exact.iter().zip(&want).enumerate() {
                    let (i, r) = (k / rows, k % rows);
                    let mag: f32 = (0..cols)
                        .map(|c| (xd[i * cols + c] * view.get_ref(r, c)).abs())
                        .sum();
                    assert!(
                        (p - q).abs() <= 1e-5 * mag + 1e-30,
                        "{} {rows}x{cols} M={m} ({i}, {r}): exact {p}, integer {q}",
                        f.name
                    );
                }
            }
        }
    }
    // Every format ran: on every integer level, or (without an integer form) on the fast
    // entry point's decoded-row path.
    let int = REGISTRY.iter().filter(|f| f.int.is_some()).count();
    assert!(runs >= int * MS.len() * levels.len());
    assert_eq!(
        decoded_runs,
        (REGISTRY.len() - int) * shapes(REGISTRY[0]).len() * MS.len()
    );
}

#[test]
fn every_registered_format_exact_path_equals_its_definition() {
    let mut rng = Rng::new(0x4E6_0033);
    for f in REGISTRY {
        for (rows, cols) in shapes(f) {
            let enc = encoded(f, rows, cols, &mut rng);
            let parts: Vec<&[u8]> = f.computed().map(|(i, _)| &enc[i][..]).collect();
            let view = WeightView::registered(f, &parts, rows, cols).unwrap();
            assert_eq!(view.format_name(), f.name);
            assert_eq!(
                view.nbytes() as u64
                    + enc[f.computed().count()..]
                        .iter()
                        .map(|b| b.len() as u64)
                        .sum::<u64>(),
                f.bytes(rows, cols)
            );
            // Row decode equals the element reference, and a row slice is those rows.
            let mut d = vec![0f32; cols];
            let sub = view.slice_rows(rows / 2, rows).unwrap();
            for r in 0..rows {
                view.decode_row(r, &mut d);
                for (c, v) in d.iter().enumerate() {
                    assert_eq!(
                        v.to_bits(),
                        view.get_ref(r, c).to_bits(),
                        "{} ({r},{c})",
                        f.name
                    );
                    if r >= rows / 2 {
                        assert_eq!(v.to_bits(), sub.get_ref(r - rows / 2, c).to_bits());
                    }
                }
            }
            // The exact kernel: its result is the decoded f32 matrix's, bit for bit (the same
            // kernel on the same f32 values), and within f32 rounding of the f64 reference.
            let dense: Vec<u8> = (0..rows)
                .flat_map(|r| {
                    let mut row = vec![0f32; cols];
                    view.decode_row(r, &mut row);
                    row.into_iter()
                        .flat_map(f32::to_le_bytes)
                        .collect::<Vec<_>>()
                })
                .collect();
            let f32v = WeightView::f32(&dense, rows, cols).unwrap();
            for m in MS {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
                let (mut a, mut b, mut c) = (
                    vec![0f32; m * rows],
                    vec![0f32; m * rows],
                    vec![0f32; m * rows],
                );
                matmul(&x, m, &view, &mut a).unwrap();
                matmul(&x, m, &f32v, &mut b).unwrap();
                matmul_ref(&x, m, &view, &mut c).unwrap();
                assert_eq!(a, b, "{} M={m}: exact path vs its f32 decode", f.name);
                for (p, q) in a.iter().zip(&c) {
                    assert!(
                        (p - q).abs() <= 1e-4 * (1.0 + q.abs()),
                        "{}: {p} vs {q}",
                        f.name
                    );
                }
            }
        }
    }
}
