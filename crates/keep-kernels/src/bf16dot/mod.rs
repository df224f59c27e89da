//! bf16 dot products ("fast" kernels for FP8 and bf16 weights): every E4M3 value (subnormals
//! included) is exactly a normal bf16, so an MXFP8 or FP8-block weight row is decoded to bf16
//! without loss (a 128-entry table of the magnitudes plus the sign bit), a bf16 weight is used
//! as stored, and AVX-512 BF16's `vdpbf16ps` multiplies two weights per f32 lane against the
//! activations. The activations are rounded to bf16 (round to nearest even) once per call
//! ([`Bf16Acts`]): that rounding (relative error ≤ 2^-9 per activation) is the only
//! approximation of the exact product; everything after it is f32 arithmetic the scalar
//! reference reproduces bit for bit. Its effect on a model is measured by
//! `keep eval --kernels fast`, not assumed.
//!
//! # The instruction ([`dpbf16_ref`])
//! Intel's pseudo-code for lane `j` of `vdpbf16ps acc, a, b`: `acc += a[2j+1]·b[2j+1]`, then
//! `acc += a[2j]·b[2j]`, each an f32 fused multiply-add (the product of two bf16 is exact in
//! f32) rounded to nearest even, with denormal inputs read as zero and denormal results
//! flushed to zero; MXCSR is neither read nor written.
//!
//! # The contract (what every level computes, bit for bit)
//! For input row `i` and weight row `r`, four sets of 16 f32 lanes `A[0..4]` start at zero
//! (four independent chains, so the instruction's latency overlaps); chunk `c` of 32 columns
//! goes to `A[c mod 4]`, its lane `j` covering columns `32c+2j` and `32c+2j+1`:
//! - unscaled (bf16): `A[j] = dpbf16(A[j], w, x)`;
//! - scaled (MXFP8, FP8-block; `s_c` is the scale of the block holding the chunk):
//!   `A[j] = fma(s_c, dpbf16(0, w, x), A[j])`.
//!
//! Then `acc[j] = (A0[j] + A2[j]) + (A1[j] + A3[j])`, `u[j] = acc[j] + acc[j+8]` (j < 8),
//! `v[j] = u[j] + u[j+4]`, `t[j] = v[j] + v[j+2]`, and the result is `t[0] + t[1]`. [`dot_row_ref`] is that contract in plain Rust (the scalar
//! level, and the reference the AVX-512 BF16 level is tested against). Results depend neither
//! on M, nor on the threading, nor on the level, so decode equals prefill bit for bit here too.
//!
//! # Prefill
//! From [`GEMM_MIN_M`] activation rows on, the AVX-512 BF16 level runs a cache-blocked GEMM
//! (`gemm_x86`) on the same contract: [`GEMM_PANEL`] weight rows decoded to bf16 once per
//! panel and reused by every activation row from L1/L2, with a register tile of activation
//! rows × weight rows sharing each loaded vector. Every (input row, weight row) result is the
//! same bits as the row kernel's.
//!
//! Only columns in whole chunks of 32 (and FP8 blocks of a multiple of 32 columns, or one
//! block across the row) take this path; [`BfSrc::from_view`] says `None` otherwise and the
//! caller runs the exact kernel.

use std::sync::LazyLock;

use crate::codec::{e4m3_to_f32_ref, e8m0_to_f32};
use crate::cpu::check_operands;
use crate::rows::{block_scale, prepare_per_input, run_row_jobs, Books, SyncPtr};
use crate::weight::{BlockScales, WeightView};
use crate::{KernelError, Result};

#[cfg(target_arch = "x86_64")]
mod gemm_x86;
#[cfg(target_arch = "x86_64")]
mod x86;

/// From this many activation rows on, the AVX-512 BF16 level runs the cache-blocked GEMM
/// (the same results as the row kernel; see the module doc's Prefill section). Measured:
/// from 5 rows the GEMM's panel (each decoded weight row met by a register tile of activation
/// rows) beats the row kernel's groups of up to four rows at 4096×4096 and 2304×5120, bf16
/// and MXFP8; at 4 rows the two are even, at 3 the row kernel holds.
pub const GEMM_MIN_M: usize = 5;

/// Weight rows per GEMM panel (decoded once, reused by every activation row).
pub const GEMM_PANEL: usize = 16;

/// Columns per chunk (one 512-bit `vdpbf16ps`: 16 lanes × 2).
pub const CHUNK: usize = 32;

/// f32 → bf16 bits, rounded to nearest even (NaN stays a quiet NaN of the same sign).
#[inline]
pub fn f32_to_bf16_rne(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// E4M3FN byte → bf16 bits (exact: every E4M3 value is a normal bf16; 0x7F/0xFF are NaN).
pub static E4M3_BF16: LazyLock<[u16; 256]> = LazyLock::new(|| {
    std::array::from_fn(|b| {
        let mag = e4m3_to_f32_ref(b as u8 & 0x7F);
        let h = if mag.is_nan() {
            0x7FC0
        } else {
            (mag.to_bits() >> 16) as u16
        };
        h | (((b as u16) & 0x80) << 8)
    })
});

/// Activation rows rounded to bf16 once per call: `x` is `m × cols` bf16 bits.
#[derive(Debug, Clone, Default)]
pub struct Bf16Acts {
    pub m: usize,
    pub cols: usize,
    pub x: Vec<u16>,
}

impl Bf16Acts {
    /// Round `m` rows of `cols` f32 to bf16.
    pub fn round(x: &[f32], m: usize, cols: usize) -> Result<Self> {
        let mut a = Bf16Acts::default();
        a.reround(x, m, cols)?;
        Ok(a)
    }

    /// [`Bf16Acts::round`] into this buffer (no allocation when it already holds `m × cols`).
    pub fn reround(&mut self, x: &[f32], m: usize, cols: usize) -> Result<()> {
        if m.checked_mul(cols) != Some(x.len()) {
            return Err(KernelError::Operand {
                what: "x",
                expected: m.saturating_mul(cols),
                got: x.len(),
            });
        }
        let _round = crate::profile::quant_span();
        self.m = m;
        self.cols = cols;
        self.x.clear();
        self.x.extend(x.iter().map(|&v| f32_to_bf16_rne(v)));
        Ok(())
    }
}

/// Most rounded activation buffers a thread keeps between calls.
const SPARE_MAX: usize = 32;
/// Largest buffer kept (`m × cols` values: decode-sized; a prefill chunk's are dropped).
const SPARE_MAX_VALUES: usize = 1 << 16;

thread_local! {
    /// Rounded activation buffers of finished calls, for the next (a decode step rounds the
    /// same few shapes every layer: no allocation once they are warm).
    static SPARE_ACTS: std::cell::RefCell<Vec<Bf16Acts>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's spare buffers (empty when none are kept).
fn take_spare() -> Vec<Bf16Acts> {
    SPARE_ACTS.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// Keep the decode-sized buffers of `spare` (at most [`SPARE_MAX`]) for this thread's next call.
fn keep_spare(mut spare: Vec<Bf16Acts>) {
    spare.retain(|a| a.x.capacity() <= SPARE_MAX_VALUES);
    spare.truncate(SPARE_MAX);
    SPARE_ACTS.with(|s| *s.borrow_mut() = spare);
}

/// Denormal bf16 input read as (signed) zero.
#[inline(always)]
fn daz_bf16(h: u16) -> f32 {
    if h & 0x7F80 == 0 {
        bf16_to_f32(h & 0x8000)
    } else {
        bf16_to_f32(h)
    }
}

/// Denormal f32 flushed to (signed) zero.
#[inline(always)]
fn ftz(v: f32) -> f32 {
    if v.is_subnormal() {
        f32::from_bits(v.to_bits() & 0x8000_0000)
    } else {
        v
    }
}

/// One lane of `vdpbf16ps` (see the module doc): `acc + a1·b1`, then `+ a0·b0`, each a fused
/// multiply-add rounded to nearest even, denormal inputs as zero, denormal results flushed.
#[inline(always)]
pub fn dpbf16_ref(acc: f32, a: [u16; 2], b: [u16; 2]) -> f32 {
    let t = ftz(daz_bf16(a[1]).mul_add(daz_bf16(b[1]), ftz(acc)));
    ftz(daz_bf16(a[0]).mul_add(daz_bf16(b[0]), t))
}

/// The contract's final reduction of the four sets of 16 lanes.
#[inline(always)]
pub fn finish_ref(a: &[[f32; 16]; 4]) -> f32 {
    let acc: [f32; 16] = std::array::from_fn(|j| (a[0][j] + a[2][j]) + (a[1][j] + a[3][j]));
    let u: [f32; 8] = std::array::from_fn(|j| acc[j] + acc[j + 8]);
    let v: [f32; 4] = std::array::from_fn(|j| u[j] + u[j + 4]);
    let t: [f32; 2] = std::array::from_fn(|j| v[j] + v[j + 2]);
    t[0] + t[1]
}

/// The contract for one (input row, weight row): `w` and `x` are `cols` bf16, `s[c]` the
/// chunk scales (`None`: unscaled).
pub fn dot_row_ref(w: &[u16], x: &[u16], s: Option<&[f32]>) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    for (c, (wc, xc)) in w.chunks_exact(CHUNK).zip(x.chunks_exact(CHUNK)).enumerate() {
        for (j, a) in acc[c % 4].iter_mut().enumerate() {
            let (wp, xp) = ([wc[2 * j], wc[2 * j + 1]], [xc[2 * j], xc[2 * j + 1]]);
            *a = match s {
                None => dpbf16_ref(*a, wp, xp),
                Some(s) => s[c].mul_add(dpbf16_ref(0.0, wp, xp), *a),
            };
        }
    }
    finish_ref(&acc)
}

/// A weight the bf16 kernels take.
#[derive(Debug, Clone, Copy)]
pub enum BfSrc<'a> {
    /// bf16 `[rows, cols]`, little-endian.
    Bf16(&'a [u8]),
    /// E4M3 `[rows, cols]`, E8M0 `[rows, cols/32]`.
    Mxfp8 { q: &'a [u8], scales: &'a [u8] },
    /// E4M3 `[rows, cols]` with `block_rows × block_cols` scales (see [`WeightKind`]).
    Fp8Block {
        q: &'a [u8],
        scales: BlockScales<'a>,
        block_rows: usize,
        block_cols: usize,
        row0: usize,
    },
}

impl<'a> BfSrc<'a> {
    /// The bf16 form of a [`WeightView`], when it has one: bf16, MXFP8 or FP8-block weights
    /// with `cols % 32 == 0` (FP8-block: blocks a multiple of 32 columns, or one block per row).
    pub fn from_view(w: &WeightView<'a>) -> Option<Self> {
        Self::from_src(&crate::simd::Src::view(w), w.cols)
    }

    /// As [`BfSrc::from_view`], from the resolved bytes of a [`crate::simd::Job`].
    pub fn from_src(src: &crate::simd::Src<'a>, cols: usize) -> Option<Self> {
        use crate::simd::Src;
        if cols == 0 || !cols.is_multiple_of(CHUNK) {
            return None;
        }
        match *src {
            Src::Bf16(b) => Some(BfSrc::Bf16(b)),
            Src::Mxfp8 { q, scales } => Some(BfSrc::Mxfp8 { q, scales }),
            Src::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            } if block_cols.is_multiple_of(CHUNK) || block_cols >= cols => Some(BfSrc::Fp8Block {
                q,
                scales,
                block_rows,
                block_cols,
                row0,
            }),
            _ => None,
        }
    }

    /// bf16 weights of row `r` into `dst[..cols]`, from the definitions.
    pub fn decode_row_ref(&self, r: usize, cols: usize, dst: &mut [u16]) {
        let dst = &mut dst[..cols];
        match *self {
            BfSrc::Bf16(b) => {
                for (o, p) in dst
                    .iter_mut()
                    .zip(b[2 * r * cols..2 * (r + 1) * cols].chunks(2))
                {
                    *o = u16::from_le_bytes([p[0], p[1]]);
                }
            }
            BfSrc::Mxfp8 { q, .. } | BfSrc::Fp8Block { q, .. } => {
                let t = &*E4M3_BF16;
                for (o, &b) in dst.iter_mut().zip(&q[r * cols..(r + 1) * cols]) {
                    *o = t[b as usize];
                }
            }
        }
    }

    /// Chunk scales of row `r` into `dst[..cols/32]`; `false` when unscaled (bf16).
    pub fn chunk_scales(&self, r: usize, cols: usize, dst: &mut [f32]) -> bool {
        let nc = cols / CHUNK;
        match *self {
            BfSrc::Bf16(_) => false,
            BfSrc::Mxfp8 { scales, .. } => {
                for (o, &e) in dst[..nc].iter_mut().zip(&scales[r * nc..(r + 1) * nc]) {
                    *o = e8m0_to_f32(e);
                }
                true
            }
            BfSrc::Fp8Block {
                scales,
                block_rows,
                block_cols,
                row0,
                ..
            } => {
                // Chunk c lies in column block 32c / block_cols: one scale per block, written
                // over its chunks (block_cols a multiple of 32, or one block across the row).
                let nb = cols.div_ceil(block_cols);
                let base = ((row0 + r) / block_rows) * nb;
                if block_cols >= cols {
                    dst[..nc].fill(block_scale(scales, base));
                } else {
                    let per = block_cols / CHUNK;
                    for (b, d) in dst[..nc].chunks_mut(per).enumerate() {
                        d.fill(block_scale(scales, base + b));
                    }
                }
                true
            }
        }
    }

    /// The block row whose scales row `r` uses (FP8-block: rows of one block row share their
    /// chunk scales, so a kernel walking rows in order computes them once per block row);
    /// `None` where each row has its own (MXFP8) or none (bf16).
    #[inline]
    pub fn scale_row(&self, r: usize) -> Option<usize> {
        match *self {
            BfSrc::Fp8Block {
                block_rows, row0, ..
            } => Some((row0 + r) / block_rows),
            _ => None,
        }
    }

    /// Whether the bytes hold `rows × cols` (and the columns fit the chunks).
    fn check(&self, rows: usize, cols: usize) -> Result<()> {
        let ok = cols.is_multiple_of(CHUNK)
            && match *self {
                BfSrc::Bf16(b) => b.len() == rows * cols * 2,
                BfSrc::Mxfp8 { q, scales } => {
                    q.len() == rows * cols && scales.len() == rows * cols / CHUNK
                }
                BfSrc::Fp8Block {
                    q,
                    scales,
                    block_rows,
                    block_cols,
                    row0,
                } => {
                    let n = match scales {
                        BlockScales::E8m0(s) => s.len(),
                        BlockScales::F32(s) => s.len() / 4,
                        BlockScales::Bf16(s) => s.len() / 2,
                    };
                    block_rows > 0
                        && block_cols > 0
                        && q.len() == rows * cols
                        && n >= (row0 + rows).div_ceil(block_rows) * cols.div_ceil(block_cols)
                }
            };
        if ok {
            Ok(())
        } else {
            Err(KernelError::Shape {
                what: "bf16-kernel weight",
                msg: format!("bytes do not match {rows}x{cols} (columns a multiple of {CHUNK})"),
            })
        }
    }
}

/// A bf16-kernel level (forced in tests; [`bf_level`] is what the CPU runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum BfLevel {
    /// [`dot_row_ref`] on a decoded row.
    Scalar,
    /// AVX-512 BF16 `vdpbf16ps`.
    Avx512Bf16,
}

impl BfLevel {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            BfLevel::Scalar => "scalar",
            BfLevel::Avx512Bf16 => "avx512-bf16",
        }
    }
}

/// The bf16 level the CPU runs (capped by `KEEP_SIMD`), `None` without AVX-512 BF16: then the
/// fast mode runs these formats on the exact kernels.
pub fn bf_level() -> Option<BfLevel> {
    static L: std::sync::OnceLock<Option<BfLevel>> = std::sync::OnceLock::new();
    *L.get_or_init(|| {
        (crate::cpu::level() == crate::cpu::Level::Avx512 && crate::cpu::has_avx512_bf16())
            .then_some(BfLevel::Avx512Bf16)
    })
}

/// The levels this CPU can run (for tests and benchmarks).
pub fn bf_levels_available() -> Vec<BfLevel> {
    let mut v = vec![BfLevel::Scalar];
    if crate::cpu::has_avx512_bf16() {
        v.push(BfLevel::Avx512Bf16);
    }
    v
}

/// Per-thread scratch: a decoded bf16 row and its chunk scales.
#[derive(Default)]
struct Scratch {
    w: Vec<u16>,
    s: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Rows `r0..r1` on the scalar level.
///
/// # Safety
/// `out` valid for writes at `i*ld + r` (i < m, r in r0..r1), written by nobody else.
unsafe fn rows_scalar(src: &BfSrc, a: &Bf16Acts, r0: usize, r1: usize, out: *mut f32, ld: usize) {
    let cols = a.cols;
    let mut s = SCRATCH.with(|c| c.take());
    s.w.resize(cols, 0);
    s.s.resize(cols / CHUNK, 0.0);
    for r in r0..r1 {
        src.decode_row_ref(r, cols, &mut s.w);
        let scaled = src.chunk_scales(r, cols, &mut s.s);
        for i in 0..a.m {
            let x = &a.x[i * cols..(i + 1) * cols];
            *out.add(i * ld + r) = dot_row_ref(&s.w, x, scaled.then_some(&s.s[..]));
        }
    }
    SCRATCH.with(|c| c.replace(s));
}

/// Rows `r0..r1` at `level` (lowered to scalar where the CPU lacks it).
///
/// # Safety
/// As [`rows_scalar`]; `src` holds at least `r1` rows of `a.cols` (checked by the callers).
unsafe fn rows_at(
    level: BfLevel,
    src: &BfSrc,
    a: &Bf16Acts,
    r0: usize,
    r1: usize,
    out: *mut f32,
    ld: usize,
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        BfLevel::Avx512Bf16 if crate::cpu::has_avx512_bf16() && a.m >= GEMM_MIN_M => {
            gemm_x86::gemm_bf16(src, a, r0, r1, out, ld)
        }
        #[cfg(target_arch = "x86_64")]
        BfLevel::Avx512Bf16 if crate::cpu::has_avx512_bf16() => {
            x86::rows_avx512bf16(src, a, r0, r1, out, ld)
        }
        _ => rows_scalar(src, a, r0, r1, out, ld),
    }
}

/// `out[M×rows] = acts · Wᵀ` at an explicit level, threaded over output rows when big.
pub fn bf_matmul_at(
    level: BfLevel,
    src: &BfSrc,
    rows: usize,
    a: &Bf16Acts,
    out: &mut [f32],
) -> Result<()> {
    src.check(rows, a.cols)?;
    if out.len() != a.m * rows {
        return Err(KernelError::Operand {
            what: "out",
            expected: a.m * rows,
            got: out.len(),
        });
    }
    let ptr = SyncPtr(out.as_mut_ptr());
    crate::rows::par_rows(rows, a.m * a.cols, |r0, r1| {
        let p = &ptr;
        // SAFETY: out has m*rows elements (checked); each task writes only its own rows.
        unsafe { rows_at(level, src, a, r0, r1, p.0, rows) }
    });
    Ok(())
}

/// `out[M×rows] = x[M×cols] · Wᵀ` on the bf16 kernels; `Ok(false)` (nothing written) where
/// the CPU lacks AVX-512 BF16, so the caller runs the exact kernel.
pub fn bf_matmul(
    x: &[f32],
    m: usize,
    src: &BfSrc,
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<bool> {
    check_operands(x, m, rows, cols, out)?;
    let Some(level) = bf_level() else {
        return Ok(false);
    };
    let mut spare = take_spare();
    let mut a = spare.pop().unwrap_or_default();
    let r = a
        .reround(x, m, cols)
        .and_then(|()| bf_matmul_at(level, src, rows, &a, out));
    spare.push(a);
    keep_spare(spare);
    r.map(|()| true)
}

/// One product of a [`bf_matmul_many`] batch.
pub struct BfJob<'a, 'b> {
    pub w: BfSrc<'a>,
    pub rows: usize,
    pub cols: usize,
    pub x: &'b [f32],
    pub m: usize,
    pub out: &'b mut [f32],
}

/// Independent bf16 products in one parallel pass at `level` (activations rounded once per
/// distinct input). Each output equals [`bf_matmul_at`] of its job.
pub fn bf_matmul_many_at(level: BfLevel, jobs: &mut [BfJob]) -> Result<()> {
    for j in jobs.iter() {
        check_operands(j.x, j.m, j.rows, j.cols, j.out)?;
        j.w.check(j.rows, j.cols)?;
    }
    let mut spare = take_spare();
    let mut books = Books::take();
    let prepared = prepare_per_input(
        jobs.iter().map(|j| (j.x, j.m, j.cols)),
        &mut spare,
        &mut books.which,
        &mut books.keys,
        |a, x, m, cols| a.reround(x, m, cols),
    );
    if let Err(e) = prepared {
        keep_spare(spare);
        books.keep();
        return Err(e);
    }
    books
        .shapes
        .extend(jobs.iter().map(|j| (j.m, j.rows, j.cols)));
    books
        .outs
        .extend(jobs.iter_mut().map(|j| SyncPtr(j.out.as_mut_ptr())));
    let jobs_ro: &[BfJob] = jobs;
    let (acts, which) = (&spare, &books.which);
    run_row_jobs(
        &books.shapes,
        &books.outs,
        &mut books.tasks,
        |ji, r0, r1, out| {
            let j = &jobs_ro[ji];
            // SAFETY: operand lengths were checked above; `run_row_jobs` hands each task a
            // disjoint row range of its job's m×rows output.
            unsafe { rows_at(level, &j.w, &acts[which[ji]], r0, r1, out, j.rows) };
        },
    );
    keep_spare(spare);
    books.keep();
    Ok(())
}

#[cfg(test)]
mod tests;
