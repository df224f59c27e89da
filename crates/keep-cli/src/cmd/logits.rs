//! `keep logits`: run one prefill of the model on token ids (or a prompt) and write the f32
//! logits `[T, vocab]` (`logits`) and the token ids (`tokens`, int32) to a safetensors file, the
//! layout `tools/oracle/model_ref.py` writes for the reference, so the two compare directly.
//! The forward is keep-model's `logits::logits`, the file keep-artifacts' `logits`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_model::generate::{encode_prompt, load_tokenizer, Prompt};
use keep_model::logits::{logits, mtp_logits, LogitsOptions};
use keep_runtime::{Session, SessionSpec};

/// Write the model's logits for a token sequence to a safetensors file.
///
/// One prefill from position 0 (or, with --decode, one token at a time through the cache) of
/// the given token ids or of the prompt encoded with the model's tokenizer.json. The file holds
/// `logits` (f32 [T, vocab]) and `tokens` (int32 [T]), with format/version metadata.
///
/// Example: keep logits --prompt "Once upon a time" --out /tmp/logits.safetensors
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct LogitsArgs {
    /// Model directory (default: the bundled model).
    model: Option<PathBuf>,
    /// Comma-separated token ids.
    #[arg(long, conflicts_with = "prompt")]
    tokens: Option<String>,
    /// Text to encode with the model's tokenizer.json.
    #[arg(long)]
    prompt: Option<String>,
    /// Output safetensors file (refused if it exists, unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Replace an existing --out file.
    #[arg(long)]
    force: bool,
    /// Feed the tokens one at a time through the cache instead of one prefill.
    #[arg(long)]
    decode: bool,
    /// Also write `routes` (int32 [layers, T, top_k]): each layer's chosen experts per token,
    /// sorted ascending.
    #[arg(long)]
    routes: bool,
    /// Also write `mtp_logits` (f32 [T − 1, vocab]): the checkpoint's MTP module (`mtp.0.*`)
    /// after one prefill, row i from the main model's streams of token i and the embedding of
    /// token i + 1 (its prediction of token i + 2).
    #[arg(long)]
    mtp: bool,
    /// Also write the FP8 codes of every layer's window KV rows (a DeepSeek-V4.1 model rounds
    /// each KV row to E4M3 with a power-of-two scale per 32 elements): `kv_fp8_codes` (uint8
    /// [layers, T, head_dim], E4M3 bytes) and `kv_fp8_scale_exp` (int32 [layers, T,
    /// head_dim/32], the scale's power of two). For comparing with a reference's own rounding.
    #[arg(long)]
    fp8_kv: bool,
    #[command(flatten)]
    threads: crate::util::ThreadsArg,
}

/// The model directory: the argument, or the bundled model.
pub fn model_dir(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match arg {
        Some(p) => Ok(p),
        None => crate::bundled::default_model_dir(),
    }
}

pub fn run(a: LogitsArgs) -> anyhow::Result<()> {
    a.threads.apply()?;
    let dir = model_dir(a.model)?;
    crate::util::check_out_file(&a.out, a.force, &[&dir])?;
    let ids: Option<Vec<u32>> = match (&a.tokens, &a.prompt) {
        (Some(t), None) => Some(
            t.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.trim()
                        .parse::<u32>()
                        .with_context(|| format!("`{s}` is not a token id"))
                })
                .collect::<anyhow::Result<_>>()?,
        ),
        (None, Some(p)) => {
            anyhow::ensure!(!p.is_empty(), "no tokens to run");
            None
        }
        _ => anyhow::bail!("give --tokens 1,2,3 or --prompt TEXT"),
    };
    // The exact kernels and the default prefill chunk: what the fixtures and the conformance
    // suite compare.
    let session = Session::open(SessionSpec::new(&dir, keep_model::Kernels::Exact))
        .map_err(|e| crate::util::open_error(e, &dir))?;
    let model = session
        .whole_model()
        .with_context(|| format!("loading the model from {}", dir.display()))?;
    // A prompt is encoded as the reference tools encode it (the tokenizer's special tokens
    // added), by keep-model's one prompt encoder.
    let tokens = match ids {
        Some(ids) => ids,
        None => {
            let text = a.prompt.as_deref().unwrap_or_default();
            let tok = load_tokenizer(&dir)?;
            encode_prompt(&model.cfg, Some(&tok), Prompt::Text(text), 0)?
        }
    };
    anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
    let opts = LogitsOptions {
        decode: a.decode,
        routes: a.routes,
        fp8_kv: a.fp8_kv,
    };
    let mut file = logits(&model, &dir.display().to_string(), &tokens, &opts)?;
    if a.mtp {
        file.mtp_logits = Some(mtp_logits(session.checkpoint(), &model, &tokens)?);
    }
    file.write(&a.out, a.force)?;
    eprintln!(
        "wrote {} ({} tokens × {} logits)",
        a.out.display(),
        tokens.len(),
        file.vocab
    );
    Ok(())
}
