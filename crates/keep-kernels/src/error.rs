//! Typed errors of the kernels: a weight view whose byte lengths do not match its shape, or
//! operands of the wrong length. Nothing here panics on input.

/// What can go wrong building a view or calling a kernel.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// A byte buffer has the wrong length for the declared shape.
    #[error("{what}: expected {expected} bytes for {rows}x{cols}, got {got}")]
    Bytes {
        what: &'static str,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    /// A shape the format cannot hold (e.g. MX columns not a multiple of 32).
    #[error("{what}: {msg}")]
    Shape { what: &'static str, msg: String },
    /// An operand of a kernel call has the wrong length.
    #[error("operand `{what}`: expected {expected} elements, got {got}")]
    Operand {
        what: &'static str,
        expected: usize,
        got: usize,
    },
}
