//! The model's ends, outside any layer: [`Globals`] (the embedding, DeepSeek-V4's final stream
//! collapse, the final norm and the head, shared by the whole model, the layer-streamed model
//! and the MTP module, which brings its own norm and collapse), which logits a forward returns
//! ([`Logits`]), and the context check every forward makes ([`check_context`]).

use keep_checkpoint::Checkpoint;
use keep_kernels::profile::{self, Part};
use keep_kernels::{matmul, ops, WeightView};

use crate::config::{Family, ModelConfig};
use crate::layer::Streams;
use crate::scratch::{zeroed, Scratch};
use crate::weights::{vec_f32, weight};
use crate::{ModelError, Result};

/// Which logits a forward returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// `[T × vocab]`.
    All,
    /// `[vocab]` of the last token.
    Last,
    /// None (the cache is what is wanted).
    None,
}

/// Embedding, final norm and head: what is not in a layer.
pub struct Globals<'a> {
    pub embed: WeightView<'a>,
    pub head: WeightView<'a>,
    pub norm: Vec<f32>,
    /// DeepSeek-V4's final stream collapse (`hc_head_fn` `[hc × hc·dim]`, `hc_head_base`
    /// `[hc]`, `hc_head_scale` `[1]`); V4.1 collapses with the last layer's pre-mix instead.
    pub hc_head: Option<(WeightView<'a>, Vec<f32>, f32)>,
}

impl<'a> Globals<'a> {
    /// Hugging Face's names (Qwen3-MoE, DeepSeek-V3): `model.embed_tokens`, `model.norm` and
    /// `lm_head`, or the embedding itself where the family config ties the head to it.
    pub fn load_hugging_face(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Self> {
        use keep_checkpoint::qwen3::{EMBED, HEAD, NORM};
        let hint = cfg.raw.weight_block_size();
        let tied = cfg.raw.family().tie_word_embeddings(&cfg.raw);
        // One stream (`hc` = 1): the embedding row itself; a tied head is the embedding.
        let embed = weight(ck, EMBED, cfg.vocab, cfg.dim, hint)?;
        Ok(Globals {
            embed,
            head: if tied {
                embed
            } else {
                weight(ck, HEAD, cfg.vocab, cfg.dim, hint)?
            },
            norm: vec_f32(ck, NORM, cfg.dim)?,
            hc_head: None,
        })
    }

    /// DeepSeek V4's names: `embed.weight`, `head.weight`, `norm.weight` (and V4's
    /// `hc_head_*`).
    pub fn load(ck: &'a Checkpoint, cfg: &ModelConfig) -> Result<Self> {
        let hint = cfg.raw.weight_block_size();
        Ok(Globals {
            embed: weight(ck, "embed", cfg.vocab, cfg.dim, hint)?,
            head: weight(ck, "head", cfg.vocab, cfg.dim, hint)?,
            norm: vec_f32(ck, "norm.weight", cfg.dim)?,
            hc_head: if cfg.family == Family::V4 {
                let t = crate::weights::tensor(ck, "hc_head_fn")?;
                Some((
                    crate::weights::view(t, None, cfg.hc, cfg.hc * cfg.dim, None)?,
                    vec_f32(ck, "hc_head_base", cfg.hc)?,
                    vec_f32(ck, "hc_head_scale", 1)?[0],
                ))
            } else {
                None
            },
        })
    }

    /// The initial streams: each token's embedding copied into all `hc` streams, pre-mix
    /// `[1, 0, …]`.
    pub fn embed(&self, cfg: &ModelConfig, tokens: &[u32]) -> Result<Streams> {
        let mut s = Streams::default();
        self.embed_into(cfg, tokens, &mut s)?;
        Ok(s)
    }

    /// [`Globals::embed`] into `s` (its buffers reused).
    pub fn embed_into(&self, cfg: &ModelConfig, tokens: &[u32], s: &mut Streams) -> Result<()> {
        let (hc, d) = (cfg.hc, cfg.dim);
        let t = tokens.len();
        s.t = t;
        let x = zeroed(&mut s.x, t * hc * d);
        for (i, &id) in tokens.iter().enumerate() {
            if id as usize >= cfg.vocab {
                return Err(ModelError::Token {
                    id,
                    vocab: cfg.vocab,
                });
            }
            let first = i * hc * d;
            self.embed.decode_row(id as usize, &mut x[first..first + d]);
            profile::read(self.embed.nbytes() / self.embed.rows.max(1));
            for k in 1..hc {
                x.copy_within(first..first + d, first + k * d);
            }
        }
        let pre_mix = zeroed(&mut s.pre_mix, t * hc);
        for i in 0..t {
            pre_mix[i * hc] = 1.0;
        }
        s.tokens.clear();
        s.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Final collapse, norm and head (on `kernels`) for the rows `which` asks for.
    pub fn finish(
        &self,
        cfg: &ModelConfig,
        kernels: keep_kernels::Kernels,
        s: &Streams,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.finish_into(cfg, s, which, &mut Scratch::on(kernels), &mut out)?;
        Ok(out)
    }

    /// [`Globals::finish`] into `out`, its intermediates in `sc`.
    pub fn finish_into(
        &self,
        cfg: &ModelConfig,
        s: &Streams,
        which: Logits,
        sc: &mut Scratch,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (hc, d) = (cfg.hc, cfg.dim);
        let rows = &mut sc.head_rows;
        rows.clear();
        match which {
            Logits::All => rows.extend(0..s.t),
            Logits::Last => rows.extend(s.t.checked_sub(1)),
            Logits::None => {
                out.clear();
                return Ok(());
            }
        }
        let _p = profile::span(Part::Head);
        // V4: `DeepseekV4HyperHead`, pre = sigmoid(rms(streams)·fnᵀ·scale + base) + hc_eps.
        let head_mix: Option<&[f32]> = match &self.hc_head {
            Some((fn_, base, scale)) => {
                let flat = &mut sc.head_flat;
                flat.clear();
                for &i in rows.iter() {
                    flat.extend_from_slice(&s.x[i * hc * d..(i + 1) * hc * d]);
                }
                crate::linear::rms_norm(flat, hc * d, None, cfg.eps);
                let mix = zeroed(&mut sc.head_mix, rows.len() * hc);
                profile::read(fn_.nbytes());
                matmul(flat, rows.len(), fn_, mix)?;
                for (j, v) in mix.iter_mut().enumerate() {
                    *v = ops::sigmoid(*v * scale + base[j % hc]) + cfg.hc_eps;
                }
                Some(mix)
            }
            None => None,
        };
        let h = zeroed(&mut sc.head_h, rows.len() * d);
        for (r, &i) in rows.iter().enumerate() {
            let o = &mut h[r * d..(r + 1) * d];
            for k in 0..hc {
                let m = match head_mix {
                    Some(mix) => mix[r * hc + k],
                    None => s.pre_mix[i * hc + k],
                };
                for (a, b) in o
                    .iter_mut()
                    .zip(&s.x[(i * hc + k) * d..(i * hc + k + 1) * d])
                {
                    *a += m * b;
                }
            }
        }
        crate::linear::rms_norm(h, d, Some(&self.norm), cfg.eps);
        let out = zeroed(out, rows.len() * cfg.vocab);
        profile::read(self.head.nbytes());
        // One product over every vocab row: threads split the rows, on the fast kernels under
        // `Kernels::Fast` (bf16 and FP8 heads on the bf16 kernels where the CPU has them).
        keep_kernels::matmul_with(sc.kernels, h, rows.len(), &self.head, out)?;
        if !out.iter().all(|v| v.is_finite()) {
            return Err(ModelError::NonFinite("the output head".into()));
        }
        Ok(())
    }
}

/// Refuse a forward of `t` tokens after `pos` that would run past `max_position_embeddings`.
pub fn check_context(cfg: &ModelConfig, pos: usize, t: usize) -> Result<()> {
    let limit = cfg.raw.max_position_embeddings;
    match pos.checked_add(t) {
        Some(end) if end <= limit => Ok(()),
        _ => Err(ModelError::Context(format!(
            "{t} tokens after position {pos} run past the model's {limit} positions \
             (max_position_embeddings)"
        ))),
    }
}
