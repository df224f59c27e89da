//! A DeepSeek-V3-family checkpoint with NVFP4 routed experts (compressed-tensors'
//! `nvfp4-pack-quantized`, a format of keep-format's registry): `keep synth --experts nvfp4`
//! writes it with the scheme's `quantization_config`, `keep inspect` names and sizes the
//! experts, `keep logits` and `keep run` run them, and its logits equal those of the same
//! weights dequantized (every routed expert written as the f32 matrix `e2m1 · (s / g)` of the
//! entry's reference decode) bit for bit on the exact kernels and on the fast ones (which run
//! NVFP4, having no integer form, on the decoded-row f32 path), within the fast-kernel KL rule.

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

/// `src` with every registered-format weight replaced by its f32 decode (`<base>.weight`),
/// every part the kernels read (the global scale included) passed to the entry's reference.
fn dequantized_twin(src: &Path, out: &Path) {
    let ck = Checkpoint::open(src).unwrap();
    let mut metas = vec![];
    let mut data: Vec<(String, Vec<u8>)> = vec![];
    for t in ck.tensors() {
        let main = keep_format::registry::find_main(t.name, t.dtype.name());
        match (main, keep_format::registry::find_by_part(t.name)) {
            (Some((f, base)), _) => {
                let (rows, cols) = (f.logical)(t.shape).unwrap();
                let parts: Vec<&[u8]> = f
                    .computed()
                    .map(|(i, p)| match i {
                        0 => t.bytes,
                        _ => ck.get(&format!("{base}{}", p.suffix)).unwrap().bytes,
                    })
                    .collect();
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
            (None, Some(_)) => {}
            (None, None) => {
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
fn nvfp4_experts_synthesise_inspect_and_run_as_their_dequantized_weights() {
    let dir = tempfile::tempdir().unwrap();
    let w = dir.path();
    let cache = w.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let cfg = w.join("config.json");
    std::fs::write(&cfg, CONFIG).unwrap();
    let q = w.join("nvfp4");
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--experts",
            "nvfp4",
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
    assert_eq!(qc["format"], "nvfp4-pack-quantized");
    let wq = &qc["config_groups"]["group_0"]["weights"];
    assert_eq!(
        (
            &wq["type"],
            &wq["num_bits"],
            &wq["group_size"],
            &wq["strategy"]
        ),
        (
            &"float".into(),
            &4.into(),
            &16.into(),
            &"tensor_group".into()
        )
    );
    // Routed experts in the format's three parts; attention and shared experts bf16.
    let ck = Checkpoint::open(&q).unwrap();
    let e = "model.layers.1.mlp.experts.3.down_proj";
    let p = ck.get(&format!("{e}.weight_packed")).unwrap();
    assert_eq!((p.dtype, p.shape), (Dtype::U8, &[256u64, 32][..]));
    let s = ck.get(&format!("{e}.weight_scale")).unwrap();
    assert_eq!((s.dtype, s.shape), (Dtype::F8_E4M3, &[256u64, 4][..]));
    assert!(ck.get(&format!("{e}.weight")).is_none());
    // The global scale is the whole matrix's: 448 · 6 / amax, so some group's scale is 448.
    let g = ck.get(&format!("{e}.weight_global_scale")).unwrap();
    assert_eq!((g.dtype, g.shape), (Dtype::F32, &[1u64][..]));
    assert!(f32::from_le_bytes(g.bytes.try_into().unwrap()) > 1.0);
    assert!(
        s.bytes.contains(&0x7E),
        "no group holds the matrix's largest weight"
    );
    let a = ck.get("model.layers.1.self_attn.o_proj.weight").unwrap();
    assert_eq!(a.dtype, Dtype::BF16);
    drop(ck);
    keep(&cache)
        .arg("inspect")
        .arg(&q)
        .assert()
        .success()
        .stdout(predicate::str::contains("nvfp4"))
        .stdout(predicate::str::contains("16 in each of 2 layers"))
        .stdout(predicate::str::contains("no problems found"));
    keep(&cache)
        .args(["inspect", "--json"])
        .arg(&q)
        .assert()
        .success()
        // 4 bits a weight, one FP8 scale per 16 (0.5), the 4-byte global scale per matrix.
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
        "keep logits: nvfp4 vs dequantized differ at {first:?}"
    );

    // The fast kernels: NVFP4 has no integer form (two FP8 scales per 32 columns), so its
    // experts run on the decoded-row f32 path, as the dequantized experts do (f32, which the
    // fast mode multiplies exactly; everything else runs the same fast kernels in both): under
    // the fast-kernel rule's KL bound over the tokens whose experts agree (a random model's
    // router has near ties).
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
    mq.opts.kernels = Kernels::Fast;
    md.opts.kernels = Kernels::Fast;
    let (mut rq, mut rd) = (RouteRecorder::default(), RouteRecorder::default());
    let fast = mq
        .forward(&tokens, &mut mq.new_cache(), Logits::All, Some(&mut rq))
        .unwrap();
    let fast_deq = md
        .forward(&tokens, &mut md.new_cache(), Logits::All, Some(&mut rd))
        .unwrap();
    // The same f32 rows through the same kernels: equal, so within the bound too.
    assert_eq!(fast, fast_deq, "fast kernels: nvfp4 vs dequantized");
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
        "fast nvfp4 experts vs dequantized: mean KL {mean:.3e} over the {same} of {} tokens \
         routed alike",
        tokens.len()
    );
    assert!(
        same * 4 >= tokens.len() * 3,
        "only {same} tokens routed alike"
    );
    assert!(mean <= MAX_MEAN_KL, "fast nvfp4 experts: mean KL {mean:e}");

    keep(&cache)
        .arg("run")
        .arg(&q)
        .args(["--prompt-tokens", "8", "--max-tokens", "4"])
        .assert()
        .success();
    // An unknown name lists the registered formats, this one among them.
    keep(&cache)
        .args([
            "synth",
            "--family",
            "deepseek_v3",
            "--experts",
            "fp4",
            "--config",
        ])
        .arg(&cfg)
        .arg("--out")
        .arg(w.join("no"))
        .assert()
        .failure()
        .stderr(predicate::str::contains("nvfp4"));
}
