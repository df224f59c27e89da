//! `keep bench peak`: the machine's arithmetic peak, measured — the line prefill GFLOP/s is
//! read against.
//!
//! Two tight register-only loops per thread, each with enough independent accumulator chains
//! to cover the instruction latency: f32 fused multiply-add (AVX-512 `vfmadd231ps` on 16
//! lanes, else AVX2 on 8, else scalar `mul_add`), counted as 2 flops per lane, and the int8
//! dot product the fast kernels use (AVX-512 VNNI `vpdpbusd`, 4 u8×i8 products summed into
//! each of 16 i32 lanes), counted as 2 ops per product. Threads run on a dedicated rayon pool;
//! the rate is the total work over the slowest thread's time. Nothing here asserts a time.

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::{BenchError, Result};

/// Independent accumulator chains per loop (covers a 4-cycle latency on two ports).
const CHAINS: usize = 12;
/// Loop iterations between clock reads.
const INNER: u64 = 1 << 16;

/// Measured peaks.
#[derive(Debug, Clone, Serialize)]
pub struct Peak {
    pub bench: &'static str,
    pub threads: usize,
    pub seconds: f64,
    /// Which f32 loop ran: avx512-fma, avx2-fma or scalar.
    pub f32_path: &'static str,
    pub f32_gflops: f64,
    /// The int8 loop (avx512-vnni), absent where the CPU lacks it.
    pub int8_path: Option<&'static str>,
    pub int8_gops: Option<f64>,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) -> (f32, u64) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_ps(0.999_999);
    let b = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    let mut s = _mm512_setzero_ps();
    for v in acc {
        s = _mm512_add_ps(s, v);
    }
    (_mm512_reduce_add_ps(s), iters * (CHAINS * 16 * 2) as u64)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) -> (f32, u64) {
    use std::arch::x86_64::*;
    let a = _mm256_set1_ps(0.999_999);
    let b = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); CHAINS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut out = [0f32; 8];
    let mut s = _mm256_setzero_ps();
    for v in acc {
        s = _mm256_add_ps(s, v);
    }
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    (out.iter().sum(), iters * (CHAINS * 8 * 2) as u64)
}

fn fma_scalar(iters: u64) -> (f32, u64) {
    let mut acc = [1f32; CHAINS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = black_box(*v).mul_add(0.999_999, 1e-7);
        }
    }
    (acc.iter().sum(), iters * (CHAINS * 2) as u64)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni_avx512(iters: u64) -> (i32, u64) {
    use std::arch::x86_64::*;
    let a = _mm512_set1_epi8(3);
    let b = _mm512_set1_epi8(-2);
    let mut acc = [_mm512_setzero_si512(); CHAINS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_dpbusd_epi32(*v, a, b);
        }
    }
    let mut s = _mm512_setzero_si512();
    for v in acc {
        s = _mm512_add_epi32(s, v);
    }
    (_mm512_reduce_add_epi32(s), iters * (CHAINS * 64 * 2) as u64)
}

fn f32_path() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return "avx512-fma";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "avx2-fma";
        }
    }
    "scalar"
}

fn int8_path() -> Option<&'static str> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            return Some("avx512-vnni");
        }
    }
    None
}

/// Run `step` (iterations → (checksum, ops)) for at least `seconds` on every thread of the
/// current pool; ops per second over the slowest thread.
fn rate<T: Send>(seconds: f64, step: impl Fn(u64) -> (T, u64) + Sync) -> f64 {
    let threads = rayon::current_num_threads();
    let per: Vec<(u64, f64)> = (0..threads)
        .into_par_iter()
        .map(|_| {
            black_box(step(INNER / 16));
            let t = Instant::now();
            let mut ops = 0u64;
            loop {
                let (c, n) = step(black_box(INNER));
                black_box(c);
                ops += n;
                let s = t.elapsed().as_secs_f64();
                if s >= seconds {
                    return (ops, s);
                }
            }
        })
        .collect();
    let ops: u64 = per.iter().map(|p| p.0).sum();
    let slowest = per.iter().map(|p| p.1).fold(0f64, f64::max);
    ops as f64 / slowest
}

/// Measure the f32 FMA and int8 dot-product peaks on `threads` threads, `seconds` each.
pub fn measure(threads: usize, seconds: f64) -> Result<Peak> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    let fp = f32_path();
    let ip = int8_path();
    let (f, i) = pool.install(|| {
        let f = match fp {
            // SAFETY: the path was chosen by runtime feature detection.
            #[cfg(target_arch = "x86_64")]
            "avx512-fma" => rate(seconds, |n| unsafe { fma_avx512(n) }),
            #[cfg(target_arch = "x86_64")]
            "avx2-fma" => rate(seconds, |n| unsafe { fma_avx2(n) }),
            _ => rate(seconds, fma_scalar),
        };
        let i = match ip {
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Some(_) => Some(rate(seconds, |n| unsafe { vnni_avx512(n) })),
            _ => None,
        };
        (f, i)
    });
    Ok(Peak {
        bench: "peak",
        threads: threads.max(1),
        seconds,
        f32_path: fp,
        f32_gflops: f / 1e9,
        int8_path: ip,
        int8_gops: i.map(|v| v / 1e9),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_are_positive_and_finite() {
        let p = measure(1, 0.0).expect("pool");
        assert!(p.f32_gflops.is_finite() && p.f32_gflops > 0.0);
        if let Some(g) = p.int8_gops {
            assert!(g.is_finite() && g > 0.0);
        }
    }

    #[test]
    fn the_scalar_loop_counts_two_flops_per_chain_step() {
        let (_, ops) = fma_scalar(10);
        assert_eq!(ops, 10 * CHAINS as u64 * 2);
    }
}
