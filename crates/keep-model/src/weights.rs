//! Reading one weight from the checkpoint as a [`WeightView`] in its shipped format, decided from
//! the weight's dtype and its scale's dtype and shape, never assumed (the one place that maps
//! tensor bytes to formats):
//!
//! | weight dtype | scale | format |
//! |---|---|---|
//! | F32 / BF16 `[out,in]` | none | f32 / bf16 |
//! | F8_E4M3 `[out,in]` | E8M0/U8 `[out, in/32]` | MXFP8 (`keep repack --resident-format mxfp8`) |
//! | F8_E4M3 `[out,in]` | E8M0/U8 or F32 `[ceil(out/B), ceil(in/B)]` | FP8 B×B block (B from `quantization_config`, else 32/64/128 by shape) |
//! | I8/U8 `[out, in/2]` | E8M0/U8 `[out, in/32]` | MXFP4 (DeepSeek FP4 experts) |
//!
//! Scales are looked up as `<base>.scale` and then `<base>.weight_scale_inv` (V3 naming).

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
    let w = tensor(ck, &wname)?;
    let scale = ck
        .get(&format!("{base}.scale"))
        .or_else(|| ck.get(&format!("{wname}_scale_inv")));
    view(w, scale, rows, cols, block_hint)
}

/// The view of a weight tensor and its optional scale tensor.
pub fn view<'a>(
    w: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
    rows: usize,
    cols: usize,
    block_hint: Option<(usize, usize)>,
) -> Result<WeightView<'a>> {
    let name = w.name;
    let wshape: Vec<usize> = w.shape.iter().map(|&v| v as usize).collect();
    let kerr = |e: keep_kernels::KernelError| fmt_err(name, e.to_string());
    match (w.dtype, scale) {
        (Dtype::F32, None) | (Dtype::BF16, None) => {
            if wshape != [rows, cols] {
                return Err(shape_err(name, &[rows, cols], w.shape));
            }
            if w.dtype == Dtype::F32 {
                WeightView::f32(w.bytes, rows, cols).map_err(kerr)
            } else {
                WeightView::bf16(w.bytes, rows, cols).map_err(kerr)
            }
        }
        (Dtype::F8_E4M3, Some(s)) => {
            if wshape != [rows, cols] {
                return Err(shape_err(name, &[rows, cols], w.shape));
            }
            let sshape: Vec<usize> = s.shape.iter().map(|&v| v as usize).collect();
            let e8 = matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8);
            if cols.is_multiple_of(32) && sshape == [rows, cols / 32] && e8 {
                return WeightView::mxfp8(w.bytes, s.bytes, rows, cols).map_err(kerr);
            }
            if sshape.len() != 2 {
                return Err(fmt_err(s.name, format!("scale shape {:?} is not 2-D", s.shape)));
            }
            let mut tries = vec![];
            if let Some(b) = block_hint {
                tries.push(b);
            }
            tries.extend([(32, 32), (64, 64), (128, 128)]);
            let block = tries
                .into_iter()
                .find(|&(br, bc)| sshape == [rows.div_ceil(br), cols.div_ceil(bc)])
                .ok_or_else(|| {
                    fmt_err(
                        s.name,
                        format!(
                            "scale shape {:?} fits neither MXFP8 [{rows}, {}] nor FP8 blocks of 32, 64 or 128 over [{rows}, {cols}]",
                            s.shape,
                            cols / 32
                        ),
                    )
                })?;
            let scales = match s.dtype {
                Dtype::F8_E8M0 | Dtype::U8 => BlockScales::E8m0(s.bytes),
                Dtype::F32 => BlockScales::F32(s.bytes),
                d => return Err(fmt_err(s.name, format!("scale dtype {d} is not E8M0 or F32"))),
            };
            WeightView::fp8_block(w.bytes, scales, rows, cols, block.0, block.1).map_err(kerr)
        }
        (Dtype::I8 | Dtype::U8, Some(s)) => {
            if !cols.is_multiple_of(32) || wshape != [rows, cols / 2] {
                return Err(shape_err(name, &[rows, cols / 2], w.shape));
            }
            let sshape: Vec<usize> = s.shape.iter().map(|&v| v as usize).collect();
            if sshape != [rows, cols / 32] || !matches!(s.dtype, Dtype::F8_E8M0 | Dtype::U8) {
                return Err(fmt_err(
                    s.name,
                    format!(
                        "FP4 scale must be E8M0 [{rows}, {}], found {} {:?}",
                        cols / 32,
                        s.dtype,
                        s.shape
                    ),
                ));
            }
            WeightView::mxfp4(w.bytes, s.bytes, rows, cols).map_err(kerr)
        }
        (d, s) => Err(fmt_err(
            name,
            format!(
                "dtype {d} {} is not a weight format keep computes with (f32, bf16, FP8 E4M3 + scale, FP4 I8 + E8M0 scale)",
                if s.is_some() { "with a scale" } else { "without a scale" }
            ),
        )),
    }
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
