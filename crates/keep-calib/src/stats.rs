//! The statistics of one calibration session and the observer that gathers them.
//!
//! [`Collector`] is a [`RouteObserver`]: it only reads what the forward shows it, so the
//! forward is bit-identical with it attached. It accumulates, per layer:
//!
//! - **imatrix** ([`ImEntry`]): Σ x² per input column (f64) and the row count of every linear;
//!   routed experts per expert (`ffn.experts.{e}.w1` …, counted over the tokens routed to the
//!   expert), the grouped `attn.wo_a` per output group;
//! - **REAP** ([`LayerReap`]): per expert Σ g·‖f‖₂, Σ g, Σ ‖f‖₂, the route count, and per output
//!   channel the max and min of f; g is the model's final gate weight (bias-corrected selection,
//!   scoring function, renormalisation, routed scaling — exactly what the forward multiplies by)
//!   and f the expert's output before gating; sums in f64, in event order;
//! - **routes**: the first `route_tokens` tokens of each layer's routing (ids as i16, weights as
//!   f16), records in order.
//!
//! Teacher log-probs for the eval split are computed from the logits by [`teacher_of`].

use keep_model::{
    CandidateOutputEvent, ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver,
};

pub use keep_artifacts::session::{ImEntry, LayerRoutes, SessionStats, TeacherRecord};

/// REAP accumulators of one MoE layer: keep-artifacts' [`LayerReap`], the sums the session
/// and finalized files hold.
pub use keep_artifacts::reap::LayerReap;

/// Top-`k` log-probs per position and the log-prob of each true next token, from logits
/// `[T × vocab]` (log-softmax in f64).
pub fn teacher_of(logits: &[f32], vocab: usize, tokens: &[u32], k: usize) -> TeacherRecord {
    let t = logits.len().checked_div(vocab).unwrap_or(0);
    let k = k.min(vocab);
    let mut ids = Vec::with_capacity(t * k);
    let mut lps = Vec::with_capacity(t * k);
    let mut next = Vec::with_capacity(t.saturating_sub(1));
    let mut idx: Vec<usize> = Vec::with_capacity(vocab);
    for i in 0..t {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
        let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        idx.clear();
        idx.extend(0..vocab);
        let cmp = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        if k > 0 && k < vocab {
            idx.select_nth_unstable_by(k - 1, cmp);
        }
        idx[..k].sort_by(cmp);
        for &j in &idx[..k] {
            ids.push(j as i32);
            lps.push((row[j] as f64 - lse) as f32);
        }
        if i + 1 < t {
            if let Some(&nt) = tokens.get(i + 1) {
                let v = row.get(nt as usize).copied().unwrap_or(f32::NEG_INFINITY);
                next.push((v as f64 - lse) as f32);
            }
        }
    }
    TeacherRecord {
        tokens: t,
        k,
        topk_ids: ids,
        topk_logprobs: lps,
        next_logprob: next,
    }
}

/// The imatrix key of a linear input event: routed experts get their id inserted
/// (`ffn.experts.w1` → `ffn.experts.{e}.w1`); other indexed linears are grouped.
pub fn imatrix_key(name: &str, expert: Option<usize>) -> (String, usize) {
    match (name.strip_prefix("ffn.experts."), expert) {
        (Some(w), Some(e)) => (format!("ffn.experts.{e}.{w}"), 0),
        (_, Some(g)) => (name.to_string(), g),
        (_, None) => (name.to_string(), 0),
    }
}

/// The calibration observer.
#[derive(Debug)]
pub struct Collector {
    pub stats: SessionStats,
    /// Tokens of routing kept per layer.
    pub route_tokens: usize,
    /// Hash-routed layers whose expert-to-expert output distances are gathered
    /// ([`LayerReap::dist`]; every expert runs on every token of these layers).
    pub distance_layers: Vec<usize>,
}

impl Collector {
    pub fn new(stats: SessionStats, route_tokens: usize) -> Collector {
        Collector {
            stats,
            route_tokens,
            distance_layers: vec![],
        }
    }
}

impl RouteObserver for Collector {
    fn wants_expert_outputs(&self) -> bool {
        true
    }
    fn wants_linear_inputs(&self) -> bool {
        true
    }
    fn wants_candidate_outputs(&self, layer: usize) -> bool {
        self.distance_layers.contains(&layer)
    }
    fn on_candidate_output(&mut self, ev: &CandidateOutputEvent) {
        if let Some(l) = self.stats.reap.get_mut(ev.layer) {
            l.add_candidate(ev.expert, ev.top_k, ev.chosen, ev.routed, ev.outputs);
        }
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        let Some(r) = self.stats.routes.get_mut(ev.layer) else {
            return;
        };
        let room = self.route_tokens.saturating_sub(r.tokens);
        let n = room.min(ev.tokens);
        let k = ev.top_k;
        r.experts
            .extend(ev.experts[..n * k].iter().map(|&e| e as i16));
        r.weights
            .extend(ev.weights[..n * k].iter().map(|&w| half::f16::from_f32(w)));
        r.tokens += n;
    }
    fn on_expert_output(&mut self, ev: &ExpertOutputEvent) {
        if let Some(l) = self.stats.reap.get_mut(ev.layer) {
            if ev.expert < l.n_experts && ev.outputs.len() == ev.weights.len() * l.hidden {
                l.add_outputs(ev.expert, ev.weights, ev.outputs);
            }
        }
    }
    fn on_linear_input(&mut self, ev: &LinearInputEvent) {
        let (key, g) = imatrix_key(ev.name, ev.expert);
        let e = self
            .stats
            .imatrix
            .entry((ev.layer, key))
            .or_insert_with(|| ImEntry::new(ev.cols));
        if e.cols == ev.cols && ev.x.len() >= ev.rows * ev.cols {
            e.add_rows(g, ev.x, ev.rows);
        }
    }
}
