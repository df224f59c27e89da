//! The one writer of single safetensors files: every file keep writes for itself (calibration
//! sessions, `imatrix.safetensors`, `reap-stats.safetensors`, route traces, `keep logits`)
//! goes through [`write`], and every shard of a checkpoint gets its header from [`header`], so
//! there is one definition of the bytes keep writes.
//!
//! Layout: 8 bytes little-endian header length N, N bytes of compact JSON padded with spaces to
//! a multiple of 8, then the tensors' bytes in the order the caller gives them. The JSON lists
//! its keys in one of two [`KeyOrder`]s, each fixed for a family of keep's files (so a writer
//! through here writes the same bytes as the format defines): checkpoint shards
//! and route traces list every key in byte order ([`KeyOrder::Sorted`]); calibration files and
//! `keep logits` list `__metadata__` first and the tensors in the order given
//! ([`KeyOrder::Listed`], the order the safetensors crate's serializer writes). Metadata is an
//! ordered list of pairs (not a map), so a caller states the order it writes; `__metadata__` is
//! omitted when the list is empty.
//!
//! [`write`] builds the file in a hidden temporary sibling, syncs it and renames it into place
//! ([`crate::atomic`]): an existing target is refused unless `force`, a target that is not a
//! regular file always, and on any error the target is left as it was.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;

use crate::atomic::{check_file_target, place_file, tmp_sibling};
use crate::{CheckpointError, Dtype, Result, TensorMeta};

/// An owned tensor to write: its name, dtype, shape and little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub meta: TensorMeta,
    pub data: Vec<u8>,
}

macro_rules! typed {
    ($(#[$doc:meta] $fn:ident, $t:ty, $dt:expr;)*) => {$(
        #[$doc]
        pub fn $fn(name: impl Into<String>, shape: &[usize], v: &[$t]) -> Tensor {
            Tensor::new(name, $dt, shape, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    )*};
}

impl Tensor {
    /// A tensor from raw little-endian bytes (checked against the shape by [`serialize`] and
    /// [`write`]).
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Tensor {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        Tensor {
            meta: TensorMeta::new(name, dtype, &shape),
            data,
        }
    }
    typed! {
        /// An F64 tensor.
        f64, f64, Dtype::F64;
        /// An F32 tensor.
        f32, f32, Dtype::F32;
        /// An I64 tensor.
        i64, i64, Dtype::I64;
        /// An I32 tensor.
        i32, i32, Dtype::I32;
        /// An I16 tensor.
        i16, i16, Dtype::I16;
        /// An F16 tensor.
        f16, half::f16, Dtype::F16;
        /// A U8 tensor.
        u8, u8, Dtype::U8;
    }
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.meta.name
    }
}

/// How the header's JSON lists its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrder {
    /// Every key in byte order, at both levels: `__metadata__` among the tensor names, its own
    /// keys sorted, and each tensor's entry as `data_offsets`, `dtype`, `shape`. Checkpoint
    /// shards and route traces.
    Sorted,
    /// `__metadata__` first with its keys in the order given, then the tensors in the order
    /// given (which is also the order of their data), each entry as `dtype`, `shape`,
    /// `data_offsets`. Calibration files and `keep logits`.
    Listed,
}

/// `metadata` as the ordered pairs the writer takes, from any map or list of string pairs
/// (a `BTreeMap` gives its keys in byte order).
pub fn pairs<'a>(
    metadata: impl IntoIterator<Item = (&'a String, &'a String)>,
) -> Vec<(String, String)> {
    metadata
        .into_iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn quote(s: &str) -> String {
    // A JSON string of a Rust string cannot fail to serialize.
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

fn list(v: impl IntoIterator<Item = u64>) -> String {
    v.into_iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The header (length prefix included) of a file holding `tensors`, whose data follow in this
/// order, with `metadata`, its keys listed in `order`. Refuses a duplicate tensor name or
/// metadata key, a tensor named `__metadata__`, and a shape whose elements do not fill whole
/// bytes.
pub fn header(
    metadata: &[(String, String)],
    tensors: &[TensorMeta],
    order: KeyOrder,
) -> Result<Vec<u8>> {
    let mut keys = BTreeSet::new();
    for (k, _) in metadata {
        if !keys.insert(k.as_str()) {
            return Err(CheckpointError::Writer(format!(
                "metadata key `{k}` given twice"
            )));
        }
    }
    let mut names = BTreeSet::new();
    let mut entries = Vec::with_capacity(tensors.len() + 1);
    let mut off = 0u64;
    for t in tensors {
        let n: u64 = t.shape.iter().product();
        if t.dtype.bytes_for(n).is_none() {
            return Err(CheckpointError::Writer(format!(
                "tensor `{}`: {n} elements of {} do not fill whole bytes",
                t.name, t.dtype
            )));
        }
        if t.name == "__metadata__" || !names.insert(t.name.as_str()) {
            return Err(CheckpointError::Writer(format!(
                "tensor `{}` declared twice (or named like the metadata)",
                t.name
            )));
        }
        let end = off + t.nbytes();
        let (dtype, shape, offsets) = (
            quote(t.dtype.name()),
            list(t.shape.iter().copied()),
            list([off, end]),
        );
        let entry = match order {
            KeyOrder::Sorted => {
                format!("{{\"data_offsets\":[{offsets}],\"dtype\":{dtype},\"shape\":[{shape}]}}")
            }
            KeyOrder::Listed => {
                format!("{{\"dtype\":{dtype},\"shape\":[{shape}],\"data_offsets\":[{offsets}]}}")
            }
        };
        entries.push((t.name.as_str(), entry));
        off = end;
    }
    if !metadata.is_empty() {
        let mut m: Vec<&(String, String)> = metadata.iter().collect();
        if order == KeyOrder::Sorted {
            m.sort_by(|a, b| a.0.cmp(&b.0));
        }
        let body = m
            .iter()
            .map(|(k, v)| format!("{}:{}", quote(k), quote(v)))
            .collect::<Vec<_>>()
            .join(",");
        entries.insert(0, ("__metadata__", format!("{{{body}}}")));
    }
    if order == KeyOrder::Sorted {
        entries.sort_by(|a, b| a.0.cmp(b.0));
    }
    let mut json = String::from("{");
    json += &entries
        .iter()
        .map(|(k, v)| format!("{}:{v}", quote(k)))
        .collect::<Vec<_>>()
        .join(",");
    json.push('}');
    let mut json = json.into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

fn check_sizes(tensors: &[Tensor]) -> Result<Vec<TensorMeta>> {
    tensors
        .iter()
        .map(|t| {
            if t.meta.nbytes() != t.data.len() as u64 {
                return Err(CheckpointError::Writer(format!(
                    "tensor `{}`: {} bytes for shape {:?} of {}",
                    t.meta.name,
                    t.data.len(),
                    t.meta.shape,
                    t.meta.dtype
                )));
            }
            Ok(t.meta.clone())
        })
        .collect()
}

/// The bytes of a file holding `tensors` (data in this order) with `metadata`.
pub fn serialize(
    tensors: &[Tensor],
    metadata: &[(String, String)],
    order: KeyOrder,
) -> Result<Vec<u8>> {
    let metas = check_sizes(tensors)?;
    let mut out = header(metadata, &metas, order)?;
    out.reserve(tensors.iter().map(|t| t.data.len()).sum());
    for t in tensors {
        out.extend_from_slice(&t.data);
    }
    Ok(out)
}

/// Write `tensors` (data in this order) with `metadata` to `path` through a synced temporary
/// sibling and a rename. An existing `path` is refused unless `force`; a `path` that is not a
/// regular file is refused always; on any error `path` is left as it was and the temporary
/// file removed.
pub fn write(
    path: &Path,
    tensors: &[Tensor],
    metadata: &[(String, String)],
    order: KeyOrder,
    force: bool,
) -> Result<()> {
    let metas = check_sizes(tensors)?;
    let head = header(metadata, &metas, order)?;
    check_file_target(path, force)?;
    let tmp = tmp_sibling(path);
    let res = (|| -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(&head)?;
        for t in tensors {
            f.write_all(&t.data)?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(CheckpointError::io(path, e));
    }
    place_file(&tmp, path, force)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ShardFile;

    fn sample() -> (Vec<Tensor>, Vec<(String, String)>) {
        let t = vec![
            Tensor::f64("reap.1.score", &[3], &[0.5, -2.0, 1e300]),
            Tensor::i16("routes.10.experts", &[2, 2], &[1, 2, 3, -4]),
            Tensor::f16(
                "routes.2.weights",
                &[1, 2],
                &[half::f16::from_f32(0.5), half::f16::from_f32(-1.0)],
            ),
            Tensor::u8("empty", &[0], &[]),
            Tensor::i64("Count", &[1], &[7]),
        ];
        let m = vec![
            ("version".to_string(), "1".to_string()),
            ("format".to_string(), "keep-test \"quoted\"".to_string()),
        ];
        (t, m)
    }

    #[test]
    fn round_trips_through_the_reader_in_the_given_order() {
        let d = tempfile::tempdir().unwrap();
        for order in [KeyOrder::Sorted, KeyOrder::Listed] {
            let p = d.path().join(format!("{order:?}.safetensors"));
            let (t, m) = sample();
            write(&p, &t, &m, order, false).unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(bytes, serialize(&t, &m, order).unwrap());
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            assert_eq!(n % 8, 0);
            let f = ShardFile::open(&p).unwrap();
            assert_eq!(f.header().metadata, m.iter().cloned().collect());
            let mut prev_end = 0;
            for want in &t {
                let got = f
                    .header()
                    .tensors
                    .iter()
                    .find(|i| i.name == want.meta.name)
                    .unwrap();
                assert_eq!((got.dtype, &got.shape), (want.meta.dtype, &want.meta.shape));
                assert_eq!(got.start, prev_end, "data in the given order");
                prev_end = got.end;
                assert_eq!(f.data(got), &want.data[..]);
            }
            // The format's own crate reads it too.
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            assert_eq!(st.len(), t.len());
            let v = st.tensor("routes.10.experts").unwrap();
            assert_eq!(v.data(), &t[1].data[..]);
        }
    }

    /// The JSON a serde_json map (sorted keys) writes: the checkpoint shards' header.
    fn serde_sorted(m: &[(String, String)], t: &[TensorMeta]) -> Vec<u8> {
        let mut h = serde_json::Map::new();
        h.insert(
            "__metadata__".into(),
            serde_json::Value::Object(
                m.iter()
                    .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                    .collect(),
            ),
        );
        let mut off = 0;
        for t in t {
            let end = off + t.nbytes();
            h.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [off, end]}),
            );
            off = end;
        }
        serde_json::to_vec(&h).unwrap()
    }

    #[test]
    fn both_orders_are_the_bytes_keep_has_always_written() {
        let (t, m) = sample();
        let metas: Vec<TensorMeta> = t.iter().map(|t| t.meta.clone()).collect();
        let json = |b: Vec<u8>| {
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            String::from_utf8(b[8..8 + n].to_vec())
                .unwrap()
                .trim_end()
                .to_string()
        };
        // Sorted: what serde_json writes for a map without `preserve_order`.
        let got = json(header(&m, &metas, KeyOrder::Sorted).unwrap());
        assert_eq!(got.as_bytes(), &serde_sorted(&m, &metas)[..]);
        assert!(got.starts_with("{\"Count\":{\"data_offsets\":[36,44],\"dtype\":\"I64\""));
        // Listed: what the safetensors crate writes (metadata first, entries dtype-shape-offsets).
        let got = json(header(&m, &metas, KeyOrder::Listed).unwrap());
        assert!(
            got.starts_with(
                "{\"__metadata__\":{\"version\":\"1\",\"format\":\"keep-test \\\"quoted\\\"\"},\
                 \"reap.1.score\":{\"dtype\":\"F64\",\"shape\":[3],\"data_offsets\":[0,24]},"
            ),
            "{got}"
        );
        let views: Vec<(String, safetensors::tensor::TensorView)> = t
            .iter()
            .map(|t| {
                let dt = match t.meta.dtype {
                    Dtype::F64 => safetensors::Dtype::F64,
                    Dtype::I64 => safetensors::Dtype::I64,
                    Dtype::I16 => safetensors::Dtype::I16,
                    Dtype::F16 => safetensors::Dtype::F16,
                    _ => safetensors::Dtype::U8,
                };
                let shape = t.meta.shape.iter().map(|&d| d as usize).collect();
                (
                    t.meta.name.clone(),
                    safetensors::tensor::TensorView::new(dt, shape, &t.data).unwrap(),
                )
            })
            .collect();
        // The crate orders tensors by descending dtype, then name; given in that order and
        // with one metadata key (its map's order is not fixed), the bytes agree exactly.
        let mut by_crate: Vec<&Tensor> = t.iter().collect();
        by_crate.sort_by_key(|t| {
            let rank = match t.meta.dtype {
                Dtype::I64 => 0,
                Dtype::F64 => 1,
                Dtype::F16 => 2,
                Dtype::I16 => 3,
                _ => 4,
            };
            (rank, t.meta.name.clone())
        });
        let ordered: Vec<Tensor> = by_crate.into_iter().cloned().collect();
        let one = vec![("format".to_string(), "keep-test".to_string())];
        let theirs = safetensors::serialize(
            views,
            Some(
                one.iter()
                    .cloned()
                    .collect::<std::collections::HashMap<_, _>>(),
            ),
        )
        .unwrap();
        assert_eq!(serialize(&ordered, &one, KeyOrder::Listed).unwrap(), theirs);
    }

    #[test]
    fn refuses_existing_bad_sizes_and_duplicates() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.safetensors");
        std::fs::write(&p, b"old").unwrap();
        let (t, m) = sample();
        let o = KeyOrder::Listed;
        let e = write(&p, &t, &m, o, false).unwrap_err().to_string();
        assert!(e.contains("already exists"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
        write(&p, &t, &m, o, true).unwrap();
        assert!(ShardFile::open(&p).is_ok());
        let mut bad = t.clone();
        bad[0].data.pop();
        assert!(write(&p, &bad, &m, o, true).is_err());
        let mut dup = t.clone();
        dup.push(t[0].clone());
        let e = serialize(&dup, &m, o).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        let mut dup_meta = m.clone();
        dup_meta.push(m[0].clone());
        let e = serialize(&t, &dup_meta, o).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        // Nothing left behind by the refusals.
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn empty_metadata_is_omitted() {
        for o in [KeyOrder::Sorted, KeyOrder::Listed] {
            let h = header(&[], &[], o).unwrap();
            assert_eq!(&h[8..], b"{}      ");
        }
    }
}
