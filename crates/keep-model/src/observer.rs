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
    /// Unbiased scores of all the layer's experts `[tokens × experts_in_layer]`.
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

/// One layer's new window KV rows around their FP8 round trip (V4.1 attention: after the KV
/// norm and RoPE, each row is rounded to E4M3 with a power-of-two scale per block of 32).
#[derive(Debug)]
pub struct KvFp8Event<'a> {
    pub layer: usize,
    /// Absolute position of row 0 (rows are consecutive positions).
    pub start_pos: usize,
    pub rows: usize,
    /// Elements per row (the head dimension).
    pub cols: usize,
    /// The rows before rounding `[rows × cols]`.
    pub before: &'a [f32],
    /// The rows after rounding `[rows × cols]` (what the cache holds).
    pub after: &'a [f32],
}

/// The rung each routed slot of one layer was computed at (delivered only when the expert
/// source has tiers, before the layer's experts run).
#[derive(Debug)]
pub struct RungEvent<'a> {
    pub layer: usize,
    pub tokens: usize,
    pub top_k: usize,
    /// Chosen experts `[tokens × top_k]`, in the router's order.
    pub experts: &'a [u32],
    /// Whether each slot `[tokens × top_k]` was computed at the upper rung.
    pub upper: &'a [bool],
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
    /// Whether to deliver [`KvFp8Event`]s.
    fn wants_kv_fp8(&self) -> bool {
        false
    }
    fn on_route(&mut self, _ev: &RouteEvent) {}
    fn on_candidate_output(&mut self, _ev: &CandidateOutputEvent) {}
    fn on_expert_output(&mut self, _ev: &ExpertOutputEvent) {}
    fn on_linear_input(&mut self, _ev: &LinearInputEvent) {}
    fn on_kv_fp8(&mut self, _ev: &KvFp8Event) {}
    fn on_rungs(&mut self, _ev: &RungEvent) {}
}

/// An observer that records routes (experts per token per layer) — used by tests and `keep`
/// tools that compare routing.
#[derive(Debug, Default, Clone)]
pub struct RouteRecorder {
    /// `(layer, start_pos, experts [tokens × top_k])` per call.
    pub calls: Vec<(usize, usize, Vec<u32>)>,
    /// The gate weights of each call's experts (`[tokens × top_k]`, same order as `calls`).
    pub weights: Vec<Vec<f32>>,
}

impl RouteObserver for RouteRecorder {
    fn on_route(&mut self, ev: &RouteEvent) {
        self.calls
            .push((ev.layer, ev.start_pos, ev.experts.to_vec()));
        self.weights.push(ev.weights.to_vec());
    }
}

/// The FP8 codes of one [`KvFp8Event`]: per element the E4M3 code byte, per block of 32 the
/// scale's power of two (value = `e4m3(code) · 2^scale_exp`).
#[derive(Debug, Clone, PartialEq)]
pub struct KvFp8Codes {
    pub layer: usize,
    pub start_pos: usize,
    pub rows: usize,
    pub cols: usize,
    /// `[rows × cols]`.
    pub codes: Vec<u8>,
    /// `[rows × cols / 32]`.
    pub scale_exp: Vec<i32>,
}

/// Block of the KV FP8 round trip (mlx-lm's `_fake_quant_fp8(kv, 32)`).
pub const KV_FP8_BLOCK: usize = 32;

impl KvFp8Codes {
    /// The codes of an event: each block's scale as the round trip computed it from the
    /// unrounded values, each code the E4M3 byte of `after / scale` (exact: `after` is on the
    /// scaled E4M3 grid).
    pub fn of(ev: &KvFp8Event) -> KvFp8Codes {
        let mut codes = Vec::with_capacity(ev.after.len());
        let mut scale_exp = Vec::with_capacity(ev.after.len() / KV_FP8_BLOCK);
        for (b, a) in ev
            .before
            .chunks_exact(KV_FP8_BLOCK)
            .zip(ev.after.chunks_exact(KV_FP8_BLOCK))
        {
            let scale = keep_kernels::ops::fp8_block_scale(b);
            scale_exp.push(scale.log2() as i32);
            codes.extend(
                a.iter()
                    .map(|v| keep_kernels::codec::f32_to_e4m3(v / scale)),
            );
        }
        KvFp8Codes {
            layer: ev.layer,
            start_pos: ev.start_pos,
            rows: ev.rows,
            cols: ev.cols,
            codes,
            scale_exp,
        }
    }
}

/// An observer that records the FP8 codes of every window KV row (`keep logits --fp8-kv`,
/// which the conformance suite compares with the reference's own codes).
#[derive(Debug, Default, Clone)]
pub struct KvFp8Recorder {
    pub calls: Vec<KvFp8Codes>,
}

impl RouteObserver for KvFp8Recorder {
    fn wants_kv_fp8(&self) -> bool {
        true
    }
    fn on_kv_fp8(&mut self, ev: &KvFp8Event) {
        self.calls.push(KvFp8Codes::of(ev));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_codes_decode_to_the_rounded_rows() {
        // Two rows of 64: magnitudes spanning several binades, one block all tiny (scale from
        // the 1e-4 floor).
        let before: Vec<f32> = (0..128)
            .map(|i| {
                if (64..96).contains(&i) {
                    1e-7 * i as f32
                } else {
                    ((i as f32) * 0.37).sin() * 3.0f32.powi(i % 5)
                }
            })
            .collect();
        let mut after = before.clone();
        for row in after.chunks_exact_mut(64) {
            keep_kernels::ops::fake_quant_fp8(row, 32);
        }
        let c = KvFp8Codes::of(&KvFp8Event {
            layer: 3,
            start_pos: 7,
            rows: 2,
            cols: 64,
            before: &before,
            after: &after,
        });
        assert_eq!((c.codes.len(), c.scale_exp.len()), (128, 4));
        for (i, (&code, &a)) in c.codes.iter().zip(&after).enumerate() {
            let v = keep_kernels::codec::E4M3[code as usize] * 2f32.powi(c.scale_exp[i / 32]);
            assert_eq!(v.to_bits(), a.to_bits(), "element {i}");
        }
        // The tiny block's scale comes from the 1e-4 floor: 2^ceil(log2(1e-4 / 448)) = 2^-22.
        assert_eq!(c.scale_exp[2], -22);
    }
}
