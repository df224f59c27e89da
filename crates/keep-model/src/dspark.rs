//! DSpark, the parallel drafter DeepSeek-V4.1 checkpoints store under `mtp.0.*` …
//! `mtp.{n−1}.*` (`docs/dspark.md` pins the followed code, NeMo Automodel's
//! `deepseek_v41/dspark.py`, and lists every point where public copies disagree).
//!
//! One draft proposes a block of `dspark_block_size` tokens in one pass. The target's hidden
//! states of the layers in `dspark_target_layer_ids`, concatenated, are projected once per
//! context row (`mtp.0.main_proj`, `mtp.0.main_norm`: [`DSpark::project`]). The block's rows —
//! the embedding of the first token, then the noise token's — sit at the positions after the
//! anchor (the last context row) and run through the stages: each is a V4.1 single-pass
//! hyper-connection block whose attention reads the context rows of the sliding window ending
//! at the anchor and every row of the block (no causal mask inside it), and whose MoE has the
//! drafter's own expert count and top-k. The last stage's collapse, `norm` and the target's
//! `head` give each row's base logits; the Markov head adds, row by row, a bias from the token
//! drafted before it (the first row's from the first token), the arg-max is the draft token,
//! and the confidence head scores each draft from the pre-norm row and that token's Markov
//! embedding ([`DSpark::draft`]).
//!
//! The attention's keys are not FP8 fake-quantised (the followed copy does not quantise them,
//! unlike the main layers' window cache).

use keep_checkpoint::{Checkpoint, DSparkKeys};
use keep_kernels::matmul::dot;
use keep_kernels::{matmul, WeightView};

use crate::cache::Cache;
use crate::config::{LayerRoles, ModelConfig};
use crate::experts::{ExpertSource, ExpertWeights};
use crate::layer::{attend, collapse, expand, hc_mix, LayerWeights, Step, Streams};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// The tensor whose presence marks a checkpoint carrying a DSpark drafter.
pub const MARKER: &str = "mtp.0.main_proj.weight";

/// Whether `ck` carries a DSpark drafter: its config declares the `dspark_*` keys and its first
/// module has the target-feature projection.
pub fn present(ck: &Checkpoint) -> bool {
    ck.contains(MARKER) && ck.config().is_some_and(|c| c.dspark().is_some())
}

/// A stage's routed experts (`mtp.k.ffn.experts.E.w{1,2,3}`), answered as layer `layer`.
struct StageExperts<'a> {
    layer: usize,
    experts: Vec<ExpertWeights<'a>>,
}

impl ExpertSource for StageExperts<'_> {
    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertWeights<'_>> {
        match self.experts.get(expert) {
            Some(w) if layer == self.layer => Ok(*w),
            _ => Err(ModelError::Expert {
                layer,
                expert,
                msg: "not an expert of this DSpark stage".into(),
            }),
        }
    }
}

/// The DSpark drafter's weights (views of the checkpoint).
pub struct DSpark<'a> {
    /// The model's config with the drafter's stages as layers `n_layers + k` (window only), its
    /// top-k and its expert count.
    pub cfg: ModelConfig,
    /// The kernels its products run on (the main model's; exact unless
    /// [`DSpark::with_kernels`] gives others).
    pub kernels: keep_kernels::Kernels,
    /// The config's DSpark keys, defaults applied.
    pub keys: DSparkKeys,
    stages: Vec<LayerWeights<'a>>,
    experts: Vec<StageExperts<'a>>,
    main_proj: WeightView<'a>,
    main_norm: Vec<f32>,
    norm: Vec<f32>,
    markov_embed: WeightView<'a>,
    markov_head: WeightView<'a>,
    /// `confidence_head.proj.weight`, `[dim + rank]`.
    confidence: Vec<f32>,
    embed: WeightView<'a>,
    head: WeightView<'a>,
}

/// One drafted block and what produced it.
#[derive(Debug, Clone)]
pub struct DraftBlock {
    /// The streams and hand-on pre-mix after each stage (`[B × hc × dim]`, `[B × hc]`).
    pub stages: Vec<Streams>,
    /// The last stage's collapsed rows before the final norm, `[B × dim]`.
    pub hidden: Vec<f32>,
    /// After the final norm, `[B × dim]`.
    pub normed: Vec<f32>,
    /// The target head on the normed rows, `[B × vocab]`.
    pub base_logits: Vec<f32>,
    /// Base logits plus each row's Markov bias, `[B × vocab]`.
    pub draft_logits: Vec<f32>,
    /// One acceptance logit per draft (`sigmoid` is the predicted probability), `[B]`.
    pub confidence: Vec<f32>,
    /// The greedy draft tokens, `[B]`.
    pub tokens: Vec<u32>,
}

impl<'a> DSpark<'a> {
    /// The drafter to run its products on `kernels`.
    pub fn with_kernels(mut self, kernels: keep_kernels::Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// The drafter of `ck` (`None` when the config declares no DSpark keys), checked against
    /// `cfg`: every tensor present with its shape, or an error naming the tensor.
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Option<Self>> {
        let Some(keys) = cfg.raw.dspark() else {
            return Ok(None);
        };
        let n = cfg.raw.num_nextn_predict_layers;
        let mut c = cfg.clone();
        c.top_k = keys.num_experts_per_tok;
        c.n_experts = keys.n_routed_experts;
        // The stages' routers: the DSpark count, unless pruning recorded per-module counts.
        if c.raw.n_routed_experts_mtp.is_none() {
            c.raw.n_routed_experts_mtp = Some(vec![keys.n_routed_experts; n]);
        }
        let first = cfg.n_layers;
        c.roles.truncate(first);
        c.roles.extend((0..n).map(|_| LayerRoles {
            ratio: 0,
            kv_source: false,
            index_source: false,
            candidate_source: false,
        }));
        let hint = cfg.raw.weight_block_size();
        let (d, i, v, r) = (cfg.dim, cfg.inter, cfg.vocab, keys.markov_rank);
        let marker = crate::experts::incoherence_map(ck)?;
        let mut stages = Vec::with_capacity(n);
        let mut experts = Vec::with_capacity(n);
        for k in 0..n {
            let p = format!("mtp.{k}.");
            let layer = first + k;
            stages.push(LayerWeights::load_at(ck, &c, layer, &p)?);
            let list = (0..c.experts_in_layer(layer))
                .map(|x| {
                    let e = format!("{p}ffn.experts.{x}");
                    let b = [format!("{e}.w1"), format!("{e}.w2"), format!("{e}.w3")];
                    Ok(ExpertWeights {
                        w1: weight(ck, &b[0], i, d, hint)?,
                        w2: weight(ck, &b[1], d, i, hint)?,
                        w3: weight(ck, &b[2], i, d, hint)?,
                        rht: crate::experts::expert_rht(&marker, [&b[0], &b[1], &b[2]], d, i)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            experts.push(StageExperts {
                layer,
                experts: list,
            });
        }
        let last = format!("mtp.{}.", n - 1);
        let targets = keys.target_layer_ids.len();
        Ok(Some(DSpark {
            kernels: keep_kernels::Kernels::Exact,
            main_proj: weight(ck, "mtp.0.main_proj", d, d * targets, hint)?,
            main_norm: vec_f32(ck, "mtp.0.main_norm.weight", d)?,
            norm: vec_f32(ck, &format!("{last}norm.weight"), d)?,
            markov_embed: weight(ck, &format!("{last}markov_head.embed"), v, r, hint)?,
            markov_head: weight(ck, &format!("{last}markov_head.head"), v, r, hint)?,
            confidence: vec_f32(ck, &format!("{last}confidence_head.proj.weight"), d + r)?,
            embed: weight(ck, "embed", v, d, hint)?,
            head: weight(ck, "head", v, d, hint)?,
            stages,
            experts,
            keys,
            cfg: c,
        }))
    }

    /// Draft positions per block.
    pub fn block_size(&self) -> usize {
        self.keys.block_size
    }

    /// `main_norm(main_proj(F))` of `rows` context rows of target features (`[rows × L·dim]`,
    /// the listed layers' hidden states concatenated in list order): `[rows × dim]`.
    pub fn project(&self, features: &[f32], rows: usize) -> Result<Vec<f32>> {
        let d = self.cfg.dim;
        let width = d * self.keys.target_layer_ids.len();
        if features.len() != rows * width {
            return Err(ModelError::Config(format!(
                "DSpark target features: {} values for {rows} rows of {} layers × {d}",
                features.len(),
                self.keys.target_layer_ids.len()
            )));
        }
        let mut out = vec![0f32; rows * d];
        matmul(features, rows, &self.main_proj, &mut out)?;
        crate::linear::rms_norm(&mut out, d, Some(&self.main_norm), self.cfg.eps);
        Ok(out)
    }

    /// One block drafted after the target has processed the row at `anchor_pos`. `context`
    /// holds projected rows ([`DSpark::project`]) at positions `anchor_pos + 1 − rows ..=
    /// anchor_pos`; only the last `sliding_window` of them are read. `first` is the token of the
    /// first draft slot and the first Markov predecessor (docs/dspark.md, "Which token goes in
    /// the first slot").
    pub fn draft(
        &self,
        context: &[f32],
        rows: usize,
        anchor_pos: usize,
        first: u32,
    ) -> Result<DraftBlock> {
        self.draft_with(context, rows, anchor_pos, first, &mut |l| argmax(l) as u32)
    }

    /// [`DSpark::draft`] with each draft token chosen by `pick` from its Markov-corrected
    /// logits (greedy: the arg-max; sampling: a draw from `softmax(ℓ / T)`); the next row's
    /// Markov bias follows the token picked.
    pub fn draft_with(
        &self,
        context: &[f32],
        rows: usize,
        anchor_pos: usize,
        first: u32,
        pick: &mut dyn FnMut(&[f32]) -> u32,
    ) -> Result<DraftBlock> {
        let cfg = &self.cfg;
        let (hc, d, v, b) = (cfg.hc, cfg.dim, cfg.vocab, self.keys.block_size);
        if context.len() != rows * d || rows == 0 || rows > anchor_pos + 1 {
            return Err(ModelError::Config(format!(
                "DSpark context: {} values for {rows} rows of {d} ending at position {anchor_pos}",
                context.len()
            )));
        }
        crate::globals::check_context(cfg, anchor_pos + 1, b)?;
        for &id in [first, self.keys.noise_token_id as u32].iter() {
            if id as usize >= v {
                return Err(ModelError::Token { id, vocab: v });
            }
        }
        let c = rows.min(cfg.window);
        let ctx = &context[(rows - c) * d..];
        let mut ids = vec![self.keys.noise_token_id as u32; b];
        ids[0] = first;
        let mut x = vec![0f32; b * hc * d];
        let mut row = vec![0f32; d];
        for (i, &id) in ids.iter().enumerate() {
            self.embed.decode_row(id as usize, &mut row);
            for s in 0..hc {
                x[(i * hc + s) * d..(i * hc + s + 1) * d].copy_from_slice(&row);
            }
        }
        let mut pre_mix = vec![0f32; b * hc];
        for i in 0..b {
            pre_mix[i * hc] = 1.0;
        }
        let mut s = Streams {
            t: b,
            x,
            pre_mix,
            tokens: ids,
        };
        let mut stages = Vec::with_capacity(self.stages.len());
        for k in 0..self.stages.len() {
            self.stage(k, &mut s, ctx, c, anchor_pos)?;
            s.check_finite(|| format!("DSpark stage {k}"))?;
            stages.push(s.clone());
        }
        let hidden = collapse(&s, &s.pre_mix, hc, d);
        let mut normed = hidden.clone();
        crate::linear::rms_norm(&mut normed, d, Some(&self.norm), cfg.eps);
        let mut base = vec![0f32; b * v];
        matmul(&normed, b, &self.head, &mut base)?;
        // The Markov chain: row j's bias comes from the token drafted at row j − 1.
        let r = self.keys.markov_rank;
        let (mut prev, mut tokens) = (first, Vec::with_capacity(b));
        let mut logits = base.clone();
        let mut confidence = Vec::with_capacity(b);
        let (mut e, mut bias) = (vec![0f32; r], vec![0f32; v]);
        for j in 0..b {
            self.markov_embed.decode_row(prev as usize, &mut e);
            matmul(&e, 1, &self.markov_head, &mut bias)?;
            let l = &mut logits[j * v..(j + 1) * v];
            for (a, bb) in l.iter_mut().zip(&bias) {
                *a += bb;
            }
            confidence.push(
                dot(&self.confidence[..d], &hidden[j * d..(j + 1) * d])
                    + dot(&self.confidence[d..], &e),
            );
            prev = pick(l);
            if prev as usize >= v {
                return Err(ModelError::Token { id: prev, vocab: v });
            }
            tokens.push(prev);
        }
        Ok(DraftBlock {
            stages,
            hidden,
            normed,
            base_logits: base,
            draft_logits: logits,
            confidence,
            tokens,
        })
    }

    /// `_DeepseekV41DSparkBlock.forward` on the block's streams (in place).
    fn stage(&self, k: usize, s: &mut Streams, ctx: &[f32], c: usize, anchor: usize) -> Result<()> {
        let cfg = &self.cfg;
        let w = &self.stages[k];
        let (hc, d) = (cfg.hc, cfg.dim);
        let (attn_pre, attn_post, attn_comb) = hc_mix(&w.hc_attn, s, cfg)?;
        let mut h = collapse(s, &s.pre_mix, hc, d);
        crate::linear::rms_norm(&mut h, d, Some(&w.attn_norm), cfg.eps);
        let a = self.attention(w, &h, s.t, ctx, c, anchor)?;
        expand(&a, s, &attn_post, &attn_comb, hc, d);
        let (ffn_pre, ffn_post, ffn_comb) = hc_mix(&w.hc_ffn, s, cfg)?;
        let mut h = collapse(s, &attn_pre, hc, d);
        crate::linear::rms_norm(&mut h, d, Some(&w.ffn_norm), cfg.eps);
        let step = Step {
            start_pos: anchor + 1,
            previous: c,
        };
        let m = w.moe(
            cfg,
            self.kernels,
            &self.experts[k],
            None,
            &h,
            &s.tokens,
            step,
            &mut None,
        )?;
        expand(&m, s, &ffn_post, &ffn_comb, hc, d);
        s.pre_mix = ffn_pre;
        Ok(())
    }

    /// `_DeepseekV41DSparkAttention.forward`: the block's `t` rows (`x`, normed, at positions
    /// `anchor + 1 …`) attend to the `c` context rows (positions `anchor + 1 − c ..= anchor`) and
    /// to every block row, each head with its sink; then RoPE is undone and the grouped output
    /// projection applied.
    fn attention(
        &self,
        w: &LayerWeights<'_>,
        x: &[f32],
        t: usize,
        ctx: &[f32],
        c: usize,
        anchor: usize,
    ) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let (d, h, hd, ql) = (cfg.dim, cfg.heads, cfg.head_dim, cfg.q_lora);
        let mut qr = vec![0f32; t * ql];
        matmul(x, t, &w.wq_a, &mut qr)?;
        crate::linear::rms_norm(&mut qr, ql, Some(&w.q_norm), cfg.eps);
        let mut q = vec![0f32; t * h * hd];
        matmul(&qr, t, &w.wq_b, &mut q)?;
        for i in 0..t {
            let pos = (anchor + 1 + i) as f32;
            for hh in 0..h {
                let o = (i * h + hh) * hd;
                w.rope.apply(&mut q[o..o + hd], pos, false);
            }
        }
        let n = c + t;
        let mut src = Vec::with_capacity(n * d);
        src.extend_from_slice(&ctx[..c * d]);
        src.extend_from_slice(x);
        let mut kv = vec![0f32; n * hd];
        matmul(&src, n, &w.wkv, &mut kv)?;
        crate::linear::rms_norm(&mut kv, hd, Some(&w.kv_norm), cfg.eps);
        for (r, row) in kv.chunks_exact_mut(hd).enumerate() {
            // Context row r sits at anchor + 1 − c + r; block row i at anchor + 1 + i.
            w.rope.apply(row, (anchor + 1 + r - c) as f32, false);
        }
        let rows: Vec<&[f32]> = kv.chunks_exact(hd).collect();
        let scale = (hd as f32).powf(-0.5);
        let mut out = vec![0f32; t * h * hd];
        let mut scores = Vec::with_capacity(n);
        for i in 0..t {
            let pos = (anchor + 1 + i) as f32;
            for hh in 0..h {
                let o = (i * h + hh) * hd;
                attend(
                    &q[o..o + hd],
                    scale,
                    &rows,
                    w.sinks[hh],
                    &mut out[o..o + hd],
                    &mut scores,
                );
                w.rope.apply(&mut out[o..o + hd], pos, true);
            }
        }
        w.grouped_out(cfg, self.kernels, &out, t, &mut None)
    }
}

/// Index of the largest value, the first of equals (as torch's `argmax`).
fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// What a forward records for the DSpark drafter: for every row, the streams entering each
/// layer of `layers` averaged over the hyper-connection streams, concatenated in list order
/// (`[rows × layers.len() · dim]`; docs/dspark.md, "Which hidden states are the target's").
#[derive(Debug, Clone, Default)]
pub(crate) struct Capture {
    pub(crate) layers: Vec<usize>,
    /// Every row recorded so far.
    pub(crate) rows: Vec<f32>,
    /// The rows of the chunk running.
    chunk: Vec<f32>,
}

impl Capture {
    pub(crate) fn new(layers: Vec<usize>) -> Capture {
        Capture {
            layers,
            ..Capture::default()
        }
    }

    pub(crate) fn begin(&mut self, t: usize, dim: usize) {
        self.chunk = vec![0f32; t * self.layers.len() * dim];
    }

    /// The streams `s` entering `layer`.
    pub(crate) fn record(&mut self, layer: usize, s: &Streams, hc: usize, dim: usize) {
        let Some(li) = self.layers.iter().position(|&l| l == layer) else {
            return;
        };
        let n = self.layers.len();
        let inv = 1.0 / hc as f32;
        for i in 0..s.t {
            let out = &mut self.chunk[(i * n + li) * dim..(i * n + li + 1) * dim];
            for k in 0..hc {
                let row = &s.x[(i * hc + k) * dim..(i * hc + k + 1) * dim];
                for (o, x) in out.iter_mut().zip(row) {
                    *o += x;
                }
            }
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }

    pub(crate) fn end(&mut self) {
        self.rows.append(&mut self.chunk);
    }
}

/// The last verify forward: the main cache before it, the tokens and their projected rows.
pub(crate) struct DSparkVerify {
    pub(crate) before: Cache,
    pub(crate) tokens: Vec<u32>,
    pub(crate) rows: Vec<f32>,
}

/// The DSpark drafter attached to a [`crate::Model`] (`Model::attach_dspark`).
pub(crate) struct DSparkDrafter<'a> {
    pub(crate) ds: DSpark<'a>,
    /// Drafts verified per forward (at most the block size).
    pub(crate) k: usize,
    /// Drafting may be turned off when it does not pay.
    pub(crate) auto: bool,
    /// Verify only the drafts whose predicted chance of all being accepted (the product of
    /// their confidences' sigmoids) is at least this ([`Model::set_dspark_confidence`]).
    pub(crate) min_confidence: Option<f32>,
    /// Projected context rows (`[rows × dim]`), the last ending at position `next − 1`.
    pub(crate) ctx: Vec<f32>,
    pub(crate) next: usize,
    pub(crate) verify: Option<DSparkVerify>,
}

impl DSparkDrafter<'_> {
    pub(crate) fn capture(&self) -> Capture {
        Capture::new(self.ds.keys.target_layer_ids.clone())
    }

    /// Append the projected rows of the first `n` of `features`' rows, which sit at positions
    /// `start ..`; only the window's rows are kept.
    pub(crate) fn push(&mut self, features: &[f32], start: usize, n: usize) -> Result<()> {
        let d = self.ds.cfg.dim;
        let width = d * self.ds.keys.target_layer_ids.len();
        if start != self.next {
            return Err(ModelError::Cache(format!(
                "DSpark context rows end at position {} but the forward started at {start}",
                self.next
            )));
        }
        let w = self.ds.cfg.window.max(1);
        let skip = n.saturating_sub(w);
        let rows = self
            .ds
            .project(&features[skip * width..n * width], n - skip)?;
        self.ctx.extend_from_slice(&rows);
        let have = self.ctx.len() / d;
        if have > w {
            self.ctx.drain(..(have - w) * d);
        }
        self.next = start + n;
        Ok(())
    }
}
