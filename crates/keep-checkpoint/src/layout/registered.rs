//! Weights in a format of keep-format's registry ([`keep_format::registry`]): the layout is
//! read from the entry (its main tensor's suffix, dtype and shape, its scale partner's dtype and
//! shape), never from an enum arm of its own. A registered weight `<base>.weight` is stored as
//! the entry's parts (`<base>.weight_packed`, `<base>.weight_scale`, `<base>.weight_shape` for
//! INT4 group 32); the main part stands where `.weight` would, the second is its
//! [`crate::layout::WeightLayout::scale`], and a part the kernels never read (compressed-tensors'
//! `weight_shape`) is checked by [`metadata_problem`].

use keep_format::registry::{find_by_part, find_main, FormatSpec, PartKind, REGISTRY};

use crate::layout::{Layout, WeightLayout};
use crate::{Checkpoint, TensorRef};

/// The registered format of weight tensor `weight` (its name ends with an entry's main
/// suffix), classified with `scale`; `None` when no entry names it.
pub(crate) fn classify<'a>(
    weight: TensorRef<'a>,
    scale: Option<TensorRef<'a>>,
) -> Option<Result<WeightLayout<'a>, String>> {
    let (_, 0, _) = find_by_part(weight.name)? else {
        return None;
    };
    let Some((f, _)) = find_main(weight.name, weight.dtype.name()) else {
        let known: Vec<String> = REGISTRY
            .iter()
            .filter(|f| weight.name.ends_with(f.parts[0].suffix))
            .map(|f| format!("{} ({})", f.parts[0].dtype, f.name))
            .collect();
        return Some(Err(format!(
            "`{}` is {}; a registered format's is {}",
            weight.name,
            weight.dtype,
            known.join(" or ")
        )));
    };
    Some(classify_as_spec(f, weight, scale))
}

/// The registered format of a main tensor (by its suffix and dtype), with its base name.
pub fn spec_of<'a>(main: &TensorRef<'a>) -> Option<(&'static FormatSpec, &'a str)> {
    find_main(main.name, main.dtype.name())
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
    if let Some(p) = f.parts.get(1).filter(|p| p.computed()) {
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
    let Some((f, base)) = ck.get(main_name).and_then(|t| spec_of(&t)) else {
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
    let (_, base) = spec_of(&l.weight)?;
    // The main part and the scale partner are checked by the classification.
    for (_, p) in f
        .parts
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(i, p)| *i > 1 || !p.computed())
    {
        let n = format!("{base}{}", p.suffix);
        let want = (p.shape)(l.rows, l.cols);
        let Some(t) = ck.get(&n) else {
            if matches!(p.kind, PartKind::Optional) {
                continue;
            }
            return Some(format!("tensor `{n}` is missing (a {} weight's)", f.name));
        };
        if t.dtype.name() != p.dtype || t.shape != want.as_slice() {
            return Some(format!(
                "tensor `{n}` is {} {:?}, expected {} {want:?}",
                t.dtype, t.shape, p.dtype
            ));
        }
        if let PartKind::Fill(fill) = p.kind {
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

/// The parts of the registered weight whose main tensor is `main` that the kernels read past
/// the main tensor and its scale partner (NVFP4's per-tensor `weight_global_scale`), in the
/// entry's order, those `ck` has (a missing one is named by [`computed_parts_with`]); empty when
/// `main` is in no registered format.
pub fn further_parts<'a>(ck: &'a Checkpoint, main: &TensorRef<'a>) -> Vec<TensorRef<'a>> {
    let Some((f, base)) = spec_of(main) else {
        return vec![];
    };
    f.computed()
        .filter(|&(i, _)| i >= 2)
        .filter_map(|(_, p)| ck.get(&format!("{base}{}", p.suffix)))
        .collect()
}

/// The bytes of every part the kernels read of registered weight `l`, in the entry's order (the
/// main tensor, its scale partner, then parts fetched by name such as a per-tensor global scale,
/// each checked for dtype and shape).
pub fn computed_parts<'a>(
    ck: &'a Checkpoint,
    l: &WeightLayout<'a>,
) -> Result<Vec<&'a [u8]>, String> {
    computed_parts_with(l, &further_parts(ck, &l.weight))
}

/// [`computed_parts`] with the parts past the scale partner taken from `further` (by name, as
/// an expert matrix carries them, [`crate::layout::ExpertMatrix::further`]) rather than from the
/// checkpoint: each present and of its entry's dtype and shape.
pub fn computed_parts_with<'a>(
    l: &WeightLayout<'a>,
    further: &[TensorRef<'a>],
) -> Result<Vec<&'a [u8]>, String> {
    let Layout::Registered(name) = l.layout else {
        return Err(format!("`{}` is not in a registered format", l.weight.name));
    };
    let f = keep_format::registry::find_by_name(name)
        .ok_or_else(|| format!("no registered format `{name}`"))?;
    let (_, base) =
        spec_of(&l.weight).ok_or_else(|| format!("`{}`: no main part", l.weight.name))?;
    let mut out = vec![];
    for (i, p) in f.computed() {
        let n = format!("{base}{}", p.suffix);
        let t = match (i, l.scale) {
            (0, _) => l.weight,
            (1, Some(s)) => s,
            _ => *further
                .iter()
                .find(|t| t.name == n)
                .ok_or_else(|| format!("tensor `{n}` is missing (a {} weight's)", f.name))?,
        };
        if i > 0 {
            let want = (p.shape)(l.rows, l.cols);
            if t.dtype.name() != p.dtype || t.shape != want.as_slice() {
                return Err(format!(
                    "tensor `{}` is {} {:?}, expected {} {want:?}",
                    t.name, t.dtype, t.shape, p.dtype
                ));
            }
        }
        out.push(t.bytes);
    }
    if let Some(t) = further.iter().find(|t| {
        !f.computed()
            .any(|(i, p)| i >= 2 && t.name == format!("{base}{}", p.suffix))
    }) {
        return Err(format!(
            "tensor `{}` is not a part a {} weight's kernels read",
            t.name, f.name
        ));
    }
    Ok(out)
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

    /// Two entries share `weight_packed` and `weight_scale`: the main part's dtype picks the
    /// format (I32 INT4-g32, U8 NVFP4), and each is checked against its own entry.
    #[test]
    fn formats_sharing_a_suffix_are_told_apart_by_dtype() {
        let b = [0u8; 0];
        let w = t("m.e.weight_packed", Dtype::U8, &[64, 16], &b);
        let s = t("m.e.weight_scale", Dtype::F8_E4M3, &[64, 2], &b);
        let l = classify(w, Some(s), None).unwrap();
        assert_eq!(
            (l.layout, l.rows, l.cols),
            (Layout::Registered("nvfp4"), 64, 32)
        );
        assert_eq!(
            spec_of(&w).map(|(f, b)| (f.name, b)),
            Some(("nvfp4", "m.e"))
        );
        // NVFP4's packed bytes with INT4's bf16 scales: refused by NVFP4's entry.
        let e = classify(
            w,
            Some(t("m.e.weight_scale", Dtype::BF16, &[64, 2], &b)),
            None,
        );
        assert!(e.unwrap_err().contains("F8_E4M3"));
        // A main part of neither dtype: both named.
        let e = classify(
            t("m.e.weight_packed", Dtype::F16, &[64, 16], &b),
            Some(s),
            None,
        );
        let e = e.unwrap_err();
        assert!(
            e.contains("I32 (int4-g32)") && e.contains("U8 (nvfp4)"),
            "{e}"
        );
        // The global scales are the weight's partners.
        for part in [".weight_global_scale", ".input_global_scale"] {
            assert_eq!(parse(&format!("m.e{part}")).part, Part::Scale);
            assert_eq!(
                crate::naming::weight_of_scale(&format!("m.e{part}")),
                Some("m.e.weight_packed".into())
            );
        }
    }
}
