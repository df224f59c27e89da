//! `keep bench matmul`: one weight product timed the way llama.cpp's `test-backend-ops perf`
//! times its MUL_MAT cases, so the two can be put side by side per thread.
//!
//! A weight of the given format and shape (out rows × in cols) is synthesised with random
//! values at realistic scales, an activation of M rows is drawn once, and the product runs
//! on a dedicated rayon pool of `threads` threads: one untimed warm-up call, then calls on
//! the same weight until at least `min_seconds` have passed. The row reports microseconds per
//! call, weight bytes per second (the format's packed bytes, scales included, over the time of
//! one call) and GFLOP/s (2·M·rows·cols per call). The weight stays in the last-level cache
//! when it fits, as it does in `test-backend-ops`; this measures kernels, not memory.
//! Nothing here asserts a time.

use std::hint::black_box;
use std::time::Instant;

use serde::Serialize;

use keep_kernels::affine::{Affine8View, AFFINE8_GROUP};
use keep_kernels::e8p::{E8pJob, E8pView};
use keep_kernels::intdot::{int_matmul_many, IntJob, IntSrc};
use keep_kernels::simd::{self, Job, Src};
pub use keep_kernels::Kernels;
use keep_kernels::WeightView;

use crate::{BenchError, Result};

/// The weight formats `keep bench matmul` can time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// E2M1 pairs + one E8M0 scale per 32 columns (routed experts).
    Mxfp4,
    /// E8P12 lattice codes (2 bits/weight) + one f32 scale per row.
    E8p,
    /// MLX affine 8-bit, groups of 64 with bf16 scale and bias.
    Affine8,
    /// MLX affine 4-bit (mlx-community's 4-bit files), groups of 64 with bf16 scale and bias.
    Mlx4,
    /// E4M3 + one E8M0 scale per 32 columns (residents).
    Mxfp8,
    /// bfloat16.
    Bf16,
}

impl Format {
    /// Every format, in CLI order.
    pub const ALL: [Format; 6] = [
        Format::Mxfp4,
        Format::E8p,
        Format::Affine8,
        Format::Mlx4,
        Format::Mxfp8,
        Format::Bf16,
    ];

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Format::Mxfp4 => "mxfp4",
            Format::E8p => "e8p",
            Format::Affine8 => "affine8",
            Format::Mlx4 => "mlx4",
            Format::Mxfp8 => "mxfp8",
            Format::Bf16 => "bf16",
        }
    }

    /// Parse a CLI name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// One case to time.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    pub format: Format,
    pub kernels: Kernels,
    /// Output rows of the weight.
    pub rows: usize,
    /// Input columns of the weight.
    pub cols: usize,
    /// Activation rows (tokens) per call.
    pub m: usize,
}

/// The evidence of one timed case.
#[derive(Debug, Clone, Serialize)]
pub struct MatmulRow {
    pub bench: &'static str,
    pub format: Format,
    pub kernels: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub m: usize,
    pub threads: usize,
    /// Packed weight bytes (codes and scales) read by one call.
    pub weight_bytes: usize,
    pub calls: u64,
    pub seconds: f64,
    pub us_per_call: f64,
    /// CPU time of the calling thread per call (Linux `CLOCK_THREAD_CPUTIME_ID`; with one
    /// thread, the work itself however loaded the machine is; `None` elsewhere).
    pub thread_cpu_us_per_call: Option<f64>,
    /// `weight_bytes` per second of one call, in GB/s (1e9 bytes).
    pub weight_gbps: f64,
    pub gflops: f64,
    /// The instruction-set levels the kernels ran at.
    pub simd_level: String,
    pub int_level: &'static str,
    pub bf_level: Option<&'static str>,
    /// A value of the last output, so the work cannot be elided (and runs can be compared).
    pub out_probe: f32,
}

/// keep-rng's SplitMix64: a fixed stream of synthetic weights.
struct Rng(keep_rng::SplitMix64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(keep_rng::splitmix(seed))
    }
    fn next(&mut self) -> u64 {
        keep_rng::RngCore::next_u64(&mut self.0)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// Approximately standard normal (sum of four uniforms, rescaled).
    fn normal(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| keep_rng::Draw::unit(&mut self.0)).sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
}

/// The owned bytes of one synthesised weight.
struct Weight {
    a: Vec<u8>,
    b: Vec<u8>,
    c: Vec<u8>,
    codes: Vec<u16>,
    row_scales: Vec<f32>,
}

fn bf16_bytes(v: f32) -> [u8; 2] {
    keep_kernels::bf16dot::f32_to_bf16_rne(v).to_le_bytes()
}

fn synth(format: Format, rows: usize, cols: usize, seed: u64) -> Weight {
    let mut r = Rng::new(seed);
    let n = rows * cols;
    let mut w = Weight {
        a: vec![],
        b: vec![],
        c: vec![],
        codes: vec![],
        row_scales: vec![],
    };
    match format {
        Format::Mxfp4 => {
            w.a = r.bytes(n / 2);
            // E8M0 scales around 2^-5.
            w.b = (0..n / 32).map(|_| 120 + (r.next() % 4) as u8).collect();
        }
        Format::E8p => {
            w.codes = (0..n / 8).map(|_| r.next() as u16).collect();
            w.row_scales = (0..rows).map(|i| 0.01 + (i % 7) as f32 * 1e-3).collect();
        }
        Format::Affine8 => {
            w.a = r.bytes(n);
            let g = n / AFFINE8_GROUP;
            w.b = (0..g).flat_map(|_| bf16_bytes(2e-4)).collect();
            w.c = (0..g).flat_map(|_| bf16_bytes(-0.0255)).collect();
        }
        Format::Mlx4 => {
            // Nibbles 0..15 over [-0.0225, 0.0225]: scale 0.003, bias the group minimum.
            w.a = r.bytes(n / 2);
            let g = n / AFFINE8_GROUP;
            w.b = (0..g).flat_map(|_| bf16_bytes(3e-3)).collect();
            w.c = (0..g).flat_map(|_| bf16_bytes(-0.0225)).collect();
        }
        Format::Mxfp8 => {
            // Finite E4M3 codes (no NaN), E8M0 scales around 2^-8.
            w.a = (0..n)
                .map(|_| {
                    let b = r.next() as u8;
                    if b & 0x7F == 0x7F {
                        b ^ 1
                    } else {
                        b
                    }
                })
                .collect();
            w.b = (0..n / 32).map(|_| 117 + (r.next() % 4) as u8).collect();
        }
        Format::Bf16 => {
            w.a = (0..n).flat_map(|_| bf16_bytes(r.normal() * 0.02)).collect();
        }
    }
    w
}

fn invalid(e: impl std::fmt::Display) -> BenchError {
    BenchError::Invalid(e.to_string())
}

/// Run one call of `case` on `w` (in the current rayon pool).
fn call(case: &Case, w: &Weight, x: &[f32], out: &mut [f32]) -> Result<()> {
    let (rows, cols, m) = (case.rows, case.cols, case.m);
    match case.format {
        Format::E8p => {
            let v = E8pView::new(&w.codes, &w.row_scales, rows, cols).map_err(invalid)?;
            if case.kernels == Kernels::Fast {
                let src = IntSrc::from_e8p(&v)
                    .ok_or_else(|| invalid("e8p integer kernel needs cols % 32 == 0"))?;
                let mut jobs = [IntJob {
                    w: src,
                    rows,
                    cols,
                    x,
                    m,
                    out,
                }];
                int_matmul_many(&mut jobs).map_err(invalid)
            } else {
                let mut jobs = [E8pJob { w: v, x, m, out }];
                keep_kernels::e8p::e8p_matmul_many(&mut jobs).map_err(invalid)
            }
        }
        f => {
            let src = match f {
                Format::Mxfp4 => {
                    Src::view(&WeightView::mxfp4(&w.a, &w.b, rows, cols).map_err(invalid)?)
                }
                Format::Mxfp8 => {
                    Src::view(&WeightView::mxfp8(&w.a, &w.b, rows, cols).map_err(invalid)?)
                }
                Format::Bf16 => Src::view(&WeightView::bf16(&w.a, rows, cols).map_err(invalid)?),
                Format::Mlx4 => Src::view(
                    &WeightView::mlx_affine(4, &w.a, &w.b, &w.c, rows, cols).map_err(invalid)?,
                ),
                _ => {
                    Src::affine8(&Affine8View::new(&w.a, &w.b, &w.c, rows, cols).map_err(invalid)?)
                }
            };
            if x.len() != m * cols || out.len() != m * rows {
                return Err(invalid("operand lengths do not match the shape"));
            }
            let mut jobs = [Job {
                w: src,
                rows,
                cols,
                x,
                m,
                out,
            }];
            keep_kernels::matmul::matmul_many_with(case.kernels, &mut jobs).map_err(invalid)
        }
    }
}

/// Packed bytes of a `format` weight of `rows × cols`.
pub fn weight_bytes(format: Format, rows: usize, cols: usize) -> usize {
    let n = rows * cols;
    match format {
        Format::Mxfp4 => n / 2 + n / 32,
        Format::E8p => n / 8 * 2 + rows * 4,
        Format::Affine8 => n + n / AFFINE8_GROUP * 4,
        Format::Mlx4 => n / 2 + n / AFFINE8_GROUP * 4,
        Format::Mxfp8 => n + n / 32,
        Format::Bf16 => n * 2,
    }
}

/// Time `case` on a pool of `threads` threads for at least `min_seconds` (after one warm-up
/// call), on the same weight every call.
pub fn time_case(case: &Case, threads: usize, min_seconds: f64) -> Result<MatmulRow> {
    if case.rows == 0 || case.cols == 0 || case.m == 0 {
        return Err(invalid("rows, cols and m must be positive"));
    }
    let block = match case.format {
        Format::Affine8 | Format::Mlx4 => AFFINE8_GROUP,
        _ => 32,
    };
    if !case.cols.is_multiple_of(block) {
        return Err(invalid(format!(
            "{}: cols {} is not a multiple of {block}",
            case.format.name(),
            case.cols
        )));
    }
    let w = synth(case.format, case.rows, case.cols, 0x6B65_6570);
    let mut g = Rng::new(0x5EED ^ case.m as u64);
    let x: Vec<f32> = (0..case.m * case.cols).map(|_| g.normal()).collect();
    let mut out = vec![0f32; case.m * case.rows];
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(invalid)?;
    let (calls, seconds, cpu) = pool.install(|| -> Result<(u64, f64, Option<f64>)> {
        call(case, &w, &x, &mut out)?;
        let (t, c0) = (Instant::now(), thread_cpu_s());
        let mut calls = 0u64;
        loop {
            call(case, &w, black_box(&x), &mut out)?;
            calls += 1;
            let s = t.elapsed().as_secs_f64();
            if s >= min_seconds {
                let cpu = c0.zip(thread_cpu_s()).map(|(a, b)| b - a);
                return Ok((calls, s, cpu));
            }
        }
    })?;
    let per = seconds / calls as f64;
    let bytes = weight_bytes(case.format, case.rows, case.cols);
    Ok(MatmulRow {
        bench: "matmul",
        format: case.format,
        kernels: case.kernels.name(),
        rows: case.rows,
        cols: case.cols,
        m: case.m,
        threads: threads.max(1),
        weight_bytes: bytes,
        calls,
        seconds,
        us_per_call: per * 1e6,
        thread_cpu_us_per_call: cpu.map(|c| c / calls as f64 * 1e6),
        weight_gbps: bytes as f64 / 1e9 / per,
        gflops: 2.0 * (case.m * case.rows * case.cols) as f64 / 1e9 / per,
        simd_level: format!("{:?}", simd::level()),
        int_level: keep_kernels::intdot::int_level().name(),
        bf_level: keep_kernels::bf16dot::bf_level().map(|l| l.name()),
        out_probe: out[out.len() - 1],
    })
}

/// CPU time of the calling thread in seconds (`None` where the clock is not available).
fn thread_cpu_s() -> Option<f64> {
    #[cfg(target_os = "linux")]
    {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec the call writes.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        (rc == 0).then_some(t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_stream_is_splitmix64() {
        // SplitMix64's published first output from state 0.
        assert_eq!(Rng::new(0).next(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn every_format_times_a_small_case_on_both_kernels() {
        for f in Format::ALL {
            for k in [Kernels::Exact, Kernels::Fast] {
                let case = Case {
                    format: f,
                    kernels: k,
                    rows: 16,
                    cols: 128,
                    m: 3,
                };
                let r = time_case(&case, 1, 0.0).expect("small case");
                assert!(r.calls >= 1);
                assert_eq!(r.weight_bytes, weight_bytes(f, 16, 128));
                assert!(r.out_probe.is_finite(), "{} {}", f.name(), k.name());
            }
        }
    }

    #[test]
    fn fast_and_exact_agree_on_the_synthesised_weights() {
        // Both kernels multiply the same synthesised weight; the fast ones quantize the
        // activations (int8 blocks or bf16), so they agree to a few parts in a hundred.
        const REL: f32 = 0.05; // int8 activation blocks: ~1% per term, summed over 128 columns
        for f in Format::ALL {
            let w = synth(f, 8, 128, 1);
            let mut g = Rng::new(2);
            let x: Vec<f32> = (0..2 * 128).map(|_| g.normal()).collect();
            let mut outs = vec![];
            for k in [Kernels::Exact, Kernels::Fast] {
                let case = Case {
                    format: f,
                    kernels: k,
                    rows: 8,
                    cols: 128,
                    m: 2,
                };
                let mut out = vec![0f32; 16];
                call(&case, &w, &x, &mut out).expect("call");
                outs.push(out);
            }
            let scale = outs[0].iter().map(|v| v.abs()).fold(0f32, f32::max);
            for (a, b) in outs[0].iter().zip(&outs[1]) {
                assert!(
                    (a - b).abs() <= REL * scale,
                    "{}: exact {a} fast {b}",
                    f.name()
                );
            }
        }
    }

    #[test]
    fn odd_columns_are_refused() {
        let case = Case {
            format: Format::Mxfp4,
            kernels: Kernels::Fast,
            rows: 4,
            cols: 33,
            m: 1,
        };
        assert!(time_case(&case, 1, 0.0).is_err());
    }
}
