//! Aggregate decode tokens/s of one batched step over B sequences against one sequence alone,
//! on any checkpoint (made for `keep synth --preset flash` models; `dev/serve-batch-bench.sh`
//! runs it): each sequence is prefilled with its own deterministic prompt, then `--steps`
//! greedy decode steps run as `forward` (B = 1) or `forward_batch` (B > 1); repetitions of the
//! batch sizes are interleaved and the median is reported as one JSON object on stdout.
//!
//! Usage: cargo run --release -p keep-model --example batch_decode -- DIR
//!        [--batches 1,8] [--steps 8] [--prompt 16] [--reps 3] [--kernels fast|exact]

use std::time::Instant;

use keep_checkpoint::Checkpoint;
use keep_model::generate::{argmax, synthetic_prompt};
use keep_model::{Cache, Kernels, Logits, Model};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).expect("usage: batch_decode DIR [flags]");
    let batches: Vec<usize> = arg(&args, "--batches")
        .unwrap_or_else(|| "1,8".into())
        .split(',')
        .map(|s| s.parse().expect("--batches: numbers"))
        .collect();
    let steps: usize = arg(&args, "--steps").map_or(8, |s| s.parse().unwrap());
    let prompt: usize = arg(&args, "--prompt").map_or(16, |s| s.parse().unwrap());
    let reps: usize = arg(&args, "--reps").map_or(3, |s| s.parse().unwrap());
    let kernels = match arg(&args, "--kernels").as_deref() {
        Some("exact") => Kernels::Exact,
        _ => Kernels::Fast,
    };
    let ck = Checkpoint::open(std::path::Path::new(dir)).expect("open the checkpoint");
    let mut model = Model::load(&ck).expect("load the model");
    model.opts.kernels = kernels;
    let vocab = model.cfg.vocab;
    let mut secs: Vec<Vec<f64>> = vec![vec![]; batches.len()];
    for _ in 0..reps {
        for (bi, &b) in batches.iter().enumerate() {
            let mut caches: Vec<Cache> = vec![];
            let mut next: Vec<u32> = vec![];
            for s in 0..b {
                let mut p = synthetic_prompt(prompt + s, vocab);
                p.drain(..s);
                let mut c = model.new_cache();
                let l = model.forward(&p, &mut c, Logits::Last, None).unwrap();
                next.push(argmax(&l));
                caches.push(c);
            }
            let t = Instant::now();
            for _ in 0..steps {
                if b == 1 {
                    let l = model
                        .forward(&next[..1], &mut caches[0], Logits::Last, None)
                        .unwrap();
                    next[0] = argmax(&l);
                } else {
                    let mut refs: Vec<&mut Cache> = caches.iter_mut().collect();
                    let l = model.forward_batch(&next, &mut refs).unwrap();
                    for (i, n) in next.iter_mut().enumerate() {
                        *n = argmax(&l[i * vocab..(i + 1) * vocab]);
                    }
                }
            }
            secs[bi].push(t.elapsed().as_secs_f64());
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rows: Vec<String> = batches
        .iter()
        .zip(secs.iter_mut())
        .map(|(&b, s)| {
            let m = median(s);
            format!(
                "{{\"batch\": {b}, \"steps\": {steps}, \"median_secs\": {m:.6}, \"aggregate_tokens_per_s\": {:.3}}}",
                (b * steps) as f64 / m
            )
        })
        .collect();
    println!(
        "{{\"dir\": {:?}, \"kernels\": \"{kernels:?}\", \"prompt\": {prompt}, \"reps\": {reps}, \"rows\": [{}]}}",
        dir,
        rows.join(", ")
    );
}
