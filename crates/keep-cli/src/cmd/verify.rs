//! `keep verify`: check a directory against its SHA256SUMS.

use std::path::PathBuf;

use clap::Args;
use keep_checkpoint::sums::verify_dir;

/// Check any directory keep wrote against its SHA256SUMS file.
///
/// Every listed file must exist and match, and every file of the directory must be listed (a
/// keep output lists every file it holds): an empty SHA256SUMS, a file not listed, a mismatch
/// or a missing file fail with exit status 1.
///
/// Example: keep verify /tmp/tiny-mxfp8
#[derive(Args)]
#[command(verbatim_doc_comment)]
pub struct VerifyArgs {
    /// The directory to check.
    dir: PathBuf,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(a: VerifyArgs) -> anyhow::Result<()> {
    let r = verify_dir(&a.dir)?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"format": "keep-verify", "version": 1, "dir": a.dir,
                "passed": r.passed(), "ok": r.ok, "mismatched": r.mismatched,
                "missing": r.missing, "unlisted": r.unlisted})
        );
    } else {
        for f in &r.mismatched {
            println!("MISMATCH {f}");
        }
        for f in &r.missing {
            println!("MISSING  {f}");
        }
        for f in &r.unlisted {
            println!("unlisted {f}");
        }
        println!(
            "{}: {} files ok, {} mismatched, {} missing",
            a.dir.display(),
            r.ok.len(),
            r.mismatched.len(),
            r.missing.len()
        );
    }
    if let Some(why) = r.failure() {
        anyhow::bail!("{} does not match its SHA256SUMS: {why}", a.dir.display());
    }
    Ok(())
}
