//! One module per verb; each exposes `XArgs` (clap) and `run(XArgs) -> anyhow::Result<()>`.

pub mod bench;
pub mod inspect;
pub mod logits;
pub mod prune;
pub mod repack;
pub mod residency;
pub mod run;
pub mod synth;
pub mod verify;
