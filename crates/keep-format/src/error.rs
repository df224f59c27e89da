//! Typed errors for every fallible codec in `keep-format`.
//!
//! What it is: the single [`FormatError`] enum returned by slice/row/block
//! decoders and encoders when lengths, shapes or scales do not fit. What it is
//! not: a place for I/O or tensor-name context (callers such as
//! `keep-checkpoint` wrap these with the tensor name). Depends on `thiserror` only.

/// Why a codec refused its input. No codec in this crate panics on bad input;
/// it returns one of these instead.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FormatError {
    /// A buffer has the wrong number of elements or bytes.
    #[error("{what}: expected length {expected}, got {got}")]
    LengthMismatch {
        /// Which buffer (e.g. `"scales"`).
        what: &'static str,
        /// The length the other arguments imply.
        expected: usize,
        /// The length that was passed.
        got: usize,
    },
    /// A column count is not a multiple of a required group size.
    #[error("{what}: {cols} columns is not a multiple of {multiple}")]
    Unaligned {
        /// Which format or argument needs the alignment.
        what: &'static str,
        /// The column count that was passed.
        cols: usize,
        /// The multiple it must be.
        multiple: usize,
    },
    /// A float32 scale that must be an exact power of two is not one.
    #[error("scale {index} = {value:e} is not an exact power of two")]
    NotPowerOfTwo {
        /// Flat index of the scale in its scale buffer.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// A scale is NaN (E8M0 byte 0xFF, or a NaN float32 where a power of two is required).
    #[error("scale {index} is NaN")]
    NanScale {
        /// Flat index of the scale in its scale buffer.
        index: usize,
    },
    /// A block shape has a zero dimension.
    #[error("invalid block shape {rows}x{cols}: both dimensions must be at least 1")]
    InvalidBlock {
        /// Block rows.
        rows: usize,
        /// Block columns.
        cols: usize,
    },
    /// A row index is past the end of the scale grid.
    #[error("row {row} needs scale row {scale_row}, but the scale grid has {scale_rows} rows")]
    RowOutOfRange {
        /// The row index that was passed.
        row: usize,
        /// The scale row it maps to.
        scale_row: usize,
        /// Scale rows available.
        scale_rows: usize,
    },
    /// A code width the format does not offer (MLX affine: 2, 3, 4 or 8 bits).
    #[error("{bits}-bit codes are not supported (2, 3, 4 or 8)")]
    UnsupportedBits {
        /// The width that was passed.
        bits: u32,
    },
    /// `rows * cols` (or a derived size) does not fit in `usize`.
    #[error("{what}: size overflows usize")]
    Overflow {
        /// Which size.
        what: &'static str,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T> = std::result::Result<T, FormatError>;

/// `Err(LengthMismatch)` unless `got == expected`.
#[inline]
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(FormatError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

/// `Err(Unaligned)` unless `cols % multiple == 0`.
#[inline]
pub(crate) fn check_aligned(what: &'static str, cols: usize, multiple: usize) -> Result<()> {
    if cols.is_multiple_of(multiple) {
        Ok(())
    } else {
        Err(FormatError::Unaligned {
            what,
            cols,
            multiple,
        })
    }
}

/// `a * b` or `Err(Overflow)`.
#[inline]
pub(crate) fn mul(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(FormatError::Overflow { what })
}
