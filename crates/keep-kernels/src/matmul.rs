//! `out[M×rows] = x[M×cols] · Wᵀ` for every [`WeightView`] format: [`matmul_ref`] (scalar, f64
//! accumulation, element by element through `get_ref`) and [`matmul`] (fast).
//!
//! The fast path is the decode-and-dot kernels of [`crate::simd`] (AVX-512 / AVX2 chosen at run
//! time, NEON on aarch64, a scalar fallback): each weight row is decoded in registers and dotted
//! against the input rows with one fixed accumulation order, so results do not depend on M or on
//! the threading (decode equals prefill bit for bit). Threads split the output rows when
//! `M·rows·cols` exceeds [`PAR_MIN_MACS`]. Measured on keep-tiny, one run, 2 cores: decode 613
//! vs 321 tok/s and prefill(512) 1,600 vs 2,130 tok/s against the previous row-tile kernel,
//! which decoded a tile of rows once for four input rows at a time. [`dot`] and [`dot4`] remain
//! for the attention's vector products.

use crate::scratch::recycle;
use crate::{Result, WeightView};

use crate::cpu::check_operands;
#[cfg(target_arch = "x86_64")]
use crate::cpu::has_avx2;
pub use crate::cpu::PAR_MIN_MACS;

const LANES: usize = 16;

#[inline(always)]
fn dot_generic<const N: usize>(xs: [&[f32]; N], w: &[f32]) -> [f32; N] {
    let n = w.len();
    let full = n / LANES * LANES;
    let mut acc = [[0f32; LANES]; N];
    let mut k = 0;
    while k < full {
        let wc = &w[k..k + LANES];
        for j in 0..N {
            let xc = &xs[j][k..k + LANES];
            for l in 0..LANES {
                acc[j][l] += xc[l] * wc[l];
            }
        }
        k += LANES;
    }
    let mut out = [0f32; N];
    for j in 0..N {
        let mut tail = 0f32;
        for i in full..n {
            tail += xs[j][i] * w[i];
        }
        out[j] = reduce(&acc[j]) + tail;
    }
    out
}

#[inline(always)]
fn reduce(a: &[f32; LANES]) -> f32 {
    let mut b = [0f32; 8];
    for i in 0..8 {
        b[i] = a[i] + a[i + 8];
    }
    let c = [b[0] + b[4], b[1] + b[5], b[2] + b[6], b[3] + b[7]];
    (c[0] + c[2]) + (c[1] + c[3])
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2+FMA dot products: two 8-lane accumulators per input row (16 lanes), the same
    //! reduction tree as `reduce`, then the scalar tail; `dot4` is four `dot1`s sharing the
    //! weight loads, bit for bit.
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(a0: __m256, a1: __m256) -> f32 {
        let b = _mm256_add_ps(a0, a1);
        let c = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1));
        let d = _mm_add_ps(c, _mm_movehl_ps(c, c));
        let e = _mm_add_ss(d, _mm_shuffle_ps(d, d, 1));
        _mm_cvtss_f32(e)
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot1(x: &[f32], w: &[f32]) -> f32 {
        let n = w.len();
        let full = n / 16 * 16;
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        let mut k = 0;
        while k < full {
            let w0 = _mm256_loadu_ps(wp.add(k));
            let w1 = _mm256_loadu_ps(wp.add(k + 8));
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(k)), w0, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(k + 8)), w1, a1);
            k += 16;
        }
        let mut tail = 0f32;
        for i in full..n {
            tail = x[i].mul_add(w[i], tail);
        }
        hsum(a0, a1) + tail
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(xs: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
        let n = w.len();
        let full = n / 16 * 16;
        let wp = w.as_ptr();
        let p = [
            xs[0].as_ptr(),
            xs[1].as_ptr(),
            xs[2].as_ptr(),
            xs[3].as_ptr(),
        ];
        let z = _mm256_setzero_ps();
        let (mut a00, mut a01, mut a10, mut a11) = (z, z, z, z);
        let (mut a20, mut a21, mut a30, mut a31) = (z, z, z, z);
        let mut k = 0;
        while k < full {
            let w0 = _mm256_loadu_ps(wp.add(k));
            let w1 = _mm256_loadu_ps(wp.add(k + 8));
            a00 = _mm256_fmadd_ps(_mm256_loadu_ps(p[0].add(k)), w0, a00);
            a01 = _mm256_fmadd_ps(_mm256_loadu_ps(p[0].add(k + 8)), w1, a01);
            a10 = _mm256_fmadd_ps(_mm256_loadu_ps(p[1].add(k)), w0, a10);
            a11 = _mm256_fmadd_ps(_mm256_loadu_ps(p[1].add(k + 8)), w1, a11);
            a20 = _mm256_fmadd_ps(_mm256_loadu_ps(p[2].add(k)), w0, a20);
            a21 = _mm256_fmadd_ps(_mm256_loadu_ps(p[2].add(k + 8)), w1, a21);
            a30 = _mm256_fmadd_ps(_mm256_loadu_ps(p[3].add(k)), w0, a30);
            a31 = _mm256_fmadd_ps(_mm256_loadu_ps(p[3].add(k + 8)), w1, a31);
            k += 16;
        }
        let mut t = [0f32; 4];
        for (j, tj) in t.iter_mut().enumerate() {
            for i in full..n {
                *tj = xs[j][i].mul_add(w[i], *tj);
            }
        }
        [
            hsum(a00, a01) + t[0],
            hsum(a10, a11) + t[1],
            hsum(a20, a21) + t[2],
            hsum(a30, a31) + t[3],
        ]
    }
}

/// Dot product of two equal-length slices in the kernels' fixed accumulation order.
#[inline]
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    let x = &x[..w.len()];
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked above).
        return unsafe { avx2::dot1(x, w) };
    }
    dot_generic([x], w)[0]
}

/// Four dot products against one weight row; each equals `dot(xs[j], w)` bit for bit.
#[inline]
pub fn dot4(xs: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let n = w.len();
    let xs = [&xs[0][..n], &xs[1][..n], &xs[2][..n], &xs[3][..n]];
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports avx2 and fma (checked above).
        return unsafe { avx2::dot4(xs, w) };
    }
    dot_generic(xs, w)
}

/// Scalar reference: f64 accumulation of `get_ref` elements.
pub fn matmul_ref(x: &[f32], m: usize, w: &WeightView, out: &mut [f32]) -> Result<()> {
    check_operands(x, m, w.rows, w.cols, out)?;
    for i in 0..m {
        for r in 0..w.rows {
            let mut s = 0f64;
            for c in 0..w.cols {
                s += x[i * w.cols + c] as f64 * w.get_ref(r, c) as f64;
            }
            out[i * w.rows + r] = s as f32;
        }
    }
    Ok(())
}

/// Which kernels a product runs on: the exact f32 decode-and-dot kernels (what `keep logits`,
/// the fixtures and the conformance suite use), or the fast ones, which quantize activations
/// to int8 blocks and multiply packed weights as integers where the format has an integer
/// kernel ([`crate::intdot`]: MXFP4, E8P with an E8P12 or E81 residual or none
/// ([`e8p_int_stages`]), and affine-8 in `matmul_many_with`), round activations to bf16 and multiply with AVX-512
/// BF16 `vdpbf16ps` for bf16, MXFP8 and FP8-block weights where the CPU has it
/// ([`crate::bf16dot`]), and run the exact kernel elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// The exact f32 kernels.
    #[default]
    Exact,
    /// Integer or bf16 dot products where a format has them.
    Fast,
}

impl Kernels {
    /// `"exact"` or `"fast"`.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Exact => "exact",
            Kernels::Fast => "fast",
        }
    }

    /// Parse `"exact"` / `"fast"`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "exact" => Some(Kernels::Exact),
            "fast" => Some(Kernels::Fast),
            _ => None,
        }
    }
}

/// The integer forms of an E8P weight's stages (`codes`/`scales` as stored, little-endian u16
/// (E81: bytes) and f32): the main stage, and the residual (E8P12 or E81). `None` when the
/// integer kernels cannot take it (columns not a multiple of 32, bytes not aligned for u16 /
/// f32, or a big-endian target), and the exact kernel runs. The fast product of a
/// weight with a residual is the main stage's contract result plus the residual's (one f32
/// add per output), so it too does not depend on M or on the threading.
pub fn e8p_int_stages<'a>(
    codes: &'a [u8],
    scales: &'a [u8],
    resid: Option<crate::weight::E8pResidual<'a>>,
    cols: usize,
) -> Option<(crate::intdot::IntSrc<'a>, Option<crate::intdot::IntSrc<'a>>)> {
    fn f32s(scales: &[u8]) -> Option<&[f32]> {
        if cfg!(target_endian = "big") {
            return None;
        }
        // SAFETY: every bit pattern is a valid f32; only the aligned middle is used, and only
        // when it is the whole slice.
        let (p, sc, s) = unsafe { scales.align_to::<f32>() };
        (p.is_empty() && s.is_empty()).then_some(sc)
    }
    fn stage<'a>(codes: &'a [u8], scales: &'a [u8]) -> Option<crate::intdot::IntSrc<'a>> {
        let scales = f32s(scales)?;
        // SAFETY: every bit pattern is a valid u16; as `f32s`.
        let (p, c, s) = unsafe { codes.align_to::<u16>() };
        (p.is_empty() && s.is_empty()).then_some(crate::intdot::IntSrc::E8p { codes: c, scales })
    }
    if !cols.is_multiple_of(crate::intdot::QBLOCK) {
        return None;
    }
    let main = stage(codes, scales)?;
    match resid {
        None => Some((main, None)),
        Some(r) if !r.e81 => Some((main, Some(stage(r.codes, r.scales)?))),
        Some(r) => Some((
            main,
            Some(crate::intdot::IntSrc::E81 {
                codes: r.codes,
                scales: f32s(r.scales)?,
            }),
        )),
    }
}

/// [`matmul`] on the chosen [`Kernels`].
pub fn matmul_with(
    kernels: Kernels,
    x: &[f32],
    m: usize,
    w: &WeightView,
    out: &mut [f32],
) -> Result<()> {
    if kernels == Kernels::Fast {
        if let Some(src) = crate::intdot::IntSrc::from_view(w) {
            return crate::intdot::int_matmul(x, m, &src, w.rows, w.cols, out);
        }
        if let crate::weight::WeightKind::E8p {
            codes,
            scales,
            resid,
        } = w.kind
        {
            if e8p_int_stages(codes, scales, resid, w.cols).is_some() {
                // One batch of one job: its main and residual stages share the activations.
                let mut job = crate::simd::Job {
                    w: crate::simd::Src::view(w),
                    rows: w.rows,
                    cols: w.cols,
                    x,
                    m,
                    out,
                };
                return matmul_many_with(kernels, std::slice::from_mut(&mut job));
            }
        }
        if let Some(src) = crate::bf16dot::BfSrc::from_view(w) {
            // `false`: no AVX-512 BF16 here, so the exact kernel runs below.
            if crate::bf16dot::bf_matmul(x, m, &src, w.rows, w.cols, out)? {
                return Ok(());
            }
        }
    }
    matmul(x, m, w, out)
}

/// `out[M×rows] = x[M×cols] · Wᵀ`, fast path (see the module doc).
pub fn matmul(x: &[f32], m: usize, w: &WeightView, out: &mut [f32]) -> Result<()> {
    check_operands(x, m, w.rows, w.cols, out)?;
    // The decode-and-dot kernels of `simd` (AVX-512 / AVX2 / NEON / scalar, chosen at run
    // time): every (input row, output row) dot is the same instruction sequence whatever M is
    // and however rows are threaded, so decode still equals prefill bit for bit.
    crate::simd::run(crate::simd::Src::view(w), w.rows, w.cols, x, m, out);
    Ok(())
}

/// Like [`matmul`] but only for output rows `r0..r1` of `w`, writing `out[M×(r1-r0)]`.
pub fn matmul_rows(
    x: &[f32],
    m: usize,
    w: &WeightView,
    r0: usize,
    r1: usize,
    out: &mut [f32],
) -> Result<()> {
    let sub = w.slice_rows(r0, r1)?;
    matmul(x, m, &sub, out)
}

/// The job lists of [`matmul_many_with`] (integer, bf16, exact), kept per thread between
/// calls in their `'static` form (see [`recycle`]).
type SplitJobs = (
    Vec<crate::intdot::IntJob<'static, 'static>>,
    Vec<crate::bf16dot::BfJob<'static, 'static>>,
    Vec<crate::simd::Job<'static, 'static>>,
);

thread_local! {
    static SPLIT: std::cell::RefCell<SplitJobs> = const {
        std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new()))
    };
    /// The residual stages' output buffers (job index, buffer), kept between calls so that a
    /// steady decode allocates nothing.
    static RESID: std::cell::RefCell<Vec<(usize, Vec<f32>)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// [`crate::simd::matmul_many`] on the chosen kernels: with [`crate::Kernels::Fast`], the jobs whose
/// weight has an integer kernel (MXFP4, E8P and its residual stage, affine-8, MLX affine-4, a
/// registered format's integer form) run through [`crate::intdot::int_matmul_many`] (activations
/// quantized once per distinct input), bf16 / MXFP8 / FP8-block jobs through
/// [`crate::bf16dot::bf_matmul_many_at`] where the CPU has AVX-512 BF16 (activations rounded
/// to bf16 once per distinct input), the rest as [`crate::simd::matmul_many`].
pub fn matmul_many_with(kernels: crate::Kernels, jobs: &mut [crate::simd::Job]) -> Result<()> {
    matmul_many_levels(kernels, crate::intdot::ActLevels::One, jobs)
}

/// [`matmul_many_with`] with the integer kernels' activations quantized to `levels` int8
/// levels ([`crate::intdot::ActLevels`]; the bf16 and exact kernels do not quantize theirs).
pub fn matmul_many_levels(
    kernels: crate::Kernels,
    levels: crate::intdot::ActLevels,
    jobs: &mut [crate::simd::Job],
) -> Result<()> {
    if kernels == crate::Kernels::Exact {
        crate::simd::matmul_many(jobs);
        return Ok(());
    }
    let bf = crate::bf16dot::bf_level();
    // E8P residual stages run as jobs of their own into these buffers (this thread's, kept
    // between calls), added afterwards.
    let mut resid_out = RESID.with(|r| std::mem::take(&mut *r.borrow_mut()));
    let mut n_resid = 0;
    for (k, j) in jobs.iter().enumerate() {
        if let crate::simd::Src::E8p {
            codes,
            scales,
            resid,
        } = j.w
        {
            if let Some((_, Some(_))) = e8p_int_stages(codes, scales, resid, j.cols) {
                if n_resid == resid_out.len() {
                    resid_out.push((k, Vec::new()));
                }
                let (slot, buf) = &mut resid_out[n_resid];
                *slot = k;
                buf.clear();
                buf.resize(j.out.len(), 0.0);
                n_resid += 1;
            }
        }
    }
    let mut resid_bufs = resid_out[..n_resid].iter_mut().map(|(_, b)| b);
    // The three job lists are this thread's, kept between calls.
    let kept = SPLIT.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let (mut int_jobs, mut bf_jobs, mut rest): (
        Vec<crate::intdot::IntJob>,
        Vec<crate::bf16dot::BfJob>,
        Vec<crate::simd::Job>,
    ) = (recycle(kept.0), recycle(kept.1), recycle(kept.2));
    for j in jobs.iter_mut() {
        let int = match j.w {
            crate::simd::Src::Mxfp4 { packed, scales }
                if j.cols.is_multiple_of(crate::intdot::QBLOCK) =>
            {
                Some(crate::intdot::IntSrc::Mxfp4 { packed, scales })
            }
            crate::simd::Src::Affine8 { q, scales, biases } => {
                Some(crate::intdot::IntSrc::Affine8 { q, scales, biases })
            }
            crate::simd::Src::MlxAffine {
                bits: 4,
                q,
                scales,
                biases,
            } => Some(crate::intdot::IntSrc::Affine4 { q, scales, biases }),
            crate::simd::Src::Registered(v) => crate::intdot::IntSrc::from_registered(v, j.cols),
            crate::simd::Src::E8p {
                codes,
                scales,
                resid,
            } => match e8p_int_stages(codes, scales, resid, j.cols) {
                Some((main, res)) => {
                    if let Some(rw) = res {
                        let buf = resid_bufs.next().expect("one buffer per residual");
                        int_jobs.push(crate::intdot::IntJob {
                            w: rw,
                            rows: j.rows,
                            cols: j.cols,
                            x: j.x,
                            m: j.m,
                            out: buf,
                        });
                    }
                    Some(main)
                }
                None => None,
            },
            _ => None,
        };
        let bfw = bf.and(crate::bf16dot::BfSrc::from_src(&j.w, j.cols));
        if let Some(w) = int {
            int_jobs.push(crate::intdot::IntJob {
                w,
                rows: j.rows,
                cols: j.cols,
                x: j.x,
                m: j.m,
                out: &mut *j.out,
            });
        } else if let Some(w) = bfw {
            bf_jobs.push(crate::bf16dot::BfJob {
                w,
                rows: j.rows,
                cols: j.cols,
                x: j.x,
                m: j.m,
                out: &mut *j.out,
            });
        } else {
            rest.push(crate::simd::Job {
                w: j.w,
                rows: j.rows,
                cols: j.cols,
                x: j.x,
                m: j.m,
                out: &mut *j.out,
            });
        }
    }
    if let (Some(level), false) = (bf, bf_jobs.is_empty()) {
        crate::bf16dot::bf_matmul_many_at(level, &mut bf_jobs)?;
    }
    if !int_jobs.is_empty() {
        crate::intdot::int_matmul_many_levels(levels, &mut int_jobs)?;
    }
    if !rest.is_empty() {
        crate::simd::matmul_many(&mut rest);
    }
    let kept = (recycle(int_jobs), recycle(bf_jobs), recycle(rest));
    SPLIT.with(|s| *s.borrow_mut() = kept);
    for (k, b) in &resid_out[..n_resid] {
        jobs[*k].out.iter_mut().zip(b).for_each(|(o, r)| *o += r);
    }
    RESID.with(|r| *r.borrow_mut() = resid_out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::BlockScales;

    use crate::test_rng::Rng;

    /// Tolerance between the fast f32 path and the f64 reference: f32 accumulation over `cols`
    /// terms, relative to the sum of |x·w|.
    const REL_TOL: f32 = 1e-5;

    fn compare(w: &WeightView, m: usize, rng: &mut Rng) {
        let x: Vec<f32> = (0..m * w.cols).map(|_| rng.f()).collect();
        let mut a = vec![0f32; m * w.rows];
        let mut b = vec![0f32; m * w.rows];
        matmul_ref(&x, m, w, &mut a).unwrap();
        matmul(&x, m, w, &mut b).unwrap();
        for i in 0..m {
            for r in 0..w.rows {
                let mag: f32 = (0..w.cols)
                    .map(|c| (x[i * w.cols + c] * w.get_ref(r, c)).abs())
                    .sum::<f32>()
                    + 1e-30;
                let (p, q) = (a[i * w.rows + r], b[i * w.rows + r]);
                if p.is_nan() {
                    assert!(q.is_nan());
                    continue;
                }
                assert!(
                    (p - q).abs() <= REL_TOL * mag,
                    "{} m={m} ({i},{r}) {p} vs {q}",
                    w.format_name()
                );
            }
        }
        // Row-independence: each row of a batch equals the same row alone, bit for bit.
        for i in [0, m / 2, m - 1] {
            let mut one = vec![0f32; w.rows];
            matmul(&x[i * w.cols..(i + 1) * w.cols], 1, w, &mut one).unwrap();
            assert_eq!(one, b[i * w.rows..(i + 1) * w.rows], "row {i} of {m}");
        }
    }

    #[test]
    fn fast_matches_ref_on_odd_shapes() {
        let mut rng = Rng::new(0x9E3779B97F4A7C15);
        for &(rows, cols) in &[(1, 32), (7, 64), (33, 96), (65, 160), (300, 1024)] {
            for &m in &[1, 3, 4, 9] {
                let f32b: Vec<u8> = (0..rows * cols)
                    .flat_map(|_| rng.f().to_le_bytes())
                    .collect();
                compare(&WeightView::f32(&f32b, rows, cols).unwrap(), m, &mut rng);
                let bf: Vec<u8> = (0..rows * cols)
                    .flat_map(|_| ((rng.f().to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                compare(&WeightView::bf16(&bf, rows, cols).unwrap(), m, &mut rng);
                let q: Vec<u8> = rng
                    .bytes(rows * cols)
                    .into_iter()
                    .map(|b| if b & 0x7F == 0x7F { 0 } else { b })
                    .collect();
                let s = rng.scales(rows * cols / 32);
                compare(&WeightView::mxfp8(&q, &s, rows, cols).unwrap(), m, &mut rng);
                let p = rng.bytes(rows * cols / 2);
                compare(&WeightView::mxfp4(&p, &s, rows, cols).unwrap(), m, &mut rng);
                for b in [32usize, 128] {
                    let gs = rng.scales(rows.div_ceil(b) * cols.div_ceil(b));
                    compare(
                        &WeightView::fp8_block(&q, BlockScales::E8m0(&gs), rows, cols, b, b)
                            .unwrap(),
                        m,
                        &mut rng,
                    );
                    let fs: Vec<u8> = (0..rows.div_ceil(b) * cols.div_ceil(b))
                        .flat_map(|_| (rng.f() * 0.01).to_le_bytes())
                        .collect();
                    compare(
                        &WeightView::fp8_block(&q, BlockScales::F32(&fs), rows, cols, b, b)
                            .unwrap(),
                        m,
                        &mut rng,
                    );
                    // bf16 scales (Qwen's `weight_scale_inv`): the same values, truncated.
                    let hs: Vec<u8> = fs.chunks_exact(4).flat_map(|c| [c[2], c[3]]).collect();
                    let hv = WeightView::fp8_block(&q, BlockScales::Bf16(&hs), rows, cols, b, b)
                        .unwrap();
                    compare(&hv, m, &mut rng);
                    // ... decode exactly as f32 scales holding the bf16 values.
                    let fv: Vec<u8> = hs
                        .chunks_exact(2)
                        .flat_map(|c| [0, 0, c[0], c[1]])
                        .collect();
                    let fw =
                        WeightView::fp8_block(&q, BlockScales::F32(&fv), rows, cols, b, b).unwrap();
                    let (mut a, mut z) = (vec![0f32; cols], vec![0f32; cols]);
                    for r in 0..rows {
                        hv.decode_row(r, &mut a);
                        fw.decode_row(r, &mut z);
                        assert!(a.iter().zip(&z).all(|(x, y)| x.to_bits() == y.to_bits()));
                    }
                }
            }
        }
    }

    #[test]
    fn fp8_block_odd_cols_and_row_slices() {
        let mut rng = Rng::new(77);
        let (rows, cols) = (70, 50);
        let q: Vec<u8> = rng
            .bytes(rows * cols)
            .into_iter()
            .map(|b| b & 0x7E)
            .collect();
        let gs = rng.scales(rows.div_ceil(32) * cols.div_ceil(32));
        let w = WeightView::fp8_block(&q, BlockScales::E8m0(&gs), rows, cols, 32, 32).unwrap();
        compare(&w, 5, &mut rng);
        let sub = w.slice_rows(40, 70).unwrap();
        for r in 0..30 {
            for c in 0..cols {
                assert_eq!(sub.get_ref(r, c).to_bits(), w.get_ref(40 + r, c).to_bits());
            }
        }
        compare(&sub, 2, &mut rng);
    }

    #[test]
    fn decode_row_equals_get_ref_on_every_code() {
        // All 256 E4M3 codes and all 16 E2M1 codes in one row each.
        let q: Vec<u8> = (0..=255u8).collect();
        let s = vec![127u8, 130, 100, 0, 140, 127, 127, 127];
        let w = WeightView::mxfp8(&q, &s, 1, 256).unwrap();
        let mut buf = vec![0f32; 256];
        w.decode_row(0, &mut buf);
        for (c, v) in buf.iter().enumerate() {
            // NaN codes compare as NaN: the reference keeps the sign of 0xFF (as ml_dtypes).
            let r = w.get_ref(0, c);
            assert!(
                v.to_bits() == r.to_bits() || (v.is_nan() && r.is_nan()),
                "code {c}"
            );
        }
        let p: Vec<u8> = (0..128u32)
            .map(|i| ((i % 16) | ((15 - i % 16) << 4)) as u8)
            .collect();
        let w = WeightView::mxfp4(&p, &s, 1, 256).unwrap();
        w.decode_row(0, &mut buf);
        for (c, v) in buf.iter().enumerate() {
            assert_eq!(v.to_bits(), w.get_ref(0, c).to_bits(), "fp4 elem {c}");
        }
    }

    #[test]
    fn table_free_decoders_equal_tables() {
        for b in 0..=255u8 {
            let (a, r) = (
                crate::weight::e4m3_bits(b),
                crate::codec::e4m3_to_f32_ref(b),
            );
            assert!(
                a.to_bits() == r.to_bits() || (a.is_nan() && r.is_nan()),
                "e4m3 {b:#x}: {a} vs {r}"
            );
        }
        for c in 0..16u8 {
            assert_eq!(
                crate::weight::e2m1_bits(c).to_bits(),
                crate::codec::E2M1[c as usize].to_bits(),
                "e2m1 {c}"
            );
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        assert!(WeightView::mxfp8(&[0; 10], &[0; 1], 1, 32).is_err());
        assert!(WeightView::mxfp4(&[0; 16], &[0; 1], 1, 33).is_err());
        let w = WeightView::f32(&[0; 8], 1, 2).unwrap();
        let mut o = [0f32; 1];
        assert!(matmul(&[1.0; 3], 1, &w, &mut o).is_err());
    }

    /// E8P weights (with no residual, an E8P12 residual, an E81 residual) through
    /// `matmul_with` / `matmul_many_with` on the fast kernels: the integer kernels' result of
    /// the main stage plus the residual's, bit for bit at every M (the E8P GEMM threshold,
    /// the GEMM's, 64) and in a batch, and near the exact product; unaligned bytes run the
    /// exact kernel.
    #[test]
    fn e8p_weights_take_the_integer_kernels_in_fast_mode() {
        use crate::intdot::{int_matmul, IntSrc};
        let mut rng = Rng::new(77);
        let (rows, cols) = (9usize, 96usize);
        let kc = rows * cols / 8;
        // u16 / f32 storage, viewed as bytes (aligned).
        let codes: Vec<u16> = (0..kc).map(|_| rng.next() as u16).collect();
        let rcodes: Vec<u16> = (0..kc).map(|_| rng.next() as u16).collect();
        let scales: Vec<f32> = (0..rows).map(|_| 0.01 + rng.f().abs()).collect();
        let rscales: Vec<f32> = (0..rows).map(|_| 0.001 + rng.f().abs() * 0.1).collect();
        let e81: Vec<u8> = (0..kc).map(|_| rng.next() as u8).collect();
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: plain numbers; the byte view covers exactly the slice.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        let plain = WeightView::e8p(bytes(&codes), bytes(&scales), rows, cols).unwrap();
        let with_e8p = plain
            .with_residual(crate::E8pResidual {
                codes: bytes(&rcodes),
                scales: bytes(&rscales),
                e81: false,
            })
            .unwrap();
        let with_e81 = plain
            .with_residual(crate::E8pResidual {
                codes: &e81,
                scales: bytes(&rscales),
                e81: true,
            })
            .unwrap();
        let main = IntSrc::E8p {
            codes: &codes,
            scales: &scales,
        };
        let res = IntSrc::E8p {
            codes: &rcodes,
            scales: &rscales,
        };
        let res81 = IntSrc::E81 {
            codes: &e81,
            scales: &rscales,
        };
        // The E81 residual has an integer form: the stages are E8P and E81.
        let crate::weight::WeightKind::E8p {
            codes: wc,
            scales: ws,
            resid: wr,
        } = with_e81.kind
        else {
            panic!("an E8P weight")
        };
        assert!(matches!(
            e8p_int_stages(wc, ws, wr, cols),
            Some((IntSrc::E8p { .. }, Some(IntSrc::E81 { .. })))
        ));
        for m in [
            1usize,
            3,
            crate::intdot::E8P_GEMM_MIN_M,
            8,
            32,
            crate::intdot::GEMM_MIN_M,
            64,
        ] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.f()).collect();
            let mut want = vec![0f32; m * rows];
            int_matmul(&x, m, &main, rows, cols, &mut want).unwrap();
            let mut got = vec![f32::NAN; m * rows];
            matmul_with(Kernels::Fast, &x, m, &plain, &mut got).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m}"
            );
            let mut r = vec![0f32; m * rows];
            let mut want81 = want.clone();
            int_matmul(&x, m, &res81, rows, cols, &mut r).unwrap();
            want81.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
            int_matmul(&x, m, &res, rows, cols, &mut r).unwrap();
            want.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
            matmul_with(Kernels::Fast, &x, m, &with_e8p, &mut got).unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m}"
            );
            // In a batch beside other jobs, the same bits.
            let mut o1 = vec![f32::NAN; m * rows];
            let mut o2 = vec![f32::NAN; m * rows];
            let mut o3 = vec![f32::NAN; m * rows];
            let mut jobs = [
                crate::simd::Job::view(&with_e81, &x, m, &mut o1).unwrap(),
                crate::simd::Job::view(&with_e8p, &x, m, &mut o2).unwrap(),
                crate::simd::Job::view(&plain, &x, m, &mut o3).unwrap(),
            ];
            matmul_many_with(Kernels::Fast, &mut jobs).unwrap();
            assert!(
                o2.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m}"
            );
            // E81 residual: the integer kernels, alone and in the batch.
            assert!(
                o1.iter()
                    .zip(&want81)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m}"
            );
            matmul_with(Kernels::Fast, &x, m, &with_e81, &mut got).unwrap();
            assert!(
                got.iter()
                    .zip(&want81)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "m={m}"
            );
            // Near the exact product: within the int8 activations' rounding (half a step,
            // a block's largest value / 254, per term, times |w|) and the f32 sums'.
            let mut e = vec![0f32; m * rows];
            for (fast, w) in [(&o2, &with_e8p), (&o1, &with_e81)] {
                matmul(&x, m, w, &mut e).unwrap();
                for i in 0..m {
                    let xi = &x[i * cols..(i + 1) * cols];
                    let amax: Vec<f32> = xi
                        .chunks_exact(crate::intdot::QBLOCK)
                        .map(|b| b.iter().fold(0f32, |a, v| a.max(v.abs())))
                        .collect();
                    for r in 0..rows {
                        let (mut q8, mut mag) = (0f32, 0f32);
                        for (j, &xv) in xi.iter().enumerate() {
                            let wv = w.get_ref(r, j).abs();
                            q8 += ACT_Q8_TOL * amax[j / crate::intdot::QBLOCK] * wv;
                            mag += (xv * wv).abs();
                        }
                        let (a, b) = (fast[i * rows + r], e[i * rows + r]);
                        assert!(
                            (a - b).abs() <= 1.001 * q8 + 1e-5 * mag,
                            "m={m} ({i},{r}): {a} vs {b}"
                        );
                    }
                }
            }
        }
        // Unaligned bytes: the exact kernel (no copy, no error).
        let mut shifted = vec![0u8; bytes(&codes).len() + 1];
        shifted[1..].copy_from_slice(bytes(&codes));
        let un = WeightView::e8p(&shifted[1..], bytes(&scales), rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f()).collect();
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        matmul_with(Kernels::Fast, &x, 1, &un, &mut a).unwrap();
        matmul(&x, 1, &un, &mut b).unwrap();
        assert_eq!(a, b);
        // An E81 residual with unaligned scales: the exact kernel too.
        let mut rs = vec![0u8; bytes(&rscales).len() + 1];
        rs[1..].copy_from_slice(bytes(&rscales));
        let un81 = plain
            .with_residual(crate::E8pResidual {
                codes: &e81,
                scales: &rs[1..],
                e81: true,
            })
            .unwrap();
        matmul_with(Kernels::Fast, &x, 1, &un81, &mut a).unwrap();
        matmul(&x, 1, &un81, &mut b).unwrap();
        assert_eq!(a, b);
    }

    /// Per-element error bound of the int8 activations relative to the output's scale: half a
    /// quantization step (1/254 of a block's largest value) per term.
    const ACT_Q8_TOL: f32 = 1.0 / 254.0;
}
