//! The slot cache's replacement policy, chosen by name (`--policy lru|decay[:H]|static`): a
//! [`Policy`] names one of keep-residency's online policies, which the cache runs per MoE layer
//! — the same implementations `keep residency` replays, so its prediction is about this run.
//!
//! - [`Policy::Lru`] (default): the least recently used expert gives up its slot.
//! - [`Policy::Decay`]: the lowest use count decayed with a half-life (in forward passes of the
//!   layer — one per decoded token).
//! - [`Policy::Static`]: a fixed ranking; the lowest-ranked expert goes first, so the top of the
//!   ranking stays resident and the rest cycle through the remaining slots. The ranking is the
//!   warm-start ordering when one is given, else the order of first use (earliest first).
//!
//! A warm start orders the experts by per-expert scores (REAP saliency or route frequencies)
//! and fills the slots with the top of that order: LRU counts them as used in that order, the
//! best most recently; static ranks by it.

use std::fmt;
use std::str::FromStr;

use keep_residency::policy::{Decay, Lru, PolicyKind, SlotPolicy, StaticSet};

/// A replacement policy.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Policy {
    #[default]
    Lru,
    Decay {
        half_life: f64,
    },
    Static,
}

/// Default half-life of [`Policy::Decay`], in forward passes (decoded tokens): keep-residency's,
/// so that `keep residency`'s default decay is the one `keep run` runs.
pub use keep_residency::policy::DEFAULT_HALF_LIFE;

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Lru => write!(f, "lru"),
            Policy::Decay { half_life } => write!(f, "decay(half-life {half_life})"),
            Policy::Static => write!(f, "static"),
        }
    }
}

impl FromStr for Policy {
    type Err = String;
    /// `lru`, `static`, `decay` (default half-life) or `decay:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Policy::Lru),
            "static" => Ok(Policy::Static),
            "decay" => Ok(Policy::Decay {
                half_life: DEFAULT_HALF_LIFE,
            }),
            _ => {
                if let Some(h) = s.strip_prefix("decay:") {
                    match h.parse::<f64>() {
                        Ok(v) if v.is_finite() && v > 0.0 => Ok(Policy::Decay { half_life: v }),
                        _ => Err(format!("decay half-life `{h}` must be a positive number")),
                    }
                } else {
                    Err(format!(
                        "unknown policy `{s}`: use lru, decay, decay:HALF_LIFE or static"
                    ))
                }
            }
        }
    }
}

impl Policy {
    /// The policy's kind in keep-residency.
    pub fn kind(self) -> PolicyKind {
        match self {
            Policy::Lru => PolicyKind::Lru,
            Policy::Decay { .. } => PolicyKind::Decay,
            Policy::Static => PolicyKind::Static,
        }
    }

    /// A fresh online state of this policy (one per MoE layer).
    pub fn make(self) -> Box<dyn SlotPolicy> {
        match self {
            Policy::Lru => Box::new(Lru::default()),
            Policy::Decay { half_life } => Box::new(Decay::new(half_life)),
            Policy::Static => Box::new(StaticSet::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        assert_eq!("lru".parse::<Policy>().unwrap(), Policy::Lru);
        assert_eq!("static".parse::<Policy>().unwrap(), Policy::Static);
        assert_eq!(
            "decay:8".parse::<Policy>().unwrap(),
            Policy::Decay { half_life: 8.0 }
        );
        assert!("decay:-1".parse::<Policy>().is_err());
        assert!("lfu"
            .parse::<Policy>()
            .unwrap_err()
            .contains("unknown policy"));
    }

    /// Hits of `p` over `trace` (tokens of 2 experts among 8, 3 slots, no warm start), driven
    /// through keep-residency's replay interface.
    fn hits(p: &mut dyn keep_residency::policy::Policy, trace: &[u16]) -> Vec<bool> {
        use keep_residency::policy::{Start, Stream};
        let order: Vec<u16> = (0..8).collect();
        let stream = Stream {
            experts: trace,
            top_k: 2,
            n_experts: 8,
        };
        p.reset(
            &stream,
            &Start {
                capacity: 3,
                order: &order,
                prefill: false,
            },
        );
        let mut out = vec![];
        for (t, tok) in trace.chunks(2).enumerate() {
            p.begin_token(2 * t, tok);
            for (j, &e) in tok.iter().enumerate() {
                out.push(p.access(2 * t + j, e, true));
            }
        }
        out
    }

    /// A skewed trace: expert 0 in every other token, the rest cycling.
    fn trace() -> Vec<u16> {
        let mut v = vec![];
        for t in 0..240u16 {
            let a = if t % 2 == 0 { 0 } else { 1 + (t * 3) % 7 };
            let b = 1 + (t * 5 + t / 7) % 7;
            v.extend([a, if b == a { 1 + b % 7 } else { b }]);
        }
        v
    }

    #[test]
    fn every_policy_runs_keep_residencys_policy_of_its_kind() {
        let tr = trace();
        let mut seen = vec![];
        for p in [
            Policy::Lru,
            Policy::Static,
            Policy::Decay { half_life: 1.0 },
            Policy::Decay {
                half_life: DEFAULT_HALF_LIFE,
            },
        ] {
            let half_life = match p {
                Policy::Decay { half_life } => half_life,
                _ => DEFAULT_HALF_LIFE,
            };
            let mut ours = p.make();
            assert_eq!(ours.kind(), p.kind());
            let mut theirs = keep_residency::policy::make(p.kind(), half_life);
            let h = hits(&mut *ours, &tr);
            assert_eq!(h, hits(&mut *theirs, &tr), "{p}");
            seen.push((p, h));
        }
        // The trace tells the policies (and the two half-lives) apart, so a policy built as
        // another kind or with another half-life fails the comparison above.
        for (i, (p, a)) in seen.iter().enumerate() {
            for (q, b) in &seen[i + 1..] {
                assert_ne!(a, b, "{p} and {q} hit alike on the trace");
            }
        }
    }
}
