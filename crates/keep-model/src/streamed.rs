//! Layer-streamed forward: load one layer's weights, run every record through it, release it,
//! go on. Each record keeps its own streams, cache and shared state; every layer runs through
//! the same [`LayerWeights::forward`] the whole model uses, so the logits are bit-identical to
//! [`Model::forward`](crate::Model::forward) on the same records. Peak memory is one layer's
//! resolved weights plus the records' activations and caches (weights are views of the
//! checkpoint mapping: file-backed pages the kernel can drop once the layer is released).
//!
//! A record longer than the chunk ([`StreamOptions::prefill_chunk`]) runs through each layer chunk by chunk,
//! with the chunk positions and shared state the whole model's chunked forward uses, so the
//! layer's temporaries stay bounded by the chunk (the records' streams are held whole).
//!
//! Routed experts come from an [`ExpertSource`]; by default one resolved per layer. With
//! `release_pages`, the pages of a finished layer's tensors are dropped from this process
//! (`madvise(MADV_DONTNEED)` on the read-only file mapping: the data is unchanged and would
//! fault back in from the page cache), so the resident set stays near one layer.

use keep_checkpoint::Checkpoint;

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::engram::{table_view, EngramLayer, TableRows};
use crate::experts::{CheckpointExperts, ExpertSource};
use crate::family_layer::FamilyLayer;
use crate::hash::HashTable;
use crate::layer::{LayerWeights, Shared, Step};
use crate::model::{check_context, Logits};
use crate::observer::RouteObserver;
use crate::scratch::Scratch;
use crate::Result;

/// Options of a streamed run.
pub struct StreamOptions<'o> {
    pub logits: Logits,
    /// Router masks per layer (`None`: no mask).
    pub masks: Vec<Option<Vec<bool>>>,
    /// Replacement `tid2eid` tables per hash-routed layer (`None`: the checkpoint's own), in the
    /// checkpoint's expert ids: a pruning plan's remap applied without writing a checkpoint
    /// (pair it with the plan's router mask, which the replaced table must respect).
    pub hash_tables: Vec<Option<HashTable>>,
    /// Called after each layer with the layer index (progress).
    pub on_layer: Option<&'o mut dyn FnMut(usize)>,
    /// Drop a finished layer's pages from the process (see the module doc).
    pub release_pages: bool,
    /// Which kernels the products run on.
    pub kernels: keep_kernels::Kernels,
    /// Tokens per chunk of a record inside each layer (`None`: the default
    /// [`RunOptions::prefill_chunk`](crate::RunOptions::prefill_chunk)).
    pub prefill_chunk: Option<usize>,
}

impl Default for StreamOptions<'_> {
    fn default() -> Self {
        StreamOptions {
            logits: Logits::All,
            masks: vec![],
            hash_tables: vec![],
            on_layer: None,
            release_pages: true,
            kernels: keep_kernels::Kernels::Exact,
            prefill_chunk: None,
        }
    }
}

/// Drop the mapped pages of `layers.{layer}.*` from this process (advisory; errors ignored).
pub fn release_layer_pages(ck: &Checkpoint, layer: usize) {
    let prefix = format!("layers.{layer}.");
    // DeepSeek's `layers.N.` or Hugging Face's `model.layers.N.` (Qwen3-MoE).
    let hf = format!("model.{prefix}");
    for t in ck
        .tensors()
        .filter(|t| t.name.starts_with(&prefix) || t.name.starts_with(&hf))
    {
        if let Some(m) = ck.shards().get(t.shard).and_then(|s| s.mapping()) {
            let (off, len) = (t.file_offset as usize, t.bytes.len());
            if len > 0 && off + len <= m.len() {
                // SAFETY: a read-only file mapping that nobody writes: after DONTNEED the same
                // bytes fault back in from the file, so no reference observes a change.
                let _ = unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off, len)
                };
            }
        }
    }
}

/// Run `records` (each a token sequence from position 0) through the model one layer at a time.
/// `obs` sees layer-major order: layer 0 for every record, then layer 1, …
pub fn forward_streamed(
    ck: &Checkpoint,
    records: &[Vec<u32>],
    mut opts: StreamOptions,
    mut obs: Option<&mut dyn RouteObserver>,
) -> Result<Vec<Vec<f32>>> {
    let cfg = ModelConfig::from_checkpoint(ck)?;
    let kernels = opts.kernels;
    let chunk = opts
        .prefill_chunk
        .unwrap_or(crate::DEFAULT_PREFILL_CHUNK)
        .max(1);
    let globals = FamilyLayer::globals(ck, &cfg)?;
    let mut states = Vec::with_capacity(records.len());
    let mut scratch = Scratch::on(kernels);
    let mut engram_ids = Vec::with_capacity(records.len());
    for r in records {
        let mut cache = Cache::new(cfg.n_layers);
        let s = globals.embed(&cfg, r)?;
        engram_ids.push(match &cfg.engram {
            Some(lay) => lay.hash(&mut cache.engram_history, r)?,
            None => vec![],
        });
        check_context(&cfg, 0, r.len())?;
        // One shared state per chunk: a chunk's layers pass it on as the whole model's do.
        let chunks = r.len().div_ceil(chunk);
        states.push((
            s,
            cache,
            (0..chunks).map(|_| Shared::default()).collect::<Vec<_>>(),
        ));
    }
    for l in 0..cfg.n_layers {
        if let Some(fl) = FamilyLayer::load(ck, &cfg, l)? {
            // A Hugging Face family's layer over every record, chunk by chunk as the whole
            // model runs it.
            let experts = FamilyLayer::experts(ck, &cfg, l..l + 1)?;
            let mask = opts.masks.get(l).and_then(|m| m.as_deref());
            let d = cfg.dim;
            for (s, cache, _) in states.iter_mut() {
                for a in (0..s.t).step_by(chunk) {
                    let b = (a + chunk).min(s.t);
                    fl.forward(
                        &cfg,
                        kernels,
                        experts.as_ref(),
                        mask,
                        &mut s.x[a * d..b * d],
                        a,
                        &mut cache.layers[l].kv_rows,
                        obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
                    )?;
                }
                s.check_finite(|| format!("layer {l}"))?;
            }
            drop(experts);
            drop(fl);
            if opts.release_pages {
                release_layer_pages(ck, l);
            }
            if let Some(f) = opts.on_layer.as_deref_mut() {
                f(l);
            }
            continue;
        }
        let mut lw = LayerWeights::load(ck, &cfg, l)?;
        if let Some(Some(t)) = opts.hash_tables.get(l) {
            lw.replace_hash_table(&cfg, t.clone())?;
        }
        let experts = CheckpointExperts::for_layers(ck, &cfg, l..l + 1)?;
        let mask = opts.masks.get(l).and_then(|m| m.as_deref());
        let engram = match cfg
            .engram
            .as_ref()
            .and_then(|lay| lay.slot_of(l).map(|k| (lay, k)))
        {
            Some((lay, slot)) => Some((
                lay,
                EngramLayer::load(ck, &cfg, lay, slot)?,
                TableRows {
                    tables: (0..lay.layer_ids.len())
                        .map(|k| table_view(ck, lay, k, lay.layer_ids[k]))
                        .collect::<Result<Vec<_>>>()?,
                },
            )),
            None => None,
        };
        for ((s, cache, shared), ids) in states.iter_mut().zip(&engram_ids) {
            if s.t == 0 {
                continue;
            }
            for (c, sh) in shared.iter_mut().enumerate() {
                let (a, b) = (c * chunk, ((c + 1) * chunk).min(s.t));
                // The chunk's rows, run as the whole model runs its chunks (a record within one
                // chunk runs in place).
                let mut part = if s.t <= chunk {
                    None
                } else {
                    Some(s.rows(a, b))
                };
                let p = match part.as_mut() {
                    Some(p) => p,
                    None => &mut *s,
                };
                let step = Step {
                    start_pos: a,
                    previous: a.min(cfg.window),
                };
                if let Some((lay, el, rows)) = &engram {
                    let per = lay.layer_ids.len() * lay.cols();
                    el.forward(&cfg, kernels, lay, p, &ids[a * per..b * per], rows)?;
                }
                // One set of working buffers for every record's chunks, lent to each in turn
                // (each chunk's shared state keeps only what its layers pass on).
                sh.scratch = std::mem::take(&mut scratch);
                let r = lw.forward(
                    &cfg,
                    &experts as &dyn ExpertSource,
                    mask,
                    p,
                    step,
                    &mut cache.layers,
                    sh,
                    obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
                );
                scratch = std::mem::take(&mut sh.scratch);
                r?;
                p.check_finite(|| format!("layer {l}"))?;
                if let Some(p) = part {
                    s.set_rows(a, &p);
                }
            }
        }
        drop(experts);
        drop(lw);
        if opts.release_pages {
            release_layer_pages(ck, l);
        }
        if let Some(f) = opts.on_layer.as_deref_mut() {
            f(l);
        }
    }
    states
        .iter()
        .map(|(s, ..)| {
            if s.t == 0 {
                Ok(vec![])
            } else {
                globals.finish(&cfg, kernels, s, opts.logits)
            }
        })
        .collect()
}
