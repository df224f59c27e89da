//! Fitting speed of the lattice searches and of whole-matrix fits on one expert-shaped matrix
//! (normal weights, a log-normal imatrix), for comparing search variants quickly:
//! `cargo run --release -p keep-quant --example fit_speed -- [ROWS COLS]`
//! (the batched search is timed at every SIMD level the CPU has; `baseline` is the lane
//! kernels built for the baseline target) (default 2304 × 5120,
//! a V4.1-Flash expert's w1). MB/s counts the matrix as FP4 with a scale per 32 inputs
//! (4.25 bits per weight, how the experts ship), so it compares with `keep quant`'s report.

use std::time::Instant;

use keep_kernels::cpu::Level;
use keep_quant::fit::{fit_matrix, QuantFormat};
use keep_quant::lattice::{
    nearest_e8p_weighted, nearest_e8p_weighted_many_at, nearest_e8p_weighted_scan,
};
use keep_rng::Draw;

/// CPU seconds this process has used (user + system, all threads), from /proc: what a loaded
/// machine distorts least. `None` where /proc is not there.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (rows, cols) = match args[..] {
        [r, c] => (r, c),
        _ => (2304, 5120),
    };
    let mut rng = keep_rng::rng(7);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| (rng.gauss() * 0.02) as f32)
        .collect();
    let im: Vec<f32> = (0..cols)
        .map(|_| (rng.gauss() * 1.2).exp() as f32)
        .collect();
    // per-group searches at the scale a fit sees (RMS / 1.03)
    let n: usize = std::env::var("FIT_SPEED_GROUPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let xs: Vec<[f32; 8]> = (0..n)
        .map(|_| std::array::from_fn(|_| (rng.gauss() / 1.03) as f32))
        .collect();
    let hs: Vec<[f32; 8]> = (0..n)
        .map(|_| std::array::from_fn(|_| (rng.gauss() * 1.2).exp() as f32))
        .collect();
    for (name, f) in [
        (
            "scan",
            nearest_e8p_weighted_scan as fn([f32; 8], [f32; 8]) -> u16,
        ),
        ("pruned", nearest_e8p_weighted),
    ] {
        let (t, c0) = (Instant::now(), cpu_seconds());
        let mut acc = 0u64;
        for (x, h) in xs.iter().zip(&hs) {
            acc += f(*x, *h) as u64;
        }
        let s = t.elapsed().as_secs_f64();
        let cpu = cpu_seconds().zip(c0).map_or(f64::NAN, |(a, b)| a - b);
        println!(
            "search {name}: {:.0} ns wall, {:.0} ns CPU per group of 8 (checksum {acc})",
            s * 1e9 / n as f64,
            cpu * 1e9 / n as f64
        );
    }
    // the batched search at every level this CPU has (one group per SIMD lane)
    let xf: Vec<f32> = xs.iter().flatten().copied().collect();
    let hf: Vec<f32> = hs.iter().flatten().copied().collect();
    let detected = keep_kernels::cpu::detected();
    for level in [Level::Scalar, Level::Neon, Level::Avx2, Level::Avx512] {
        if level > detected && level != Level::Neon {
            continue;
        }
        let mut codes = vec![0u16; n];
        let (t, c0) = (Instant::now(), cpu_seconds());
        nearest_e8p_weighted_many_at(level, &xf, &hf, &mut codes);
        let s = t.elapsed().as_secs_f64();
        let cpu = cpu_seconds().zip(c0).map_or(f64::NAN, |(a, b)| a - b);
        let acc: u64 = codes.iter().map(|&c| c as u64).sum();
        let name = if level == Level::Neon {
            "baseline"
        } else {
            level.name()
        };
        println!(
            "search batched {name}: {:.0} ns wall, {:.0} ns CPU per group of 8 (checksum {acc})",
            s * 1e9 / n as f64,
            cpu * 1e9 / n as f64
        );
    }
    let mb = (rows * cols) as f64 * 4.25 / 8.0 / 1e6;
    let threads = rayon::current_num_threads();
    for format in QuantFormat::ALL {
        let (t, c0) = (Instant::now(), cpu_seconds());
        let f = fit_matrix(&w, rows, cols, &im, format).expect("fit");
        let s = t.elapsed().as_secs_f64();
        let cpu = cpu_seconds().zip(c0).map_or(f64::NAN, |(a, b)| a - b);
        let rel = f.errors.full.unwrap_or(f.errors.base) / f.errors.weight;
        println!(
            "fit {:10} [{rows}, {cols}]: {s:.2} s wall, {cpu:.2} CPU s; {:.1} MB/s wall on {threads} threads, {:.1} MB per CPU second; rel weighted error {rel:.5}",
            format.label(),
            mb / s,
            mb / cpu
        );
    }
}
