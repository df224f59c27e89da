//! Element codecs the kernels inline: FP8 E4M3FN, FP4 E2M1, E8M0 and bf16 to f32, and the
//! round-to-nearest-even f32 → E4M3FN value used by fake quantization.
//!
//! Decode formulas (OCP / DeepSeek / MLX agree):
//! - E4M3FN `S EEEE MMM`, bias 7: E>0 → (-1)^S (1+M/8) 2^(E-7); E=0 → (-1)^S M 2^-9;
//!   0x7F/0xFF are NaN; no infinity.
//! - E2M1 `S EE M`: codes 0..7 → 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 the negatives.
//! - E8M0 byte b → 2^(b-127) (b = 0 → 2^-127, a subnormal f32); 0xFF → NaN.
//! - bf16 → the top 16 bits of an f32.

use std::sync::LazyLock;

/// E4M3FN byte → f32, computed from the definition.
pub fn e4m3_to_f32_ref(b: u8) -> f32 {
    let s = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 0xF && (b & 7) == 7 {
        return f32::NAN;
    }
    if e == 0 {
        s * m * 2f32.powi(-9)
    } else {
        s * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// The E4M3FN table.
pub static E4M3: LazyLock<[f32; 256]> = LazyLock::new(|| {
    let mut t = [0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32_ref(i as u8);
    }
    t
});

/// E2M1 code (low 4 bits) → f32.
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E8M0 byte → f32 scale.
#[inline]
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        _ => f32::from_bits((b as u32) << 23),
    }
}

/// bf16 bits → f32.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

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
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
    }
}
