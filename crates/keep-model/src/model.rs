//! [`Model`]: the whole DeepSeek-V4.1 text model over a checkpoint (`TextModel` + `lm_head` of
//! the reference): embeddings, the layers, the final collapse, norm and head.
//!
//! [`Model::forward`] runs T new tokens from the cache's position (prefill when the cache is
//! empty, decode when T = 1) and returns logits as asked ([`Logits`]).

use keep_checkpoint::Checkpoint;
use keep_kernels::profile;

use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::engram::Engram;
use crate::experts::ExpertSource;
use crate::family_layer::FamilyLayer;
use crate::layer::{LayerWeights, Shared, Step, Streams};
use crate::observer::RouteObserver;
use crate::options::RunOptions;
use crate::{ModelError, Result};

pub use crate::globals::{check_context, Globals, Logits};

/// Run `tokens` as consecutive passes of at most `chunk` tokens through `pass` (tokens, which
/// logits), asking every pass but the last for no logits when only the last position's are
/// wanted, and joining the logits of all passes when all are: the one chunk loop of the whole
/// model and of keep-runtime's budgeted model.
pub fn run_chunked(
    tokens: &[u32],
    chunk: usize,
    which: Logits,
    mut pass: impl FnMut(&[u32], Logits) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let chunk = chunk.max(1);
    let n = tokens.len().div_ceil(chunk);
    let mut out = vec![];
    for (i, part) in tokens.chunks(chunk).enumerate() {
        let w = match which {
            Logits::Last if i + 1 < n => Logits::None,
            w => w,
        };
        let l = pass(part, w)?;
        if which == Logits::All {
            if i == 0 {
                // Every position's logits, allocated once (one pass gives the row size).
                out.reserve_exact(l.len() / part.len() * tokens.len());
            }
            out.extend_from_slice(&l);
        } else {
            out = l;
        }
    }
    Ok(out)
}

/// The step of a forward of `t` tokens on `cache`.
pub(crate) fn step_of(cfg: &ModelConfig, cache: &Cache) -> Step {
    Step {
        start_pos: cache.pos,
        previous: cache.pos.min(cfg.window),
    }
}

/// The whole model, borrowing its weights from an open checkpoint.
pub struct Model<'a> {
    /// What the checkpoint says.
    pub cfg: ModelConfig,
    /// How it runs: the kernels and the prefill chunk (the caller's, given when the model is
    /// built; [`Model::load_opts`]).
    pub opts: RunOptions,
    pub globals: Globals<'a>,
    pub layers: Vec<LayerWeights<'a>>,
    pub(crate) experts: Box<dyn ExpertSource + 'a>,
    pub(crate) masks: Vec<Option<Vec<bool>>>,
    /// Engram layers (`None` without `engram_layer_ids`).
    pub engram: Option<Engram<'a>>,
    /// A Hugging Face family's decoder layers (`layers` is then empty).
    pub family_layers: Vec<FamilyLayer<'a>>,
    /// The MTP drafter, once attached ([`Model::attach_mtp`]).
    pub(crate) mtp: Option<Box<crate::mtp::Drafter<'a>>>,
    /// The DSpark drafter, once attached ([`Model::attach_dspark`]).
    pub(crate) dspark: Option<Box<crate::dspark::DSparkDrafter<'a>>>,
}

impl<'a> Model<'a> {
    /// Load the model with routed experts read from the checkpoint itself, to run with the
    /// default options (exact kernels, the default prefill chunk).
    pub fn load(ck: &'a Checkpoint) -> Result<Self> {
        Self::load_opts(ck, RunOptions::default())
    }

    /// [`Model::load`] to run with `opts`.
    pub fn load_opts(ck: &'a Checkpoint, opts: RunOptions) -> Result<Self> {
        let cfg = ModelConfig::from_checkpoint(ck)?;
        let experts = FamilyLayer::experts(ck, &cfg, 0..cfg.n_layers)?;
        Ok(Self::load_with(ck, cfg, experts)?.with_options(opts))
    }

    /// The model to run with `opts` instead of its own.
    pub fn with_options(mut self, opts: RunOptions) -> Self {
        self.opts = opts;
        self
    }

    /// Load the model with routed experts from `experts`, to run with the default options
    /// ([`Model::with_options`] gives others).
    pub fn load_with(
        ck: &'a Checkpoint,
        cfg: ModelConfig,
        experts: Box<dyn ExpertSource + 'a>,
    ) -> Result<Self> {
        let globals = FamilyLayer::globals(ck, &cfg)?;
        let (layers, family_layers) = match FamilyLayer::load_all(ck, &cfg)? {
            Some(f) => (vec![], f),
            None => {
                let layers = (0..cfg.n_layers)
                    .map(|l| LayerWeights::load(ck, &cfg, l))
                    .collect::<Result<Vec<_>>>()?;
                (layers, vec![])
            }
        };
        let masks = vec![None; cfg.n_layers];
        let engram = Engram::load(ck, &cfg)?;
        Ok(Model {
            cfg,
            opts: RunOptions::default(),
            globals,
            layers,
            experts,
            masks,
            engram,
            family_layers,
            mtp: None,
            dspark: None,
        })
    }

    /// An empty cache for this model.
    pub fn new_cache(&self) -> Cache {
        Cache::new(self.cfg.n_layers)
    }

    /// Forbid the experts marked `true` in `layer`'s router (they are never chosen; the gate
    /// weights renormalise over the survivors). `None` clears the mask.
    pub fn set_router_mask(&mut self, layer: usize, mask: Option<Vec<bool>>) -> Result<()> {
        if layer >= self.cfg.n_layers {
            return Err(ModelError::Config(format!(
                "router mask for layer {layer} of {}",
                self.cfg.n_layers
            )));
        }
        if let Some(m) = &mask {
            let alive = m.iter().filter(|d| !**d).count();
            if m.len() != self.cfg.experts_in_layer(layer) || alive < self.cfg.top_k {
                return Err(ModelError::Config(format!(
                    "router mask of layer {layer}: {} entries with {alive} alive; need {} entries and at least num_experts_per_tok = {} alive",
                    m.len(),
                    self.cfg.experts_in_layer(layer),
                    self.cfg.top_k
                )));
            }
        }
        self.masks[layer] = mask;
        Ok(())
    }

    /// Route hash-routed `layer` by `table` (checkpoint expert ids) instead of its `tid2eid`
    /// (see [`LayerWeights::replace_hash_table`]).
    pub fn set_hash_table(&mut self, layer: usize, table: crate::hash::HashTable) -> Result<()> {
        let cfg = &self.cfg;
        let lw = self.layers.get_mut(layer).ok_or_else(|| {
            ModelError::Config(format!("hash table for layer {layer} of {}", cfg.n_layers))
        })?;
        lw.replace_hash_table(cfg, table)
    }

    /// Run `tokens` from the cache's position, updating the cache: in passes of at most
    /// [`RunOptions::prefill_chunk`] tokens (the logits are the same bit for bit; see
    /// [`crate::memory`]), refused past `max_position_embeddings`.
    pub fn forward(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.forward_into(tokens, cache, which, obs, &mut logits)?;
        Ok(logits)
    }

    /// [`Model::forward`] into `logits` (emptied first): with the cache's working buffers and
    /// a `logits` kept by the caller, a warm decode step allocates nothing.
    pub fn forward_into(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        mut obs: Option<&mut dyn RouteObserver>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        logits.clear();
        if cache.layers.len() != self.cfg.n_layers {
            return Err(ModelError::Cache(format!(
                "{} layer caches for a {}-layer model",
                cache.layers.len(),
                self.cfg.n_layers
            )));
        }
        if tokens.is_empty() {
            return Ok(());
        }
        check_context(&self.cfg, cache.pos, tokens.len())?;
        let chunk = self.opts.chunk();
        if tokens.len() <= chunk {
            return self.chunk_into(tokens, cache, which, obs, None, logits, None);
        }
        // A long prompt runs as consecutive chunks (see `crate::memory`): the same logits bit
        // for bit, activations bounded by the chunk.
        *logits = run_chunked(tokens, chunk, which, |part, w| {
            self.forward_chunk(
                part,
                cache,
                w,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
            )
        })?;
        Ok(())
    }

    /// [`Model::forward`] that also returns the last layer's streams of every token (the hidden
    /// state the MTP module reads), in chunks as `forward` runs them.
    pub fn forward_streams(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<(Vec<f32>, Streams)> {
        self.forward_captured(tokens, cache, which, obs, None)
    }

    /// [`Model::forward_streams`] that also records, when `capture` is given, the streams
    /// entering its layers (what the DSpark drafter reads).
    pub(crate) fn forward_captured(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        mut obs: Option<&mut dyn RouteObserver>,
        mut capture: Option<&mut crate::dspark::Capture>,
    ) -> Result<(Vec<f32>, Streams)> {
        if cache.layers.len() != self.cfg.n_layers {
            return Err(ModelError::Cache(format!(
                "{} layer caches for a {}-layer model",
                cache.layers.len(),
                self.cfg.n_layers
            )));
        }
        check_context(&self.cfg, cache.pos, tokens.len())?;
        let mut all = Streams {
            t: 0,
            x: vec![],
            pre_mix: vec![],
            tokens: vec![],
        };
        let chunk = self.opts.chunk();
        let logits = run_chunked(tokens, chunk, which, |part, w| {
            let (l, s) = self.forward_chunk_streams(
                part,
                cache,
                w,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
                capture.as_deref_mut(),
            )?;
            all.t += s.t;
            all.x.extend_from_slice(&s.x);
            all.pre_mix.extend_from_slice(&s.pre_mix);
            all.tokens.extend_from_slice(&s.tokens);
            Ok(l)
        })?;
        Ok((logits, all))
    }

    /// One forward pass over `tokens` (at most a chunk) from the cache's position.
    fn forward_chunk(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        self.chunk_into(tokens, cache, which, obs, None, &mut logits, None)?;
        Ok(logits)
    }

    /// [`Model::forward_chunk`] with the last layer's streams.
    fn forward_chunk_streams(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
        capture: Option<&mut crate::dspark::Capture>,
    ) -> Result<(Vec<f32>, Streams)> {
        let (mut logits, mut s) = (Vec::new(), Streams::default());
        self.chunk_into(
            tokens,
            cache,
            which,
            obs,
            capture,
            &mut logits,
            Some(&mut s),
        )?;
        Ok((logits, s))
    }

    /// One forward pass over `tokens` (at most a chunk) into `logits`, the hidden state and
    /// every intermediate in the cache's working buffers (lent for the pass and kept after);
    /// the last layer's streams copied into `streams` when asked.
    #[allow(clippy::too_many_arguments)]
    fn chunk_into(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        obs: Option<&mut dyn RouteObserver>,
        capture: Option<&mut crate::dspark::Capture>,
        logits: &mut Vec<f32>,
        streams: Option<&mut Streams>,
    ) -> Result<()> {
        let mut sc = std::mem::take(&mut cache.scratch);
        sc.ensure_reserved();
        sc.kernels = self.opts.kernels;
        let mut shared = Shared::with(sc);
        let sc = &mut shared.scratch;
        let mut s = Streams {
            t: 0,
            x: std::mem::take(&mut sc.x),
            pre_mix: std::mem::take(&mut sc.pre_mix),
            tokens: std::mem::take(&mut sc.tokens),
        };
        let r = self.chunk_with(
            tokens,
            cache,
            which,
            obs,
            capture,
            &mut s,
            &mut shared,
            logits,
        );
        if let (Ok(()), Some(out)) = (&r, streams) {
            out.clone_from(&s);
        }
        let mut sc = shared.into_scratch();
        (sc.x, sc.pre_mix, sc.tokens) = (s.x, s.pre_mix, s.tokens);
        sc.after_pass(tokens.len());
        cache.scratch = sc;
        r
    }

    /// [`Model::chunk_into`] on the lent streams `s` and call state `shared`.
    #[allow(clippy::too_many_arguments)]
    fn chunk_with(
        &self,
        tokens: &[u32],
        cache: &mut Cache,
        which: Logits,
        mut obs: Option<&mut dyn RouteObserver>,
        mut capture: Option<&mut crate::dspark::Capture>,
        s: &mut Streams,
        shared: &mut Shared,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        profile::begin_step(tokens.len());
        self.globals.embed_into(&self.cfg, tokens, s)?;
        s.check_finite(|| "the embedding".into())?;
        if self.cfg.family.is_hugging_face() {
            // A Hugging Face family's layers (whatever KV the family keeps, a latent attention's
            // compressed KV included, lives in each layer's `kv_rows`).
            for lw in &self.family_layers {
                let l = lw.layer();
                lw.forward_into(
                    &self.cfg,
                    self.experts.as_ref(),
                    self.masks[l].as_deref(),
                    &mut s.x,
                    cache.pos,
                    &mut cache.layers[l].kv_rows,
                    obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
                    &mut shared.scratch,
                )?;
                s.check_finite(|| format!("layer {l}"))?;
            }
            cache.pos += tokens.len();
            return self
                .globals
                .finish_into(&self.cfg, s, which, &mut shared.scratch, logits);
        }
        let step = step_of(&self.cfg, cache);
        if let Some(e) = &self.engram {
            let _p = profile::span(profile::Part::Engram);
            e.hash_into(
                &mut cache.engram_history,
                tokens,
                &mut shared.scratch.engram,
            )?;
        }
        if let Some(c) = capture.as_deref_mut() {
            c.begin(tokens.len(), self.cfg.dim);
        }
        for lw in &self.layers {
            if let Some(c) = capture.as_deref_mut() {
                c.record(lw.layer, s, self.cfg.hc, self.cfg.dim);
            }
            if let Some(e) = &self.engram {
                let _p = profile::span(profile::Part::Engram);
                e.apply(
                    &self.cfg,
                    self.opts.kernels,
                    lw.layer,
                    s,
                    &mut shared.scratch.engram,
                )?;
            }
            lw.forward(
                &self.cfg,
                self.experts.as_ref(),
                self.masks[lw.layer].as_deref(),
                s,
                step,
                &mut cache.layers,
                shared,
                obs.as_mut().map(|o| &mut **o as &mut dyn RouteObserver),
            )?;
            s.check_finite(|| format!("layer {}", lw.layer))?;
        }
        if let Some(c) = capture {
            c.end();
        }
        cache.pos += tokens.len();
        self.globals
            .finish_into(&self.cfg, s, which, &mut shared.scratch, logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dspark::Capture;

    #[test]
    fn capture_averages_the_streams_entering_the_listed_layers_in_list_order() {
        // Two rows, two streams of width three; layers 5 then 2 are listed.
        let s = Streams {
            t: 2,
            x: vec![
                1.0, 2.0, 3.0, 3.0, 4.0, 5.0, // row 0: streams 0 and 1
                -1.0, 0.0, 1.0, 1.0, 0.0, 3.0, // row 1
            ],
            pre_mix: vec![1.0, 0.0, 1.0, 0.0],
            tokens: vec![0, 0],
        };
        let mut c = Capture::new(vec![5, 2]);
        c.begin(2, 3);
        c.record(2, &s, 2, 3);
        c.record(3, &s, 2, 3);
        let doubled = Streams {
            x: s.x.iter().map(|v| v * 2.0).collect(),
            ..s.clone()
        };
        c.record(5, &doubled, 2, 3);
        c.end();
        assert_eq!(
            c.rows,
            vec![
                4.0, 6.0, 8.0, 2.0, 3.0, 4.0, // row 0: layer 5, layer 2
                0.0, 0.0, 4.0, 0.0, 0.0, 2.0, // row 1
            ]
        );
    }
}
