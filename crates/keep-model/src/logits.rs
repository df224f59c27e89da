//! `keep logits`' forward: the whole model over given token ids — one prefill from position 0,
//! or one token at a time through the cache — with every position's logits, optionally each
//! layer's chosen experts and the FP8 codes of the window KV rows, gathered into
//! keep-artifacts' [`LogitsFile`] (the layout `tools/oracle/model_ref.py` writes for the
//! reference). The caller writes the file; nothing here prints.

use keep_artifacts::logits::{LogitsFile, LogitsKvFp8, LogitsRoutes};

use crate::observer::{
    KvFp8Event, KvFp8Recorder, RouteEvent, RouteObserver, RouteRecorder, KV_FP8_BLOCK,
};
use crate::{Logits, Model, ModelError};
use keep_checkpoint::Checkpoint;

/// What [`logits`] runs and gathers.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogitsOptions {
    /// One token at a time through the cache instead of one prefill.
    pub decode: bool,
    /// Gather each layer's chosen experts per token (sorted ascending).
    pub routes: bool,
    /// Gather the FP8 codes of every layer's window KV rows (DeepSeek-V4.1 attention only).
    pub fp8_kv: bool,
}

/// The observer of one run: routes always, FP8 KV codes when asked.
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

/// Run `model` over `tokens` and gather what `opts` asks for; `model_name` is recorded in the
/// file (the model directory as the user gave it). Refuses no tokens, and `fp8_kv` on a model
/// that rounds no KV rows to FP8.
pub fn logits(
    model: &Model,
    model_name: &str,
    tokens: &[u32],
    opts: &LogitsOptions,
) -> Result<LogitsFile, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::Config("no tokens to run".into()));
    }
    let mut cache = model.new_cache();
    let mut rec = Observer {
        routes: RouteRecorder::default(),
        kv: opts.fp8_kv.then(KvFp8Recorder::default),
    };
    let logits = if opts.decode {
        let mut all = Vec::with_capacity(tokens.len() * model.cfg.vocab);
        for &t in tokens {
            all.extend(model.forward(&[t], &mut cache, Logits::All, Some(&mut rec))?);
        }
        all
    } else {
        model.forward(tokens, &mut cache, Logits::All, Some(&mut rec))?
    };
    let (nl, t, k) = (model.cfg.n_layers, tokens.len(), model.cfg.top_k);
    let outside = |what: &str, layer: usize, start: usize, rows: usize| {
        ModelError::Config(format!(
            "{what}: layer {layer} reported {rows} rows at position {start}, outside \
             {nl} layers × {t} tokens"
        ))
    };
    // Routes as [layers, T, top_k], each row sorted.
    let routes = if opts.routes {
        let mut routes = vec![-1i32; nl * t * k];
        for (layer, start, ex) in &rec.routes.calls {
            let rows = ex.len() / k.max(1);
            if *layer >= nl || start + rows > t {
                return Err(outside("routes", *layer, *start, rows));
            }
            for (i, row) in ex.chunks_exact(k).enumerate() {
                let mut r: Vec<i32> = row.iter().map(|&v| v as i32).collect();
                r.sort_unstable();
                let o = (layer * t + start + i) * k;
                routes[o..o + k].copy_from_slice(&r);
            }
        }
        Some(LogitsRoutes {
            layers: nl,
            top_k: k,
            experts: routes,
        })
    } else {
        None
    };
    // FP8 KV codes as [layers, T, head_dim] and scale exponents as [layers, T, head_dim/32].
    let hd = model.cfg.head_dim;
    let kv_fp8 =
        match &rec.kv {
            None => None,
            Some(kv) if kv.calls.is_empty() => return Err(ModelError::Config(
                "--fp8-kv: this model rounds no KV rows to FP8 (only DeepSeek-V4.1 attention does)"
                    .into(),
            )),
            Some(kv) => {
                let blocks = hd / KV_FP8_BLOCK;
                let mut codes = vec![0u8; nl * t * hd];
                let mut scale_exp = vec![0i32; nl * t * blocks];
                for c in &kv.calls {
                    if c.cols != hd
                        || c.layer >= nl
                        || c.start_pos + c.rows > t
                        || c.codes.len() != c.rows * hd
                        || c.scale_exp.len() != c.rows * blocks
                    {
                        return Err(outside("--fp8-kv", c.layer, c.start_pos, c.rows));
                    }
                    let o = (c.layer * t + c.start_pos) * hd;
                    codes[o..o + c.codes.len()].copy_from_slice(&c.codes);
                    let o = (c.layer * t + c.start_pos) * blocks;
                    scale_exp[o..o + c.scale_exp.len()].copy_from_slice(&c.scale_exp);
                }
                Some(LogitsKvFp8 {
                    layers: nl,
                    head_dim: hd,
                    block: KV_FP8_BLOCK,
                    codes,
                    scale_exp,
                })
            }
        };
    Ok(LogitsFile {
        model: model_name.to_string(),
        mode: if opts.decode { "decode" } else { "prefill" }.to_string(),
        vocab: model.cfg.vocab,
        tokens: tokens.iter().map(|&v| v as i32).collect(),
        logits,
        routes,
        kv_fp8,
        mtp_logits: None,
    })
}

/// The checkpoint's MTP module (`mtp.0.*`) after one prefill of `model` over `tokens`: f32
/// `[T − 1, vocab]`, row i from the main model's streams of token i and the embedding of token
/// i + 1. Refuses a checkpoint without the module and fewer than two tokens.
pub fn mtp_logits(ck: &Checkpoint, model: &Model, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
    let mtp = crate::Mtp::load(ck, &model.cfg)?.ok_or_else(|| {
        ModelError::Config("--mtp: the checkpoint has no MTP module (mtp.0.*)".into())
    })?;
    let mtp = mtp.with_kernels(model.opts.kernels);
    if tokens.len() < 2 {
        return Err(ModelError::Config("--mtp needs at least two tokens".into()));
    }
    mtp.prefill_logits(model, tokens)
}
