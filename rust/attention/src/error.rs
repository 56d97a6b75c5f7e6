//! Errors a caller can cause; each message says what to change.

use std::fmt;

/// One variant per kind of failure; the binding maps each to a Python exception class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionError {
    /// A length, shape, stride or parameter that does not fit the others.
    InvalidArgument(String),
    /// A visible position maps to the null block (0) or to a block id outside the cache.
    InvalidBlock(String),
}

impl fmt::Display for AttentionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttentionError::InvalidArgument(message) | AttentionError::InvalidBlock(message) => {
                write!(f, "{message}")
            }
        }
    }
}

impl std::error::Error for AttentionError {}

/// An `InvalidArgument` error unless `condition` holds.
pub(crate) fn ensure(
    condition: bool,
    message: impl FnOnce() -> String,
) -> Result<(), AttentionError> {
    if condition {
        Ok(())
    } else {
        Err(AttentionError::InvalidArgument(message()))
    }
}
