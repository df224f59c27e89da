//! Per-group scales against per-row scales: the imatrix-weighted relative reconstruction
//! error of every routed expert matrix of a model, summed, for each format and scale group,
//! beside the stored bits per weight (codes plus f32 scales), as JSON on stdout:
//! `cargo run --release -p keep-quant --example scale_groups -- MODEL IMATRIX [GROUPS...]`
//! (groups default 16 32 64 128 256; a group that does not divide a matrix's columns falls
//! back to one scale per row for that matrix, and the bits say so).

use std::path::Path;

use keep_checkpoint::{layout, Checkpoint};
use keep_quant::checkpoint::{decode_source, Imatrix, PARTS};
use keep_quant::fit::{fit_matrix_grouped, QuantFormat};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err("usage: scale_groups MODEL IMATRIX [GROUPS...]".into());
    }
    let ck = Checkpoint::open(Path::new(&args[0]))?;
    let im = Imatrix::open(Path::new(&args[1]))?;
    let mut groups: Vec<usize> = args[2..].iter().filter_map(|a| a.parse().ok()).collect();
    if groups.is_empty() {
        groups = vec![16, 32, 64, 128, 256];
    }
    groups.insert(0, 0); // 0: one scale per row
    let cfg = ck.require_config()?.clone();
    let (hidden, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    // [group][format] → (error, weight, stored bits, weights)
    let mut acc = vec![[(0f64, 0f64, 0f64, 0f64); 3]; groups.len()];
    for layer in 0..cfg.num_hidden_layers {
        for expert in 0..cfg.experts_in_layer(layer) {
            for part in PARTS {
                let base = format!("layers.{layer}.ffn.experts.{expert}.{part}");
                let wname = format!("{base}.weight");
                let (rows, cols) = if part == "w2" {
                    (hidden, inter)
                } else {
                    (inter, hidden)
                };
                let w = ck.tensor(&wname)?;
                let vals = decode_source(w, layout::scale_of(&ck, &wname), rows, cols)?;
                let key = format!("ffn.experts.{expert}.{part}");
                let h = im
                    .get(layer, &key, cols)
                    .ok_or_else(|| format!("no imatrix for {wname}"))?;
                for (gi, &g) in groups.iter().enumerate() {
                    let g = if g == 0 || !cols.is_multiple_of(g) {
                        cols
                    } else {
                        g
                    };
                    for (fi, format) in QuantFormat::ALL.into_iter().enumerate() {
                        let f = fit_matrix_grouped(&vals, rows, cols, &h, format, g)?;
                        let stages = if format.residual().is_some() {
                            2.0
                        } else {
                            1.0
                        };
                        let code_bits = match format {
                            QuantFormat::E8p2 => 2.0,
                            QuantFormat::E8p2E81 => 3.0,
                            QuantFormat::E8p2E8p2 => 4.0,
                        };
                        let n = (rows * cols) as f64;
                        let a = &mut acc[gi][fi];
                        a.0 += f.errors.full.unwrap_or(f.errors.base);
                        a.1 += f.errors.weight;
                        a.2 += n * (code_bits + stages * 32.0 / g as f64);
                        a.3 += n;
                    }
                }
            }
        }
    }
    let mut rows = vec![];
    for (gi, &g) in groups.iter().enumerate() {
        for (fi, format) in QuantFormat::ALL.into_iter().enumerate() {
            let (e, wt, bits, n) = acc[gi][fi];
            rows.push(serde_json::json!({
                "format": format.label(),
                "scale_group": if g == 0 { "row".to_string() } else { g.to_string() },
                "rel_weighted_error": e / wt,
                "bits_per_weight_f32_scales": bits / n,
            }));
        }
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "model": args[0], "imatrix": args[1], "hidden": hidden, "moe_intermediate": inter,
            "rows": rows,
        }))?
    );
    Ok(())
}
