//! One module per verb; each exposes `XArgs` (clap) and `run(XArgs) -> anyhow::Result<()>`.

pub mod bench;
pub mod calibrate;
pub mod eval;
pub mod finalize;
pub mod inspect;
pub mod logits;
pub mod pack;
pub mod prune;
pub mod repack;
pub mod residency;
pub mod run;
pub mod select;
pub mod synth;
pub mod verify;
