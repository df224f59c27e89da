//! Reading one weight from the checkpoint as a [`WeightView`] in its shipped format. The format
//! is keep-checkpoint's [`layout`] classification (weight dtype + scale dtype + scale shape →
//! plain f32/bf16, FP8 blocks of any side with E8M0 or f32 scales, MXFP8, MXFP4), the same one
//! `keep inspect`, `keep repack` and the runtime's budget use; this module only maps a layout to
//! the kernels' view. Scales are looked up as `<base>.scale` and then `<base>.weight_scale_inv`.

use keep_checkpoint::layout::{self, Layout, ScaleDtype};
use keep_checkpoint::{Checkpoint, Dtype, TensorRef};
use keep_kernels::{BlockScales, WeightView};

use crate::{ModelError, Result};

fn shape_err(name: &str, expected: &[usize], got: &[u64]) -> ModelError {
    ModelError::Shape {
        name: name.into(),
        expected: expected.iter().map(|&v| v as u64).collect(),
        got: got.to_vec(),
    }
}

fn fmt_err(name: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Format {
        name: name.into(),
        msg: msg.into(),
    }
}

/// A tensor by name, or [`ModelError::Missing`].
pub fn tensor<'a>(ck: &'a Checkpoint, name: &str) -> Result<TensorRef<'a>> {
    ck.get(name).ok_or_else(|| ModelError::Missing(name.into()))
}

/// The weight `<base>.weight` as an `[rows, cols]` view (with its scale when it has one).
pub fn weight<'a>(
    ck: &'a Checkpoint,
    base: &str,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightView<'a>> {
    let wname = format!("{base}.weight");
    // `<base>.weight`, or a registered format's main part (`<base>.weight_packed`).
    let w = layout::registered::main_tensor(ck, &wname)
        .ok_or_else(|| ModelError::Missing(wname.clone()))?;
    let wname = w.name;
    if let Some(v) = registered_view(ck, w, layout::scale_of(ck, wname), rows, cols) {
        return v;
    }
    if let Some(b) = layout::biases_of(ck, wname) {
        return view_mlx_affine(w, layout::scale_of(ck, wname), b, rows, cols);
    }
    view_with_residual(
        w,
        layout::scale_of(ck, wname),
        layout::residual_of(ck, wname),
        rows,
        cols,
        block_hint,
    )
}

/// A weight in a registered format (`w` its main part), every part the kernels read gathered
/// from `ck` by the entry (a per-tensor global scale included); `None` when `w` is not one.
pub fn registered_view<'a>(
    ck: &'a Checkpoint,
    w: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    rows: usize,
    cols: usize,
) -> Option<Result<WeightView<'a>>> {
    let m = layout::ExpertMatrix {
        weight: w,
        scale,
        biases: None,
        further: layout::registered::further_parts(ck, &w),
    };
    registered_matrix_view(&m, rows, cols)
}

/// A matrix in a registered format (its weight the entry's main part) from the parts it
/// carries: the weight, its scale partner and the further parts the kernels read (a per-tensor
/// global scale), however many the entry has; `None` when the weight is in no registered
/// format.
pub fn registered_matrix_view<'a>(
    m: &layout::ExpertMatrix<'a>,
    rows: usize,
    cols: usize,
) -> Option<Result<WeightView<'a>>> {
    layout::registered::spec_of(&m.weight)?;
    let name = m.weight.name;
    let view = || -> Result<WeightView<'a>> {
        let l = layout::classify_as(m.weight, m.scale, rows, cols, None)
            .map_err(|e| fmt_err(name, e))?;
        let parts = layout::registered::computed_parts_with(&l, &m.further)
            .map_err(|e| fmt_err(name, e))?;
        let f = l
            .layout
            .spec()
            .ok_or_else(|| fmt_err(name, "no registry entry"))?;
        WeightView::registered(f, &parts, rows, cols).map_err(|e| fmt_err(name, e.to_string()))
    };
    Some(view())
}

/// [`view`], with the residual stage of an E8P weight (`<base>.resid.weight` and its scale,
/// keep-checkpoint's [`layout::residual_of`]) attached when there is one.
pub fn view_with_residual<'a>(
    w: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    resid: Option<(TensorRef<'a>, Option<TensorRef<'a>>)>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightView<'a>> {
    let v = view(w, scale, rows, cols, block_hint)?;
    with_residual_stage(v, resid, rows, cols)
}

/// `v` with the residual stage of an E8P weight attached when `resid` has one.
fn with_residual_stage<'a>(
    v: WeightView<'a>,
    resid: Option<(TensorRef<'a>, Option<TensorRef<'a>>)>,
    rows: usize,
    cols: usize,
) -> Result<WeightView<'a>> {
    let Some((rw, rs)) = resid else {
        return Ok(v);
    };
    let rl = layout::classify_residual(rw, rs, rows, cols).map_err(|e| fmt_err(rw.name, e))?;
    v.with_residual(keep_kernels::E8pResidual {
        codes: rw.bytes,
        scales: rl.scale.map_or(&[][..], |s| s.bytes),
        e81: rl.layout == Layout::E81,
    })
    .map_err(|e| fmt_err(rw.name, e.to_string()))
}

/// The view of one routed expert's matrix wherever the checkpoint keeps it (its own tensors or
/// a slice of mlx-lm's stacked `switch_mlp`; keep-checkpoint's [`layout::expert_matrix`]), with
/// the residual stage of an E8P weight when `resid` has one. A registered format's matrix is
/// read from the parts it carries ([`registered_matrix_view`]), so the expert store's slot,
/// which holds exactly those parts, gives the same view as the mapped checkpoint.
pub fn expert_view<'a>(
    m: &layout::ExpertMatrix<'a>,
    resid: Option<(TensorRef<'a>, Option<TensorRef<'a>>)>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightView<'a>> {
    if let Some(b) = m.biases {
        return view_mlx_affine(m.weight, m.scale, b, rows, cols);
    }
    match registered_matrix_view(m, rows, cols) {
        Some(v) => with_residual_stage(v?, resid, rows, cols),
        None => view_with_residual(m.weight, m.scale, resid, rows, cols, block_hint),
    }
}

/// The view of an MLX affine weight (`U32` packed codes, `.scales`, `.biases`) as `[rows, cols]`.
pub fn view_mlx_affine<'a>(
    w: TensorRef<'a>,
    scales: Option<TensorRef<'a>>,
    biases: TensorRef<'a>,
    rows: usize,
    cols: usize,
) -> Result<WeightView<'a>> {
    let name = w.name;
    let l = layout::classify_as(w, scales, rows, cols, None).map_err(|e| fmt_err(name, e))?;
    let Layout::MlxAffine { bits } = l.layout else {
        return Err(fmt_err(
            biases.name,
            format!(
                "biases belong to MLX affine weights, this one is {}",
                l.layout.label()
            ),
        ));
    };
    layout::check_biases(l.scale, Some(biases)).map_err(|e| fmt_err(name, e))?;
    let sb = l.scale.map_or(&[][..], |s| s.bytes);
    WeightView::mlx_affine(bits, w.bytes, sb, biases.bytes, rows, cols)
        .map_err(|e| fmt_err(name, e.to_string()))
}

/// The view of a weight tensor and its optional scale tensor, as `[rows, cols]`: the layout is
/// keep-checkpoint's one classification ([`layout::classify_as`]), so the loader accepts
/// exactly what `keep inspect` accepts.
pub fn view<'a>(
    w: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightView<'a>> {
    let name = w.name;
    let l = layout::classify_as(w, scale, rows, cols, block_hint).map_err(|e| fmt_err(name, e))?;
    let kerr = |e: keep_kernels::KernelError| fmt_err(name, e.to_string());
    let sbytes = || l.scale.map_or(&[][..], |s| s.bytes);
    match l.layout {
        Layout::Plain(Dtype::F32) => WeightView::f32(w.bytes, rows, cols),
        Layout::Plain(Dtype::BF16) => WeightView::bf16(w.bytes, rows, cols),
        Layout::Plain(d) => {
            return Err(fmt_err(name, format!("dtype {d} is not computable")));
        }
        l @ Layout::Fp8Block { .. } if l.is_mxfp8() => {
            WeightView::mxfp8(w.bytes, sbytes(), rows, cols)
        }
        Layout::Fp8Block { block, scale } => {
            let scales = match scale {
                ScaleDtype::E8m0 => BlockScales::E8m0(sbytes()),
                ScaleDtype::F32 => BlockScales::F32(sbytes()),
                ScaleDtype::Bf16 => BlockScales::Bf16(sbytes()),
            };
            WeightView::fp8_block(w.bytes, scales, rows, cols, block.0, block.1)
        }
        Layout::Mxfp4 => WeightView::mxfp4(w.bytes, sbytes(), rows, cols),
        Layout::E8p => WeightView::e8p(w.bytes, sbytes(), rows, cols),
        Layout::E81 => {
            return Err(fmt_err(
                name,
                "E81B codes are a residual stage, not a weight",
            ));
        }
        Layout::MlxAffine { .. } => {
            return Err(fmt_err(
                name,
                "an MLX affine weight is read with its `.biases` (weights::weight)",
            ));
        }
        Layout::Registered(format) => {
            let Some(f) = l.layout.spec() else {
                return Err(fmt_err(name, format!("no registered format `{format}`")));
            };
            // The computed parts: the main tensor and (when the entry has one) its partner; a
            // format with more is read with the parts an expert matrix carries
            // (`registered_matrix_view`) or with its checkpoint (`weight`).
            if f.computed().count() > 2 {
                return Err(fmt_err(
                    name,
                    format!(
                        "a {format} weight has {} parts the kernels read; this path carries \
                         two (the weight and its scale)",
                        f.computed().count()
                    ),
                ));
            }
            let parts = [w.bytes, sbytes()];
            WeightView::registered(f, &parts[..f.computed().count()], rows, cols)
        }
    }
    .map_err(kerr)
}

/// A 1-D (or any-shape with `len` elements) f32/bf16 tensor decoded to f32.
pub fn vec_f32(ck: &Checkpoint, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = tensor(ck, name)?;
    if t.numel() != len as u64 {
        return Err(shape_err(name, &[len], t.shape));
    }
    match t.dtype {
        Dtype::F32 => Ok((0..len)
            .map(|i| keep_kernels::codec::f32_at(t.bytes, i))
            .collect()),
        Dtype::BF16 => Ok((0..len)
            .map(|i| keep_kernels::codec::bf16_at(t.bytes, i))
            .collect()),
        d => Err(fmt_err(name, format!("dtype {d}, expected F32 or BF16"))),
    }
}
