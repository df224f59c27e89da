//! `keep quant`: fit lattice codes (E8P12, with an optional E81B or E8P12 residual stage) to
//! the routed experts of a model, weighted by a calibration run's imatrix, or write them in
//! MLX's affine 2/3/4/8-bit layout (`--format mlxN`).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_quant::checkpoint::{quantize_with, ExpertSelection, QuantOptions};
use keep_quant::incoherence::{IncoherenceOptions, Mode, DEFAULT_SEED};
use keep_quant::QuantFormat;

/// Quantize routed experts to 2-bit E8P12 lattice codes (plus a residual stage).
///
/// Every selected routed expert's w1/w2/w3 is coded as E8P12 (16 bits per 8 weights) with one
/// scale per output row, each group of 8 rounded to the nearest codeword under the
/// imatrix-weighted error (the per-input-channel second moments `keep finalize` wrote), the
/// scale refitted by weighted least squares. `e8p2+e81` adds a 1-bit E8 residual stage (3 bits
/// per weight), `e8p2+e8p2` a second E8P12 stage (4 bits), each stored as tensors of their own
/// with their own scales. Everything else is copied byte for byte. A tensor without an imatrix
/// entry is refused by name. Work is saved per layer: `--shard I/N` does layers L with
/// L % N = I, a rerun resumes, and the output is joined (atomically) once every layer is done.
/// Saved layers are joined only with a run of the same model and the same --format, --experts
/// or --alloc, --incoherence, --incoherence-seed and imatrix: another is refused naming what
/// differs, and --force discards them. A weight holding NaN or infinity is refused by name.
/// `mlx2`, `mlx3`, `mlx4` and `mlx8` write MLX affine codes instead (group 64, bf16 scale and
/// bias per group: `mx.quantize`'s exact output, bits + 0.5 per weight), for comparison at
/// equal bits; the imatrix then only weights the reported error.
/// `--incoherence on` fits each lattice-coded weight rotated by seeded random-sign Hadamard
/// transforms on both sides (QuIP#'s incoherence processing; their seeds are stored in
/// config.json and undone on the activations at run time), `out` on the output side only
/// (the imatrix weighting stays exact). The default, `auto`, is `out` for the lattice formats
/// and off for MLX codes: on the bundled model output-only rotation lowers E8P2+E81's KL to
/// the teacher and leaves E8P2's unchanged, while both-sided rotation raises both (its
/// imatrix weighting flattens to a block mean) (dev/quant-incoherence.sh).
/// Writes quant-report.json with the weighted reconstruction error of every rung per tensor
/// and per expert.
///
/// Example: keep quant --imatrix /tmp/run --format e8p2+e81 --out /tmp/keep-tiny-e8p3
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct QuantArgs {
    /// The model to quantize (default: the bundled model).
    model: Option<PathBuf>,
    /// Output directory (refused if it exists, unless --force; a rerun with the same
    /// arguments resumes an unfinished one, and --force discards the saved layers of a run with
    /// other arguments).
    #[arg(long)]
    out: PathBuf,
    /// The calibration run directory (with imatrix.safetensors from `keep finalize`) or the file.
    #[arg(long)]
    imatrix: PathBuf,
    /// Code format: e8p2, e8p2+e81, e8p2+e8p2, or MLX affine mlx2, mlx3, mlx4, mlx8.
    #[arg(long, default_value = "e8p2", value_parser = parse_format)]
    format: (QuantFormat, Option<u32>),
    /// `all`, or a plan (keep-prune-plan JSON from `keep select`): only the experts it keeps
    /// are quantized, the rest stay as shipped.
    #[arg(long, default_value = "all")]
    experts: String,
    /// A precision-tier allocation (ALLOC.json from `keep alloc`): each expert at its own
    /// rung, `shipped` ones copied; --format and --experts are then ignored. An allocation
    /// that prunes is refused (solve it without `pruned`).
    #[arg(long)]
    alloc: Option<PathBuf>,
    /// Do only the layers L with L % N = I (0 ≤ I < N); the last shard to finish joins.
    #[arg(long, value_parser = crate::util::parse_shard, default_value = "0/1")]
    shard: (usize, usize),
    /// Incoherence processing of lattice-coded weights: off, on (random-sign Hadamard on both
    /// sides), out (output side only), auto (out for lattice formats, off for MLX codes).
    #[arg(long, default_value = "auto", value_parser = parse_incoherence)]
    incoherence: Incoherence,
    /// Seed of the incoherence transforms' signs (each tensor's own are derived from it).
    #[arg(long, default_value_t = DEFAULT_SEED)]
    incoherence_seed: u64,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

fn parse_format(s: &str) -> Result<(QuantFormat, Option<u32>), String> {
    let mlx = match s {
        "mlx2" => Some(2),
        "mlx3" => Some(3),
        "mlx4" => Some(4),
        "mlx8" => Some(8),
        _ => None,
    };
    if mlx.is_some() {
        return Ok((QuantFormat::E8p2, mlx));
    }
    QuantFormat::parse(s).map(|f| (f, None)).ok_or_else(|| {
        format!("unknown format {s}: e8p2, e8p2+e81, e8p2+e8p2, mlx2, mlx3, mlx4 or mlx8")
    })
}

/// `--incoherence`'s value: `None` = `auto`, else off (`Some(None)`) or a mode.
#[derive(Debug, Clone, Copy)]
struct Incoherence(Option<Option<Mode>>);

fn parse_incoherence(s: &str) -> Result<Incoherence, String> {
    match s {
        "auto" => Ok(Incoherence(None)),
        "off" => Ok(Incoherence(Some(None))),
        "on" => Ok(Incoherence(Some(Some(Mode::Both)))),
        "out" => Ok(Incoherence(Some(Some(Mode::Output)))),
        _ => Err(format!("--incoherence {s}: auto, on, off or out")),
    }
}

pub fn run(a: QuantArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let model = match a.model {
        Some(m) => m,
        None => crate::bundled::default_model_dir()?,
    };
    let out = a.out;
    crate::util::check_out_of_cache(&out)?;
    keep_checkpoint::writer::check_dir_target(&out, a.force, &[model.clone(), a.imatrix.clone()])?;
    let experts = if let Some(p) = &a.alloc {
        let al = keep_artifacts::alloc::Alloc::read(p)?;
        let fp = keep_checkpoint::fingerprint::model_fingerprint(&model)?;
        if al.model_fingerprint != fp {
            anyhow::bail!(
                "{}: the allocation is for another model (fingerprint {}, {} has {fp})",
                p.display(),
                al.model_fingerprint,
                model.display()
            );
        }
        ExpertSelection::from_alloc(&al)?
    } else if a.experts == "all" {
        ExpertSelection::All
    } else {
        ExpertSelection::from_plan(std::path::Path::new(&a.experts))?
    };
    let opts = QuantOptions {
        format: a.format.0,
        experts,
        shard: a.shard,
        force: a.force,
        mlx_bits: a.format.1,
    };
    let bar = crate::util::count_bar(0, "quant");
    let mode = match a.incoherence.0 {
        Some(m) => m,
        None if a.format.1.is_some() => None,
        None => Some(Mode::Output),
    };
    let incoherence = mode.map(|mode| IncoherenceOptions {
        mode,
        seed: a.incoherence_seed,
    });
    let r = quantize_with(&model, &a.imatrix, &out, &opts, incoherence, &|d, t| {
        bar.set_length(t as u64);
        bar.set_position(d as u64);
    })
    .with_context(|| format!("quantizing {} into {}", model.display(), out.display()))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let mb = r.source_bytes_fitted as f64 / 1e6;
    println!(
        "{}: fitted {} layers ({:.1} MB of source expert weights in {:.1} s, {:.2} MB/s)",
        r.method,
        r.layers_fitted.len(),
        mb,
        r.fit_seconds,
        mb / r.fit_seconds.max(1e-9)
    );
    if !r.joined {
        println!(
            "layers still to do: {:?}; run the other shards (or rerun without --shard) to join",
            r.layers_missing
        );
        return Ok(());
    }
    let mut mean: std::collections::BTreeMap<&str, (f64, usize)> = Default::default();
    for e in &r.experts {
        for (k, v) in &e.rel_error {
            let m = mean.entry(k.as_str()).or_default();
            m.0 += v;
            m.1 += 1;
        }
    }
    println!(
        "wrote {}: {} tensors at {:.3} bits/weight (scales included)",
        out.display(),
        r.tensors_quantized,
        r.bits_per_weight
    );
    crate::util::print_reused(&r.reused);
    for (k, (s, n)) in mean {
        println!(
            "  mean imatrix-weighted relative error per expert, {k}: {:.5}",
            s / n as f64
        );
    }
    Ok(())
}
