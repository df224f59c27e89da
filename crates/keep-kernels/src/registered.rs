//! A weight in a registered format (keep-format's [`keep_format::registry`]): one view type
//! for every format the registry describes, so that the kernels' enums ([`crate::WeightKind`],
//! [`crate::simd::Src`], [`crate::intdot::IntSrc`]) each have one arm for all of them. The
//! exact kernels decode its rows with the entry's `decode_row` and run the scalar
//! decode-and-dot path; the integer kernels take its integer form (small integers and one
//! factor per 32 columns) on every level through the same row and GEMM kernels as the other
//! decoded-row formats (see [`crate::intdot`]); a format without one (NVFP4: two scales per 32
//! columns) runs on the decoded-row f32 path under either kernel choice.

use keep_format::registry::FormatSpec;

use crate::{KernelError, Result};

/// Most computed parts a registered format has.
pub const MAX_PARTS: usize = 3;

/// The computed parts of a registered weight (`[rows, cols]`, the view's own rows).
#[derive(Debug, Clone, Copy)]
pub struct RegView<'a> {
    pub spec: &'static FormatSpec,
    parts: [&'a [u8]; MAX_PARTS],
    n: usize,
}

impl<'a> RegView<'a> {
    /// A `[rows, cols]` weight from its computed parts, in the entry's order (lengths
    /// checked).
    pub fn new(
        spec: &'static FormatSpec,
        parts: &[&'a [u8]],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if parts.len() > MAX_PARTS {
            return Err(KernelError::Shape {
                what: "registered weight",
                msg: format!("{} parts (at most {MAX_PARTS})", parts.len()),
            });
        }
        spec.check(parts, rows, cols)
            .map_err(|msg| KernelError::Shape {
                what: "registered weight",
                msg,
            })?;
        let mut p: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
        p[..parts.len()].copy_from_slice(parts);
        Ok(RegView {
            spec,
            parts: p,
            n: parts.len(),
        })
    }

    /// The computed parts.
    #[inline]
    pub fn parts(&self) -> &[&'a [u8]] {
        &self.parts[..self.n]
    }

    /// Rows `r0..r1` (of a `cols`-wide weight) as a view of their own.
    pub fn slice_rows(&self, cols: usize, r0: usize, r1: usize) -> Self {
        let mut out = *self;
        for ((o, p), (_, spec)) in out
            .parts
            .iter_mut()
            .zip(self.parts())
            .zip(self.spec.computed())
        {
            // A per-tensor part (a global scale) stays whole.
            if let Some(rb) = spec.row_bytes(cols) {
                *o = &p[r0 * rb..r1 * rb];
            }
        }
        out
    }

    /// Bytes the view reads.
    pub fn nbytes(&self) -> usize {
        self.parts().iter().map(|p| p.len()).sum()
    }

    /// Element `(r, c)` from the definition.
    pub fn get_ref(&self, r: usize, c: usize, cols: usize) -> f32 {
        let mut row = vec![0f32; cols];
        (self.spec.decode_row_ref)(self.parts(), cols, r, &mut row);
        row[c]
    }

    /// Row `r` decoded to f32 (the fast decoder).
    #[inline]
    pub fn decode_row(&self, r: usize, cols: usize, dst: &mut [f32]) {
        (self.spec.decode_row)(self.parts(), cols, r, dst)
    }
}
