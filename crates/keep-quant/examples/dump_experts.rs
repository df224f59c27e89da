//! Write routed expert matrices of a model, their imatrix rows and keep's E8P2 fit decoded,
//! as raw little-endian f32 files, for comparing with other quantizers on the same tensors
//! (dev/quant-vs-iq2.sh):
//! `cargo run --release -p keep-quant --example dump_experts -- MODEL IMATRIX OUTDIR [N]`
//! writes, for the first N (default 4) experts of layer 0 and each of w1/w2/w3,
//! `OUTDIR/<name>.w.f32`, `.h.f32`, `.e8p2.f32`, `.e8p2+e81.f32` and a line of
//! `OUTDIR/tensors.jsonl` (name, rows, cols, keep's stored bits per weight per format).

use std::io::Write;
use std::path::Path;

use keep_checkpoint::{layout, Checkpoint};
use keep_quant::checkpoint::{decode_source, Imatrix, PARTS};
use keep_quant::fit::{dequantize, fit_matrix, QuantFormat};

fn write_f32(path: &Path, v: &[f32]) -> std::io::Result<()> {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 3 {
        return Err("usage: dump_experts MODEL IMATRIX OUTDIR [N]".into());
    }
    let ck = Checkpoint::open(Path::new(&args[0]))?;
    let im = Imatrix::open(Path::new(&args[1]))?;
    let out = Path::new(&args[2]);
    std::fs::create_dir_all(out)?;
    let n: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(4);
    let cfg = ck.require_config()?.clone();
    let (hidden, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    let mut index = std::fs::File::create(out.join("tensors.jsonl"))?;
    for expert in 0..n.min(cfg.experts_in_layer(0)) {
        for part in PARTS {
            let name = format!("layers.0.ffn.experts.{expert}.{part}");
            let wname = format!("{name}.weight");
            let (rows, cols) = if part == "w2" {
                (hidden, inter)
            } else {
                (inter, hidden)
            };
            let vals = decode_source(
                ck.tensor(&wname)?,
                layout::scale_of(&ck, &wname),
                rows,
                cols,
            )?;
            let h = im
                .get(0, &format!("ffn.experts.{expert}.{part}"), cols)
                .ok_or_else(|| format!("no imatrix for {wname}"))?;
            write_f32(&out.join(format!("{name}.w.f32")), &vals)?;
            write_f32(&out.join(format!("{name}.h.f32")), &h)?;
            let mut line = serde_json::json!({"name": name, "rows": rows, "cols": cols});
            for format in [QuantFormat::E8p2, QuantFormat::E8p2E81] {
                let f = fit_matrix(&vals, rows, cols, &h, format)?;
                let label = format.label();
                write_f32(&out.join(format!("{name}.{label}.f32")), &dequantize(&f))?;
                line[format!("{label}_bits_per_weight")] =
                    format.bits_per_weight(rows, cols).into();
            }
            writeln!(index, "{line}")?;
        }
    }
    Ok(())
}
