//! The type of a format registry entry ([`FormatSpec`]) and its parts; the entries and the
//! list are in [`crate::registry`].

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
    /// How the kernels read it, if they do.
    pub kind: PartKind,
}

/// How a part is read.
#[derive(Debug, Clone, Copy)]
pub enum PartKind {
    /// Read by the kernels, this many bytes per weight row of `cols` columns (a row slice of
    /// the weight takes its rows' bytes).
    Rows(fn(usize) -> usize),
    /// Read by the kernels whole, whatever rows a slice takes (a per-tensor scale such as
    /// NVFP4's `weight_global_scale`).
    Tensor,
    /// Metadata the kernels never read, whose bytes follow from `[rows, cols]` alone (these
    /// bytes; compressed-tensors' `weight_shape`).
    Fill(fn(usize, usize) -> Vec<u8>),
    /// Stored by some releases for another reader and never read by keep (NVFP4's
    /// `input_global_scale`, for activation quantization): when present, of this dtype and
    /// shape; the encoder writes none (an empty part), and [`FormatSpec::bytes`] counts none.
    Optional,
}

impl PartSpec {
    /// Whether the kernels read it.
    pub fn computed(&self) -> bool {
        matches!(self.kind, PartKind::Rows(_) | PartKind::Tensor)
    }

    /// Bytes per weight row, for a part the kernels read row by row.
    pub fn row_bytes(&self, cols: usize) -> Option<usize> {
        match self.kind {
            PartKind::Rows(f) => Some(f(cols)),
            _ => None,
        }
    }

    /// Its stored bytes for a `[rows, cols]` weight.
    pub fn bytes(&self, rows: usize, cols: usize) -> u64 {
        (self.shape)(rows, cols).iter().product::<u64>() * dtype_bytes(self.dtype)
    }

    /// The bytes of a row slice of `n` rows of a `cols`-wide weight (what a view of those rows
    /// holds of this part).
    pub fn slice_bytes(&self, n: usize, cols: usize) -> usize {
        match self.kind {
            PartKind::Rows(f) => n * f(cols),
            PartKind::Tensor => self.bytes(n, cols) as usize,
            PartKind::Fill(_) | PartKind::Optional => 0,
        }
    }
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
    /// Its tensors; the first is the main one (its suffix and dtype identify the format: two
    /// entries may share a suffix, as compressed-tensors' formats all name theirs
    /// `weight_packed`, never a suffix and dtype), read row by row; the second, when the
    /// kernels read it, is the weight's scale partner.
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
    /// The `quantization_config` (JSON) that a Hugging Face release in this format declares
    /// in its `config.json`, which `keep synth` writes with it.
    pub hf_quantization_config: Option<&'static str>,
}

impl FormatSpec {
    /// The parts the kernels read, in order (indices into [`FormatSpec::parts`]).
    pub fn computed(&self) -> impl Iterator<Item = (usize, &PartSpec)> {
        self.parts.iter().enumerate().filter(|(_, p)| p.computed())
    }

    /// Stored bytes of a `[rows, cols]` weight, every part included but optional ones.
    pub fn bytes(&self, rows: usize, cols: usize) -> u64 {
        self.parts
            .iter()
            .filter(|p| !matches!(p.kind, PartKind::Optional))
            .map(|p| p.bytes(rows, cols))
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
            .map(|(_, p)| (p, p.slice_bytes(rows, cols)))
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
