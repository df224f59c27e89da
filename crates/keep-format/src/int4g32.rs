//! INT4 group 32, symmetric: compressed-tensors' `pack-quantized` format with `num_bits: 4`,
//! `group_size: 32`, `symmetric: true` (the routed experts of Moonshot's Kimi-K2-Thinking
//! release). A `[rows, cols]` weight `<base>.weight` is stored as three tensors:
//!
//! - `<base>.weight_packed`: `I32 [rows, cols/8]`, eight 4-bit values per int32, element `j`
//!   of a row in word `j/8` at bits `4·(j%8)..4·(j%8)+4` (so, little-endian, byte `k` of a row
//!   holds element `2k` in its low nibble and `2k+1` in its high nibble), each value stored as
//!   `q + 8` for the signed integer `q` in [−8, 7];
//! - `<base>.weight_scale`: `BF16 [rows, cols/32]`, one scale per row and 32 columns;
//! - `<base>.weight_shape`: `I32 [2]`, the logical `[rows, cols]`.
//!
//! `w[i, j] = q[i, j] · s[i, j/32]`, computed in f32 (exact: a 4-bit integer times a bf16).
//!
//! The packing is compressed-tensors' `pack_to_int32` / `unpack_from_int32` (packed along the
//! columns, `offset = 1 << (num_bits − 1)`), as read at neuralmagic/compressed-tensors commit
//! 0199c6e7f96f7ac581138849ed8c7140f9842fe1,
//! `src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py`. The encoder
//! here (what `keep synth` writes) takes each group's scale as `amax / 7.5` rounded to bf16 and
//! `q = clamp(round_half_even(x / s), −8, 7)`; readers never depend on how a scale was chosen.

use crate::bf16::{bf16_to_f32, f32_to_bf16};
use crate::spec::{Encoded, FormatSpec, IntForm, PartKind, PartSpec};
use crate::FormatError;

/// Columns per scale.
pub const GROUP: usize = 32;

/// The registry entry.
pub static INT4_G32: FormatSpec = FormatSpec {
    name: "int4-g32",
    label: "int4-g32 (compressed-tensors pack-quantized)",
    parts: &[
        PartSpec {
            suffix: ".weight_packed",
            dtype: "I32",
            shape: |r, c| vec![r as u64, (c / 8) as u64],
            kind: PartKind::Rows(|c| c / 2),
        },
        PartSpec {
            suffix: ".weight_scale",
            dtype: "BF16",
            shape: |r, c| vec![r as u64, (c / GROUP) as u64],
            kind: PartKind::Rows(|c| c / GROUP * 2),
        },
        PartSpec {
            suffix: ".weight_shape",
            dtype: "I32",
            shape: |_, _| vec![2],
            kind: PartKind::Fill(shape_bytes),
        },
    ],
    col_multiple: GROUP,
    logical: |s| match *s {
        [r, w] if w > 0 => Some((r as usize, w as usize * 8)),
        _ => None,
    },
    decode_row_ref,
    decode_row,
    encode_ref: encode,
    int: Some(&INT_FORM),
    hf_quantization_config: Some(HF_QUANTIZATION_CONFIG),
};

/// compressed-tensors' `quantization_config` as Kimi-K2-Thinking's `config.json` declares it:
/// one config group of symmetric 4-bit integer weights in groups of 32 targeting `Linear`;
/// attention, the shared experts, the dense MLPs, the routers and the head ignored (bf16).
pub const HF_QUANTIZATION_CONFIG: &str = r#"{
  "quant_method": "compressed-tensors",
  "format": "pack-quantized",
  "quantization_status": "compressed",
  "kv_cache_scheme": null,
  "config_groups": {"group_0": {
    "targets": ["Linear"],
    "input_activations": null,
    "output_activations": null,
    "weights": {"type": "int", "num_bits": 4, "group_size": 32, "strategy": "group",
      "symmetric": true, "dynamic": false, "actorder": null, "block_structure": null,
      "observer": "minmax", "observer_kwargs": {}}
  }},
  "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|down)_proj.*", "re:.*mlp\\.gate$"]
}"#;

static INT_FORM: IntForm = IntForm {
    decode_ref: int_row_ref,
    decode: int_row,
    block_factors,
};

/// The stored 4-bit value of element `j` of a packed row, from the int32 words.
fn stored_ref(row: &[u8], j: usize) -> u32 {
    let w = j / 8;
    let word = i32::from_le_bytes([row[4 * w], row[4 * w + 1], row[4 * w + 2], row[4 * w + 3]]);
    ((word as u32) >> (4 * (j % 8))) & 0xF
}

fn scale_at(scales: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([scales[2 * i], scales[2 * i + 1]]))
}

fn decode_row_ref(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [f32]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    let ng = cols / GROUP;
    for (j, o) in dst[..cols].iter_mut().enumerate() {
        let q = stored_ref(row, j) as i32 - 8;
        *o = q as f32 * scale_at(parts[1], r * ng + j / GROUP);
    }
}

fn decode_row(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [f32]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    let ng = cols / GROUP;
    let sc = &parts[1][r * ng * 2..(r + 1) * ng * 2];
    for ((d, p), s) in dst[..cols]
        .chunks_exact_mut(GROUP)
        .zip(row.chunks_exact(GROUP / 2))
        .zip(sc.chunks_exact(2))
    {
        let s = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        for (d2, &b) in d.chunks_exact_mut(2).zip(p) {
            d2[0] = ((b & 0xF) as i32 - 8) as f32 * s;
            d2[1] = ((b >> 4) as i32 - 8) as f32 * s;
        }
    }
}

fn int_row_ref(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [i8]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    for (j, o) in dst[..cols].iter_mut().enumerate() {
        *o = (stored_ref(row, j) as i32 - 8) as i8;
    }
}

fn int_row(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [i8]) {
    let row = &parts[0][r * cols / 2..(r + 1) * cols / 2];
    for (d2, &b) in dst[..cols].chunks_exact_mut(2).zip(row) {
        d2[0] = (b & 0xF) as i8 - 8;
        d2[1] = (b >> 4) as i8 - 8;
    }
}

fn block_factors(parts: &[&[u8]], cols: usize, r: usize, dst: &mut [f32]) {
    let ng = cols / GROUP;
    for (g, o) in dst[..ng].iter_mut().enumerate() {
        *o = scale_at(parts[1], r * ng + g);
    }
}

/// Encode a row-major `[rows, cols]` matrix: `weight_packed`, `weight_scale`, `weight_shape`
/// bytes (little-endian).
pub fn encode(w: &[f32], rows: usize, cols: usize) -> Encoded {
    if !cols.is_multiple_of(GROUP) {
        return Err(FormatError::Unaligned {
            what: "int4-g32 weight",
            cols,
            multiple: GROUP,
        });
    }
    if w.len() != rows * cols {
        return Err(FormatError::LengthMismatch {
            what: "int4-g32 weight",
            expected: rows * cols,
            got: w.len(),
        });
    }
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = Vec::with_capacity(rows * cols / GROUP * 2);
    for (g, (x, p)) in w
        .chunks_exact(GROUP)
        .zip(packed.chunks_exact_mut(GROUP / 2))
        .enumerate()
    {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let sb = f32_to_bf16(amax / 7.5);
        let s = bf16_to_f32(sb);
        if !s.is_finite() {
            return Err(FormatError::LengthMismatch {
                what: "int4-g32 finite group (a NaN or infinite weight)",
                expected: g,
                got: g,
            });
        }
        scales.extend_from_slice(&sb.to_le_bytes());
        let q = |v: f32| -> u8 {
            let q = if s == 0.0 {
                0.0
            } else {
                (v / s).round_ties_even().clamp(-8.0, 7.0)
            };
            (q as i32 + 8) as u8
        };
        for (b, x2) in p.iter_mut().zip(x.chunks_exact(2)) {
            *b = q(x2[0]) | (q(x2[1]) << 4);
        }
    }
    Ok(vec![packed, scales, shape_bytes(rows, cols)])
}

/// `weight_shape`: `[rows, cols]` as little-endian int32.
fn shape_bytes(rows: usize, cols: usize) -> Vec<u8> {
    [rows as i32, cols as i32]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// compressed-tensors' docstring example, for 4 bits: the int8 values [1, 2] become
    /// unsigned [9, 10] and pack, low value first, into the int32 0xA9.
    #[test]
    fn packs_as_compressed_tensors_does() {
        let mut w = vec![0f32; 32];
        // Scale 1 exactly: amax 7.5.
        w[0] = 1.0;
        w[1] = 2.0;
        w[2] = -7.5;
        let p = encode(&w, 1, 32).unwrap();
        // −7.5 rounds half to even: −8, stored 0.
        assert_eq!(&p[0][..4], &[0xA9, 0x80, 0x88, 0x88]);
        assert_eq!(bf16_to_f32(u16::from_le_bytes([p[1][0], p[1][1]])), 1.0);
        assert_eq!(p[2], [1, 0, 0, 0, 32, 0, 0, 0]);
        let mut d = vec![0f32; 32];
        decode_row_ref(&[&p[0], &p[1]], 32, 0, &mut d);
        assert_eq!(&d[..4], &[1.0, 2.0, -8.0, 0.0]);
    }

    #[test]
    fn every_stored_value_decodes() {
        // One group whose 32 nibbles run through 0..16 twice, scale 0.5.
        let packed: Vec<u8> = (0..16u8)
            .map(|k| (2 * k % 16) | ((2 * k + 1) % 16) << 4)
            .collect();
        let scale = f32_to_bf16(0.5).to_le_bytes();
        let mut d = vec![0f32; 32];
        decode_row(&[&packed, &scale], 32, 0, &mut d);
        for (j, v) in d.iter().enumerate() {
            assert_eq!(*v, ((j % 16) as f32 - 8.0) * 0.5);
        }
    }
}
