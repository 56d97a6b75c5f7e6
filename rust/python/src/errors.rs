//! One Python exception class per `CoreError` variant, all subclasses of `HybridCacheError`.
//!
//! The classes are defined in Python, in `hybrid_cache/errors.py` (the package's ground floor,
//! importing nothing from the package), and imported from there the first time one is needed:
//! at module load, when `register` adds them to `_core`. One class object serves both names,
//! `hybrid_cache._core.X` and `hybrid_cache.errors.X`.

use hybrid_cache_attention::AttentionError;
use hybrid_cache_core::CoreError;
use pyo3::prelude::*;

pyo3::import_exception!(hybrid_cache.errors, HybridCacheError);
pyo3::import_exception!(hybrid_cache.errors, InvalidArgumentError);
pyo3::import_exception!(hybrid_cache.errors, NoFreeBlocksError);
pyo3::import_exception!(hybrid_cache.errors, InvalidBlockError);
pyo3::import_exception!(hybrid_cache.errors, DoubleFreeError);
pyo3::import_exception!(hybrid_cache.errors, UnknownRequestError);
pyo3::import_exception!(hybrid_cache.errors, DuplicateRequestError);
pyo3::import_exception!(hybrid_cache.errors, InvalidGroupError);
pyo3::import_exception!(hybrid_cache.errors, RequestTooLargeError);
pyo3::import_exception!(hybrid_cache.errors, TooManyRequestsError);

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
