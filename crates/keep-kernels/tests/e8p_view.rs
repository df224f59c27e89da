//! E8P weights (with and without a residual stage) as a `WeightView`: the fast row decode
//! against the element reference, the formula against keep-format's decoders, the products
//! against the f64 reference, row slices, and refusals.

use keep_format::e81::decode_e81_ref;
use keep_format::e8p::decode_e8p_ref;
use keep_kernels::{matmul, matmul_ref, matmul_with, E8pResidual, Kernels, WeightKind, WeightView};

/// The f32 products accumulate in a different order from the f64 reference: relative to the
/// sum of |x·w| of the dot, a few hundred f32 roundings.
const DOT_REL_TOL: f64 = 1e-5;

/// keep-rng's LCG stream, upper 48 bits per draw.
struct Lcg(keep_rng::Lcg64);
impl Lcg {
    fn new(seed: u64) -> Lcg {
        Lcg(keep_rng::lcg(seed))
    }
    fn next(&mut self) -> u64 {
        keep_rng::RngCore::next_u64(&mut self.0) >> 16
    }
    fn f(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn e8p_views_decode_and_multiply() {
    let (rows, cols, m) = (6, 64, 3);
    let mut g = Lcg::new(7);
    let codes: Vec<u8> = (0..rows * cols / 8 * 2).map(|_| g.next() as u8).collect();
    let scales: Vec<f32> = (0..rows).map(|_| g.f() * 0.1).collect();
    let r81: Vec<u8> = (0..rows * cols / 8).map(|_| g.next() as u8).collect();
    let r8p: Vec<u8> = (0..rows * cols / 8 * 2).map(|_| g.next() as u8).collect();
    let rs: Vec<f32> = (0..rows).map(|_| g.f() * 0.03).collect();
    let (sb, rsb) = (f32s(&scales), f32s(&rs));
    let base = WeightView::e8p(&codes, &sb, rows, cols).unwrap();
    let x: Vec<f32> = (0..m * cols).map(|_| g.f()).collect();
    for resid in [
        None,
        Some(E8pResidual {
            codes: &r81,
            scales: &rsb,
            e81: true,
        }),
        Some(E8pResidual {
            codes: &r8p,
            scales: &rsb,
            e81: false,
        }),
    ] {
        let w = match resid {
            Some(r) => base.with_residual(r).unwrap(),
            None => base,
        };
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            w.decode_row(r, &mut row);
            for (c, &got) in row.iter().enumerate() {
                let k = (r * cols + c) / 8;
                let q = decode_e8p_ref(u16::from_le_bytes([codes[2 * k], codes[2 * k + 1]]))[c % 8];
                let mut want = scales[r] * q;
                if let Some(rr) = resid {
                    let q2 = if rr.e81 {
                        decode_e81_ref(r81[k])[c % 8]
                    } else {
                        decode_e8p_ref(u16::from_le_bytes([r8p[2 * k], r8p[2 * k + 1]]))[c % 8]
                    };
                    want += rs[r] * q2;
                }
                assert_eq!(got.to_bits(), want.to_bits(), "{} {r} {c}", w.format_name());
                assert_eq!(w.get_ref(r, c).to_bits(), want.to_bits());
            }
        }
        let (mut a, mut b, mut f) = (
            vec![0f32; m * rows],
            vec![0f32; m * rows],
            vec![0f32; m * rows],
        );
        matmul(&x, m, &w, &mut a).unwrap();
        matmul_ref(&x, m, &w, &mut b).unwrap();
        matmul_with(Kernels::Fast, &x, m, &w, &mut f).unwrap();
        // The fast kernels take E8P (and an E8P12 or E81 residual) as integer products of the int8
        // activations: their reference is the exact product of the dequantized activations.
        let WeightKind::E8p {
            codes: wc,
            scales: ws,
            resid: wr,
        } = w.kind
        else {
            unreachable!("an E8P view")
        };
        let fb = if keep_kernels::matmul::e8p_int_stages(wc, ws, wr, cols).is_some() {
            let xq = keep_kernels::intdot::Q8Acts::quantize(&x, m, cols)
                .unwrap()
                .dequantize();
            let mut o = vec![0f32; m * rows];
            matmul_ref(&xq, m, &w, &mut o).unwrap();
            o
        } else {
            b.clone()
        };
        for i in 0..m {
            for r in 0..rows {
                let mag: f64 = (0..cols)
                    .map(|c| (x[i * cols + c] as f64 * w.get_ref(r, c) as f64).abs())
                    .sum();
                let j = i * rows + r;
                assert!(((a[j] - b[j]) as f64).abs() <= DOT_REL_TOL * mag, "{j}");
                assert!(((f[j] - fb[j]) as f64).abs() <= DOT_REL_TOL * mag, "{j}");
            }
        }
        // a row slice decodes the same rows
        let s = w.slice_rows(2, 5).unwrap();
        let mut r2 = vec![0f32; cols];
        for r in 0..3 {
            s.decode_row(r, &mut r2);
            w.decode_row(r + 2, &mut row);
            assert_eq!(r2, row);
        }
        assert_eq!(s.nbytes() * rows, w.nbytes() * 3);
    }
    // refusals
    assert!(WeightView::e8p(&codes, &sb, rows, 60).is_err());
    assert!(WeightView::e8p(&codes[2..], &sb, rows, cols).is_err());
    assert!(base
        .with_residual(E8pResidual {
            codes: &r81[1..],
            scales: &rsb,
            e81: true,
        })
        .is_err());
    let plain = WeightView::f32(&sb, 1, rows).unwrap();
    assert!(plain
        .with_residual(E8pResidual {
            codes: &r81,
            scales: &rsb,
            e81: true,
        })
        .is_err());
}
