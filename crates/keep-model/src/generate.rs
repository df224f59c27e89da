//! Sampling and generation: greedy (temperature 0) or temperature + top-p with a seeded
//! SplitMix64 generator (deterministic for a seed), and keep's one generation loop
//! ([`generate_with`]) over [`Generate`], which the whole model implements here and
//! keep-runtime's budgeted model implements there.

use std::time::Instant;

use crate::cache::Cache;
use crate::model::{Logits, Model};
use crate::observer::RouteObserver;
use crate::Result;

/// Sampling settings.
#[derive(Debug, Clone, Copy)]
pub struct SamplerConfig {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = no truncation.
    pub top_p: f32,
    pub seed: u64,
}

/// A seeded sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    state: u64,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        Sampler {
            cfg,
            state: cfg.seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    fn next_f64(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Pick a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        let t = self.cfg.temperature;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(f64, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &v)| ((((v - m) / t) as f64).exp(), i as u32))
            .collect();
        let z: f64 = p.iter().map(|x| x.0).sum();
        p.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut keep = p.len();
        if self.cfg.top_p < 1.0 {
            let mut c = 0.0;
            for (i, x) in p.iter().enumerate() {
                c += x.0 / z;
                if c >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = p[..keep].iter().map(|x| x.0).sum();
        let mut u = self.next_f64() * mass;
        for x in &p[..keep] {
            u -= x.0;
            if u <= 0.0 {
                return x.1;
            }
        }
        p[keep - 1].1
    }
}

/// Index of the largest logit (first on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Timings of a generation.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenStats {
    pub prompt_tokens: usize,
    pub prefill_secs: f64,
    pub generated: usize,
    pub decode_secs: f64,
}

/// A model the generation loop can drive: the whole model (`&Model`) or one whose routed
/// experts live elsewhere (keep-runtime's budgeted model).
pub trait Generate {
    /// An empty KV cache.
    fn new_cache(&self) -> Cache;
    /// Feed `tokens` after those in `cache`; the logits of the last one.
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>>;
    /// Called once, right after the prompt's forward (a budgeted model takes its prefill
    /// counters here).
    fn prefilled(&mut self) {}
}

impl Generate for &Model<'_> {
    fn new_cache(&self) -> Cache {
        Model::new_cache(self)
    }
    fn forward_last(
        &mut self,
        tokens: &[u32],
        cache: &mut Cache,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        self.forward(tokens, cache, Logits::Last, obs)
    }
}

/// Prefill `prompt`, then sample up to `max_tokens` tokens, calling `on_token` with each; stops
/// early at a token in `stop` (which is passed to `on_token` but not fed back).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop: &[u32],
    on_token: impl FnMut(u32),
) -> Result<GenStats> {
    generate_with(
        &mut &*model,
        prompt,
        max_tokens,
        sampler,
        stop,
        None,
        on_token,
    )
}

/// [`generate`] over any [`Generate`], with an observer of every forward.
pub fn generate_with<G: Generate + ?Sized>(
    model: &mut G,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    stop: &[u32],
    mut obs: Option<&mut dyn RouteObserver>,
    mut on_token: impl FnMut(u32),
) -> Result<GenStats> {
    let mut cache = model.new_cache();
    let t0 = Instant::now();
    let mut logits = model.forward_last(
        prompt,
        &mut cache,
        obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
    )?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    model.prefilled();
    let t1 = Instant::now();
    let mut generated = 0;
    let mut decode_steps = 0;
    while generated < max_tokens {
        let tok = sampler.sample(&logits);
        generated += 1;
        on_token(tok);
        if stop.contains(&tok) || generated == max_tokens {
            break;
        }
        logits = model.forward_last(
            &[tok],
            &mut cache,
            obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
        )?;
        decode_steps += 1;
    }
    Ok(GenStats {
        prompt_tokens: prompt.len(),
        prefill_secs,
        generated: decode_steps,
        decode_secs: t1.elapsed().as_secs_f64(),
    })
}
