//! `model.safetensors.index.json`: which shard holds each tensor.
//!
//! Layout (Hugging Face's): `{"metadata": {"total_size": N, ...}, "weight_map": {name: file}}`.
//! Shard names are checked to be plain file names (no directories, no `..`), so that an index
//! can never point outside its checkpoint.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::{CheckpointError, Result};

/// The index's file name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A parsed index.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Index {
    /// Tensor name → shard file name.
    pub weight_map: BTreeMap<String, String>,
    /// `metadata.total_size`, if present.
    pub total_size: Option<u64>,
}

impl Index {
    /// Parse an index from JSON text.
    pub fn parse(path: &Path, text: &str) -> Result<Index> {
        let ierr = |msg: String| CheckpointError::Index {
            path: path.to_path_buf(),
            msg,
        };
        let v: Value = serde_json::from_str(text).map_err(|e| ierr(format!("not JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ierr("no `weight_map` object".into()))?;
        let mut weight_map = BTreeMap::new();
        for (k, f) in map {
            let f = f
                .as_str()
                .ok_or_else(|| ierr(format!("shard of `{k}` is not a string")))?;
            if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
                return Err(ierr(format!(
                    "shard `{f}` of `{k}` is not a plain file name"
                )));
            }
            weight_map.insert(k.clone(), f.to_string());
        }
        let total_size = v
            .get("metadata")
            .and_then(|m| m.get("total_size"))
            .and_then(Value::as_u64);
        Ok(Index {
            weight_map,
            total_size,
        })
    }

    /// Read an index file.
    pub fn read(path: &Path) -> Result<Index> {
        let text = crate::small_file::read_text(path, crate::small_file::MAX_SMALL_FILE)?;
        Index::parse(path, &text)
    }

    /// The shard file names, sorted and deduplicated.
    pub fn shards(&self) -> Vec<String> {
        let mut v: Vec<String> = self.weight_map.values().cloned().collect();
        v.sort();
        v.dedup();
        v
    }

    /// Serialise as Hugging Face writes it.
    pub fn to_json(&self) -> Value {
        json!({
            "metadata": {"total_size": self.total_size.unwrap_or(0)},
            "weight_map": self.weight_map,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_refuse() {
        let p = Path::new("i.json");
        let i = Index::parse(
            p,
            r#"{"metadata":{"total_size":10},"weight_map":{"a":"s1.safetensors","b":"s1.safetensors","c":"s2.safetensors"}}"#,
        )
        .unwrap();
        assert_eq!(i.shards(), vec!["s1.safetensors", "s2.safetensors"]);
        assert_eq!(i.total_size, Some(10));
        for bad in [
            "{}",
            r#"{"weight_map":{"a":1}}"#,
            r#"{"weight_map":{"a":"../x.safetensors"}}"#,
            "nope",
        ] {
            assert!(Index::parse(p, bad).is_err(), "{bad}");
        }
    }
}
