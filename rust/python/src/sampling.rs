//! `top_k_rows_cpu`: hybrid-cache-sampling's top k of each row on buffers (numpy arrays, e.g.
//! `torch.Tensor.numpy()` views of a step's logprobs). Converts buffers to slices and errors to
//! exceptions; nothing else.

use hybrid_cache_sampling::{top_k_rows, TopK};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{buffer_bytes, contiguous_items, output};
use crate::errors::invalid_argument;

/// For `logprobs` [rows, cols] (float32, C-contiguous) and `chosen` [rows] (int64): writes
/// `ids_out` / `values_out` [rows, k + 1] (int64 / float32, writable), column 0 the chosen
/// token and its logprob, columns 1..=k the row's k largest, most likely first, and
/// `ranks_out` [rows] (int64), the chosen token's rank (the values at least its own). Returns
/// the rows whose top k is not settled (ties among the k + 1 largest, or a NaN): recompute
/// those (their ranks are exact).
#[pyfunction]
#[pyo3(signature = (logprobs, k, chosen, ids_out, values_out, ranks_out))]
pub fn top_k_rows_cpu(
    logprobs: PyBuffer<f32>,
    k: usize,
    chosen: PyBuffer<i64>,
    mut ids_out: PyBuffer<i64>,
    mut values_out: PyBuffer<f32>,
    mut ranks_out: PyBuffer<i64>,
) -> PyResult<Vec<usize>> {
    let values = contiguous_items(&logprobs, "logprobs", 2)?;
    let chosen_items = contiguous_items(&chosen, "chosen", 1)?;
    let (rows, cols) = (values.shape[0], values.shape[1]);
    let shape = [rows, k + 1];
    // Each output may overlap neither an input nor an output before it.
    let ids_bytes = buffer_bytes(&ids_out);
    let values_bytes = buffer_bytes(&values_out);
    let inputs = [values.bytes(), chosen_items.bytes()];
    let ids = output(&mut ids_out, "ids_out", &shape, &inputs)?;
    let out_values = output(
        &mut values_out,
        "values_out",
        &shape,
        &[inputs[0].clone(), inputs[1].clone(), ids_bytes.clone()],
    )?;
    let ranks = output(
        &mut ranks_out,
        "ranks_out",
        &[rows],
        &[
            inputs[0].clone(),
            inputs[1].clone(),
            ids_bytes,
            values_bytes,
        ],
    )?;
    top_k_rows(
        values.slice,
        cols,
        k,
        chosen_items.slice,
        TopK {
            ids,
            values: out_values,
            ranks,
        },
    )
    .map_err(|error| invalid_argument(error.to_string()))
}
