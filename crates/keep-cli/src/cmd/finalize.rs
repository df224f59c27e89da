//! `keep finalize`: sum a calibration run's sessions into imatrix and REAP statistics.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use keep_calib::finalize::finalize;

/// Sum a run's session files into RUN/imatrix.safetensors and RUN/reap-stats.safetensors.
///
/// Refuses, naming the sessions, when any session of the run is missing or cut off, lacks REAP
/// arrays, or has REAP route counts that differ from its imatrix counts — never a silent
/// under-score. reap-stats holds reap.{layer}.score = Σg·‖f‖ / count (F64) beside the sums;
/// imatrix holds Σx² and counts per linear, per expert for routed experts.
///
/// Example: keep finalize /tmp/run
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct FinalizeArgs {
    /// The run directory (from `keep calibrate`).
    run: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: FinalizeArgs) -> anyhow::Result<()> {
    let r = finalize(&a.run).with_context(|| format!("finalizing {}", a.run.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "summed {} sessions ({} tokens): wrote {} ({} linears) and {}",
            r.sessions,
            r.tokens,
            r.imatrix.display(),
            r.linears,
            r.reap.display()
        );
    }
    Ok(())
}
