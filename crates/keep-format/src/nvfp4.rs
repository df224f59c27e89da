//! NVFP4 as compressed-tensors writes it (`format: "nvfp4-pack-quantized"`, llm-compressor's
//! `NVFP4` / `NVFP4A16` schemes): FP4 E2M1 values in groups of 16 columns, each group with an
//! FP8 E4M3 scale, and one f32 global scale per tensor. A `[rows, cols]` weight
//! `<base>.weight` is stored as three tensors:
//!
//! - `<base>.weight_packed`: `U8 [rows, cols/2]`, element `2k` of a row in the **low** nibble of
//!   byte `k`, element `2k+1` in the high nibble; a nibble is E2M1 (bit 3 the sign, bits 0..3
//!   the index into 0, 0.5, 1, 1.5, 2, 3, 4, 6);
//! - `<base>.weight_scale`: `F8_E4M3 [rows, cols/16]`, one scale per row and 16 columns;
//! - `<base>.weight_global_scale`: `F32 [1]`, the tensor's global scale `g`;
//! - `<base>.input_global_scale`: `F32 [1]`, in checkpoints of the W4A4 `NVFP4` scheme only
//!   (below).
//!
//! `w[i, j] = e2m1(q[i, j]) · (s[i, j/16] / g)`, in f32: the factor `s / g` rounded to f32
//! first, then the product (the order compressed-tensors' `_dequantize` computes in; its
//! `decompress_weight` then casts the product to bf16, keep keeps the f32 product).
//! `g` is large (`448 · 6 / amax`): it divides the stored scale.
//!
//! Pinned to neuralmagic/compressed-tensors commit 52792be02ec09e59f3517104e755a02d0e003fbb:
//! the packing is `pack_fp4_to_uint8` / `unpack_fp4_from_uint8` in
//! `src/compressed_tensors/compressors/quantized_compressors/fp4_quantized.py` (the
//! `NVFP4PackedCompressor`, whose parameters are `weight_packed`, `weight_scale`,
//! `weight_global_scale`); the formula is `_dequantize` in
//! `src/compressed_tensors/quantization/lifecycle/forward.py` (`scale =
//! scale.to(global_scale.dtype) / global_scale`, then `x_q · scale`); the encoder's scales are
//! `generate_gparam` (`g = 448 · 6 / amax`) and `calculate_qparams` (`s = fp8(g · amax₁₆ / 6)`,
//! a zero scale replaced by 0.125) in `src/compressed_tensors/quantization/utils/helpers.py`,
//! its rounding `FP4_E2M1_DATA.cast_to_fp4` (nearest, ties to even) in `quant_args.py`.
//!
//! Activations: the `NVFP4` (W4A4) scheme also stores a per-tensor `input_global_scale` for
//! quantizing activations to FP4 at run time; keep multiplies these weights with its own
//! activation handling (f32 on the exact kernels, the fast kernels' own), so the part is
//! optional and never read (checked for dtype and shape when present), and `keep synth` writes
//! the weight-only `NVFP4A16` scheme, which has none.
//!
//! Integer form: none. The fast integer kernels take one f32 factor per 32 columns; NVFP4 has
//! two independent FP8 scales per 32 columns, and no int8 rescaling of one half makes them one
//! factor exactly (their ratio is any ratio of E4M3 values). The fast kernels run it on the
//! decoded-row f32 path, which is the exact one.

use crate::fp4::{e2m1_to_f32_ref, f32_to_e2m1, E2M1_MAX, E2M1_PAIR_LUT};
use crate::fp8::{e4m3_to_f32, e4m3_to_f32_ref, f32_to_e4m3, E4M3_MAX};
use crate::spec::{Encoded, FormatSpec, PartKind, PartSpec};
use crate::FormatError;

/// Columns per FP8 scale.
pub const GROUP: usize = 16;

/// The registry entry.
pub static NVFP4: FormatSpec = FormatSpec {
    name: "nvfp4",
    label: "nvfp4 (compressed-tensors nvfp4-pack-quantized)",
    parts: &[
        PartSpec {
            suffix: ".weight_packed",
            dtype: "U8",
            shape: |r, c| vec![r as u64, (c / 2) as u64],
            kind: PartKind::Rows(|c| c / 2),
        },
        PartSpec {
            suffix: ".weight_scale",
            dtype: "F8_E4M3",
            shape: |r, c| vec![r as u64, (c / GROUP) as u64],
            kind: PartKind::Rows(|c| c / GROUP),
        },
        PartSpec {
            suffix: ".weight_global_scale",
            dtype: "F32",
            shape: |_, _| vec![1],
            kind: PartKind::Tensor,
        },
        PartSpec {
            suffix: ".input_global_scale",
            dtype: "F32",
            shape: |_, _| vec![1],
            kind: PartKind::Optional,
        },
    ],
    col_multiple: GROUP,
    logical: |s| match *s {
        [r, w] if w > 0 => Some((r as usize, w as usize * 2)),
        _ => None,
    },
    decode_row_ref,
    decode_row,
    encode_ref: encode,
    int: None,
    hf_quantization_config: Some(HF_QUANTIZATION_CONFIG),
};

/// compressed-tensors' `quantization_config` as a checkpoint quantized with llm-compressor's
/// `NVFP4A16` scheme declares it (weights only: FP4 in groups of 16 with FP8 scales and a
/// global scale, strategy `tensor_group`; activations left to the runtime), the routed experts
/// quantized and attention, shared experts, dense MLPs, routers and head ignored (bf16).
pub const HF_QUANTIZATION_CONFIG: &str = r#"{
  "quant_method": "compressed-tensors",
  "format": "nvfp4-pack-quantized",
  "quantization_status": "compressed",
  "kv_cache_scheme": null,
  "config_groups": {"group_0": {
    "targets": ["Linear"],
    "format": "nvfp4-pack-quantized",
    "input_activations": null,
    "output_activations": null,
    "weights": {"type": "float", "num_bits": 4, "group_size": 16, "strategy": "tensor_group",
      "symmetric": true, "dynamic": false, "actorder": null, "block_structure": null,
      "observer": "minmax", "observer_kwargs": {}}
  }},
  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|down)_proj.*", "re:.*mlp\\.gate$"]
}"#;

/// The global scale from its four little-endian bytes.
fn global(parts: &[&[u8]]) -> f32 {
    let g = parts[2];
    f32::from_le_bytes([g[0], g[1], g[2], g[3]])
}

fn decode_row_ref(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [f32]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    let ng = cols / GROUP;
    let g = global(parts);
    for (j, o) in dst[..cols].iter_mut().enumerate() {
        let byte = row[j / 2];
        let nib = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
        let s = e4m3_to_f32_ref(parts[1][r * ng + j / GROUP]);
        *o = e2m1_to_f32_ref(nib) * (s / g);
    }
}

fn decode_row(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [f32]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    let ng = cols / GROUP;
    let sc = &parts[1][r * ng..(r + 1) * ng];
    let g = global(parts);
    for ((d, p), &s) in dst[..cols]
        .chunks_exact_mut(GROUP)
        .zip(row.chunks_exact(GROUP / 2))
        .zip(sc)
    {
        let f = e4m3_to_f32(s) / g;
        for (d2, &b) in d.chunks_exact_mut(2).zip(p) {
            let [lo, hi] = E2M1_PAIR_LUT[b as usize];
            d2[0] = lo * f;
            d2[1] = hi * f;
        }
    }
}

/// Encode a row-major `[rows, cols]` matrix as compressed-tensors does: `weight_packed`,
/// `weight_scale`, `weight_global_scale` bytes (little-endian). The global scale is the whole
/// matrix's (`448 · 6 / amax`, 1 for an all-zero matrix).
pub fn encode(w: &[f32], rows: usize, cols: usize) -> Encoded {
    if !cols.is_multiple_of(GROUP) {
        return Err(FormatError::Unaligned {
            what: "nvfp4 weight",
            cols,
            multiple: GROUP,
        });
    }
    if w.len() != rows * cols {
        return Err(FormatError::LengthMismatch {
            what: "nvfp4 weight",
            expected: rows * cols,
            got: w.len(),
        });
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(FormatError::LengthMismatch {
            what: "nvfp4 finite weight (a NaN or infinite weight at this index)",
            expected: i,
            got: i,
        });
    }
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let g = if amax > 0.0 {
        E4M3_MAX * E2M1_MAX / amax
    } else {
        1.0
    };
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = Vec::with_capacity(rows * cols / GROUP);
    for (x, p) in w
        .chunks_exact(GROUP)
        .zip(packed.chunks_exact_mut(GROUP / 2))
    {
        let gmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut code = f32_to_e4m3(g * (gmax / E2M1_MAX));
        if e4m3_to_f32(code) == 0.0 {
            code = f32_to_e4m3(0.125);
        }
        scales.push(code);
        let f = e4m3_to_f32(code) / g;
        let q = |v: f32| f32_to_e2m1((v / f).clamp(-E2M1_MAX, E2M1_MAX));
        for (b, x2) in p.iter_mut().zip(x.chunks_exact(2)) {
            *b = q(x2[0]) | (q(x2[1]) << 4);
        }
    }
    Ok(vec![packed, scales, g.to_le_bytes().to_vec(), vec![]])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-computed from the definition: E2M1 nibbles, E4M3 scales, the global scale dividing.
    #[test]
    fn decodes_hand_computed_values() {
        // Row of 32: bytes 0x21 (elements 0.5 then 1.0), 0xF9 (−0.5 then −6), 0x07 (6 then 0),
        // the rest zero. Scales: group 0 E4M3 0x40 = 2.0, group 1 0x38 = 1.0. Global scale 4.
        let mut packed = [0u8; 16];
        packed[0] = 0x21;
        packed[1] = 0xF9;
        packed[2] = 0x07;
        packed[8] = 0x5C; // group 1, elements 16, 17: −2 (0xC) then 3 (0x5)
        let scales = [0x40u8, 0x38];
        let g = 4.0f32.to_le_bytes();
        let parts: [&[u8]; 3] = [&packed, &scales, &g];
        let mut want = [0f32; 32];
        want[..6].copy_from_slice(&[0.25, 0.5, -0.25, -3.0, 3.0, 0.0]);
        want[16] = -0.5;
        want[17] = 0.75;
        for dec in [decode_row_ref, decode_row] {
            let mut d = [f32::NAN; 32];
            dec(&parts, 32, 0, &mut d);
            assert_eq!(d, want);
        }
        // An E4M3 subnormal scale (0x01 = 2⁻⁹) and a global scale of 0.5.
        let half = 0.5f32.to_le_bytes();
        let parts: [&[u8]; 3] = [&packed, &[0x01, 0x38], &half];
        let mut d = [0f32; 32];
        decode_row_ref(&parts, 32, 0, &mut d);
        assert_eq!(d[1], 1.0 * (2f32.powi(-9) / 0.5));
        assert_eq!(d[17], 3.0 * 2.0);
    }

    #[test]
    fn every_nibble_and_scale_decodes_fast_as_the_reference() {
        let packed: Vec<u8> = (0..=255u8).collect();
        let scales: Vec<u8> = (0..32u8).map(|k| k.wrapping_mul(37) & 0x7E).collect();
        let g = 3.0f32.to_le_bytes();
        let parts: [&[u8]; 3] = [&packed, &scales, &g];
        let (mut a, mut b) = (vec![0f32; 512], vec![0f32; 512]);
        decode_row_ref(&parts, 512, 0, &mut a);
        decode_row(&parts, 512, 0, &mut b);
        for (j, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.to_bits(), y.to_bits(), "element {j}");
        }
    }

    #[test]
    fn encodes_as_compressed_tensors_does() {
        // amax 12: g = 448·6/12 = 224. Group 0 amax 12 → s = fp8(224·2) = 448, factor 2;
        // group 1 amax 1 → s = fp8(224/6) = 36 (37.33 rounds to the E4M3 grid's 36).
        let mut w = vec![0f32; 32];
        w[0] = 12.0;
        w[1] = -3.0;
        w[16] = 1.0;
        let e = encode(&w, 1, 32).unwrap();
        assert_eq!(f32::from_le_bytes(e[2][..].try_into().unwrap()), 224.0);
        assert_eq!(e4m3_to_f32(e[1][0]), 448.0);
        assert_eq!(e4m3_to_f32(e[1][1]), 36.0);
        // 12 / 2 = 6 (code 7), −3 / 2 = −1.5 (code 0xB): low nibble first.
        assert_eq!(e[0][0], 0xB7);
        let mut d = vec![0f32; 32];
        decode_row_ref(&[&e[0], &e[1], &e[2]], 32, 0, &mut d);
        assert_eq!((d[0], d[1]), (12.0, -3.0));
        assert!((d[16] - 1.0).abs() < 0.1);
        // An all-zero group takes the scale 0.125, and decodes to zeros.
        let e = encode(&[0f32; 16], 1, 16).unwrap();
        assert_eq!(e4m3_to_f32(e[1][0]), 0.125);
        assert!(encode(&[f32::NAN; 16], 1, 16).is_err());
        assert!(encode(&[0f32; 8], 1, 8).is_err());
    }
}
