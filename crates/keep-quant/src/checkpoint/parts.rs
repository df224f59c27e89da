//! The record and the lock of a quantization's parts directory
//! (`.<out>.keep-quant-parts/`).
//!
//! Parts are only ever joined with parts of the same run: `parts.json` records the source
//! checkpoint's fingerprint and every argument that shapes a part's bytes (the code format,
//! the experts, the incoherence mode and seed, the imatrix's SHA-256). A run whose arguments
//! differ is refused, naming the first argument that differs, unless it is forced, which
//! discards the parts. Every change to the directory (claiming it, placing a part, joining) is
//! made holding an exclusive lock on its `lock` file, and a part is placed only after the record
//! was read again under that lock, so two writers with different arguments never mix.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::QuantOptions;
use crate::incoherence::IncoherenceOptions;
use crate::{QuantError, Result};

/// `format` of `parts.json`.
pub const PARTS_FORMAT: &str = "keep-quant-parts";
/// Its version.
pub const PARTS_VERSION: u32 = 1;
/// The record's file name in the parts directory.
pub const RECORD_FILE: &str = "parts.json";
const LOCK_FILE: &str = "lock";
/// Parts directories are named `layer-{L:05}`.
pub const PART_PREFIX: &str = "layer-";

/// What the parts of a directory were made from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Record {
    pub format: String,
    pub version: u32,
    /// The source checkpoint's model fingerprint.
    pub source_fingerprint: String,
    /// Flag → value, for every argument that shapes the bytes of a part.
    pub args: BTreeMap<String, String>,
}

fn io(path: &Path, e: std::io::Error) -> QuantError {
    QuantError::Io {
        path: path.display().to_string(),
        source: e,
    }
}

impl Record {
    /// The record of a run quantizing `model` with `imatrix_file` and `opts`.
    pub fn new(
        model: &Path,
        imatrix_file: &Path,
        opts: &QuantOptions,
        incoherence: Option<IncoherenceOptions>,
    ) -> Result<Record> {
        let source_fingerprint = keep_checkpoint::fingerprint::model_fingerprint(model)?;
        let selection: String = match &opts.experts {
            super::ExpertSelection::All => "all".into(),
            other => {
                let d = Sha256::digest(format!("{other:?}").as_bytes());
                format!("selection sha256 {}", keep_checkpoint::sums::hex(&d[..8]))
            }
        };
        let args = BTreeMap::from([
            ("--format".to_string(), opts.method()),
            ("--experts/--alloc".to_string(), selection),
            (
                "--incoherence".to_string(),
                incoherence.map_or("off".into(), |i| i.mode.label().to_string()),
            ),
            (
                "--incoherence-seed".to_string(),
                incoherence.map_or("-".into(), |i| i.seed.to_string()),
            ),
            (
                "--imatrix".to_string(),
                format!(
                    "sha256 {}",
                    keep_checkpoint::sums::file_sha256(imatrix_file)?
                ),
            ),
        ]);
        Ok(Record {
            format: PARTS_FORMAT.into(),
            version: PARTS_VERSION,
            source_fingerprint,
            args,
        })
    }

    /// Why parts recorded as `self` cannot be joined with a run of `want` (`None`: they can).
    fn differs(&self, want: &Record) -> Option<String> {
        if self.format != want.format || self.version != want.version {
            return Some(format!(
                "they are recorded as {} version {}, not {PARTS_FORMAT} version {PARTS_VERSION}",
                self.format, self.version
            ));
        }
        if self.source_fingerprint != want.source_fingerprint {
            return Some(format!(
                "they were made from another checkpoint (fingerprint {}; this model's is {})",
                self.source_fingerprint, want.source_fingerprint
            ));
        }
        for (k, v) in &want.args {
            match self.args.get(k) {
                Some(have) if have == v => {}
                Some(have) => {
                    return Some(format!(
                        "they were made with {k} {have}, this run asks for {k} {v}"
                    ))
                }
                None => return Some(format!("they do not record {k}")),
            }
        }
        self.args
            .keys()
            .find(|k| !want.args.contains_key(*k))
            .map(|k| format!("they record {k}, which this run does not know"))
    }
}

/// An exclusive lock on a parts directory, released when dropped.
pub struct Lock {
    _file: File,
}

impl Lock {
    /// Wait for and take the lock of `parts` (a directory that exists).
    pub fn acquire(parts: &Path) -> Result<Lock> {
        let p = parts.join(LOCK_FILE);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| io(&p, e))?;
        f.lock().map_err(|e| io(&p, e))?;
        Ok(Lock { _file: f })
    }
}

/// The part directories in `parts`.
pub fn part_dirs(parts: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(parts).map_err(|e| io(parts, e))?;
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(PART_PREFIX))
        .map(|e| e.path())
        .collect();
    v.sort();
    Ok(v)
}

fn read(parts: &Path) -> Result<Option<Record>> {
    let p = parts.join(RECORD_FILE);
    if std::fs::symlink_metadata(&p).is_err() {
        return Ok(None);
    }
    let text =
        keep_checkpoint::small_file::read_text(&p, keep_checkpoint::small_file::MAX_SMALL_FILE)?;
    Ok(Some(serde_json::from_str(&text).unwrap_or(Record {
        format: "an unreadable record".into(),
        version: 0,
        source_fingerprint: String::new(),
        args: BTreeMap::new(),
    })))
}

fn write(parts: &Path, r: &Record) -> Result<()> {
    let text = serde_json::to_string_pretty(r).expect("JSON");
    keep_checkpoint::atomic::write_file(&parts.join(RECORD_FILE), text.as_bytes(), true)?;
    Ok(())
}

/// Remove every part and the record (the lock file stays: other writers may hold it).
fn clear(parts: &Path) -> Result<()> {
    for d in part_dirs(parts)? {
        std::fs::remove_dir_all(&d).map_err(|e| io(&d, e))?;
    }
    let p = parts.join(RECORD_FILE);
    match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(&p, e)),
        _ => Ok(()),
    }
}

/// Make `parts` a directory of `want`'s parts; call holding its [`Lock`]. Parts of another
/// run (another record, or parts without one) are refused naming what differs, or with
/// `force` removed.
pub fn claim(parts: &Path, want: &Record, force: bool) -> Result<()> {
    let why = match read(parts)? {
        Some(have) => have.differs(want),
        None if part_dirs(parts)?.is_empty() => None,
        None => Some("they carry no record of the arguments they were made with".into()),
    };
    if let Some(why) = why {
        if !force {
            return Err(QuantError::Input(format!(
                "{} holds the parts of an unfinished quantization that cannot be joined with this one: {why}; rerun with the same arguments to resume it, or pass --force to discard its parts",
                parts.display()
            )));
        }
        clear(parts)?;
    }
    write(parts, want)
}

/// Check, holding the [`Lock`], that `parts` still belongs to `want` before a part is placed
/// or the parts are joined (another writer may have discarded them with `--force`).
pub fn still_ours(parts: &Path, want: &Record) -> Result<()> {
    if !parts.is_dir() {
        return Err(QuantError::Input(format!(
            "{} is gone: another writer of this quantization joined the output meanwhile; \
             check the output, or run again",
            parts.display()
        )));
    }
    let why = match read(parts)? {
        Some(have) => have.differs(want),
        None => Some("its record was removed".into()),
    };
    match why {
        None => Ok(()),
        Some(why) => Err(QuantError::Input(format!(
            "{} was taken over by another quantization while this one ran ({why}); nothing of this run was stored there",
            parts.display()
        ))),
    }
}
