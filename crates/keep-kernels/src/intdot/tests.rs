//! Tests of the integer kernels: the quantizer's error bound, the integer decoders on every
//! code, every forced level bit-identical to the scalar contract on odd shapes and M = 1..32,
//! and the result against the exact f64 reference run on the dequantized activations.

use super::*;
use crate::matmul::matmul_ref;
use crate::test_rng::Rng;

/// f32 accumulation over `cols` terms against the f64 reference, relative to Σ|x·w|.
const REL_TOL: f32 = 1e-5;

#[test]
fn quantize_block_error_is_half_a_step() {
    let mut rng = Rng::new(11);
    for scale in [1e-6f32, 1.0, 3e4] {
        let x: Vec<f32> = (0..QBLOCK).map(|_| rng.f() * scale).collect();
        let mut q = [0i8; QBLOCK];
        let d = quantize_block(&x, &mut q);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(d, amax / QMAX);
        assert!(q.iter().any(|v| v.unsigned_abs() == 127));
        for (v, &qq) in x.iter().zip(&q) {
            // Half a step, plus the rounding of `x · (127 / amax)` itself.
            assert!((v - qq as f32 * d).abs() <= d * 0.5001, "{v} {qq} {d}");
        }
    }
    let mut q = [1i8; QBLOCK];
    assert_eq!(quantize_block(&[0.0; QBLOCK], &mut q), 0.0);
    assert!(q.iter().all(|v| *v == 0));
    let mut x = [0.5f32; QBLOCK];
    x[3] = f32::NAN;
    assert!(quantize_block(&x, &mut q).is_nan());
    x[3] = f32::INFINITY;
    assert!(quantize_block(&x, &mut q).is_nan());
    assert!(Q8Acts::quantize(&[0.0; 40], 1, 40).is_err());
    assert!(Q8Acts::quantize(&[0.0; 64], 1, 32).is_err());
}

#[test]
fn vector_quantization_equals_the_scalar_blocks() {
    let mut rng = Rng::new(23);
    let cols = 32 * 37;
    let mut x: Vec<f32> = (0..3 * cols).map(|_| rng.f() * 3.0).collect();
    // Zero, NaN, infinite, subnormal-only (127 / amax overflows), huge and tie blocks.
    x[32..64].iter_mut().for_each(|v| *v = 0.0);
    x[64 + 5] = f32::NAN;
    x[96 + 31] = f32::NEG_INFINITY;
    x[128..160]
        .iter_mut()
        .enumerate()
        .for_each(|(j, v)| *v = f32::from_bits(j as u32) * if j % 2 == 0 { 1.0 } else { -1.0 });
    x[160..192].iter_mut().for_each(|v| *v *= 3e38 / 3.0);
    x[192..224]
        .iter_mut()
        .enumerate()
        .for_each(|(j, v)| *v = (j as f32 - 15.5) * 127.0 / 16.0);
    x[224 + 7] = -0.0;
    let a = Q8Acts::quantize(&x, 3, cols).unwrap();
    let r = Q8Acts::quantize_ref(&x, 3, cols).unwrap();
    assert_eq!(a.q, r.q);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.d), bits(&r.d));
    assert_eq!(a.sums, r.sums);
    assert_eq!(bits(&a.ds), bits(&r.ds));
    assert_eq!(bits(&a.dx), bits(&r.dx));
    assert_eq!(a.nsum4, r.nsum4);
    assert!(r.d[1] == 0.0 && r.d[2].is_nan() && r.d[3].is_nan());
}

#[test]
fn integer_decoders_equal_definitions_on_every_code() {
    // Affine-8: every byte is q − 128, and the block factors are the group scales.
    let q: Vec<u8> = (0..=255u8).collect();
    let sc: Vec<u8> = [0.5f32, 2.0, -1.0, 0.25]
        .iter()
        .flat_map(|&v| crate::bf16dot::f32_to_bf16_rne(v).to_le_bytes())
        .collect();
    let src = IntSrc::Affine8 {
        q: &q,
        scales: &sc,
        biases: &sc,
    };
    let (mut a, mut b) = (vec![0i8; 256], vec![0i8; 256]);
    src.decode_row_ref(0, 256, &mut a);
    src.decode_row_fast(0, 256, &mut b);
    assert_eq!(a, b);
    assert!(a
        .iter()
        .enumerate()
        .all(|(c, &v)| v as i32 == c as i32 - 128));
    let mut f = [0f32; 8];
    src.block_factors(0, 256, &mut f);
    assert_eq!(f, [0.5, 0.5, 2.0, 2.0, -1.0, -1.0, 0.25, 0.25]);
    // MXFP4: every byte (two nibbles).
    let packed: Vec<u8> = (0..=255u8).collect();
    let scales = vec![127u8; 16];
    let src = IntSrc::Mxfp4 {
        packed: &packed,
        scales: &scales,
    };
    let (mut a, mut b) = (vec![0i8; 512], vec![0i8; 512]);
    src.decode_row_ref(0, 512, &mut a);
    src.decode_row_fast(0, 512, &mut b);
    assert_eq!(a, b);
    for c in 0..16u8 {
        let v = keep_format::fp4::e2m1_to_f32_ref(c);
        assert_eq!(MXFP4_I8[c as usize] as f32, 2.0 * v, "e2m1 {c}");
    }
    // E8P: every code, and 4·codeword is an integer in [-11, 11].
    let codes: Vec<u16> = (0..=u16::MAX).collect();
    let sc = [1.0f32];
    let src = IntSrc::E8p {
        codes: &codes,
        scales: &sc,
    };
    let n = codes.len() * 8;
    let (mut a, mut b) = (vec![0i8; n], vec![0i8; n]);
    src.decode_row_ref(0, n, &mut a);
    src.decode_row_fast(0, n, &mut b);
    assert_eq!(a, b);
    for (j, &v) in a.iter().enumerate() {
        let exact = keep_format::e8p::decode_e8p_ref(codes[j / 8])[j % 8] * 4.0;
        assert_eq!(v as f32, exact, "code {:#06x}", codes[j / 8]);
        assert!((-11..=11).contains(&v));
    }
    // The vector E8P decoder: every code, at several alignments (the scalar tail included).
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::detected() >= crate::cpu::Level::Avx512 {
        for skip in [0usize, 3, 13] {
            let cs = &codes[skip..];
            let mut v = vec![0i8; cs.len() * 8];
            // SAFETY: AVX-512 checked above; `v` has room for every code.
            unsafe { x86::decode_e8p_test(false, cs, &mut v) };
            assert_eq!(v, a[skip * 8..], "offset {skip}");
            // SAFETY: as above.
            unsafe { x86::decode_e8p_test(true, cs, &mut v) };
            assert!(v
                .iter()
                .zip(&a[skip * 8..])
                .all(|(b, w)| (*b as u8 ^ 0x80) as i8 == *w));
        }
    }
    // A CPU with VNNI and VBMI runs (and these tests force) the VBMI level.
    if crate::cpu::has_avx512_vnni() && crate::cpu::has_avx512_vbmi() {
        assert!(int_levels_available().contains(&IntLevel::Avx512VnniVbmi));
    }
    // The VBMI decoder: every code, at alignments and lengths that leave every partial
    // group of 64 codes and of 8 (the masked loads and stores), bytes past the end untouched.
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_vbmi() {
        for (skip, len) in [(0usize, 65536usize), (3, 65533), (13, 70), (5, 1), (64, 63)] {
            let cs = &codes[skip..skip + len];
            for biased in [false, true] {
                let mut v = vec![0x55i8; cs.len() * 8 + 64];
                // SAFETY: VBMI checked above; `v` has room for every code.
                unsafe { x86::decode_e8p_vbmi_test(biased, cs, &mut v) };
                let flip = if biased { 0x80u8 } else { 0 };
                let want: Vec<i8> = a[skip * 8..(skip + len) * 8]
                    .iter()
                    .map(|&w| (w as u8 ^ flip) as i8)
                    .collect();
                assert_eq!(v[..len * 8], want[..], "offset {skip} len {len} {biased}");
                assert!(
                    v[len * 8..].iter().all(|&b| b == 0x55),
                    "wrote past the end"
                );
            }
        }
    }
    // E81: every code, and the half-unit codeword is an integer in [-4, 4]; the AVX-512 row
    // kernels' `w + 128` form is the same bytes with the sign bit flipped.
    let codes: Vec<u8> = (0..=255u8).collect();
    let src = IntSrc::E81 {
        codes: &codes,
        scales: &sc,
    };
    let n = codes.len() * 8;
    let (mut a, mut b) = (vec![0i8; n], vec![0i8; n]);
    src.decode_row_ref(0, n, &mut a);
    src.decode_row_fast(0, n, &mut b);
    assert_eq!(a, b);
    for (j, &v) in a.iter().enumerate() {
        let exact = keep_format::e81::decode_e81_ref(codes[j / 8])[j % 8] * 2.0;
        assert_eq!(v as f32, exact, "e81 code {}", j / 8);
        assert!((-4..=4).contains(&v));
    }
    let mut f = [0f32; 64];
    src.block_factors(0, n, &mut f);
    assert!(f.iter().all(|&v| v == 1.0));
    assert_eq!(src.post(0), Some(0.5));
    #[cfg(target_arch = "x86_64")]
    {
        let mut v = vec![0i8; n];
        x86::decode_e81_biased(&codes, &mut v);
        assert!(v.iter().zip(&a).all(|(b, w)| (*b as u8 ^ 0x80) as i8 == *w));
    }
    // The VBMI E81 decoder: every code, at alignments and lengths that leave every partial
    // group of 64 codes and of 8 (the masked loads and stores), bytes past the end untouched.
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_vbmi() {
        let codes: Vec<u8> = (0..1000u32).map(|j| (j * 37 + j / 256) as u8).collect();
        let src = IntSrc::E81 {
            codes: &codes,
            scales: &sc,
        };
        let mut a = vec![0i8; codes.len() * 8];
        src.decode_row_ref(0, a.len(), &mut a);
        for (skip, len) in [
            (0usize, 1000usize),
            (0, 256),
            (3, 997),
            (13, 70),
            (5, 1),
            (64, 63),
        ] {
            let cs = &codes[skip..skip + len];
            for biased in [false, true] {
                let mut v = vec![0x55i8; cs.len() * 8 + 64];
                // SAFETY: VBMI checked above; `v` has room for every code.
                unsafe { x86::decode_e81_vbmi_test(biased, cs, &mut v) };
                let flip = if biased { 0x80u8 } else { 0 };
                let want: Vec<i8> = a[skip * 8..(skip + len) * 8]
                    .iter()
                    .map(|&w| (w as u8 ^ flip) as i8)
                    .collect();
                assert_eq!(
                    v[..len * 8],
                    want[..],
                    "e81 offset {skip} len {len} {biased}"
                );
                assert!(
                    v[len * 8..].iter().all(|&b| b == 0x55),
                    "e81 wrote past the end"
                );
            }
        }
    }
    // E8M0 halves.
    for e in 0..=255u8 {
        let h = e8m0_half(e);
        let s = keep_format::e8m0::e8m0_to_f32_ref(e);
        assert!((h * 2.0 == s) || (h.is_nan() && s.is_nan()), "e8m0 {e}");
    }
}

/// Every available level against the scalar level (bits), the scalar level against the f64
/// reference on the dequantized activations, and row independence.
pub(super) fn compare(
    src: &IntSrc,
    rows: usize,
    cols: usize,
    exact: &dyn Fn(&[f32], usize) -> Vec<f32>,
    rng: &mut Rng,
) {
    // From GEMM_MIN_M on, the VNNI level runs the GEMM: odd M across its tile sizes.
    compare_at(
        src,
        rows,
        cols,
        exact,
        rng,
        &[1, 2, 3, 4, 5, 7, 8, 13, 32, GEMM_MIN_M, 38, 45],
    )
}

/// [`compare`] at the activation row counts `ms`.
fn compare_at(
    src: &IntSrc,
    rows: usize,
    cols: usize,
    exact: &dyn Fn(&[f32], usize) -> Vec<f32>,
    rng: &mut Rng,
    ms: &[usize],
) {
    for &m in ms {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let a = Q8Acts::quantize(&x, m, cols).unwrap();
        let xd = a.dequantize();
        let want = exact(&xd, m);
        let mut base = vec![0f32; m * rows];
        int_matmul_at(IntLevel::Scalar, src, rows, &a, &mut base).unwrap();
        for i in 0..m {
            for o in 0..rows {
                let (p, q) = (want[i * rows + o], base[i * rows + o]);
                let mag = exact_mag(&xd[i * cols..(i + 1) * cols], src, o, cols) + 1e-30;
                assert!((p - q).abs() <= REL_TOL * mag, "m={m} ({i},{o}) {p} vs {q}");
            }
        }
        for lv in int_levels_available() {
            let mut f = vec![0f32; m * rows];
            int_matmul_at(lv, src, rows, &a, &mut f).unwrap();
            let same = f.iter().zip(&base).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{lv:?} {rows}x{cols} m={m}: not bit-identical to scalar"
            );
            for i in [0, m / 2, m - 1] {
                let one_a = Q8Acts::quantize(&x[i * cols..(i + 1) * cols], 1, cols).unwrap();
                let mut one = vec![0f32; rows];
                int_matmul_at(lv, src, rows, &one_a, &mut one).unwrap();
                assert_eq!(
                    one,
                    f[i * rows..(i + 1) * rows],
                    "{lv:?}: row {i} of {m} alone"
                );
            }
        }
    }
}

/// Σ_j |x_j · w_j| for weight row `o`, from the integer decoder and the factors (affine-8:
/// from the definition).
fn exact_mag(x: &[f32], src: &IntSrc, o: usize, cols: usize) -> f32 {
    if let IntSrc::Affine8 { q, scales, biases } = *src {
        let v = crate::affine::Affine8View::new(q, scales, biases, q.len() / cols, cols).unwrap();
        return (0..cols).map(|j| (x[j] * v.get_ref(o, j)).abs()).sum();
    }
    if let IntSrc::Affine4 { q, scales, biases } = *src {
        let v = WeightView::mlx_affine(4, q, scales, biases, 2 * q.len() / cols, cols).unwrap();
        return (0..cols).map(|j| (x[j] * v.get_ref(o, j)).abs()).sum();
    }
    let mut w = vec![0i8; cols];
    src.decode_row_ref(o, cols, &mut w);
    let mut f = vec![0f32; cols / QBLOCK];
    src.block_factors(o, cols, &mut f);
    let post = src.post(o).unwrap_or(1.0);
    (0..cols)
        .map(|j| (x[j] * w[j] as f32 * f[j / QBLOCK] * post).abs())
        .sum()
}

#[test]
fn every_level_matches_the_contract_on_odd_shapes() {
    let mut rng = Rng::new(0x5EED_1234_ABCD_0001);
    for &(rows, cols) in &[
        (1, 32),
        (3, 64),
        (17, 96),
        (5, 128),
        (33, 160),
        (9, 256),
        (70, 1056),
        (21, 1088),
    ] {
        let p = rng.bytes(rows * cols / 2);
        let s = rng.scales(rows * cols / 32);
        let w = WeightView::mxfp4(&p, &s, rows, cols).unwrap();
        let src = IntSrc::from_view(&w).unwrap();
        let exact = |x: &[f32], m: usize| {
            let mut o = vec![0f32; m * rows];
            matmul_ref(x, m, &w, &mut o).unwrap();
            o
        };
        compare(&src, rows, cols, &exact, &mut rng);
        let codes: Vec<u16> = (0..rows * cols / 8).map(|_| rng.next() as u16).collect();
        let scales: Vec<f32> = (0..rows).map(|_| rng.f() * 0.1 + 0.001).collect();
        let e = E8pView::new(&codes, &scales, rows, cols).unwrap();
        let src = IntSrc::from_e8p(&e).unwrap();
        let exact = |x: &[f32], m: usize| {
            let mut o = vec![0f32; m * rows];
            crate::e8p::e8p_matmul_ref(x, m, &e, &mut o).unwrap();
            o
        };
        compare(&src, rows, cols, &exact, &mut rng);
        if cols.is_multiple_of(crate::affine::AFFINE8_GROUP) {
            let q = rng.bytes(rows * cols);
            let ng = rows * cols / crate::affine::AFFINE8_GROUP;
            // MLX-like groups: scale (max − min) / 255 > 0, bias the group's minimum.
            let sc: Vec<u8> = (0..ng)
                .flat_map(|_| {
                    crate::bf16dot::f32_to_bf16_rne(rng.f().abs() * 0.01 + 1e-4).to_le_bytes()
                })
                .collect();
            let bi: Vec<u8> = (0..ng)
                .flat_map(|_| crate::bf16dot::f32_to_bf16_rne(rng.f() * 0.5).to_le_bytes())
                .collect();
            let v = crate::affine::Affine8View::new(&q, &sc, &bi, rows, cols).unwrap();
            let src = IntSrc::from_affine8(&v);
            let exact = |x: &[f32], m: usize| {
                let mut o = vec![0f32; m * rows];
                crate::affine::affine8_matmul_ref(x, m, &v, &mut o).unwrap();
                o
            };
            compare(&src, rows, cols, &exact, &mut rng);
        }
    }
}

/// E81 residual stages (`IntSrc::E81`) on every level against the scalar contract and the
/// f64 reference, on odd shapes, at M from 1 past the E8P GEMM threshold to 64.
#[test]
fn e81_every_level_matches_the_contract() {
    let mut rng = Rng::new(0x5EED_0E81_0002);
    for &(rows, cols) in &[(1, 32), (3, 64), (17, 96), (33, 160), (9, 256), (21, 1088)] {
        let codes = rng.bytes(rows * cols / 8);
        let scales: Vec<f32> = (0..rows).map(|_| rng.f() * 0.1 + 0.001).collect();
        let src = IntSrc::E81 {
            codes: &codes,
            scales: &scales,
        };
        let exact = |x: &[f32], m: usize| {
            let mut o = vec![0f32; m * rows];
            let mut w = vec![0f32; cols];
            for r in 0..rows {
                keep_format::e81::decode_e81_row_ref(
                    &codes[r * cols / 8..(r + 1) * cols / 8],
                    scales[r],
                    &mut w,
                )
                .unwrap();
                for i in 0..m {
                    let xi = &x[i * cols..(i + 1) * cols];
                    let acc: f64 = xi.iter().zip(&w).map(|(&a, &b)| a as f64 * b as f64).sum();
                    o[i * rows + r] = acc as f32;
                }
            }
            o
        };
        let ms = [
            1,
            2,
            E8P_GEMM_MIN_M - 1,
            E8P_GEMM_MIN_M,
            7,
            8,
            32,
            GEMM_MIN_M,
            64,
        ];
        compare_at(&src, rows, cols, &exact, &mut rng, &ms);
    }
}

#[test]
fn extreme_scales_and_special_inputs() {
    // Scale bytes 0, 1, 200 in one row and NaN (0xFF) in the other; inputs with zero and NaN blocks.
    let (rows, cols) = (2, 192);
    let mut rng = Rng::new(99);
    let p = rng.bytes(rows * cols / 2);
    let s = vec![0u8, 1, 200, 127, 127, 130, 127, 0xFF, 127, 127, 127, 127];
    let w = WeightView::mxfp4(&p, &s, rows, cols).unwrap();
    let src = IntSrc::from_view(&w).unwrap();
    let mut x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
    x[32..64].iter_mut().for_each(|v| *v = 0.0);
    let a = Q8Acts::quantize(&x, 1, cols).unwrap();
    let mut base = vec![0f32; rows];
    int_matmul_at(IntLevel::Scalar, &src, rows, &a, &mut base).unwrap();
    assert!(base[0].is_finite() && base[1].is_nan(), "{base:?}");
    for lv in int_levels_available() {
        let mut f = vec![0f32; rows];
        int_matmul_at(lv, &src, rows, &a, &mut f).unwrap();
        assert_eq!(f[0].to_bits(), base[0].to_bits(), "{lv:?}");
        assert!(f[1].is_nan());
    }
    x[70] = f32::NAN;
    let mut o = vec![0f32; rows];
    int_matmul(&x, 1, &src, rows, cols, &mut o).unwrap();
    assert!(o.iter().all(|v| v.is_nan()));
}

#[test]
fn threaded_and_many_equal_one_thread() {
    let mut rng = Rng::new(7);
    let (rows, cols) = (1037, 4128);
    assert!(rows * cols >= crate::cpu::PAR_MIN_MACS);
    let (p, sc) = (rng.bytes(rows * cols / 2), rng.scales(rows * cols / 32));
    let w = WeightView::mxfp4(&p, &sc, rows, cols).unwrap();
    let src = IntSrc::from_view(&w).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    for m in [1, 3] {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut threaded = vec![0f32; m * rows];
        pool.install(|| int_matmul(&x, m, &src, rows, cols, &mut threaded).unwrap());
        let a = Q8Acts::quantize(&x, m, cols).unwrap();
        let mut serial = vec![0f32; m * rows];
        // SAFETY: serial has m*rows elements; one thread.
        unsafe { rows_at(int_level(), &src, &a, 0, rows, serial.as_mut_ptr(), rows) };
        assert_eq!(threaded, serial, "m = {m}");
        // The same product twice in one batch (shared quantized input) and an E8P job.
        let codes: Vec<u16> = (0..rows * cols / 8).map(|_| rng.next() as u16).collect();
        let scales: Vec<f32> = (0..rows).map(|_| rng.f()).collect();
        let e = E8pView::new(&codes, &scales, rows, cols).unwrap();
        let esrc = IntSrc::from_e8p(&e).unwrap();
        let (mut o1, mut o2, mut o3) = (
            vec![0f32; m * rows],
            vec![0f32; m * rows],
            vec![0f32; m * rows],
        );
        {
            let mut jobs = vec![
                IntJob {
                    w: src,
                    rows,
                    cols,
                    x: &x,
                    m,
                    out: &mut o1,
                },
                IntJob {
                    w: src,
                    rows,
                    cols,
                    x: &x,
                    m,
                    out: &mut o2,
                },
                IntJob {
                    w: esrc,
                    rows,
                    cols,
                    x: &x,
                    m,
                    out: &mut o3,
                },
            ];
            pool.install(|| int_matmul_many(&mut jobs).unwrap());
        }
        assert_eq!(o1, serial);
        assert_eq!(o2, serial);
        let mut e1 = vec![0f32; m * rows];
        int_matmul(&x, m, &esrc, rows, cols, &mut e1).unwrap();
        assert_eq!(o3, e1);
    }
    // Affine-8: threaded equals one thread, and `matmul_many_with(Fast)` routes it here.
    let (rows, cols) = (517, 4096);
    assert!(rows * cols >= crate::cpu::PAR_MIN_MACS);
    let q = rng.bytes(rows * cols);
    let ng = rows * cols / crate::affine::AFFINE8_GROUP;
    let bf = |v: f32| crate::bf16dot::f32_to_bf16_rne(v).to_le_bytes();
    let sc: Vec<u8> = (0..ng).flat_map(|_| bf(rng.f().abs() * 0.01)).collect();
    let bi: Vec<u8> = (0..ng).flat_map(|_| bf(rng.f())).collect();
    let v = crate::affine::Affine8View::new(&q, &sc, &bi, rows, cols).unwrap();
    let src = IntSrc::from_affine8(&v);
    for m in [1, 3] {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut threaded = vec![0f32; m * rows];
        pool.install(|| int_matmul(&x, m, &src, rows, cols, &mut threaded).unwrap());
        let a = Q8Acts::quantize(&x, m, cols).unwrap();
        let mut serial = vec![0f32; m * rows];
        // SAFETY: serial has m*rows elements; one thread.
        unsafe { rows_at(int_level(), &src, &a, 0, rows, serial.as_mut_ptr(), rows) };
        assert_eq!(threaded, serial, "affine-8 m = {m}");
        let mut via = vec![0f32; m * rows];
        {
            let mut jobs = vec![crate::simd::Job {
                w: crate::simd::Src::affine8(&v),
                rows,
                cols,
                x: &x,
                m,
                out: &mut via,
            }];
            pool.install(|| {
                crate::matmul::matmul_many_with(crate::Kernels::Fast, &mut jobs).unwrap()
            });
        }
        assert_eq!(via, serial, "affine-8 through matmul_many_with");
    }
}

#[test]
fn bad_operands_are_errors() {
    let p = vec![0u8; 16];
    let s = vec![127u8; 1];
    let src = IntSrc::Mxfp4 {
        packed: &p,
        scales: &s,
    };
    let mut o = [0f32; 1];
    assert!(int_matmul(&[0.0; 32], 1, &src, 1, 32, &mut o).is_ok());
    assert!(int_matmul(&[0.0; 31], 1, &src, 1, 32, &mut o).is_err());
    assert!(int_matmul(&[0.0; 64], 1, &src, 1, 64, &mut [0f32; 1]).is_err());
    assert!(int_matmul(&[0.0; 32], 1, &src, 2, 32, &mut [0f32; 2]).is_err());
}

/// Manual single-thread timing (`KEEP_PRINT_M=1,32,33,128 cargo test --release -p keep-kernels
/// intdot::tests::print -- --ignored --nocapture`; M defaults to 1,4,8,32): GB/s of weight
/// bytes and GFLOP/s, exact kernels beside integer ones at every level; asserts nothing.
#[test]
#[ignore]
fn print_single_thread_gbps() {
    use std::time::Instant;
    let (rows, cols) = (2048usize, 7168usize);
    let mut rng = Rng::new(5);
    let p = rng.bytes(rows * cols / 2);
    let sc = rng.scales(rows * cols / 32);
    let w = WeightView::mxfp4(&p, &sc, rows, cols).unwrap();
    let codes: Vec<u16> = (0..rows * cols / 8).map(|_| rng.next() as u16).collect();
    let escales: Vec<f32> = (0..rows).map(|_| rng.f()).collect();
    let e = E8pView::new(&codes, &escales, rows, cols).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let q = rng.bytes(rows * cols);
    let ng = rows * cols / crate::affine::AFFINE8_GROUP;
    let sb: Vec<u8> = (0..ng)
        .flat_map(|_| crate::bf16dot::f32_to_bf16_rne(2e-4).to_le_bytes())
        .collect();
    let bb: Vec<u8> = (0..ng)
        .flat_map(|_| crate::bf16dot::f32_to_bf16_rne(-0.0255).to_le_bytes())
        .collect();
    let af = crate::affine::Affine8View::new(&q, &sb, &bb, rows, cols).unwrap();
    let m_list: Vec<usize> = std::env::var("KEEP_PRINT_M")
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|_| vec![1, 4, 8, 32]);
    for m in m_list {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut out = vec![0f32; m * rows];
        let time = |f: &mut dyn FnMut()| {
            let mut best = f64::INFINITY;
            for _ in 0..if m > 32 { 3 } else { 10 } {
                let t = Instant::now();
                f();
                best = best.min(t.elapsed().as_secs_f64());
            }
            best
        };
        let nb4 = w.nbytes() as f64;
        let nb2 = e.nbytes() as f64;
        pool.install(|| {
            if m <= 32 {
                let t = time(&mut || crate::simd::matmul_fast(&x, m, &w, &mut out).unwrap());
                println!("m={m} mxfp4 exact: {:.2} GB/s", nb4 / t / 1e9);
                let t = time(&mut || crate::e8p::e8p_matmul(&x, m, &e, &mut out).unwrap());
                println!("m={m} e8p exact: {:.2} GB/s", nb2 / t / 1e9);
            }
            // The scalar level only at small M (it is slow).
            for lv in int_levels_available()
                .into_iter()
                .filter(|&l| m <= 8 || l >= IntLevel::Avx512)
            {
                for (name, src, nb) in [
                    ("mxfp4", IntSrc::from_view(&w).unwrap(), nb4),
                    ("e8p", IntSrc::from_e8p(&e).unwrap(), nb2),
                    (
                        "affine8",
                        IntSrc::from_affine8(&af),
                        (rows * cols * 17 / 16) as f64,
                    ),
                ] {
                    let t = time(&mut || {
                        let a = Q8Acts::quantize(&x, m, cols).unwrap();
                        int_matmul_at(lv, &src, rows, &a, &mut out).unwrap()
                    });
                    let gf = 2.0 * (m * rows * cols) as f64 / t / 1e9;
                    println!(
                        "m={m} {name} int {}: {:.2} GB/s {gf:.1} GFLOP/s",
                        lv.name(),
                        nb / t / 1e9
                    );
                }
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_row_factors_equal_scalar_on_every_scale_byte() {
    if crate::cpu::detected() < crate::cpu::Level::Avx512 {
        return;
    }
    // MXFP4: every E8M0 byte (0, 1 and 0xFF are special), 16 at a time and in the tail.
    let cols = 32 * 260;
    let scales: Vec<u8> = (0..cols / 32).map(|b| (b % 256) as u8).collect();
    let packed = vec![0u8; cols / 2];
    let src = IntSrc::Mxfp4 {
        packed: &packed,
        scales: &scales,
    };
    let (mut a, mut b) = (vec![0f32; cols / 32], vec![0f32; cols / 32]);
    src.block_factors(0, cols, &mut a);
    // SAFETY: the CPU has AVX-512 (checked above).
    unsafe { x86::block_factors_avx512(&src, 0, cols, &mut b) };
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    // Affine-8: random bf16 scales and biases (infinities and NaN included), odd group count.
    let mut rng = Rng::new(3);
    let cols = 64 * 37;
    let ng = cols / 64;
    let mut sc = rng.bytes(2 * ng);
    sc[1] = 0x7F;
    sc[0] = 0x80; // +inf
    let bi = rng.bytes(2 * ng);
    let q = vec![0u8; cols];
    let src = IntSrc::Affine8 {
        q: &q,
        scales: &sc,
        biases: &bi,
    };
    let nb = cols / 32;
    let (mut a, mut b) = (vec![0f32; nb], vec![0f32; nb]);
    src.block_factors(0, cols, &mut a);
    // SAFETY: as above.
    unsafe { x86::block_factors_avx512(&src, 0, cols, &mut b) };
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    src.bias_blocks(0, cols, &mut a);
    // SAFETY: as above.
    unsafe { x86::bias_blocks_avx512(&src, 0, cols, &mut b) };
    let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    assert!(a.iter().zip(&b).all(|(x, y)| same(*x, *y)));
}

/// CPU time of the calling thread in seconds (`CLOCK_THREAD_CPUTIME_ID`): on a shared,
/// loaded machine it counts only the cycles this thread ran, unlike wall time.
#[cfg(target_os = "linux")]
fn thread_cpu_s() -> f64 {
    extern "C" {
        fn clock_gettime(clk: i32, tp: *mut [i64; 2]) -> i32;
    }
    let mut t = [0i64; 2];
    // SAFETY: `t` is a valid timespec-sized buffer; clock 3 is CLOCK_THREAD_CPUTIME_ID.
    unsafe { clock_gettime(3, &mut t) };
    t[0] as f64 + t[1] as f64 * 1e-9
}

/// Where one thread's time goes at decode shapes, timed by thread CPU time (so it means
/// something on a busy machine; the caches are still shared): `KEEP_PRINT_M=1,8,32 cargo
/// test --release -p keep-kernels intdot::tests::print_cpu -- --ignored --nocapture`. E8P:
/// the row decode alone (the 512 KiB table and the vector decoder), the activation
/// quantization, and whole products per level; MXFP8: the bf16 kernels. Asserts nothing.
#[cfg(target_os = "linux")]
#[test]
#[ignore]
fn print_cpu_time_breakdown() {
    // One pool thread runs everything (nested rayon work stays on it), timed from inside.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(cpu_time_breakdown);
}

#[cfg(target_os = "linux")]
fn cpu_time_breakdown() {
    use crate::bf16dot::{bf_levels_available, bf_matmul_at, Bf16Acts, BfSrc};
    let (rows, cols) = (2048usize, 4096usize);
    let mut rng = Rng::new(9);
    let codes: Vec<u16> = (0..rows * cols / 8).map(|_| rng.next() as u16).collect();
    let escales: Vec<f32> = (0..rows).map(|_| rng.f()).collect();
    let e = E8pView::new(&codes, &escales, rows, cols).unwrap();
    let esrc = IntSrc::from_e8p(&e).unwrap();
    let q8: Vec<u8> = (0..rows * cols)
        .map(|_| {
            let b = rng.next() as u8;
            if b & 0x7F == 0x7F {
                b ^ 1
            } else {
                b
            }
        })
        .collect();
    let mx: Vec<u8> = (0..rows * cols / 32)
        .map(|_| 117 + (rng.next() % 4) as u8)
        .collect();
    let mv = WeightView::mxfp8(&q8, &mx, rows, cols).unwrap();
    let msrc = BfSrc::from_view(&mv).unwrap();
    let p4 = rng.bytes(rows * cols / 2);
    let fv = WeightView::mxfp4(&p4, &mx, rows, cols).unwrap();
    let fsrc = IntSrc::from_view(&fv).unwrap();
    let reps: usize = std::env::var("KEEP_PRINT_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(31);
    let time = |f: &mut dyn FnMut()| {
        f();
        let mut best = f64::INFINITY;
        for _ in 0..reps {
            let t = thread_cpu_s();
            f();
            best = best.min(thread_cpu_s() - t);
        }
        best
    };
    let ns_w = |t: f64| t * 1e9 / (rows * cols) as f64;
    let mut buf = vec![0i8; cols];
    let t = time(&mut || {
        for r in 0..rows {
            esrc.decode_row_fast(r, cols, &mut buf);
            std::hint::black_box(&buf);
        }
    });
    println!("e8p decode, 512 KiB table: {:.4} ns/weight", ns_w(t));
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::detected() >= crate::cpu::Level::Avx512 {
        let t = time(&mut || {
            for r in 0..rows {
                let kc = cols / 8;
                // SAFETY: AVX-512 checked; `buf` holds a row.
                unsafe { x86::decode_e8p_test(true, &codes[r * kc..(r + 1) * kc], &mut buf) };
                std::hint::black_box(&buf);
            }
        });
        println!("e8p decode, vector (gather): {:.4} ns/weight", ns_w(t));
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::has_avx512_vbmi() {
        let t = time(&mut || {
            for r in 0..rows {
                let kc = cols / 8;
                // SAFETY: VBMI checked; `buf` holds a row.
                unsafe { x86::decode_e8p_vbmi_test(true, &codes[r * kc..(r + 1) * kc], &mut buf) };
                std::hint::black_box(&buf);
            }
        });
        println!("e8p decode, vector (VBMI planes): {:.4} ns/weight", ns_w(t));
    }
    let m_list: Vec<usize> = std::env::var("KEEP_PRINT_M")
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or_else(|_| vec![1, 8, 32]);
    for m in m_list {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let mut out = vec![0f32; m * rows];
        let t = time(&mut || {
            std::hint::black_box(Q8Acts::quantize(&x, m, cols).unwrap());
        });
        println!("m={m} int8 activation quantization: {:.1} us", t * 1e6);
        let a = Q8Acts::quantize(&x, m, cols).unwrap();
        for lv in int_levels_available()
            .into_iter()
            .filter(|&l| l >= IntLevel::Avx2)
        {
            let t = time(&mut || int_matmul_at(lv, &esrc, rows, &a, &mut out).unwrap());
            println!(
                "m={m} e8p {}: {:.4} ns/weight/row-of-M, {:.2} GB/s of codes at one core",
                lv.name(),
                ns_w(t) / m as f64,
                (rows * cols / 4) as f64 / t / 1e9
            );
        }
        for lv in int_levels_available()
            .into_iter()
            .filter(|&l| l >= IntLevel::Avx2)
        {
            let t = time(&mut || int_matmul_at(lv, &fsrc, rows, &a, &mut out).unwrap());
            println!(
                "m={m} mxfp4 {}: {:.4} ns/weight/row-of-M, {:.2} GB/s at one core",
                lv.name(),
                ns_w(t) / m as f64,
                fv.nbytes() as f64 / t / 1e9
            );
        }
        let ba = Bf16Acts::round(&x, m, cols).unwrap();
        for lv in bf_levels_available().into_iter().skip(1) {
            let t = time(&mut || bf_matmul_at(lv, &msrc, rows, &ba, &mut out).unwrap());
            println!(
                "m={m} mxfp8 {:?}: {:.4} ns/weight, {:.2} GB/s at one core",
                lv,
                ns_w(t) / m as f64,
                mv.nbytes() as f64 / t / 1e9
            );
        }
    }
}

#[test]
fn mx4_order_is_a_permutation_of_each_row() {
    for cols in [32usize, 96, 128, 160, 256, 1056, 4128] {
        let mut seen = vec![false; cols];
        for j in 0..cols {
            let k = mx4_order(j, cols);
            assert!(k < cols && !seen[k], "cols {cols}: {j} -> {k}");
            seen[k] = true;
            // Within a whole group of four blocks, both halves of the 32-bit lanes stay in
            // one block and one group of four columns.
            if (j / 128 + 1) * 128 <= cols {
                assert_eq!(k / 4 % 8 / 4, j / 64 % 2, "cols {cols}: {j} -> {k}");
            } else {
                assert_eq!(k, j);
            }
        }
    }
    for cols in [32usize, 160, 256, 4128] {
        for m in [1usize, 3] {
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 37 % 101) as f32) - 50.0)
                .collect();
            let a = Q8Acts::quantize(&x, m, cols).unwrap();
            assert_eq!((a.qmx4.len(), a.n12mx4.len()), (m * cols, m * cols / 4));
            for i in 0..m {
                for j in 0..cols {
                    let want = a.q[i * cols + mx4_order(j, cols)];
                    assert_eq!(a.qmx4[i * cols + j], want, "cols {cols}: ({i}, {j})");
                }
            }
            for (k, n) in a.n12mx4.iter().enumerate() {
                let s: i32 = (0..4).map(|e| a.qmx4[4 * k + e] as i32).sum();
                assert_eq!(*n, -12 * s);
            }
        }
    }
    // The GEMM does not read them.
    let a = Q8Acts::quantize(&vec![1.0; GEMM_MIN_M * 32], GEMM_MIN_M, 32).unwrap();
    assert!(a.qmx4.is_empty() && a.n12mx4.is_empty());
}

/// Two-level activations ([`ActLevels::Two`]): row `i` of a product is the sum of the
/// contract's results on its two levels (the level-one row exactly what one level gives, the
/// residual row quantized from `x − q₁·d₁`), it depends on nothing but row `i` (any `m`, any
/// batch, threaded or not, every level), and its distance from the exact product is far below
/// one level's on heavy-tailed rows (a few large values per block, as SwiGLU outputs have).
#[test]
fn two_level_activations_are_the_sum_of_their_levels_and_closer_to_exact() {
    let mut rng = Rng::new(0x5EED_2222_0003);
    let (rows, cols) = (67, 4096);
    let p = rng.bytes(rows * cols / 2);
    let s = rng.scales(rows * cols / 32);
    let w = WeightView::mxfp4(&p, &s, rows, cols).unwrap();
    let src = IntSrc::from_view(&w).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    // Heavy-tailed rows: mostly small values, one large one per 32.
    let heavy = |rng: &mut Rng, n: usize| -> Vec<f32> {
        (0..n)
            .map(|j| {
                let v = rng.f() * 0.05;
                if j % 32 == 7 {
                    v * 400.0
                } else {
                    v
                }
            })
            .collect()
    };
    let all = heavy(&mut rng, 45 * cols);
    let two = |x: &[f32], m: usize| {
        let mut out = vec![0f32; m * rows];
        let mut jobs = [IntJob {
            w: src,
            rows,
            cols,
            x,
            m,
            out: &mut out,
        }];
        pool.install(|| int_matmul_many_levels(ActLevels::Two, &mut jobs).unwrap());
        out
    };
    for m in [1usize, 2, 5, GEMM_MIN_M / 2 + 1, 45] {
        let x = &all[..m * cols];
        let got = two(x, m);
        // The definition: the level-one rows and the residual rows through the contract.
        let a = Q8Acts::quantize(x, m, cols).unwrap();
        let resid: Vec<f32> = x
            .iter()
            .zip(a.dequantize())
            .map(|(&v, dq)| v - dq)
            .collect();
        let r = Q8Acts::quantize(&resid, m, cols).unwrap();
        for lv in int_levels_available() {
            let (mut y1, mut y2) = (vec![0f32; m * rows], vec![0f32; m * rows]);
            int_matmul_at(lv, &src, rows, &a, &mut y1).unwrap();
            int_matmul_at(lv, &src, rows, &r, &mut y2).unwrap();
            let want: Vec<f32> = y1.iter().zip(&y2).map(|(a, b)| a + b).collect();
            assert_eq!(got, want, "{lv:?} m = {m}");
        }
        // Row independence: each row alone gives the same bits.
        for i in [0, m - 1] {
            assert_eq!(
                two(&x[i * cols..(i + 1) * cols], 1),
                got[i * rows..(i + 1) * rows]
            );
        }
        // Closer to the exact product than one level, by far.
        let mut exact = vec![0f32; m * rows];
        matmul_ref(x, m, &w, &mut exact).unwrap();
        let mut one = vec![0f32; m * rows];
        int_matmul(x, m, &src, rows, cols, &mut one).unwrap();
        let err = |y: &[f32]| -> f64 {
            y.iter()
                .zip(&exact)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        };
        let (e1, e2) = (err(&one), err(&got));
        assert!(
            e2 * 1e3 < e1,
            "m = {m}: two levels {e2:e}, one level {e1:e}"
        );
    }
}
