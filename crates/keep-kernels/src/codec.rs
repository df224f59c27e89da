//! Byte helpers the kernels inline (little-endian f32 / bf16 at an element index) and the
//! round-to-nearest-even f32 → E4M3FN value used by fake quantization. The element decode
//! tables themselves (E4M3FN, E2M1, E8M0, bf16) are keep-format's — one definition, checked
//! against `ml_dtypes` by the conformance suite — and are re-exported here under the names the
//! kernels use.

pub use keep_format::bf16::bf16_to_f32;
pub use keep_format::e8m0::e8m0_to_f32;
pub use keep_format::fp4::E2M1_LUT as E2M1;
pub use keep_format::fp8::{e4m3_to_f32_ref, f32_to_e4m3, E4M3_LUT as E4M3};

/// Little-endian f32 at element `i` of a byte slice.
#[inline]
pub fn f32_at(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([
        bytes[4 * i],
        bytes[4 * i + 1],
        bytes[4 * i + 2],
        bytes[4 * i + 3],
    ])
}

/// Little-endian bf16 at element `i` of a byte slice, as f32.
#[inline]
pub fn bf16_at(bytes: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
}

/// Round an f32 to the nearest E4M3FN value (ties to even), saturating at ±448, returned as f32.
/// This is what `mx.from_fp8(mx.to_fp8(x))` computes (checked equal to ml_dtypes on 200k values).
#[inline]
pub fn round_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let r = if a < 2f32.powi(-6) {
        // Subnormal range: multiples of 2^-9.
        (a * 512.0).round_ties_even() / 512.0
    } else {
        // Keep 3 mantissa bits, ties to even.
        let bits = a.to_bits();
        let lsb = (bits >> 20) & 1;
        let rounded = (bits + 0x7FFFF + lsb) & !0xFFFFF;
        f32::from_bits(rounded)
    };
    let r = r.min(448.0);
    if x.is_sign_negative() {
        -r
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_spot_values() {
        assert_eq!(E4M3[0x7E], 448.0);
        assert_eq!(E4M3[0x01], 2f32.powi(-9));
        assert_eq!(E4M3[0x38], 1.0);
        assert!(E4M3[0x7F].is_nan() && E4M3[0xFF].is_nan());
        assert_eq!(E4M3[0x80].to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn round_e4m3_is_identity_on_codes_and_nearest_elsewhere() {
        let finite: Vec<f32> = (0..256u32)
            .map(|b| E4M3[b as usize])
            .filter(|v| v.is_finite())
            .collect();
        for &v in &finite {
            assert_eq!(round_e4m3(v).to_bits(), v.to_bits());
        }
        // Nearest, ties to even, on a dense sweep.
        let mut pos: Vec<f32> = finite.iter().copied().filter(|v| *v >= 0.0).collect();
        pos.sort_by(f32::total_cmp);
        pos.dedup();
        let mut x = 1e-5f32;
        while x < 448.0 {
            let r = round_e4m3(x);
            let best = pos
                .iter()
                .copied()
                .min_by(|a, b| (a - x).abs().total_cmp(&(b - x).abs()))
                .unwrap();
            assert_eq!((r - x).abs(), (best - x).abs(), "x={x} r={r} best={best}");
            x *= 1.0173;
        }
        assert_eq!(round_e4m3(1.0625), 1.0);
        assert_eq!(round_e4m3(1.1875), 1.25);
        assert_eq!(round_e4m3(-1000.0), -448.0);
    }

    #[test]
    fn e8m0_values() {
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
    }
}
