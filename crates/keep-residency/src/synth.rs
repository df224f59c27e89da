//! Synthetic route traces with temporal locality, for tests, demos and replay-speed numbers
//! before a real calibration run exists. Not a model of any particular checkpoint.
//!
//! Per layer, experts have a Zipf-like base popularity (exponent `zipf`) over a random
//! permutation. Each session keeps a *working set* of `working_set` experts drawn from that
//! popularity; each token, with probability `drift`, one member is replaced by a fresh draw
//! (the topic drifts). Each of a token's `top_k` distinct experts comes from the working set
//! with probability `locality`, else from the base popularity. Gate weights are random,
//! sorted descending (the router's order) and normalised to sum to 1. A deterministic
//! SplitMix64 stream (keep-rng's) makes every trace reproducible from its seed.

use keep_artifacts::routes::{LayerRoutes, RouteTrace, Session};
use keep_rng::Draw;

/// The shape and locality of a synthetic trace.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    pub layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    /// Tokens per session.
    pub tokens: usize,
    pub sessions: usize,
    pub seed: u64,
    /// Experts in a session's working set.
    pub working_set: usize,
    /// Probability a slot is drawn from the working set.
    pub locality: f64,
    /// Per-token probability that one working-set member is replaced.
    pub drift: f64,
    /// Exponent of the base popularity (`rank^-zipf`).
    pub zipf: f64,
}

impl Default for SynthSpec {
    fn default() -> Self {
        SynthSpec {
            layers: 8,
            n_experts: 256,
            top_k: 6,
            tokens: 2048,
            sessions: 4,
            seed: 1,
            working_set: 48,
            locality: 0.85,
            drift: 0.05,
            zipf: 0.8,
        }
    }
}

impl SynthSpec {
    /// Parse `key=value,...` over the defaults (`layers`, `experts`, `top_k`, `tokens`,
    /// `sessions`, `seed`, `working_set`, `locality`, `drift`, `zipf`); `""` gives the defaults.
    pub fn parse(s: &str) -> Result<SynthSpec, String> {
        let mut o = SynthSpec::default();
        for kv in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("`{kv}` is not key=value"))?;
            let u = || {
                v.parse::<usize>()
                    .map_err(|_| format!("{k}: `{v}` is not a whole number"))
            };
            let f = || {
                v.parse::<f64>()
                    .map_err(|_| format!("{k}: `{v}` is not a number"))
            };
            match k {
                "layers" => o.layers = u()?,
                "experts" | "n_experts" => o.n_experts = u()?,
                "top_k" | "k" => o.top_k = u()?,
                "tokens" => o.tokens = u()?,
                "sessions" => o.sessions = u()?,
                "seed" => o.seed = u()? as u64,
                "working_set" => o.working_set = u()?,
                "locality" => o.locality = f()?,
                "drift" => o.drift = f()?,
                "zipf" => o.zipf = f()?,
                _ => return Err(format!("unknown key `{k}`")),
            }
        }
        if o.n_experts == 0 || o.n_experts > keep_artifacts::routes::MAX_EXPERTS {
            return Err(format!(
                "experts must be in 1..={}",
                keep_artifacts::routes::MAX_EXPERTS
            ));
        }
        if o.top_k == 0 || o.top_k > o.n_experts {
            return Err("top_k must be in 1..=experts".into());
        }
        if o.layers == 0 || o.sessions == 0 {
            return Err("layers and sessions must be at least 1".into());
        }
        // Checked before anything is allocated: a trace holds 6 bytes a routed slot in memory
        // (u32 expert + f16 weight) and again on disk.
        let slots =
            (o.sessions as u128) * (o.tokens as u128) * (o.layers as u128) * (o.top_k as u128);
        if slots > MAX_SYNTH_SLOTS as u128 {
            return Err(format!(
                "sessions × tokens × layers × top_k = {slots} routed slots; a synthetic trace holds at most {MAX_SYNTH_SLOTS} ({} GB in memory)",
                MAX_SYNTH_SLOTS * 6 / 1_000_000_000
            ));
        }
        Ok(o)
    }
}

/// Most routed slots a synthetic trace may hold (sessions × tokens × layers × top_k).
pub const MAX_SYNTH_SLOTS: u64 = 1 << 30;

/// The traces' generator: keep-rng's SplitMix64 stream started at `spec.seed` (so a seed makes
/// the same trace).
type Rng = keep_rng::SplitMix64;

/// Write [`synthetic`]'s trace of `spec` into `dir` as a run directory: one `keep-routes` file
/// per session (`{id}.safetensors`, keep-artifacts' writer, metadata `synthetic` = the spec).
/// `dir` must be new or empty (it is created).
pub fn write_run(dir: &std::path::Path, spec: &SynthSpec) -> crate::Result<RouteTrace> {
    let io = |err| crate::ResidencyError::Io {
        path: dir.to_path_buf(),
        err,
    };
    if dir.exists() && std::fs::read_dir(dir).map_err(io)?.next().is_some() {
        return Err(crate::ResidencyError::Trace {
            path: dir.to_path_buf(),
            msg: "exists and is not empty; --make-synthetic writes a new run directory".into(),
        });
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let t = synthetic(spec);
    let meta = std::collections::BTreeMap::from([("synthetic".to_string(), format!("{spec:?}"))]);
    for s in &t.sessions {
        let p = dir.join(format!("{}.safetensors", s.id));
        keep_artifacts::routes::write_session(&p, s, &meta, false)?;
    }
    Ok(t)
}

/// A synthetic trace (see the module doc). Layers are numbered `0..layers`.
pub fn synthetic(spec: &SynthSpec) -> RouteTrace {
    let n = spec.n_experts.max(1);
    let k = spec.top_k.clamp(1, n);
    let ws = spec.working_set.clamp(k, n);
    let mut rng = keep_rng::splitmix(spec.seed);
    // Per layer: a popularity CDF over a random permutation of the experts.
    let cdfs: Vec<(Vec<f64>, Vec<u16>)> = (0..spec.layers)
        .map(|_| {
            let mut perm: Vec<u16> = (0..n as u32).map(|e| e as u16).collect();
            for i in (1..n).rev() {
                perm.swap(i, rng.below(i + 1));
            }
            let mut acc = 0.0;
            let cdf = (0..n)
                .map(|r| {
                    acc += ((r + 1) as f64).powf(-spec.zipf);
                    acc
                })
                .collect();
            (cdf, perm)
        })
        .collect();
    let draw = |rng: &mut Rng, l: usize| -> u16 {
        let (cdf, perm) = &cdfs[l];
        let x = rng.unit() * cdf[n - 1];
        let r = cdf.partition_point(|&c| c <= x).min(n - 1);
        perm[r]
    };
    let mut sessions = Vec::with_capacity(spec.sessions);
    for si in 0..spec.sessions {
        let mut layers = Vec::with_capacity(spec.layers);
        for l in 0..spec.layers {
            let mut set: Vec<u16> = vec![];
            let mut in_set = vec![false; n];
            while set.len() < ws {
                let e = draw(&mut rng, l);
                if !in_set[e as usize] {
                    in_set[e as usize] = true;
                    set.push(e);
                }
            }
            let mut experts = Vec::with_capacity(spec.tokens * k);
            let mut weights = Vec::with_capacity(spec.tokens * k);
            let mut chosen = vec![false; n];
            let mut tok: Vec<u16> = Vec::with_capacity(k);
            let mut w: Vec<f32> = Vec::with_capacity(k);
            for _ in 0..spec.tokens {
                if rng.unit() < spec.drift {
                    let i = rng.below(ws);
                    for _ in 0..64 {
                        let e = draw(&mut rng, l);
                        if !in_set[e as usize] {
                            in_set[set[i] as usize] = false;
                            in_set[e as usize] = true;
                            set[i] = e;
                            break;
                        }
                    }
                }
                tok.clear();
                while tok.len() < k {
                    let mut e = if rng.unit() < spec.locality {
                        set[rng.below(ws)]
                    } else {
                        draw(&mut rng, l)
                    };
                    if chosen[e as usize] {
                        // Fall back to a uniform pick among the unchosen.
                        e = rng.below(n) as u16;
                        if chosen[e as usize] {
                            continue;
                        }
                    }
                    chosen[e as usize] = true;
                    tok.push(e);
                }
                w.clear();
                w.extend((0..k).map(|_| (rng.unit() as f32).max(1e-3)));
                w.sort_by(|a, b| b.total_cmp(a));
                let sum: f32 = w.iter().sum();
                for (&e, &x) in tok.iter().zip(&w) {
                    chosen[e as usize] = false;
                    experts.push(e);
                    weights.push(x / sum);
                }
            }
            layers.push(LayerRoutes {
                layer: l,
                top_k: k,
                n_experts: n,
                hash: false,
                experts,
                weights,
            });
        }
        sessions.push(Session {
            id: format!("synthetic-{si:03}"),
            layers,
            ..Session::default()
        });
    }
    RouteTrace {
        sessions,
        ..RouteTrace::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_run_reads_back_and_a_full_directory_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("run");
        let s = SynthSpec {
            layers: 2,
            n_experts: 8,
            top_k: 2,
            tokens: 20,
            sessions: 2,
            ..SynthSpec::default()
        };
        let t = write_run(&dir, &s).unwrap();
        let back = keep_artifacts::routes::read_run(&dir).unwrap();
        assert_eq!(back.sessions.len(), 2);
        for (a, b) in back.sessions.iter().zip(&t.sessions) {
            for (x, y) in a.layers.iter().zip(&b.layers) {
                assert_eq!((x.layer, &x.experts), (y.layer, &y.experts));
            }
        }
        let e = write_run(&dir, &s).unwrap_err().to_string();
        assert!(e.contains("not empty"), "{e}");
    }

    #[test]
    fn deterministic_distinct_and_in_range() {
        let s = SynthSpec {
            layers: 2,
            n_experts: 16,
            top_k: 4,
            tokens: 100,
            sessions: 2,
            seed: 3,
            working_set: 6,
            ..SynthSpec::default()
        };
        let a = synthetic(&s);
        assert_eq!(a, synthetic(&s));
        for sess in &a.sessions {
            for l in &sess.layers {
                assert_eq!(l.experts.len(), 400);
                for t in l.experts.chunks(4) {
                    let mut v = t.to_vec();
                    v.sort();
                    v.dedup();
                    assert_eq!(v.len(), 4);
                    assert!(t.iter().all(|&e| e < 16));
                }
                for w in l.weights.chunks(4) {
                    assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-4);
                    assert!(w.windows(2).all(|p| p[0] >= p[1]));
                }
            }
        }
    }

    #[test]
    fn parse_spec() {
        let s = SynthSpec::parse("layers=3, experts=64,top_k=2").unwrap();
        assert_eq!((s.layers, s.n_experts, s.top_k), (3, 64, 2));
        assert_eq!(s.tokens, SynthSpec::default().tokens);
        assert!(SynthSpec::parse("top_k=9,experts=8").is_err());
        assert!(SynthSpec::parse("bogus=1").is_err());
        assert!(SynthSpec::parse("layers").is_err());
        assert!(SynthSpec::parse("tokens=10000000000").is_err());
    }
}
