//! Replacement policies of the slot cache, one state per MoE layer: which resident expert gives
//! up its slot when a missing one must be read.
//!
//! - [`Policy::Lru`] (default): the least recently used expert (ties: lower id).
//! - [`Policy::Decay`]: the lowest use count decayed with a half-life (in forward passes of the
//!   layer — one per decoded token): `c ← c · 2^(−Δt/half_life) + 1` at each use.
//! - [`Policy::Static`]: a fixed ranking; the lowest-ranked expert goes first, so the top of the
//!   ranking stays resident and the rest cycle through the remaining slots. The ranking is the
//!   warm-start score when one is given, else the order of first use (earliest first).
//!
//! A warm start ([`PolicyState::warm`]) seeds the policy from per-expert scores (REAP saliency or
//! route frequencies): LRU treats higher-scored experts as more recent, decay starts from the
//! scores normalised to the layer's maximum, static ranks by them.

use std::fmt;
use std::str::FromStr;

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

/// Default half-life of [`Policy::Decay`], in forward passes.
pub const DEFAULT_HALF_LIFE: f64 = 32.0;

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

/// The per-expert bookkeeping of one layer.
#[derive(Debug, Clone)]
pub struct PolicyState {
    policy: Policy,
    last_use: Vec<u64>,
    count: Vec<f64>,
    count_tick: Vec<u64>,
    rank: Vec<f64>,
    ranked: Vec<bool>,
    arrivals: u64,
}

impl PolicyState {
    /// Fresh state for `n_experts` experts.
    pub fn new(policy: Policy, n_experts: usize) -> PolicyState {
        PolicyState {
            policy,
            last_use: vec![0; n_experts],
            count: vec![0.0; n_experts],
            count_tick: vec![0; n_experts],
            rank: vec![0.0; n_experts],
            ranked: vec![false; n_experts],
            arrivals: 0,
        }
    }

    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Seed from warm-start scores (one per expert; missing or non-finite entries count as 0).
    pub fn warm(&mut self, scores: &[f64]) {
        let clean = |i: usize| {
            scores
                .get(i)
                .copied()
                .filter(|v| v.is_finite())
                .unwrap_or(0.0)
        };
        let max = (0..self.rank.len())
            .map(clean)
            .fold(0.0f64, |a, b| a.max(b.abs()));
        for e in 0..self.rank.len() {
            let s = clean(e);
            self.rank[e] = s;
            self.ranked[e] = true;
            self.count[e] = if max > 0.0 { s.max(0.0) / max } else { 0.0 };
        }
    }

    /// The current decayed count of `e` at `tick`.
    fn decayed(&self, e: usize, tick: u64, half_life: f64) -> f64 {
        let dt = tick.saturating_sub(self.count_tick[e]) as f64;
        self.count[e] * (-dt / half_life).exp2()
    }

    /// Record a use of expert `e` at `tick` (ticks never decrease).
    pub fn touch(&mut self, e: usize, tick: u64) {
        if e >= self.last_use.len() {
            return;
        }
        self.last_use[e] = tick;
        if let Policy::Decay { half_life } = self.policy {
            self.count[e] = self.decayed(e, tick, half_life) + 1.0;
            self.count_tick[e] = tick;
        }
        if !self.ranked[e] {
            // Static without a warm start: earlier first use ranks higher.
            self.arrivals += 1;
            self.rank[e] = -(self.arrivals as f64);
            self.ranked[e] = true;
        }
    }

    /// The key that orders victims: the smallest goes first.
    fn key(&self, e: usize, tick: u64) -> (f64, f64, usize) {
        let lru = self.last_use[e] as f64;
        match self.policy {
            // Ties among equally old experts: lower rank (warm score) first.
            Policy::Lru => (lru, self.rank[e], e),
            Policy::Decay { half_life } => (self.decayed(e, tick, half_life), lru, e),
            Policy::Static => (self.rank[e], lru, e),
        }
    }

    /// Among `candidates` (`(slot, expert)` pairs), the slot to give up at `tick`.
    pub fn victim(
        &self,
        candidates: impl IntoIterator<Item = (usize, usize)>,
        tick: u64,
    ) -> Option<usize> {
        let mut best: Option<((f64, f64, usize), usize)> = None;
        for (slot, e) in candidates {
            if e >= self.last_use.len() {
                continue;
            }
            let k = self.key(e, tick);
            let better = match &best {
                None => true,
                Some((bk, _)) => {
                    k.0.total_cmp(&bk.0)
                        .then(k.1.total_cmp(&bk.1))
                        .then(k.2.cmp(&bk.2))
                        .is_lt()
                }
            };
            if better {
                best = Some((k, slot));
            }
        }
        best.map(|b| b.1)
    }

    /// Experts ordered best-first by warm score (for filling slots before a run).
    pub fn warm_order(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.rank.len()).collect();
        v.sort_by(|&a, &b| self.rank[b].total_cmp(&self.rank[a]).then(a.cmp(&b)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(v: &[usize]) -> Vec<(usize, usize)> {
        v.iter().copied().enumerate().collect()
    }

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
    fn lru_evicts_least_recent() {
        let mut p = PolicyState::new(Policy::Lru, 4);
        p.touch(0, 1);
        p.touch(1, 2);
        p.touch(2, 3);
        p.touch(0, 4);
        // Resident 0, 1, 2 in slots 0..3: 1 is the least recent.
        assert_eq!(p.victim(slots(&[0, 1, 2]), 5), Some(1));
        p.touch(1, 5);
        assert_eq!(p.victim(slots(&[0, 1, 2]), 6), Some(2));
        assert_eq!(p.victim(Vec::new(), 6), None);
    }

    #[test]
    fn decay_keeps_frequent_over_recent() {
        let mut p = PolicyState::new(Policy::Decay { half_life: 100.0 }, 3);
        for t in 1..=10 {
            p.touch(0, t);
        }
        p.touch(1, 11);
        // 0 was used 10 times with little decay; 1 once but more recently: 1 goes.
        assert_eq!(p.victim(slots(&[0, 1]), 12), Some(1));
        // With a short half-life, old uses fade: 0 goes after a long pause.
        let mut q = PolicyState::new(Policy::Decay { half_life: 1.0 }, 3);
        for t in 1..=10 {
            q.touch(0, t);
        }
        q.touch(1, 30);
        assert_eq!(q.victim(slots(&[0, 1]), 31), Some(0));
    }

    #[test]
    fn static_keeps_ranked_experts() {
        let mut p = PolicyState::new(Policy::Static, 4);
        p.warm(&[0.1, 5.0, 3.0, f64::NAN]);
        for t in 1..10 {
            p.touch(1, t);
            p.touch(3, t);
        }
        // Recency does not matter: the lowest warm score goes (3 is NaN → 0).
        assert_eq!(p.victim(slots(&[1, 2, 3]), 10), Some(2));
        assert_eq!(p.warm_order(), vec![1, 2, 0, 3]);
        // Without a warm start, the first experts used stay.
        let mut q = PolicyState::new(Policy::Static, 4);
        q.touch(2, 1);
        q.touch(0, 2);
        q.touch(1, 3);
        q.touch(2, 4);
        assert_eq!(q.victim(slots(&[2, 0, 1]), 5), Some(2)); // slot 2 holds expert 1
    }

    #[test]
    fn warm_start_breaks_lru_ties() {
        let mut p = PolicyState::new(Policy::Lru, 3);
        p.warm(&[3.0, 1.0, 2.0]);
        assert_eq!(p.victim(slots(&[0, 1, 2]), 1), Some(1));
    }
}
