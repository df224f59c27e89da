//! [`WeightView`]: a borrowed `[rows, cols]` weight in its shipped byte format, with a scalar
//! element decoder (`get_ref`, the reference) and a fast row decoder (`decode_row`).
//!
//! Byte layouts (row-major, little-endian):
//! - `F32`: 4 bytes per element. `Bf16`: 2 bytes per element.
//! - `Fp8Block`: E4M3 bytes `[rows, cols]` and scales `[ceil(R/br), ceil(C/bc)]` for blocks of
//!   `br × bc` (DeepSeek's 32×32 or 128×128), either E8M0 bytes or f32 values (power-of-two
//!   or V3-style `scale_inv` multipliers): `w[i,j] = e4m3(q[i,j]) · s[i/br, j/bc]`.
//!   `row0` is the first row of this view inside the scale grid (for row slices).
//! - `Mxfp8`: E4M3 bytes `[rows, cols]`, E8M0 scales `[rows, cols/32]`:
//!   `w[i,j] = e4m3(q[i,j]) · 2^(s[i, j/32] − 127)`.
//! - `Mxfp4`: packed E2M1 `[rows, cols/2]` (element 2k in the low nibble of byte k), E8M0 scales
//!   `[rows, cols/32]`: `w[i,j] = e2m1(nibble) · 2^(s[i, j/32] − 127)`.
//! - `E8p`: E8P12 codes `[rows, cols/8]` (u16 little-endian, `keep_format::e8p`) and f32 scales
//!   `[rows]`: `w[i,j] = s[i] · e8p(code[i, j/8])[j%8]`; with a residual stage (codes `[rows,
//!   cols/8]` of E81B bytes or E8P12 u16, f32 scales `[rows]`), `w[i,j] = s[i]·q₁ + s₂[i]·q₂`
//!   (two f32 products and one f32 add, in that order).
//! - `MlxAffine`: MLX affine codes at 2, 3, 4 or 8 bits, `[rows, cols·bits/8]` bytes (MLX's
//!   `uint32` words read little-endian: one bit stream per row, code `j` in bits
//!   `j·bits..(j+1)·bits`, `keep_format::mlx_affine`), bf16 scales and biases `[rows, cols/64]`:
//!   `w[i,j] = s[i, j/64] · q[i,j] + b[i, j/64]` (an f32 product, then an f32 add).
//! - `Registered`: any format of keep-format's registry ([`crate::RegView`]): its parts,
//!   byte layout and decode are the registry entry's.

use crate::codec::{bf16_at, e8m0_to_f32, f32_at, E2M1};
use crate::{KernelError, Result};
use keep_format::e81::{decode_e81, decode_e81_ref};
use keep_format::e8p::{decode_e8p, decode_e8p_ref};
use keep_format::mlx_affine::{code_ref, unpack_unchecked};

/// Columns per MLX affine group (MLX's default; the only one keep computes with).
pub const MLX_AFFINE_GROUP: usize = 64;

/// E4M3FN byte → f32 without a table (vectorises, and never touches an f32 subnormal, which
/// would be slow): E>0 builds the f32 directly (exponent E+120, mantissa M at bit 20); E=0 is
/// M·2^−9; 0x7F/0xFF are NaN. Equal to the table on all 256 codes (tested).
#[inline(always)]
pub fn e4m3_bits(b: u8) -> f32 {
    let b = b as u32;
    let sign = (b & 0x80) << 24;
    let e = (b >> 3) & 0xF;
    let m = b & 7;
    let normal = f32::from_bits(sign | ((e + 120) << 23) | (m << 20));
    let sub = f32::from_bits(sign | (m as f32 * (1.0 / 512.0)).to_bits());
    let v = if e == 0 { sub } else { normal };
    if b & 0x7F == 0x7F {
        f32::NAN
    } else {
        v
    }
}

/// E2M1 code → f32 without a table: E>0 builds the f32 (exponent E+126, mantissa at bit 22);
/// E=0 is M·0.5. Equal to the table on all 16 codes (tested).
#[inline(always)]
pub fn e2m1_bits(c: u8) -> f32 {
    let c = c as u32;
    let sign = (c & 8) << 28;
    let e = (c >> 1) & 3;
    let m = c & 1;
    let normal = f32::from_bits(sign | ((e + 126) << 23) | (m << 22));
    let sub = f32::from_bits(sign | (m as f32 * 0.5).to_bits());
    if e == 0 {
        sub
    } else {
        normal
    }
}

/// Scales of an FP8 block-scaled weight.
#[derive(Debug, Clone, Copy)]
pub enum BlockScales<'a> {
    /// One E8M0 byte per block.
    E8m0(&'a [u8]),
    /// One little-endian f32 per block (multiplied as is).
    F32(&'a [u8]),
    /// One little-endian bf16 per block (multiplied as is; Qwen's FP8 `weight_scale_inv`).
    Bf16(&'a [u8]),
}

/// The residual stage of an E8P weight: codes `[rows, cols/8]` and f32 scales `[rows]`.
#[derive(Debug, Clone, Copy)]
pub struct E8pResidual<'a> {
    /// E81B bytes (`e81`) or E8P12 u16 little-endian codes.
    pub codes: &'a [u8],
    pub scales: &'a [u8],
    /// Whether the codes are E81B (one byte per 8 weights) rather than E8P12.
    pub e81: bool,
}

impl E8pResidual<'_> {
    #[inline(always)]
    fn decode(&self, k: usize) -> [f32; 8] {
        if self.e81 {
            decode_e81(self.codes[k])
        } else {
            decode_e8p(u16::from_le_bytes([
                self.codes[2 * k],
                self.codes[2 * k + 1],
            ]))
        }
    }

    fn decode_ref(&self, k: usize) -> [f32; 8] {
        if self.e81 {
            decode_e81_ref(self.codes[k])
        } else {
            decode_e8p_ref(u16::from_le_bytes([
                self.codes[2 * k],
                self.codes[2 * k + 1],
            ]))
        }
    }

    fn code_bytes(&self) -> usize {
        if self.e81 {
            1
        } else {
            2
        }
    }
}

/// The format-specific bytes of a [`WeightView`].
#[derive(Debug, Clone, Copy)]
pub enum WeightKind<'a> {
    F32(&'a [u8]),
    Bf16(&'a [u8]),
    Fp8Block {
        q: &'a [u8],
        scales: BlockScales<'a>,
        block_rows: usize,
        block_cols: usize,
        /// First row of this view in the full tensor (the scale grid is the full tensor's).
        row0: usize,
    },
    Mxfp8 {
        q: &'a [u8],
        scales: &'a [u8],
    },
    Mxfp4 {
        packed: &'a [u8],
        scales: &'a [u8],
    },
    E8p {
        codes: &'a [u8],
        scales: &'a [u8],
        resid: Option<E8pResidual<'a>>,
    },
    /// MLX affine codes (`bits` ∈ {2, 3, 4, 8}, group 64) with bf16 scales and biases.
    MlxAffine {
        bits: u32,
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
    /// A format of keep-format's registry (INT4 group 32, ...).
    Registered(crate::RegView<'a>),
}

/// A borrowed weight matrix `[rows, cols]` (out × in) in its packed format.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub kind: WeightKind<'a>,
}

fn check(what: &'static str, rows: usize, cols: usize, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(KernelError::Bytes {
            what,
            rows,
            cols,
            expected,
            got,
        });
    }
    Ok(())
}

impl<'a> WeightView<'a> {
    /// f32 weight.
    pub fn f32(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        check("f32 weight", rows, cols, rows * cols * 4, bytes.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::F32(bytes),
        })
    }

    /// bf16 weight.
    pub fn bf16(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        check("bf16 weight", rows, cols, rows * cols * 2, bytes.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::Bf16(bytes),
        })
    }

    /// FP8 E4M3 with `block_rows × block_cols` block scales.
    pub fn fp8_block(
        q: &'a [u8],
        scales: BlockScales<'a>,
        rows: usize,
        cols: usize,
        block_rows: usize,
        block_cols: usize,
    ) -> Result<Self> {
        check("fp8 weight", rows, cols, rows * cols, q.len())?;
        if block_rows == 0 || block_cols == 0 {
            return Err(KernelError::Shape {
                what: "fp8 block",
                msg: "block size 0".into(),
            });
        }
        let n = rows.div_ceil(block_rows) * cols.div_ceil(block_cols);
        let (what, got) = match scales {
            BlockScales::E8m0(s) => ("fp8 block scales (E8M0)", s.len()),
            BlockScales::F32(s) => ("fp8 block scales (f32)", s.len() / 4),
            BlockScales::Bf16(s) => ("fp8 block scales (bf16)", s.len() / 2),
        };
        check(what, rows, cols, n, got)?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0: 0,
            },
        })
    }

    /// MXFP8: E4M3 elements with one E8M0 scale per row and 32 columns.
    pub fn mxfp8(q: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(32) {
            return Err(KernelError::Shape {
                what: "mxfp8 weight",
                msg: format!("{cols} columns is not a multiple of 32"),
            });
        }
        check("mxfp8 weight", rows, cols, rows * cols, q.len())?;
        check("mxfp8 scales", rows, cols, rows * cols / 32, scales.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::Mxfp8 { q, scales },
        })
    }

    /// MXFP4: packed E2M1 pairs with one E8M0 scale per row and 32 columns.
    pub fn mxfp4(packed: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(32) {
            return Err(KernelError::Shape {
                what: "mxfp4 weight",
                msg: format!("{cols} columns is not a multiple of 32"),
            });
        }
        check("mxfp4 weight", rows, cols, rows * cols / 2, packed.len())?;
        check("mxfp4 scales", rows, cols, rows * cols / 32, scales.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::Mxfp4 { packed, scales },
        })
    }

    /// E8P12: u16 codes `[rows, cols/8]` and f32 scales `[rows]` (little-endian bytes).
    pub fn e8p(codes: &'a [u8], scales: &'a [u8], rows: usize, cols: usize) -> Result<Self> {
        if !cols.is_multiple_of(8) {
            return Err(KernelError::Shape {
                what: "e8p weight",
                msg: format!("{cols} columns is not a multiple of 8"),
            });
        }
        check("e8p codes", rows, cols, rows * cols / 8 * 2, codes.len())?;
        check("e8p scales", rows, cols, rows * 4, scales.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::E8p {
                codes,
                scales,
                resid: None,
            },
        })
    }

    /// MLX affine (`mx.quantize(mode="affine", group_size=64)`): packed codes
    /// `[rows, cols·bits/8]` bytes and bf16 scales and biases `[rows, cols/64]` (little-endian
    /// bytes), `bits` ∈ {2, 3, 4, 8}.
    pub fn mlx_affine(
        bits: u32,
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        if !keep_format::mlx_affine::supported_bits(bits) {
            return Err(KernelError::Shape {
                what: "mlx affine weight",
                msg: format!("{bits}-bit codes (MLX affine weights are 2, 3, 4 or 8 bits)"),
            });
        }
        if !cols.is_multiple_of(MLX_AFFINE_GROUP) {
            return Err(KernelError::Shape {
                what: "mlx affine weight",
                msg: format!("{cols} columns is not a multiple of {MLX_AFFINE_GROUP}"),
            });
        }
        let ng = rows * cols / MLX_AFFINE_GROUP;
        check(
            "mlx affine codes",
            rows,
            cols,
            rows * cols * bits as usize / 8,
            q.len(),
        )?;
        check("mlx affine scales (bf16)", rows, cols, ng * 2, scales.len())?;
        check("mlx affine biases (bf16)", rows, cols, ng * 2, biases.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            },
        })
    }

    /// A weight in a registered format (keep-format's registry) from its computed parts, in
    /// the entry's order.
    pub fn registered(
        spec: &'static keep_format::registry::FormatSpec,
        parts: &[&'a [u8]],
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::Registered(crate::RegView::new(spec, parts, rows, cols)?),
        })
    }

    /// This E8P weight with a residual stage added.
    pub fn with_residual(self, r: E8pResidual<'a>) -> Result<Self> {
        let (rows, cols) = (self.rows, self.cols);
        let WeightKind::E8p { codes, scales, .. } = self.kind else {
            return Err(KernelError::Shape {
                what: "residual stage",
                msg: format!("a {} weight takes no residual", self.format_name()),
            });
        };
        check(
            "residual codes",
            rows,
            cols,
            rows * cols / 8 * r.code_bytes(),
            r.codes.len(),
        )?;
        check("residual scales", rows, cols, rows * 4, r.scales.len())?;
        Ok(WeightView {
            rows,
            cols,
            kind: WeightKind::E8p {
                codes,
                scales,
                resid: Some(r),
            },
        })
    }

    /// Rows `r0..r1` as a view of their own.
    pub fn slice_rows(&self, r0: usize, r1: usize) -> Result<Self> {
        if r0 > r1 || r1 > self.rows {
            return Err(KernelError::Shape {
                what: "row slice",
                msg: format!("{r0}..{r1} of {} rows", self.rows),
            });
        }
        let c = self.cols;
        let kind = match self.kind {
            WeightKind::F32(b) => WeightKind::F32(&b[r0 * c * 4..r1 * c * 4]),
            WeightKind::Bf16(b) => WeightKind::Bf16(&b[r0 * c * 2..r1 * c * 2]),
            WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } => WeightKind::Fp8Block {
                q: &q[r0 * c..r1 * c],
                scales,
                block_rows,
                block_cols,
                row0: row0 + r0,
            },
            WeightKind::Mxfp8 { q, scales } => WeightKind::Mxfp8 {
                q: &q[r0 * c..r1 * c],
                scales: &scales[r0 * c / 32..r1 * c / 32],
            },
            WeightKind::Mxfp4 { packed, scales } => WeightKind::Mxfp4 {
                packed: &packed[r0 * c / 2..r1 * c / 2],
                scales: &scales[r0 * c / 32..r1 * c / 32],
            },
            WeightKind::E8p {
                codes,
                scales,
                resid,
            } => WeightKind::E8p {
                codes: &codes[r0 * c / 4..r1 * c / 4],
                scales: &scales[r0 * 4..r1 * 4],
                resid: resid.map(|r| {
                    let b = r.code_bytes();
                    E8pResidual {
                        codes: &r.codes[r0 * c / 8 * b..r1 * c / 8 * b],
                        scales: &r.scales[r0 * 4..r1 * 4],
                        e81: r.e81,
                    }
                }),
            },
            WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            } => {
                let (pb, g) = (c * bits as usize / 8, c / MLX_AFFINE_GROUP * 2);
                WeightKind::MlxAffine {
                    bits,
                    q: &q[r0 * pb..r1 * pb],
                    scales: &scales[r0 * g..r1 * g],
                    biases: &biases[r0 * g..r1 * g],
                }
            }
            WeightKind::Registered(v) => WeightKind::Registered(v.slice_rows(c, r0, r1)),
        };
        Ok(WeightView {
            rows: r1 - r0,
            cols: c,
            kind,
        })
    }

    /// Bytes this view reads (elements and scales).
    pub fn nbytes(&self) -> usize {
        match self.kind {
            WeightKind::F32(b) | WeightKind::Bf16(b) => b.len(),
            WeightKind::Fp8Block { q, .. } => q.len(),
            WeightKind::Mxfp8 { q, scales } => q.len() + scales.len(),
            WeightKind::Mxfp4 { packed, scales } => packed.len() + scales.len(),
            WeightKind::E8p {
                codes,
                scales,
                resid,
            } => codes.len() + scales.len() + resid.map_or(0, |r| r.codes.len() + r.scales.len()),
            WeightKind::MlxAffine {
                q, scales, biases, ..
            } => q.len() + scales.len() + biases.len(),
            WeightKind::Registered(v) => v.nbytes(),
        }
    }

    /// A short name of the format, for reports and errors.
    pub fn format_name(&self) -> &'static str {
        match self.kind {
            WeightKind::F32(_) => "f32",
            WeightKind::Bf16(_) => "bf16",
            WeightKind::Fp8Block { .. } => "fp8-block",
            WeightKind::Mxfp8 { .. } => "mxfp8",
            WeightKind::Mxfp4 { .. } => "mxfp4",
            WeightKind::E8p { resid: None, .. } => "e8p2",
            WeightKind::E8p { resid: Some(r), .. } => {
                if r.e81 {
                    "e8p2+e81"
                } else {
                    "e8p2+e8p2"
                }
            }
            WeightKind::MlxAffine { bits, .. } => match bits {
                2 => "mlx-affine2",
                3 => "mlx-affine3",
                4 => "mlx-affine4",
                _ => "mlx-affine8",
            },
            WeightKind::Registered(v) => v.spec.name,
        }
    }

    /// Element `(r, c)`, decoded from the definition (the scalar reference).
    pub fn get_ref(&self, r: usize, c: usize) -> f32 {
        let cols = self.cols;
        match self.kind {
            WeightKind::F32(b) => f32_at(b, r * cols + c),
            WeightKind::Bf16(b) => bf16_at(b, r * cols + c),
            WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } => {
                let gc = cols.div_ceil(block_cols);
                let si = ((row0 + r) / block_rows) * gc + c / block_cols;
                let s = match scales {
                    BlockScales::E8m0(s) => e8m0_to_f32(s[si]),
                    BlockScales::F32(s) => f32_at(s, si),
                    BlockScales::Bf16(s) => crate::codec::bf16_at(s, si),
                };
                crate::codec::e4m3_to_f32_ref(q[r * cols + c]) * s
            }
            WeightKind::Mxfp8 { q, scales } => {
                crate::codec::e4m3_to_f32_ref(q[r * cols + c])
                    * e8m0_to_f32(scales[r * cols / 32 + c / 32])
            }
            WeightKind::Mxfp4 { packed, scales } => {
                let byte = packed[(r * cols + c) / 2];
                let nib = if c.is_multiple_of(2) {
                    byte & 0xF
                } else {
                    byte >> 4
                };
                E2M1[nib as usize] * e8m0_to_f32(scales[r * cols / 32 + c / 32])
            }
            WeightKind::E8p {
                codes,
                scales,
                resid,
            } => {
                let k = (r * cols + c) / 8;
                let code = u16::from_le_bytes([codes[2 * k], codes[2 * k + 1]]);
                let v = f32_at(scales, r) * decode_e8p_ref(code)[c % 8];
                match resid {
                    Some(rs) => v + f32_at(rs.scales, r) * rs.decode_ref(k)[c % 8],
                    None => v,
                }
            }
            WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            } => {
                let pb = cols * bits as usize / 8;
                let code = code_ref(&q[r * pb..(r + 1) * pb], bits, c);
                let gi = r * (cols / MLX_AFFINE_GROUP) + c / MLX_AFFINE_GROUP;
                let prod = bf16_at(scales, gi) * f32::from(code);
                prod + bf16_at(biases, gi)
            }
            WeightKind::Registered(v) => v.get_ref(r, c, cols),
        }
    }

    /// Decode row `r` into `dst[..cols]` (the fast path; equal to `get_ref` element by element).
    #[inline]
    pub fn decode_row(&self, r: usize, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::has_avx2() {
            // SAFETY: the CPU supports avx2 and fma (checked).
            unsafe { self.decode_row_avx2(r, dst) };
            return;
        }
        self.decode_row_impl(r, dst)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn decode_row_avx2(&self, r: usize, dst: &mut [f32]) {
        self.decode_row_impl(r, dst)
    }

    #[inline(always)]
    fn decode_row_impl(&self, r: usize, dst: &mut [f32]) {
        let cols = self.cols;
        let dst = &mut dst[..cols];
        match self.kind {
            WeightKind::F32(b) => {
                let row = &b[r * cols * 4..(r + 1) * cols * 4];
                for (d, ch) in dst.iter_mut().zip(row.chunks_exact(4)) {
                    *d = f32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
                }
            }
            WeightKind::Bf16(b) => {
                let row = &b[r * cols * 2..(r + 1) * cols * 2];
                for (d, ch) in dst.iter_mut().zip(row.chunks_exact(2)) {
                    *d = f32::from_bits((u16::from_le_bytes([ch[0], ch[1]]) as u32) << 16);
                }
            }
            WeightKind::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } => {
                let gc = cols.div_ceil(block_cols);
                let base = ((row0 + r) / block_rows) * gc;
                let row = &q[r * cols..(r + 1) * cols];
                for (g, (dch, qch)) in dst
                    .chunks_mut(block_cols)
                    .zip(row.chunks(block_cols))
                    .enumerate()
                {
                    let s = match scales {
                        BlockScales::E8m0(s) => e8m0_to_f32(s[base + g]),
                        BlockScales::F32(s) => f32_at(s, base + g),
                        BlockScales::Bf16(s) => crate::codec::bf16_at(s, base + g),
                    };
                    for (d, &b) in dch.iter_mut().zip(qch) {
                        *d = e4m3_bits(b) * s;
                    }
                }
            }
            WeightKind::Mxfp8 { q, scales } => {
                let row = &q[r * cols..(r + 1) * cols];
                let sc = &scales[r * cols / 32..(r + 1) * cols / 32];
                for ((dch, qch), &s) in dst.chunks_exact_mut(32).zip(row.chunks_exact(32)).zip(sc) {
                    let s = e8m0_to_f32(s);
                    for (d, &b) in dch.iter_mut().zip(qch) {
                        *d = e4m3_bits(b) * s;
                    }
                }
            }
            WeightKind::Mxfp4 { packed, scales } => {
                let row = &packed[r * cols / 2..(r + 1) * cols / 2];
                let sc = &scales[r * cols / 32..(r + 1) * cols / 32];
                for ((dch, pch), &s) in dst.chunks_exact_mut(32).zip(row.chunks_exact(16)).zip(sc) {
                    let s = e8m0_to_f32(s);
                    for (d2, &b) in dch.chunks_exact_mut(2).zip(pch) {
                        d2[0] = e2m1_bits(b & 0xF) * s;
                        d2[1] = e2m1_bits(b >> 4) * s;
                    }
                }
            }
            WeightKind::E8p {
                codes,
                scales,
                resid,
            } => {
                let kc = cols / 8;
                let s1 = f32_at(scales, r);
                for (g, d8) in dst.chunks_exact_mut(8).enumerate() {
                    let k = r * kc + g;
                    let q = decode_e8p(u16::from_le_bytes([codes[2 * k], codes[2 * k + 1]]));
                    match resid {
                        Some(rs) => {
                            let s2 = f32_at(rs.scales, r);
                            let q2 = rs.decode(k);
                            for i in 0..8 {
                                d8[i] = s1 * q[i] + s2 * q2[i];
                            }
                        }
                        None => {
                            for i in 0..8 {
                                d8[i] = s1 * q[i];
                            }
                        }
                    }
                }
            }
            WeightKind::MlxAffine {
                bits,
                q,
                scales,
                biases,
            } => {
                let pb = cols * bits as usize / 8;
                let gb = MLX_AFFINE_GROUP * bits as usize / 8;
                let ng = cols / MLX_AFFINE_GROUP;
                let row = &q[r * pb..(r + 1) * pb];
                let mut codes = [0u8; MLX_AFFINE_GROUP];
                for (g, (d, p)) in dst
                    .chunks_exact_mut(MLX_AFFINE_GROUP)
                    .zip(row.chunks_exact(gb))
                    .enumerate()
                {
                    unpack_unchecked(bits, p, &mut codes);
                    let (s, b) = (bf16_at(scales, r * ng + g), bf16_at(biases, r * ng + g));
                    for (o, &c) in d.iter_mut().zip(&codes) {
                        *o = s * f32::from(c) + b;
                    }
                }
            }
            WeightKind::Registered(v) => v.decode_row(r, cols, dst),
        }
    }
}
