//! Calibration packs: local text cut into token records with the model's tokenizer.
//!
//! A pack is a directory (written atomically, with a `SHA256SUMS`):
//!
//! - `pack.json` — [`PackManifest`]: `format` = `keep-pack`, `version` = 1,
//!   `tokenizer_sha256` (SHA-256 of the `tokenizer.json` used), `vocab_size`, `max_tokens`,
//!   `held_out_frac`, `seed`, `records_file`, `records_sha256`, `n_records`, `n_tokens`, and
//!   `groups`: `[{"id": "g00000", "source": "path/or/jsonl#group", "split": "calibration" |
//!   "eval", "records": n, "tokens": n}]`;
//! - `records.jsonl` — one record a line, in group order:
//!   `{"id": "g00000-0000", "group": "g00000", "tokens": [ids...]}`.
//!
//! A *group* is one source: a text file, or for JSONL input (`{"text": ..., "group"?: ...}` per
//! line) the lines sharing a `group` value (each line its own group when there is none). Each
//! source's text is tokenized whole (no special tokens added) and cut into consecutive records of
//! at most `max_tokens` tokens (a trailing piece shorter than 2 tokens is dropped). Splits are
//! disjoint by group: a group is held out (`eval`) when the first 8 bytes of
//! SHA-256(`seed` ‖ source), read as a fraction of 2⁶⁴, fall below `held_out_frac`; with two or
//! more groups each split gets at least one when the fraction is strictly between 0 and 1.
//! The pack fingerprint is the SHA-256 of `pack.json`.

use std::path::{Path, PathBuf};

use keep_checkpoint::{CheckpointWriter, WriterOptions};
use serde::{Deserialize, Serialize};

use crate::fingerprint::{file_sha256, sha256_hex};
use crate::{CalibError, Result};

/// `format` of `pack.json`.
pub const PACK_FORMAT: &str = "keep-pack";
/// The pack version written and read.
pub const PACK_VERSION: u32 = 1;
/// The records file inside a pack.
pub const RECORDS_FILE: &str = "records.jsonl";
/// Shortest record kept (a record needs a next token to be scored).
pub const MIN_RECORD_TOKENS: usize = 2;

/// Which part of a pack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Statistics are gathered over these groups.
    Calibration,
    /// Held out: teacher logits for evaluation.
    Eval,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Calibration => "calibration",
            Split::Eval => "eval",
        }
    }
    pub fn parse(s: &str) -> Option<Split> {
        match s {
            "calibration" | "calib" => Some(Split::Calibration),
            "eval" | "held-out" | "heldout" => Some(Split::Eval),
            _ => None,
        }
    }
}

/// One group (source) of a pack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupInfo {
    pub id: String,
    pub source: String,
    pub split: Split,
    pub records: usize,
    pub tokens: usize,
}

/// `pack.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PackManifest {
    pub format: String,
    pub version: u32,
    pub tokenizer_sha256: String,
    pub vocab_size: usize,
    pub max_tokens: usize,
    pub held_out_frac: f64,
    pub seed: u64,
    pub records_file: String,
    pub records_sha256: String,
    pub n_records: usize,
    pub n_tokens: usize,
    pub groups: Vec<GroupInfo>,
}

/// One record: a token sequence from one group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub group: String,
    pub tokens: Vec<u32>,
}

/// A pack read from disk (or built in memory).
#[derive(Debug, Clone)]
pub struct Pack {
    pub dir: PathBuf,
    pub manifest: PackManifest,
    /// SHA-256 of `pack.json`.
    pub fingerprint: String,
    pub records: Vec<Record>,
}

/// A source document before tokenization.
#[derive(Debug, Clone)]
pub struct Document {
    /// Where it came from; documents with equal sources form one group.
    pub source: String,
    pub text: String,
}

/// Options of [`build_pack`].
#[derive(Debug, Clone)]
pub struct PackOptions {
    pub max_tokens: usize,
    pub held_out_frac: f64,
    pub seed: u64,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            max_tokens: 512,
            held_out_frac: 0.1,
            seed: 0,
        }
    }
}

/// What [`collect_documents`] read and skipped.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    pub documents: Vec<Document>,
    /// Files skipped (not UTF-8 text), with the reason.
    pub skipped: Vec<(PathBuf, String)>,
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let rd = std::fs::read_dir(dir).map_err(|e| CalibError::io(dir, e))?;
    let mut entries: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            walk(&p, out)?;
        } else if p.is_file() {
            out.push(p);
        }
    }
    Ok(())
}

/// Read text sources: files, directories (recursively, sorted, hidden entries skipped) and
/// `.jsonl` files (one `{"text": ..., "group"?: ...}` object a line). Non-UTF-8 files are
/// skipped and listed; a malformed JSONL line is an error naming the line.
pub fn collect_documents(from: &[PathBuf]) -> Result<Collected> {
    let mut c = Collected::default();
    for root in from {
        let (files, base) = if root.is_dir() {
            let mut v = vec![];
            walk(root, &mut v)?;
            (v, Some(root.clone()))
        } else if root.is_file() {
            (vec![root.clone()], None)
        } else {
            return Err(CalibError::invalid(root, "no such file or directory"));
        };
        for f in files {
            let bytes = std::fs::read(&f).map_err(|e| CalibError::io(&f, e))?;
            let Ok(text) = String::from_utf8(bytes) else {
                c.skipped.push((f.clone(), "not UTF-8 text".into()));
                continue;
            };
            let name = match &base {
                Some(b) => f
                    .strip_prefix(b)
                    .map(|r| format!("{}/{}", b.display(), r.display()))
                    .unwrap_or_else(|_| f.display().to_string()),
                None => f.display().to_string(),
            };
            if f.extension().is_some_and(|e| e == "jsonl") {
                for (i, line) in text.lines().enumerate() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                        CalibError::invalid(&f, format!("line {}: not JSON: {e}", i + 1))
                    })?;
                    let Some(t) = v.get("text").and_then(|t| t.as_str()) else {
                        return Err(CalibError::invalid(
                            &f,
                            format!("line {}: no string field `text`", i + 1),
                        ));
                    };
                    let source = match v.get("group") {
                        Some(g) if g.is_string() => {
                            format!("{name}#{}", g.as_str().unwrap_or_default())
                        }
                        Some(g) if !g.is_null() => format!("{name}#{g}"),
                        _ => format!("{name}:{}", i + 1),
                    };
                    c.documents.push(Document {
                        source,
                        text: t.to_string(),
                    });
                }
            } else {
                c.documents.push(Document { source: name, text });
            }
        }
    }
    Ok(c)
}

/// Load a `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer> {
    tokenizers::Tokenizer::from_file(path).map_err(|e| CalibError::Tokenizer {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

/// Whether a group with this source is held out (see the module doc).
fn held_out_u(seed: u64, source: &str) -> f64 {
    let mut b = seed.to_le_bytes().to_vec();
    b.extend_from_slice(source.as_bytes());
    let h = sha256_hex(&b);
    let v = u64::from_str_radix(&h[..16], 16).unwrap_or(0);
    v as f64 / 2f64.powi(64)
}

/// Tokenize documents with `tokenizer` into records and a manifest (nothing is written).
pub fn build_pack(
    tokenizer_path: &Path,
    docs: &[Document],
    opts: &PackOptions,
) -> Result<(PackManifest, Vec<Record>)> {
    let tok = load_tokenizer(tokenizer_path)?;
    let tokenizer_sha256 = file_sha256(tokenizer_path)?;
    let vocab = tok.get_vocab_size(true);
    let mut sources: Vec<(String, Vec<u32>)> = vec![];
    for d in docs {
        let enc = tok
            .encode(d.text.as_str(), false)
            .map_err(|e| CalibError::Tokenizer {
                path: tokenizer_path.to_path_buf(),
                msg: format!("{}: {e}", d.source),
            })?;
        match sources.iter_mut().find(|(s, _)| *s == d.source) {
            Some((_, ids)) => ids.extend_from_slice(enc.get_ids()),
            None => sources.push((d.source.clone(), enc.get_ids().to_vec())),
        }
    }
    from_token_sources(&sources, tokenizer_sha256, vocab, opts)
}

/// Build a manifest and records from already tokenized sources `(source, ids)`.
pub fn from_token_sources(
    sources: &[(String, Vec<u32>)],
    tokenizer_sha256: String,
    vocab_size: usize,
    opts: &PackOptions,
) -> Result<(PackManifest, Vec<Record>)> {
    if opts.max_tokens < MIN_RECORD_TOKENS {
        return Err(CalibError::Options(format!(
            "--max-tokens {} is too small (at least {MIN_RECORD_TOKENS})",
            opts.max_tokens
        )));
    }
    if !(0.0..=1.0).contains(&opts.held_out_frac) {
        return Err(CalibError::Options(format!(
            "--held-out-frac {} is not between 0 and 1",
            opts.held_out_frac
        )));
    }
    let mut groups = vec![];
    let mut records = vec![];
    let mut us = vec![];
    for (source, ids) in sources {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(CalibError::Options(format!(
                "{source}: token id {bad} is outside the tokenizer's vocabulary ({vocab_size})"
            )));
        }
        let id = format!("g{:05}", groups.len());
        let mut n_rec = 0;
        let mut n_tok = 0;
        for chunk in ids.chunks(opts.max_tokens) {
            if chunk.len() < MIN_RECORD_TOKENS {
                continue;
            }
            records.push(Record {
                id: format!("{id}-{n_rec:04}"),
                group: id.clone(),
                tokens: chunk.to_vec(),
            });
            n_rec += 1;
            n_tok += chunk.len();
        }
        if n_rec == 0 {
            continue;
        }
        let u = held_out_u(opts.seed, source);
        us.push(u);
        groups.push(GroupInfo {
            id,
            source: source.clone(),
            split: if u < opts.held_out_frac {
                Split::Eval
            } else {
                Split::Calibration
            },
            records: n_rec,
            tokens: n_tok,
        });
    }
    if groups.is_empty() {
        return Err(CalibError::Options(
            "no text to pack: every source was empty or shorter than 2 tokens".into(),
        ));
    }
    let f = opts.held_out_frac;
    if groups.len() >= 2 && f > 0.0 && f < 1.0 {
        let pick = |want_min: bool| {
            let mut idx: Vec<usize> = (0..us.len()).collect();
            idx.sort_by(|&a, &b| us[a].total_cmp(&us[b]));
            if want_min {
                idx[0]
            } else {
                idx[idx.len() - 1]
            }
        };
        if !groups.iter().any(|g| g.split == Split::Eval) {
            let i = pick(true);
            groups[i].split = Split::Eval;
        }
        if !groups.iter().any(|g| g.split == Split::Calibration) {
            let i = pick(false);
            groups[i].split = Split::Calibration;
        }
    }
    let text = records_jsonl(&records)?;
    let manifest = PackManifest {
        format: PACK_FORMAT.into(),
        version: PACK_VERSION,
        tokenizer_sha256,
        vocab_size,
        max_tokens: opts.max_tokens,
        held_out_frac: opts.held_out_frac,
        seed: opts.seed,
        records_file: RECORDS_FILE.into(),
        records_sha256: sha256_hex(text.as_bytes()),
        n_records: records.len(),
        n_tokens: records.iter().map(|r| r.tokens.len()).sum(),
        groups,
    };
    Ok((manifest, records))
}

fn records_jsonl(records: &[Record]) -> Result<String> {
    let mut s = String::new();
    for r in records {
        s.push_str(
            &serde_json::to_string(r)
                .map_err(|e| CalibError::Options(format!("record {}: {e}", r.id)))?,
        );
        s.push('\n');
    }
    Ok(s)
}

/// Write a pack directory atomically (refusing an existing `out` unless `force`).
pub fn write_pack(
    out: &Path,
    manifest: &PackManifest,
    records: &[Record],
    force: bool,
) -> Result<PathBuf> {
    let text = records_jsonl(records)?;
    let json =
        serde_json::to_string_pretty(manifest).map_err(|e| CalibError::Options(e.to_string()))?;
    let opts = WriterOptions {
        force,
        ..Default::default()
    };
    let mut w = CheckpointWriter::create(out, vec![], opts)?;
    w.add_file("pack.json", json.as_bytes())?;
    w.add_file(RECORDS_FILE, text.as_bytes())?;
    Ok(w.finish()?)
}

impl Pack {
    /// Read and validate a pack directory: format and version, the records file's SHA-256,
    /// every record in a listed group, per-group counts.
    pub fn open(dir: &Path) -> Result<Pack> {
        let mp = dir.join("pack.json");
        let bytes = std::fs::read(&mp).map_err(|e| CalibError::io(&mp, e))?;
        let manifest: PackManifest = serde_json::from_slice(&bytes)
            .map_err(|e| CalibError::invalid(&mp, format!("not a keep pack manifest: {e}")))?;
        if manifest.format != PACK_FORMAT || manifest.version != PACK_VERSION {
            return Err(CalibError::invalid(
                &mp,
                format!(
                    "format `{}` version {} is not {PACK_FORMAT} version {PACK_VERSION}",
                    manifest.format, manifest.version
                ),
            ));
        }
        if manifest.records_file.contains('/') || manifest.records_file.contains("..") {
            return Err(CalibError::invalid(
                &mp,
                "records_file must be a plain file name",
            ));
        }
        let rp = dir.join(&manifest.records_file);
        let text = std::fs::read(&rp).map_err(|e| CalibError::io(&rp, e))?;
        if sha256_hex(&text) != manifest.records_sha256 {
            return Err(CalibError::invalid(
                &rp,
                "SHA-256 differs from pack.json's records_sha256: the pack was changed or cut off; rebuild it with `keep pack`",
            ));
        }
        let text = String::from_utf8(text).map_err(|_| CalibError::invalid(&rp, "not UTF-8"))?;
        // Not sized from `n_records`: the manifest is input, and checked against the file below.
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let r: Record = serde_json::from_str(line)
                .map_err(|e| CalibError::invalid(&rp, format!("line {}: {e}", i + 1)))?;
            records.push(r);
        }
        if records.len() != manifest.n_records {
            return Err(CalibError::invalid(
                &mp,
                format!(
                    "n_records is {}, the records file has {}",
                    manifest.n_records,
                    records.len()
                ),
            ));
        }
        for g in &manifest.groups {
            let n = records.iter().filter(|r| r.group == g.id).count();
            if n != g.records {
                return Err(CalibError::invalid(
                    &mp,
                    format!(
                        "group {} lists {} records, the records file has {n}",
                        g.id, g.records
                    ),
                ));
            }
        }
        if let Some(r) = records
            .iter()
            .find(|r| !manifest.groups.iter().any(|g| g.id == r.group))
        {
            return Err(CalibError::invalid(
                &rp,
                format!(
                    "record {} names group {}, which pack.json does not list",
                    r.id, r.group
                ),
            ));
        }
        if let Some(r) = records
            .iter()
            .find(|r| r.tokens.iter().any(|&t| t as usize >= manifest.vocab_size))
        {
            return Err(CalibError::invalid(
                &rp,
                format!(
                    "record {} has a token id ≥ vocab_size {}",
                    r.id, manifest.vocab_size
                ),
            ));
        }
        Ok(Pack {
            dir: dir.to_path_buf(),
            fingerprint: sha256_hex(&bytes),
            manifest,
            records,
        })
    }

    /// Groups of a split, in pack order.
    pub fn groups(&self, split: Split) -> Vec<&GroupInfo> {
        self.manifest
            .groups
            .iter()
            .filter(|g| g.split == split)
            .collect()
    }

    /// Records of a group, in order.
    pub fn records_of<'a>(&'a self, group: &'a str) -> impl Iterator<Item = &'a Record> + 'a {
        self.records.iter().filter(move |r| r.group == group)
    }
}
