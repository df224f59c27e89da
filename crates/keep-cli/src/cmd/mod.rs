//! One module per verb; each exposes `XArgs` (clap) and `run(XArgs) -> anyhow::Result<()>`.

pub mod inspect;
pub mod repack;
pub mod synth;
pub mod verify;
