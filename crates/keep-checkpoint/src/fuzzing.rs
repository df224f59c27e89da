//! Entry points shared by the `cargo fuzz` targets (in `fuzz/`) and the tests that replay their
//! committed corpus: each feeds arbitrary bytes to a parser and must return, never panic.
//!
//! Parsers that read files (a checkpoint directory, a route trace, a pack) are fuzzed through
//! real files: one input holds several files separated by [`FILE_SEPARATOR`] ([`split_files`]),
//! written into a scratch directory of this process ([`write_scratch`]) before the parser opens
//! them. The same helpers serve the fuzz entry points of the crates above (`keep-model`,
//! `keep-convert`, `keep-artifacts`, `keep-calib`), so one encoding covers every multi-file
//! target.

use std::path::{Path, PathBuf};

/// Separates the files of one multi-file fuzz input.
pub const FILE_SEPARATOR: &[u8] = b"\n--keep-fuzz-file--\n";

/// Targets of this crate, in the order the corpus replay runs them.
pub const TARGETS: [&str; 4] = ["header", "index", "config", "checkpoint"];

/// The shard names the `checkpoint` target writes (its third and later files).
const SHARDS: [&str; 3] = [
    "model-00001-of-00003.safetensors",
    "model-00002-of-00003.safetensors",
    "model-00003-of-00003.safetensors",
];

/// Split a multi-file input into at most `max` files (the last one takes the rest).
pub fn split_files(data: &[u8], max: usize) -> Vec<&[u8]> {
    let mut out = vec![];
    let mut rest = data;
    while out.len() + 1 < max {
        match find(rest, FILE_SEPARATOR) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + FILE_SEPARATOR.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    out
}

/// The inverse of [`split_files`] (for writing seeds).
pub fn join_files(files: &[&[u8]]) -> Vec<u8> {
    let mut v = vec![];
    for (i, f) in files.iter().enumerate() {
        if i > 0 {
            v.extend_from_slice(FILE_SEPARATOR);
        }
        v.extend_from_slice(f);
    }
    v
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// This process's (and thread's) scratch directory for multi-file targets.
pub fn scratch_dir() -> PathBuf {
    let tid = format!("{:?}", std::thread::current().id());
    let tid: String = tid.chars().filter(char::is_ascii_digit).collect();
    std::env::temp_dir().join(format!("keep-fuzz-{}-{tid}", std::process::id()))
}

/// Empty the scratch directory and write `files` (name, bytes) into it; `None` for a file
/// leaves it absent. Returns the directory, or `None` when the file system refused (the input
/// is then skipped: that is the machine's problem, not the parser's).
pub fn write_scratch(files: &[(&str, Option<&[u8]>)]) -> Option<PathBuf> {
    let d = scratch_dir();
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).ok()?;
    for (name, bytes) in files {
        if let Some(b) = bytes {
            std::fs::write(d.join(name), b).ok()?;
        }
    }
    Some(d)
}

/// Remove the scratch directory (the corpus replay calls this when done).
pub fn clear_scratch() {
    let _ = std::fs::remove_dir_all(scratch_dir());
}

/// Run the parser named `target` (one of [`TARGETS`]) on `data`.
pub fn run(target: &str, data: &[u8]) {
    let p = Path::new("fuzz-input");
    match target {
        "header" => {
            if data.len() >= 8 {
                let n = u64::from_le_bytes(data[..8].try_into().expect("8 bytes")) as usize;
                let rest = &data[8..];
                let n = n.min(rest.len());
                let (json, body) = rest.split_at(n);
                let _ = crate::safetensors::parse_header(p, json, 8 + n as u64, body.len() as u64);
            } else {
                let _ = crate::safetensors::parse_header(p, data, 8, 0);
            }
        }
        "index" => {
            if let Ok(s) = std::str::from_utf8(data) {
                if let Ok(ix) = crate::index::Index::parse(p, s) {
                    let _ = ix.shards();
                }
            }
        }
        "config" => {
            if let Ok(s) = std::str::from_utf8(data) {
                if let Ok(c) = crate::config::DeepSeekConfig::from_json(p, s) {
                    exercise_config(&c);
                }
            }
        }
        "checkpoint" => checkpoint(data),
        _ => {}
    }
}

/// Call the accessors every reader of a validated config uses.
fn exercise_config(c: &crate::DeepSeekConfig) {
    let _ = c.weight_block_size();
    for l in 0..c.num_hidden_layers.min(64) {
        let _ = (c.experts_in_layer(l), c.compress_ratio(l));
    }
    let _ = c.raw_with(&[("keep_fuzz", serde_json::Value::Bool(true))]);
}

/// A whole checkpoint directory: `config.json`, `model.safetensors.index.json` and up to three
/// shards (an empty file part means the file is absent), opened with `Checkpoint::open`, then
/// every tensor looked up, its name parsed and its bytes touched, and the model fingerprint
/// taken.
fn checkpoint(data: &[u8]) {
    let parts = split_files(data, 2 + SHARDS.len());
    let opt = |i: usize| parts.get(i).copied().filter(|b| !b.is_empty());
    let mut files = vec![
        (crate::checkpoint::CONFIG_FILE, opt(0)),
        (crate::index::INDEX_FILE, opt(1)),
    ];
    for (i, s) in SHARDS.iter().enumerate() {
        files.push((s, opt(2 + i)));
    }
    let Some(dir) = write_scratch(&files) else {
        return;
    };
    let Ok(ck) = crate::Checkpoint::open(&dir) else {
        return;
    };
    let mut sum = 0u64;
    for t in ck.tensors() {
        let n = crate::naming::parse(t.name);
        let _ = n.layer();
        let _ = crate::naming::scale_candidates(t.name);
        let _ = crate::naming::weight_of_scale(t.name);
        sum = sum.wrapping_add(t.numel());
        if let (Some(a), Some(b)) = (t.bytes.first(), t.bytes.last()) {
            sum = sum.wrapping_add(u64::from(*a) + u64::from(*b));
        }
        let _ = ck.get(t.name).map(|r| r.bytes.len());
    }
    std::hint::black_box(sum);
    if let Ok(c) = ck.require_config() {
        exercise_config(c);
    }
    let _ = ck.aux_files();
    let _ = crate::fingerprint::model_fingerprint(ck.dir());
}

/// Replay a crate's committed inputs of `targets` — the repository's `fuzz/corpus/TARGET` and
/// `fuzz/regressions/TARGET`, found from the crate's `CARGO_MANIFEST_DIR` — through `f`; the
/// number of corpus inputs run (regressions are run too, not counted).
pub fn replay_committed(manifest_dir: &str, targets: &[&str], f: &dyn Fn(&str, &[u8])) -> usize {
    let fuzz = Path::new(manifest_dir).join("../../fuzz");
    let n = replay_corpus(&fuzz.join("corpus"), targets, f);
    replay_corpus(&fuzz.join("regressions"), targets, f);
    n
}

/// Replay every committed input of `targets` under `fuzz/corpus/<target>` through `f`;
/// returns the number of inputs replayed. Shared by the corpus replays of every crate.
pub fn replay_corpus(corpus: &Path, targets: &[&str], f: &dyn Fn(&str, &[u8])) -> usize {
    let mut n = 0;
    for target in targets {
        let dir = corpus.join(target);
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            if let Ok(bytes) = std::fs::read(&p) {
                f(target, &bytes);
                n += 1;
            }
        }
    }
    clear_scratch();
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_split_and_join() {
        let j = join_files(&[b"a", b"", b"ccc"]);
        assert_eq!(split_files(&j, 5), vec![&b"a"[..], b"", b"ccc"]);
        // The last file takes the rest, separators included.
        let two = split_files(&j, 2);
        assert_eq!(two.len(), 2);
        assert_eq!(two[0], b"a");
        assert_eq!(split_files(two[1], 5), vec![&b""[..], b"ccc"]);
        assert_eq!(split_files(b"plain", 3), vec![&b"plain"[..]]);
    }
}
