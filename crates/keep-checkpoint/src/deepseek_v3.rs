//! The DeepSeek-V3 family (`model_type` `deepseek_v3`: DeepSeek-V3, R1, V3.1, Kimi-K2) as keep
//! sees it ([`DeepseekV3`]): its config and role view in `config::deepseek_v3`, the names only it
//! has in `naming::deepseek_v3` (the rest are Hugging Face's Qwen3-style names), its tensor check
//! in [`layout`].

#[path = "deepseek_v3/layout.rs"]
pub(crate) mod layout;

pub use crate::config::deepseek_v3::{
    layer_prefix, DeepseekV3Config, Yarn, EMBED, HEAD, MODEL_TYPE, NORM,
};
pub use layout::model_problems;

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::family::{own, Family};
use crate::layout::{named_expert_matrix, ExpertMatrix};
use crate::naming::{ExpertMat, Scope};
use crate::DeepSeekConfig;

/// The DeepSeek-V3 family ([`Family`]): Hugging Face's per-expert names (as Qwen3-MoE's), dense
/// layers from `first_k_dense_replace` / `moe_layer_freq`, the group-limited router's rule on
/// pruned survivors.
#[derive(Debug, Clone, Copy)]
pub struct DeepseekV3;

impl Family for DeepseekV3 {
    fn name(&self) -> &'static str {
        MODEL_TYPE
    }

    fn model_types(&self) -> &'static [&'static str] {
        &[MODEL_TYPE]
    }

    fn role_view(&self, flat: Value, raw: Value) -> Result<DeepSeekConfig, String> {
        Ok(DeepseekV3Config::from_value(flat)?.role_view(raw))
    }

    fn validate(&self, cfg: &DeepSeekConfig) -> Result<(), String> {
        own(&cfg.deepseek_v3, cfg)?.validate()
    }

    fn model_problems(&self, ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
        match own(&cfg.deepseek_v3, cfg) {
            Ok(c) => model_problems(ck, c),
            Err(e) => vec![e],
        }
    }

    fn is_moe_layer(&self, cfg: &DeepSeekConfig, layer: usize) -> bool {
        cfg.deepseek_v3
            .as_ref()
            .is_none_or(|c| c.is_moe_layer(layer))
    }

    fn expert_prefix(&self, scope: Scope, expert: usize) -> Option<String> {
        match scope {
            Scope::Layer(l) => Some(crate::naming::qwen3::expert_prefix(l, expert)),
            _ => None,
        }
    }

    fn expert_tensor(
        &self,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
        part: &str,
    ) -> Option<String> {
        Some(crate::naming::qwen3::expert_tensor(
            layer, expert, mat, part,
        ))
    }

    fn expert_matrix<'a>(
        &self,
        ck: &'a Checkpoint,
        _cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
    ) -> Result<ExpertMatrix<'a>, String> {
        named_expert_matrix(
            ck,
            &crate::naming::qwen3::expert_tensor(layer, expert, mat, "weight"),
        )
    }

    fn check_survivors(&self, cfg: &DeepSeekConfig, survivors: &[usize]) -> Result<(), String> {
        match &cfg.deepseek_v3 {
            Some(c) => c.check_survivors(survivors),
            None => Ok(()),
        }
    }

    fn tie_word_embeddings(&self, cfg: &DeepSeekConfig) -> bool {
        cfg.deepseek_v3
            .as_ref()
            .is_some_and(|c| c.tie_word_embeddings)
    }
}
