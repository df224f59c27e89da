//! [`RunOptions`]: how a model runs, apart from what its checkpoint says. The config
//! ([`crate::ModelConfig`]) is the checkpoint's; the options are the caller's (a command's flags,
//! a fit plan) and are given to the model when it is built ([`crate::Model::load_opts`]). The
//! forward reads the kernels from them and runs long prompts in chunks of their size.

use keep_kernels::Kernels;

use crate::config::DEFAULT_PREFILL_CHUNK;

/// The options one model runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Which kernels the products run on (see [`keep_kernels::Kernels`]).
    pub kernels: Kernels,
    /// Most tokens one forward pass computes at once (at least 1). Longer prompts run as
    /// consecutive chunks, which gives the same logits bit for bit and bounds the activations
    /// (see [`crate::memory`]).
    pub prefill_chunk: usize,
}

impl Default for RunOptions {
    /// The exact kernels and [`DEFAULT_PREFILL_CHUNK`].
    fn default() -> RunOptions {
        RunOptions {
            kernels: Kernels::Exact,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

impl RunOptions {
    /// The default options on `kernels`.
    pub fn with_kernels(kernels: Kernels) -> RunOptions {
        RunOptions {
            kernels,
            ..RunOptions::default()
        }
    }

    /// The chunk a forward runs: `prefill_chunk`, at least 1.
    pub fn chunk(&self) -> usize {
        self.prefill_chunk.max(1)
    }
}
