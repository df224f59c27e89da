//! The registry of model families: every [`Family`] keep reads, each listed once, and the
//! role view's way to its family ([`DeepSeekConfig::family`]).
//!
//! A new family is its module declared here and one line in [`FAMILIES`] (and its config and
//! name parser, see [`crate::family`]).

#[path = "deepseek_v3.rs"]
pub mod deepseek_v3;
#[path = "gpt_oss.rs"]
pub mod gpt_oss;

use crate::deepseek_v4::DeepSeekV4;
use crate::family::Family;
use crate::qwen3::Qwen3Moe;
use crate::DeepSeekConfig;
use deepseek_v3::DeepseekV3;
use gpt_oss::GptOss;

/// Every family keep reads. DeepSeek V4 comes first: a `model_type` no family owns is read as
/// DeepSeek V4's (whose validation names the types it knows).
pub static FAMILIES: &[&dyn Family] = &[&DeepSeekV4, &Qwen3Moe, &DeepseekV3, &GptOss];

/// The family that owns `model_type`, if any.
pub fn by_model_type(model_type: &str) -> Option<&'static dyn Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types().contains(&model_type))
}

/// A family by the name keep's commands give it ([`Family::name`]).
pub fn by_name(name: &str) -> Option<&'static dyn Family> {
    FAMILIES.iter().copied().find(|f| f.name() == name)
}

impl DeepSeekConfig {
    /// The family this role view was read by (the owner of its `model_type`).
    pub fn family(&self) -> &'static dyn Family {
        DeepSeekConfig::family_of(&self.model_type)
    }

    /// The family that reads `model_type`: its owner, else DeepSeek V4 (whose validation refuses
    /// a type it does not know).
    pub fn family_of(model_type: &str) -> &'static dyn Family {
        by_model_type(model_type).unwrap_or(&DeepSeekV4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each `model_type` is owned by exactly one family, and each family is listed once.
    #[test]
    fn every_model_type_has_one_owner() {
        let mut types: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|f| f.model_types().iter().copied())
            .collect();
        let n = types.len();
        types.sort_unstable();
        types.dedup();
        assert_eq!(types.len(), n, "a model_type is owned twice");
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len(), "a family is listed twice");
    }

    /// Every family keep has a module for is in the registry, and a config of each reads back
    /// as that family.
    #[test]
    fn every_family_is_registered() {
        let families: [&dyn Family; 4] = [&DeepSeekV4, &Qwen3Moe, &DeepseekV3, &GptOss];
        for f in families {
            for t in f.model_types() {
                let owner = by_model_type(t)
                    .unwrap_or_else(|| panic!("model_type `{t}` ({}) is in no family", f.name()));
                assert_eq!(owner.name(), f.name());
            }
            assert!(by_name(f.name()).is_some());
        }
    }
}
