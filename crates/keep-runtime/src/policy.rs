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

    #[test]
    fn every_policy_is_online() {
        for p in [
            Policy::Lru,
            Policy::Static,
            Policy::Decay { half_life: 4.0 },
        ] {
            assert_eq!(p.make().kind(), p.kind());
        }
    }
}
