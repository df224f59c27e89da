//! Dev tool: `model_logits DIR --tokens 1,2,3 --out FILE [--decode] [--routes]` writes keep's
//! f32 logits `[T, vocab]` (`logits`), `tokens`, and with `--routes` the chosen experts
//! `routes [L, T, top_k]` (sorted ascending), in the layout of `tools/oracle/model_ref.py`.
//! `--decode` feeds the tokens one at a time through the cache instead of one prefill.
use std::collections::HashMap;

use keep_checkpoint::Checkpoint;
use keep_model::observer::RouteRecorder;
use keep_model::{Logits, Model};
use safetensors::tensor::{Dtype, TensorView};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = &args[1];
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .map(|i| args[i + 1].clone())
    };
    let tokens: Vec<u32> = get("--tokens")
        .unwrap()
        .split(',')
        .map(|t| t.trim().parse().unwrap())
        .collect();
    let out = get("--out").unwrap();
    let decode = args.iter().any(|a| a == "--decode");
    let ck = Checkpoint::open(std::path::Path::new(dir)).unwrap();
    let model = Model::load(&ck).unwrap();
    let mut cache = model.new_cache();
    let mut rec = RouteRecorder::default();
    let t0 = std::time::Instant::now();
    let logits = if decode {
        let mut all = vec![];
        for &t in &tokens {
            all.extend(
                model
                    .forward(&[t], &mut cache, Logits::All, Some(&mut rec))
                    .unwrap(),
            );
        }
        all
    } else {
        model
            .forward(&tokens, &mut cache, Logits::All, Some(&mut rec))
            .unwrap()
    };
    eprintln!(
        "{} tokens in {:.3}s",
        tokens.len(),
        t0.elapsed().as_secs_f64()
    );
    let (l, t, k) = (model.cfg.n_layers, tokens.len(), model.cfg.top_k);
    let mut routes = vec![0i32; l * t * k];
    for (layer, start, ex) in &rec.calls {
        let n = ex.len() / k;
        for i in 0..n {
            let mut r: Vec<i32> = ex[i * k..(i + 1) * k].iter().map(|&v| v as i32).collect();
            r.sort();
            let row = (layer * t + start + i) * k;
            routes[row..row + k].copy_from_slice(&r);
        }
    }
    let lb: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tb: Vec<u8> = tokens
        .iter()
        .flat_map(|&v| (v as i32).to_le_bytes())
        .collect();
    let rb: Vec<u8> = routes.iter().flat_map(|v| v.to_le_bytes()).collect();
    let vocab = logits.len() / t;
    let mut m = HashMap::new();
    m.insert(
        "logits".to_string(),
        TensorView::new(Dtype::F32, vec![t, vocab], &lb).unwrap(),
    );
    m.insert(
        "tokens".to_string(),
        TensorView::new(Dtype::I32, vec![t], &tb).unwrap(),
    );
    m.insert(
        "routes".to_string(),
        TensorView::new(Dtype::I32, vec![l, t, k], &rb).unwrap(),
    );
    safetensors::serialize_to_file(m, None, std::path::Path::new(&out)).unwrap();
}
