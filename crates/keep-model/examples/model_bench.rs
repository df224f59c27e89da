//! Dev benchmark (not a test): `model_bench DIR [--prompt-len 512] [--decode 64] [--reps 3]`
//! prefills a deterministic pseudo-random prompt, then decodes greedily one token at a time
//! through the cache; prints one JSON line with the median prefill and decode tokens/s.
use keep_checkpoint::Checkpoint;
use keep_model::{generate::argmax, Logits, Model};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str, d: usize| {
        args.iter()
            .position(|a| a == k)
            .map(|i| args[i + 1].parse().unwrap())
            .unwrap_or(d)
    };
    let (plen, ndec, reps) = (
        get("--prompt-len", 512),
        get("--decode", 64),
        get("--reps", 3),
    );
    let ck = Checkpoint::open(std::path::Path::new(&args[1])).unwrap();
    let model = Model::load(&ck).unwrap();
    let prompt = keep_model::generate::synthetic_prompt(plen, model.cfg.vocab);
    let (mut pre, mut dec) = (vec![], vec![]);
    for _ in 0..reps {
        let mut cache = model.new_cache();
        let t0 = std::time::Instant::now();
        let mut last = model
            .forward(&prompt, &mut cache, Logits::Last, None)
            .unwrap();
        pre.push(plen as f64 / t0.elapsed().as_secs_f64());
        let t1 = std::time::Instant::now();
        for _ in 0..ndec {
            let t = argmax(&last);
            last = model.forward(&[t], &mut cache, Logits::Last, None).unwrap();
        }
        dec.push(ndec as f64 / t1.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{{\"impl\":\"keep\",\"prompt_len\":{plen},\"decode_tokens\":{ndec},\"reps\":{reps},\"threads\":{},\"prefill_tok_s\":{:.1},\"decode_tok_s\":{:.1}}}",
        rayon_threads(),
        med(&mut pre),
        med(&mut dec)
    );
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
