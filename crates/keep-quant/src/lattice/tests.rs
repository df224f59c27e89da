//! Tests of the structured searches against exhaustive search on random and adversarial
//! vectors, plain and weighted.

use super::*;
use keep_format::e81::nearest_e81_brute;
use keep_format::e8p::{decode_e8p, nearest_e8p as nearest_e8p_brute};
use keep_rng::Draw;

/// The pattern scan and the E81 search accumulate in f32, the references in f64: a result
/// may be worse than the reference by this relative amount (f32 rounding of 8-term sums).
const DIST_REL_TOL: f64 = 1e-5;
/// Absolute slack for distances near zero (f32 rounding of the terms themselves).
const DIST_ABS_TOL: f64 = 1e-6;

fn assert_as_near(x: &[f32; 8], w: Option<&[f32; 8]>, got: [f32; 8], want: [f32; 8], what: &str) {
    let (dg, dw) = (dist(x, &got, w), dist(x, &want, w));
    assert!(
        dg <= dw * (1.0 + DIST_REL_TOL) + DIST_ABS_TOL,
        "{what}: x={x:?} w={w:?}: got {got:?} at {dg}, reference {want:?} at {dw}"
    );
}

fn gauss8(rng: &mut keep_rng::Rng, s: f64) -> [f32; 8] {
    std::array::from_fn(|_| (rng.gauss() * s) as f32)
}

/// Weights as an imatrix gives them: positive, heavy-tailed, some (near) zero.
fn weights8(rng: &mut keep_rng::Rng) -> [f32; 8] {
    std::array::from_fn(|_| match rng.below(6) {
        0 => 0.0,
        1 => 1e-4,
        _ => (rng.gauss() * 1.5).exp() as f32,
    })
}

fn in_e8(p: &[f64; 8]) -> bool {
    let int = p.iter().all(|v| v.fract() == 0.0);
    let half = p.iter().all(|v| (v - 0.5).fract() == 0.0);
    (int || half) && p.iter().sum::<f64>().rem_euclid(2.0) == 0.0
}

/// Nearest E8 point by search: for each coset, every coordinate within one step of its
/// rounding (the nearest point of a coset of D8 is always among these).
fn nearest_e8_search(x: &[f64; 8]) -> f64 {
    let mut best = f64::INFINITY;
    for off in [0.0, 0.5] {
        let r = x.map(|v| (v - off).round() + off);
        for k in 0..6561u32 {
            let mut p = r;
            let mut rest = k;
            for v in &mut p {
                *v += (rest % 3) as f64 - 1.0;
                rest /= 3;
            }
            if in_e8(&p) {
                let d: f64 = (0..8).map(|i| (x[i] - p[i]).powi(2)).sum();
                best = best.min(d);
            }
        }
    }
    best
}

#[test]
fn e8_decoder_is_nearest() {
    let mut rng = keep_rng::rng(0xE8E8_0001);
    for n in 0..60 {
        let x: [f64; 8] = std::array::from_fn(|_| rng.gauss() * [0.4, 1.0, 3.0][n % 3]);
        let p = nearest_e8(x);
        assert!(in_e8(&p), "{p:?}");
        let d: f64 = (0..8).map(|i| (x[i] - p[i]).powi(2)).sum();
        assert!(d <= nearest_e8_search(&x) + 1e-12, "{x:?}");
    }
    // lattice points decode to themselves
    for p in [[0.0; 8], [0.5; 8], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] {
        assert_eq!(nearest_e8(p), p);
    }
}

#[test]
fn code_of_every_codeword() {
    for code in 0..=u16::MAX {
        let c = decode_e8p(code);
        let y = c.map(|v| v as f64 - 0.25);
        assert_eq!(e8p_code_of(y), Some(code), "{code:#06x}");
    }
    // E8 points whose pattern is outside the grid
    assert_eq!(e8p_code_of([3.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]), None);
    assert_eq!(e8p_code_of([2.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]), None);
    assert_eq!(e8p_code_of([f64::NAN; 8]), None);
    assert_eq!(e8p_code_of([0.25; 8]), None);
}

#[test]
fn structured_plain_matches_brute_force() {
    let mut rng = keep_rng::rng(0xE8E8_0002);
    for n in 0..96 {
        // small, unit, wide and far-out inputs (the last ones exercise the fallback)
        let x = gauss8(&mut rng, [0.3, 1.03, 1.6, 4.0][n % 4]);
        let got = nearest_e8p(x);
        let want = nearest_e8p_brute(x);
        assert_as_near(&x, None, decode_e8p(got), decode_e8p(want), "plain");
    }
    // every codeword comes back as itself
    for code in (0..=u16::MAX).step_by(97) {
        assert_eq!(nearest_e8p(decode_e8p(code)), code);
    }
}

#[test]
fn weighted_scan_matches_brute_force() {
    let mut rng = keep_rng::rng(0xE8E8_0003);
    for n in 0..64 {
        let x = gauss8(&mut rng, [0.5, 1.03, 2.0, 5.0][n % 4]);
        let w = weights8(&mut rng);
        let got = nearest_e8p_weighted(x, w);
        let want = nearest_e8p_brute_weighted(x, w);
        assert_as_near(&x, Some(&w), decode_e8p(got), decode_e8p(want), "weighted");
        // unit weights: the scan agrees with the plain search too
        let got = nearest_e8p_weighted(x, [1.0; 8]);
        assert_as_near(
            &x,
            None,
            decode_e8p(got),
            decode_e8p(nearest_e8p_brute(x)),
            "unit",
        );
    }
}

#[test]
fn fast_weighted_search_matches_scan_and_brute_force() {
    let mut rng = keep_rng::rng(0xE8E8_0006);
    // against the scan: many inputs at the scales a fit sees
    for n in 0..20000 {
        let x = gauss8(&mut rng, [0.3, 1.03, 1.6, 3.0, 8.0][n % 5]);
        let w = match n % 4 {
            0 => [1.0; 8],
            _ => weights8(&mut rng),
        };
        let got = nearest_e8p_weighted(x, w);
        let want = nearest_e8p_weighted_scan(x, w);
        assert_as_near(
            &x,
            Some(&w),
            decode_e8p(got),
            decode_e8p(want),
            "fast vs scan",
        );
    }
    // against brute force
    for n in 0..48 {
        let x = gauss8(&mut rng, [0.5, 1.03, 2.0, 5.0][n % 4]);
        let w = weights8(&mut rng);
        let got = nearest_e8p_weighted(x, w);
        let want = nearest_e8p_brute_weighted(x, w);
        assert_as_near(
            &x,
            Some(&w),
            decode_e8p(got),
            decode_e8p(want),
            "fast vs brute",
        );
    }
    // the grid's layout the search relies on: the first 227 patterns are exactly the digit
    // vectors within 4 norm units, the rest have five 3/2 and three ½
    let units = |dg: &[u8; 8]| dg.iter().map(|&d| DIGIT_UNITS[d as usize]).sum::<usize>();
    for (g, (dg, _)) in PATTERN_DIGITS.iter().enumerate() {
        if g < NORM12_FIRST {
            assert!(units(dg) <= 4, "{g}");
        } else {
            assert!(dg.iter().all(|&d| d <= 1) && units(dg) == UNITS, "{g}");
        }
    }
    let within4 = (0..6561usize)
        .filter(|&k| {
            let dg: [u8; 8] = std::array::from_fn(|i| ((k / 3usize.pow(7 - i as u32)) % 3) as u8);
            units(&dg) <= 4
        })
        .count();
    assert_eq!(within4, NORM12_FIRST);
}

#[test]
fn adversarial_inputs() {
    let mut rng = keep_rng::rng(0xE8E8_0004);
    let mut cases: Vec<[f32; 8]> = vec![
        [0.0; 8],
        [0.25; 8],
        [-0.25; 8],
        [0.5; 8],
        [1.0; 8],
        [100.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [-3.0, 3.0, -3.0, 3.0, -3.0, 3.0, -3.0, 3.0],
        [2.75, -2.75, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25],
    ];
    // midpoints of pairs of codewords (exact ties) and quarter-grid points
    for _ in 0..16 {
        let a = decode_e8p(rng.below(65536) as u16);
        let b = decode_e8p(rng.below(65536) as u16);
        cases.push(std::array::from_fn(|i| (a[i] + b[i]) * 0.5));
        cases.push(std::array::from_fn(|_| {
            (rng.below(25) as f32 - 12.0) * 0.25
        }));
    }
    for x in cases {
        let want = decode_e8p(nearest_e8p_brute(x));
        assert_as_near(
            &x,
            None,
            decode_e8p(nearest_e8p(x)),
            want,
            "plain adversarial",
        );
        let w = weights8(&mut rng);
        let want = decode_e8p(nearest_e8p_brute_weighted(x, w));
        let got = decode_e8p(nearest_e8p_weighted(x, w));
        assert_as_near(&x, Some(&w), got, want, "weighted adversarial");
        let got = decode_e8p(nearest_e8p_weighted_scan(x, w));
        assert_as_near(&x, Some(&w), got, want, "scan adversarial");
        let got = decode_e8p(nearest_e8p_weighted(x, [0.0; 8]));
        assert_as_near(&x, Some(&[0.0; 8]), got, want, "zero weights");
    }
    // non-finite input: no panic
    let _ = nearest_e8p([f32::NAN; 8]);
    let _ = nearest_e8p_weighted([f32::INFINITY; 8], [1.0; 8]);
    let _ = nearest_e8p_weighted([f32::NAN; 8], [1.0; 8]);
    let _ = nearest_e8p_weighted([1.0; 8], [f32::NAN; 8]);
    let _ = nearest_e8p_weighted_scan([f32::NAN; 8], [1.0; 8]);
    let _ = nearest_e81_weighted([f32::NAN; 8], [1.0; 8]);
}

#[test]
fn e81_tables_match_codebook() {
    for i in 0..8 {
        for j in i + 1..8 {
            for (si, sj) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let c = E81_PAIRS[i][j][si][sj] as usize;
                let mut v = [0i8; 8];
                v[i] = if si == 1 { -2 } else { 2 };
                v[j] = if sj == 1 { -2 } else { 2 };
                assert_eq!(E81_GRID[c], v);
            }
        }
    }
    for b in 0..256usize {
        let v: [i8; 8] = std::array::from_fn(|i| if (b >> (7 - i)) & 1 == 1 { 1 } else { -1 });
        if v.iter().filter(|&&c| c < 0).count() % 2 == 0 {
            assert_eq!(E81_GRID[E81_HALF + b / 2], v);
        }
    }
    for i in 0..8 {
        assert_eq!(E81_GRID[E81_PLUS2 + i][i], 4);
        if i < 7 {
            assert_eq!(E81_GRID[E81_MINUS2 + i][i], -4);
        }
    }
}

#[test]
fn e81_weighted_matches_brute_force() {
    let mut rng = keep_rng::rng(0xE8E8_0005);
    for n in 0..4000 {
        let x = gauss8(&mut rng, [0.2, 0.5, 1.0, 2.0][n % 4]);
        let w = if n % 5 == 0 {
            [1.0; 8]
        } else {
            weights8(&mut rng)
        };
        let got = e81_point(nearest_e81_weighted(x, w));
        let want = e81_point(nearest_e81_brute(x, w));
        assert_as_near(&x, Some(&w), got, want, "e81");
    }
    for c in 0..=255u8 {
        assert_eq!(nearest_e81_weighted(e81_point(c), [1.0; 8]), c);
    }
}

#[test]
fn batched_search_gives_the_one_group_codes_at_every_level() {
    use keep_kernels::cpu::Level;
    let mut rng = keep_rng::rng(0xE8E8_0007);
    // fit-like, wide, far-out, tie and non-finite groups; a count that leaves a partial block
    let n = 40 * LANES + 7;
    let mut x = Vec::with_capacity(8 * n);
    let mut w = Vec::with_capacity(8 * n);
    for g in 0..n {
        let xg = match g % 7 {
            5 => {
                let (a, b) = (
                    decode_e8p(rng.below(65536) as u16),
                    decode_e8p(rng.below(65536) as u16),
                );
                std::array::from_fn(|i| (a[i] + b[i]) * 0.5)
            }
            6 if g % 5 == 0 => [f32::NAN, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, f32::INFINITY],
            _ => gauss8(&mut rng, [0.3, 1.03, 1.6, 3.0, 8.0][g % 5]),
        };
        let wg = match g % 4 {
            0 => [1.0; 8],
            _ => weights8(&mut rng),
        };
        x.extend_from_slice(&xg);
        w.extend_from_slice(&wg);
    }
    let want: Vec<u16> = (0..n)
        .map(|g| {
            nearest_e8p_weighted(
                std::array::from_fn(|i| x[8 * g + i]),
                std::array::from_fn(|i| w[8 * g + i]),
            )
        })
        .collect();
    let detected = keep_kernels::cpu::detected();
    for level in [Level::Scalar, Level::Neon, Level::Avx2, Level::Avx512] {
        if level > detected && level != Level::Neon {
            continue;
        }
        let mut got = vec![0u16; n];
        nearest_e8p_weighted_many_at(level, &x, &w, &mut got);
        for g in 0..n {
            assert_eq!(got[g], want[g], "{} group {g}", level.name());
        }
    }
}
