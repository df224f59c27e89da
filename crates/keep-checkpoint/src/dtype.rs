//! The element types a safetensors header may name, with their sizes in bits.
//!
//! Only names are handled here: decoding the values is `keep-format`'s business. Sub-byte types
//! (`F4`) are counted in bits so that byte sizes of packed tensors can be checked exactly.

use std::fmt;

/// A safetensors dtype string (`"F8_E4M3"`, `"BF16"`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum Dtype {
    BOOL,
    U8,
    I8,
    F8_E4M3,
    F8_E5M2,
    F8_E8M0,
    F4,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    /// Every dtype, for tests and tables.
    pub const ALL: [Dtype; 17] = [
        Dtype::BOOL,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E4M3,
        Dtype::F8_E5M2,
        Dtype::F8_E8M0,
        Dtype::F4,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Parse the header spelling; `None` for an unknown dtype.
    pub fn parse(s: &str) -> Option<Dtype> {
        Dtype::ALL.iter().copied().find(|d| d.name() == s)
    }

    /// The header spelling.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F4 => "F4",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            Dtype::F4 => 4,
            Dtype::BOOL | Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 | Dtype::F8_E5M2 => 8,
            Dtype::F8_E8M0 => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Bytes taken by `numel` elements, or `None` when a sub-byte count does not fill whole
    /// bytes or the count overflows.
    pub fn bytes_for(self, numel: u64) -> Option<u64> {
        let bits = numel.checked_mul(self.bits() as u64)?;
        (bits % 8 == 0).then_some(bits / 8)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::parse(d.name()), Some(d));
        }
        assert_eq!(Dtype::parse("F8_E4M3FN"), None);
        assert_eq!(Dtype::parse("bf16"), None);
    }

    #[test]
    fn sub_byte_sizes() {
        assert_eq!(Dtype::F4.bytes_for(4), Some(2));
        assert_eq!(Dtype::F4.bytes_for(3), None);
        assert_eq!(Dtype::BF16.bytes_for(3), Some(6));
        assert_eq!(Dtype::U64.bytes_for(u64::MAX), None);
    }
}
