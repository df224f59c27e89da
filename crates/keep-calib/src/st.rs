//! Small safetensors helpers: build a file from owned tensors and write it atomically (a hidden
//! temporary sibling, `fsync`, rename), and typed reads of tensors and metadata from a file
//! opened with keep-checkpoint's hostile-input parser.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use keep_checkpoint::{Dtype, ShardFile, TensorInfo};

use crate::{CalibError, Result};

/// An owned tensor to write.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    pub fn f64(name: impl Into<String>, shape: Vec<usize>, v: &[f64]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::F64,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, v: &[f32]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::F32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn i64(name: impl Into<String>, shape: Vec<usize>, v: &[i64]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::I64,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn i32(name: impl Into<String>, shape: Vec<usize>, v: &[i32]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::I32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn i16(name: impl Into<String>, shape: Vec<usize>, v: &[i16]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::I16,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    pub fn f16(name: impl Into<String>, shape: Vec<usize>, v: &[half::f16]) -> Tensor {
        Tensor {
            name: name.into(),
            dtype: safetensors::Dtype::F16,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Serialize `tensors` with `metadata` and write them to `path` atomically: the bytes go to
/// `.<name>.tmp-<pid>` beside it, are synced, and the file is renamed over `path` (an existing
/// `path` only if `force`; a `path` that is not a regular file never).
pub fn write_atomic(
    path: &Path,
    tensors: &[Tensor],
    metadata: &BTreeMap<String, String>,
    force: bool,
) -> Result<()> {
    let bytes = serialize(path, tensors, metadata)?;
    write_bytes_atomic(path, &bytes, force)
}

fn dtype_name(d: safetensors::Dtype) -> Option<(&'static str, usize)> {
    use safetensors::Dtype as D;
    Some(match d {
        D::I16 => ("I16", 2),
        D::F16 => ("F16", 2),
        D::I32 => ("I32", 4),
        D::F32 => ("F32", 4),
        D::I64 => ("I64", 8),
        D::F64 => ("F64", 8),
        D::U8 => ("U8", 1),
        _ => return None,
    })
}

/// The safetensors bytes of `tensors` with `metadata`, deterministic: `__metadata__` first
/// with sorted keys, then tensors in name order, data in the same order, the header padded
/// with spaces to a multiple of 8 bytes.
pub fn serialize(
    path: &Path,
    tensors: &[Tensor],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let q = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let mut order: Vec<&Tensor> = tensors.iter().collect();
    order.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = order.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(CalibError::invalid(
            path,
            format!("tensor `{}` given twice", w[0].name),
        ));
    }
    let mut h = String::from("{");
    h += "\"__metadata__\":{";
    h += &metadata
        .iter()
        .map(|(k, v)| format!("{}:{}", q(k), q(v)))
        .collect::<Vec<_>>()
        .join(",");
    h += "}";
    let mut off = 0usize;
    for t in &order {
        let Some((dn, size)) = dtype_name(t.dtype) else {
            return Err(CalibError::invalid(
                path,
                format!("tensor `{}`: unsupported dtype", t.name),
            ));
        };
        let n: usize = t.shape.iter().product();
        if n * size != t.data.len() {
            return Err(CalibError::invalid(
                path,
                format!(
                    "tensor `{}`: {} bytes for shape {:?} of {dn}",
                    t.name,
                    t.data.len(),
                    t.shape
                ),
            ));
        }
        let shape = t
            .shape
            .iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",");
        h += &format!(
            ",{}:{{\"dtype\":\"{dn}\",\"shape\":[{shape}],\"data_offsets\":[{off},{}]}}",
            q(&t.name),
            off + t.data.len()
        );
        off += t.data.len();
    }
    h += "}";
    while h.len() % 8 != 0 {
        h.push(' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    for t in &order {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Write bytes to `path` through a synced temporary sibling and a rename
/// ([`keep_checkpoint::atomic::write_file`]); an existing `path` is refused unless `force`.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8], force: bool) -> Result<()> {
    Ok(keep_checkpoint::atomic::write_file(path, bytes, force)?)
}

/// Remove temporary siblings in `dir` left by processes that no longer run.
pub fn remove_stale_tmp(dir: &Path) {
    keep_checkpoint::atomic::remove_stale_tmp(dir)
}

/// A safetensors file opened for typed reads.
pub struct StFile {
    pub file: ShardFile,
    by_name: HashMap<String, usize>,
}

impl StFile {
    /// Open and parse (bounded header, checked offsets: a cut-off file is an error here).
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
    pub fn path(&self) -> &Path {
        self.file.path()
    }
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.file.header().metadata
    }
    /// A metadata value, or an error naming the key.
    pub fn meta(&self, key: &str) -> Result<&str> {
        self.metadata()
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| CalibError::invalid(self.path(), format!("metadata `{key}` is missing")))
    }
    /// A whole-number metadata value.
    pub fn meta_usize(&self, key: &str) -> Result<usize> {
        let v = self.meta(key)?;
        v.parse().map_err(|_| {
            CalibError::invalid(
                self.path(),
                format!("metadata `{key}` = `{v}` is not a whole number"),
            )
        })
    }
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.file.header().tensors
    }
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.file.header().tensors[i])
    }
    pub fn has(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }
    fn get(&self, name: &str, dtypes: &[Dtype]) -> Result<(&TensorInfo, &[u8])> {
        let t = self.info(name).ok_or_else(|| {
            CalibError::invalid(self.path(), format!("tensor `{name}` is missing"))
        })?;
        if !dtypes.contains(&t.dtype) {
            return Err(CalibError::invalid(
                self.path(),
                format!("tensor `{name}` is {}, expected one of {dtypes:?}", t.dtype),
            ));
        }
        Ok((t, self.file.data(t)))
    }
    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let t = self.info(name).ok_or_else(|| {
            CalibError::invalid(self.path(), format!("tensor `{name}` is missing"))
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
