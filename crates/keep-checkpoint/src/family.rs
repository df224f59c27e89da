//! What a model family tells the rest of keep: the one interface between keep's roles and a
//! family's own `config.json`, tensor names and tensor check.
//!
//! A family is a zero-sized type implementing [`Family`] in the family's own module, listed
//! once in [`crate::families::FAMILIES`]. Reading a `config.json` picks the family that owns its
//! `model_type` and keeps the family's answer as the role view ([`DeepSeekConfig`]); from then
//! on every reader asks [`DeepSeekConfig::family`] (or the role view's methods, which ask it)
//! and never tests which family config the role view carries.
//!
//! Each method is answered per call (a layer, an expert, a checkpoint), never inside a loop over
//! a matrix's values.

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::config::{CodedMatrix, DeepSeekConfig};
use crate::layout::ExpertMatrix;
use crate::naming::{ExpertMat, Scope};

/// One model family: its `model_type`s, its config read into keep's roles, its tensor names
/// and its tensor check. Methods taking a [`DeepSeekConfig`] are given the role view this family
/// returned from [`Family::role_view`].
pub trait Family: Sync + std::fmt::Debug {
    /// The family as keep's commands name it (`keep synth --family`): `deepseek` for DeepSeek
    /// V4, a Hugging Face family's `model_type`.
    fn name(&self) -> &'static str;

    /// The `config.json` `model_type`s this family reads (each owned by exactly one family).
    fn model_types(&self) -> &'static [&'static str];

    /// The family's config read from `flat` (the file with `text_config` flattened into the top
    /// level) and described in keep's roles; `raw` is the file as read, kept for writers. The
    /// error says which key is wrong and why.
    fn role_view(&self, flat: Value, raw: Value) -> Result<DeepSeekConfig, String>;

    /// The family's validation of its role view (every bound and rule of its config).
    fn validate(&self, cfg: &DeepSeekConfig) -> Result<(), String>;

    /// Everything about `ck`'s tensors that contradicts `cfg` or that the model cannot read
    /// (what [`crate::layout::model_problems`] returns).
    fn model_problems(&self, ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String>;

    /// Whether decoder layer `layer` has routed experts (else a dense MLP).
    fn is_moe_layer(&self, _cfg: &DeepSeekConfig, _layer: usize) -> bool {
        true
    }

    /// Whether the keys only DeepSeek V4 has (`n_routed_experts_per_layer`,
    /// `n_routed_experts_mtp`) apply.
    fn is_deepseek_v4(&self) -> bool {
        false
    }

    /// The `config.json` key that holds the routed-expert count, in the family's words (what
    /// `keep prune` rewrites).
    fn experts_key(&self) -> &'static str {
        "n_routed_experts"
    }

    /// The prefix of routed expert `expert`'s own tensors in `scope`; `None` where the family
    /// has no such scope or keeps its experts only stacked.
    fn expert_prefix(&self, scope: Scope, expert: usize) -> Option<String>;

    /// Tensor `part` of matrix `mat` of routed expert `expert` of decoder layer `layer`, as the
    /// family names its per-expert tensors; `None` where its experts are only stacked.
    fn expert_tensor(
        &self,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
        part: &str,
    ) -> Option<String>;

    /// The matrices of one routed expert as the model computes with them, in the order the
    /// expert's weights are laid out (`w1`, `w2`, then `w3` where the family has one), each with
    /// its rows and columns: what the runtime's expert store reads per expert.
    fn expert_matrices(&self, cfg: &DeepSeekConfig) -> Vec<(ExpertMat, usize, usize)> {
        let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        vec![
            (ExpertMat::W1, i, d),
            (ExpertMat::W2, d, i),
            (ExpertMat::W3, i, d),
        ]
    }

    /// Matrix `mat` of routed expert `expert` of `layer`, wherever the family's checkpoints keep
    /// it (what [`crate::layout::expert_matrix`] returns). Names and shapes only.
    fn expert_matrix<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
    ) -> Result<ExpertMatrix<'a>, String>;

    /// The matrices of routed expert `expert` of decoder layer `layer` that `keep quant` codes
    /// (by default each per-expert matrix under its own name, its weight and block scale
    /// replaced).
    fn coded_matrices(
        &self,
        cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
    ) -> Vec<CodedMatrix> {
        crate::config::per_expert_coded_matrices(cfg, layer, expert)
    }

    /// Whether decoder layer pruned to `survivors` leaves a router the family's code runs as it
    /// runs the original with the removed experts masked (by default any survivors do).
    fn check_survivors(&self, _cfg: &DeepSeekConfig, _survivors: &[usize]) -> Result<(), String> {
        Ok(())
    }

    /// Whether the embedding and the head share one tensor.
    fn tie_word_embeddings(&self, _cfg: &DeepSeekConfig) -> bool {
        false
    }
}

/// The family config `slot` of a role view, or the error that names its missing config.
pub(crate) fn own<'c, T>(slot: &'c Option<T>, cfg: &DeepSeekConfig) -> Result<&'c T, String> {
    slot.as_ref()
        .ok_or_else(|| format!("model_type `{}` without its family config", cfg.model_type))
}
