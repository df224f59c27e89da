//! Tests of [`super`]: packing against the bit-by-bit reference on every width, fast decode
//! against the reference decode, errors on bad lengths, and codes, scales, biases and
//! dequantized values against `mx.quantize` / `mx.dequantize` fixtures
//! (`fixtures/mlx-affine/mlx-affine.safetensors`, written by
//! `tools/oracle/mlx_affine_fixture.py`).

use super::*;
use crate::bf16::bf16_to_f32;
use crate::testutil::same;

fn draw32(r: &mut keep_rng::Rng) -> u32 {
    keep_rng::RngCore::next_u32(r)
}

#[test]
fn pack_unpack_round_trip_every_width() {
    let mut rng = keep_rng::rng(21);
    for bits in MLX_AFFINE_BITS {
        for cols in [64usize, 128, 192, 320] {
            let codes: Vec<u8> = (0..cols)
                .map(|_| (draw32(&mut rng) % (1 << bits)) as u8)
                .collect();
            let mut packed = vec![0u8; packed_row_bytes(cols, bits).unwrap()];
            pack_row(bits, &codes, &mut packed).unwrap();
            let (mut a, mut b) = (vec![0u8; cols], vec![0u8; cols]);
            unpack_row_ref(bits, &packed, &mut a).unwrap();
            unpack_row(bits, &packed, &mut b).unwrap();
            assert_eq!(a, codes, "bits {bits}");
            assert_eq!(b, codes, "bits {bits}");
        }
        // Every byte pattern unpacks the same both ways.
        let n = 3 * 32 * bits as usize / 8 * 8 / bits as usize;
        let packed: Vec<u8> = (0..n * bits as usize / 8)
            .map(|i| (i * 37 + 11) as u8)
            .collect();
        let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
        unpack_row_ref(bits, &packed, &mut a).unwrap();
        unpack_row(bits, &packed, &mut b).unwrap();
        assert_eq!(a, b);
    }
}

#[test]
fn three_bit_codes_cross_bytes_as_mlx_stores_them() {
    // Eight codes 7,6,...,0 in three bytes, least significant bit first (what mx.quantize
    // writes for a group 0..7 repeated: scale −1, bias 7).
    let codes: Vec<u8> = (0..32).map(|i| 7 - (i % 8) as u8).collect();
    let mut p = vec![0u8; 12];
    pack_row(3, &codes, &mut p).unwrap();
    assert_eq!(&p[..3], &[119, 57, 5]);
}

#[test]
fn fast_decode_equals_reference_all_param_kinds() {
    let mut rng = keep_rng::rng(5);
    for bits in MLX_AFFINE_BITS {
        let cols = 256;
        let packed: Vec<u8> = (0..cols * bits as usize / 8)
            .map(|_| draw32(&mut rng) as u8)
            .collect();
        let s16: Vec<u16> = (0..4).map(|_| draw32(&mut rng) as u16).collect();
        let b16: Vec<u16> = (0..4).map(|_| draw32(&mut rng) as u16).collect();
        let s32: Vec<f32> = (0..4).map(|_| f32::from_bits(draw32(&mut rng))).collect();
        for (s, b) in [
            (ParamSlice::Bf16(&s16), ParamSlice::Bf16(&b16)),
            (ParamSlice::F16(&s16), ParamSlice::F16(&b16)),
            (ParamSlice::F32(&s32), ParamSlice::F32(&s32)),
        ] {
            let (mut x, mut y) = (vec![0f32; cols], vec![0f32; cols]);
            decode_row_ref(bits, &packed, s, b, &mut x).unwrap();
            decode_row(bits, &packed, s, b, &mut y).unwrap();
            assert!(x.iter().zip(&y).all(|(a, c)| same(*a, *c)), "bits {bits}");
        }
    }
}

#[test]
fn eight_bits_agree_with_the_byte_per_code_helpers() {
    let mut rng = keep_rng::rng(8);
    let w: Vec<f32> = (0..256)
        .map(|_| (draw32(&mut rng) >> 8) as f32 / (1u32 << 24) as f32 - 0.4)
        .collect();
    let (mut q, mut s, mut b) = (vec![0u8; 256], vec![0f32; 4], vec![0f32; 4]);
    quantize_row(8, &w, &mut q, &mut s, &mut b).unwrap();
    let (mut q8, mut s8, mut b8) = (vec![0u8; 256], vec![0f32; 4], vec![0f32; 4]);
    crate::affine::quantize_affine8_row(&w, &mut q8, &mut s8, &mut b8).unwrap();
    assert_eq!((q, s, b), (q8, s8, b8));
}

#[test]
fn bad_lengths_and_widths_are_errors() {
    let s = [0u16; 2];
    let (ps, pb) = (ParamSlice::Bf16(&s), ParamSlice::Bf16(&s));
    let mut d = vec![0f32; 128];
    assert!(decode_row(5, &[0; 80], ps, pb, &mut d).is_err());
    assert!(decode_row(4, &[0; 63], ps, pb, &mut d).is_err());
    assert!(decode_row_ref(4, &[0; 64], ParamSlice::Bf16(&s[..1]), pb, &mut d).is_err());
    assert!(decode_row(3, &[0; 36], ps, pb, &mut d[..96]).is_err());
    assert!(unpack_row(3, &[0; 3], &mut [0; 8]).is_err()); // not a whole uint32 word
    assert!(pack_row(2, &[0; 64], &mut [0; 15]).is_err());
    assert!(quantize_row(4, &d[..100], &mut [0; 50], &mut [0.0; 1], &mut [0.0; 1]).is_err());
    assert!(quantize_row_bf16(3, &d, &mut [0; 48], &mut [0; 2], &mut [0; 1]).is_err());
    assert_eq!(packed_row_bytes(64, 3), Some(24));
    assert_eq!(packed_row_bytes(16, 3), None);
    assert_eq!(packed_row_bytes(64, 6), None);
    assert_eq!(bits_per_weight(4, 64), 4.5);
}

#[test]
fn quantize_bounds_on_random_rows() {
    let mut rng = keep_rng::rng(77);
    for bits in MLX_AFFINE_BITS {
        for trial in 0..50 {
            let cols = 64 * (1 + trial % 3);
            let w: Vec<f32> = (0..cols)
                .map(|_| ((draw32(&mut rng) >> 8) as f32 / (1u32 << 24) as f32 - 0.3) * 3.0)
                .collect();
            let mut p = vec![0u8; cols * bits as usize / 8];
            let (mut s, mut b) = (vec![0f32; cols / 64], vec![0f32; cols / 64]);
            quantize_row(bits, &w, &mut p, &mut s, &mut b).unwrap();
            let mut d = vec![0f32; cols];
            decode_row(bits, &p, ParamSlice::F32(&s), ParamSlice::F32(&b), &mut d).unwrap();
            for i in 0..cols {
                // Half a step, plus a step lost to the clamp after MLX moves the scale to hit
                // the edge value exactly.
                assert!((w[i] - d[i]).abs() <= s[i / 64].abs() * 1.5, "bits {bits}");
            }
        }
    }
}

struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    fn open() -> Option<Fixture> {
        let p = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fixtures/mlx-affine/mlx-affine.safetensors"
        );
        std::fs::read(p).ok().map(|bytes| Fixture { bytes })
    }
}

/// Values of a fixture tensor widened to f32 (F32 or BF16), its raw bytes, and its shape.
fn tensor(st: &safetensors::SafeTensors, name: &str) -> (Vec<f32>, Vec<u8>, Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    let b = t.data().to_vec();
    let v = match t.dtype() {
        safetensors::Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        safetensors::Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        _ => vec![],
    };
    (v, b, t.shape().to_vec())
}

#[test]
fn matches_mx_quantize_and_dequantize_fixtures() {
    let fx = Fixture::open().expect("fixtures/mlx-affine/mlx-affine.safetensors is committed");
    let (_, meta) = safetensors::SafeTensors::read_metadata(&fx.bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["format"], "keep-fixture-mlx-affine");
    let cases: Vec<serde_json::Value> = serde_json::from_str(&meta["cases"]).unwrap();
    assert_eq!(cases.len(), 16, "four widths x two dtypes x two shapes");
    let st = safetensors::SafeTensors::deserialize(&fx.bytes).unwrap();
    for c in &cases {
        let name = c["name"].as_str().unwrap();
        let bits = c["bits"].as_u64().unwrap() as u32;
        let bf16 = c["dtype"] == "bfloat16";
        let (w, _, shape) = tensor(&st, &format!("{name}.w"));
        let (rows, cols) = (shape[0], shape[1]);
        let (_, q, qshape) = tensor(&st, &format!("{name}.q"));
        assert_eq!(qshape, [rows, cols * bits as usize / 32]);
        let (sv, sb, _) = tensor(&st, &format!("{name}.scales"));
        let (bv, bb, _) = tensor(&st, &format!("{name}.biases"));
        let (deq, _, _) = tensor(&st, &format!("{name}.deq"));
        let (g, pb) = (cols / 64, cols * bits as usize / 8);
        for r in 0..rows {
            let wr = &w[r * cols..(r + 1) * cols];
            let qr = &q[r * pb..(r + 1) * pb];
            // keep's quantizer gives mx.quantize's bytes
            let mut p = vec![0u8; pb];
            if bf16 {
                let (mut s, mut b) = (vec![0u16; g], vec![0u16; g]);
                quantize_row_bf16(bits, wr, &mut p, &mut s, &mut b).unwrap();
                let sb2: Vec<u8> = s.iter().flat_map(|v| v.to_le_bytes()).collect();
                let bb2: Vec<u8> = b.iter().flat_map(|v| v.to_le_bytes()).collect();
                assert_eq!(sb2, sb[r * g * 2..(r + 1) * g * 2], "{name} row {r} scales");
                assert_eq!(bb2, bb[r * g * 2..(r + 1) * g * 2], "{name} row {r} biases");
            } else {
                let (mut s, mut b) = (vec![0f32; g], vec![0f32; g]);
                quantize_row(bits, wr, &mut p, &mut s, &mut b).unwrap();
                assert!(
                    s.iter().zip(&sv[r * g..]).all(|(a, c)| same(*a, *c)),
                    "{name} scales"
                );
                assert!(
                    b.iter().zip(&bv[r * g..]).all(|(a, c)| same(*a, *c)),
                    "{name} biases"
                );
            }
            assert_eq!(p, qr, "{name} row {r} codes (bits {bits})");
            // keep's decode of MLX's bytes gives mx.dequantize's values
            let (ps, pbias) = if bf16 {
                (
                    ParamSlice::Bf16Le(&sb[r * g * 2..(r + 1) * g * 2]),
                    ParamSlice::Bf16Le(&bb[r * g * 2..(r + 1) * g * 2]),
                )
            } else {
                (
                    ParamSlice::F32(&sv[r * g..(r + 1) * g]),
                    ParamSlice::F32(&bv[r * g..(r + 1) * g]),
                )
            };
            let (mut d, mut dr) = (vec![0f32; cols], vec![0f32; cols]);
            decode_row(bits, qr, ps, pbias, &mut d).unwrap();
            decode_row_ref(bits, qr, ps, pbias, &mut dr).unwrap();
            let want = &deq[r * cols..(r + 1) * cols];
            assert!(d.iter().zip(&dr).all(|(a, c)| same(*a, *c)));
            if bf16 {
                // MLX dequantizes bf16 parameters in bf16 (product rounded, then the sum), even
                // with dtype=float32: keep's codes and parameters give exactly that value.
                let mut codes = vec![0u8; cols];
                unpack_row(bits, qr, &mut codes).unwrap();
                for (j, c) in want.iter().enumerate() {
                    let rb = |v: f32| bf16_to_f32(crate::bf16::f32_to_bf16(v));
                    let v = rb(rb(ps.get(j / 64) * f32::from(codes[j])) + pbias.get(j / 64));
                    assert!(same(v, *c), "{name} ({r},{j}): keep {v} mlx {c}");
                }
            } else {
                for (j, (a, c)) in d.iter().zip(want).enumerate() {
                    assert!(same(*a, *c), "{name} ({r},{j}): keep {a} mlx {c}");
                }
            }
        }
    }
}
