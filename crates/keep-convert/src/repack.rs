//! `keep repack`: FP8-block residents rewritten as MXFP8 without changing a weight, or decoded
//! to bf16; every other tensor copied byte for byte.
//!
//! A resident is an FP8 E4M3 weight with a scale partner that is not a routed expert (attention
//! projections including the grouped `wo_a`, the indexer's `wq_b`, shared experts, MTP's
//! `e_proj`/`h_proj`, engram tables). For `mxfp8` its element bytes are written unchanged and its
//! scale grid is expanded to one E8M0 byte per row and 32 columns, `s'[i, g] = s[i/br, 32g/bc]`:
//! the layout MLX's `mode="mxfp8"` reads. The whole plan is checked before a byte is written, so
//! a refusal (a scale that is not an exact power of two, a NaN scale byte, a block width that
//! lets a 32-wide group straddle two blocks, a width that is not a multiple of 32, a bf16 decode
//! that would round) leaves nothing behind and names the tensor.

use std::path::{Path, PathBuf};

use keep_checkpoint::naming::{self, Part, Role};
use keep_checkpoint::writer::{CheckpointWriter, TensorMeta, WriterOptions};
use keep_checkpoint::{Checkpoint, Dtype, TensorRef};
use keep_format::fp8block::{decode_fp8_block, repack_scales_to_mx, BlockScales, BlockShape};
use keep_format::mx::decode_mxfp8_row;
use keep_format::FormatError;
use serde::Serialize;
use serde_json::json;

use crate::copy::copy_tensor;
use crate::resident::{classify, scale_kind, scale_of, Layout, ScaleKind};
use crate::{ConvertError, Result};

/// The format residents are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResidentFormat {
    /// E4M3 bytes unchanged + E8M0 per row and 32 columns.
    Mxfp8,
    /// Decoded to bf16 (exact for power-of-two scales; refused where it would round).
    Bf16,
}

/// Options of [`repack`].
#[derive(Debug, Clone)]
pub struct RepackOptions {
    pub resident: ResidentFormat,
    pub verify: bool,
    pub force: bool,
    /// fsync outputs before the rename (benchmarks compare against a copy without sync).
    pub sync: bool,
}

/// One repacked tensor in `repack-report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RepackedTensor {
    pub name: String,
    pub shape: [usize; 2],
    pub source_scale: String,
    pub source_block: [usize; 2],
    pub source_scale_kind: &'static str,
    /// The scale tensor written (None for bf16, which has none).
    pub created_scale: Option<String>,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// `repack-report.json`.
#[derive(Debug, Clone, Serialize)]
pub struct RepackReport {
    pub format: &'static str,
    pub version: u32,
    pub source: String,
    pub output: String,
    pub resident_format: ResidentFormat,
    /// Logical tensors (scales are not counted).
    pub repacked: Vec<RepackedTensor>,
    pub copied_tensors: usize,
    pub bytes_before: u64,
    pub bytes_after: u64,
    pub verified: bool,
}

/// What to do with one resident.
struct Resident<'a> {
    weight: TensorRef<'a>,
    scale: TensorRef<'a>,
    rows: usize,
    cols: usize,
    block: BlockShape,
    kind: ScaleKind,
    /// The new bytes: expanded E8M0 scales (mxfp8) or bf16 weights (bf16).
    new_bytes: Vec<u8>,
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn scales_of<'b>(kind: ScaleKind, bytes: &'b [u8], buf: &'b mut Vec<f32>) -> BlockScales<'b> {
    match kind {
        ScaleKind::E8m0 => BlockScales::E8m0(bytes),
        ScaleKind::F32Pow2 => {
            *buf = f32s(bytes);
            BlockScales::F32Pow2(buf)
        }
        ScaleKind::F32ScaleInv => {
            *buf = f32s(bytes);
            BlockScales::F32ScaleInv(buf)
        }
        ScaleKind::Bf16Pow2 => {
            *buf = f32s(&crate::resident::bf16_scales_as_f32(bytes));
            BlockScales::F32Pow2(buf)
        }
        ScaleKind::Bf16ScaleInv => {
            *buf = f32s(&crate::resident::bf16_scales_as_f32(bytes));
            BlockScales::F32ScaleInv(buf)
        }
    }
}

fn refusal(tensor: &str, e: FormatError, what: ResidentFormat) -> ConvertError {
    let reason = match e {
        FormatError::NanScale { index } => {
            format!("scale {index} of its block grid is NaN (E8M0 0xFF); the checkpoint is damaged")
        }
        FormatError::NotPowerOfTwo { index, value } => format!(
            "scale {index} = {value:e} is not an exact power of two, so it has no E8M0 byte; \
             use --resident-format bf16 only if that decode is exact, or keep the shipped format"
        ),
        other => format!("{other}"),
    };
    let _ = what;
    ConvertError::Refused {
        tensor: tensor.to_string(),
        reason,
    }
}

/// Is this weight a resident that repack rewrites?
pub fn is_resident(name: &str, dtype: Dtype, has_scale: bool) -> bool {
    let n = naming::parse(name);
    n.part == Part::Weight
        && dtype == Dtype::F8_E4M3
        && has_scale
        && !matches!(n.role, Role::RoutedExpert { .. })
}

fn prepare<'a>(ck: &'a Checkpoint, opts: &RepackOptions) -> Result<Vec<Resident<'a>>> {
    let hint = ck.config().and_then(|c| c.weight_block_size());
    let mut out = vec![];
    for t in ck.tensors() {
        let scale = scale_of(ck, t.name);
        if !is_resident(t.name, t.dtype, scale.is_some()) {
            continue;
        }
        let scale = scale.expect("checked above");
        let c = classify(t, Some(scale), hint).map_err(|reason| ConvertError::Refused {
            tensor: t.name.to_string(),
            reason: format!("cannot read its format: {reason}"),
        })?;
        let (Layout::Fp8Block { block, .. }, Some(kind)) = (c.layout, scale_kind(&c)) else {
            return Err(ConvertError::Refused {
                tensor: t.name.to_string(),
                reason: format!("cannot read its format: {}", c.layout.label()),
            });
        };
        let (rows, cols) = (c.rows, c.cols);
        let block = BlockShape::new(block.0, block.1);
        let mut buf = vec![];
        let scales = scales_of(kind, scale.bytes, &mut buf);
        let new_bytes = match opts.resident {
            ResidentFormat::Mxfp8 => {
                repack_scales_to_mx(rows, cols, block, scales).map_err(|e| match e {
                    FormatError::Unaligned { .. } if cols % 32 != 0 => ConvertError::Refused {
                        tensor: t.name.to_string(),
                        reason: format!(
                            "{cols} columns is not a multiple of 32: MXFP8 needs whole groups of 32"
                        ),
                    },
                    FormatError::Unaligned { .. } => ConvertError::Refused {
                        tensor: t.name.to_string(),
                        reason: format!(
                            "its {}x{} blocks would let a 32-wide group straddle two source blocks",
                            block.rows, block.cols
                        ),
                    },
                    e => refusal(t.name, e, opts.resident),
                })?
            }
            ResidentFormat::Bf16 => {
                if let BlockScales::E8m0(s) = scales {
                    if let Some(i) = s.iter().position(|&b| b == 0xFF) {
                        return Err(refusal(
                            t.name,
                            FormatError::NanScale { index: i },
                            opts.resident,
                        ));
                    }
                }
                let mut f = vec![0f32; rows * cols];
                decode_fp8_block(t.bytes, rows, cols, block, scales, &mut f)
                    .map_err(|e| refusal(t.name, e, opts.resident))?;
                let mut b = Vec::with_capacity(f.len() * 2);
                for (i, &x) in f.iter().enumerate() {
                    let h = keep_format::bf16::f32_to_bf16(x);
                    let back = keep_format::bf16::bf16_to_f32(h);
                    if back.to_bits() != x.to_bits() && !(x.is_nan() && back.is_nan()) {
                        return Err(ConvertError::Refused {
                            tensor: t.name.to_string(),
                            reason: format!(
                                "element {i} decodes to {x:e}, which bf16 would round to {back:e}"
                            ),
                        });
                    }
                    b.extend_from_slice(&h.to_le_bytes());
                }
                b
            }
        };
        out.push(Resident {
            weight: t,
            scale,
            rows,
            cols,
            block,
            kind,
            new_bytes,
        });
    }
    Ok(out)
}

/// The `quantization_config` of the output.
fn new_quant_config(ck: &Checkpoint, resident: ResidentFormat) -> serde_json::Value {
    let source = ck
        .config()
        .and_then(|c| c.raw.get("quantization_config").cloned())
        .unwrap_or(serde_json::Value::Null);
    match resident {
        // mlx-lm maps quant_method "mxfp8" to mode mxfp8 (group 32, 8 bits) and infers mxfp4
        // for the FP4 experts from their scale shapes.
        ResidentFormat::Mxfp8 => json!({
            "quant_method": "mxfp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "weight_block_size": [1, 32],
            "keep_repacked_from": source,
        }),
        ResidentFormat::Bf16 => json!({
            "quant_method": "mxfp4", "fmt": "e2m1", "scale_fmt": "ue8m0",
            "weight_block_size": [1, 32],
            "keep_residents": "bf16",
            "keep_repacked_from": source,
        }),
    }
}

/// Repack `src` into `out`. Calls `progress(bytes_done, bytes_total)` as it copies.
pub fn repack(
    src: &Path,
    out: &Path,
    opts: &RepackOptions,
    progress: &dyn Fn(u64, u64),
) -> Result<(PathBuf, RepackReport)> {
    keep_checkpoint::writer::check_dir_target(out, opts.force, &[src.to_path_buf()])?;
    let ck = Checkpoint::open(src)?;
    for s in ck.shards() {
        s.advise_sequential();
    }
    let residents = prepare(&ck, opts)?;
    let by_weight: std::collections::HashMap<&str, &Resident> =
        residents.iter().map(|r| (r.weight.name, r)).collect();
    let old_scales: std::collections::HashSet<&str> =
        residents.iter().map(|r| r.scale.name).collect();

    // The output's tensors, in the source's order.
    let mut metas = vec![];
    let mut total = 0u64;
    for t in ck.tensors() {
        if old_scales.contains(t.name) {
            continue;
        }
        match by_weight.get(t.name) {
            Some(r) => match opts.resident {
                ResidentFormat::Mxfp8 => {
                    metas.push(TensorMeta::new(t.name, Dtype::F8_E4M3, t.shape));
                    metas.push(TensorMeta::new(
                        r.scale.name,
                        Dtype::F8_E8M0,
                        &[r.rows as u64, (r.cols / 32) as u64],
                    ));
                }
                ResidentFormat::Bf16 => metas.push(TensorMeta::new(t.name, Dtype::BF16, t.shape)),
            },
            None => metas.push(TensorMeta::new(t.name, t.dtype, t.shape)),
        }
        total += t.bytes.len() as u64;
    }
    let max_shard = ck.shards().iter().map(|s| s.len()).max().unwrap_or(0);
    let wopts = WriterOptions {
        max_shard_bytes: max_shard + max_shard / 16 + (1 << 20),
        force: opts.force,
        sync: opts.sync,
        protect: vec![src.to_path_buf()],
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, metas, wopts)?;
    let mut done = 0u64;
    let mut report_rows = vec![];
    let mut copied = 0usize;
    for t in ck.tensors() {
        if old_scales.contains(t.name) {
            continue;
        }
        match by_weight.get(t.name) {
            Some(r) => {
                let before = (r.weight.bytes.len() + r.scale.bytes.len()) as u64;
                let after = match opts.resident {
                    ResidentFormat::Mxfp8 => {
                        copy_tensor(&ck, &mut w, t.name, &t)?;
                        w.write_tensor(r.scale.name, &r.new_bytes)?;
                        (t.bytes.len() + r.new_bytes.len()) as u64
                    }
                    ResidentFormat::Bf16 => {
                        w.write_tensor(t.name, &r.new_bytes)?;
                        r.new_bytes.len() as u64
                    }
                };
                report_rows.push(RepackedTensor {
                    name: t.name.to_string(),
                    shape: [r.rows, r.cols],
                    source_scale: r.scale.name.to_string(),
                    source_block: [r.block.rows, r.block.cols],
                    source_scale_kind: r.kind.label(),
                    created_scale: (opts.resident == ResidentFormat::Mxfp8)
                        .then(|| r.scale.name.to_string()),
                    bytes_before: before,
                    bytes_after: after,
                });
            }
            None => {
                copy_tensor(&ck, &mut w, t.name, &t)?;
                copied += 1;
            }
        }
        done += t.bytes.len() as u64;
        progress(done, total);
    }

    // config.json with the new quantization_config; other files pass through untouched.
    if let Some(cfg) = ck.config() {
        let raw = cfg.raw_with(&[("quantization_config", new_quant_config(&ck, opts.resident))]);
        let text = serde_json::to_string_pretty(&raw).expect("JSON");
        w.add_file("config.json", text.as_bytes())?;
    }
    for f in ck.aux_files()? {
        let name = f.file_name().expect("a file").to_string_lossy().to_string();
        if name == "repack-report.json" {
            continue;
        }
        w.copy_file(&name, &f)?;
    }
    let bytes_before: u64 = ck.tensors().map(|t| t.bytes.len() as u64).sum();
    let mut report = RepackReport {
        format: "keep-repack-report",
        version: 1,
        source: src.display().to_string(),
        output: out.display().to_string(),
        resident_format: opts.resident,
        bytes_after: bytes_before - report_rows.iter().map(|r| r.bytes_before).sum::<u64>()
            + report_rows.iter().map(|r| r.bytes_after).sum::<u64>(),
        repacked: report_rows,
        copied_tensors: copied,
        bytes_before,
        verified: false,
    };
    if opts.verify {
        verify_tensors(&residents, w.tmp_dir(), opts.resident)?;
        report.verified = true;
    }
    let text = serde_json::to_string_pretty(&report).expect("JSON");
    w.add_file("repack-report.json", text.as_bytes())?;
    let path = w.finish()?;
    Ok((path, report))
}

/// Decode every repacked tensor both ways (source block decode, output decode) and compare
/// the f32 bits. Runs on the finished shards in the writer's temporary directory, before the
/// rename, so a failure leaves no output.
fn verify_tensors(residents: &[Resident], tmp: &Path, resident: ResidentFormat) -> Result<()> {
    let outck = Checkpoint::open(tmp)?;
    for r in residents {
        let name = r.weight.name;
        let mut buf = vec![];
        let scales = scales_of(r.kind, r.scale.bytes, &mut buf);
        let mut want = vec![0f32; r.rows * r.cols];
        decode_fp8_block(r.weight.bytes, r.rows, r.cols, r.block, scales, &mut want).map_err(
            |e| ConvertError::Format {
                tensor: name.to_string(),
                err: e,
            },
        )?;
        let w = outck.tensor(name)?;
        let mut got = vec![0f32; r.cols];
        for i in 0..r.rows {
            match resident {
                ResidentFormat::Mxfp8 => {
                    let s = outck.tensor(r.scale.name)?;
                    let g = r.cols / 32;
                    decode_mxfp8_row(
                        &w.bytes[i * r.cols..(i + 1) * r.cols],
                        &s.bytes[i * g..(i + 1) * g],
                        &mut got,
                    )
                    .map_err(|e| ConvertError::Format {
                        tensor: name.to_string(),
                        err: e,
                    })?;
                }
                ResidentFormat::Bf16 => {
                    for (j, g) in got.iter_mut().enumerate() {
                        let k = (i * r.cols + j) * 2;
                        *g = keep_format::bf16::bf16_to_f32(u16::from_le_bytes([
                            w.bytes[k],
                            w.bytes[k + 1],
                        ]));
                    }
                }
            }
            for j in 0..r.cols {
                let (a, b) = (want[i * r.cols + j], got[j]);
                if a.to_bits() != b.to_bits() {
                    return Err(ConvertError::VerifyFailed {
                        tensor: name.to_string(),
                        detail: format!("element [{i}, {j}]: source {a:e}, repacked {b:e}"),
                    });
                }
            }
        }
    }
    Ok(())
}
