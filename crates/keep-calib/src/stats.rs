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

use std::collections::BTreeMap;

use keep_model::{
    CandidateOutputEvent, ExpertOutputEvent, LinearInputEvent, RouteEvent, RouteObserver,
};

/// Σ x² per column for one linear (one row of sums per group), with row counts.
#[derive(Debug, Clone, PartialEq)]
pub struct ImEntry {
    pub cols: usize,
    /// `[groups][cols]`.
    pub sums: Vec<Vec<f64>>,
    /// Rows seen, per group.
    pub counts: Vec<u64>,
}

impl ImEntry {
    pub fn new(cols: usize) -> ImEntry {
        ImEntry {
            cols,
            sums: vec![],
            counts: vec![],
        }
    }
    fn group(&mut self, g: usize) -> (&mut Vec<f64>, &mut u64) {
        while self.sums.len() <= g {
            self.sums.push(vec![0.0; self.cols]);
            self.counts.push(0);
        }
        (&mut self.sums[g], &mut self.counts[g])
    }
    /// Add `rows` rows of `x` (`[rows × cols]`) to group `g`.
    pub fn add_rows(&mut self, g: usize, x: &[f32], rows: usize) {
        let cols = self.cols;
        let (s, c) = self.group(g);
        for r in 0..rows {
            for (a, &v) in s.iter_mut().zip(&x[r * cols..(r + 1) * cols]) {
                let v = v as f64;
                *a += v * v;
            }
        }
        *c += rows as u64;
    }
    /// Add another entry's sums and counts (shapes must agree; checked by the caller).
    pub fn add(&mut self, o: &ImEntry) {
        for (g, (s, &c)) in o.sums.iter().zip(&o.counts).enumerate() {
            let (d, dc) = self.group(g);
            for (a, b) in d.iter_mut().zip(s) {
                *a += b;
            }
            *dc += c;
        }
    }
}

/// REAP accumulators of one MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerReap {
    pub n_experts: usize,
    pub hidden: usize,
    pub count: Vec<u64>,
    pub sum_g: Vec<f64>,
    pub sum_norm: Vec<f64>,
    pub sum_g_norm: Vec<f64>,
    /// `[n_experts × hidden]`; meaningful where `count > 0` (written as 0 elsewhere).
    pub max_f: Vec<f32>,
    pub min_f: Vec<f32>,
    /// Hash-routed layers: `[n_experts × n_experts]`, entry `(r, j)` = Σ over the routes to
    /// expert `r` of ‖f_r(x) − f_j(x)‖² (f64); empty when not gathered.
    pub dist: Vec<f64>,
}

impl LayerReap {
    pub fn new(n_experts: usize, hidden: usize) -> LayerReap {
        LayerReap {
            n_experts,
            hidden,
            count: vec![0; n_experts],
            sum_g: vec![0.0; n_experts],
            sum_norm: vec![0.0; n_experts],
            sum_g_norm: vec![0.0; n_experts],
            max_f: vec![f32::NEG_INFINITY; n_experts * hidden],
            min_f: vec![f32::INFINITY; n_experts * hidden],
            dist: vec![],
        }
    }
    /// Add the candidate outputs of expert `j` (`[tokens × hidden]`) against the routed outputs
    /// (`[tokens × top_k × hidden]`, experts `chosen`) to [`LayerReap::dist`].
    pub fn add_candidate(
        &mut self,
        j: usize,
        top_k: usize,
        chosen: &[u32],
        routed: &[f32],
        outputs: &[f32],
    ) {
        let (d, e) = (self.hidden, self.n_experts);
        let t = outputs.len() / d.max(1);
        if j >= e || chosen.len() != t * top_k || routed.len() != t * top_k * d {
            return;
        }
        if self.dist.is_empty() {
            self.dist = vec![0.0; e * e];
        }
        for i in 0..t {
            let y = &outputs[i * d..(i + 1) * d];
            for s in 0..top_k {
                let r = chosen[i * top_k + s] as usize;
                if r >= e {
                    continue;
                }
                let f = &routed[(i * top_k + s) * d..(i * top_k + s + 1) * d];
                let sq: f64 = f
                    .iter()
                    .zip(y)
                    .map(|(&a, &b)| {
                        let v = a as f64 - b as f64;
                        v * v
                    })
                    .sum();
                self.dist[r * e + j] += sq;
            }
        }
    }
    /// Mean squared distance from removed expert `r` to every expert (`None` when `r` was
    /// never routed or no distances were gathered).
    pub fn mean_dist(&self, r: usize) -> Option<Vec<f64>> {
        let e = self.n_experts;
        if self.dist.len() != e * e || r >= e || self.count[r] == 0 {
            return None;
        }
        let c = self.count[r] as f64;
        Some(
            self.dist[r * e..(r + 1) * e]
                .iter()
                .map(|&v| v / c)
                .collect(),
        )
    }
    /// ‖f‖₂ of one output row, accumulated in f64.
    pub fn norm(row: &[f32]) -> f64 {
        row.iter()
            .map(|&v| (v as f64) * (v as f64))
            .sum::<f64>()
            .sqrt()
    }
    /// Add one expert's outputs for its routed rows.
    pub fn add_outputs(&mut self, e: usize, weights: &[f32], outputs: &[f32]) {
        let d = self.hidden;
        for (r, &g) in weights.iter().enumerate() {
            let row = &outputs[r * d..(r + 1) * d];
            let n = Self::norm(row);
            let g = g as f64;
            self.sum_g_norm[e] += g * n;
            self.sum_g[e] += g;
            self.sum_norm[e] += n;
            self.count[e] += 1;
            let mx = &mut self.max_f[e * d..(e + 1) * d];
            for (m, &v) in mx.iter_mut().zip(row) {
                if v > *m {
                    *m = v;
                }
            }
            let mn = &mut self.min_f[e * d..(e + 1) * d];
            for (m, &v) in mn.iter_mut().zip(row) {
                if v < *m {
                    *m = v;
                }
            }
        }
    }
    /// Add another layer's sums (max/min only where the other saw the expert).
    pub fn add(&mut self, o: &LayerReap) {
        let d = self.hidden;
        if !o.dist.is_empty() {
            if self.dist.is_empty() {
                self.dist = vec![0.0; o.dist.len()];
            }
            for (a, b) in self.dist.iter_mut().zip(&o.dist) {
                *a += b;
            }
        }
        for e in 0..self.n_experts {
            self.sum_g_norm[e] += o.sum_g_norm[e];
            self.sum_g[e] += o.sum_g[e];
            self.sum_norm[e] += o.sum_norm[e];
            if o.count[e] > 0 {
                for c in e * d..(e + 1) * d {
                    self.max_f[c] = self.max_f[c].max(o.max_f[c]);
                    self.min_f[c] = self.min_f[c].min(o.min_f[c]);
                }
            }
            self.count[e] += o.count[e];
        }
    }
    /// REAP saliency Σ g·‖f‖ / count (0 for never-routed experts).
    pub fn score(&self) -> Vec<f64> {
        (0..self.n_experts)
            .map(|e| {
                if self.count[e] == 0 {
                    0.0
                } else {
                    self.sum_g_norm[e] / self.count[e] as f64
                }
            })
            .collect()
    }
    /// max |f| per expert over channels (0 for never-routed experts).
    pub fn max_abs(&self) -> Vec<f64> {
        let d = self.hidden;
        (0..self.n_experts)
            .map(|e| {
                if self.count[e] == 0 {
                    return 0.0;
                }
                let mx = self.max_f[e * d..(e + 1) * d]
                    .iter()
                    .fold(0f32, |a, &b| a.max(b.abs()));
                let mn = self.min_f[e * d..(e + 1) * d]
                    .iter()
                    .fold(0f32, |a, &b| a.max(b.abs()));
                mx.max(mn) as f64
            })
            .collect()
    }
    /// max_f / min_f with never-routed experts' rows set to 0 (for writing).
    pub fn extremes_for_write(&self) -> (Vec<f32>, Vec<f32>) {
        let d = self.hidden;
        let mut mx = self.max_f.clone();
        let mut mn = self.min_f.clone();
        for e in 0..self.n_experts {
            if self.count[e] == 0 {
                mx[e * d..(e + 1) * d].fill(0.0);
                mn[e * d..(e + 1) * d].fill(0.0);
            }
        }
        (mx, mn)
    }
}

/// The first tokens of one layer's routing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerRoutes {
    pub experts: Vec<i16>,
    pub weights: Vec<half::f16>,
    pub tokens: usize,
}

/// Teacher outputs for one record.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherRecord {
    pub tokens: usize,
    pub k: usize,
    /// `[tokens × k]`, most likely first (ties by lower id).
    pub topk_ids: Vec<i32>,
    /// `[tokens × k]` natural-log probabilities.
    pub topk_logprobs: Vec<f32>,
    /// `[tokens - 1]`: log-prob of the true next token at each position.
    pub next_logprob: Vec<f32>,
}

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

/// Everything one session gathers.
#[derive(Debug, Clone)]
pub struct SessionStats {
    pub n_layers: usize,
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    /// `(layer, key)` → entry; keys as in the crate doc (`attn.wq_a`, `ffn.experts.3.w1`, …).
    pub imatrix: BTreeMap<(usize, String), ImEntry>,
    pub reap: Vec<LayerReap>,
    pub routes: Vec<LayerRoutes>,
    pub teacher: Vec<TeacherRecord>,
    /// Record ids in order.
    pub records: Vec<String>,
    pub tokens: u64,
}

impl SessionStats {
    pub fn new(n_layers: usize, n_experts: usize, top_k: usize, hidden: usize) -> SessionStats {
        SessionStats {
            n_layers,
            n_experts,
            top_k,
            hidden,
            imatrix: BTreeMap::new(),
            reap: (0..n_layers)
                .map(|_| LayerReap::new(n_experts, hidden))
                .collect(),
            routes: vec![LayerRoutes::default(); n_layers],
            teacher: vec![],
            records: vec![],
            tokens: 0,
        }
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
