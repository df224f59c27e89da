//! One safetensors file: a hostile-input header parser and a zero-copy, memory-mapped view.
//!
//! Layout (the format's own definition): 8 bytes little-endian `u64` N, then N bytes of UTF-8
//! JSON mapping each tensor name to `{"dtype", "shape", "data_offsets": [start, end]}` (offsets
//! relative to the byte after the header) plus an optional `"__metadata__"` string map, then the
//! data. The parser bounds the header ([`MAX_HEADER_BYTES`] and the file's size), refuses duplicate
//! names, unknown dtypes, offsets out of range or overlapping, and shapes whose bytes do not match
//! their offsets; every error names the file and the tensor. We parse ourselves instead of through
//! the `safetensors` crate because that crate keeps the last of two duplicate names silently and
//! its errors do not name the file; tests check that both agree on well-formed files.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::{Deserializer, MapAccess, Visitor};
use serde_json::Value;

use crate::{CheckpointError, Dtype, Result};

/// The largest header keep accepts (the reference implementation's own bound).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One tensor's entry in a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Start of the data, relative to the data section.
    pub start: u64,
    /// End (exclusive) of the data, relative to the data section.
    pub end: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Bytes of data.
    pub fn nbytes(&self) -> u64 {
        self.end - self.start
    }
}

/// A parsed header.
#[derive(Debug, Clone)]
pub struct Header {
    /// Tensors in the order of their data offsets.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map, if any.
    pub metadata: BTreeMap<String, String>,
    /// Absolute offset of the data section in the file (8 + header length).
    pub data_start: u64,
}

/// Top-level JSON entries in file order, so that duplicates can be seen.
struct Entries(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Value>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Parse a header's JSON bytes. `data_len` is the size of the data section (file size minus
/// 8 minus the header), against which every offset is checked.
pub fn parse_header(path: &Path, json: &[u8], data_start: u64, data_len: u64) -> Result<Header> {
    let herr = |msg: String| CheckpointError::Header {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::str::from_utf8(json).map_err(|e| {
        herr(format!(
            "header is not valid UTF-8 (byte {} of the header)",
            e.valid_up_to()
        ))
    })?;
    let entries: Entries = serde_json::from_str(text)
        .map_err(|e| herr(format!("header is not a JSON object: {e}")))?;
    let mut seen = std::collections::HashSet::new();
    let mut tensors = Vec::with_capacity(entries.0.len());
    let mut metadata = BTreeMap::new();
    for (name, value) in entries.0 {
        if !seen.insert(name.clone()) {
            return Err(CheckpointError::Tensor {
                path: path.to_path_buf(),
                tensor: name,
                msg: "name appears twice in the header".into(),
            });
        }
        if name == "__metadata__" {
            let obj = value
                .as_object()
                .ok_or_else(|| herr("__metadata__ is not an object".into()))?;
            for (k, v) in obj {
                let s = v
                    .as_str()
                    .ok_or_else(|| herr(format!("__metadata__ value of `{k}` is not a string")))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        tensors.push(parse_entry(path, name, &value, data_len)?);
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    let mut prev: Option<&TensorInfo> = None;
    for t in tensors.iter().filter(|t| t.end > t.start) {
        if let Some(p) = prev {
            if t.start < p.end {
                return Err(CheckpointError::Tensor {
                    path: path.to_path_buf(),
                    tensor: t.name.clone(),
                    msg: format!(
                        "data [{}, {}) overlaps tensor `{}` [{}, {})",
                        t.start, t.end, p.name, p.start, p.end
                    ),
                });
            }
        }
        prev = Some(t);
    }
    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

fn parse_entry(path: &Path, name: String, value: &Value, data_len: u64) -> Result<TensorInfo> {
    let terr = |msg: String| CheckpointError::Tensor {
        path: path.to_path_buf(),
        tensor: name.clone(),
        msg,
    };
    let obj = value
        .as_object()
        .ok_or_else(|| terr("entry is not an object".into()))?;
    for k in obj.keys() {
        if !matches!(k.as_str(), "dtype" | "shape" | "data_offsets") {
            return Err(terr(format!("unexpected field `{k}`")));
        }
    }
    let dtype_s = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| terr("missing or non-string `dtype`".into()))?;
    let dtype = Dtype::parse(dtype_s).ok_or_else(|| terr(format!("unknown dtype `{dtype_s}`")))?;
    let shape_v = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| terr("missing or non-array `shape`".into()))?;
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        shape.push(
            d.as_u64()
                .ok_or_else(|| terr(format!("shape entry {d} is not a non-negative integer")))?,
        );
    }
    let offs = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| terr("missing or non-array `data_offsets`".into()))?;
    if offs.len() != 2 {
        return Err(terr("`data_offsets` must have two entries".into()));
    }
    let start = offs[0]
        .as_u64()
        .ok_or_else(|| terr("data offset is not a non-negative integer".into()))?;
    let end = offs[1]
        .as_u64()
        .ok_or_else(|| terr("data offset is not a non-negative integer".into()))?;
    if start > end {
        return Err(terr(format!("data offsets [{start}, {end}) are reversed")));
    }
    if end > data_len {
        return Err(terr(format!(
            "data [{start}, {end}) runs past the end of the data section ({data_len} bytes): the file is truncated or the header is wrong"
        )));
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| terr(format!("shape {shape:?} overflows")))?;
    let expect = dtype.bytes_for(numel).ok_or_else(|| {
        terr(format!(
            "{numel} elements of {dtype} do not fill whole bytes"
        ))
    })?;
    if expect != end - start {
        return Err(terr(format!(
            "shape {shape:?} of {dtype} needs {expect} bytes but its offsets give {}",
            end - start
        )));
    }
    Ok(TensorInfo {
        name,
        dtype,
        shape,
        start,
        end,
    })
}

/// Read and parse the header of the safetensors file at `path` without mapping it.
pub fn read_header(path: &Path) -> Result<(Header, u64)> {
    let mut f = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
    let file_len = f
        .metadata()
        .map_err(|e| CheckpointError::io(path, e))?
        .len();
    let herr = |msg: String| CheckpointError::Header {
        path: path.to_path_buf(),
        msg,
    };
    if file_len < 8 {
        return Err(herr(format!(
            "file has {file_len} bytes, fewer than the 8-byte header length"
        )));
    }
    let mut lenb = [0u8; 8];
    f.read_exact(&mut lenb)
        .map_err(|e| CheckpointError::io(path, e))?;
    let n = u64::from_le_bytes(lenb);
    if n > MAX_HEADER_BYTES {
        return Err(herr(format!(
            "header claims {n} bytes, more than the {MAX_HEADER_BYTES}-byte limit"
        )));
    }
    if n > file_len - 8 {
        return Err(herr(format!(
            "header claims {n} bytes but the file has only {} after the length: truncated?",
            file_len - 8
        )));
    }
    let mut json = vec![0u8; n as usize];
    f.read_exact(&mut json)
        .map_err(|e| CheckpointError::io(path, e))?;
    let data_start = 8 + n;
    let header = parse_header(path, &json, data_start, file_len - data_start)?;
    Ok((header, file_len))
}

/// A memory-mapped safetensors file.
pub struct ShardFile {
    path: PathBuf,
    header: Header,
    mmap: Option<memmap2::Mmap>,
    len: u64,
}

impl std::fmt::Debug for ShardFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardFile")
            .field("path", &self.path)
            .field("tensors", &self.header.tensors.len())
            .field("len", &self.len)
            .finish()
    }
}

impl ShardFile {
    /// Open, parse and map a file. The mapping is read-only; keep assumes the files are not
    /// changed while it runs (as every mmap-based loader does).
    pub fn open(path: &Path) -> Result<ShardFile> {
        let (header, len) = read_header(path)?;
        let f = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
        // SAFETY: read-only map of a file we do not modify; see the doc comment above.
        let mmap = if len > 0 {
            Some(unsafe { memmap2::Mmap::map(&f) }.map_err(|e| CheckpointError::io(path, e))?)
        } else {
            None
        };
        Ok(ShardFile {
            path: path.to_path_buf(),
            header,
            mmap,
            len,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The parsed header.
    pub fn header(&self) -> &Header {
        &self.header
    }
    /// The file's size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether the file is empty (never true for a file that parsed).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The bytes of one tensor (zero-copy).
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        let a = (self.header.data_start + t.start) as usize;
        let b = (self.header.data_start + t.end) as usize;
        match &self.mmap {
            Some(m) => &m[a..b],
            None => &[],
        }
    }
    /// Absolute byte offset of a tensor's data in the file.
    pub fn file_offset(&self, t: &TensorInfo) -> u64 {
        self.header.data_start + t.start
    }
    /// Tell the kernel the file will be read front to back (larger readahead); advisory, so
    /// a failure is ignored.
    pub fn advise_sequential(&self) {
        if let Some(m) = &self.mmap {
            let _ = m.advise(memmap2::Advice::Sequential);
        }
    }
    /// Ask the kernel to start reading `len` bytes at file offset `offset` now (asynchronous
    /// readahead), so that a later copy of them does not wait on the disk; advisory.
    pub fn advise_willneed(&self, offset: u64, len: usize) {
        if let Some(m) = &self.mmap {
            let off = offset as usize;
            if len > 0 && off < m.len() {
                let _ = m.advise_range(memmap2::Advice::WillNeed, off, len.min(m.len() - off));
            }
        }
    }
    /// Fault the whole mapping in now (`madvise(MADV_POPULATE_READ)`, reading from disk what
    /// the page cache lacks), as llama.cpp's loader does with `MAP_POPULATE`: the first
    /// forward then reads weights from memory instead of taking a page fault per 4 KiB the
    /// first time each is touched. Advisory: false where the kernel refuses (before Linux
    /// 5.14, or not Linux).
    pub fn populate(&self) -> bool {
        match &self.mmap {
            #[cfg(target_os = "linux")]
            Some(m) => m.advise(memmap2::Advice::PopulateRead).is_ok(),
            _ => false,
        }
    }
    /// The whole mapping, for advice calls (`madvise`) by callers that stream layers.
    pub fn mapping(&self) -> Option<&memmap2::Mmap> {
        self.mmap.as_ref()
    }
}
