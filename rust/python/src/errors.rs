//! One Python exception class per `CoreError` variant, all subclasses of `HybridCacheError`.

use hybrid_cache_attention::AttentionError;
use hybrid_cache_core::CoreError;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    _core,
    HybridCacheError,
    PyException,
    "Base of every hybrid-cache error."
);
pyo3::create_exception!(
    _core,
    InvalidArgumentError,
    HybridCacheError,
    "A size, count or parameter is out of range."
);
pyo3::create_exception!(
    _core,
    NoFreeBlocksError,
    HybridCacheError,
    "The pool has fewer free blocks than asked; nothing was taken."
);
pyo3::create_exception!(
    _core,
    InvalidBlockError,
    HybridCacheError,
    "A block id that is the null block, out of range, or not held."
);
pyo3::create_exception!(
    _core,
    DoubleFreeError,
    HybridCacheError,
    "A block freed more times than it is referenced."
);
pyo3::create_exception!(
    _core,
    UnknownRequestError,
    HybridCacheError,
    "A request id that was never added or is already freed."
);
pyo3::create_exception!(
    _core,
    DuplicateRequestError,
    HybridCacheError,
    "A request id added twice."
);
pyo3::create_exception!(
    _core,
    InvalidGroupError,
    HybridCacheError,
    "A group id out of range."
);
pyo3::create_exception!(
    _core,
    RequestTooLargeError,
    HybridCacheError,
    "A request the pool or table can never hold."
);
pyo3::create_exception!(
    _core,
    TooManyRequestsError,
    HybridCacheError,
    "Every block-table row is in use."
);

/// Converts a core error into its Python exception.
pub fn to_py(error: CoreError) -> PyErr {
    let message = error.to_string();
    match error {
        CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        CoreError::NoFreeBlocks { .. } => NoFreeBlocksError::new_err(message),
        CoreError::InvalidBlock(_) => InvalidBlockError::new_err(message),
        CoreError::DoubleFree { .. } => DoubleFreeError::new_err(message),
        CoreError::UnknownRequest { .. } => UnknownRequestError::new_err(message),
        CoreError::DuplicateRequest { .. } => DuplicateRequestError::new_err(message),
        CoreError::InvalidGroup { .. } => InvalidGroupError::new_err(message),
        CoreError::RequestTooLarge(_) => RequestTooLargeError::new_err(message),
        CoreError::TooManyRequests { .. } => TooManyRequestsError::new_err(message),
    }
}

/// Converts a CPU-attention error into the exception of the same kind.
pub fn attention_to_py(error: AttentionError) -> PyErr {
    let message = error.to_string();
    match error {
        AttentionError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        AttentionError::InvalidBlock(_) => InvalidBlockError::new_err(message),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HybridCacheError", py.get_type::<HybridCacheError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("NoFreeBlocksError", py.get_type::<NoFreeBlocksError>())?;
    m.add("InvalidBlockError", py.get_type::<InvalidBlockError>())?;
    m.add("DoubleFreeError", py.get_type::<DoubleFreeError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add(
        "DuplicateRequestError",
        py.get_type::<DuplicateRequestError>(),
    )?;
    m.add("InvalidGroupError", py.get_type::<InvalidGroupError>())?;
    m.add(
        "RequestTooLargeError",
        py.get_type::<RequestTooLargeError>(),
    )?;
    m.add(
        "TooManyRequestsError",
        py.get_type::<TooManyRequestsError>(),
    )?;
    Ok(())
}

/// An `InvalidArgumentError` with `message` (for conversions the binding itself checks).
pub fn invalid_argument(message: String) -> PyErr {
    to_py(CoreError::InvalidArgument(message))
}
