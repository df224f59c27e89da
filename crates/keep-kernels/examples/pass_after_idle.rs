//! How long one parallel pass over the worker pool takes after the pool has been idle: the
//! calling thread works alone for GAP microseconds (as a forward does between its products:
//! norms, attention scores, routing), then one memory-bound pass reads 32 MiB in 32 tasks (the
//! size of a decode token's expert pass), timed. Each pass reads the next 32 MiB of a 1 GiB
//! buffer, so the reads come from memory, not the caches. Prints one JSON line per gap: the
//! median pass time and its ratio to the pass with no gap. A pass that slows with the gap is
//! paying for the workers' wake-up (rayon's workers sleep once idle for a while; on a virtual
//! machine an idle vCPU can take long to run again).
//!
//! Usage: cargo run --release -p keep-kernels --example pass_after_idle -- [THREADS] [PASSES]

use std::time::{Duration, Instant};

use rayon::prelude::*;

fn busy(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let passes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
    {
        eprintln!("cannot size the pool: {e}");
        std::process::exit(1);
    }
    let pass_words = (32usize << 20) / 8;
    let words = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut at = 0;
    let mut base = None;
    for gap_us in [0u64, 50, 200, 1000, 3000] {
        let mut times: Vec<f64> = Vec::with_capacity(passes);
        let mut check = 0u64;
        for _ in 0..passes {
            busy(Duration::from_micros(gap_us));
            let part = &buf[at..at + pass_words];
            at = (at + pass_words) % words;
            let t = Instant::now();
            let s = part
                .par_chunks(pass_words / 32)
                .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                .reduce(|| 0, u64::wrapping_add);
            times.push(t.elapsed().as_secs_f64() * 1e6);
            check = check.wrapping_add(s);
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let b = *base.get_or_insert(med);
        println!(
            "{{\"threads\":{threads},\"gap_us\":{gap_us},\"pass_us_median\":{med:.1},\"pass_gbps\":{:.2},\"ratio_to_no_gap\":{:.3},\"check\":{check}}}",
            (pass_words * 8) as f64 / med / 1e3,
            med / b
        );
    }
}
