//! The format registry: one [`FormatSpec`] per number format that is described by a table
//! entry rather than by an arm in every layer's enum. An entry says everything the layers
//! above need to read, size, name, decode, encode and multiply by a `[rows, cols]` weight
//! stored in that format:
//!
//! - its tensors ([`PartSpec`]: the suffix that replaces `.weight`, the safetensors dtype, the
//!   shape for a `[rows, cols]` weight, and whether the kernels read it);
//! - the logical `[rows, cols]` from the main tensor's shape, and the bytes each computed part
//!   takes per row (so row slices and byte sizes need no format knowledge);
//! - a scalar decode written from the definition (`decode_row_ref`, the reference) and a fast
//!   one tested equal to it, and the encoder `keep synth` writes it with;
//! - its integer form for the fast kernels ([`IntForm`]: small integers per weight and one f32
//!   factor per block of 32 columns), which every integer level of `keep-kernels` multiplies
//!   by through one dispatch.
//!
//! keep-checkpoint classifies tensors through [`find_by_part`] / [`find_by_name`], keep-kernels
//! holds a registered weight as one `Registered` view whatever the format, and the harness in
//! keep-kernels runs every entry of [`REGISTRY`] on every integer level against its reference:
//! a format added here is covered by being registered.

pub use crate::spec::{dtype_bytes, Encoded, FormatSpec, IntForm, PartKind, PartSpec};

/// Every registered format.
pub static REGISTRY: &[&FormatSpec] = &[&crate::int4g32::INT4_G32, &crate::nvfp4::NVFP4];

/// The registered format called `name`.
pub fn find_by_name(name: &str) -> Option<&'static FormatSpec> {
    REGISTRY.iter().copied().find(|f| f.name == name)
}

/// The registered format whose main part ends `tensor_name` with dtype `dtype` (a safetensors
/// dtype name), with the base name before the suffix (`a.b.weight_packed`, `"U8"` → (NVFP4,
/// `a.b`)): entries that share a main suffix are told apart by its dtype.
pub fn find_main<'a>(tensor_name: &'a str, dtype: &str) -> Option<(&'static FormatSpec, &'a str)> {
    REGISTRY.iter().copied().find_map(|f| {
        let p = &f.parts[0];
        tensor_name
            .strip_suffix(p.suffix)
            .filter(|b| !b.is_empty() && p.dtype == dtype)
            .map(|b| (f, b))
    })
}

/// The first registered format and part index whose suffix ends `tensor_name`, with the base
/// name before the suffix (`a.b.weight_packed` → (INT4-g32, 0, `a.b`)): the part's role (index
/// 0 the main part, 1 the scale partner), which entries sharing a suffix agree on; the format
/// itself is [`find_main`]'s, from the main part's dtype.
pub fn find_by_part(tensor_name: &str) -> Option<(&'static FormatSpec, usize, &str)> {
    REGISTRY.iter().copied().find_map(|f| {
        f.parts.iter().enumerate().find_map(|(i, p)| {
            tensor_name
                .strip_suffix(p.suffix)
                .filter(|b| !b.is_empty())
                .map(|b| (f, i, b))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_main_parts_are_unique() {
        let mut names: Vec<&str> = REGISTRY.iter().map(|f| f.name).collect();
        let mut mains: Vec<(&str, &str)> = REGISTRY
            .iter()
            .map(|f| (f.parts[0].suffix, f.parts[0].dtype))
            .collect();
        let (n, s) = (names.len(), mains.len());
        names.sort();
        names.dedup();
        mains.sort();
        mains.dedup();
        assert_eq!((names.len(), mains.len()), (n, s));
        for f in REGISTRY {
            // A suffix two entries share has the same role (index) in both.
            for (i, p) in f.parts.iter().enumerate() {
                let (_, j, _) = find_by_part(&format!("m{}", p.suffix)).unwrap();
                assert!(i == j || (i > 1 && j > 1), "{} `{}`", f.name, p.suffix);
            }
            let main = format!("a.b{}", f.parts[0].suffix);
            assert_eq!(
                find_main(&main, f.parts[0].dtype).map(|(g, b)| (g.name, b)),
                Some((f.name, "a.b"))
            );
            assert!(find_main(&main, "F64").is_none());
            assert_eq!(find_by_name(f.name).map(|g| g.name), Some(f.name));
            if let Some(j) = f.hf_quantization_config {
                let v: serde_json::Value = serde_json::from_str(j).unwrap();
                assert!(v["quant_method"].is_string(), "{}", f.name);
            }
            assert!(
                matches!(f.parts[0].kind, PartKind::Rows(_)),
                "{}: main part",
                f.name
            );
            for p in f.parts {
                assert!(!p.suffix.ends_with(".weight"), "{}", p.suffix);
            }
        }
    }

    /// Every entry: encode → decode_ref → fast decode agree, sizes match the parts, and the
    /// integer form times its factors is the f32 decode.
    #[test]
    fn every_entry_round_trips_its_definition() {
        use keep_rng::RngCore;
        let mut rng = keep_rng::splitmix(7);
        for f in REGISTRY {
            for (rows, cols) in [(1, f.col_multiple), (3, 4 * f.col_multiple), (5, 96)] {
                if !cols.is_multiple_of(f.col_multiple) {
                    continue;
                }
                let w: Vec<f32> = (0..rows * cols)
                    .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0)
                    .collect();
                let enc = (f.encode_ref)(&w, rows, cols).unwrap();
                assert_eq!(enc.len(), f.parts.len());
                let total: u64 = enc.iter().map(|b| b.len() as u64).sum();
                assert_eq!(total, f.bytes(rows, cols), "{}", f.name);
                for (p, b) in f.parts.iter().zip(&enc) {
                    if let PartKind::Fill(fill) = p.kind {
                        assert_eq!(fill(rows, cols), *b, "{} `{}`", f.name, p.suffix);
                    }
                }
                let parts: Vec<&[u8]> = f.computed().map(|(i, _)| &enc[i][..]).collect();
                f.check(&parts, rows, cols).unwrap();
                let main: Vec<u64> = (f.parts[0].shape)(rows, cols);
                assert_eq!((f.logical)(&main), Some((rows, cols)));
                let (mut a, mut b) = (vec![0f32; cols], vec![0f32; cols]);
                let (mut qa, mut qb) = (vec![0i8; cols], vec![0i8; cols]);
                let mut fac = vec![0f32; cols / 32];
                for r in 0..rows {
                    (f.decode_row_ref)(&parts, cols, r, &mut a);
                    (f.decode_row)(&parts, cols, r, &mut b);
                    assert_eq!(
                        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    );
                    if let Some(i) = f.int {
                        (i.decode_ref)(&parts, cols, r, &mut qa);
                        (i.decode)(&parts, cols, r, &mut qb);
                        assert_eq!(qa, qb);
                        (i.block_factors)(&parts, cols, r, &mut fac);
                        for j in 0..cols {
                            assert_eq!(
                                (qa[j] as f32 * fac[j / 32]).to_bits(),
                                a[j].to_bits(),
                                "{} ({r}, {j})",
                                f.name
                            );
                        }
                    }
                    // Every registered encoder rounds to nearest on a grid far finer than the
                    // values' range [-1.5, 1.5].
                    for j in 0..cols {
                        assert!((a[j] - w[r * cols + j]).abs() <= 0.25, "{}", f.name);
                    }
                }
            }
        }
    }
}
