//! The incoherence marker of a quantized checkpoint: which weights were stored rotated by
//! seeded random-sign Hadamard transforms, and their seeds and block sizes that undo them.
//!
//! What it is: the `incoherence` object of `config.json`'s `keep_quantization` entry (written
//! by `keep quant --incoherence on`), one entry per weight base name (`layers.L.ffn.experts.E.w1`,
//! the keys of the entry's `tensors` map):
//!
//! ```json
//! "incoherence": { "layers.0.ffn.experts.3.w1":
//!     { "kind": "rht", "seed_in": 17, "block_in": 256, "seed_out": 18, "block_out": 128 } }
//! ```
//!
//! The stored weight is `W̃ = V_out · W · V_inᵀ` with `V = H_B · S` (`S` the ±1 diagonal drawn
//! from its seed, `H_B` block-diagonal normalised Walsh–Hadamard with blocks of `B`; keep-kernels'
//! `hadamard::Rht` defines both), so `y = V_outᵀ · W̃ · (V_in · x)`. [`read`] parses and checks
//! the object (known kind, power-of-two blocks); whether a block divides the weight's size is
//! checked where the weight's shape is known (keep-model). What it is not: the transform itself
//! (keep-kernels) or where it is applied (keep-model's expert products).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::DeepSeekConfig;

/// The config key of the quantization entry that holds the marker.
pub const QUANT_KEY: &str = "keep_quantization";
/// `format` of that entry (and of `keep quant`'s report).
pub const QUANT_FORMAT: &str = "keep-quant";
/// The newest version of that entry this keep reads: a newer one may describe weights this
/// keep would compute wrongly (a transform it does not know), so it is refused, never ignored.
pub const QUANT_VERSION: u32 = 1;
/// The marker's key inside it.
pub const INCOHERENCE_KEY: &str = "incoherence";
/// The one transform kind: random signs then a block-diagonal normalised Hadamard.
pub const KIND_RHT: &str = "rht";

/// The two transforms of one stored weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Incoherence {
    /// Transform kind (only [`KIND_RHT`]).
    pub kind: TransformKind,
    /// Seed of the input side's sign diagonal (`V_in`, size = the weight's columns).
    pub seed_in: u64,
    /// Hadamard block of the input side.
    pub block_in: usize,
    /// Seed of the output side's sign diagonal (`V_out`, size = the weight's rows).
    pub seed_out: u64,
    /// Hadamard block of the output side.
    pub block_out: usize,
}

/// The transform kind, a string in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransformKind {
    /// [`KIND_RHT`].
    #[serde(rename = "rht")]
    Rht,
}

/// The marker of `cfg` (empty when the checkpoint has none): base name → transforms. A
/// malformed marker is an error naming the weight, never ignored (a rotated weight computed
/// without its transforms would be silently wrong).
pub fn read(cfg: &DeepSeekConfig) -> Result<BTreeMap<String, Incoherence>, String> {
    if let Some(q) = cfg.raw.get(QUANT_KEY) {
        check_entry(q)?;
    }
    let Some(v) = cfg.raw.get(QUANT_KEY).and_then(|q| q.get(INCOHERENCE_KEY)) else {
        return Ok(BTreeMap::new());
    };
    let m: BTreeMap<String, Incoherence> = serde_json::from_value(v.clone())
        .map_err(|e| format!("{QUANT_KEY}.{INCOHERENCE_KEY}: {e}"))?;
    for (name, t) in &m {
        for (side, b) in [("block_in", t.block_in), ("block_out", t.block_out)] {
            if b == 0 || !b.is_power_of_two() {
                return Err(format!(
                    "{QUANT_KEY}.{INCOHERENCE_KEY}.{name}: {side} {b} is not a power of two"
                ));
            }
        }
    }
    Ok(m)
}

/// The entry's `format` and `version`, when present, must be ones this keep reads.
fn check_entry(q: &serde_json::Value) -> Result<(), String> {
    if let Some(f) = q.get("format") {
        if f.as_str() != Some(QUANT_FORMAT) {
            return Err(format!(
                "{QUANT_KEY}.format is {f}, not \"{QUANT_FORMAT}\": this checkpoint was not \
                 quantized by keep, or its entry is damaged"
            ));
        }
    }
    if let Some(v) = q.get("version") {
        match v.as_u64() {
            Some(n) if n <= u64::from(QUANT_VERSION) => {}
            Some(n) => {
                return Err(format!(
                    "{QUANT_KEY}.version is {n}: written by a newer keep (this one reads \
                     version {QUANT_VERSION} at most); upgrade keep to run it"
                ))
            }
            None => return Err(format!("{QUANT_KEY}.version is {v}, not a version number")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The bundled model's config with `keep_quantization` set to `entry` (JSON text).
    fn cfg(entry: Option<&str>) -> DeepSeekConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/keep-tiny");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if let Some(e) = entry {
            v[QUANT_KEY] = serde_json::from_str(e).unwrap();
        }
        DeepSeekConfig::from_json(Path::new("config.json"), &v.to_string()).unwrap()
    }

    #[test]
    fn absent_marker_is_empty() {
        assert!(read(&cfg(None)).unwrap().is_empty());
        let c = cfg(Some(r#"{"format":"keep-quant","tensors":{}}"#));
        assert!(read(&c).unwrap().is_empty());
    }

    #[test]
    fn marker_round_trips() {
        let c = cfg(Some(
            r#"{"incoherence":{"layers.0.ffn.experts.1.w2":
            {"kind":"rht","seed_in":5,"block_in":16,"seed_out":6,"block_out":32}}}"#,
        ));
        let m = read(&c).unwrap();
        let t = m["layers.0.ffn.experts.1.w2"];
        assert_eq!(
            (t.seed_in, t.block_in, t.seed_out, t.block_out),
            (5, 16, 6, 32)
        );
        assert_eq!(t.kind, TransformKind::Rht);
    }

    #[test]
    fn newer_or_foreign_entries_are_refused() {
        let ok = cfg(Some(r#"{"format":"keep-quant","version":1,"tensors":{}}"#));
        assert!(read(&ok).is_ok());
        for bad in [
            r#"{"format":"keep-quant","version":2,"tensors":{}}"#,
            r#"{"format":"keep-quant","version":"1","tensors":{}}"#,
            r#"{"format":"other","version":1,"tensors":{}}"#,
        ] {
            let err = read(&cfg(Some(bad))).unwrap_err();
            assert!(err.contains(QUANT_KEY), "{bad}: {err}");
        }
        let newer = read(&cfg(Some(r#"{"format":"keep-quant","version":2}"#))).unwrap_err();
        assert!(newer.contains("newer keep"), "{newer}");
    }

    #[test]
    fn malformed_markers_are_refused() {
        for bad in [
            r#"{"w":{"kind":"other","seed_in":5,"block_in":16,"seed_out":6,"block_out":32}}"#,
            r#"{"w":{"kind":"rht","seed_in":5,"block_in":12,"seed_out":6,"block_out":32}}"#,
            r#"{"w":{"kind":"rht","seed_in":5,"block_in":16,"seed_out":6,"block_out":0}}"#,
            r#"{"w":{"kind":"rht","seed_in":5,"block_in":16}}"#,
            r#"{"w":{"kind":"rht","seed_in":5,"block_in":16,"seed_out":6,"block_out":32,"x":1}}"#,
            r#"[1]"#,
        ] {
            let c = cfg(Some(&format!(r#"{{"incoherence":{bad}}}"#)));
            assert!(read(&c).is_err(), "{bad}");
        }
    }
}
