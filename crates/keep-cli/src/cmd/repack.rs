//! `keep repack`: FP8-block residents → MXFP8 bit-exactly (or → bf16); the rest byte-copied.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use keep_convert::repack::{repack, RepackOptions, ResidentFormat};

use crate::util::{byte_bar, human};

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Mxfp8,
    Bf16,
}

/// Rewrite a checkpoint's FP8-block residents without changing a single weight.
///
/// With `mxfp8`, each FP8 weight with a block scale that is not a routed expert keeps its E4M3
/// bytes and gets one E8M0 scale per row and 32 columns — the layout MLX's mode="mxfp8" reads
/// (8.25 bits per weight). Anything that would need rounding is refused, naming the tensor: a
/// scale that is not an exact power of two, a NaN scale, a block width that lets a 32-wide group
/// straddle two blocks. `bf16` decodes residents instead (refused where bf16 would round).
/// Everything else is copied byte for byte; config.json states the new quantization_config;
/// repack-report.json lists what changed. The output appears only when complete.
///
/// Example: keep repack /tmp/tiny /tmp/tiny-mxfp8 --resident-format mxfp8 --verify
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct RepackArgs {
    /// Source checkpoint directory.
    dir: PathBuf,
    /// Output directory (refused if it exists, unless --force).
    out: PathBuf,
    /// Format of the residents in the output.
    #[arg(long, value_enum)]
    resident_format: Format,
    /// Decode every repacked tensor both ways and compare bit for bit before finishing.
    #[arg(long)]
    verify: bool,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Skip fsync of the output (for benchmarks against a copy that does not sync either).
    #[arg(long, hide = true)]
    no_sync: bool,
}

pub fn run(a: RepackArgs) -> anyhow::Result<()> {
    crate::util::check_out_of_cache(&a.out)?;
    let opts = RepackOptions {
        resident: match a.resident_format {
            Format::Mxfp8 => ResidentFormat::Mxfp8,
            Format::Bf16 => ResidentFormat::Bf16,
        },
        verify: a.verify,
        force: a.force,
        sync: !a.no_sync,
    };
    let bar = byte_bar(0, "repack");
    let (out, r) = repack(&a.dir, &a.out, &opts, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("repacking {} into {}", a.dir.display(), a.out.display()))?;
    bar.finish_and_clear();
    let before: u64 = r.repacked.iter().map(|t| t.bytes_before).sum();
    let after: u64 = r.repacked.iter().map(|t| t.bytes_after).sum();
    println!(
        "wrote {}: {} residents repacked ({} → {}), {} tensors copied{}",
        out.display(),
        r.repacked.len(),
        human(before),
        human(after),
        r.copied_tensors,
        if r.verified {
            ", every repacked tensor verified bit for bit"
        } else {
            ""
        }
    );
    Ok(())
}
