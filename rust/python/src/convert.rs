//! Conversions from Python values, each failure a typed `InvalidArgumentError`.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::errors::invalid_argument;

/// A non-negative Python int as `usize`.
pub fn size(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| invalid_argument(format!("{name} must be non-negative, got {value}")))
}

/// A request id: a non-negative int below 2^63.
pub fn request_id(value: i64) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| invalid_argument(format!("request ids must be non-negative, got {value}")))
}

/// Integers from anything exposing an int64 buffer (numpy int64 arrays: one copy, no per-item
/// Python calls) or from any sequence of ints.
pub fn int64s(name: &str, values: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if let Ok(buffer) = PyBuffer::<i64>::get(values) {
        if buffer.dimensions() <= 1 {
            return buffer.to_vec(values.py());
        }
    }
    values
        .extract::<Vec<i64>>()
        .map_err(|_| invalid_argument(format!("{name} must be a 1-d sequence of ints")))
}

/// Token ids: ints in `0..2^32`.
pub fn token_ids(values: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    int64s("token ids", values)?
        .into_iter()
        .map(|token| {
            u32::try_from(token)
                .map_err(|_| invalid_argument(format!("token id {token} is outside 0..2^32")))
        })
        .collect()
}

/// A 128-bit hash from any Python int: non-negative ints below 2^128 as they are, negative
/// ones (e.g. from `hash()`) by their two's-complement bits.
pub fn hash128(value: &Bound<'_, PyAny>) -> PyResult<u128> {
    if let Ok(unsigned) = value.extract::<u128>() {
        return Ok(unsigned);
    }
    value
        .extract::<i128>()
        .map(|signed| signed as u128)
        .map_err(|_| invalid_argument("hashes must be ints in -2^127..2^128".into()))
}
