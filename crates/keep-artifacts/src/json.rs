//! The small JSON files stages hand each other (prune plans, allocations, fit plans, route
//! profiles): one reader (a regular file of at most
//! [`keep_checkpoint::small_file::MAX_SMALL_FILE`] bytes, parsed, then validated by the file's
//! own rules), one atomic writer (validated first; temporary sibling, fsync, rename; an
//! existing file refused unless `force`) and the format/version check every one of them opens
//! with. What each file holds and checks stays in its own module.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{ArtifactError, Result};

/// How a kind of file is named in errors: `a` with its article ("an allocation"), `name`
/// without ("allocation").
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kind {
    pub a: &'static str,
    pub name: &'static str,
}

/// Read, parse and validate `path`.
pub(crate) fn read<T: DeserializeOwned>(
    path: &Path,
    kind: Kind,
    validate: impl Fn(&T) -> std::result::Result<(), String>,
) -> Result<T> {
    let text =
        keep_checkpoint::small_file::read_text(path, keep_checkpoint::small_file::MAX_SMALL_FILE)?;
    parse(path, &text, kind, validate)
}

/// Parse and validate `text`; `path` only names it in errors.
pub(crate) fn parse<T: DeserializeOwned>(
    path: &Path,
    text: &str,
    kind: Kind,
    validate: impl Fn(&T) -> std::result::Result<(), String>,
) -> Result<T> {
    let v: T = serde_json::from_str(text)
        .map_err(|e| ArtifactError::invalid(path, format!("not {}: {e}", kind.a)))?;
    validate(&v).map_err(|e| ArtifactError::invalid(path, e))?;
    Ok(v)
}

/// Validate `value` and write it to `path` atomically, pretty-printed or compact (no trailing
/// newline either way).
pub(crate) fn write<T: Serialize>(
    value: &T,
    path: &Path,
    force: bool,
    pretty: bool,
    kind: Kind,
    validate: impl Fn(&T) -> std::result::Result<(), String>,
) -> Result<()> {
    validate(value).map_err(|e| ArtifactError::Config(format!("invalid {}: {e}", kind.name)))?;
    let bytes = if pretty {
        serde_json::to_vec_pretty(value)
    } else {
        serde_json::to_vec(value)
    }
    .map_err(|e| ArtifactError::Config(format!("{}: {e}", kind.name)))?;
    Ok(keep_checkpoint::atomic::write_file(path, &bytes, force)?)
}

/// The check every file opens with: its `format` tag and `version` are the ones this crate
/// reads.
pub(crate) fn check_format(
    format: &str,
    version: u32,
    want_format: &str,
    want_version: u32,
) -> std::result::Result<(), String> {
    if format != want_format || version != want_version {
        return Err(format!(
            "format `{format}` version {version} is not {want_format} version {want_version}"
        ));
    }
    Ok(())
}
