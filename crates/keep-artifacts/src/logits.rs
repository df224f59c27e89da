//! The `keep logits` output: one forward of a model over a token sequence, in the layout
//! `tools/oracle/model_ref.py` writes for the reference so the two compare directly.
//!
//! Safetensors, `__metadata__` `format` = `keep-logits`, `version` = `1`, `model` (the model
//! directory), `mode` (`prefill` or `decode`), listed in that order. Tensors: `logits` F32
//! `[T, vocab]`; `tokens` I32 `[T]`; optionally `routes` I32 `[layers, T, top_k]` (each layer's
//! chosen experts per token, sorted ascending); optionally the FP8 codes of every layer's
//! window KV rows, `kv_fp8_codes` U8 `[layers, T, head_dim]` (E4M3 bytes) and
//! `kv_fp8_scale_exp` I32 `[layers, T, head_dim / block]` (each block's power-of-two scale).
//! Header and data list them as the safetensors crate, which wrote this file first, orders
//! tensors — by descending dtype, then name: `logits`, `kv_fp8_scale_exp`, `routes`,
//! `tokens`, `kv_fp8_codes`. Written atomically; an existing file is refused unless `force`.

use std::path::Path;

use keep_checkpoint::tensor_file::{self, KeyOrder, Tensor};

use crate::st::StFile;
use crate::{ArtifactError, Result};

/// `format` of the file.
pub const FORMAT: &str = "keep-logits";
/// `version` of the file.
pub const VERSION: &str = "1";

/// Each layer's chosen experts per token.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsRoutes {
    pub layers: usize,
    pub top_k: usize,
    /// `[layers × T × top_k]`, each token's ids ascending.
    pub experts: Vec<i32>,
}

/// The FP8 codes of every layer's window KV rows.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsKvFp8 {
    pub layers: usize,
    pub head_dim: usize,
    /// Elements per scale block (`head_dim` is a multiple of it).
    pub block: usize,
    /// `[layers × T × head_dim]` E4M3 bytes.
    pub codes: Vec<u8>,
    /// `[layers × T × head_dim / block]` powers of two of the block scales.
    pub scale_exp: Vec<i32>,
}

/// What `keep logits` writes.
#[derive(Debug, Clone, PartialEq)]
pub struct LogitsFile {
    /// The model directory, as given.
    pub model: String,
    /// `prefill` (one forward) or `decode` (one token at a time through the cache).
    pub mode: String,
    pub vocab: usize,
    pub tokens: Vec<i32>,
    /// `[T × vocab]`.
    pub logits: Vec<f32>,
    pub routes: Option<LogitsRoutes>,
    pub kv_fp8: Option<LogitsKvFp8>,
    /// The MTP module's logits, f32 `[T − 1, vocab]` (`mtp_logits`).
    pub mtp_logits: Option<Vec<f32>>,
}

fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl LogitsFile {
    fn check(&self) -> Result<()> {
        let t = self.tokens.len();
        if self.vocab == 0 || Some(self.logits.len()) != product(&[t, self.vocab]) {
            return Err(ArtifactError::Config(format!(
                "logits: {} values are not {t} tokens × vocab {}",
                self.logits.len(),
                self.vocab
            )));
        }
        if let Some(m) = &self.mtp_logits {
            if t < 2 || Some(m.len()) != product(&[t - 1, self.vocab]) {
                return Err(ArtifactError::Config(format!(
                    "logits: {} MTP values are not {t} − 1 tokens × vocab {}",
                    m.len(),
                    self.vocab
                )));
            }
        }
        if let Some(r) = &self.routes {
            if Some(r.experts.len()) != product(&[r.layers, t, r.top_k]) {
                return Err(ArtifactError::Config(format!(
                    "logits: {} route ids are not {} layers × {t} tokens × top-{}",
                    r.experts.len(),
                    r.layers,
                    r.top_k
                )));
            }
        }
        if let Some(k) = &self.kv_fp8 {
            let blocks = if k.block == 0 || !k.head_dim.is_multiple_of(k.block) {
                None
            } else {
                Some(k.head_dim / k.block)
            };
            if Some(k.codes.len()) != product(&[k.layers, t, k.head_dim])
                || blocks.and_then(|b| product(&[k.layers, t, b])) != Some(k.scale_exp.len())
            {
                return Err(ArtifactError::Config(format!(
                    "logits: {} KV codes and {} scale exponents are not {} layers × {t} tokens × \
                     head_dim {} in blocks of {}",
                    k.codes.len(),
                    k.scale_exp.len(),
                    k.layers,
                    k.head_dim,
                    k.block
                )));
            }
        }
        Ok(())
    }

    /// The tensors of the file, in the file's order (see the module doc).
    fn tensors(&self) -> Vec<Tensor> {
        let t = self.tokens.len();
        let mut out = vec![Tensor::f32("logits", &[t, self.vocab], &self.logits)];
        if let Some(m) = &self.mtp_logits {
            out.push(Tensor::f32("mtp_logits", &[t - 1, self.vocab], m));
        }
        if let Some(k) = &self.kv_fp8 {
            out.push(Tensor::i32(
                "kv_fp8_scale_exp",
                &[k.layers, t, k.head_dim / k.block],
                &k.scale_exp,
            ));
        }
        if let Some(r) = &self.routes {
            out.push(Tensor::i32("routes", &[r.layers, t, r.top_k], &r.experts));
        }
        out.push(Tensor::i32("tokens", &[t], &self.tokens));
        if let Some(k) = &self.kv_fp8 {
            out.push(Tensor::u8(
                "kv_fp8_codes",
                &[k.layers, t, k.head_dim],
                &k.codes,
            ));
        }
        out
    }

    /// Write the file to `path` atomically (an existing `path` only with `force`; a `path`
    /// that is not a regular file never).
    pub fn write(&self, path: &Path, force: bool) -> Result<()> {
        self.check()?;
        let meta = [
            ("format", FORMAT),
            ("version", VERSION),
            ("model", &self.model),
            ("mode", &self.mode),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        Ok(tensor_file::write(
            path,
            &self.tensors(),
            &meta,
            KeyOrder::Listed,
            force,
        )?)
    }

    /// Read a file written by [`LogitsFile::write`] (or by the reference tools, which write the
    /// same tensors without metadata), every shape checked.
    pub fn read(path: &Path) -> Result<LogitsFile> {
        let f = StFile::open(path)?;
        if let Some(fmt) = f.metadata().get("format") {
            if fmt != FORMAT || f.metadata().get("version").map(String::as_str) != Some(VERSION) {
                return Err(ArtifactError::invalid(
                    path,
                    format!("format `{fmt}` is not {FORMAT} version {VERSION}"),
                ));
            }
        }
        let tokens = f.i32s("tokens")?;
        let t = tokens.len();
        let shape = f.shape("logits")?;
        if shape.len() != 2 || shape[0] != t {
            return Err(ArtifactError::tensor(
                path,
                "logits",
                format!("shape {shape:?} is not [{t}, vocab]"),
            ));
        }
        let logits = f.f32s("logits")?;
        let routes = if f.has("routes") {
            let s = f.shape("routes")?;
            if s.len() != 3 || s[1] != t {
                return Err(ArtifactError::tensor(
                    path,
                    "routes",
                    format!("shape {s:?} is not [layers, {t}, top_k]"),
                ));
            }
            Some(LogitsRoutes {
                layers: s[0],
                top_k: s[2],
                experts: f.i32s("routes")?,
            })
        } else {
            None
        };
        let kv_fp8 = if f.has("kv_fp8_codes") || f.has("kv_fp8_scale_exp") {
            let c = f.shape("kv_fp8_codes")?;
            let e = f.shape("kv_fp8_scale_exp")?;
            let ok = c.len() == 3
                && e.len() == 3
                && c[1] == t
                && e[..2] == c[..2]
                && e[2] > 0
                && c[2].is_multiple_of(e[2]);
            if !ok {
                return Err(ArtifactError::tensor(
                    path,
                    "kv_fp8_codes",
                    format!(
                        "shapes {c:?} and {e:?} (kv_fp8_scale_exp) are not [layers, {t}, \
                         head_dim] and [layers, {t}, head_dim / block]"
                    ),
                ));
            }
            let codes = f.u8s("kv_fp8_codes")?;
            Some(LogitsKvFp8 {
                layers: c[0],
                head_dim: c[2],
                block: c[2] / e[2],
                codes,
                scale_exp: f.i32s("kv_fp8_scale_exp")?,
            })
        } else {
            None
        };
        let mtp_logits = if f.has("mtp_logits") {
            Some(f.f32s("mtp_logits")?)
        } else {
            None
        };
        let meta = |k: &str| f.metadata().get(k).cloned().unwrap_or_default();
        let out = LogitsFile {
            model: meta("model"),
            mode: meta("mode"),
            vocab: shape[1],
            tokens,
            logits,
            routes,
            kv_fp8,
            mtp_logits,
        };
        out.check()
            .map_err(|e| ArtifactError::invalid(path, e.to_string()))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(routes: bool, kv: bool) -> LogitsFile {
        LogitsFile {
            model: "/models/tiny".into(),
            mode: "prefill".into(),
            vocab: 3,
            tokens: vec![5, 1],
            logits: vec![0.5, -1.0, 2.0, f32::MIN, 0.0, 1e-30],
            routes: routes.then(|| LogitsRoutes {
                layers: 2,
                top_k: 2,
                experts: vec![0, 3, 1, 2, 4, 5, 0, 7],
            }),
            kv_fp8: kv.then(|| LogitsKvFp8 {
                layers: 2,
                head_dim: 4,
                block: 2,
                codes: (0..16).map(|i| i * 13).collect(),
                scale_exp: vec![-3, 0, 1, 2, -127, 5, 6, 7],
            }),
            mtp_logits: kv.then(|| vec![1.0, -2.5, 0.25]),
        }
    }

    #[test]
    fn round_trip_with_and_without_routes_and_kv_codes() {
        let d = tempfile::tempdir().unwrap();
        for (r, kv) in [(false, false), (true, false), (false, true), (true, true)] {
            let p = d.path().join(format!("l{r}{kv}.safetensors"));
            let s = sample(r, kv);
            s.write(&p, false).unwrap();
            assert_eq!(LogitsFile::read(&p).unwrap(), s);
            let f = StFile::open(&p).unwrap();
            assert_eq!(f.meta("format").unwrap(), FORMAT);
            assert_eq!(f.meta("mode").unwrap(), "prefill");
            // Data in the file's order: descending dtype, then name.
            let mut names: Vec<_> = f
                .tensors()
                .iter()
                .map(|t| (t.start, t.name.clone()))
                .collect();
            names.sort();
            let names: Vec<_> = names.into_iter().map(|n| n.1).collect();
            let want: Vec<_> = [
                "logits",
                "mtp_logits",
                "kv_fp8_scale_exp",
                "routes",
                "tokens",
                "kv_fp8_codes",
            ]
            .into_iter()
            .filter(|n| (r || *n != "routes") && (kv || !n.starts_with("kv") && *n != "mtp_logits"))
            .collect();
            assert_eq!(names, want);
        }
    }

    #[test]
    fn refuses_existing_and_inconsistent() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("l.safetensors");
        std::fs::write(&p, b"keep me").unwrap();
        let e = sample(true, true).write(&p, false).unwrap_err().to_string();
        assert!(e.contains("already exists"), "{e}");
        assert_eq!(std::fs::read(&p).unwrap(), b"keep me");
        sample(true, true).write(&p, true).unwrap();
        let mut bad = sample(true, true);
        bad.logits.pop();
        assert!(bad.write(&p, true).is_err());
        let mut bad = sample(true, true);
        bad.routes.as_mut().unwrap().experts.pop();
        assert!(bad.write(&p, true).is_err());
        let mut bad = sample(true, true);
        bad.kv_fp8.as_mut().unwrap().scale_exp.pop();
        assert!(bad.write(&p, true).is_err());
        let mut bad = sample(true, true);
        bad.kv_fp8.as_mut().unwrap().block = 3;
        assert!(bad.write(&p, true).is_err());
        assert_eq!(LogitsFile::read(&p).unwrap(), sample(true, true));
    }
}
