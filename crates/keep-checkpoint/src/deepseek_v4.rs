//! The DeepSeek V4.1 / V4 / V4-Flash family (`model_type` `deepseek_v41`, `deepseek_v4`), keep's
//! native one ([`DeepSeekV4`]): its config is [`DeepSeekConfig`] itself (`config`), its names are
//! `naming`'s own (`layers.N.ffn.experts.E.w1.weight`), its tensor check is `layout`'s.

use serde_json::Value;

use crate::checkpoint::Checkpoint;
use crate::config::MODEL_TYPES;
use crate::family::Family;
use crate::layout::{named_expert_matrix, ExpertMatrix};
use crate::naming::{self, ExpertMat, Scope};
use crate::DeepSeekConfig;

/// The DeepSeek V4 family ([`Family`]): every layer routed, per-layer and MTP expert counts,
/// experts under `layers.L.ffn.experts.E.`.
#[derive(Debug, Clone, Copy)]
pub struct DeepSeekV4;

impl Family for DeepSeekV4 {
    fn name(&self) -> &'static str {
        "deepseek"
    }

    fn model_types(&self) -> &'static [&'static str] {
        MODEL_TYPES
    }

    fn role_view(&self, flat: Value, raw: Value) -> Result<DeepSeekConfig, String> {
        DeepSeekConfig::deepseek_v4_from_value(flat, raw)
    }

    fn validate(&self, cfg: &DeepSeekConfig) -> Result<(), String> {
        cfg.validate_deepseek_v4()
    }

    fn model_problems(&self, ck: &Checkpoint, cfg: &DeepSeekConfig) -> Vec<String> {
        crate::layout::deepseek_v4_problems(ck, cfg)
    }

    fn is_deepseek_v4(&self) -> bool {
        true
    }

    fn expert_prefix(&self, scope: Scope, expert: usize) -> Option<String> {
        Some(naming::expert_prefix(scope, expert))
    }

    fn expert_tensor(
        &self,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
        part: &str,
    ) -> Option<String> {
        Some(naming::expert_tensor(layer, expert, mat, part))
    }

    fn expert_matrix<'a>(
        &self,
        ck: &'a Checkpoint,
        _cfg: &DeepSeekConfig,
        layer: usize,
        expert: usize,
        mat: ExpertMat,
    ) -> Result<ExpertMatrix<'a>, String> {
        named_expert_matrix(ck, &naming::expert_tensor(layer, expert, mat, "weight"))
    }
}
