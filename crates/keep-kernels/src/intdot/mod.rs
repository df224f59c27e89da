//! Integer dot products ("fast" kernels): each activation row is quantized once per call to
//! int8 blocks of 32 with one f32 scale per block ([`Q8Acts`]), each packed weight is decoded
//! to small integers (never to f32), and the two are multiplied as int8 × int8 with exact i32
//! sums, as llama.cpp's CPU backend does (`maddubs` on AVX2, `vpdpbusd` on AVX-512 VNNI,
//! `sdot` on aarch64 with the dot-product extension). Only the per-block sums meet floating
//! point. This is an approximation of the exact product (the activation rounding, about 2^-8
//! of a block's largest value); its cost is measured by `keep eval --kernels fast`, not
//! assumed.
//!
//! Formats ([`IntSrc`]) and their integer weights:
//! - MXFP4 (packed E2M1 + E8M0 per 32): `2·e2m1` is an integer in [−12, 12]; the block's
//!   weight factor is `2^(e−128)` (exact: `w = 2·e2m1 · 2^(e−128)`).
//! - E8P (one 16-bit code per 8 weights, one f32 scale per row): `4·codeword` is an integer in
//!   [−11, 11] (pattern × 4, signs, ±1 for the ¼ shift), looked up in a 65,536-entry table of
//!   8 int8 each (512 KiB, built once from `keep_format::e8p::decode_e8p`) on the scalar and
//!   AVX2 levels; the AVX-512 levels decode eight codes at a time in registers instead (the
//!   base patterns gathered from a 2 KiB table, the sign bytes as one 64-bit mask with the
//!   parity fix, one masked negate and a ±1 add) and hand the row to the kernels as `w + 128`
//!   bytes, the form affine-8 rows are stored in (so VNNI multiplies them as they lie); the
//!   block factor is 1 and the row's result is multiplied by `scale / 4` at the end. With
//!   AVX-512 VBMI ([`IntLevel::Avx512VnniVbmi`]) 64 codes are decoded per step without a
//!   gather, from byte planes of the pattern table held in registers ([`E8pPlanes`]), and at
//!   M = 1 fed to the dot without the row buffer; from [`E8P_GEMM_MIN_M`] rows on, E8P
//!   weights take the GEMM (Prefill below).
//! - E81 (one byte per 8 weights, one f32 scale per row; the residual stage of `e8p2+e81`,
//!   `w = scale · E81_GRID[code] / 2`): the grid entry itself (half-units) is an integer in
//!   [−4, 4], looked up in a 256-entry table of 8 int8 ([`E81_I8`], 2 KiB, built at compile
//!   time from `keep_format::e81::E81_GRID`): into a row buffer as int8 (scalar, AVX2, NEON,
//!   the GEMM's panel) or as `w + 128` bytes (the AVX-512 row kernels, which then take it as
//!   an affine-8 row, as E8P's); with AVX-512 VBMI the row kernels decode 64 codes per step
//!   without a table load per code, from nibble planes of the grid held in registers
//!   ([`E81_PLANES`]); the block factor is 1 and the row's
//!   result is multiplied by `scale / 2`. From [`E8P_GEMM_MIN_M`] rows on it takes the GEMM,
//!   as E8P does.
//! - affine-8 (MLX `mode="affine", bits=8, group_size=64`: `w = s·q + b`, `q` a byte, bf16
//!   `s` and `b` per 64 columns): the integer weight is `q − 128` in [−128, 127] and the block
//!   factor `s`; the rest, `(128·s + b) · Σx`, is the bias term of step 5 (`128·s + b` is
//!   rounded to f32 once: the only rounding beyond the activations').
//! - affine-4 (MLX `mode="affine", bits=4, group_size=64`, the mlx-community 4-bit files:
//!   `w = s·q + b`, `q` a nibble in [0, 15], element `j` of each little-endian u32 word at bits
//!   `4j..4j+4`, so byte `k` of a row holds elements `2k` (low nibble) and `2k+1`): the
//!   integer weight is `q` itself (an unsigned byte, so `vpdpbusd` / `vpmaddubsw` take it
//!   as it is, no sign trick) and the block factor `s`; the rest, `b · Σx`, is the bias term
//!   of step 5 with `β_b = b_g` (no rounding beyond the activations'). The kernels are in
//!   `affine4` (scalar dispatch) and `affine4_x86` (nibbles widened in registers).
//!
//! # The contract (what every level computes, bit for bit)
//! For input row `i` and weight row `r`, with integer weights `w`, int8 activations `q` and
//! block scales `d` (both from [`Q8Acts`]), block factor `f_b` and coefficient
//! `c_b = f_b · d_b` (one f32 multiply):
//! 1. `p[b][g] = Σ_{e<4} w[32b+4g+e] · q[32b+4g+e]` for `g` in 0..8 (exact i32);
//! 2. `acc[b mod 4][g] = fma(c_b, p[b][g] as f32, acc[b mod 4][g])`, blocks in order;
//! 3. `u[g] = (acc[0][g] + acc[2][g]) + (acc[1][g] + acc[3][g])`;
//! 4. `s = ((u0+u4) + (u2+u6)) + ((u1+u5) + (u3+u7))`, then `s · post` where the format has a
//!    row factor (E8P: `scale · 0.25`, E81: `scale · 0.5`, exact);
//! 5. affine-8 and affine-4 only: with `β_b = 128·s_g + b_g` (affine-4: `β_b = b_g`) for the group `g` holding block `b` and
//!    `e_b = d_b · S_b` (`S_b` the exact sum of block `b`'s int8 activations; one f32
//!    multiply, `Q8Acts::ds`), sixteen lanes `L[b mod 16] = fma(β_b, e_b, L[b mod 16])` over
//!    the blocks in order from zero, then `v[j] = L[j] + L[j+8]`, `β = ((v0+v4) + (v2+v6)) +
//!    ((v1+v5) + (v3+v7))`, and the result is `s + β` ([`bias_term_ref`]; one 512-bit FMA per
//!    16 blocks on the AVX-512 levels).
//!
//! [`dot_blocks_ref`] and [`finish_ref`] are that contract in plain Rust (the scalar level, and
//! the reference the SIMD levels are tested against on every forced level and odd shapes); a
//! SIMD level hands any blocks past its last whole group to them. Results therefore do not
//! depend on M, on the threading or on the level, so decode equals prefill bit for bit in this
//! mode too.
//!
//! # Prefill
//! From [`GEMM_MIN_M`] activation rows on (E8P from [`E8P_GEMM_MIN_M`], affine-8 from
//! [`AFFINE8_GEMM_MIN_M`]), the AVX-512 VNNI level runs a cache-blocked GEMM
//! (`gemm_x86`) on the same contract: a panel of [`GEMM_PANEL`] weight rows is decoded to int8
//! once and reused by every activation row from L1/L2, and a register tile of activation rows
//! × weight rows shares each loaded vector (activations offset to unsigned bytes, `q + 128`,
//! so `vpdpbusd` needs no sign trick; the offset's `128·Σw` is subtracted exactly as the
//! starting value of the integer sum). Every (input row, weight row) result is the same bits
//! as the row kernels'.

use std::sync::LazyLock;

use keep_format::e81::{E81_DIM, E81_GRID};
use keep_format::e8p::{decode_e8p, E8P_DIM};

use crate::affine::AFFINE8_GROUP;
use crate::codec::bf16_at;
use crate::cpu::check_operands;
use crate::e8p::E8pView;
use crate::rows::{prepare_per_input, run_row_jobs, Books, SyncPtr};
use crate::weight::{WeightKind, WeightView};
use crate::{KernelError, Result};

mod affine4;
#[cfg(target_arch = "x86_64")]
mod affine4_x86;
#[cfg(target_arch = "x86_64")]
mod gemm_x86;
#[cfg(target_arch = "aarch64")]
mod neon;
mod nibbles;
#[cfg(target_arch = "x86_64")]
mod x86;

/// From this many activation rows on, the AVX-512 VNNI level runs the cache-blocked GEMM
/// (the same results as the row kernels; see the module doc's Prefill section).
pub const GEMM_MIN_M: usize = 33;

/// From this many activation rows on, E8P weights (and E81 residual stages, decoded the same
/// way into a row buffer) take the GEMM on the AVX-512 VNNI levels
/// (measured faster than the row kernels from here: the row kernel streams every
/// activation row's int8, `−128·Σ` and scale arrays past each weight row, the GEMM's
/// register tile keeps four of them per panel in L1).
pub const E8P_GEMM_MIN_M: usize = 4;

/// From this many activation rows on, affine-8 weights (and MLX affine 8-bit, the same bytes)
/// take the GEMM on the AVX-512 VNNI levels (measured faster than the row kernels from here
/// on an Intel Xeon, `dev/evidence/matmul-affine8-gemm-from-3-rows.json`; the MXFP4 and MLX
/// affine-4 row kernels, which decode in registers, stay ahead of the GEMM up to 32 rows).
pub const AFFINE8_GEMM_MIN_M: usize = 3;

/// Weight rows per GEMM panel (decoded once, reused by every activation row).
pub const GEMM_PANEL: usize = 16;

/// Activation values per quantization block (one f32 scale each).
pub const QBLOCK: usize = 32;

/// Largest int8 magnitude an activation is quantized to (symmetric, so negating is safe).
pub const QMAX: f32 = 127.0;

/// Activation rows quantized to int8 blocks: `q` is `m × cols` int8, `d` is `m × cols/32`
/// block scales (`x ≈ q · d`), `sums` the `m × cols/32` exact block sums of `q` and `ds` the
/// products `d · sums` (one f32 multiply each; both for the affine-8 bias term), `dx` the
/// block scales spread over the lanes (E8P's coefficients), and `nsum4`
/// the `m × cols/4` values `−128 · Σ` of every four int8 (the start of the VNNI level's
/// affine-8 sums, which multiply the stored bytes `q` as unsigned).
#[derive(Debug, Clone, Default)]
pub struct Q8Acts {
    pub m: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub sums: Vec<i32>,
    pub ds: Vec<f32>,
    pub nsum4: Vec<i32>,
    /// `m × cols/4`: every block scale `d_b` eight times (entry `8b + g`), the coefficients
    /// of a weight whose block factors are 1 (E8P, E81) laid out as the SIMD lanes use them.
    pub dx: Vec<f32>,
    /// `m × cols` below [`GEMM_MIN_M`] rows (empty from there on, where the GEMM runs): each
    /// row of `q` in the order the MXFP4 row kernels read it ([`mx4_order`]): per group of
    /// four blocks, the first 16 values of each block, then the last 16 of each; a last
    /// incomplete group as `q`.
    pub qmx4: Vec<i8>,
    /// `m × cols/4` (with [`Q8Acts::qmx4`]): `−12 · Σ` of every four values of `qmx4` (the
    /// start of those kernels' integer sums, which multiply `w + 12` as unsigned bytes).
    pub n12mx4: Vec<i32>,
}

/// Index into a row of `q` of entry `j` of the same row of [`Q8Acts::qmx4`] (`cols` wide).
#[inline]
pub fn mx4_order(j: usize, cols: usize) -> usize {
    let g = j / (4 * QBLOCK);
    if (g + 1) * 4 * QBLOCK > cols {
        return j;
    }
    let k = j % (4 * QBLOCK);
    let (half, l, e) = (k / 64, (k % 64) / 16, k % 16);
    g * 4 * QBLOCK + l * QBLOCK + half * 16 + e
}

/// Quantize one block: `d = amax / 127`, `q = round_ties_even(x · (127 / amax))` clamped to
/// ±127. An all-zero block has `d = 0`; a block with a NaN or infinity gets `d = NaN` (so the
/// products that use it are NaN, as the exact kernels would give) and `q = 0`.
pub fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let mut amax = 0f32;
    let mut finite = true;
    for &v in x {
        finite &= v.is_finite();
        amax = amax.max(v.abs());
    }
    if !finite {
        q.iter_mut().for_each(|o| *o = 0);
        return f32::NAN;
    }
    if amax == 0.0 {
        q.iter_mut().for_each(|o| *o = 0);
        return 0.0;
    }
    let id = QMAX / amax;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * id).round_ties_even().clamp(-QMAX, QMAX) as i8;
    }
    amax / QMAX
}

/// `x` (`m × cols`, `cols % 32 == 0`) is an input of `m` rows of `cols`.
fn check_acts(x: &[f32], m: usize, cols: usize) -> Result<()> {
    if !cols.is_multiple_of(QBLOCK) {
        return Err(KernelError::Shape {
            what: "int8 activations",
            msg: format!("{cols} columns is not a multiple of {QBLOCK}"),
        });
    }
    if m.checked_mul(cols) != Some(x.len()) {
        return Err(KernelError::Operand {
            what: "x",
            expected: m.saturating_mul(cols),
            got: x.len(),
        });
    }
    Ok(())
}

/// [`quantize_block`] over every block of `x` into `q` and `d` (sized for it), on AVX-512
/// where the CPU has it (the same values).
fn quantize_into(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::level() >= crate::cpu::Level::Avx512 {
        // SAFETY: AVX-512 checked; `q` and `d` are sized for `x` by the callers.
        unsafe { x86::quantize_blocks_avx512(x, q, d) };
        return;
    }
    quantize_scalar(x, q, d);
}

/// [`quantize_block`] over every block (the scalar level; the AVX-512 one is tested against
/// it).
fn quantize_scalar(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((xb, qb), d) in x
        .chunks_exact(QBLOCK)
        .zip(q.chunks_exact_mut(QBLOCK))
        .zip(d.iter_mut())
    {
        *d = quantize_block(xb, qb);
    }
}

impl Q8Acts {
    /// Quantize `m` rows of `cols` (`cols % 32 == 0`).
    pub fn quantize(x: &[f32], m: usize, cols: usize) -> Result<Self> {
        let mut a = Q8Acts::default();
        a.requantize(x, m, cols)?;
        Ok(a)
    }

    /// As [`Q8Acts::quantize`], reusing this value's buffers.
    pub fn requantize(&mut self, x: &[f32], m: usize, cols: usize) -> Result<()> {
        check_acts(x, m, cols)?;
        let _quant = crate::profile::quant_span();
        self.m = m;
        self.cols = cols;
        self.q.clear();
        self.q.resize(m * cols, 0);
        self.d.clear();
        self.d.resize(m * cols / QBLOCK, 0.0);
        quantize_into(x, &mut self.q, &mut self.d);
        self.finish_sums();
        Ok(())
    }

    /// Two int8 levels per row (`x ≈ q₁·d₁ + q₂·d₂`): `2m` rows, rows `0..m` being `x`
    /// quantized as [`Q8Acts::requantize`] does and row `m + i` the residual `x − q₁·d₁` of
    /// row `i` (f32) quantized the same way, so a block's error falls from half a step of its
    /// largest value to half a step of its largest residual (about 1/254 of that). The
    /// product of row `i` is the sum of the products of rows `i` and `m + i`
    /// ([`ActLevels::Two`]). `resid` is scratch.
    pub fn requantize_two(
        &mut self,
        x: &[f32],
        m: usize,
        cols: usize,
        resid: &mut Vec<f32>,
    ) -> Result<()> {
        check_acts(x, m, cols)?;
        let _quant = crate::profile::quant_span();
        let nb = m * cols / QBLOCK;
        self.m = 2 * m;
        self.cols = cols;
        self.q.clear();
        self.q.resize(2 * m * cols, 0);
        self.d.clear();
        self.d.resize(2 * nb, 0.0);
        let (q1, q2) = self.q.split_at_mut(m * cols);
        let (d1, d2) = self.d.split_at_mut(nb);
        quantize_into(x, q1, d1);
        resid.clear();
        resid.extend(
            x.iter()
                .zip(q1.iter())
                .enumerate()
                .map(|(j, (&v, &q))| v - q as f32 * d1[j / QBLOCK]),
        );
        quantize_into(resid, q2, d2);
        self.finish_sums();
        Ok(())
    }

    /// The sums, products and spread scales derived from `q` and `d`.
    fn finish_sums(&mut self) {
        self.sums.clear();
        self.sums.extend(
            self.q
                .chunks_exact(QBLOCK)
                .map(|b| b.iter().map(|&v| v as i32).sum::<i32>()),
        );
        self.ds.clear();
        self.ds
            .extend(self.d.iter().zip(&self.sums).map(|(&d, &s)| d * s as f32));
        self.dx.clear();
        self.dx.extend(self.d.iter().flat_map(|&d| [d; QBLOCK / 4]));
        self.nsum4.clear();
        self.nsum4.extend(
            self.q
                .chunks_exact(4)
                .map(|v| -128 * v.iter().map(|&e| e as i32).sum::<i32>()),
        );
        self.qmx4.clear();
        self.n12mx4.clear();
        if self.m >= GEMM_MIN_M {
            return;
        }
        // Each row in `mx4_order`, sixteen values at a time.
        let (m, cols, g4) = (self.m, self.cols, 4 * QBLOCK);
        let whole = cols / g4 * g4;
        self.qmx4.resize(m * cols, 0);
        for i in 0..m {
            let (src_row, dst_row) = (
                &self.q[i * cols..(i + 1) * cols],
                &mut self.qmx4[i * cols..(i + 1) * cols],
            );
            for g in (0..whole).step_by(g4) {
                for half in 0..2 {
                    for l in 0..4 {
                        let (dst, src) = (g + 64 * half + 16 * l, g + QBLOCK * l + 16 * half);
                        dst_row[dst..dst + 16].copy_from_slice(&src_row[src..src + 16]);
                    }
                }
            }
            dst_row[whole..].copy_from_slice(&src_row[whole..cols]);
        }
        self.n12mx4.extend(
            self.qmx4
                .chunks_exact(4)
                .map(|v| -12 * v.iter().map(|&e| e as i32).sum::<i32>()),
        );
    }

    /// [`Q8Acts::quantize`] on the scalar level only (the reference of the vector one).
    pub fn quantize_ref(x: &[f32], m: usize, cols: usize) -> Result<Self> {
        let mut a = Q8Acts::quantize(x, m, cols)?;
        quantize_scalar(x, &mut a.q, &mut a.d);
        a.finish_sums();
        Ok(a)
    }

    /// The values the int8 blocks stand for (`q · d`), for tests and error reports.
    pub fn dequantize(&self) -> Vec<f32> {
        self.q
            .iter()
            .enumerate()
            .map(|(j, &v)| v as f32 * self.d[j / QBLOCK])
            .collect()
    }
}

/// A weight the integer kernels take.
#[derive(Debug, Clone, Copy)]
pub enum IntSrc<'a> {
    /// Packed E2M1 `[rows, cols/2]` (element 2k in the low nibble), E8M0 `[rows, cols/32]`.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
    /// E8P codes `[rows, cols/8]`, one f32 scale per row.
    E8p { codes: &'a [u16], scales: &'a [f32] },
    /// E81 codes `[rows, cols/8]` (one byte per 8 weights, the residual stage of
    /// `e8p2+e81`), one f32 scale per row.
    E81 { codes: &'a [u8], scales: &'a [f32] },
    /// Affine-8 codes `[rows, cols]`, bf16 scales and biases `[rows, cols/64]`.
    Affine8 {
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
    /// MLX affine-4 codes `[rows, cols/2]` bytes (element `2k` in the low nibble of byte
    /// `k`), bf16 scales and biases `[rows, cols/64]`.
    Affine4 {
        q: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
    },
    /// A format of keep-format's registry with an integer form (its entry decodes the integer
    /// weights and the block factors; every level multiplies them as a decoded row).
    Registered(crate::RegView<'a>),
}

impl<'a> IntSrc<'a> {
    /// The integer form of a [`WeightView`], when it has one (MXFP4 with `cols % 32 == 0`,
    /// MLX affine 8-bit).
    pub fn from_view(w: &WeightView<'a>) -> Option<Self> {
        match w.kind {
            WeightKind::Mxfp4 { packed, scales } if w.cols.is_multiple_of(QBLOCK) => {
                Some(IntSrc::Mxfp4 { packed, scales })
            }
            // MLX affine 8-bit codes are affine-8's bytes.
            WeightKind::MlxAffine {
                bits: 8,
                q,
                scales,
                biases,
            } => Some(IntSrc::Affine8 { q, scales, biases }),
            // MLX affine 4-bit: the nibbles are the integer weights.
            WeightKind::MlxAffine {
                bits: 4,
                q,
                scales,
                biases,
            } => Some(IntSrc::Affine4 { q, scales, biases }),
            WeightKind::Registered(v) => Self::from_registered(v, w.cols),
            _ => None,
        }
    }

    /// The integer form of a registered weight, when its entry has one (`cols % 32 == 0`).
    pub fn from_registered(v: crate::RegView<'a>, cols: usize) -> Option<Self> {
        (v.spec.int.is_some() && cols.is_multiple_of(QBLOCK)).then_some(IntSrc::Registered(v))
    }

    /// The integer form of an [`E8pView`] (`cols % 32 == 0`).
    pub fn from_e8p(w: &E8pView<'a>) -> Option<Self> {
        w.cols.is_multiple_of(QBLOCK).then_some(IntSrc::E8p {
            codes: w.codes,
            scales: w.scales,
        })
    }

    /// The integer form of an [`crate::affine::Affine8View`] (always: `cols % 64 == 0`).
    pub fn from_affine8(w: &crate::affine::Affine8View<'a>) -> Self {
        IntSrc::Affine8 {
            q: w.q,
            scales: w.scales,
            biases: w.biases,
        }
    }

    /// Whether the format has the bias term of step 5 (affine-8, affine-4).
    #[inline]
    pub fn has_bias(&self) -> bool {
        matches!(self, IntSrc::Affine8 { .. } | IntSrc::Affine4 { .. })
    }

    /// `β_b = 128·s_g + b_g` (affine-4: `b_g`) of weight row `r` for every block `b` (`g` the
    /// group holding it) into `dst[..cols/32]` (`false`: the format has no bias term).
    #[inline]
    pub fn bias_blocks(&self, r: usize, cols: usize, dst: &mut [f32]) -> bool {
        let (scales, biases, four) = match *self {
            IntSrc::Affine8 { scales, biases, .. } => (scales, biases, false),
            IntSrc::Affine4 { scales, biases, .. } => (scales, biases, true),
            _ => return false,
        };
        let ng = cols / AFFINE8_GROUP;
        let per = AFFINE8_GROUP / QBLOCK;
        for (g, o) in dst[..cols / QBLOCK].chunks_exact_mut(per).enumerate() {
            let beta = if four {
                bf16_at(biases, r * ng + g)
            } else {
                128.0 * bf16_at(scales, r * ng + g) + bf16_at(biases, r * ng + g)
            };
            o.iter_mut().for_each(|v| *v = beta);
        }
        true
    }

    /// Step 5 of the contract for weight row `r` and activation row `i` (`None`: the format
    /// has no bias term).
    pub fn bias_term(&self, r: usize, a: &Q8Acts, i: usize) -> Option<f32> {
        let nb = a.cols / QBLOCK;
        let mut bb = vec![0f32; nb];
        self.bias_blocks(r, a.cols, &mut bb)
            .then(|| bias_term_ref(&bb, &a.ds[i * nb..(i + 1) * nb]))
    }

    /// Integer weights of row `r` (`cols` wide) into `dst`, from the definitions.
    pub fn decode_row_ref(&self, r: usize, cols: usize, dst: &mut [i8]) {
        let dst = &mut dst[..cols];
        match *self {
            IntSrc::Mxfp4 { packed, .. } => {
                let row = &packed[r * cols / 2..(r + 1) * cols / 2];
                for (d2, &b) in dst.chunks_exact_mut(2).zip(row) {
                    d2[0] = (2.0 * keep_format::fp4::e2m1_to_f32_ref(b & 0xF)) as i8;
                    d2[1] = (2.0 * keep_format::fp4::e2m1_to_f32_ref(b >> 4)) as i8;
                }
            }
            IntSrc::E8p { codes, .. } => {
                let kc = cols / E8P_DIM;
                for (d8, &c) in dst.chunks_exact_mut(8).zip(&codes[r * kc..(r + 1) * kc]) {
                    let w = keep_format::e8p::decode_e8p_ref(c);
                    for (o, v) in d8.iter_mut().zip(w) {
                        *o = (v * 4.0) as i8;
                    }
                }
            }
            IntSrc::E81 { codes, .. } => {
                let kc = cols / E81_DIM;
                for (d8, &c) in dst.chunks_exact_mut(8).zip(&codes[r * kc..(r + 1) * kc]) {
                    let w = keep_format::e81::decode_e81_ref(c);
                    for (o, v) in d8.iter_mut().zip(w) {
                        *o = (v * 2.0) as i8;
                    }
                }
            }
            IntSrc::Affine8 { q, .. } => {
                for (o, &c) in dst.iter_mut().zip(&q[r * cols..(r + 1) * cols]) {
                    *o = (c as i32 - 128) as i8;
                }
            }
            IntSrc::Affine4 { q, .. } => {
                let row = &q[r * cols / 2..(r + 1) * cols / 2];
                for (j, o) in dst.iter_mut().enumerate() {
                    *o = keep_format::mlx_affine::code_ref(row, 4, j) as i8;
                }
            }
            IntSrc::Registered(v) => {
                if let Some(f) = v.spec.int {
                    (f.decode_ref)(v.parts(), cols, r, dst)
                }
            }
        }
    }

    /// Block factors `f_b` of row `r` into `dst[..cols/32]`.
    #[inline]
    pub fn block_factors(&self, r: usize, cols: usize, dst: &mut [f32]) {
        let nb = cols / QBLOCK;
        match *self {
            IntSrc::Mxfp4 { scales, .. } => {
                for (o, &e) in dst[..nb].iter_mut().zip(&scales[r * nb..(r + 1) * nb]) {
                    *o = e8m0_half(e);
                }
            }
            IntSrc::E8p { .. } | IntSrc::E81 { .. } => dst[..nb].iter_mut().for_each(|o| *o = 1.0),
            IntSrc::Affine8 { scales, .. } | IntSrc::Affine4 { scales, .. } => {
                let ng = cols / AFFINE8_GROUP;
                for (b, o) in dst[..nb].iter_mut().enumerate() {
                    *o = bf16_at(scales, r * ng + b * QBLOCK / AFFINE8_GROUP);
                }
            }
            IntSrc::Registered(v) => {
                if let Some(f) = v.spec.int {
                    (f.block_factors)(v.parts(), cols, r, dst)
                }
            }
        }
    }

    /// The row factor applied after the reduction (E8P: `scale / 4`, E81: `scale / 2`).
    #[inline]
    pub fn post(&self, r: usize) -> Option<f32> {
        match *self {
            IntSrc::Mxfp4 { .. }
            | IntSrc::Affine8 { .. }
            | IntSrc::Affine4 { .. }
            | IntSrc::Registered(_) => None,
            IntSrc::E8p { scales, .. } => Some(scales[r] * 0.25),
            IntSrc::E81 { scales, .. } => Some(scales[r] * 0.5),
        }
    }
}

/// E8M0 byte → `2^(e−128)` (half the scale, since the MXFP4 integers are `2·e2m1`); byte 0 is
/// 2^-128 (a subnormal), 0xFF is NaN.
#[inline(always)]
pub fn e8m0_half(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0020_0000),
        1 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        _ => f32::from_bits(((e - 1) as u32) << 23),
    }
}

/// `4 · decode_e8p(code)` as 8 int8 for every code (index = code), little-endian in a u64.
pub static E8P_I8: LazyLock<Vec<u64>> = LazyLock::new(|| {
    (0..=u16::MAX)
        .map(|c| {
            let w = decode_e8p(c);
            u64::from_le_bytes(w.map(|v| (v * 4.0) as i8 as u8))
        })
        .collect()
});

/// `E81_GRID[code]` (the codeword in half-units, integers in [−4, 4]) as 8 int8 for the 256
/// codes (index = code), little-endian in a u64: 2 KiB, built at compile time from
/// keep-format's grid.
pub static E81_I8: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut c = 0;
    while c < 256 {
        let mut b = [0u8; 8];
        let mut i = 0;
        while i < 8 {
            b[i] = E81_GRID[c][i] as u8;
            i += 1;
        }
        t[c] = u64::from_le_bytes(b);
        c += 1;
    }
    t
};

/// The nibble planes the VBMI E81 decoder looks codes up in (index = code): byte `c` of
/// plane `p` holds coordinates `2p` (low nibble) and `2p + 1` (high nibble) of code `c` as
/// `E81_GRID[c][i] + 4` (0..=8). Four 256-byte tables: each is four 64-byte registers.
pub static E81_PLANES: [[u8; 256]; 4] = {
    let mut t = [[0u8; 256]; 4];
    let mut c = 0;
    while c < 256 {
        let mut p = 0;
        while p < 4 {
            let lo = (E81_GRID[c][2 * p] + 4) as u8;
            let hi = (E81_GRID[c][2 * p + 1] + 4) as u8;
            t[p][c] = lo | hi << 4;
            p += 1;
        }
        c += 1;
    }
    t
};

/// `4 · e8p_base(g)` as 8 int8 for the 256 patterns (index = the code's high byte),
/// little-endian in a u64: the 2 KiB table the vector E8P decoder gathers from (it stays in
/// L1, where [`E8P_I8`]'s 512 KiB cannot).
pub static E8P_BASE4: LazyLock<[u64; 256]> = LazyLock::new(|| {
    std::array::from_fn(|g| {
        u64::from_le_bytes(keep_format::e8p::e8p_base(g as u8).map(|v| (v * 4.0) as i8 as u8))
    })
});

/// The byte planes the VBMI E8P decoder looks patterns up in (index = the code's high byte):
/// `lo[g]` holds the magnitude indices `m_i` of coordinates 0..4 of pattern `g` (two bits
/// each, coordinate `i` at bits `2i..2i+2`), `hi[g]` those of coordinates 4..8, where
/// `|4 · e8p_base(g)[i]| = 2 + 4·m_i` (`m_i` ∈ {0, 1, 2}); `fix[g]` is 0x80 when the base
/// pattern's coordinate 7 is negative (the sign fix of odd-sum patterns), else 0. Three
/// 256-byte tables: each is four 64-byte registers that two `vpermi2b` and a blend read.
#[derive(Debug)]
pub struct E8pPlanes {
    pub lo: [u8; 256],
    pub hi: [u8; 256],
    pub fix: [u8; 256],
}

/// [`E8pPlanes`] from [`E8P_BASE4`].
pub static E8P_PLANES: LazyLock<E8pPlanes> = LazyLock::new(|| {
    let mut p = E8pPlanes {
        lo: [0; 256],
        hi: [0; 256],
        fix: [0; 256],
    };
    for g in 0..256 {
        let b = E8P_BASE4[g].to_le_bytes().map(|v| v as i8);
        let m: [u8; 8] = b.map(|v| ((v.unsigned_abs() - 2) / 4) & 3);
        p.lo[g] = m[0] | m[1] << 2 | m[2] << 4 | m[3] << 6;
        p.hi[g] = m[4] | m[5] << 2 | m[6] << 4 | m[7] << 6;
        p.fix[g] = if b[7] < 0 { 0x80 } else { 0 };
    }
    p
});

/// The per-byte sign flips and shift signs of eight E8P sign bytes packed little-endian in
/// `s` (byte `c` = code `c`'s low byte): bit `8c + i` of the first value negates coordinate
/// `i` of code `c` (the sign byte with bit 0 toggled when its parity is odd), and byte `c` of
/// the second is 0xFF when code `c`'s shift is −¼ (odd parity), else 0. A SWAR parity: after
/// `s ^ s>>4`, `^ >>2`, `^ >>1`, bit 0 of each byte is the parity of that byte (the bits
/// shifted in from the byte above reach only bits 4..7, which the later steps never read).
#[inline(always)]
pub fn e8p_sign_masks(s: u64) -> (u64, u64) {
    let mut p = s ^ (s >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    p &= 0x0101_0101_0101_0101;
    (s ^ p, p * 0xFF)
}

/// Step 1–2 of the contract for blocks `b0..b1` (see the module doc), on the scalar level.
#[inline]
pub fn dot_blocks_ref(
    w: &[i8],
    q: &[i8],
    c: impl Fn(usize) -> f32,
    acc: &mut [[f32; 8]; 4],
    b0: usize,
    b1: usize,
) {
    for b in b0..b1 {
        let cb = c(b);
        let a = &mut acc[b % 4];
        for (g, ag) in a.iter_mut().enumerate() {
            let o = QBLOCK * b + 4 * g;
            let mut p = 0i32;
            for e in 0..4 {
                p += w[o + e] as i32 * q[o + e] as i32;
            }
            *ag = cb.mul_add(p as f32, *ag);
        }
    }
}

/// Steps 3–4 of the contract (without the row factor).
#[inline]
pub fn finish_ref(acc: &[[f32; 8]; 4]) -> f32 {
    let u: [f32; 8] = std::array::from_fn(|g| (acc[0][g] + acc[2][g]) + (acc[1][g] + acc[3][g]));
    ((u[0] + u[4]) + (u[2] + u[6])) + ((u[1] + u[5]) + (u[3] + u[7]))
}

/// An integer-kernel level (forced in tests; [`int_level`] is what the CPU runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IntLevel {
    /// [`dot_blocks_ref`] on a decoded row.
    Scalar,
    /// AVX2 `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// AVX-512 BW `vpmaddubsw` + `vpmaddwd` on 512-bit registers.
    Avx512,
    /// AVX-512 VNNI `vpdpbusd`.
    Avx512Vnni,
    /// AVX-512 VNNI with VBMI: E8P decoded without a gather (byte-plane tables in
    /// registers, `vpermi2b` / `vpmultishiftqb` / `vpermb`); the other formats as
    /// [`IntLevel::Avx512Vnni`].
    Avx512VnniVbmi,
    /// aarch64 NEON with the dot-product extension (`sdot`).
    NeonDot,
}

impl IntLevel {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            IntLevel::Scalar => "scalar",
            IntLevel::Avx2 => "avx2-maddubs",
            IntLevel::Avx512 => "avx512-maddubs",
            IntLevel::Avx512Vnni => "avx512-vnni",
            IntLevel::Avx512VnniVbmi => "avx512-vnni-vbmi",
            IntLevel::NeonDot => "neon-sdot",
        }
    }
}

/// The best integer level this CPU has, capped by `KEEP_SIMD` (as [`crate::cpu::level`]).
pub fn int_level() -> IntLevel {
    use crate::cpu::Level;
    static L: std::sync::OnceLock<IntLevel> = std::sync::OnceLock::new();
    *L.get_or_init(|| match crate::cpu::level() {
        Level::Avx512 if crate::cpu::has_avx512_vnni() && crate::cpu::has_avx512_vbmi() => {
            IntLevel::Avx512VnniVbmi
        }
        Level::Avx512 if crate::cpu::has_avx512_vnni() => IntLevel::Avx512Vnni,
        Level::Avx512 => IntLevel::Avx512,
        Level::Avx2 => IntLevel::Avx2,
        Level::Neon if has_neon_dotprod() => IntLevel::NeonDot,
        _ => IntLevel::Scalar,
    })
}

/// The levels this CPU can run (for tests and benchmarks).
pub fn int_levels_available() -> Vec<IntLevel> {
    use crate::cpu::{detected, has_avx512_vbmi, has_avx512_vnni, Level};
    let d = detected();
    let mut v = vec![IntLevel::Scalar];
    if d == Level::Neon && has_neon_dotprod() {
        v.push(IntLevel::NeonDot);
    }
    if d >= Level::Avx2 && d != Level::Neon {
        v.push(IntLevel::Avx2);
    }
    if d >= Level::Avx512 {
        v.push(IntLevel::Avx512);
        if has_avx512_vnni() {
            v.push(IntLevel::Avx512Vnni);
            if has_avx512_vbmi() {
                v.push(IntLevel::Avx512VnniVbmi);
            }
        }
    }
    v
}

/// NEON's dot-product extension (`sdot`), checked at run time.
fn has_neon_dotprod() -> bool {
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("dotprod")
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        false
    }
}

/// Per-thread scratch: a decoded integer row, its block factors and bias-term weights.
#[derive(Default)]
struct Scratch {
    w: Vec<i8>,
    f: Vec<f32>,
    bb: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Rows `r0..r1` on the scalar level.
///
/// # Safety
/// `out` valid for writes at `i*ld + r` (i < m, r in r0..r1), written by nobody else.
unsafe fn rows_scalar(src: &IntSrc, a: &Q8Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    let (cols, nb) = (a.cols, a.cols / QBLOCK);
    {
        // Taken out of the thread-local for the call (no closure: closures do not inherit
        // the enclosing function's target features).
        let mut taken = SCRATCH.with(|c| c.take());
        let s = &mut taken;
        s.w.resize(cols, 0);
        s.f.resize(nb, 0.0);
        for r in r0..r1 {
            src.decode_row_fast(r, cols, &mut s.w);
            src.block_factors(r, cols, &mut s.f);
            let post = src.post(r);
            for i in 0..a.m {
                let q = &a.q[i * cols..(i + 1) * cols];
                let d = &a.d[i * nb..(i + 1) * nb];
                let mut acc = [[0f32; 8]; 4];
                dot_blocks_ref(&s.w, q, |b| s.f[b] * d[b], &mut acc, 0, nb);
                let v = finish_ref(&acc);
                *out.add(i * ld + r) = post.map_or(v, |p| v * p);
            }
            add_bias_terms(src, a, r, out, ld);
        }
        SCRATCH.with(|c| c.replace(taken));
    }
}

impl IntSrc<'_> {
    /// Integer weights of row `r` (the same values as [`IntSrc::decode_row_ref`], tested),
    /// through the E8P table and a nibble table.
    #[inline]
    pub fn decode_row_fast(&self, r: usize, cols: usize, dst: &mut [i8]) {
        let dst = &mut dst[..cols];
        match *self {
            IntSrc::Mxfp4 { packed, .. } => {
                let row = &packed[r * cols / 2..(r + 1) * cols / 2];
                for (d2, &b) in dst.chunks_exact_mut(2).zip(row) {
                    d2[0] = MXFP4_I8[(b & 0xF) as usize];
                    d2[1] = MXFP4_I8[(b >> 4) as usize];
                }
            }
            IntSrc::E8p { codes, .. } => {
                let kc = cols / E8P_DIM;
                let t = &*E8P_I8;
                for (d8, &c) in dst.chunks_exact_mut(8).zip(&codes[r * kc..(r + 1) * kc]) {
                    // One 8-byte copy per code (the table holds the int8 weights' bytes).
                    let v = t[c as usize].to_le_bytes().map(|b| b as i8);
                    d8.copy_from_slice(&v);
                }
            }
            IntSrc::E81 { codes, .. } => {
                let kc = cols / E81_DIM;
                for (d8, &c) in dst.chunks_exact_mut(8).zip(&codes[r * kc..(r + 1) * kc]) {
                    d8.copy_from_slice(&E81_I8[c as usize].to_le_bytes().map(|b| b as i8));
                }
            }
            IntSrc::Affine8 { q, .. } => {
                for (o, &c) in dst.iter_mut().zip(&q[r * cols..(r + 1) * cols]) {
                    *o = (c ^ 0x80) as i8;
                }
            }
            IntSrc::Affine4 { q, .. } => {
                affine4::decode_nibbles(&q[r * cols / 2..(r + 1) * cols / 2], dst)
            }
            IntSrc::Registered(v) => {
                if let Some(f) = v.spec.int {
                    (f.decode)(v.parts(), cols, r, dst)
                }
            }
        }
    }
}

/// Step 5 of the contract: sixteen lanes of `fma(β_b, e_b, L)` over the blocks, then the
/// fixed tree (`bb`: the weight row's `β_b`, `ds`: the activation row's `e_b = d_b · S_b`).
#[inline]
pub fn bias_term_ref(bb: &[f32], ds: &[f32]) -> f32 {
    let mut l = [0f32; 16];
    for (b, (&beta, &e)) in bb.iter().zip(ds).enumerate() {
        l[b % 16] = beta.mul_add(e, l[b % 16]);
    }
    let v: [f32; 8] = std::array::from_fn(|j| l[j] + l[j + 8]);
    ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))
}

/// Step 5 of the contract for weight row `r`, added to every activation row's result.
///
/// # Safety
/// As [`rows_scalar`].
#[inline]
unsafe fn add_bias_terms(src: &IntSrc, a: &Q8Acts, r: usize, out: *mut f32, ld: usize) {
    if !src.has_bias() {
        return;
    }
    let nb = a.cols / QBLOCK;
    BIAS.with(|c| {
        let mut bb = c.take();
        bb.resize(nb, 0.0);
        src.bias_blocks(r, a.cols, &mut bb);
        for i in 0..a.m {
            *out.add(i * ld + r) += bias_term_ref(&bb, &a.ds[i * nb..(i + 1) * nb]);
        }
        c.replace(bb);
    });
}

thread_local! {
    /// The `β_b` of the row being finished (affine-8).
    static BIAS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `2 · e2m1(code)` for the 16 codes.
pub const MXFP4_I8: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Rows `r0..r1` of the product at `level` (a level the CPU lacks must not be passed).
///
/// # Safety
/// As [`rows_scalar`]; `src` holds at least `r1` rows of `a.cols`.
unsafe fn rows_at(
    level: IntLevel,
    src: &IntSrc,
    a: &Q8Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx512Vnni | IntLevel::Avx512VnniVbmi
            if a.m >= GEMM_MIN_M
                || (a.m >= E8P_GEMM_MIN_M
                    && matches!(src, IntSrc::E8p { .. } | IntSrc::E81 { .. }))
                || (a.m >= AFFINE8_GEMM_MIN_M && matches!(src, IntSrc::Affine8 { .. })) =>
        {
            gemm_x86::gemm_vnni(src, a, r0, r1, out, ld)
        }
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx512VnniVbmi | IntLevel::Avx512Vnni | IntLevel::Avx512 | IntLevel::Avx2
            if matches!(src, IntSrc::Affine4 { .. }) =>
        {
            affine4::rows_affine4(level, src, a, r0, r1, out, ld)
        }
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx512VnniVbmi => x86::rows_avx512_vbmi(src, a, r0, r1, out, ld),
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx512Vnni => x86::rows_avx512::<true>(src, a, r0, r1, out, ld),
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx512 => x86::rows_avx512::<false>(src, a, r0, r1, out, ld),
        #[cfg(target_arch = "x86_64")]
        IntLevel::Avx2 => x86::rows_avx2(src, a, r0, r1, out, ld),
        #[cfg(target_arch = "aarch64")]
        IntLevel::NeonDot => neon::rows_sdot(src, a, r0, r1, out, ld),
        _ => rows_scalar(src, a, r0, r1, out, ld),
    }
}

fn check_src(src: &IntSrc, rows: usize, cols: usize) -> Result<()> {
    let ok = cols.is_multiple_of(QBLOCK)
        && match *src {
            IntSrc::Mxfp4 { packed, scales } => {
                packed.len() == rows * cols / 2 && scales.len() == rows * cols / QBLOCK
            }
            IntSrc::E8p { codes, scales } => {
                codes.len() == rows * cols / E8P_DIM && scales.len() == rows
            }
            IntSrc::E81 { codes, scales } => {
                codes.len() == rows * cols / E81_DIM && scales.len() == rows
            }
            IntSrc::Affine8 { q, scales, biases } => {
                let ng = rows * cols / AFFINE8_GROUP;
                cols.is_multiple_of(AFFINE8_GROUP)
                    && q.len() == rows * cols
                    && scales.len() == 2 * ng
                    && biases.len() == 2 * ng
            }
            IntSrc::Affine4 { q, scales, biases } => {
                let ng = rows * cols / AFFINE8_GROUP;
                cols.is_multiple_of(AFFINE8_GROUP)
                    && q.len() == rows * cols / 2
                    && scales.len() == 2 * ng
                    && biases.len() == 2 * ng
            }
            IntSrc::Registered(v) => {
                v.spec.int.is_some() && v.spec.check(v.parts(), rows, cols).is_ok()
            }
        };
    if ok {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what: "integer weight",
            msg: format!("bytes do not match {rows}x{cols} (columns a multiple of {QBLOCK})"),
        })
    }
}

/// `out[M×rows] = acts · Wᵀ` at an explicit level (lowered to [`int_level`] when higher),
/// threaded over output rows when big.
pub fn int_matmul_at(
    level: IntLevel,
    src: &IntSrc,
    rows: usize,
    a: &Q8Acts,
    out: &mut [f32],
) -> Result<()> {
    check_src(src, rows, a.cols)?;
    if out.len() != a.m * rows {
        return Err(KernelError::Operand {
            what: "out",
            expected: a.m * rows,
            got: out.len(),
        });
    }
    let level = level.min(best_available());
    let ptr = SyncPtr(out.as_mut_ptr());
    crate::rows::par_rows(rows, a.m * a.cols, |r0, r1| {
        let p = &ptr;
        // SAFETY: out has m*rows elements (checked); each task writes only its own rows.
        unsafe { rows_at(level, src, a, r0, r1, p.0, rows) }
    });
    Ok(())
}

fn best_available() -> IntLevel {
    static L: std::sync::OnceLock<IntLevel> = std::sync::OnceLock::new();
    *L.get_or_init(|| *int_levels_available().last().unwrap_or(&IntLevel::Scalar))
}

/// `out[M×rows] = x[M×cols] · Wᵀ` through the integer kernels at [`int_level`]: the
/// activations are quantized once here.
pub fn int_matmul(
    x: &[f32],
    m: usize,
    src: &IntSrc,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<()> {
    check_operands(x, m, rows, cols, out)?;
    // Quantized into a buffer this thread keeps between calls (as `int_matmul_many` does).
    let mut spare = SPARE_ACTS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let mut a = spare.pop().unwrap_or_default();
    let r = a
        .requantize(x, m, cols)
        .and_then(|()| int_matmul_at(int_level(), src, rows, &a, out));
    spare.push(a);
    keep_spare(spare);
    r
}

/// One product of an [`int_matmul_many`] batch.
pub struct IntJob<'a, 'b> {
    pub w: IntSrc<'a>,
    pub rows: usize,
    pub cols: usize,
    pub x: &'b [f32],
    pub m: usize,
    pub out: &'b mut [f32],
}

/// How many int8 levels the activations of a product are quantized to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActLevels {
    /// One: `x ≈ q·d` ([`Q8Acts::requantize`]), as llama.cpp's `q8_0`.
    #[default]
    One,
    /// Two: `x ≈ q₁·d₁ + q₂·d₂` ([`Q8Acts::requantize_two`]); a row's result is the sum
    /// `y₁ + y₂` (one f32 add) of the contract's results on its two levels (the weight row
    /// decoded once for both). About twice the multiplies of [`ActLevels::One`], for about
    /// 1/254 of its rounding error.
    Two,
}

/// Independent integer products in one parallel pass (a token's top-k experts). Activations
/// are quantized once per distinct input (jobs whose `x` is the same slice share it). Each
/// output equals [`int_matmul`] of its job.
pub fn int_matmul_many(jobs: &mut [IntJob]) -> Result<()> {
    int_matmul_many_levels(ActLevels::One, jobs)
}

/// [`int_matmul_many`] with the activations quantized to `levels` int8 levels. Row `i` of a
/// job's output depends only on row `i` of its input, whatever the batch, `m` or level.
pub fn int_matmul_many_levels(levels: ActLevels, jobs: &mut [IntJob]) -> Result<()> {
    for j in jobs.iter() {
        check_operands(j.x, j.m, j.rows, j.cols, j.out)?;
        check_src(&j.w, j.rows, j.cols)?;
    }
    // One quantization per distinct input slice, into buffers kept from earlier calls on this
    // thread (a decode step quantizes the same few shapes every layer: no allocation once
    // they are warm).
    let mut spare = SPARE_ACTS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let (lv, rows_per) = match levels {
        ActLevels::One => (1, 1),
        ActLevels::Two => (2, 2),
    };
    // (Empty, without an allocation, for one level.)
    let mut two = match levels {
        ActLevels::One => TwoLevelBufs::default(),
        ActLevels::Two => TWO_LEVELS.with(|s| std::mem::take(&mut *s.borrow_mut())),
    };
    let mut books = Books::take();
    let resid = &mut two.resid;
    let prepared = prepare_per_input(
        jobs.iter().map(|j| (j.x, j.m, j.cols)),
        &mut spare,
        &mut books.which,
        &mut books.keys,
        |a, x, m, cols| match levels {
            ActLevels::One => a.requantize(x, m, cols),
            ActLevels::Two => a.requantize_two(x, m, cols, resid),
        },
    );
    if let Err(e) = prepared {
        keep_spare(spare);
        keep_two_levels(two);
        books.keep();
        return Err(e);
    }
    let level = int_level();
    books
        .shapes
        .extend(jobs.iter().map(|j| (rows_per * j.m, j.rows, j.cols)));
    if lv == 1 {
        books
            .outs
            .extend(jobs.iter_mut().map(|j| SyncPtr(j.out.as_mut_ptr())));
    } else {
        // Each job's two-level results into a buffer of its own, summed into its output below.
        while two.outs.len() < jobs.len() {
            two.outs.push(Vec::new());
        }
        for (j, o) in jobs.iter().zip(two.outs.iter_mut()) {
            o.clear();
            o.resize(rows_per * j.m * j.rows, 0.0);
        }
        books.outs.extend(
            two.outs[..jobs.len()]
                .iter_mut()
                .map(|o| SyncPtr(o.as_mut_ptr())),
        );
    }
    {
        let jobs_ro: &[IntJob] = jobs;
        let (acts, which) = (&spare, &books.which);
        run_row_jobs(
            &books.shapes,
            &books.outs,
            &mut books.tasks,
            |ji, r0, r1, out| {
                let j = &jobs_ro[ji];
                // SAFETY: operand lengths were checked above (the two-level buffers are sized
                // for `2m` rows); `run_row_jobs` hands each task a disjoint row range of its
                // job's output.
                unsafe { rows_at(level, &j.w, &acts[which[ji]], r0, r1, out, j.rows) };
            },
        );
    }
    if lv == 2 {
        for (j, y) in jobs.iter_mut().zip(&two.outs) {
            let (y1, y2) = y.split_at(j.m * j.rows);
            for ((o, a), b) in j.out.iter_mut().zip(y1).zip(y2) {
                *o = a + b;
            }
        }
    }
    keep_spare(spare);
    if lv == 2 {
        keep_two_levels(two);
    }
    books.keep();
    Ok(())
}

/// Keep the decode-sized buffers of `two` for this thread's next two-level call.
fn keep_two_levels(mut two: TwoLevelBufs) {
    two.outs.retain(|o| o.capacity() <= SPARE_MAX_VALUES);
    if two.resid.capacity() > 2 * SPARE_MAX_VALUES {
        two.resid = Vec::new();
    }
    TWO_LEVELS.with(|s| *s.borrow_mut() = two);
}

/// A thread's buffers for [`ActLevels::Two`]: the rows to quantize, and each job's results.
#[derive(Default)]
struct TwoLevelBufs {
    resid: Vec<f32>,
    outs: Vec<Vec<f32>>,
}

thread_local! {
    static TWO_LEVELS: std::cell::RefCell<TwoLevelBufs> = const {
        std::cell::RefCell::new(TwoLevelBufs {
            resid: Vec::new(),
            outs: Vec::new(),
        })
    };
}

/// Most quantized activation buffers a thread keeps between [`int_matmul_many`] calls.
const SPARE_MAX: usize = 32;
/// Largest buffer kept (`m × cols` values: decode-sized; a prefill chunk's are dropped, so the
/// kept memory stays far below the run's fixed overhead).
const SPARE_MAX_VALUES: usize = 1 << 16;

thread_local! {
    /// Quantized activation buffers of finished [`int_matmul_many`] calls, for the next.
    static SPARE_ACTS: std::cell::RefCell<Vec<Q8Acts>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Keep the decode-sized buffers of `spare` (at most [`SPARE_MAX`]) for this thread's next call.
fn keep_spare(mut spare: Vec<Q8Acts>) {
    spare.retain(|a| a.q.capacity() <= SPARE_MAX_VALUES);
    spare.truncate(SPARE_MAX);
    SPARE_ACTS.with(|s| *s.borrow_mut() = spare);
}

#[cfg(test)]
mod affine4_tests;
#[cfg(test)]
mod registry_tests;
#[cfg(test)]
mod tests;
