//! Route observers: what calibration sees of each MoE layer and linear. The model calls
//! an observer only when one is attached (`Option<&mut dyn RouteObserver>`), and observers only
//! read: the forward is bit-identical with and without them.

/// The router's decision for a batch of tokens of one layer.
#[derive(Debug)]
pub struct RouteEvent<'a> {
    pub layer: usize,
    /// Absolute position of token row 0 (rows are consecutive positions).
    pub start_pos: usize,
    /// Number of token rows.
    pub tokens: usize,
    pub top_k: usize,
    /// Chosen experts `[tokens × top_k]`, in the router's order.
    pub experts: &'a [u32],
    /// Gate weights of the chosen experts `[tokens × top_k]` (after renormalisation and scaling).
    pub weights: &'a [f32],
    /// Unbiased scores of all experts `[tokens × n_experts]`.
    pub scores: &'a [f32],
}

/// The outputs of one routed expert for the tokens routed to it (before the gate weight).
#[derive(Debug)]
pub struct ExpertOutputEvent<'a> {
    pub layer: usize,
    pub expert: usize,
    /// Token rows (within the batch) routed to this expert.
    pub token_rows: &'a [usize],
    /// The slot (0..top_k) of this expert in each token's route.
    pub slots: &'a [usize],
    /// The gate weight of each route.
    pub weights: &'a [f32],
    /// Expert outputs `[token_rows.len() × hidden]`.
    pub outputs: &'a [f32],
}

/// One routed expert's output on every token row of a hash-routed layer, beside the outputs of
/// the experts the tokens were actually routed to: what a pruner needs to measure how close a
/// kept expert's outputs are to a removed one's on the tokens that `tid2eid` sends to it.
/// Delivered (for every expert of the layer, after the routed experts ran) only when
/// [`RouteObserver::wants_candidate_outputs`] says so; it costs one pass of every expert over
/// every token of the layer.
#[derive(Debug)]
pub struct CandidateOutputEvent<'a> {
    pub layer: usize,
    pub top_k: usize,
    /// The expert whose outputs `outputs` are.
    pub expert: usize,
    /// The routed experts `[tokens × top_k]` (the table's ids).
    pub chosen: &'a [u32],
    /// The routed experts' outputs (before the gate weight) `[tokens × top_k × hidden]`.
    pub routed: &'a [f32],
    /// `expert`'s outputs on every token row `[tokens × hidden]`.
    pub outputs: &'a [f32],
}

/// The input rows of one linear (for an importance matrix).
#[derive(Debug)]
pub struct LinearInputEvent<'a> {
    pub layer: usize,
    /// Checkpoint-style name within the layer, e.g. `attn.wq_a`, `ffn.shared_experts.w2`,
    /// `ffn.experts.w1` (with `expert` set).
    pub name: &'static str,
    pub expert: Option<usize>,
    pub rows: usize,
    pub cols: usize,
    /// `[rows × cols]`.
    pub x: &'a [f32],
}

/// A hook the model calls during the forward. Every method has an empty default.
pub trait RouteObserver {
    /// Whether to deliver [`ExpertOutputEvent`]s.
    fn wants_expert_outputs(&self) -> bool {
        false
    }
    /// Whether to deliver [`LinearInputEvent`]s.
    fn wants_linear_inputs(&self) -> bool {
        false
    }
    /// Whether to deliver [`CandidateOutputEvent`]s for hash-routed layer `layer`.
    fn wants_candidate_outputs(&self, _layer: usize) -> bool {
        false
    }
    fn on_route(&mut self, _ev: &RouteEvent) {}
    fn on_candidate_output(&mut self, _ev: &CandidateOutputEvent) {}
    fn on_expert_output(&mut self, _ev: &ExpertOutputEvent) {}
    fn on_linear_input(&mut self, _ev: &LinearInputEvent) {}
}

/// An observer that records routes (experts per token per layer) — used by tests and `keep`
/// tools that compare routing.
#[derive(Debug, Default, Clone)]
pub struct RouteRecorder {
    /// `(layer, start_pos, experts [tokens × top_k])` per call.
    pub calls: Vec<(usize, usize, Vec<u32>)>,
}

impl RouteObserver for RouteRecorder {
    fn on_route(&mut self, ev: &RouteEvent) {
        self.calls
            .push((ev.layer, ev.start_pos, ev.experts.to_vec()));
    }
}
