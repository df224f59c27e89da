//! Typed reads of one safetensors file that keep wrote for itself: metadata values as text or
//! whole numbers, tensors as `f64`/`f32`/`i64`/`i32`/`i16`/`f16` vectors with their dtype and
//! presence checked, every error naming the file and the tensor or key. The file is opened with
//! keep-checkpoint's hostile-input parser (bounded header, checked offsets), so a cut-off file
//! is an error here. [`write`] is the layout of calibration files (sessions, imatrix, REAP
//! statistics): keep-checkpoint's one single-file writer with the tensors in name order and the
//! metadata keys in byte order, listed metadata first.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use keep_checkpoint::tensor_file::{self, KeyOrder, Tensor};
use keep_checkpoint::{Dtype, ShardFile, TensorInfo};

use crate::{ArtifactError, Result};

/// Write `tensors` with `metadata` to `path` atomically (an existing `path` only if `force`; a
/// `path` that is not a regular file never) in the calibration files' layout: `__metadata__`
/// first with its keys in byte order, then the tensors in name order, data in the same order.
pub fn write(
    path: &Path,
    mut tensors: Vec<Tensor>,
    metadata: &BTreeMap<String, String>,
    force: bool,
) -> Result<()> {
    tensors.sort_by(|a, b| a.name().cmp(b.name()));
    Ok(tensor_file::write(
        path,
        &tensors,
        &tensor_file::pairs(metadata),
        KeyOrder::Listed,
        force,
    )?)
}

/// A safetensors file opened for typed reads.
pub struct StFile {
    pub file: ShardFile,
    by_name: HashMap<String, usize>,
}

impl StFile {
    /// Open and parse the header.
    pub fn open(path: &Path) -> Result<StFile> {
        let file = ShardFile::open(path)?;
        let by_name = file
            .header()
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(StFile { file, by_name })
    }
    /// The file's path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }
    /// The header's `__metadata__`.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.file.header().metadata
    }
    /// A metadata value, or an error naming the key.
    pub fn meta(&self, key: &str) -> Result<&str> {
        self.metadata().get(key).map(String::as_str).ok_or_else(|| {
            ArtifactError::invalid(self.path(), format!("metadata `{key}` is missing"))
        })
    }
    /// A whole-number metadata value.
    pub fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self.meta(key)?;
        v.parse().map_err(|_| {
            ArtifactError::invalid(
                self.path(),
                format!("metadata `{key}` = `{v}` is not a whole number"),
            )
        })
    }
    /// A metadata value that is a comma list of whole numbers (empty for an empty value).
    pub fn meta_list(&self, key: &str) -> Result<Vec<usize>> {
        let v = self.meta(key)?;
        v.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.trim().parse::<usize>())
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| {
                ArtifactError::invalid(self.path(), format!("metadata {key} is not a comma list"))
            })
    }
    /// Every tensor's header entry, in header order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.file.header().tensors
    }
    /// The header entry of `name`.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.file.header().tensors[i])
    }
    /// Whether the file holds `name`.
    pub fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }
    fn get(&self, name: &str, dtypes: &[Dtype]) -> Result<(&TensorInfo, &[u8])> {
        let t = self.info(name).ok_or_else(|| {
            ArtifactError::invalid(self.path(), format!("tensor `{name}` is missing"))
        })?;
        if !dtypes.contains(&t.dtype) {
            return Err(ArtifactError::invalid(
                self.path(),
                format!("tensor `{name}` is {}, expected one of {dtypes:?}", t.dtype),
            ));
        }
        Ok((t, self.file.data(t)))
    }
    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let t = self.info(name).ok_or_else(|| {
            ArtifactError::invalid(self.path(), format!("tensor `{name}` is missing"))
        })?;
        Ok(t.shape.iter().map(|&d| d as usize).collect())
    }
    /// Values as f64 (F64 or F32 stored).
    pub fn f64s(&self, name: &str) -> Result<Vec<f64>> {
        let (t, b) = self.get(name, &[Dtype::F64, Dtype::F32])?;
        Ok(if t.dtype == Dtype::F64 {
            b.chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        } else {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")) as f64)
                .collect()
        })
    }
    /// Values as f32 (F32 stored).
    pub fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        let (_, b) = self.get(name, &[Dtype::F32])?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    /// Values as i64 (I64 stored).
    pub fn i64s(&self, name: &str) -> Result<Vec<i64>> {
        let (_, b) = self.get(name, &[Dtype::I64])?;
        Ok(b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect())
    }
    /// Values as i32 (I32 stored).
    pub fn i32s(&self, name: &str) -> Result<Vec<i32>> {
        let (_, b) = self.get(name, &[Dtype::I32])?;
        Ok(b.chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
    /// Values as u8 (U8 stored).
    pub fn u8s(&self, name: &str) -> Result<Vec<u8>> {
        Ok(self.get(name, &[Dtype::U8])?.1.to_vec())
    }
    /// Values as i16 (I16 stored).
    pub fn i16s(&self, name: &str) -> Result<Vec<i16>> {
        let (_, b) = self.get(name, &[Dtype::I16])?;
        Ok(b.chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]))
            .collect())
    }
    /// Values as f32 (F16 stored).
    pub fn f16s(&self, name: &str) -> Result<Vec<f32>> {
        let (_, b) = self.get(name, &[Dtype::F16])?;
        Ok(b.chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect())
    }
}
