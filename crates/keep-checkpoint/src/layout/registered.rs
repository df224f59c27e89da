//! Weights in a format of keep-format's registry ([`keep_format::registry`]): the layout is
//! read from the entry (its main tensor's suffix, dtype and shape, its scale partner's dtype and
//! shape), never from an enum arm of its own. A registered weight `<base>.weight` is stored as
//! the entry's parts (`<base>.weight_packed`, `<base>.weight_scale`, `<base>.weight_shape` for
//! INT4 group 32); the main part stands where `.weight` would, the second is its
//! [`crate::layout::WeightLayout::scale`], and a part the kernels never read (compressed-tensors'
//! `weight_shape`) is checked by [`metadata_problem`].

use keep_format::registry::{find_by_part, FormatSpec, REGISTRY};

use crate::layout::{Layout, WeightLayout};
use crate::{Checkpoint, TensorRef};

/// The registered format of weight tensor `weight` (its name ends with an entry's main
/// suffix), classified with `scale`; `None` when no entry names it.
pub(crate) fn classify<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
) -> Option<Result<WeightLayout<'a>, String>> {
    let (f, 0, _) = find_by_part(weight.name)? else {
        return None;
    };
    Some(classify_as_spec(f, weight, scale))
}

fn classify_as_spec<'a>(
    f: &'static FormatSpec,
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
) -> Result<WeightLayout<'a>, String> {
    let main = &f.parts[0];
    if weight.dtype.name() != main.dtype {
        return Err(format!(
            "a {} weight's `{}` is {}, not {}",
            f.name, main.suffix, weight.dtype, main.dtype
        ));
    }
    let Some((rows, cols)) = (f.logical)(weight.shape) else {
        return Err(format!(
            "a {} weight's `{}` has shape {:?}",
            f.name, main.suffix, weight.shape
        ));
    };
    if !cols.is_multiple_of(f.col_multiple) {
        return Err(format!(
            "a {} weight of {rows}x{cols}: columns must be a multiple of {}",
            f.name, f.col_multiple
        ));
    }
    if let Some(p) = f.parts.get(1).filter(|p| p.row_bytes.is_some()) {
        let want = (p.shape)(rows, cols);
        match scale {
            None => {
                return Err(format!(
                    "a {} weight needs its `{}` tensor",
                    f.name, p.suffix
                ))
            }
            Some(s) if s.dtype.name() != p.dtype || s.shape != want.as_slice() => {
                return Err(format!(
                    "its `{}` tensor `{}` is {} {:?}; a {rows}x{cols} {} weight's is {} {want:?}",
                    p.suffix, s.name, s.dtype, s.shape, f.name, p.dtype
                ))
            }
            Some(_) => {}
        }
    }
    Ok(WeightLayout {
        weight,
        scale,
        layout: Layout::Registered(f.name),
        rows,
        cols,
    })
}

/// The tensor that stands for `<base>.weight` (`weight_name`): itself, or a registered
/// format's main part (`<base>.weight_packed`).
pub fn main_tensor<'a>(ck: &'a Checkpoint, weight_name: &str) -> Option<TensorRef<'a>> {
    ck.get(weight_name).or_else(|| {
        REGISTRY
            .iter()
            .find_map(|f| ck.get(&f.part_name(weight_name, 0)?))
    })
}

/// Every part of the registered weight whose main tensor is `main_name` (for claiming them
/// in reports), the main one excluded.
pub fn parts_of(ck: &Checkpoint, main_name: &str) -> Vec<String> {
    let Some((f, 0, base)) = find_by_part(main_name) else {
        return vec![];
    };
    f.parts[1..]
        .iter()
        .map(|p| format!("{base}{}", p.suffix))
        .filter(|n| ck.contains(n))
        .collect()
}

/// A problem with the parts of a registered weight the kernels never read (present, of the
/// entry's dtype and shape, holding the bytes the entry's `fill` gives for `[rows, cols]`).
pub fn metadata_problem(ck: &Checkpoint, l: &WeightLayout) -> Option<String> {
    let Layout::Registered(name) = l.layout else {
        return None;
    };
    let f = keep_format::registry::find_by_name(name)?;
    let (_, _, base) = find_by_part(l.weight.name)?;
    for p in f.parts.iter().filter(|p| p.row_bytes.is_none()) {
        let n = format!("{base}{}", p.suffix);
        let want = (p.shape)(l.rows, l.cols);
        let Some(t) = ck.get(&n) else {
            return Some(format!("tensor `{n}` is missing (a {} weight's)", f.name));
        };
        if t.dtype.name() != p.dtype || t.shape != want.as_slice() {
            return Some(format!(
                "tensor `{n}` is {} {:?}, expected {} {want:?}",
                t.dtype, t.shape, p.dtype
            ));
        }
        if let Some(fill) = p.fill {
            if t.bytes != fill(l.rows, l.cols).as_slice() {
                return Some(format!(
                    "tensor `{n}` does not describe a {}x{} {} weight (the packed weight's shape)",
                    l.rows, l.cols, f.name
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{classify, classify_as, scale_of};
    use crate::naming::{parse, ExpertMat, Part, Role};
    use crate::Dtype;

    fn t<'a>(name: &'a str, dtype: Dtype, shape: &'a [u64], bytes: &'a [u8]) -> TensorRef<'a> {
        TensorRef {
            name,
            dtype,
            shape,
            bytes,
            shard: 0,
            file_offset: 0,
        }
    }

    #[test]
    fn int4_g32_is_read_from_the_registry_entry() {
        let b = [0u8; 0];
        let w = t("m.e.weight_packed", Dtype::I32, &[64, 32], &b);
        let s = t("m.e.weight_scale", Dtype::BF16, &[64, 8], &b);
        let l = classify(w, Some(s), None).unwrap();
        assert_eq!(
            (l.layout, l.rows, l.cols),
            (Layout::Registered("int4-g32"), 64, 256)
        );
        assert!(l.layout.computable());
        assert!(l.layout.label().starts_with("int4-g32"));
        assert!(classify_as(w, Some(s), 64, 256, None).is_ok());
        // Scale of the wrong dtype or grid, or none: refused with the reason.
        let e = classify(
            w,
            Some(t("m.e.weight_scale", Dtype::F32, &[64, 8], &b)),
            None,
        );
        assert!(e.unwrap_err().contains("BF16"));
        let e = classify(
            w,
            Some(t("m.e.weight_scale", Dtype::BF16, &[64, 4], &b)),
            None,
        );
        assert!(e.unwrap_err().contains("[64, 8]"));
        assert!(classify(w, None, None)
            .unwrap_err()
            .contains("weight_scale"));
        let u = t("m.e.weight_packed", Dtype::U32, &[64, 32], &b);
        assert!(classify(u, Some(s), None).unwrap_err().contains("I32"));
        // Names: the parts are the weight and its scale partners.
        let n = "model.layers.2.mlp.experts.5.up_proj";
        let p = parse(&format!("{n}.weight_packed"));
        assert_eq!(
            (p.role, p.part),
            (
                Role::RoutedExpert {
                    expert: 5,
                    mat: ExpertMat::W3
                },
                Part::Weight
            )
        );
        for part in [".weight_scale", ".weight_shape"] {
            assert_eq!(parse(&format!("{n}{part}")).part, Part::Scale);
        }
        assert_eq!(
            crate::naming::weight_of_scale(&format!("{n}.weight_scale")),
            Some(format!("{n}.weight_packed"))
        );
        assert_eq!(
            crate::naming::scale_candidates(&format!("{n}.weight_packed")),
            vec![format!("{n}.weight_scale")]
        );
        let _ = scale_of;
    }
}
