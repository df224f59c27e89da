//! The atomic checkpoint writer: shards, index, `SHA256SUMS`, temp-dir-then-rename.
//!
//! The caller declares every tensor (name, dtype, shape) up front, in the order it will write
//! them; the writer plans shards (a new shard when the next tensor would pass
//! [`WriterOptions::max_shard_bytes`]), writes each shard's header, then takes the data in order,
//! in as many chunks as the caller likes, hashing while it writes. Everything is built in a
//! hidden sibling directory (`.<out>.keep-tmp-<pid>`) and renamed to the output only by
//! [`CheckpointWriter::finish`]; dropping an unfinished writer deletes the temporary directory,
//! and a later writer removes temporaries left by processes that no longer exist, so an
//! interrupted run never leaves a half-written output.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::index::{Index, INDEX_FILE};
use crate::sums::{hex, render, SUMS_FILE};
use crate::{CheckpointError, Dtype, Result};

/// A tensor to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// Construct.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64]) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }
    /// Bytes of data (sub-byte dtypes rounded up; shapes are checked in [`CheckpointWriter::create`]).
    pub fn nbytes(&self) -> u64 {
        let n: u64 = self.shape.iter().product();
        (n * self.dtype.bits() as u64).div_ceil(8)
    }
}

/// Writer settings.
#[derive(Debug, Clone)]
pub struct WriterOptions {
    /// Largest shard, in bytes (a single larger tensor gets a shard of its own).
    pub max_shard_bytes: u64,
    /// Replace an existing output.
    pub force: bool,
    /// `__metadata__` written into every shard.
    pub shard_metadata: BTreeMap<String, String>,
    /// `fsync` every file before the rename (durable; off only for benchmarks that compare
    /// against a copy that does not sync either).
    pub sync: bool,
    /// Paths the output must neither be, contain, nor lie inside (the inputs being read).
    pub protect: Vec<PathBuf>,
}

impl Default for WriterOptions {
    fn default() -> Self {
        WriterOptions {
            max_shard_bytes: 4 << 30,
            force: false,
            shard_metadata: BTreeMap::from([("format".to_string(), "pt".to_string())]),
            sync: true,
            protect: vec![],
        }
    }
}

struct Shard {
    file: String,
    tensors: Vec<TensorMeta>,
}

/// A shard of another checkpoint that the output holds byte for byte: the writer links it into
/// the output (a hard link where the file system allows one, else a copy) instead of the
/// caller streaming its tensors, and lists its tensors in the index. Quant and prune hand over
/// every source shard none of whose tensors they change (Engram tables, for one), so an output
/// costs disk only for what is new. Keep never writes into an existing file, so the two names
/// of a linked shard stay equal; a tool that edits a shard in place would change both.
#[derive(Debug, Clone)]
pub struct ReusedShard {
    /// The source shard file.
    pub src: PathBuf,
    /// Its tensors, as its header lists them.
    pub tensors: Vec<TensorMeta>,
}

/// How the output got the shards it reused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReuseStats {
    /// Shards hard-linked.
    pub linked_shards: usize,
    /// Their bytes.
    pub linked_bytes: u64,
    /// Shards copied (the output is on another file system, or linking is not allowed).
    pub copied_shards: usize,
    /// Their bytes.
    pub copied_bytes: u64,
}

/// A file written and hashed by a background thread, so that hashing (SHA-256) and the
/// caller's reading overlap: the caller fills 8 MiB buffers, the thread hashes and writes them.
struct HashingFile {
    tx: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    pool: std::sync::mpsc::Receiver<Vec<u8>>,
    worker: Option<std::thread::JoinHandle<std::io::Result<(File, String)>>>,
    buf: Vec<u8>,
    path: PathBuf,
}

const HASH_BUF: usize = 8 << 20;

impl HashingFile {
    fn create(path: PathBuf) -> Result<HashingFile> {
        let mut f = File::create(&path).map_err(|e| CheckpointError::io(&path, e))?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(2);
        let (back_tx, pool) = std::sync::mpsc::channel::<Vec<u8>>();
        let worker = std::thread::spawn(move || {
            let mut hash = Sha256::new();
            for mut buf in rx {
                hash.update(&buf);
                f.write_all(&buf)?;
                buf.clear();
                let _ = back_tx.send(buf);
            }
            Ok((f, hex(&hash.finalize())))
        });
        Ok(HashingFile {
            tx: Some(tx),
            pool,
            worker: Some(worker),
            buf: Vec::with_capacity(HASH_BUF),
            path,
        })
    }
    fn send(&mut self) -> Result<()> {
        let next = self
            .pool
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(HASH_BUF));
        let full = std::mem::replace(&mut self.buf, next);
        let sent = self.tx.as_ref().map(|tx| tx.send(full).is_ok());
        if sent != Some(true) {
            // The worker stopped: its error is reported by close().
            return self.close_inner(false).map(|_| ());
        }
        Ok(())
    }
    fn write(&mut self, mut data: &[u8]) -> Result<()> {
        while !data.is_empty() {
            let room = HASH_BUF - self.buf.len();
            let n = room.min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == HASH_BUF {
                self.send()?;
            }
        }
        Ok(())
    }
    fn close_inner(&mut self, sync: bool) -> Result<String> {
        if !self.buf.is_empty() {
            let full = std::mem::take(&mut self.buf);
            if let Some(tx) = &self.tx {
                let _ = tx.send(full);
            }
        }
        self.tx = None;
        let worker = self.worker.take().ok_or_else(|| {
            CheckpointError::Writer(format!("{} was already closed", self.path.display()))
        })?;
        let (f, h) = worker
            .join()
            .map_err(|_| CheckpointError::Writer("writer thread panicked".into()))?
            .map_err(|e| CheckpointError::io(&self.path, e))?;
        if sync {
            f.sync_all()
                .map_err(|e| CheckpointError::io(&self.path, e))?;
        }
        Ok(h)
    }
    fn close(mut self, sync: bool) -> Result<String> {
        self.close_inner(sync)
    }
}

/// Builds one output directory; see the module doc.
pub struct CheckpointWriter {
    out: PathBuf,
    tmp: PathBuf,
    opts: WriterOptions,
    shards: Vec<Shard>,
    shard: usize,
    tensor: usize,
    written: u64,
    file: Option<HashingFile>,
    sums: Vec<(String, String)>,
    extra: Vec<String>,
    /// The shards taken whole from another checkpoint, already in the temporary directory.
    reused: Vec<Shard>,
    reuse: ReuseStats,
    finished: bool,
}

fn tmp_prefix(out: &Path) -> Result<(PathBuf, String)> {
    let name = out
        .file_name()
        .ok_or_else(|| CheckpointError::Writer(format!("{} has no file name", out.display())))?
        .to_string_lossy()
        .to_string();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, format!(".{name}.keep-tmp-")))
}

/// Where the previous output waits while it is replaced on a file system without an atomic
/// exchange (two renames); a later writer restores it from there if it was stranded.
fn old_sibling(out: &Path) -> Result<PathBuf> {
    let (parent, prefix) = tmp_prefix(out)?;
    Ok(parent.join(prefix.replace(".keep-tmp-", ".keep-old")))
}

/// Restore an output stranded in its old sibling by an interrupted replace (`out` missing), or
/// remove an old copy whose replace completed.
fn recover_old(out: &Path) -> Result<()> {
    let old = old_sibling(out)?;
    if std::fs::symlink_metadata(&old).is_err() {
        return Ok(());
    }
    if std::fs::symlink_metadata(out).is_err() {
        std::fs::rename(&old, out).map_err(|e| CheckpointError::io(out, e))
    } else {
        std::fs::remove_dir_all(&old).map_err(|e| CheckpointError::io(&old, e))
    }
}

/// Check that a checkpoint may be written at `out`: absent, or an existing directory (not a
/// link) and `force` that is empty or an output keep wrote ([`check_keep_output`]); never one
/// of `protect`, inside one, or containing one. Every verb that writes a directory checks its
/// output here (the writer does, in [`CheckpointWriter::create`] and before its rename).
pub fn check_dir_target(out: &Path, force: bool, protect: &[PathBuf]) -> Result<()> {
    let inputs: Vec<&Path> = protect.iter().map(PathBuf::as_path).collect();
    crate::atomic::check_disjoint(out, &inputs)?;
    match std::fs::symlink_metadata(out) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CheckpointError::io(out, e)),
        Ok(m) if !m.file_type().is_dir() => Err(CheckpointError::NotADirectory {
            path: out.to_path_buf(),
            kind: crate::atomic::kind_of(&m.file_type()),
        }),
        Ok(_) if !force => Err(CheckpointError::OutputExists {
            path: out.to_path_buf(),
        }),
        Ok(_) => check_keep_output(out),
    }
}

/// Check that the existing directory `out` may be replaced: it is not the current directory
/// nor holds it, and it is empty or keep wrote it, that is it has a `SHA256SUMS` and every
/// entry in it is listed there (a file of anyone else's is never removed). The error names
/// the first entry that is not keep's.
pub fn check_keep_output(out: &Path) -> Result<()> {
    let not = |why: String| CheckpointError::NotKeepOutput {
        path: out.to_path_buf(),
        why,
    };
    if let Ok(cwd) = std::env::current_dir() {
        let (o, c) = (crate::atomic::resolve(out), crate::atomic::resolve(&cwd));
        if c.starts_with(&o) {
            let how = if c == o {
                "is the current directory".to_string()
            } else {
                format!("holds the current directory {}", cwd.display())
            };
            return Err(not(how));
        }
    }
    let rd = std::fs::read_dir(out).map_err(|e| CheckpointError::io(out, e))?;
    let mut entries: Vec<String> = rd
        .map(|e| {
            e.map(|e| e.file_name().to_string_lossy().to_string())
                .map_err(|e| CheckpointError::io(out, e))
        })
        .collect::<Result<_>>()?;
    if entries.is_empty() {
        return Ok(());
    }
    entries.sort();
    let sums = out.join(SUMS_FILE);
    if !std::fs::symlink_metadata(&sums).is_ok_and(|m| m.is_file()) {
        return Err(not(format!(
            "is not empty and has no {SUMS_FILE} (it holds {})",
            entries[0]
        )));
    }
    let text = crate::small_file::read_text(&sums, crate::small_file::MAX_SMALL_FILE)?;
    let listed: std::collections::HashSet<String> = crate::sums::parse(&sums, &text)
        .map_err(|_| not(format!("has a {SUMS_FILE} keep did not write")))?
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    match entries
        .iter()
        .find(|n| n.as_str() != SUMS_FILE && !listed.contains(n.as_str()))
    {
        Some(n) => Err(not(format!(
            "holds {n}, which its {SUMS_FILE} does not list"
        ))),
        None => Ok(()),
    }
}

/// Remove temporaries of `out` left by processes that are gone (Linux: no `/proc/<pid>`).
fn remove_stale(out: &Path) -> Result<()> {
    let (parent, prefix) = tmp_prefix(out)?;
    let Ok(rd) = std::fs::read_dir(&parent) else {
        return Ok(());
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().to_string();
        if let Some(pid) = n.strip_prefix(&prefix) {
            let alive = pid
                .parse::<u32>()
                .map(|p| Path::new(&format!("/proc/{p}")).exists())
                .unwrap_or(false);
            if !alive || pid == std::process::id().to_string() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
}

impl CheckpointWriter {
    /// Plan shards and create the temporary directory. Refuses an existing `out` unless
    /// `opts.force`.
    pub fn create(
        out: &Path,
        tensors: Vec<TensorMeta>,
        opts: WriterOptions,
    ) -> Result<CheckpointWriter> {
        Self::create_reusing(out, tensors, vec![], opts)
    }

    /// [`CheckpointWriter::create`], with `reused` shards of another checkpoint that the
    /// output takes whole ([`ReusedShard`]): their tensors are not written by the caller.
    pub fn create_reusing(
        out: &Path,
        tensors: Vec<TensorMeta>,
        reused: Vec<ReusedShard>,
        opts: WriterOptions,
    ) -> Result<CheckpointWriter> {
        check_dir_target(out, opts.force, &opts.protect)?;
        recover_old(out)?;
        check_dir_target(out, opts.force, &opts.protect)?;
        let mut seen = std::collections::HashSet::new();
        for t in tensors.iter().chain(reused.iter().flat_map(|r| &r.tensors)) {
            if !seen.insert(t.name.as_str()) {
                return Err(CheckpointError::Writer(format!(
                    "tensor `{}` declared twice",
                    t.name
                )));
            }
            let n: u64 = t.shape.iter().product();
            if t.dtype.bytes_for(n).is_none() {
                return Err(CheckpointError::Writer(format!(
                    "tensor `{}`: {n} elements of {} do not fill whole bytes",
                    t.name, t.dtype
                )));
            }
        }
        remove_stale(out)?;
        let (parent, prefix) = tmp_prefix(out)?;
        let tmp = parent.join(format!("{prefix}{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;
        }
        std::fs::create_dir_all(&tmp).map_err(|e| CheckpointError::io(&tmp, e))?;

        let mut groups: Vec<Vec<TensorMeta>> = vec![];
        let mut size = 0u64;
        for t in tensors {
            let b = t.nbytes();
            if groups.is_empty() || (size + b > opts.max_shard_bytes && size > 0) {
                groups.push(vec![]);
                size = 0;
            }
            size += b;
            groups.last_mut().expect("pushed above").push(t);
        }
        let n = groups.len() + reused.len();
        let file = |i: usize| {
            if n <= 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            }
        };
        let written = groups.len();
        let shards = groups
            .into_iter()
            .enumerate()
            .map(|(i, tensors)| Shard {
                file: file(i),
                tensors,
            })
            .collect();
        let reused: Vec<(String, ReusedShard)> = reused
            .into_iter()
            .enumerate()
            .map(|(i, r)| (file(written + i), r))
            .collect();
        let mut w = CheckpointWriter {
            out: out.to_path_buf(),
            tmp,
            opts,
            shards,
            shard: 0,
            tensor: 0,
            written: 0,
            file: None,
            sums: vec![],
            extra: vec![],
            reused: vec![],
            reuse: ReuseStats::default(),
            finished: false,
        };
        w.place_reused(reused)?;
        w.open_shard()?;
        Ok(w)
    }

    /// The temporary directory being filled (for callers that add files themselves).
    pub fn tmp_dir(&self) -> &Path {
        &self.tmp
    }

    fn open_shard(&mut self) -> Result<()> {
        let Some(shard) = self.shards.get(self.shard) else {
            return Ok(());
        };
        let head = crate::tensor_file::header(
            &crate::tensor_file::pairs(&self.opts.shard_metadata),
            &shard.tensors,
            crate::tensor_file::KeyOrder::Sorted,
        )?;
        let mut f = HashingFile::create(self.tmp.join(&shard.file))?;
        f.write(&head)?;
        self.file = Some(f);
        self.tensor = 0;
        self.written = 0;
        self.skip_empty()
    }

    /// Close finished shards and move past zero-byte tensors.
    fn skip_empty(&mut self) -> Result<()> {
        loop {
            let Some(shard) = self.shards.get(self.shard) else {
                return Ok(());
            };
            if self.tensor < shard.tensors.len() {
                if shard.tensors[self.tensor].nbytes() == 0 {
                    self.tensor += 1;
                    continue;
                }
                return Ok(());
            }
            let file = shard.file.clone();
            let f = self.file.take().expect("open shard");
            let h = f.close(self.opts.sync)?;
            self.sums.push((file, h));
            self.shard += 1;
            if self.shard < self.shards.len() {
                return self.open_shard();
            }
        }
    }

    /// The name of the tensor the writer expects next, if any.
    pub fn next_tensor(&self) -> Option<&TensorMeta> {
        self.shards.get(self.shard)?.tensors.get(self.tensor)
    }

    /// Append `data` to tensor `name`, which must be the one expected next; a tensor may be
    /// written in several chunks, and the writer moves on when its bytes are complete.
    pub fn write_chunk(&mut self, name: &str, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let Some(t) = self.next_tensor() else {
            return Err(CheckpointError::Writer(format!(
                "`{name}` written after every declared tensor"
            )));
        };
        if t.name != name {
            return Err(CheckpointError::Writer(format!(
                "expected data of `{}`, got `{name}`",
                t.name
            )));
        }
        let need = t.nbytes();
        if self.written + data.len() as u64 > need {
            return Err(CheckpointError::Writer(format!(
                "`{name}` takes {need} bytes, got more"
            )));
        }
        self.file.as_mut().expect("open shard").write(data)?;
        self.written += data.len() as u64;
        if self.written == need {
            self.tensor += 1;
            self.written = 0;
            self.skip_empty()?;
        }
        Ok(())
    }

    /// Write a whole tensor.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let need = self.next_tensor().map(TensorMeta::nbytes);
        if need.is_some_and(|n| n != data.len() as u64) || self.written != 0 {
            return Err(CheckpointError::Writer(format!(
                "`{name}`: whole-tensor write of {} bytes, expected {:?}",
                data.len(),
                need
            )));
        }
        if data.is_empty() {
            return Ok(());
        }
        self.write_chunk(name, data)
    }

    /// Add a small file (config.json, a report, a tokenizer) to the output.
    pub fn add_file(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        if name.contains('/') || name == SUMS_FILE || name == INDEX_FILE {
            return Err(CheckpointError::Writer(format!(
                "`{name}` cannot be added by hand"
            )));
        }
        let mut f = HashingFile::create(self.tmp.join(name))?;
        f.write(bytes)?;
        let h = f.close(self.opts.sync)?;
        self.sums.retain(|(n, _)| n != name);
        self.sums.push((name.to_string(), h));
        self.extra.push(name.to_string());
        Ok(())
    }

    /// Copy a file from elsewhere into the output (tokenizer files pass through untouched).
    pub fn copy_file(&mut self, name: &str, src: &Path) -> Result<()> {
        let bytes = std::fs::read(src).map_err(|e| CheckpointError::io(src, e))?;
        self.add_file(name, &bytes)
    }

    /// Link (or copy) the reused shards into the temporary directory, each with its checksum:
    /// the one the source's `SHA256SUMS` lists for it, else computed from the file.
    fn place_reused(&mut self, reused: Vec<(String, ReusedShard)>) -> Result<()> {
        for (file, r) in reused {
            // Link the file itself, not a symbolic link to it (a hub cache's shards are links
            // into its blob store, often relative ones).
            let src = std::fs::canonicalize(&r.src).map_err(|e| CheckpointError::io(&r.src, e))?;
            let dst = self.tmp.join(&file);
            let bytes = std::fs::metadata(&src)
                .map_err(|e| CheckpointError::io(&src, e))?
                .len();
            if std::fs::hard_link(&src, &dst).is_ok() {
                self.reuse.linked_shards += 1;
                self.reuse.linked_bytes += bytes;
            } else {
                // Never copy onto an existing name: were it a link to the source, the copy
                // would truncate the source.
                if std::fs::symlink_metadata(&dst).is_ok() {
                    return Err(CheckpointError::Writer(format!(
                        "{} exists in the output being built",
                        dst.display()
                    )));
                }
                std::fs::copy(&src, &dst).map_err(|e| CheckpointError::io(&dst, e))?;
                if self.opts.sync {
                    File::open(&dst)
                        .and_then(|f| f.sync_all())
                        .map_err(|e| CheckpointError::io(&dst, e))?;
                }
                self.reuse.copied_shards += 1;
                self.reuse.copied_bytes += bytes;
            }
            let listed = listed_sum(&r.src)?;
            let h = match listed {
                Some(h) => h,
                None => crate::sums::file_sha256(&dst)?,
            };
            self.sums.push((file.clone(), h));
            self.reused.push(Shard {
                file,
                tensors: r.tensors,
            });
        }
        Ok(())
    }

    /// How the reused shards were placed (in the temporary directory from
    /// [`CheckpointWriter::create_reusing`] on).
    pub fn reuse_stats(&self) -> ReuseStats {
        self.reuse
    }

    /// Check that everything was written, write the index and `SHA256SUMS`, and rename the
    /// temporary directory into place. Returns the output path.
    pub fn finish(mut self) -> Result<PathBuf> {
        if let Some(t) = self.next_tensor() {
            return Err(CheckpointError::Writer(format!(
                "finished before tensor `{}` was written",
                t.name
            )));
        }
        if self.shards.len() + self.reused.len() > 1 {
            let mut index = Index::default();
            let mut total = 0;
            for s in self.shards.iter().chain(&self.reused) {
                for t in &s.tensors {
                    index.weight_map.insert(t.name.clone(), s.file.clone());
                    total += t.nbytes();
                }
            }
            index.total_size = Some(total);
            let bytes = serde_json::to_vec_pretty(&index.to_json()).expect("JSON");
            let mut f = HashingFile::create(self.tmp.join(INDEX_FILE))?;
            f.write(&bytes)?;
            let h = f.close(self.opts.sync)?;
            self.sums.push((INDEX_FILE.to_string(), h));
        }
        let sums = render(&self.sums);
        let p = self.tmp.join(SUMS_FILE);
        std::fs::write(&p, sums).map_err(|e| CheckpointError::io(&p, e))?;
        check_dir_target(&self.out, self.opts.force, &self.opts.protect)?;
        if std::fs::symlink_metadata(&self.out).is_ok() {
            // Swap new and old in one step where the OS can; the old copy is then in the
            // temporary directory, removed below or, after a kill, by the next writer.
            if crate::atomic::exchange(&self.tmp, &self.out)
                .map_err(|e| CheckpointError::io(&self.out, e))?
            {
                let _ = std::fs::remove_dir_all(&self.tmp);
            } else {
                let old = old_sibling(&self.out)?;
                std::fs::rename(&self.out, &old).map_err(|e| CheckpointError::io(&self.out, e))?;
                if let Err(e) = std::fs::rename(&self.tmp, &self.out) {
                    let _ = std::fs::rename(&old, &self.out);
                    return Err(CheckpointError::io(&self.out, e));
                }
                let _ = std::fs::remove_dir_all(&old);
            }
        } else {
            crate::atomic::rename_noreplace(&self.tmp, &self.out).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    CheckpointError::OutputExists {
                        path: self.out.clone(),
                    }
                } else {
                    CheckpointError::io(&self.out, e)
                }
            })?;
        }
        self.finished = true;
        Ok(self.out.clone())
    }
}

/// The checksum the `SHA256SUMS` beside `shard` lists for it, if that file exists and lists it.
fn listed_sum(shard: &Path) -> Result<Option<String>> {
    let (Some(dir), Some(name)) = (shard.parent(), shard.file_name()) else {
        return Ok(None);
    };
    let sums = dir.join(SUMS_FILE);
    if !sums.is_file() {
        return Ok(None);
    }
    let text = crate::small_file::read_text(&sums, crate::small_file::MAX_SMALL_FILE)?;
    let Ok(entries) = crate::sums::parse(&sums, &text) else {
        return Ok(None);
    };
    let name = name.to_string_lossy();
    Ok(entries
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, h)| h))
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }
}
