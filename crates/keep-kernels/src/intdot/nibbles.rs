//! The 4-bit nibble decoder of MLX affine-4 rows (element `2k` in the low nibble of byte `k`),
//! a leaf shared by the affine-4 dispatch (`affine4`), its x86 levels (`affine4_x86`) and the
//! scalar contract's decoded rows; what the nibbles mean (scale and bias) is `affine4`'s.

/// Nibbles of `packed` (element `2k` in the low nibble of byte `k`, MLX's order) as int8
/// into `dst` (`2 · packed.len()` values, each in [0, 15]).
#[inline]
pub fn decode_nibbles(packed: &[u8], dst: &mut [i8]) {
    for (d2, &b) in dst.chunks_exact_mut(2).zip(packed) {
        d2[0] = (b & 0x0F) as i8;
        d2[1] = (b >> 4) as i8;
    }
}
