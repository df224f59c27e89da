//! `keep pack`: build a calibration pack from local text with the model's tokenizer.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_calib::pack::{build_pack, collect_documents, write_pack, PackOptions, Split};

/// Cut local text (files, directories or JSONL) into token records for calibration.
///
/// Each source (a file, or the JSONL lines sharing a `group`) is one group, tokenized whole
/// with the model's tokenizer.json and cut into records of at most --max-tokens tokens. Groups
/// go to the calibration or the held-out (eval) split by a seeded hash of their source, so the
/// splits are disjoint by group. Writes a directory: pack.json (keep-pack v1: tokenizer
/// fingerprint, splits, groups, sources), records.jsonl (id, group, token ids) and SHA256SUMS;
/// the output appears only when complete.
///
/// Example: keep pack --from corpus/ notes.jsonl --out /tmp/pack --max-tokens 512
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct PackArgs {
    /// Text sources: files, directories (recursive), or .jsonl files ({"text": ..., "group": ...}).
    #[arg(long, num_args = 1.., required = true)]
    from: Vec<PathBuf>,
    /// Output pack directory.
    #[arg(long)]
    out: PathBuf,
    /// The model whose tokenizer.json to use (default: the bundled model).
    #[arg(long, conflicts_with = "tokenizer")]
    model: Option<PathBuf>,
    /// A tokenizer.json to use instead of the model's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Most tokens per record.
    #[arg(long, default_value_t = 512)]
    max_tokens: usize,
    /// Fraction of groups held out for evaluation.
    #[arg(long, default_value_t = 0.1)]
    held_out_frac: f64,
    /// Seed of the split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Print the manifest summary as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: PackArgs) -> anyhow::Result<()> {
    crate::util::check_out_of_cache(&a.out)?;
    let tok = match (&a.tokenizer, &a.model) {
        (Some(t), _) => t.clone(),
        (None, Some(m)) => m.join("tokenizer.json"),
        (None, None) => crate::bundled::default_model_dir()?.join("tokenizer.json"),
    };
    if !tok.is_file() {
        anyhow::bail!(
            "{} does not exist: give --model DIR (with a tokenizer.json) or --tokenizer FILE",
            tok.display()
        );
    }
    let c = collect_documents(&a.from)?;
    for (p, why) in &c.skipped {
        eprintln!("skipped {}: {why}", p.display());
    }
    let opts = PackOptions {
        max_tokens: a.max_tokens,
        held_out_frac: a.held_out_frac,
        seed: a.seed,
    };
    let (m, records) = build_pack(&tok, &c.documents, &opts)?;
    let out = write_pack(&a.out, &m, &records, a.force)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let split = |s: Split| {
        let g: Vec<_> = m.groups.iter().filter(|g| g.split == s).collect();
        (
            g.len(),
            g.iter().map(|g| g.records).sum::<usize>(),
            g.iter().map(|g| g.tokens).sum::<usize>(),
        )
    };
    let (cg, cr, ct) = split(Split::Calibration);
    let (eg, er, et) = split(Split::Eval);
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "pack": out, "tokenizer_sha256": m.tokenizer_sha256, "records": m.n_records,
                "tokens": m.n_tokens, "skipped": c.skipped.len(),
                "calibration": {"groups": cg, "records": cr, "tokens": ct},
                "eval": {"groups": eg, "records": er, "tokens": et},
            }))?
        );
    } else {
        println!(
            "wrote {}: {} records, {} tokens; calibration {cg} groups / {cr} records / {ct} tokens, eval {eg} groups / {er} records / {et} tokens",
            out.display(),
            m.n_records,
            m.n_tokens
        );
    }
    Ok(())
}
