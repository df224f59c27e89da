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

use crate::FormatError;

/// An encoder's output: one byte vector per part, in the entry's order.
pub type Encoded = Result<Vec<Vec<u8>>, FormatError>;

/// One tensor of a registered format's weight.
#[derive(Debug)]
pub struct PartSpec {
    /// What replaces `.weight` in the tensor's name (`.weight_packed`).
    pub suffix: &'static str,
    /// Its safetensors dtype name (`"I32"`, `"BF16"`).
    pub dtype: &'static str,
    /// Its shape for a `[rows, cols]` weight.
    pub shape: fn(usize, usize) -> Vec<u64>,
    /// Bytes per weight row the kernels read (`None`: metadata the kernels never read, such as
    /// compressed-tensors' `weight_shape`).
    pub row_bytes: Option<fn(usize) -> usize>,
}

/// The integer form of a registered format (see `keep-kernels`' `intdot` contract): weight
/// `(r, j)` is `w[r, j] · f[r, j / 32]` with `w` an integer in [−128, 127].
#[derive(Debug)]
pub struct IntForm {
    /// Integer weights of row `r` into `dst[..cols]`, from the definition.
    pub decode_ref: fn(&[&[u8]], usize, usize, &mut [i8]),
    /// The same values, fast (tested equal to `decode_ref`).
    pub decode: fn(&[&[u8]], usize, usize, &mut [i8]),
    /// Block factors of row `r` into `dst[..cols/32]`.
    pub block_factors: fn(&[&[u8]], usize, usize, &mut [f32]),
}

/// A number format described by one entry.
#[derive(Debug)]
pub struct FormatSpec {
    /// Short name (`keep synth --experts`, reports, kernel names): `"int4-g32"`.
    pub name: &'static str,
    /// Report label (`keep inspect`).
    pub label: &'static str,
    /// Its tensors; the first is the main one (its dtype and shape identify the format).
    pub parts: &'static [PartSpec],
    /// Columns must be a multiple of this.
    pub col_multiple: usize,
    /// `[rows, cols]` from the main tensor's shape (`None`: not this format's shape).
    pub logical: fn(&[u64]) -> Option<(usize, usize)>,
    /// Row `r` of a `[.., cols]` weight decoded to f32 from the definition (`parts`: the
    /// computed parts, in order).
    pub decode_row_ref: fn(&[&[u8]], usize, usize, &mut [f32]),
    /// The same values, fast (tested equal to `decode_row_ref`).
    pub decode_row: fn(&[&[u8]], usize, usize, &mut [f32]),
    /// Encode a row-major `[rows, cols]` f32 matrix: one byte vector per part, in order.
    pub encode_ref: fn(&[f32], usize, usize) -> Encoded,
    /// The integer form, if the fast integer kernels take it.
    pub int: Option<&'static IntForm>,
}

impl FormatSpec {
    /// The parts the kernels read, in order (indices into [`FormatSpec::parts`]).
    pub fn computed(&self) -> impl Iterator<Item = (usize, &PartSpec)> {
        self.parts
            .iter()
            .enumerate()
            .filter(|(_, p)| p.row_bytes.is_some())
    }

    /// Stored bytes of a `[rows, cols]` weight, every part included.
    pub fn bytes(&self, rows: usize, cols: usize) -> u64 {
        self.parts
            .iter()
            .map(|p| {
                let n: u64 = (p.shape)(rows, cols).iter().product();
                n * dtype_bytes(p.dtype)
            })
            .sum()
    }

    /// The name of part `i` of the weight whose `.weight` name is `weight_name`.
    pub fn part_name(&self, weight_name: &str, i: usize) -> Option<String> {
        let base = weight_name.strip_suffix(".weight")?;
        Some(format!("{base}{}", self.parts.get(i)?.suffix))
    }

    /// Check computed parts' byte lengths against a `[rows, cols]` weight.
    pub fn check(&self, parts: &[&[u8]], rows: usize, cols: usize) -> Result<(), String> {
        if cols == 0 || !cols.is_multiple_of(self.col_multiple) {
            return Err(format!(
                "{}: {cols} columns is not a multiple of {}",
                self.name, self.col_multiple
            ));
        }
        let want: Vec<(&PartSpec, usize)> = self
            .computed()
            .map(|(_, p)| (p, rows * p.row_bytes.map_or(0, |f| f(cols))))
            .collect();
        if want.len() != parts.len() {
            return Err(format!(
                "{}: {} computed parts, got {}",
                self.name,
                want.len(),
                parts.len()
            ));
        }
        for ((p, n), b) in want.iter().zip(parts) {
            if b.len() != *n {
                return Err(format!(
                    "{} `{}` of a {rows}x{cols} weight is {n} bytes, got {}",
                    self.name,
                    p.suffix,
                    b.len()
                ));
            }
        }
        Ok(())
    }
}

/// Bytes per element of a safetensors dtype name the registry uses.
pub fn dtype_bytes(dtype: &str) -> u64 {
    match dtype {
        "I32" | "U32" | "F32" => 4,
        "BF16" | "F16" | "U16" | "I16" => 2,
        "I64" | "U64" | "F64" => 8,
        _ => 1,
    }
}

/// Every registered format.
pub static REGISTRY: &[&FormatSpec] = &[&crate::int4g32::INT4_G32];

/// The registered format called `name`.
pub fn find_by_name(name: &str) -> Option<&'static FormatSpec> {
    REGISTRY.iter().copied().find(|f| f.name == name)
}

/// The registered format and part index whose suffix ends `tensor_name`, with the base name
/// before the suffix (`a.b.weight_packed` → (INT4-g32, 0, `a.b`)).
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
    fn names_and_parts_are_unique() {
        let mut names: Vec<&str> = REGISTRY.iter().map(|f| f.name).collect();
        let mut suffixes: Vec<&str> = REGISTRY
            .iter()
            .flat_map(|f| f.parts.iter().map(|p| p.suffix))
            .collect();
        let (n, s) = (names.len(), suffixes.len());
        names.sort();
        names.dedup();
        suffixes.sort();
        suffixes.dedup();
        assert_eq!((names.len(), suffixes.len()), (n, s));
        for f in REGISTRY {
            assert_eq!(find_by_name(f.name).map(|g| g.name), Some(f.name));
            assert!(f.parts[0].row_bytes.is_some(), "{}: main part", f.name);
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
