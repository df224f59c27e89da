//! Measure the two bandwidths the residency cost model needs, on this machine, now: memory read
//! bandwidth (summing a 1 GiB buffer on every core, best of 5) and the expert store's read
//! bandwidth (random routed experts of MODEL read the way the slot cache reads them: O_DIRECT
//! into aligned slots, `--io-threads` at once). Prints one JSON object.
//!
//! Usage: cargo run --release -p keep-runtime --example bandwidth -- MODEL [EXPERTS] [IO_THREADS]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_model::ModelConfig;
use keep_runtime::aligned::AlignedBuf;
use keep_runtime::ExpertStore;

fn mem_gbps() -> f64 {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per = (1usize << 30) / threads / 8;
    let bufs: Vec<Arc<Vec<u64>>> = (0..threads)
        .map(|t| Arc::new((0..per as u64).map(|i| i ^ t as u64).collect()))
        .collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        let hs: Vec<_> = bufs
            .iter()
            .map(|b| {
                let b = b.clone();
                std::thread::spawn(move || b.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
            })
            .collect();
        let s: u64 = hs.into_iter().map(|h| h.join().unwrap_or(0)).sum();
        std::hint::black_box(s);
        best = best.max((per * 8 * threads) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .ok_or("usage: bandwidth MODEL [EXPERTS] [IO_THREADS]")?;
    let n: usize = args.get(2).map_or(Ok(48), |s| s.parse())?;
    let threads: usize = args.get(3).map_or(Ok(8), |s| s.parse())?;
    let ck = Checkpoint::open(std::path::Path::new(dir))?;
    let cfg = ModelConfig::from_checkpoint(&ck)?;
    let store = Arc::new(ExpertStore::open(&ck, &cfg, true)?);
    // Distinct random (layer, expert) pairs.
    let mut r = keep_rng::rng(0x2545_F491_4F6C_DD1D);
    let mut picks = vec![];
    let total = cfg.n_layers * cfg.n_experts;
    while picks.len() < n.min(total) {
        let i = keep_rng::Draw::below(&mut r, total);
        if !picks.contains(&i) {
            picks.push(i);
        }
    }
    let picks = Arc::new(picks);
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|_| {
            let (store, picks, next, ne) =
                (store.clone(), picks.clone(), next.clone(), cfg.n_experts);
            std::thread::spawn(move || -> u64 {
                let mut buf = AlignedBuf::new(store.slot_bytes() as usize).expect("slot");
                let mut bytes = 0;
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = picks.get(k) else { return bytes };
                    bytes += store
                        .read_into(i / ne, i % ne, buf.as_mut_slice())
                        .expect("read");
                }
            })
        })
        .collect();
    let bytes: u64 = hs.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    let secs = t0.elapsed().as_secs_f64();
    let mem = mem_gbps();
    println!(
        "{}",
        serde_json::json!({
            "format": "keep-bandwidth", "version": 1,
            "command": args.join(" "),
            "ssd_gbps": bytes as f64 / secs / 1e9,
            "ssd_bytes": bytes, "ssd_secs": secs, "experts": picks.len(),
            "io_threads": threads, "direct_io": store.direct_io(),
            "mem_gbps": mem,
        })
    );
    Ok(())
}
