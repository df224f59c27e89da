//! Entry point of the `pack` fuzz target (in `fuzz/`) and of the test that replays its committed
//! corpus: a pack directory (`pack.json` and `records.jsonl`, one multi-file input, see
//! `keep_checkpoint::fuzzing::split_files`) opened with [`Pack::open`] and walked by split and
//! group as calibration does. It must return, never panic or abort.
//!
//! A manifest whose `records_sha256` is the placeholder `"fuzz"` gets the records file's real
//! SHA-256 written in before the pack is opened, so that mutations of the records reach the
//! record parser instead of stopping at the checksum; every other manifest is opened as it is.

use crate::fingerprint::sha256_hex;
use crate::pack::{Pack, Split, RECORDS_FILE};

/// Targets of this crate.
pub const TARGETS: [&str; 1] = ["pack"];

/// The `records_sha256` placeholder the harness replaces (see the module doc).
pub const SHA_PLACEHOLDER: &str = "\"records_sha256\":\"fuzz\"";

/// Run the target named `target` on `data`.
pub fn run(target: &str, data: &[u8]) {
    if target != "pack" {
        return;
    }
    let parts = keep_checkpoint::fuzzing::split_files(data, 2);
    let records: &[u8] = parts.get(1).copied().unwrap_or(&[]);
    let mut manifest = parts[0].to_vec();
    if let Some(i) = manifest
        .windows(SHA_PLACEHOLDER.len())
        .position(|w| w == SHA_PLACEHOLDER.as_bytes())
    {
        let real = format!("\"records_sha256\":\"{}\"", sha256_hex(records));
        manifest.splice(i..i + SHA_PLACEHOLDER.len(), real.into_bytes());
    }
    let Some(dir) = keep_checkpoint::fuzzing::write_scratch(&[
        ("pack.json", Some(&manifest)),
        (RECORDS_FILE, Some(records)),
    ]) else {
        return;
    };
    let Ok(pack) = Pack::open(&dir) else {
        return;
    };
    let mut n = 0usize;
    for split in [Split::Calibration, Split::Eval] {
        for g in pack.groups(split) {
            n += pack
                .records_of(&g.id)
                .map(|r| r.tokens.len())
                .sum::<usize>();
        }
    }
    std::hint::black_box(n);
}

#[cfg(test)]
mod tests {
    #[test]
    fn fuzz_corpus_replays_without_panic() {
        let n = keep_checkpoint::fuzzing::replay_committed(
            env!("CARGO_MANIFEST_DIR"),
            &super::TARGETS,
            &super::run,
        );
        assert!(n >= 5, "expected a committed pack corpus, found {n}");
    }
}
