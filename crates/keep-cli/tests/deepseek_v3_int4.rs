//! A DeepSeek-V3-family checkpoint with Kimi-K2-Thinking's INT4 group-32 routed experts
//! (compressed-tensors' `pack-quantized`, a format of keep-format's registry): `keep synth
//! --experts int4-g32` writes it with the release's `quantization_config`, `keep inspect` names
//! and sizes the experts, `keep logits` and `keep run` run them, and its logits equal those of
//! the same weights dequantized (every routed expert written as the f32 matrix `q · s`, exact)
//! bit for bit on the exact kernels, and within the fast-kernel KL rule on the fast ones.

use std::path::Path;

use assert_cmd::Command;
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype};
use keep_model::observer::RouteRecorder;
use keep_model::{Kernels, Logits, Model};
use predicates::prelude::*;

const CONFIG: &str = r#"{"architectures":["DeepseekV3ForCausalLM"],"model_type":"deepseek_v3",
  "vocab_size":4096,"hidden_size":256,"intermediate_size":320,"moe_intermediate_size":64,
  "num_hidden_layers":3,"num_attention_heads":4,"n_routed_experts":16,"n_shared_experts":1,
  "q_lora_rank":96,"kv_lora_rank":64,"qk_nope_head_dim":32,"qk_rope_head_dim":16,
  "v_head_dim":32,"n_group":4,"topk_group":2,"num_experts_per_tok":4,
  "first_k_dense_replace":1,"routed_scaling_factor":2.5,"max_position_embeddings":4096,
  "rope_theta":10000,"bos_token_id":0,"eos_token_id":1,
  "rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":1024,
  "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}}"#;

/// The fast-kernel rule's bound on mean KL(exact ‖ fast), nats per position (as
/// `fast_kernels_rule.rs`).
const MAX_MEAN_KL: f64 = 1e-3;

fn keep(cache: &Path) -> Command {
    let mut c = Command::cargo_bin("keep").unwrap();
    c.env("KEEP_CACHE_DIR", cache);
    c
}

/// `src` with every registered-format weight replaced by its f32 decode (`<base>.weight`).
fn dequantized_twin(src: &Path, out: &Path) {
    let ck = Checkpoint::open(src).unwrap();
    let mut metas = vec![];
    let mut data: Vec<(String, Vec<u8>)> = vec![];
    for t in ck.tensors() {
        match keep_format::registry::find_by_part(t.name) {
            Some((f, 0, base)) => {
                let (rows, cols) = (f.logical)(t.shape).unwrap();
                let scale = ck.get(&format!("{base}{}", f.parts[1].suffix)).unwrap();
                let parts = [t.bytes, scale.bytes];
                let mut row = vec![0f32; cols];
                let mut bytes = Vec::with_capacity(rows * cols * 4);
                for r in 0..rows {
                    (f.decode_row_ref)(&parts, cols, r, &mut row);
                    bytes.extend(row.iter().flat_map(|v| v.to_le_bytes()));
                }
                let name = format!("{base}.weight");
                metas.push(TensorMeta::new(
                    &name,
                    Dtype::F32,
                    &[rows as u64, cols as u64],
                ));
                data.push((name, bytes));
            }
            Some(_) => {}
            None => {
                metas.push(TensorMeta::new(t.name, t.dtype, t.shape));
                data.push((t.name.to_string(), t.bytes.to_vec()));
            }
        }
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    let mut w = CheckpointWriter::create(out, metas, WriterOptions::default()).unwrap();
    for (n, b) in &data {
        w.write_tensor(n, b).unwrap();
    }
    w.add_file("config.json", cfg.to_string().as_bytes())
        .unwrap();
    w.finish().unwrap();
}

/// The f32 `logits` of a `keep logits` file.
fn logits_of(path: &Path) -> Vec<f32> {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let o = &h["logits"]["data_offsets"];
    let (s, e) = (
        o[0].as_u64().unwrap() as usize,
        o[1].as_u64().unwrap() as usize,
    );
    b[8 + n + s..8 + n + e]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - z).collect()
}

#[test]
fn int4_g32_experts_synthesise_inspect_and_run_as_their_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let q = w.join("int4");
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--experts",
            "int4-g32",
            "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(&q)
        .assert()
        .success();
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(q.join("config.json")).unwrap()).unwrap();
    let qc = &c["quantization_config"];
    assert_eq!(qc["quant_method"], "compressed-tensors");
    assert_eq!(qc["format"], "pack-quantized");
    let wq = &qc["config_groups"]["group_0"]["weights"];
    assert_eq!(
        (&wq["num_bits"], &wq["group_size"], &wq["symmetric"]),
        (&4.into(), &32.into(), &true.into())
    );
    // Routed experts in the format's three parts; attention and shared experts bf16.
    let ck = Checkpoint::open(&q).unwrap();
    let e = "model.layers.1.mlp.experts.3.down_proj";
    let p = ck.get(&format!("{e}.weight_packed")).unwrap();
    assert_eq!((p.dtype, p.shape), (Dtype::I32, &[256u64, 8][..]));
    let s = ck.get(&format!("{e}.weight_scale")).unwrap();
    assert_eq!((s.dtype, s.shape), (Dtype::BF16, &[256u64, 2][..]));
    assert!(ck.get(&format!("{e}.weight")).is_none());
    let sh = ck.get(&format!("{e}.weight_shape")).unwrap();
    assert_eq!(sh.bytes, [0, 1, 0, 0, 64, 0, 0, 0]);
    let a = ck.get("model.layers.1.self_attn.o_proj.weight").unwrap();
    assert_eq!(a.dtype, Dtype::BF16);
    drop(ck);
    keep(&cache)
        .arg("inspect")
        .arg(&q)
        .assert()
        .success()
        .stdout(predicate::str::contains("int4-g32"))
        .stdout(predicate::str::contains("16 in each of 2 layers"))
        .stdout(predicate::str::contains("no problems found"));
    keep(&cache)
        .args(["inspect", "--json"])
        .arg(&q)
        .assert()
        .success()
        // 4 bits a weight, one bf16 scale per 32 (0.5), the 8-byte shape per matrix.
        .stdout(predicate::str::contains("4.5"));

    let twin = w.join("dequantized");
    dequantized_twin(&q, &twin);
    let tokens: Vec<u32> = (0..12).map(|i| (i * 331 + 7) % 4096).collect();
    let ids = tokens
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    for (dirn, out) in [(&q, "q.safetensors"), (&twin, "d.safetensors")] {
        keep(&cache)
            .arg("logits")
            .arg(dirn)
            .args(["--tokens", &ids, "--out"])
            .arg(w.join(out))
            .assert()
            .success();
    }
    let (lq, ld) = (
        logits_of(&w.join("q.safetensors")),
        logits_of(&w.join("d.safetensors")),
    );
    assert_eq!(lq.len(), tokens.len() * 4096);
    let first = lq
        .iter()
        .zip(&ld)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert!(
        first.is_none(),
        "keep logits: int4-g32 vs dequantized differ at {first:?}"
    );

    // The fast kernels (int8 activations × int4 weights) against the exact dequantized run.
    let ckq = Checkpoint::open(&q).unwrap();
    let ckd = Checkpoint::open(&twin).unwrap();
    let mut mq = Model::load(&ckq).unwrap();
    let mut md = Model::load(&ckd).unwrap();
    let exact = md
        .forward(&tokens, &mut md.new_cache(), Logits::All, None)
        .unwrap();
    let mine = mq
        .forward(&tokens, &mut mq.new_cache(), Logits::All, None)
        .unwrap();
    assert_eq!(mine, exact, "exact kernels, through the library");
    // The fast kernels: the int4-g32 experts on the integer kernels (int8 activations ×
    // int4 weights), against the same run with the dequantized experts (f32, which the fast
    // mode multiplies exactly; everything else runs the same fast kernels in both): what the
    // format's fast path costs, under the fast-kernel rule's KL bound. A random model's router
    // has near ties, so an activation rounding can change a token's experts (a discrete jump no
    // kernel bound covers): the bound holds over the tokens whose experts agree, and most do.
    mq.opts.kernels = Kernels::Fast;
    md.opts.kernels = Kernels::Fast;
    let (mut rq, mut rd) = (RouteRecorder::default(), RouteRecorder::default());
    let fast = mq
        .forward(&tokens, &mut mq.new_cache(), Logits::All, Some(&mut rq))
        .unwrap();
    let fast_deq = md
        .forward(&tokens, &mut md.new_cache(), Logits::All, Some(&mut rd))
        .unwrap();
    assert!(
        fast != fast_deq,
        "fast mode ran the exact kernels on the int4-g32 experts"
    );
    let routes = |r: &RouteRecorder| -> Vec<Vec<Vec<u32>>> {
        let mut per = vec![vec![]; tokens.len()];
        for (_, start, ex) in &r.calls {
            for (j, row) in ex.chunks_exact(mq.cfg.top_k).enumerate() {
                let mut row = row.to_vec();
                row.sort_unstable();
                per[start + j].push(row);
            }
        }
        per
    };
    let (routes_q, routes_d) = (routes(&rq), routes(&rd));
    let v = 4096;
    let (mut kl, mut same) = (0f64, 0usize);
    for i in 0..tokens.len() {
        if routes_q[i] != routes_d[i] {
            continue;
        }
        let (a, b) = (
            log_softmax(&fast_deq[i * v..(i + 1) * v]),
            log_softmax(&fast[i * v..(i + 1) * v]),
        );
        kl += a
            .iter()
            .zip(&b)
            .map(|(x, y)| x.exp() * (x - y))
            .sum::<f64>();
        same += 1;
    }
    let mean = kl / same as f64;
    eprintln!(
        "fast int4-g32 experts vs dequantized: mean KL {mean:.3e} over the {same} of {} tokens \
         routed alike",
        tokens.len()
    );
    assert!(
        same * 4 >= tokens.len() * 3,
        "only {same} tokens routed alike"
    );
    assert!(
        mean <= MAX_MEAN_KL,
        "fast int4-g32 experts: mean KL {mean:e}"
    );

    keep(&cache)
        .arg("run")
        .arg(&q)
        .args(["--prompt-tokens", "8", "--max-tokens", "4"])
        .assert()
        .success();
    // The flag is DeepSeek-V3's, and names a registered format.
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--experts",
            "int3",
            "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(w.join("no"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("int4-g32"));
}
