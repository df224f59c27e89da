//! Linear layers as the model calls them, and top-k selection: `y = x · Wᵀ` with the observer
//! told the input (calibration's imatrix and REAP read it there), and the deterministic
//! top-k order the routers and the V4 indexer share, each product also into a caller's buffer
//! (`_into`: the forward's scratch). A leaf: it knows the kernels and the observer, nothing of
//! layers.

use keep_kernels::matmul::matmul_many_with;
use keep_kernels::simd::{Job, Src};
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

/// Projections of one input in one parallel pass (Qwen3's q, k and v; V4's `wq_a` and `wkv`;
/// a shared expert's gate and up), each into its buffer as [`proj_into`] writes it, bit for bit
/// (`matmul_many_with` computes every job as `matmul_with` computes it alone): the input is
/// prepared once for the kernels and the products' rows are cut into tasks together, so that a
/// small one (below the threading threshold alone) no longer runs on one thread while the
/// others wait.
pub(crate) fn projs_into<const N: usize>(
    kernels: Kernels,
    x: &[f32],
    m: usize,
    ws: [(&WeightView, &'static str, &mut Vec<f32>); N],
    obs: &mut Option<&mut dyn RouteObserver>,
    layer: usize,
) -> Result<()> {
    for (w, name, _) in &ws {
        if m.checked_mul(w.cols) != Some(x.len()) || m.checked_mul(w.rows).is_none() {
            return Err(keep_kernels::KernelError::Operand {
                what: "x",
                expected: m.saturating_mul(w.cols),
                got: x.len(),
            }
            .into());
        }
        note_input(obs, layer, name, None, x, m, w.cols);
        profile::read(w.nbytes());
    }
    let mut jobs = ws.map(|(w, _, y)| Job {
        w: Src::view(w),
        rows: w.rows,
        cols: w.cols,
        x,
        m,
        out: zeroed(y, m * w.rows),
    });
    matmul_many_with(kernels, &mut jobs)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of a small deterministic generator.
    fn bytes(n: usize, seed: u64, f: impl Fn(u64) -> u8) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                f(s)
            })
            .collect()
    }

    fn bf16s(n: usize, seed: u64) -> Vec<u8> {
        let v = bytes(n, seed, |s| (s >> 40) as u8);
        v.chunks(1)
            .flat_map(|b| {
                let x = (b[0] as f32 - 128.0) / 256.0;
                ((x.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    /// Qwen3's q, k and v in one pass ([`projs_into`]) write what three [`proj_into`] calls
    /// write, bit for bit, on both kernel choices, in bf16, MXFP8, MXFP4 and MLX affine 4-bit,
    /// for one and several rows; the bf16 case is large enough for q to be threaded.
    #[test]
    fn proj3_equals_three_projections() {
        let cols = 1024;
        let shapes = [2048, 256, 256];
        let x: Vec<f32> = bytes(7 * cols, 1, |s| (s >> 33) as u8)
            .iter()
            .map(|&b| (b as f32 - 127.5) / 64.0)
            .collect();
        type Parts = Vec<Vec<u8>>;
        type Make = fn(usize, usize, u64) -> Parts;
        let formats: [(&str, Make); 4] = [
            ("bf16", |r, c, s| vec![bf16s(r * c, s)]),
            ("mxfp8", |r, c, s| {
                vec![
                    bytes(r * c, s, |v| ((v >> 29) as u8) & 0x7e),
                    bytes(r * c / 32, s + 7, |v| 120 + ((v >> 50) as u8) % 8),
                ]
            }),
            ("mxfp4", |r, c, s| {
                vec![
                    bytes(r * c / 2, s, |v| (v >> 31) as u8),
                    bytes(r * c / 32, s + 7, |v| 120 + ((v >> 50) as u8) % 8),
                ]
            }),
            ("mlx4", |r, c, s| {
                vec![
                    bytes(r * c / 2, s, |v| (v >> 31) as u8),
                    bf16s(r * c / 64, s + 7),
                    bf16s(r * c / 64, s + 9),
                ]
            }),
        ];
        for (name, make) in formats {
            let parts: Vec<Parts> = shapes
                .iter()
                .enumerate()
                .map(|(i, &r)| make(r, cols, 10 + i as u64))
                .collect();
            let views: Vec<WeightView> = parts
                .iter()
                .zip(shapes)
                .map(|(p, r)| match name {
                    "bf16" => WeightView::bf16(&p[0], r, cols),
                    "mxfp8" => WeightView::mxfp8(&p[0], &p[1], r, cols),
                    "mxfp4" => WeightView::mxfp4(&p[0], &p[1], r, cols),
                    _ => WeightView::mlx_affine(4, &p[0], &p[1], &p[2], r, cols),
                })
                .collect::<std::result::Result<_, _>>()
                .unwrap();
            for kernels in [Kernels::Fast, Kernels::Exact] {
                for m in [1, 3, 7] {
                    let x = &x[..m * cols];
                    let mut one: [Vec<f32>; 3] = Default::default();
                    for (w, y) in views.iter().zip(one.iter_mut()) {
                        proj_into(kernels, x, m, w, &mut None, 0, "p", None, y).unwrap();
                    }
                    let [mut a, mut b, mut c] = <[Vec<f32>; 3]>::default();
                    projs_into(
                        kernels,
                        x,
                        m,
                        [
                            (&views[0], "q", &mut a),
                            (&views[1], "k", &mut b),
                            (&views[2], "v", &mut c),
                        ],
                        &mut None,
                        0,
                    )
                    .unwrap();
                    for (got, want) in [a, b, c].iter().zip(&one) {
                        let (g, w): (Vec<u32>, Vec<u32>) = (
                            got.iter().map(|v| v.to_bits()).collect(),
                            want.iter().map(|v| v.to_bits()).collect(),
                        );
                        assert_eq!(g, w, "{name}, {kernels:?}, m = {m}");
                    }
                }
            }
        }
    }
}
