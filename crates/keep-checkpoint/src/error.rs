//! Typed errors of the checkpoint layer: each names the file and, where there is one, the tensor,
//! so that the CLI can say what happened, where, and what to do next.

use std::path::PathBuf;

/// Everything that can go wrong reading or writing a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// An operating-system error on a file.
    #[error("{path}: {err}")]
    Io {
        path: PathBuf,
        /// Shown in the message (not as a separate cause, so it is printed once).
        err: std::io::Error,
    },
    /// A path is a symbolic link whose target does not exist.
    #[error("{path} is a symbolic link to {target}, which does not exist")]
    DanglingLink { path: PathBuf, target: PathBuf },
    /// The safetensors header of a file is malformed.
    #[error("{path}: bad safetensors header: {msg}")]
    Header { path: PathBuf, msg: String },
    /// One tensor's entry in a safetensors header is malformed.
    #[error("{path}: tensor `{tensor}`: {msg}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },
    /// config.json is missing, malformed or disagrees with the tensors.
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    /// The shard index is malformed or names a missing shard.
    #[error("{path}: {msg}")]
    Index { path: PathBuf, msg: String },
    /// A tensor looked up by name does not exist.
    #[error("tensor `{tensor}` is not in the checkpoint at {dir}")]
    NoSuchTensor { dir: PathBuf, tensor: String },
    /// The output already exists and `--force` was not given.
    #[error("{path} already exists; pass --force to replace it, or choose another output")]
    OutputExists { path: PathBuf },
    /// A file keep reads whole is larger than it can be.
    #[error("{path} is larger than {max} bytes; this is not a file keep wrote or reads")]
    TooLarge { path: PathBuf, max: u64 },
    /// A path names something that is not a regular file where keep reads or writes one (or,
    /// for a checkpoint output, not a directory); an output like that is never replaced, even
    /// with `--force`.
    #[error("{path} is {kind}, not a regular file")]
    NotRegular { path: PathBuf, kind: &'static str },
    /// A checkpoint path that is not a directory.
    #[error("{path} is {kind}, not a checkpoint directory")]
    NotADirectory { path: PathBuf, kind: &'static str },
    /// An output would be, contain, or lie inside an input (or keep's own cache).
    #[error("{path} {how} {role} {input}; choose an output outside it")]
    OutputOverlapsInput {
        path: PathBuf,
        how: &'static str,
        role: &'static str,
        input: PathBuf,
    },
    /// An existing directory given as an output is not one keep wrote (or is where keep runs):
    /// `--force` replaces only keep's own outputs.
    #[error("{path} {why}; --force replaces only an output keep wrote (a directory whose SHA256SUMS lists everything in it): choose another output, or move it aside yourself")]
    NotKeepOutput { path: PathBuf, why: String },
    /// A writer was used out of order (a bug in the caller, reported, not panicked on).
    #[error("writer: {0}")]
    Writer(String),
    /// A SHA256SUMS check failed.
    #[error("{path}: {msg}")]
    Verify { path: PathBuf, msg: String },
}

impl CheckpointError {
    /// Wrap an I/O error with the path it happened on (a path that is not found because it is
    /// a symbolic link to nothing says so, naming where the link points).
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.kind() == std::io::ErrorKind::NotFound {
            if let Ok(target) = std::fs::read_link(&path) {
                return CheckpointError::DanglingLink { path, target };
            }
        }
        CheckpointError::Io { path, err: source }
    }
}
