//! The gpt-oss family (`model_type` `gpt_oss`: gpt-oss-20b and gpt-oss-120b) as keep sees it
//! ([`GptOss`]): its config, role view and MXFP4 expert stacks in `config::gpt_oss`, the names
//! only it has in `naming::gpt_oss` (the rest are Hugging Face's Qwen3-style names), its tensor
//! check and its experts' matrices in [`layout`] (a `*_blocks` / `*_scales` pair is classified
//! as MXFP4 by the shared `crate::layout`, by its names).

#[path = "gpt_oss/layout.rs"]
pub(crate) mod layout;

pub use crate::config::gpt_oss::{
    layer_prefix, GptOssConfig, Mxfp4Stack, Stack, Yarn, BLOCKS, EMBED, FULL, HEAD, MODEL_TYPE,
    NORM, SCALES, SLIDING,
};
pub use layout::model_problems;

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::config::CodedMatrix;
use crate::family::{own, Family};
use crate::layout::ExpertMatrix;
use crate::naming::{ExpertMat, Scope};
use crate::DeepSeekConfig;

/// The gpt-oss family ([`Family`]): experts only in per-layer MXFP4 stacks (`W1` the
/// interleaved gate-up matrix, `W2` down, no `W3`), coded per expert by `keep quant`.
#[derive(Debug, Clone, Copy)]
pub struct GptOss;

impl Family for GptOss {
    fn name(&self) -> &'static str {
        MODEL_TYPE
    }

    fn model_types(&self) -> &'static [&'static str] {
        &[MODEL_TYPE]
    }

    fn role_view(&self, flat: Value, raw: Value) -> Result<DeepSeekConfig, String> {
        Ok(GptOssConfig::from_value(flat)?.role_view(raw))
    }

    fn validate(&self, cfg: &DeepSeekConfig) -> Result<(), String> {
        own(&cfg.gpt_oss, cfg)?.validate()
    }

    fn model_problems(&self, ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
        match own(&cfg.gpt_oss, cfg) {
            Ok(c) => model_problems(ck, c),
            Err(e) => vec![e],
        }
    }

    fn experts_key(&self) -> &'static str {
        GptOssConfig::EXPERTS_KEY
    }

    fn expert_prefix(&self, _scope: Scope, _expert: usize) -> Option<String> {
        None
    }

    fn expert_tensor(
        &self,
        _layer: usize,
        _expert: usize,
        _mat: ExpertMat,
        _part: &str,
    ) -> Option<String> {
        None
    }

    /// The gate-up matrix (gate and up rows interleaved) and down; no up matrix of its own.
    fn expert_matrices(&self, cfg: &DeepSeekConfig) -> Vec<(ExpertMat, usize, usize)> {
        let (d, i) = (cfg.hidden_size, cfg.moe_intermediate_size);
        vec![(ExpertMat::W1, 2 * i, d), (ExpertMat::W2, d, i)]
    }

    fn expert_matrix<'a>(
        &self,
        ck: &'a Checkpoint,
        cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
    ) -> Result<ExpertMatrix<'a>, String> {
        layout::expert_matrix(ck, own(&cfg.gpt_oss, cfg)?, layer, expert, mat)
    }

    fn coded_matrices(
        &self,
        cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
    ) -> Vec<CodedMatrix> {
        cfg.gpt_oss
            .as_ref()
            .map(|g| g.coded_matrices(layer, expert))
            .unwrap_or_default()
    }

    fn tie_word_embeddings(&self, cfg: &DeepSeekConfig) -> bool {
        cfg.gpt_oss.as_ref().is_some_and(|c| c.tie_word_embeddings)
    }
}
