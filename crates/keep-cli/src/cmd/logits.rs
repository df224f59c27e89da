//! `keep logits`: run one prefill of the model on token ids (or a prompt) and write the f32
//! logits `[T, vocab]` (`logits`) and the token ids (`tokens`, int32) to a safetensors file, the
//! layout `tools/oracle/model_ref.py` writes for the reference, so the two compare directly.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use keep_checkpoint::Checkpoint;
use keep_model::observer::{
    KvFp8Event, KvFp8Recorder, RouteEvent, RouteObserver, RouteRecorder, KV_FP8_BLOCK,
};
use keep_model::{Logits, Model};
use safetensors::tensor::{Dtype, TensorView};

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
}

/// The observer of one `keep logits` run: routes always, FP8 KV codes when asked.
struct Observer {
    routes: RouteRecorder,
    kv: Option<KvFp8Recorder>,
}

impl RouteObserver for Observer {
    fn wants_kv_fp8(&self) -> bool {
        self.kv.is_some()
    }
    fn on_route(&mut self, ev: &RouteEvent) {
        self.routes.on_route(ev);
    }
    fn on_kv_fp8(&mut self, ev: &KvFp8Event) {
        if let Some(k) = &mut self.kv {
            k.on_kv_fp8(ev);
        }
    }
}

/// The model directory: the argument, or the bundled model.
pub fn model_dir(arg: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    match arg {
        Some(p) => Ok(p),
        None => crate::bundled::default_model_dir(),
    }
}

/// The model's tokenizer (`tokenizer.json` in its directory).
pub fn tokenizer(dir: &Path) -> anyhow::Result<tokenizers::Tokenizer> {
    Ok(keep_model::generate::load_tokenizer(dir)?)
}

/// Token ids of `text` (with the tokenizer's special tokens, as the reference tools encode).
pub fn encode(dir: &Path, text: &str) -> anyhow::Result<Vec<u32>> {
    let tok = tokenizer(dir)?;
    let enc = tok
        .encode(text, true)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

pub fn run(a: LogitsArgs) -> anyhow::Result<()> {
    let dir = model_dir(a.model)?;
    crate::util::check_out_file(&a.out, a.force, &[&dir])?;
    let tokens: Vec<u32> = match (&a.tokens, &a.prompt) {
        (Some(t), None) => t
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| {
                s.trim()
                    .parse::<u32>()
                    .with_context(|| format!("`{s}` is not a token id"))
            })
            .collect::<anyhow::Result<_>>()?,
        (None, Some(p)) => encode(&dir, p)?,
        _ => anyhow::bail!("give --tokens 1,2,3 or --prompt TEXT"),
    };
    anyhow::ensure!(!tokens.is_empty(), "no tokens to run");
    let ck = Checkpoint::open(&dir).with_context(|| format!("opening {}", dir.display()))?;
    let model =
        Model::load(&ck).with_context(|| format!("loading the model from {}", dir.display()))?;
    let mut cache = model.new_cache();
    let mut rec = Observer {
        routes: RouteRecorder::default(),
        kv: a.fp8_kv.then(KvFp8Recorder::default),
    };
    let logits = if a.decode {
        let mut all = Vec::with_capacity(tokens.len() * model.cfg.vocab);
        for &t in &tokens {
            all.extend(model.forward(&[t], &mut cache, Logits::All, Some(&mut rec))?);
        }
        all
    } else {
        model.forward(&tokens, &mut cache, Logits::All, Some(&mut rec))?
    };
    // Routes as [layers, T, top_k], each row sorted.
    let (nl, t, k) = (model.cfg.n_layers, tokens.len(), model.cfg.top_k);
    let mut routes = vec![-1i32; nl * t * k];
    for (layer, start, ex) in &rec.routes.calls {
        for (i, row) in ex.chunks_exact(k).enumerate() {
            let mut r: Vec<i32> = row.iter().map(|&v| v as i32).collect();
            r.sort_unstable();
            let o = (layer * t + start + i) * k;
            routes[o..o + k].copy_from_slice(&r);
        }
    }
    // FP8 KV codes as [layers, T, head_dim] and scale exponents as [layers, T, head_dim/32].
    let hd = model.cfg.head_dim;
    let (mut kv_codes, mut kv_exp) = (vec![], vec![]);
    if let Some(kv) = &rec.kv {
        anyhow::ensure!(
            !kv.calls.is_empty(),
            "--fp8-kv: this model rounds no KV rows to FP8 (only DeepSeek-V4.1 attention does)"
        );
        kv_codes = vec![0u8; nl * t * hd];
        kv_exp = vec![0i32; nl * t * (hd / KV_FP8_BLOCK)];
        for c in &kv.calls {
            anyhow::ensure!(
                c.cols == hd && c.layer < nl && c.start_pos + c.rows <= t,
                "--fp8-kv: layer {} reported {} rows of {} at position {}, outside [{nl}, {t}, {hd}]",
                c.layer,
                c.rows,
                c.cols,
                c.start_pos
            );
            let o = (c.layer * t + c.start_pos) * hd;
            kv_codes[o..o + c.codes.len()].copy_from_slice(&c.codes);
            let o = (c.layer * t + c.start_pos) * (hd / KV_FP8_BLOCK);
            kv_exp[o..o + c.scale_exp.len()].copy_from_slice(&c.scale_exp);
        }
    }
    let mtp_logits = if a.mtp {
        let mtp = keep_model::Mtp::load(&ck, &model.cfg)?
            .ok_or_else(|| anyhow::anyhow!("--mtp: the checkpoint has no MTP module (mtp.0.*)"))?;
        anyhow::ensure!(tokens.len() >= 2, "--mtp needs at least two tokens");
        mtp.prefill_logits(&model, &tokens)?
    } else {
        vec![]
    };
    let mb: Vec<u8> = mtp_logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let eb: Vec<u8> = kv_exp.iter().flat_map(|v| v.to_le_bytes()).collect();
    let rb: Vec<u8> = routes.iter().flat_map(|v| v.to_le_bytes()).collect();
    let lb: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tb: Vec<u8> = tokens
        .iter()
        .flat_map(|&v| (v as i32).to_le_bytes())
        .collect();
    let mut m = HashMap::new();
    m.insert(
        "logits".to_string(),
        TensorView::new(Dtype::F32, vec![tokens.len(), model.cfg.vocab], &lb)?,
    );
    m.insert(
        "tokens".to_string(),
        TensorView::new(Dtype::I32, vec![tokens.len()], &tb)?,
    );
    if a.routes {
        m.insert(
            "routes".to_string(),
            TensorView::new(Dtype::I32, vec![nl, t, k], &rb)?,
        );
    }
    if a.mtp {
        m.insert(
            "mtp_logits".to_string(),
            TensorView::new(Dtype::F32, vec![tokens.len() - 1, model.cfg.vocab], &mb)?,
        );
    }
    if a.fp8_kv {
        m.insert(
            "kv_fp8_codes".to_string(),
            TensorView::new(Dtype::U8, vec![nl, t, hd], &kv_codes)?,
        );
        m.insert(
            "kv_fp8_scale_exp".to_string(),
            TensorView::new(Dtype::I32, vec![nl, t, hd / KV_FP8_BLOCK], &eb)?,
        );
    }
    let meta: HashMap<String, String> = [
        ("format".to_string(), "keep-logits".to_string()),
        ("version".to_string(), "1".to_string()),
        ("model".to_string(), dir.display().to_string()),
        (
            "mode".to_string(),
            if a.decode { "decode" } else { "prefill" }.to_string(),
        ),
    ]
    .into();
    let bytes = safetensors::serialize(m, Some(meta))?;
    keep_checkpoint::atomic::write_file(&a.out, &bytes, a.force)?;
    eprintln!(
        "wrote {} ({} tokens × {} logits)",
        a.out.display(),
        tokens.len(),
        model.cfg.vocab
    );
    Ok(())
}
