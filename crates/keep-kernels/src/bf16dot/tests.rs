//! Tests of the bf16 kernels: the E4M3 → bf16 table on all 256 codes, the instruction model
//! against the hardware instruction on crafted and random lanes (denormals, ties, overflow),
//! every forced level bit-identical to the scalar contract on odd shapes and M = 1..32, and
//! the result against the exact f64 product of the bf16-rounded activations.

use super::*;
use crate::matmul::matmul_ref;
use crate::test_rng::Rng;

/// f32 accumulation over `cols` terms against the f64 reference, relative to Σ|x·w|.
const REL_TOL: f32 = 1e-5;

/// Equal bits, or both NaN (NaN payloads are not part of the contract).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[test]
fn e4m3_to_bf16_is_exact_on_all_256_codes() {
    for b in 0..=255u8 {
        let want = e4m3_to_f32_ref(b);
        let got = bf16_to_f32(E4M3_BF16[b as usize]);
        assert!(same(want, got), "code {b:#x}: {want} vs {got}");
        // Normal in bf16 (so the instruction's denormals-as-zero never touches a weight).
        if want != 0.0 && want.is_finite() {
            assert_ne!(
                E4M3_BF16[b as usize] & 0x7F80,
                0,
                "code {b:#x} is a bf16 denormal"
            );
        }
    }
}

#[test]
fn bf16_rounding_is_nearest_even() {
    assert_eq!(f32_to_bf16_rne(1.0), 0x3F80);
    // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even is 1.
    assert_eq!(f32_to_bf16_rne(1.0 + 2f32.powi(-8)), 0x3F80);
    // 1 + 3·2^-8 ties to 1 + 2^-6 (even mantissa).
    assert_eq!(f32_to_bf16_rne(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
    assert_eq!(
        f32_to_bf16_rne(1.0 + 2f32.powi(-8) + 2f32.powi(-20)),
        0x3F81
    );
    assert_eq!(f32_to_bf16_rne(f32::MAX), 0x7F80);
    assert_eq!(f32_to_bf16_rne(-0.0), 0x8000);
    assert!(bf16_to_f32(f32_to_bf16_rne(f32::NAN)).is_nan());
    let mut rng = Rng::new(5);
    for _ in 0..10_000 {
        let v = f32::from_bits(rng.next() as u32);
        if v.is_nan() {
            continue;
        }
        let h = bf16_to_f32(f32_to_bf16_rne(v)) as f64;
        // No bf16 neighbour is nearer.
        let up = bf16_to_f32(f32_to_bf16_rne(v).wrapping_add(1)) as f64;
        let dn = bf16_to_f32(f32_to_bf16_rne(v).wrapping_sub(1)) as f64;
        let e = (h - v as f64).abs();
        if h.is_finite() && up.is_finite() && dn.is_finite() {
            assert!(
                e <= (up - v as f64).abs() && e <= (dn - v as f64).abs(),
                "{v}"
            );
        }
    }
}

#[test]
fn instruction_model_rounds_and_flushes() {
    let h = f32_to_bf16_rne;
    // Products are exact; the two adds each round: 1 + 2^-24 + 2^-24 with odd first.
    let tiny = h(2f32.powi(-12));
    assert_eq!(dpbf16_ref(1.0, [tiny, tiny], [tiny, tiny]), 1.0);
    // Denormal bf16 input counts as zero.
    let den = 0x0001u16;
    assert_eq!(dpbf16_ref(0.0, [den, 0], [h(2f32.powi(100)), 0]), 0.0);
    // A denormal result is flushed to zero.
    let s = h(2f32.powi(-70));
    assert_eq!(dpbf16_ref(0.0, [s, 0], [s, 0]), 0.0);
    assert_eq!(dpbf16_ref(0.0, [0, 0], [0, 0]), 0.0);
    // Odd pair first, then even: (big + 1) - big vs big + (1 - big).
    let big = h(2f32.powi(30));
    let one = h(1.0);
    let neg = h(-(2f32.powi(30)));
    assert_eq!(dpbf16_ref(0.0, [neg, big], [one, one]), 0.0);
    assert_eq!(dpbf16_ref(1.0, [neg, big], [one, one]), 0.0);
}

/// Lanes that exercise the instruction's corners: denormal inputs, products near the f32
/// underflow and overflow limits, cancellations and rounding ties.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn crafted_lanes(rng: &mut Rng) -> ([f32; 16], [u16; 32], [u16; 32]) {
    let pick = |r: &mut Rng| -> u16 {
        match r.next() % 8 {
            0 => (r.next() as u16) & 0x807F,                 // denormal or zero
            1 => ((r.next() as u16) & 0x80FF) | (0x01 << 7), // smallest exponents
            2 => ((r.next() as u16) & 0x80FF) | (0xFE << 7), // largest exponents
            3 => f32_to_bf16_rne(1.0 + (r.next() % 256) as f32 / 256.0),
            4 => f32_to_bf16_rne(-1.0 - (r.next() % 256) as f32 / 256.0),
            5 => ((r.next() as u16) & 0x80FF) | ((0x30 + (r.next() % 16) as u16) << 7),
            _ => f32_to_bf16_rne(r.f()),
        }
    };
    let acc = std::array::from_fn(|_| match rng.next() % 5 {
        0 => 0.0,
        1 => f32::from_bits((rng.next() as u32) & 0x807F_FFFF), // denormal accumulator
        2 => 1.0 + rng.f() * 2f32.powi(-10),
        3 => f32::from_bits((rng.next() as u32) & 0x80FF_FFFF | (0x01 << 23)),
        _ => rng.f(),
    });
    (
        acc,
        std::array::from_fn(|_| pick(rng)),
        std::array::from_fn(|_| pick(rng)),
    )
}

#[cfg(target_arch = "x86_64")]
#[test]
fn instruction_model_equals_vdpbf16ps() {
    if !crate::cpu::has_avx512_bf16() {
        eprintln!("skipped: no AVX-512 BF16");
        return;
    }
    let mut rng = Rng::new(77);
    let mut checked = 0usize;
    for it in 0..20_000 {
        let (acc, a, b) = if it % 2 == 0 {
            crafted_lanes(&mut rng)
        } else {
            (
                std::array::from_fn(|_| rng.f()),
                std::array::from_fn(|_| rng.next() as u16),
                std::array::from_fn(|_| rng.next() as u16),
            )
        };
        // SAFETY: AVX-512 BF16 checked above.
        let hw = unsafe { x86::dpbf16_hw(acc, a, b) };
        for j in 0..16 {
            let want = dpbf16_ref(acc[j], [a[2 * j], a[2 * j + 1]], [b[2 * j], b[2 * j + 1]]);
            assert!(
                same(want, hw[j]),
                "lane {j}: acc {:e} a {:#06x},{:#06x} b {:#06x},{:#06x}: model {want:e} ({:#x}) hw {:e} ({:#x})",
                acc[j],
                a[2 * j],
                a[2 * j + 1],
                b[2 * j],
                b[2 * j + 1],
                want.to_bits(),
                hw[j],
                hw[j].to_bits()
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 320_000);
}

/// Weights of every supported format at `rows × cols`.
fn weights(rng: &mut Rng, rows: usize, cols: usize) -> Vec<(String, Vec<u8>, Vec<u8>, usize)> {
    let bf: Vec<u8> = (0..rows * cols)
        .flat_map(|_| f32_to_bf16_rne(rng.f() * 0.5).to_le_bytes())
        .collect();
    // Finite E4M3 codes (NaN codes are tested on their own).
    let q: Vec<u8> = rng
        .bytes(rows * cols)
        .into_iter()
        .map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b })
        .collect();
    let mx = rng.scales(rows * cols / CHUNK);
    let mut v = vec![
        ("bf16".to_string(), bf, vec![], 0),
        ("mxfp8".to_string(), q.clone(), mx, 0),
    ];
    for b in [32usize, 128] {
        let n = rows.div_ceil(b) * cols.div_ceil(b);
        v.push((format!("fp8-block{b}-e8m0"), q.clone(), rng.scales(n), b));
        let fs: Vec<u8> = (0..n)
            .flat_map(|_| (rng.f().abs() * 0.01 + 1e-4).to_le_bytes())
            .collect();
        v.push((format!("fp8-block{b}-f32"), q.clone(), fs, b));
    }
    v
}

fn view<'a>(
    name: &str,
    w: &'a [u8],
    s: &'a [u8],
    b: usize,
    rows: usize,
    cols: usize,
) -> WeightView<'a> {
    match name {
        "bf16" => WeightView::bf16(w, rows, cols).unwrap(),
        "mxfp8" => WeightView::mxfp8(w, s, rows, cols).unwrap(),
        n if n.ends_with("e8m0") => {
            WeightView::fp8_block(w, BlockScales::E8m0(s), rows, cols, b, b).unwrap()
        }
        _ => WeightView::fp8_block(w, BlockScales::F32(s), rows, cols, b, b).unwrap(),
    }
}

#[test]
fn every_level_equals_the_contract_on_odd_shapes() {
    let mut rng = Rng::new(2024);
    for &(rows, cols) in &[(1usize, 32usize), (7, 96), (33, 160), (5, 224), (19, 288)] {
        for (name, w, s, b) in weights(&mut rng, rows, cols) {
            let wv = view(&name, &w, &s, b, rows, cols);
            let src = BfSrc::from_view(&wv).expect("supported");
            // From GEMM_MIN_M on, the AVX-512 BF16 level runs the GEMM: odd M across its tiles.
            for m in [1usize, 2, 3, 4, 5, 8, 13, 32, GEMM_MIN_M, 38, 43] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.f() * 3.0).collect();
                let a = Bf16Acts::round(&x, m, cols).unwrap();
                // The contract written out.
                let mut want = vec![0f32; m * rows];
                let (mut wr, mut sc) = (vec![0u16; cols], vec![0f32; cols / CHUNK]);
                for r in 0..rows {
                    src.decode_row_ref(r, cols, &mut wr);
                    let scaled = src.chunk_scales(r, cols, &mut sc);
                    for i in 0..m {
                        let xr = &a.x[i * cols..(i + 1) * cols];
                        want[i * rows + r] = dot_row_ref(&wr, xr, scaled.then_some(&sc[..]));
                    }
                }
                for level in bf_levels_available() {
                    let mut got = vec![f32::NAN; m * rows];
                    bf_matmul_at(level, &src, rows, &a, &mut got).unwrap();
                    for (k, (g, e)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            same(*g, *e),
                            "{name} {rows}x{cols} m={m} {}: [{k}] {g:e} vs {e:e}",
                            level.name()
                        );
                    }
                }
                // Against the exact product of the bf16-rounded activations (f64 reference).
                let xr: Vec<f32> = a.x.iter().map(|&h| bf16_to_f32(h)).collect();
                let mut exact = vec![0f32; m * rows];
                matmul_ref(&xr, m, &wv, &mut exact).unwrap();
                for i in 0..m {
                    for r in 0..rows {
                        let mag: f64 = (0..cols)
                            .map(|c| (xr[i * cols + c] as f64 * wv.get_ref(r, c) as f64).abs())
                            .sum();
                        let d = (want[i * rows + r] - exact[i * rows + r]).abs() as f64;
                        assert!(
                            d <= REL_TOL as f64 * mag.max(1e-30),
                            "{name} m={m} ({i},{r}): {} vs {} (Σ|xw| {mag})",
                            want[i * rows + r],
                            exact[i * rows + r]
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn all_e4m3_codes_and_special_scales_match_across_levels() {
    // One row holding every code (NaN codes included), MXFP8 with extreme scale bytes.
    let cols = 256;
    let q: Vec<u8> = (0..=255u8).collect();
    let mut rng = Rng::new(9);
    for sb in [0u8, 1, 100, 127, 200, 254, 255] {
        let s = vec![sb; cols / CHUNK];
        let wv = WeightView::mxfp8(&q, &s, 1, cols).unwrap();
        let src = BfSrc::from_view(&wv).unwrap();
        for m in 1..=4 {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
            let a = Bf16Acts::round(&x, m, cols).unwrap();
            let mut want = vec![0f32; m];
            bf_matmul_at(BfLevel::Scalar, &src, 1, &a, &mut want).unwrap();
            // NaN codes make every result NaN, as in the exact kernels.
            assert!(want.iter().all(|v| v.is_nan()));
            for level in bf_levels_available() {
                let mut got = vec![0f32; m];
                bf_matmul_at(level, &src, 1, &a, &mut got).unwrap();
                assert!(got.iter().zip(&want).all(|(g, w)| same(*g, *w)));
            }
        }
        // Without the NaN codes: finite and equal across levels.
        let qf: Vec<u8> = q
            .iter()
            .map(|&b| if b & 0x7F == 0x7F { 0 } else { b })
            .collect();
        let wv = WeightView::mxfp8(&qf, &s, 1, cols).unwrap();
        let src = BfSrc::from_view(&wv).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
        let a = Bf16Acts::round(&x, 1, cols).unwrap();
        let mut want = [0f32];
        bf_matmul_at(BfLevel::Scalar, &src, 1, &a, &mut want).unwrap();
        for level in bf_levels_available() {
            let mut got = [0f32];
            bf_matmul_at(level, &src, 1, &a, &mut got).unwrap();
            assert!(same(got[0], want[0]), "scale {sb} {}", level.name());
        }
    }
}

#[test]
fn threaded_and_batched_equal_one_thread() {
    let mut rng = Rng::new(31);
    let (rows, cols, m) = (300usize, 1024usize, 8usize);
    for (name, w, s, b) in weights(&mut rng, rows, cols) {
        let wv = view(&name, &w, &s, b, rows, cols);
        let src = BfSrc::from_view(&wv).unwrap();
        let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
        let a = Bf16Acts::round(&x, m, cols).unwrap();
        for level in bf_levels_available() {
            let mut one = vec![0f32; m * rows];
            // SAFETY: `one` holds m × rows.
            unsafe { rows_at(level, &src, &a, 0, rows, one.as_mut_ptr(), rows) };
            let mut par = vec![0f32; m * rows];
            bf_matmul_at(level, &src, rows, &a, &mut par).unwrap();
            assert!(one.iter().zip(&par).all(|(p, q)| same(*p, *q)), "{name}");
            let (mut o1, mut o2) = (vec![0f32; m * rows], vec![0f32; rows]);
            let mut jobs = vec![
                BfJob {
                    w: src,
                    rows,
                    cols,
                    x: &x,
                    m,
                    out: &mut o1,
                },
                BfJob {
                    w: src,
                    rows,
                    cols,
                    x: &x[..cols],
                    m: 1,
                    out: &mut o2,
                },
            ];
            bf_matmul_many_at(level, &mut jobs).unwrap();
            assert!(
                one.iter().zip(&o1).all(|(p, q)| same(*p, *q)),
                "{name} batched"
            );
            // Decode equals prefill: row 0 alone equals row 0 of the batch.
            assert!(
                one[..rows].iter().zip(&o2).all(|(p, q)| same(*p, *q)),
                "{name} m=1"
            );
        }
    }
}

#[test]
fn unsupported_shapes_and_bad_lengths() {
    let w = vec![0u8; 3 * 40 * 2];
    assert!(BfSrc::from_view(&WeightView::bf16(&w, 3, 40).unwrap()).is_none());
    let q = vec![0u8; 64 * 64];
    let s = vec![127u8; 16];
    let wv = WeightView::fp8_block(&q, BlockScales::E8m0(&s), 64, 64, 16, 16).unwrap();
    assert!(BfSrc::from_view(&wv).is_none());
    let src = BfSrc::Mxfp8 {
        q: &q[..100],
        scales: &s,
    };
    let a = Bf16Acts::round(&[0.0; 64], 1, 64).unwrap();
    assert!(bf_matmul_at(BfLevel::Scalar, &src, 64, &a, &mut [0.0; 64]).is_err());
    assert!(Bf16Acts::round(&[0.0; 10], 1, 64).is_err());
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vector_decoders_and_scales_equal_the_tables_on_every_code() {
    if !crate::cpu::has_avx512_bf16() || !x86::has_vbmi() {
        return;
    }
    // Every code at every byte position of a 64-byte group, and an odd chunk count (the last
    // chunk through the 32-wide decoder).
    let nc = 2 * 256 + 1;
    let q: Vec<u8> = (0..nc * CHUNK)
        .map(|k| ((k * 7 + k / 64) % 256) as u8)
        .collect();
    let want: Vec<u16> = q.iter().map(|&b| E4M3_BF16[b as usize]).collect();
    for vbmi in [false, true] {
        let mut got = vec![0u16; nc * CHUNK];
        // SAFETY: the CPU has AVX-512 BF16 and VBMI (checked above); sizes match.
        unsafe { x86::decode_row_test(vbmi, q.as_ptr(), nc, got.as_mut_ptr()) };
        assert_eq!(got, want, "vbmi={vbmi}");
    }
    // E8M0 chunk scales: every byte, 16 at a time and in the tail.
    let scales: Vec<u8> = (0..nc).map(|c| (c % 256) as u8).collect();
    let src = BfSrc::Mxfp8 {
        q: &q,
        scales: &scales,
    };
    let (mut a, mut b) = (vec![0f32; nc], vec![0f32; nc]);
    assert!(src.chunk_scales(0, nc * CHUNK, &mut a));
    // SAFETY: as above.
    assert!(unsafe { x86::chunk_scales_test(&src, 0, nc * CHUNK, &mut b) });
    assert!(a
        .iter()
        .zip(&b)
        .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())));
}

/// An FP8-block weight with power-of-two block scales (E8M0, or f32 / bf16 holding exact powers
/// of two) is, row by row, MXFP8 with each 32-column chunk scaled by its block's scale: the
/// fast kernels give the two the same bits (whole matrices and row slices that start inside a
/// block, columns not a multiple of the 128-column block, M across the row kernel and the
/// GEMM), and both stay within the tolerance of the exact product of the bf16-rounded
/// activations.
#[test]
fn fp8_block_with_power_of_two_scales_equals_mxfp8() {
    let mut rng = Rng::new(77);
    let b = 128usize;
    for &(rows, cols) in &[(300usize, 160usize), (131, 416), (129, 32)] {
        let q: Vec<u8> = rng
            .bytes(rows * cols)
            .into_iter()
            .map(|v| if v & 0x7F == 0x7F { v ^ 1 } else { v })
            .collect();
        let (br, bc) = (rows.div_ceil(b), cols.div_ceil(b));
        let e8: Vec<u8> = rng.scales(br * bc);
        let f32s: Vec<u8> = e8
            .iter()
            .flat_map(|&e| crate::codec::e8m0_to_f32(e).to_le_bytes())
            .collect();
        let bf16s: Vec<u8> = f32s.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
        // MXFP8 scales: chunk k of row r carries block (r / 128, 32k / 128)'s byte.
        let nc = cols / CHUNK;
        let mx: Vec<u8> = (0..rows * nc)
            .map(|i| e8[(i / nc) / b * bc + (i % nc) * CHUNK / b])
            .collect();
        let mxv = WeightView::mxfp8(&q, &mx, rows, cols).unwrap();
        let blocks = [
            ("e8m0", BlockScales::E8m0(&e8)),
            ("f32", BlockScales::F32(&f32s)),
            ("bf16", BlockScales::Bf16(&bf16s)),
        ];
        for (sname, sc) in blocks {
            let fbv = WeightView::fp8_block(&q, sc, rows, cols, b, b).unwrap();
            for (r0, r1) in [(0, rows), (rows / 3, rows), (1, rows.min(130))] {
                let (fs, ms) = (
                    fbv.slice_rows(r0, r1).unwrap(),
                    mxv.slice_rows(r0, r1).unwrap(),
                );
                let n = r1 - r0;
                for m in [1usize, 3, GEMM_MIN_M + 2] {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.f() * 2.0).collect();
                    let a = Bf16Acts::round(&x, m, cols).unwrap();
                    let xr: Vec<f32> = a.x.iter().map(|&h| bf16_to_f32(h)).collect();
                    let mut exact = vec![0f32; m * n];
                    matmul_ref(&xr, m, &ms, &mut exact).unwrap();
                    let mag: Vec<f64> = (0..m * n)
                        .map(|k| {
                            let (i, r) = (k / n, k % n);
                            (0..cols)
                                .map(|c| (xr[i * cols + c] as f64 * ms.get_ref(r, c) as f64).abs())
                                .sum()
                        })
                        .collect();
                    for level in bf_levels_available() {
                        let mut got = [vec![0f32; m * n], vec![0f32; m * n]];
                        for (o, v) in got.iter_mut().zip([&fs, &ms]) {
                            let src = BfSrc::from_view(v).expect("supported");
                            bf_matmul_at(level, &src, n, &a, o).unwrap();
                        }
                        let what = format!("{sname} {rows}x{cols} [{r0}..{r1}) m={m}");
                        assert!(
                            got[0].iter().zip(&got[1]).all(|(p, q)| same(*p, *q)),
                            "{what} {}: FP8-block and MXFP8 differ",
                            level.name()
                        );
                        for (k, (g, e)) in got[0].iter().zip(&exact).enumerate() {
                            let d = (g - e).abs() as f64;
                            assert!(d <= REL_TOL as f64 * mag[k].max(1e-30), "{what} [{k}]");
                        }
                    }
                    // What `--kernels fast` runs: `matmul_with` takes the same path for both.
                    let (mut p, mut q2) = (vec![0f32; m * n], vec![0f32; m * n]);
                    crate::matmul_with(crate::Kernels::Fast, &x, m, &fs, &mut p).unwrap();
                    crate::matmul_with(crate::Kernels::Fast, &x, m, &ms, &mut q2).unwrap();
                    assert!(
                        p.iter().zip(&q2).all(|(a, b)| same(*a, *b)),
                        "{sname} matmul_with"
                    );
                }
            }
        }
    }
}
