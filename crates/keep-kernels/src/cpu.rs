//! What the CPU can run and whether a call's operands fit: the SIMD [`Level`] detected at run
//! time (capped by `KEEP_SIMD`), the extra instruction sets the integer and bf16 dot products
//! use (AVX-512 VNNI, AVX-VNNI, AVX-512 BF16), the threading threshold [`PAR_MIN_MACS`], and
//! [`check_operands`], shared by every kernel. A leaf module: it imports no other module of
//! the crate, so `matmul`, `simd`, `weight`, `e8p` and `intdot` all depend on it and not on
//! each other for these.

use crate::{KernelError, Result};

/// Below this many multiply-adds a call stays on the calling thread: waking rayon's workers
/// costs more than a small GEMV saves. Measured on keep-tiny decode (2-core VM, 64 tokens,
/// `model_bench`, two alternated runs): 1 << 18 gave 446–453 tok/s once a token's top-4
/// experts ran as one `matmul_many` (262,144 MACs, just over the line), 1 << 20 gave 697–719,
/// 1 << 22 gave 745–749 — as fast as one thread (739–742) — and 1 << 21 the same (726–737).
/// 1 << 21 keeps V4.1-Flash's smallest resident GEMV threaded (`wkv`, 512 × 4096 = 2 M MACs:
/// 13.6 GB/s threaded vs 10.6 GB/s on one thread in the kill test's bf16 chain).
pub const PAR_MIN_MACS: usize = 1 << 21;

/// A SIMD level a kernel can run at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Plain Rust (the scalar references' arithmetic).
    Scalar,
    /// NEON (aarch64).
    Neon,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F/BW/VL/DQ + FMA + F16C.
    Avx512,
}

impl Level {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Neon => "neon",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

/// The best level this CPU supports (ignoring `KEEP_SIMD`).
pub fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("f16c")
        {
            return Level::Avx512;
        }
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Level::Avx2;
        }
        Level::Scalar
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            return Level::Neon;
        }
        Level::Scalar
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Level::Scalar
    }
}

/// The level kernels run at: [`detected`], capped by `KEEP_SIMD` (read once).
pub fn level() -> Level {
    use std::sync::OnceLock;
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        let d = detected();
        let cap = match std::env::var("KEEP_SIMD").ok().as_deref() {
            Some("scalar") => Level::Scalar,
            Some("avx2") => Level::Avx2,
            Some("neon") => Level::Neon,
            _ => d,
        };
        d.min(cap)
    })
}

/// AVX2 and FMA (the f32 dot products of `matmul` and the row decoders).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static F: OnceLock<bool> = OnceLock::new();
        *F.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 VNNI (`vpdpbusd` on 512-bit registers), on top of [`Level::Avx512`].
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        detected() >= Level::Avx512 && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 VBMI (`vpermb`, `vpermi2b`, `vpmultishiftqb`: byte tables in registers), on top
/// of [`Level::Avx512`].
pub fn has_avx512_vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        detected() >= Level::Avx512 && is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX-512 BF16 (`vdpbf16ps`), on top of [`Level::Avx512`].
pub fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        detected() >= Level::Avx512 && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Check the operands of `out[M×rows] = x[M×cols] · Wᵀ` (shared by every kernel).
pub(crate) fn check_operands(
    x: &[f32],
    m: usize,
    rows: usize,
    cols: usize,
    out: &[f32],
) -> Result<()> {
    let (xn, on) = match (m.checked_mul(cols), m.checked_mul(rows)) {
        (Some(a), Some(b)) => (a, b),
        _ => {
            return Err(KernelError::Shape {
                what: "operands",
                msg: format!("{m} rows of {cols}/{rows} overflow"),
            })
        }
    };
    if x.len() != xn {
        return Err(KernelError::Operand {
            what: "x",
            expected: xn,
            got: x.len(),
        });
    }
    if out.len() != on {
        return Err(KernelError::Operand {
            what: "out",
            expected: on,
            got: out.len(),
        });
    }
    Ok(())
}

/// The compute threads every parallel kernel runs on: the process's one worker pool (rayon's
/// global pool; `RAYON_NUM_THREADS`, else one per core, unless [`set_threads`] chose).
pub fn threads() -> usize {
    rayon::current_num_threads()
}

/// Size the process's worker pool to `n` threads. Only before any kernel has run: once the
/// pool exists its size is fixed, and a different `n` is refused (the same `n` is accepted).
pub fn set_threads(n: usize) -> std::result::Result<(), String> {
    if n == 0 {
        return Err("0 compute threads: give at least 1".into());
    }
    match rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
    {
        Ok(()) => Ok(()),
        Err(_) if threads() == n => Ok(()),
        Err(e) => Err(format!(
            "cannot size the worker pool to {n} threads: it already runs {} ({e})",
            threads()
        )),
    }
}
