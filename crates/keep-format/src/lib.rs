//! `keep-format`: the number formats and block codecs keep reads and writes.
//!
//! What it is: bf16, f16, FP8 E4M3FN/E5M2, E8M0, FP4 E2M1 element codecs; MXFP8/MXFP4
//! rows in MLX's layout; DeepSeek FP8 block-scaled tensors (E8M0, power-of-two f32 and
//! V3-style `scale_inv` scales); MLX affine 2/3/4/8-bit (packing, decode, `mx.quantize`'s
//! rule); the format [`registry`], one entry per table-described format (INT4 group 32,
//! compressed-tensors' `pack-quantized`, [`int4g32`]; NVFP4, compressed-tensors'
//! `nvfp4-pack-quantized`, [`nvfp4`]). Each format documents its byte layout and
//! decode formula, has a `_ref` scalar implementation written from the definition and a
//! fast path tested against it on every code. What it is not: I/O, tensor naming,
//! threading or GEMV kernels (those live in `keep-checkpoint` and `keep-kernels`).
//! Nothing here prints or panics on input; shape and length problems come back as
//! [`FormatError`]. Depends on `half` and `thiserror` only.

pub mod affine;
pub mod bf16;
pub mod e81;
pub mod e8m0;
pub mod e8p;
pub mod error;
pub mod f16;
pub mod fp4;
pub mod fp8;
pub mod fp8block;
pub mod int4g32;
mod minifloat;
pub mod mlx_affine;
pub mod mx;
pub mod nvfp4;
pub mod registry;
pub mod spec;

#[cfg(test)]
mod testutil;

pub use error::FormatError;

/// The element formats this crate decodes, for reports and conformance dumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElementFormat {
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
    /// FP8 E4M3FN (no infinity).
    E4m3,
    /// FP8 E5M2 (IEEE-like).
    E5m2,
    /// E8M0 power-of-two scale.
    E8m0,
    /// FP4 E2M1.
    E2m1,
}

impl ElementFormat {
    /// Every variant, in declaration order.
    pub const ALL: [ElementFormat; 7] = [
        ElementFormat::Bf16,
        ElementFormat::F16,
        ElementFormat::F32,
        ElementFormat::E4m3,
        ElementFormat::E5m2,
        ElementFormat::E8m0,
        ElementFormat::E2m1,
    ];

    /// Storage bits per element.
    pub const fn bits(self) -> u32 {
        match self {
            ElementFormat::Bf16 | ElementFormat::F16 => 16,
            ElementFormat::F32 => 32,
            ElementFormat::E4m3 | ElementFormat::E5m2 | ElementFormat::E8m0 => 8,
            ElementFormat::E2m1 => 4,
        }
    }

    /// The `ml_dtypes` / NumPy dtype name (`"bfloat16"`, `"float8_e4m3fn"`, ...),
    /// which is what the Python conformance suite keys on.
    pub const fn name(self) -> &'static str {
        match self {
            ElementFormat::Bf16 => "bfloat16",
            ElementFormat::F16 => "float16",
            ElementFormat::F32 => "float32",
            ElementFormat::E4m3 => "float8_e4m3fn",
            ElementFormat::E5m2 => "float8_e5m2",
            ElementFormat::E8m0 => "float8_e8m0fnu",
            ElementFormat::E2m1 => "float4_e2m1fn",
        }
    }

    /// The safetensors dtype string for formats that have one (`F8_E4M3`, `F8_E8M0`, ...).
    /// E2M1 has none: DeepSeek stores packed nibbles as `I8`.
    pub const fn safetensors_dtype(self) -> Option<&'static str> {
        match self {
            ElementFormat::Bf16 => Some("BF16"),
            ElementFormat::F16 => Some("F16"),
            ElementFormat::F32 => Some("F32"),
            ElementFormat::E4m3 => Some("F8_E4M3"),
            ElementFormat::E5m2 => Some("F8_E5M2"),
            ElementFormat::E8m0 => Some("F8_E8M0"),
            ElementFormat::E2m1 => None,
        }
    }
}

impl std::fmt::Display for ElementFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Every code of the 8-bit and 4-bit element formats decoded by the fast path:
/// 256 E4M3FN, 256 E5M2, 256 E8M0 and 16 E2M1 entries (784 in all), in that order
/// and by ascending code. For the Python conformance suite to compare against
/// `ml_dtypes` (NaN compared as NaN, signed zeros by bits).
pub fn dump_all_codes() -> Vec<(ElementFormat, u8, f32)> {
    let mut v = Vec::with_capacity(3 * 256 + 16);
    v.extend((0..=255u8).map(|c| (ElementFormat::E4m3, c, fp8::e4m3_to_f32(c))));
    v.extend((0..=255u8).map(|c| (ElementFormat::E5m2, c, fp8::e5m2_to_f32(c))));
    v.extend((0..=255u8).map(|c| (ElementFormat::E8m0, c, e8m0::e8m0_to_f32(c))));
    v.extend((0..16u8).map(|c| (ElementFormat::E2m1, c, fp4::e2m1_to_f32(c))));
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::same;

    #[test]
    fn dump_matches_refs() {
        let d = dump_all_codes();
        assert_eq!(d.len(), 784);
        for (f, c, v) in d {
            let r = match f {
                ElementFormat::E4m3 => fp8::e4m3_to_f32_ref(c),
                ElementFormat::E5m2 => fp8::e5m2_to_f32_ref(c),
                ElementFormat::E8m0 => e8m0::e8m0_to_f32_ref(c),
                ElementFormat::E2m1 => fp4::e2m1_to_f32_ref(c),
                _ => unreachable!(),
            };
            assert!(same(v, r), "{f} {c:#04x}");
        }
    }

    #[test]
    fn element_format_meta() {
        let bits: Vec<u32> = ElementFormat::ALL.iter().map(|f| f.bits()).collect();
        assert_eq!(bits, [16, 16, 32, 8, 8, 8, 4]);
        assert_eq!(ElementFormat::E4m3.to_string(), "float8_e4m3fn");
        assert_eq!(ElementFormat::E8m0.safetensors_dtype(), Some("F8_E8M0"));
    }

    /// Tidy: every source file opens with a `//!` paragraph.
    #[test]
    fn every_file_opens_with_module_doc() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "rs") {
                let s = std::fs::read_to_string(&p).unwrap();
                assert!(
                    s.starts_with("//!"),
                    "{} must open with a //! paragraph",
                    p.display()
                );
                n += 1;
            }
        }
        assert!(n >= 10);
    }
}
