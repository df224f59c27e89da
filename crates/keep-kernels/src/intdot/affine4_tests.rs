//! Tests of the MLX affine-4 integer kernels: the nibble decoders against MLX's packing
//! (`keep_format::mlx_affine`), every forced level bit-identical to the scalar contract on odd
//! shapes (rows not a multiple of any row tile, `cols = 64·k` with and without tail blocks)
//! and M = 1..45 (the GEMM from [`GEMM_MIN_M`] on), the scalar level against the exact f32
//! kernel on the dequantized activations, and threaded / batched / `matmul_with` calls equal
//! to one thread.

use super::tests::compare;
use super::*;
use crate::matmul::matmul_ref;
use crate::test_rng::Rng;

/// MLX-like affine-4 groups: `rows × cols/64` bf16 scales ((max − min) / 15 > 0) and biases
/// (the group minimum).
fn groups(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let ng = rows * cols / crate::affine::AFFINE8_GROUP;
    let bf = |v: f32| crate::bf16dot::f32_to_bf16_rne(v).to_le_bytes();
    let sc = (0..ng)
        .flat_map(|_| bf(rng.f().abs() * 0.02 + 1e-4))
        .collect();
    let bi = (0..ng).flat_map(|_| bf(rng.f() * 0.2)).collect();
    (sc, bi)
}

#[test]
fn nibble_decoders_equal_mlx_packing() {
    let mut rng = Rng::new(0xA4_0001);
    let (rows, cols) = (3, 448);
    let q = rng.bytes(rows * cols / 2);
    let (sc, bi) = groups(&mut rng, rows, cols);
    let src = IntSrc::Affine4 {
        q: &q,
        scales: &sc,
        biases: &bi,
    };
    for r in 0..rows {
        let row = &q[r * cols / 2..(r + 1) * cols / 2];
        let mut codes = vec![0u8; cols];
        keep_format::mlx_affine::unpack_row_ref(4, row, &mut codes).unwrap();
        let (mut a, mut b) = (vec![0i8; cols], vec![0i8; cols]);
        src.decode_row_ref(r, cols, &mut a);
        src.decode_row_fast(r, cols, &mut b);
        let want: Vec<i8> = codes.iter().map(|&c| c as i8).collect();
        assert_eq!(a, want, "reference decoder, row {r}");
        assert_eq!(b, want, "table decoder, row {r}");
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::detected() >= crate::cpu::Level::Avx512 {
            let mut v = vec![0i8; cols];
            // SAFETY: AVX-512 checked; `row` holds cols/2 bytes and `v` cols.
            unsafe { avx512_decode(row.as_ptr(), cols, &mut v) };
            assert_eq!(v, want, "vector decoder, row {r}");
        }
    }
    // Every byte value, through the same definitions.
    let all: Vec<u8> = (0..=255).collect();
    let mut codes = vec![0u8; 512];
    keep_format::mlx_affine::unpack_row_ref(4, &all, &mut codes).unwrap();
    let mut d = vec![0i8; 512];
    affine4::decode_nibbles(&all, &mut d);
    assert!(d.iter().zip(&codes).all(|(&a, &b)| a as u8 == b));
    // Block factors are the scales, the bias coefficients the biases (each group twice).
    let mut f = vec![0f32; cols / QBLOCK];
    let mut bb = vec![0f32; cols / QBLOCK];
    src.block_factors(1, cols, &mut f);
    assert!(src.bias_blocks(1, cols, &mut bb));
    for b in 0..cols / QBLOCK {
        let g = cols / 64 + b / 2;
        assert_eq!(f[b], crate::codec::bf16_at(&sc, g));
        assert_eq!(bb[b], crate::codec::bf16_at(&bi, g));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn avx512_decode(p: *const u8, cols: usize, w: &mut [i8]) {
    affine4_x86::decode_row_avx512(p, cols, w)
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_bias_blocks_equal_scalar() {
    if crate::cpu::detected() < crate::cpu::Level::Avx512 {
        return;
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    unsafe fn both(src: &IntSrc, r: usize, cols: usize, f: &mut [f32], b: &mut [f32]) {
        x86::block_factors_avx512(src, r, cols, f);
        x86::bias_blocks_avx512(src, r, cols, b);
    }
    let mut rng = Rng::new(0xA4_0002);
    for cols in [64, 192, 512, 576, 1088] {
        let rows = 3;
        let q = rng.bytes(rows * cols / 2);
        let (sc, bi) = groups(&mut rng, rows, cols);
        let src = IntSrc::Affine4 {
            q: &q,
            scales: &sc,
            biases: &bi,
        };
        let nb = cols / QBLOCK;
        for r in 0..rows {
            let (mut f, mut b, mut fv, mut bv) = (
                vec![0f32; nb],
                vec![0f32; nb],
                vec![0f32; nb],
                vec![0f32; nb],
            );
            src.block_factors(r, cols, &mut f);
            src.bias_blocks(r, cols, &mut b);
            // SAFETY: AVX-512 checked; the slices hold nb floats and src holds row r.
            unsafe { both(&src, r, cols, &mut fv, &mut bv) };
            assert_eq!(f, fv, "cols {cols} row {r}");
            assert_eq!(b, bv, "cols {cols} row {r}");
        }
    }
}

#[test]
fn every_level_matches_the_contract_on_odd_shapes() {
    let mut rng = Rng::new(0xA4_0003);
    // nb = cols/32 ≡ 2 (mod 4) leaves two tail blocks past the last whole group of four.
    for &(rows, cols) in &[
        (1, 64),
        (3, 128),
        (17, 192),
        (5, 320),
        (33, 256),
        (70, 1088),
        (21, 1024),
        (9, 1280),
        (4, 1344),
    ] {
        let q = rng.bytes(rows * cols / 2);
        let (sc, bi) = groups(&mut rng, rows, cols);
        let w = WeightView::mlx_affine(4, &q, &sc, &bi, rows, cols).unwrap();
        let src = IntSrc::from_view(&w).expect("MLX affine-4 has an integer form");
        assert!(matches!(src, IntSrc::Affine4 { .. }));
        let exact = |x: &[f32], m: usize| {
            let mut o = vec![0f32; m * rows];
            matmul_ref(x, m, &w, &mut o).unwrap();
            o
        };
        compare(&src, rows, cols, &exact, &mut rng);
    }
}

#[test]
fn special_inputs() {
    // A zero activation block, zero codes with a bias only, and a NaN activation.
    let mut rng = Rng::new(0xA4_0004);
    let (rows, cols) = (3, 192);
    let mut q = rng.bytes(rows * cols / 2);
    q[cols / 2..cols].iter_mut().for_each(|b| *b = 0);
    let (sc, bi) = groups(&mut rng, rows, cols);
    let w = WeightView::mlx_affine(4, &q, &sc, &bi, rows, cols).unwrap();
    let src = IntSrc::from_view(&w).unwrap();
    let mut x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
    x[32..64].iter_mut().for_each(|v| *v = 0.0);
    let a = Q8Acts::quantize(&x, 1, cols).unwrap();
    let mut base = vec![0f32; rows];
    int_matmul_at(IntLevel::Scalar, &src, rows, &a, &mut base).unwrap();
    // Row 1 is all zero codes: only the bias term, Σ_b b_g · d_b · S_b.
    let nb = cols / QBLOCK;
    let mut bb = vec![0f32; nb];
    src.bias_blocks(1, cols, &mut bb);
    assert_eq!(base[1].to_bits(), bias_term_ref(&bb, &a.ds).to_bits());
    for lv in int_levels_available() {
        let mut f = vec![0f32; rows];
        int_matmul_at(lv, &src, rows, &a, &mut f).unwrap();
        let same = f.iter().zip(&base).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{lv:?}");
    }
    x[70] = f32::NAN;
    let mut o = vec![0f32; rows];
    int_matmul(&x, 1, &src, rows, cols, &mut o).unwrap();
    assert!(o.iter().all(|v| v.is_nan()));
    // Wrong byte counts are errors, not panics.
    let short = IntSrc::Affine4 {
        q: &q[1..],
        scales: &sc,
        biases: &bi,
    };
    assert!(int_matmul_at(IntLevel::Scalar, &short, rows, &a, &mut o).is_err());
}

#[test]
fn threaded_batched_and_matmul_with_equal_one_thread() {
    let mut rng = Rng::new(0xA4_0005);
    let (rows, cols) = (517, 4096);
    assert!(rows * cols >= crate::cpu::PAR_MIN_MACS);
    let q = rng.bytes(rows * cols / 2);
    let (sc, bi) = groups(&mut rng, rows, cols);
    let w = WeightView::mlx_affine(4, &q, &sc, &bi, rows, cols).unwrap();
    let src = IntSrc::from_view(&w).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    for m in [1, 3, GEMM_MIN_M + 1] {
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let a = Q8Acts::quantize(&x, m, cols).unwrap();
        let mut serial = vec![0f32; m * rows];
        // SAFETY: serial has m*rows elements; one thread.
        unsafe { rows_at(int_level(), &src, &a, 0, rows, serial.as_mut_ptr(), rows) };
        let mut threaded = vec![0f32; m * rows];
        pool.install(|| int_matmul(&x, m, &src, rows, cols, &mut threaded).unwrap());
        assert_eq!(threaded, serial, "threaded m = {m}");
        let mut with = vec![0f32; m * rows];
        pool.install(|| {
            crate::matmul::matmul_with(crate::Kernels::Fast, &x, m, &w, &mut with).unwrap()
        });
        assert_eq!(with, serial, "matmul_with(Fast) m = {m}");
        let mut via = vec![0f32; m * rows];
        {
            let mut jobs = vec![crate::simd::Job {
                w: crate::simd::Src::view(&w),
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
        assert_eq!(via, serial, "matmul_many_with(Fast) m = {m}");
        // Decode equals prefill: each row alone is the same bits.
        for i in [0, m - 1] {
            let mut one = vec![0f32; rows];
            int_matmul(&x[i * cols..(i + 1) * cols], 1, &src, rows, cols, &mut one).unwrap();
            assert_eq!(
                one,
                serial[i * rows..(i + 1) * rows],
                "row {i} of {m} alone"
            );
        }
        // Exact kernels are untouched by the fast path.
        let mut ex = vec![0f32; m * rows];
        crate::matmul::matmul_with(crate::Kernels::Exact, &x, m, &w, &mut ex).unwrap();
        let mut want = vec![0f32; m * rows];
        crate::matmul::matmul(&x, m, &w, &mut want).unwrap();
        assert_eq!(ex, want);
    }
}
