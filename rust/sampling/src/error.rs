//! Errors a caller can cause; each message says what to change.

use std::fmt;

/// A shape or index that does not fit the others (the binding raises `InvalidArgumentError`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplingError(pub String);

impl fmt::Display for SamplingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::error::Error for SamplingError {}

/// An error unless `condition` holds.
pub(crate) fn ensure(
    condition: bool,
    message: impl FnOnce() -> String,
) -> Result<(), SamplingError> {
    if condition {
        Ok(())
    } else {
        Err(SamplingError(message()))
    }
}
