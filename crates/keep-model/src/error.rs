//! Typed errors of the model layer. Each names the config key or tensor involved and, where
//! there is one, both shapes; nothing here prints or panics on a bad checkpoint.

use keep_checkpoint::CheckpointError;
use keep_kernels::KernelError;

/// Everything that can go wrong loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The config asks for something keep's model does not implement.
    #[error("config key `{key}`: {msg}")]
    Unsupported { key: String, msg: String },
    /// The config is inconsistent.
    #[error("config: {0}")]
    Config(String),
    /// The checkpoint's tensors contradict its config or are stored in a layout keep cannot
    /// read (`keep inspect` lists the same problems).
    #[error("{dir}: the checkpoint does not match its config.json: {}{}", problems.iter().take(8).cloned().collect::<Vec<_>>().join("; "), if problems.len() > 8 { format!("; and {} more (keep inspect lists them)", problems.len() - 8) } else { String::new() })]
    Tensors { dir: String, problems: Vec<String> },
    /// A tensor the model needs is missing.
    #[error("tensor `{0}` is missing from the checkpoint (the model needs it)")]
    Missing(String),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<u64>,
        got: Vec<u64>,
    },
    /// A tensor's dtype/scale combination is not a format keep can compute with.
    #[error("tensor `{name}`: {msg}")]
    Format { name: String, msg: String },
    /// A kernel refused its operands (a bug or a corrupt view).
    #[error("kernel: {0}")]
    Kernel(#[from] KernelError),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    Token { id: u32, vocab: usize },
    /// An expert source could not provide an expert.
    #[error("expert {expert} of layer {layer}: {msg}")]
    Expert {
        layer: usize,
        expert: usize,
        msg: String,
    },
    /// The hidden state or the logits turned NaN or infinite: the checkpoint holds non-finite
    /// weights or scales that reach the computation.
    #[error("the model's numbers turned non-finite (NaN or infinity) after {0}: the checkpoint holds non-finite weights or scales there (`keep inspect` lists them)")]
    NonFinite(String),
    /// A forward that would run past the context the model (`max_position_embeddings`) or the
    /// run (a budgeted run's planned context) allows.
    #[error("context: {0}")]
    Context(String),
    /// A cache used with the wrong model or after an error.
    #[error("cache: {0}")]
    Cache(String),
    /// The tokenizer could not be loaded, or could not encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Sampling settings that would sample garbage.
    #[error("sampling: {0}")]
    Sampling(String),
    /// A generation longer than the model's context.
    #[error("{prompt} prompt tokens + {max_tokens} tokens to generate exceed the model's context of {limit} positions (max_position_embeddings)")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        limit: usize,
    },
}
