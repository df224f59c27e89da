//! Linear layers as the model calls them, and top-k selection: `y = x · Wᵀ` with the observer
//! told the input (calibration's imatrix and REAP read it there), and the deterministic
//! top-k order the routers and the V4 indexer share, each product also into a caller's buffer
//! (`_into`: the forward's scratch). A leaf: it knows the kernels and the observer, nothing of
//! layers.

use keep_kernels::{matmul_with, profile, Kernels, WeightView};

use crate::observer::{LinearInputEvent, RouteObserver};
use crate::scratch::zeroed;
use crate::Result;

/// `y = x · Wᵀ` for `m` rows into `y` (resized to `m × rows`; no allocation once it has held
/// that many) on the chosen kernels, reporting the input to an observer that wants linear
/// inputs: the dense projections (attention, shared expert, Qwen3's attention and dense MLP)
/// take [`Kernels::Fast`] where the format has a fast kernel (FP8-block and MXFP8 on the bf16
/// kernels, MXFP4 / affine on the integer ones), so under `--kernels fast` they run as the
/// routed experts do.
#[allow(clippy::too_many_arguments)]
pub(crate) fn proj_into(
    kernels: Kernels,
    x: &[f32],
    m: usize,
    w: &WeightView,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    name: &'static str,
    expert: Option<usize>,
    y: &mut Vec<f32>,
) -> Result<()> {
    note_input(obs, layer, name, expert, x, m, w.cols);
    profile::read(w.nbytes());
    matmul_with(kernels, x, m, w, zeroed(y, m * w.rows))?;
    Ok(())
}

/// [`proj_into`] on the exact kernels: the router gates, the compressor, the indexer (products
/// whose results pick experts or rows, kept exact under either [`Kernels`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn lin_into(
    x: &[f32],
    m: usize,
    w: &WeightView,
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    name: &'static str,
    expert: Option<usize>,
    y: &mut Vec<f32>,
) -> Result<()> {
    proj_into(Kernels::Exact, x, m, w, obs, layer, name, expert, y)
}

/// Tell the observer (if it wants them) the input of a linear layer.
pub(crate) fn note_input(
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
    name: &'static str,
    expert: Option<usize>,
    x: &[f32],
    rows: usize,
    cols: usize,
) {
    if let Some(o) = obs.as_deref_mut() {
        if o.wants_linear_inputs() {
            o.on_linear_input(&LinearInputEvent {
                layer,
                name,
                expert,
                rows,
                cols,
                x,
            });
        }
    }
}

/// Put the `k` largest `(score, id)` first, ordered by score descending then id ascending
/// (so ties and -inf picks are deterministic and match the reference).
pub fn top_k_by(v: &mut [(f32, usize)], k: usize) {
    // Equal values (including -0 and +0, which mlx's comparison also treats as equal) go by
    // ascending index: mlx's `argpartition` picks the lowest indices among ties (checked on
    // random tie-heavy inputs). NaN, never expected, sorts last.
    let cmp = |a: &(f32, usize), b: &(f32, usize)| {
        let by_value = match b.0.partial_cmp(&a.0) {
            Some(o) => o,
            None => a.0.is_nan().cmp(&b.0.is_nan()),
        };
        by_value.then(a.1.cmp(&b.1))
    };
    if k == 0 {
        return;
    }
    if k < v.len() {
        v.select_nth_unstable_by(k - 1, cmp);
    }
    let kk = k.min(v.len());
    v[..kk].sort_by(cmp);
}

/// `ops::rms_norm`, its time counted as the profile's [`profile::Part::Norm`].
#[inline]
pub(crate) fn rms_norm(x: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32) {
    let _p = profile::span(profile::Part::Norm);
    keep_kernels::ops::rms_norm(x, d, w, eps)
}
