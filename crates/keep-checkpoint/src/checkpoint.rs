//! A checkpoint directory opened for reading: config, index, shards, lookup by name.
//!
//! Shards come from the index when there is one (every shard it names must exist, every tensor
//! it names must be in that shard) and from `*.safetensors` in the directory otherwise. A tensor
//! found in two shards is an error. What is inconsistent but readable (a shard tensor the index
//! does not name, a shard the index does not use) is collected in [`Checkpoint::warnings`] for
//! `keep inspect` to show.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::index::{Index, INDEX_FILE};
use crate::safetensors::{ShardFile, TensorInfo};
use crate::sums::SUMS_FILE;
use crate::{CheckpointError, DeepSeekConfig, Dtype, Result};

/// The config file's name.
pub const CONFIG_FILE: &str = "config.json";

/// A borrowed view of one tensor.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    /// The tensor's bytes (zero-copy from the mapping).
    pub bytes: &'a [u8],
    /// Index of the shard in [`Checkpoint::shards`].
    pub shard: usize,
    /// Absolute offset of the bytes in the shard file.
    pub file_offset: u64,
}

impl TensorRef<'_> {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// An opened checkpoint directory.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config: Option<DeepSeekConfig>,
    index: Option<Index>,
    shards: Vec<ShardFile>,
    by_name: HashMap<String, (usize, usize)>,
    order: Vec<(usize, usize)>,
    warnings: Vec<String>,
}

impl Checkpoint {
    /// Open a directory. `config.json` is optional here (callers that need it use
    /// [`Checkpoint::require_config`]); a malformed one is an error.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        match std::fs::metadata(dir) {
            Err(e) => return Err(CheckpointError::io(dir, e)),
            Ok(m) if !m.is_dir() => {
                return Err(CheckpointError::NotADirectory {
                    path: dir.to_path_buf(),
                    kind: crate::atomic::kind_of(&m.file_type()),
                })
            }
            Ok(_) => {}
        }
        let cfg_path = dir.join(CONFIG_FILE);
        // Present means any directory entry, a dangling link included (reading it then says
        // what it is), not only a readable file.
        let present = |p: &Path| std::fs::symlink_metadata(p).is_ok();
        let config = if present(&cfg_path) {
            Some(DeepSeekConfig::read(&cfg_path)?)
        } else {
            None
        };
        let idx_path = dir.join(INDEX_FILE);
        let index = if present(&idx_path) {
            Some(Index::read(&idx_path)?)
        } else {
            None
        };
        let mut warnings = vec![];
        let mut files: Vec<String> = vec![];
        let rd = std::fs::read_dir(dir).map_err(|e| CheckpointError::io(dir, e))?;
        for e in rd {
            let e = e.map_err(|e| CheckpointError::io(dir, e))?;
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".safetensors") {
                // A shard that is a FIFO or a device would block or never end: name it.
                let m = std::fs::metadata(e.path())
                    .map_err(|err| CheckpointError::io(e.path(), err))?;
                if !m.is_file() {
                    return Err(CheckpointError::NotRegular {
                        path: e.path(),
                        kind: crate::atomic::kind_of(&m.file_type()),
                    });
                }
                files.push(n);
            }
        }
        files.sort();
        let shard_names = match &index {
            Some(ix) => {
                for s in ix.shards() {
                    if !dir.join(&s).is_file() {
                        return Err(CheckpointError::Index {
                            path: idx_path.clone(),
                            msg: format!(
                                "names shard `{s}`, which is missing from {}",
                                dir.display()
                            ),
                        });
                    }
                }
                for f in &files {
                    if !ix.weight_map.values().any(|s| s == f) {
                        warnings.push(format!("shard `{f}` is not named by {INDEX_FILE}"));
                    }
                }
                ix.shards()
            }
            None => files,
        };
        if shard_names.is_empty() {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| CheckpointError::io(dir, e))?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect();
            names.sort();
            let msg = if names.is_empty() {
                "is an empty directory, not a checkpoint (a checkpoint directory holds \
                 config.json and *.safetensors shards)"
                    .to_string()
            } else {
                let shown: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
                format!(
                    "is not a checkpoint directory: it holds no *.safetensors shard ({} entr{}: {}{})",
                    names.len(),
                    if names.len() == 1 { "y" } else { "ies" },
                    shown.join(", "),
                    if names.len() > shown.len() { ", …" } else { "" }
                )
            };
            return Err(CheckpointError::Index {
                path: dir.to_path_buf(),
                msg,
            });
        }
        let mut shards = vec![];
        let mut by_name: HashMap<String, (usize, usize)> = HashMap::new();
        let mut order = vec![];
        for (si, s) in shard_names.iter().enumerate() {
            let sf = ShardFile::open(&dir.join(s))?;
            for (ti, t) in sf.header().tensors.iter().enumerate() {
                if let Some(&(other, _)) = by_name.get(&t.name) {
                    return Err(CheckpointError::Tensor {
                        path: dir.join(s),
                        tensor: t.name.clone(),
                        msg: format!("also in shard `{}`", shard_names[other]),
                    });
                }
                by_name.insert(t.name.clone(), (si, ti));
                order.push((si, ti));
                if let Some(ix) = &index {
                    match ix.weight_map.get(&t.name) {
                        Some(f) if f == s => {}
                        Some(f) => {
                            return Err(CheckpointError::Index {
                                path: idx_path.clone(),
                                msg: format!("says `{}` is in `{f}` but it is in `{s}`", t.name),
                            })
                        }
                        None => warnings.push(format!(
                            "tensor `{}` in `{s}` is not named by {INDEX_FILE}",
                            t.name
                        )),
                    }
                }
            }
            shards.push(sf);
        }
        if let Some(ix) = &index {
            for (name, s) in &ix.weight_map {
                if !by_name.contains_key(name) {
                    return Err(CheckpointError::Index {
                        path: idx_path.clone(),
                        msg: format!(
                            "names tensor `{name}` in `{s}`, but that shard has no such tensor"
                        ),
                    });
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            config,
            index,
            shards,
            by_name,
            order,
            warnings,
        })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The config, if the directory has one.
    pub fn config(&self) -> Option<&DeepSeekConfig> {
        self.config.as_ref()
    }
    /// The config, or an error saying it is needed.
    pub fn require_config(&self) -> Result<&DeepSeekConfig> {
        self.config.as_ref().ok_or_else(|| CheckpointError::Config {
            path: self.dir.join(CONFIG_FILE),
            msg: "missing: this command needs the model's config.json".into(),
        })
    }
    /// The index, if the directory has one.
    pub fn index(&self) -> Option<&Index> {
        self.index.as_ref()
    }
    /// The shard files.
    pub fn shards(&self) -> &[ShardFile] {
        &self.shards
    }
    /// Bytes of all shard files together.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(ShardFile::len).sum()
    }
    /// Fault every shard's mapping in now ([`ShardFile::populate`]); the bytes populated.
    pub fn populate(&self) -> u64 {
        self.shards
            .iter()
            .filter(|s| s.populate())
            .map(ShardFile::len)
            .sum()
    }
    /// Readable inconsistencies found while opening.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.order.len()
    }
    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    fn make_ref(&self, si: usize, ti: usize) -> TensorRef<'_> {
        let sf = &self.shards[si];
        let t: &TensorInfo = &sf.header().tensors[ti];
        TensorRef {
            name: &t.name,
            dtype: t.dtype,
            shape: &t.shape,
            bytes: sf.data(t),
            shard: si,
            file_offset: sf.file_offset(t),
        }
    }

    /// Look a tensor up by name.
    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        self.by_name
            .get(name)
            .map(|&(si, ti)| self.make_ref(si, ti))
    }

    /// Look a tensor up by name, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        self.get(name).ok_or_else(|| CheckpointError::NoSuchTensor {
            dir: self.dir.clone(),
            tensor: name.to_string(),
        })
    }

    /// Every tensor, shard by shard in data order.
    pub fn tensors(&self) -> impl Iterator<Item = TensorRef<'_>> + '_ {
        self.order.iter().map(|&(si, ti)| self.make_ref(si, ti))
    }

    /// The shards an output may take whole ([`crate::writer::ReusedShard`]): those whose every
    /// tensor `unchanged` accepts (the output holds it under the same name, dtype, shape and
    /// bytes) and is the one this checkpoint reads under that name.
    pub fn whole_shards(
        &self,
        unchanged: impl Fn(&TensorRef<'_>) -> bool,
    ) -> Vec<crate::writer::ReusedShard> {
        let mut out = vec![];
        for (si, sf) in self.shards.iter().enumerate() {
            let tensors = &sf.header().tensors;
            let whole = !tensors.is_empty()
                && (0..tensors.len()).all(|ti| {
                    self.by_name.get(tensors[ti].name.as_str()) == Some(&(si, ti))
                        && unchanged(&self.make_ref(si, ti))
                });
            if whole {
                out.push(crate::writer::ReusedShard {
                    src: sf.path().to_path_buf(),
                    tensors: tensors
                        .iter()
                        .map(|t| crate::writer::TensorMeta::new(t.name.clone(), t.dtype, &t.shape))
                        .collect(),
                });
            }
        }
        out
    }

    /// Files of the directory that are neither shards, the index, the config nor SHA256SUMS
    /// (tokenizer files and the like), which writers pass through untouched.
    pub fn aux_files(&self) -> Result<Vec<PathBuf>> {
        let mut out = vec![];
        let rd = std::fs::read_dir(&self.dir).map_err(|e| CheckpointError::io(&self.dir, e))?;
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            let p = e.path();
            if !p.is_file()
                || n.ends_with(".safetensors")
                || n == INDEX_FILE
                || n == CONFIG_FILE
                || n == SUMS_FILE
            {
                continue;
            }
            out.push(p);
        }
        out.sort();
        Ok(out)
    }
}
