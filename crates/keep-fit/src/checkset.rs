//! The check set: the token sequences `keep fit` probes with and `keep fit --check` decodes
//! again. Each sequence is a prompt, prefilled, then the rest of a known text fed one token at a
//! time (a decode whose next token is the text's, not the model's pick), so the routes it makes
//! depend on the text alone: the routes `keep fit` records while probing are the routes the
//! check will make, and the hit rate the plan is predicted to get is reproducible. The texts
//! are a pack's held-out records when there is one for the model's vocabulary, otherwise
//! deterministic synthetic ids.

use std::time::Instant;

use keep_artifacts::fit_plan::CheckSet;
use keep_artifacts::routes::{LayerRoutes, RouteTrace, Session};
use keep_calib::pack::{Pack, Split};
use keep_model::generate::Generate;
use keep_model::RouteObserver;
use keep_runtime::{RouteLog, RunModel};

use crate::{FitError, Result};

/// Sequences in a check set unless asked otherwise.
pub const DEFAULT_SEQUENCES: usize = 4;
/// Seed of the synthetic sequences (the i-th uses this plus i).
const SYNTHETIC_SEED: u64 = 0x6b65_6570_6669_7400;

/// Up to `n` held-out records of `pack` (one per held-out group in turn), each cut to
/// `prompt + decode` tokens; refused when none is long enough or ids exceed `vocab`.
pub fn held_out(
    pack: &Pack,
    vocab: usize,
    n: usize,
    prompt: usize,
    decode: usize,
) -> Result<CheckSet> {
    let len = prompt + decode;
    if pack.manifest.vocab_size > vocab {
        return Err(FitError::Invalid(format!(
            "the pack {} has a vocabulary of {} ids, the model {}",
            pack.dir.display(),
            pack.manifest.vocab_size,
            vocab
        )));
    }
    let groups = pack.groups(Split::Eval);
    let per_group: Vec<Vec<&[u32]>> = groups
        .iter()
        .map(|g| {
            pack.records_of(&g.id)
                .filter(|r| r.tokens.len() >= len)
                .map(|r| &r.tokens[..len])
                .collect()
        })
        .collect();
    let mut sequences = vec![];
    let mut round = 0;
    while sequences.len() < n && per_group.iter().any(|g| g.len() > round) {
        for g in &per_group {
            if sequences.len() < n {
                if let Some(s) = g.get(round) {
                    sequences.push(s.to_vec());
                }
            }
        }
        round += 1;
    }
    if sequences.is_empty() {
        return Err(FitError::Invalid(format!(
            "the pack {} has no held-out record of {len} tokens",
            pack.dir.display()
        )));
    }
    Ok(CheckSet {
        source: format!("held-out records of {}", pack.dir.display()),
        prompt_tokens: prompt,
        sequences,
    })
}

/// `n` sequences of `prompt + decode` deterministic pseudo-random ids below `vocab`.
pub fn synthetic(vocab: usize, n: usize, prompt: usize, decode: usize) -> CheckSet {
    let sequences = (0..n as u64)
        .map(|i| {
            // keep-rng's SplitMix64: a fixed stream per sequence, the same on every machine.
            let mut z = keep_rng::splitmix(
                SYNTHETIC_SEED.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            );
            (0..prompt + decode)
                .map(|_| (keep_rng::RngCore::next_u64(&mut z) % vocab.max(1) as u64) as u32)
                .collect()
        })
        .collect();
    CheckSet {
        source: "synthetic ids".into(),
        prompt_tokens: prompt,
        sequences,
    }
}

/// What decoding a check set measured, summed over its sequences (decode steps only).
#[derive(Debug, Clone, Default)]
pub struct Decoded {
    pub decode_tokens: usize,
    pub decode_secs: f64,
    /// Expert cache counters of the decode steps (zero without a budget).
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub io_busy_secs: f64,
    pub wait_secs: f64,
    /// Engram rows' wait during the decode steps.
    pub engram_wait_secs: f64,
    /// Whether the model ran under a budget (the counters mean something).
    pub budgeted: bool,
    /// Every sequence's routes (prefill and decode), when recorded.
    pub trace: RouteTrace,
}

impl Decoded {
    /// Decoded tokens per second.
    pub fn tps(&self) -> f64 {
        if self.decode_secs > 0.0 {
            self.decode_tokens as f64 / self.decode_secs
        } else {
            0.0
        }
    }
    /// `hits / (hits + misses)` of the decode steps (1 when nothing was routed).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            1.0
        } else {
            self.hits as f64 / n as f64
        }
    }
    /// Read rate while reads were in flight, GB/s (0 without reads).
    pub fn read_gbps(&self) -> f64 {
        if self.io_busy_secs > 0.0 {
            self.bytes_read as f64 / self.io_busy_secs / 1e9
        } else {
            0.0
        }
    }
}

/// Both of two optional route logs.
struct Tee<'a, 'b>(Option<&'a mut RouteLog>, Option<&'b mut RouteLog>);

impl RouteObserver for Tee<'_, '_> {
    fn on_route(&mut self, ev: &keep_model::RouteEvent) {
        if let Some(l) = self.0.as_deref_mut() {
            l.on_route(ev);
        }
        if let Some(l) = self.1.as_deref_mut() {
            l.on_route(ev);
        }
    }
}

/// Decode `set` with `model`: each sequence's prompt prefilled, then its remaining tokens fed
/// one at a time, timed; the routes recorded into the result's trace when `record`, and into
/// `fold` (all sequences in one log) when given.
pub fn decode(
    model: &mut RunModel,
    set: &CheckSet,
    record: bool,
    mut fold: Option<&mut RouteLog>,
) -> Result<Decoded> {
    let cfg = model.cfg().clone();
    let mut out = Decoded {
        budgeted: model.budgeted().is_some(),
        ..Decoded::default()
    };
    for (i, seq) in set.sequences.iter().enumerate() {
        let p = set.prompt_tokens.min(seq.len());
        let mut log = RouteLog::new();
        model.starting();
        let mut cache = model.new_cache();
        let observe = record || fold.is_some();
        {
            let mut tee = Tee(record.then_some(&mut log), fold.as_deref_mut());
            model.forward_last(
                &seq[..p],
                &mut cache,
                observe.then_some(&mut tee as &mut dyn RouteObserver),
            )?;
        }
        model.prefilled();
        let t0 = Instant::now();
        for &tok in &seq[p..] {
            let mut tee = Tee(record.then_some(&mut log), fold.as_deref_mut());
            model.forward_last(
                &[tok],
                &mut cache,
                observe.then_some(&mut tee as &mut dyn RouteObserver),
            )?;
        }
        out.decode_secs += t0.elapsed().as_secs_f64();
        out.decode_tokens += seq.len() - p;
        if let Some(m) = model.budgeted() {
            let s = m.cache().stats();
            out.hits += s.hits;
            out.misses += s.misses;
            out.bytes_read += s.bytes_read;
            out.io_busy_secs += s.io_busy_secs;
            out.wait_secs += s.wait_secs;
            if let Some(e) = m.engram() {
                out.engram_wait_secs += e.stats().wait_secs;
            }
        }
        if record {
            let k = log.top_k().max(1);
            let layers = log
                .layer_routes()
                .map(|(layer, ex)| LayerRoutes {
                    layer,
                    top_k: k,
                    n_experts: cfg.n_experts,
                    hash: layer < cfg.hash_layers,
                    experts: ex.iter().map(|&e| e as u16).collect(),
                    weights: vec![1.0 / k as f32; ex.len()],
                })
                .collect();
            out.trace.sessions.push(Session {
                id: format!("check-{i}"),
                model_fingerprint: None,
                layers,
                source: None,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_sets_are_fixed_distinct_and_in_range() {
        let a = synthetic(100, 3, 4, 5);
        assert_eq!(a, synthetic(100, 3, 4, 5));
        // The stream plans record: SplitMix64 from the fixed seed.
        assert_eq!(a.sequences[0], [40, 85, 13, 91, 97, 46, 13, 55, 17]);
        assert_eq!(a.sequences.len(), 3);
        assert!(a.sequences.iter().all(|s| s.len() == 9));
        assert!(a.sequences.iter().flatten().all(|&t| t < 100));
        assert_ne!(a.sequences[0], a.sequences[1]);
    }
}
