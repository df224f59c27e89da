//! Hash routing (DeepSeek-V4-Flash's first `num_hash_layers` MoE layers): the experts of a token
//! are fixed by its id, `tid2eid[token]` (`ffn.gate.tid2eid`, `[vocab × top_k]` integers), with
//! no top-k over scores; the learned gate still weighs them. For one token with router logits
//! `z = x·Wᵀ`:
//!
//! ```text
//! s = score(z)                    (sqrtsoftplus / sigmoid / softmax, as the top-k router)
//! e = tid2eid[token]              (k expert ids)
//! w_j = s[e_j] / (Σ_i s[e_i] + 1e-20) · routed_scaling_factor
//! ```
//!
//! as transformers 5.23's `DeepseekV4HashRouter` (which normalises unconditionally). Because the
//! ids depend only on the token, the experts of a hash layer are known as soon as the token is:
//! [`HashTable::experts`] is what an offloading runtime prefetches from.
//!
//! A pruned model keeps the table but remaps ids of removed experts (see keep-convert's prune);
//! a router mask on a hash layer therefore has to come with a remap, not a top-k exclusion.

use keep_checkpoint::{Checkpoint, Dtype};

use crate::config::{ModelConfig, Scoring};
use crate::{ModelError, Result};
use keep_kernels::ops;

/// A layer's `tid2eid` table, decoded and checked (every id below the layer's expert count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashTable {
    pub vocab: usize,
    pub top_k: usize,
    /// `[vocab × top_k]` expert ids.
    pub ids: Vec<u32>,
}

impl HashTable {
    /// Read `layers.{layer}.ffn.gate.tid2eid` (I32 or I64, shape `[vocab, top_k]`).
    pub fn load(ck: &Checkpoint, cfg: &ModelConfig, layer: usize) -> Result<HashTable> {
        let name = format!("layers.{layer}.ffn.gate.tid2eid");
        let t = crate::weights::tensor(ck, &name)?;
        let want = [cfg.vocab as u64, cfg.top_k as u64];
        if t.shape != want {
            return Err(ModelError::Shape {
                name,
                expected: want.to_vec(),
                got: t.shape.to_vec(),
            });
        }
        let n = cfg.vocab * cfg.top_k;
        let raw: Vec<i64> = match t.dtype {
            Dtype::I32 => t
                .bytes
                .chunks_exact(4)
                .take(n)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64)
                .collect(),
            Dtype::I64 => t
                .bytes
                .chunks_exact(8)
                .take(n)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect(),
            d => {
                return Err(ModelError::Format {
                    name,
                    msg: format!("dtype {d}, expected I32 or I64 expert ids"),
                })
            }
        };
        if raw.len() != n {
            return Err(ModelError::Format {
                name,
                msg: format!("{} ids stored, {n} expected", raw.len()),
            });
        }
        HashTable::new(cfg.vocab, cfg.top_k, cfg.experts_in_layer(layer), &raw).map_err(|msg| {
            ModelError::Format {
                name: format!("layers.{layer}.ffn.gate.tid2eid"),
                msg,
            }
        })
    }

    /// A table from raw ids, refusing ids outside `0..n_experts`.
    pub fn new(
        vocab: usize,
        top_k: usize,
        n_experts: usize,
        raw: &[i64],
    ) -> std::result::Result<HashTable, String> {
        if raw.len() != vocab * top_k {
            return Err(format!("{} ids for [{vocab} × {top_k}]", raw.len()));
        }
        let mut ids = Vec::with_capacity(raw.len());
        for (i, &v) in raw.iter().enumerate() {
            if v < 0 || v as usize >= n_experts {
                return Err(format!(
                    "token {} names expert {v}, outside 0..{n_experts}",
                    i / top_k.max(1)
                ));
            }
            ids.push(v as u32);
        }
        Ok(HashTable { vocab, top_k, ids })
    }

    /// The experts of `token` (`None` outside the vocabulary).
    pub fn experts(&self, token: u32) -> Option<&[u32]> {
        let t = token as usize;
        (t < self.vocab).then(|| &self.ids[t * self.top_k..(t + 1) * self.top_k])
    }
}

/// Route one token of a hash layer: `scores` (len E) from `logits` (divided by `gate_temp`
/// in place), `chosen` = the table's ids, `weights` = their normalised, scaled scores.
pub fn route_hash(
    cfg: &ModelConfig,
    logits: &mut [f32],
    ids: &[u32],
    chosen: &mut [u32],
    weights: &mut [f32],
    scores: &mut [f32],
) {
    for v in logits.iter_mut() {
        *v /= cfg.gate_temp;
    }
    match cfg.scoring {
        Scoring::Sigmoid => scores
            .iter_mut()
            .zip(logits.iter())
            .for_each(|(s, &v)| *s = ops::sigmoid(v)),
        Scoring::SqrtSoftplus => scores
            .iter_mut()
            .zip(logits.iter())
            .for_each(|(s, &v)| *s = ops::softplus(v).sqrt()),
        Scoring::Softmax => {
            scores.copy_from_slice(logits);
            ops::softmax(scores);
        }
    }
    let mut sum = 0f32;
    for (s, &j) in ids.iter().enumerate() {
        chosen[s] = j;
        weights[s] = scores[j as usize];
        sum += scores[j as usize];
    }
    for w in weights.iter_mut() {
        *w = *w / (sum + 1e-20) * cfg.route_scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keep_checkpoint::DeepSeekConfig;
    use std::path::Path;

    /// f32 against f64: sqrt(softplus) and one division, a few ulps.
    const TOL: f64 = 1e-6;

    #[test]
    fn table_refuses_out_of_range_ids() {
        assert!(HashTable::new(2, 2, 4, &[0, 1, 2, 3]).is_ok());
        let e = HashTable::new(2, 2, 4, &[0, 1, 2, 4]).unwrap_err();
        assert!(e.contains("token 1") && e.contains("expert 4"), "{e}");
        assert!(HashTable::new(2, 2, 4, &[0, -1, 2, 3]).is_err());
        assert!(HashTable::new(2, 2, 4, &[0, 1, 2]).is_err());
        let t = HashTable::new(2, 2, 4, &[0, 1, 2, 3]).unwrap();
        assert_eq!(t.experts(1), Some(&[2u32, 3][..]));
        assert_eq!(t.experts(2), None);
    }

    #[test]
    fn hash_route_matches_plain_f64() {
        let c = DeepSeekConfig::from_json(
            Path::new("config.json"),
            r#"{"model_type":"deepseek_v4","num_hash_layers":1,"n_routed_experts":8,
                "num_experts_per_tok":3,"routed_scaling_factor":1.5}"#,
        )
        .unwrap();
        let cfg = ModelConfig::from_deepseek(&c).unwrap();
        let logits: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin() * 3.0).collect();
        let ids = [5u32, 0, 3];
        let (mut ch, mut w, mut s) = ([0u32; 3], [0f32; 3], [0f32; 8]);
        let mut l = logits.clone();
        route_hash(&cfg, &mut l, &ids, &mut ch, &mut w, &mut s);
        assert_eq!(ch, ids);
        let sc: Vec<f64> = logits
            .iter()
            .map(|&z| (z as f64).exp().ln_1p().sqrt())
            .collect();
        let sum: f64 = ids.iter().map(|&j| sc[j as usize]).sum();
        for (k, &j) in ids.iter().enumerate() {
            let want = sc[j as usize] / sum * 1.5;
            assert!((w[k] as f64 - want).abs() < TOL, "{} vs {want}", w[k]);
        }
    }
}
