//! FP8 E4M3FN tensors with 2-D block scales: DeepSeek V3 / V4 / V4.1 checkpoint weights.
//!
//! What it is: whole-tensor and row-at-a-time decoders (a `_ref` from the definition and a
//! fast path with the scale hoisted per block and table-lookup elements) for any block shape
//! `(br, bc)` (1x32 Engram tables, 32x32 V4.1, 128x128 V3/V4, or anything else) with tails,
//! three kinds of scale, the DeepSeek block encoder, the FP4 expert encoder, and the lossless
//! FP8-block → MXFP8 scale repack. What it is not: safetensors parsing or tensor naming
//! (`keep-checkpoint`), or a GEMV kernel (`keep-kernels`). Depends on [`crate::fp8`],
//! [`crate::e8m0`], [`crate::mx`] and [`crate::error`].
//!
//! # Layout
//! * `q`: `rows * cols` E4M3FN bytes, row-major.
//! * scales: a row-major grid of `ceil(rows/br) x ceil(cols/bc)` values; element `(i, j)`
//!   uses scale `(i / br, j / bc)`. Partial blocks at the bottom/right edges are allowed.
//!
//! # Decode
//! `w[i, j] = e4m3(q[i, j]) * s[i / br, j / bc]` as one `f32` multiply, where `s` is
//! * [`BlockScales::E8m0`]: `2^(byte - 127)` (V4/V4.1 `F8_E8M0`; byte `0xFF` decodes to NaN);
//! * [`BlockScales::F32Pow2`]: an `f32` that must be an exact positive power of two
//!   (V4-Flash-Base); anything else is refused with [`FormatError::NotPowerOfTwo`] / [`FormatError::NanScale`];
//! * [`BlockScales::F32ScaleInv`]: any `f32` multiplier (V3/R1 `weight_scale_inv`,
//!   `weight_dequant`'s `w = q * scale_inv`), used as is.

use crate::e8m0::{
    ceil_exponent, e8m0_from_pow2_f32, e8m0_to_f32, e8m0_to_f32_ref, DEEPSEEK_AMAX_FLOOR, E8M0_LUT,
    E8M0_NAN,
};
use crate::error::{check_aligned, check_len, mul, FormatError, Result};
use crate::fp8::{e4m3_to_f32_ref, f32_to_e4m3, E4M3_LUT, E4M3_MAX};
use crate::mx::{amax, quantize_mxfp4_row, MX_GROUP};

/// A block's shape in elements: `rows` x `cols`. Both must be at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockShape {
    /// Rows per block (`br`).
    pub rows: usize,
    /// Columns per block (`bc`).
    pub cols: usize,
}

impl BlockShape {
    /// `rows x cols`.
    pub const fn new(rows: usize, cols: usize) -> Self {
        BlockShape { rows, cols }
    }

    /// `n x n` (e.g. 128 for V3/V4, 32 for V4.1).
    pub const fn square(n: usize) -> Self {
        BlockShape { rows: n, cols: n }
    }

    /// The scale grid `(ceil(rows / br), ceil(cols / bc))` of a `rows x cols` tensor.
    pub fn grid(self, rows: usize, cols: usize) -> Result<(usize, usize)> {
        if self.rows == 0 || self.cols == 0 {
            return Err(FormatError::InvalidBlock {
                rows: self.rows,
                cols: self.cols,
            });
        }
        Ok((rows.div_ceil(self.rows), cols.div_ceil(self.cols)))
    }
}

/// The scale grid of a block-scaled FP8 tensor, by storage kind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BlockScales<'a> {
    /// E8M0 bytes (`F8_E8M0`): scale `2^(b - 127)`.
    E8m0(&'a [u8]),
    /// float32 scales that must be exact positive powers of two (V4-Flash-Base).
    F32Pow2(&'a [f32]),
    /// float32 multipliers used as is (V3/R1 `*_scale_inv`).
    F32ScaleInv(&'a [f32]),
}

impl BlockScales<'_> {
    /// Number of scales in the grid.
    pub fn len(&self) -> usize {
        match self {
            BlockScales::E8m0(s) => s.len(),
            BlockScales::F32Pow2(s) | BlockScales::F32ScaleInv(s) => s.len(),
        }
    }

    /// `true` when the grid is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Check the scales in `range` for the kinds that have a rule: `F32Pow2` must be exact
    /// positive powers of two. E8M0 `0xFF` (NaN) and `F32ScaleInv` values are not refused
    /// by decoding (they decode to NaN / are used as is).
    fn validate(&self, range: std::ops::Range<usize>) -> Result<()> {
        if let BlockScales::F32Pow2(s) = self {
            let start = range.start;
            for (k, &v) in s[range].iter().enumerate() {
                check_pow2(start + k, v)?;
            }
        }
        Ok(())
    }
}

/// `Ok` iff `v` is an exact positive power of two (any finite `f32` exponent, subnormal
/// powers included); `NanScale` for NaN, `NotPowerOfTwo` otherwise.
pub fn check_pow2(index: usize, v: f32) -> Result<()> {
    if v.is_nan() {
        return Err(FormatError::NanScale { index });
    }
    let bits = v.to_bits();
    let exp = bits >> 23; // sign bit makes negatives >= 256
    let frac = bits & 0x7F_FFFF;
    let ok = if exp == 0 {
        frac.is_power_of_two()
    } else {
        (1..=254).contains(&exp) && frac == 0
    };
    if ok {
        Ok(())
    } else {
        Err(FormatError::NotPowerOfTwo { index, value: v })
    }
}

/// Validate lengths; returns the scale grid `(scale_rows, scale_cols)`.
fn check_tensor(
    q: usize,
    dst: usize,
    rows: usize,
    cols: usize,
    block: BlockShape,
    scales: usize,
) -> Result<(usize, usize)> {
    let (sr, sc) = block.grid(rows, cols)?;
    let n = mul("fp8 block tensor", rows, cols)?;
    check_len("fp8 block elements", n, q)?;
    check_len("fp8 block output", n, dst)?;
    check_len(
        "fp8 block scales",
        mul("fp8 block scale grid", sr, sc)?,
        scales,
    )?;
    Ok((sr, sc))
}

/// Reference decode of a whole `rows x cols` tensor, element by element from the definition.
pub fn decode_fp8_block_ref(
    q: &[u8],
    rows: usize,
    cols: usize,
    block: BlockShape,
    scales: BlockScales,
    dst: &mut [f32],
) -> Result<()> {
    let (_, sc) = check_tensor(q.len(), dst.len(), rows, cols, block, scales.len())?;
    scales.validate(0..scales.len())?;
    for i in 0..rows {
        for j in 0..cols {
            let k = (i / block.rows) * sc + j / block.cols;
            let s = match scales {
                BlockScales::E8m0(s) => e8m0_to_f32_ref(s[k]),
                BlockScales::F32Pow2(s) | BlockScales::F32ScaleInv(s) => s[k],
            };
            dst[i * cols + j] = e4m3_to_f32_ref(q[i * cols + j]) * s;
        }
    }
    Ok(())
}

/// One row, scale looked up per column block by `scale_of(block_col)`.
#[inline(always)]
fn row_with(q_row: &[u8], bc: usize, dst_row: &mut [f32], scale_of: impl Fn(usize) -> f32) {
    for (jb, (qc, dc)) in q_row.chunks(bc).zip(dst_row.chunks_mut(bc)).enumerate() {
        let s = scale_of(jb);
        for (o, &c) in dc.iter_mut().zip(qc) {
            *o = E4M3_LUT[c as usize] * s;
        }
    }
}

/// Decode one row given its scale row (already validated).
#[inline]
fn decode_row_unchecked(q_row: &[u8], bc: usize, srow: BlockScales, dst_row: &mut [f32]) {
    match srow {
        BlockScales::E8m0(s) => row_with(q_row, bc, dst_row, |jb| E8M0_LUT[s[jb] as usize]),
        BlockScales::F32Pow2(s) | BlockScales::F32ScaleInv(s) => {
            row_with(q_row, bc, dst_row, |jb| s[jb])
        }
    }
}

/// The `sc` scales of scale row `r`.
fn scale_row<'a>(scales: BlockScales<'a>, r: usize, sc: usize) -> BlockScales<'a> {
    let range = r * sc..(r + 1) * sc;
    match scales {
        BlockScales::E8m0(s) => BlockScales::E8m0(&s[range]),
        BlockScales::F32Pow2(s) => BlockScales::F32Pow2(&s[range]),
        BlockScales::F32ScaleInv(s) => BlockScales::F32ScaleInv(&s[range]),
    }
}

/// Fast decode of a whole tensor; bit-identical to [`decode_fp8_block_ref`] (same errors too).
pub fn decode_fp8_block(
    q: &[u8],
    rows: usize,
    cols: usize,
    block: BlockShape,
    scales: BlockScales,
    dst: &mut [f32],
) -> Result<()> {
    let (_, sc) = check_tensor(q.len(), dst.len(), rows, cols, block, scales.len())?;
    scales.validate(0..scales.len())?;
    if cols == 0 {
        return Ok(());
    }
    for (i, (qr, dr)) in q
        .chunks_exact(cols)
        .zip(dst.chunks_exact_mut(cols))
        .enumerate()
    {
        decode_row_unchecked(qr, block.cols, scale_row(scales, i / block.rows, sc), dr);
    }
    Ok(())
}

/// Decode row `row_index` of a block-scaled tensor with `cols` columns, for kernels that
/// work a row at a time. `scales` is the whole grid (`ceil(rows/br) x ceil(cols/bc)`); its
/// length must be a multiple of `ceil(cols/bc)` and have a scale row for `row_index / br`.
/// Only that scale row is validated (for `F32Pow2`); errors name flat scale indices.
pub fn decode_fp8_block_row(
    q_row: &[u8],
    row_index: usize,
    cols: usize,
    block: BlockShape,
    scales: BlockScales,
    dst_row: &mut [f32],
) -> Result<()> {
    let (_, sc) = block.grid(1, cols)?;
    check_len("fp8 block row elements", cols, q_row.len())?;
    check_len("fp8 block row output", cols, dst_row.len())?;
    if cols == 0 {
        return Ok(());
    }
    let n = scales.len();
    if !n.is_multiple_of(sc) {
        return Err(FormatError::LengthMismatch {
            what: "fp8 block scales (a multiple of the scale columns)",
            expected: n.div_ceil(sc) * sc,
            got: n,
        });
    }
    let scale_rows = n / sc;
    let r = row_index / block.rows;
    if r >= scale_rows {
        return Err(FormatError::RowOutOfRange {
            row: row_index,
            scale_row: r,
            scale_rows,
        });
    }
    scales.validate(r * sc..(r + 1) * sc)?;
    decode_row_unchecked(q_row, block.cols, scale_row(scales, r, sc), dst_row);
    Ok(())
}

/// Encode a `rows x cols` f32 tensor as E4M3FN with E8M0 block scales, DeepSeek's rule:
/// per block `amax = max(max |w|, DEEPSEEK_AMAX_FLOOR)` (NaN ignored), scale byte
/// `b = ceil_exponent(amax, 448)` (i.e. scale `2^ceil(log2(amax / 448))`), element
/// `f32_to_e4m3(w / scale)` (nearest-even, saturating at ±448 = clamp-before-cast).
/// Returns `(q [rows*cols], scales [ceil(rows/br) * ceil(cols/bc)])`.
pub fn encode_fp8_block(
    w: &[f32],
    rows: usize,
    cols: usize,
    block: BlockShape,
) -> Result<(Vec<u8>, Vec<u8>)> {
    let (sr, sc) = block.grid(rows, cols)?;
    let n = mul("fp8 block tensor", rows, cols)?;
    check_len("fp8 block input", n, w.len())?;
    let mut q = vec![0u8; n];
    let mut scales = vec![0u8; mul("fp8 block scale grid", sr, sc)?];
    for bi in 0..sr {
        let r0 = bi * block.rows;
        let r1 = (r0 + block.rows).min(rows);
        for bj in 0..sc {
            let c0 = bj * block.cols;
            let c1 = (c0 + block.cols).min(cols);
            let a = (r0..r1)
                .map(|i| amax(&w[i * cols + c0..i * cols + c1]))
                .fold(DEEPSEEK_AMAX_FLOOR, f32::max);
            let b = ceil_exponent(a, E4M3_MAX);
            let scale = e8m0_to_f32(b);
            scales[bi * sc + bj] = b;
            for i in r0..r1 {
                for j in c0..c1 {
                    q[i * cols + j] = f32_to_e4m3(w[i * cols + j] / scale);
                }
            }
        }
    }
    Ok((q, scales))
}

/// Encode routed-expert weights `[rows, cols]` as DeepSeek FP4: exactly
/// [`crate::mx::quantize_mxfp4_row`] per row (ceil shared exponent per 32 columns, no amax
/// floor, nearest-even E2M1). Returns `(packed [rows * cols/2], scales [rows * cols/32])`.
/// Needs `cols % 32 == 0`.
pub fn encode_fp4_experts(w: &[f32], rows: usize, cols: usize) -> Result<(Vec<u8>, Vec<u8>)> {
    check_aligned("fp4 experts", cols, MX_GROUP)?;
    check_len(
        "fp4 experts input",
        mul("fp4 experts tensor", rows, cols)?,
        w.len(),
    )?;
    let mut packed = vec![0u8; rows * (cols / 2)];
    let mut scales = vec![0u8; rows * (cols / MX_GROUP)];
    if cols == 0 {
        return Ok((packed, scales));
    }
    for ((wr, pr), sr) in w
        .chunks_exact(cols)
        .zip(packed.chunks_exact_mut(cols / 2))
        .zip(scales.chunks_exact_mut(cols / MX_GROUP))
    {
        quantize_mxfp4_row(wr, pr, sr)?;
    }
    Ok((packed, scales))
}

/// The lossless FP8-block → MXFP8 repack of the scales: for row `i` and 32-group `g`, the
/// MX scale byte is the block scale `s[i / br, 32g / bc]` as E8M0. Returns `[rows * cols/32]`
/// bytes; the element bytes are reused unchanged.
///
/// Refuses (never rounds): `cols % 32 != 0` or `bc % 32 != 0` (a group would straddle two
/// blocks) → [`FormatError::Unaligned`]; an E8M0 `0xFF` or NaN float scale →
/// [`FormatError::NanScale`]; a float scale that is not exactly `2^k` for `k` in `-127..=127`
/// → [`FormatError::NotPowerOfTwo`] (this applies to `F32ScaleInv` too, which V3 checkpoints
/// generally fail).
pub fn repack_scales_to_mx(
    rows: usize,
    cols: usize,
    block: BlockShape,
    scales: BlockScales,
) -> Result<Vec<u8>> {
    let (sr, sc) = block.grid(rows, cols)?;
    check_aligned("mxfp8 repack columns", cols, MX_GROUP)?;
    check_aligned("fp8 block columns for mxfp8 repack", block.cols, MX_GROUP)?;
    check_len(
        "fp8 block scales",
        mul("fp8 block scale grid", sr, sc)?,
        scales.len(),
    )?;
    let bytes: Vec<u8> = match scales {
        BlockScales::E8m0(s) => {
            if let Some(index) = s.iter().position(|&b| b == E8M0_NAN) {
                return Err(FormatError::NanScale { index });
            }
            s.to_vec()
        }
        BlockScales::F32Pow2(s) | BlockScales::F32ScaleInv(s) => s
            .iter()
            .enumerate()
            .map(|(index, &v)| {
                e8m0_from_pow2_f32(v).ok_or(if v.is_nan() {
                    FormatError::NanScale { index }
                } else {
                    FormatError::NotPowerOfTwo { index, value: v }
                })
            })
            .collect::<Result<_>>()?,
    };
    let groups = cols / MX_GROUP;
    let mut out = vec![0u8; mul("mxfp8 scales", rows, groups)?];
    if groups == 0 {
        return Ok(out);
    }
    for (i, orow) in out.chunks_exact_mut(groups).enumerate() {
        let srow = &bytes[(i / block.rows) * sc..(i / block.rows + 1) * sc];
        for (g, o) in orow.iter_mut().enumerate() {
            *o = srow[(g * MX_GROUP) / block.cols];
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mx::decode_mxfp8_row;
    use crate::testutil::same;

    /// 32 bits of keep-rng's generator.
    fn draw32(r: &mut keep_rng::Rng) -> u32 {
        keep_rng::RngCore::next_u32(r)
    }

    const BLOCKS: [(usize, usize); 5] = [(1, 32), (32, 32), (128, 128), (3, 5), (7, 1)];
    const COLS: [usize; 7] = [1, 5, 31, 33, 64, 130, 257];

    #[test]
    fn ref_vs_fast_odd_shapes_all_scale_kinds() {
        let mut seed = keep_rng::rng(1);
        let mut cases = 0;
        for rows in (1..=70).step_by(3).chain([64, 128, 129]) {
            for &cols in &COLS {
                for &(br, bc) in &BLOCKS {
                    let block = BlockShape::new(br, bc);
                    let (sr, sc) = block.grid(rows, cols).unwrap();
                    let q: Vec<u8> = (0..rows * cols).map(|_| draw32(&mut seed) as u8).collect();
                    let e8: Vec<u8> = (0..sr * sc).map(|_| draw32(&mut seed) as u8).collect();
                    let p2: Vec<f32> = (0..sr * sc)
                        .map(|_| crate::minifloat::pow2((draw32(&mut seed) % 277) as i32 - 149))
                        .collect();
                    let inv: Vec<f32> = (0..sr * sc)
                        .map(|_| f32::from_bits(draw32(&mut seed)))
                        .collect();
                    for scales in [
                        BlockScales::E8m0(&e8),
                        BlockScales::F32Pow2(&p2),
                        BlockScales::F32ScaleInv(&inv),
                    ] {
                        let mut a = vec![0.0; rows * cols];
                        let mut b = vec![1.0; rows * cols];
                        decode_fp8_block_ref(&q, rows, cols, block, scales, &mut a).unwrap();
                        decode_fp8_block(&q, rows, cols, block, scales, &mut b).unwrap();
                        assert!(
                            a.iter().zip(&b).all(|(x, y)| same(*x, *y)),
                            "{rows}x{cols} block {br}x{bc} {scales:?}"
                        );
                        for i in 0..rows {
                            let mut r = vec![2.0; cols];
                            let qr = &q[i * cols..(i + 1) * cols];
                            decode_fp8_block_row(qr, i, cols, block, scales, &mut r).unwrap();
                            assert!(r.iter().zip(&a[i * cols..]).all(|(x, y)| same(*x, *y)));
                        }
                        cases += 1;
                    }
                }
            }
        }
        assert!(cases > 2000);
    }

    #[test]
    fn known_values() {
        // 2x3 tensor, 1x2 blocks: scales grid 2x2
        let q = [0x38u8, 0x40, 0x7E, 0xB8, 0x01, 0x80];
        let block = BlockShape::new(1, 2);
        let mut d = [0.0; 6];
        decode_fp8_block(
            &q,
            2,
            3,
            block,
            BlockScales::E8m0(&[0x7F, 0x80, 0x7E, 0x00]),
            &mut d,
        )
        .unwrap();
        assert_eq!(d[..5], [1.0, 2.0, 896.0, -0.5, 2f32.powi(-10)]);
        assert_eq!(d[5].to_bits(), 0x8000_0000);
        decode_fp8_block(
            &q,
            2,
            3,
            block,
            BlockScales::F32ScaleInv(&[0.1, 3.0, 1.0, 1.0]),
            &mut d,
        )
        .unwrap();
        assert_eq!(d[..3], [0.1, 2.0 * 0.1, 448.0 * 3.0]);
    }

    #[test]
    fn errors_not_panics() {
        let q = [0u8; 12];
        let mut d = [0.0; 12];
        let b = BlockShape::new(2, 2);
        let e8 = [0x7Fu8; 4]; // grid 2x2
        assert!(matches!(
            decode_fp8_block(
                &q,
                3,
                4,
                BlockShape::new(0, 2),
                BlockScales::E8m0(&e8),
                &mut d
            ),
            Err(FormatError::InvalidBlock { .. })
        ));
        assert!(matches!(
            decode_fp8_block(&q, 3, 4, b, BlockScales::E8m0(&e8[..3]), &mut d),
            Err(FormatError::LengthMismatch {
                what: "fp8 block scales",
                expected: 4,
                got: 3
            })
        ));
        assert!(decode_fp8_block_ref(&q[1..], 3, 4, b, BlockScales::E8m0(&e8), &mut d).is_err());
        assert!(decode_fp8_block(&q, 3, 4, b, BlockScales::E8m0(&e8), &mut d[1..]).is_err());
        assert!(matches!(
            decode_fp8_block(
                &q,
                usize::MAX,
                2,
                BlockShape::new(usize::MAX, 2),
                BlockScales::E8m0(&e8),
                &mut d
            ),
            Err(FormatError::Overflow { .. })
        ));
        let mut p2 = [1.0f32, 0.5, 2.0, 3.0];
        assert_eq!(
            decode_fp8_block(&q, 3, 4, b, BlockScales::F32Pow2(&p2), &mut d),
            Err(FormatError::NotPowerOfTwo {
                index: 3,
                value: 3.0
            })
        );
        assert_eq!(
            decode_fp8_block_ref(&q, 3, 4, b, BlockScales::F32Pow2(&p2), &mut d),
            Err(FormatError::NotPowerOfTwo {
                index: 3,
                value: 3.0
            })
        );
        // the row API validates only the scale row it uses
        let mut r = [0.0; 4];
        assert!(decode_fp8_block_row(&q[..4], 0, 4, b, BlockScales::F32Pow2(&p2), &mut r).is_ok());
        assert!(decode_fp8_block_row(&q[..4], 2, 4, b, BlockScales::F32Pow2(&p2), &mut r).is_err());
        p2[0] = f32::NAN;
        assert_eq!(
            decode_fp8_block(&q, 3, 4, b, BlockScales::F32Pow2(&p2), &mut d),
            Err(FormatError::NanScale { index: 0 })
        );
        for bad in [-1.0f32, 0.0, f32::INFINITY, 1.5, f32::from_bits(3)] {
            assert!(check_pow2(0, bad).is_err(), "{bad:e}");
        }
        for good in [1.0f32, 2f32.powi(-149), 2f32.powi(-127), 2f32.powi(127)] {
            assert!(check_pow2(0, good).is_ok(), "{good:e}");
        }
        assert!(matches!(
            decode_fp8_block_row(&q[..4], 4, 4, b, BlockScales::E8m0(&e8), &mut r),
            Err(FormatError::RowOutOfRange {
                row: 4,
                scale_row: 2,
                scale_rows: 2
            })
        ));
        assert!(
            decode_fp8_block_row(&q[..4], 0, 4, b, BlockScales::E8m0(&e8[..3]), &mut r).is_err()
        );
        assert!(decode_fp8_block_row(&q[..3], 0, 4, b, BlockScales::E8m0(&e8), &mut r).is_err());
        assert!(encode_fp8_block(&[0.0; 5], 2, 3, b).is_err());
        assert!(encode_fp8_block(&[0.0; 6], 2, 3, BlockShape::new(1, 0)).is_err());
        assert!(encode_fp4_experts(&[0.0; 48], 1, 48).is_err());
        assert!(encode_fp4_experts(&[0.0; 63], 2, 32).is_err());
        // empty tensors are fine
        assert!(decode_fp8_block(&[], 0, 0, b, BlockScales::E8m0(&[]), &mut []).is_ok());
        assert!(decode_fp8_block(&[], 0, 5, b, BlockScales::E8m0(&[]), &mut []).is_ok());
    }

    #[test]
    fn encode_decode_error_bounds_and_floor() {
        let mut seed = keep_rng::rng(3);
        for &(rows, cols) in &[(1usize, 1usize), (5, 7), (33, 65), (130, 40)] {
            for &(br, bc) in &BLOCKS {
                let block = BlockShape::new(br, bc);
                let w: Vec<f32> = (0..rows * cols)
                    .map(|_| {
                        let r = draw32(&mut seed);
                        ((r >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
                            * 2f32.powi((r % 40) as i32 - 20)
                    })
                    .collect();
                let (q, s) = encode_fp8_block(&w, rows, cols, block).unwrap();
                let mut d = vec![0.0; rows * cols];
                decode_fp8_block(&q, rows, cols, block, BlockScales::E8m0(&s), &mut d).unwrap();
                let (_, sc) = block.grid(rows, cols).unwrap();
                for i in 0..rows {
                    for j in 0..cols {
                        let scale = e8m0_to_f32(s[(i / br) * sc + j / bc]);
                        let x = w[i * cols + j];
                        let bound = (x.abs() / 16.0).max(scale * 2f32.powi(-10));
                        assert!((x - d[i * cols + j]).abs() <= bound);
                        assert!(x.abs() / scale <= 448.0);
                    }
                }
            }
        }
        // all-zero block: floored amax gives a small finite scale
        let (q, s) = encode_fp8_block(&[0.0; 4], 2, 2, BlockShape::square(2)).unwrap();
        assert_eq!(q, [0; 4]);
        assert_eq!(s, [ceil_exponent(DEEPSEEK_AMAX_FLOOR, 448.0)]);
    }

    #[test]
    fn encode_of_decode_is_byte_identical() {
        let mut seed = keep_rng::rng(11);
        let (rows, cols, block) = (70usize, 100usize, BlockShape::new(32, 32));
        let (sr, sc) = block.grid(rows, cols).unwrap();
        let mut q: Vec<u8> = (0..rows * cols)
            .map(|_| {
                let c = draw32(&mut seed) as u8;
                if c & 0x7F == 0x7F {
                    0x80
                } else {
                    c
                }
            })
            .collect();
        // make every block's amax code 448 so the scale is recovered exactly
        for bi in 0..sr {
            for bj in 0..sc {
                q[bi * 32 * cols + bj * 32] = 0xFE;
            }
        }
        let s: Vec<u8> = (0..sr * sc)
            .map(|_| 110 + (draw32(&mut seed) % 100) as u8)
            .collect();
        let mut d = vec![0.0; rows * cols];
        decode_fp8_block(&q, rows, cols, block, BlockScales::E8m0(&s), &mut d).unwrap();
        let (q2, s2) = encode_fp8_block(&d, rows, cols, block).unwrap();
        assert_eq!(s2, s);
        assert_eq!(q2, q);
    }

    #[test]
    fn fp4_experts_equal_mxfp4_rows() {
        let w: Vec<f32> = (0..3 * 64).map(|i| (i as f32 - 90.0) * 0.37).collect();
        let (p, s) = encode_fp4_experts(&w, 3, 64).unwrap();
        assert_eq!((p.len(), s.len()), (96, 6));
        for i in 0..3 {
            let (mut pr, mut sr) = ([0u8; 32], [0u8; 2]);
            quantize_mxfp4_row(&w[i * 64..(i + 1) * 64], &mut pr, &mut sr).unwrap();
            assert_eq!(&p[i * 32..(i + 1) * 32], &pr);
            assert_eq!(&s[i * 2..(i + 1) * 2], &sr);
        }
    }

    #[test]
    fn repack_to_mxfp8_is_bit_exact() {
        let mut seed = keep_rng::rng(5);
        for &(rows, cols, b) in &[
            (70usize, 96usize, 32usize),
            (130, 256, 128),
            (5, 160, 64),
            (33, 32, 32),
        ] {
            let block = BlockShape::square(b);
            let (sr, sc) = block.grid(rows, cols).unwrap();
            let q: Vec<u8> = (0..rows * cols).map(|_| draw32(&mut seed) as u8).collect();
            let e8: Vec<u8> = (0..sr * sc)
                .map(|_| (draw32(&mut seed) % 255) as u8)
                .collect();
            let p2: Vec<f32> = e8.iter().map(|&x| e8m0_to_f32(x)).collect();
            let mut full = vec![0.0; rows * cols];
            decode_fp8_block(&q, rows, cols, block, BlockScales::E8m0(&e8), &mut full).unwrap();
            for scales in [
                BlockScales::E8m0(&e8),
                BlockScales::F32Pow2(&p2),
                BlockScales::F32ScaleInv(&p2),
            ] {
                let mx = repack_scales_to_mx(rows, cols, block, scales).unwrap();
                assert_eq!(mx.len(), rows * cols / 32);
                let mut row = vec![0.0; cols];
                for i in 0..rows {
                    decode_mxfp8_row(
                        &q[i * cols..(i + 1) * cols],
                        &mx[i * cols / 32..(i + 1) * cols / 32],
                        &mut row,
                    )
                    .unwrap();
                    assert!(row.iter().zip(&full[i * cols..]).all(|(x, y)| same(*x, *y)));
                }
            }
        }
        let b = BlockShape::square(32);
        assert_eq!(
            repack_scales_to_mx(32, 64, b, BlockScales::E8m0(&[1, 255])),
            Err(FormatError::NanScale { index: 1 })
        );
        assert_eq!(
            repack_scales_to_mx(32, 64, b, BlockScales::F32ScaleInv(&[1.0, 0.3])),
            Err(FormatError::NotPowerOfTwo {
                index: 1,
                value: 0.3
            })
        );
        assert!(
            repack_scales_to_mx(32, 64, b, BlockScales::F32Pow2(&[1.0, 2f32.powi(-128)])).is_err()
        );
        assert!(repack_scales_to_mx(32, 64, b, BlockScales::F32Pow2(&[1.0, f32::NAN])).is_err());
        assert!(matches!(
            repack_scales_to_mx(32, 48, b, BlockScales::E8m0(&[1, 1])),
            Err(FormatError::Unaligned { .. })
        ));
        assert!(matches!(
            repack_scales_to_mx(32, 64, BlockShape::new(32, 16), BlockScales::E8m0(&[1; 4])),
            Err(FormatError::Unaligned { .. })
        ));
    }
}
