//! `log_softmax_rows_cpu`, `top_k_rows_cpu`, `logprob_top_k_rows_cpu` and
//! `greedy_logprob_top_k_rows_cpu`: hybrid-cache-sampling's
//! row operations on buffers (numpy arrays, e.g. `torch.Tensor.numpy()` views of a step's
//! logits). Converts buffers to slices and errors to exceptions; nothing else.

use std::ops::Range;

use hybrid_cache_sampling::{
    greedy_logprob_top_k_rows, log_softmax_rows, logprob_top_k_rows, top_k_rows, SamplingError,
    TopK,
};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{buffer_bytes, contiguous_items, output};
use crate::errors::invalid_argument;

/// Writes the log-softmax of each row of `logits` [rows, cols] (float32, C-contiguous) into
/// `out` (the same shape, writable, not overlapping `logits`).
#[pyfunction]
#[pyo3(signature = (logits, out))]
pub fn log_softmax_rows_cpu(logits: PyBuffer<f32>, mut out: PyBuffer<f32>) -> PyResult<()> {
    let values = contiguous_items(&logits, "logits", 2)?;
    let cols = values.shape[1];
    let shape = [values.shape[0], cols];
    let out = output(&mut out, "out", &shape, &[values.bytes()])?;
    log_softmax_rows(values.slice, cols, out).map_err(|error| invalid_argument(error.to_string()))
}

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
    ids_out: PyBuffer<i64>,
    values_out: PyBuffer<f32>,
    ranks_out: PyBuffer<i64>,
) -> PyResult<Vec<usize>> {
    let buffers = (logprobs, chosen, ids_out, values_out, ranks_out);
    with_top_k_buffers(buffers, "logprobs", k, top_k_rows)
}

/// `top_k_rows_cpu` of the log-softmax of `logits` (`log_softmax_rows_cpu`'s values to the
/// bit, the ranks counted over them) without writing it: ids in the logits' order. Rows the log-softmax makes NaN
/// get NaN values and rank 0 and are returned with the unsettled ones: recompute those from
/// `log_softmax_rows_cpu`.
#[pyfunction]
#[pyo3(signature = (logits, k, chosen, ids_out, values_out, ranks_out))]
pub fn logprob_top_k_rows_cpu(
    logits: PyBuffer<f32>,
    k: usize,
    chosen: PyBuffer<i64>,
    ids_out: PyBuffer<i64>,
    values_out: PyBuffer<f32>,
    ranks_out: PyBuffer<i64>,
) -> PyResult<Vec<usize>> {
    let buffers = (logits, chosen, ids_out, values_out, ranks_out);
    with_top_k_buffers(buffers, "logits", k, logprob_top_k_rows)
}

/// `logprob_top_k_rows_cpu` with each row's chosen token its largest logit (a greedy pick),
/// written to `ids_out[:, 0]`. Returns the rows not settled (also those whose largest logit is
/// not the only maximum): their pick and top k are guesses, to recompute.
#[pyfunction]
#[pyo3(signature = (logits, k, ids_out, values_out, ranks_out))]
pub fn greedy_logprob_top_k_rows_cpu(
    logits: PyBuffer<f32>,
    k: usize,
    mut ids_out: PyBuffer<i64>,
    mut values_out: PyBuffer<f32>,
    mut ranks_out: PyBuffer<i64>,
) -> PyResult<Vec<usize>> {
    let values = contiguous_items(&logits, "logits", 2)?;
    let (rows, cols) = (values.shape[0], values.shape[1]);
    let inputs = [values.bytes()];
    let out = top_k_outputs(
        &mut ids_out,
        &mut values_out,
        &mut ranks_out,
        rows,
        k,
        &inputs,
    )?;
    greedy_logprob_top_k_rows(values.slice, cols, k, out)
        .map_err(|error| invalid_argument(error.to_string()))
}

/// The inputs and outputs of a top k: `values` [rows, cols], `chosen` [rows], `ids_out` and
/// `values_out` [rows, k + 1], `ranks_out` [rows].
type TopKBuffers = (
    PyBuffer<f32>,
    PyBuffer<i64>,
    PyBuffer<i64>,
    PyBuffer<f32>,
    PyBuffer<i64>,
);

/// Runs `top_k` on the buffers' slices (`name`: the values' argument name), each output
/// checked to overlap neither an input nor an output before it.
fn with_top_k_buffers(
    buffers: TopKBuffers,
    name: &str,
    k: usize,
    top_k: impl FnOnce(&[f32], usize, usize, &[i64], TopK<'_>) -> Result<Vec<usize>, SamplingError>,
) -> PyResult<Vec<usize>> {
    let (values, chosen, mut ids_out, mut values_out, mut ranks_out) = buffers;
    let values = contiguous_items(&values, name, 2)?;
    let chosen_items = contiguous_items(&chosen, "chosen", 1)?;
    let (rows, cols) = (values.shape[0], values.shape[1]);
    let inputs = [values.bytes(), chosen_items.bytes()];
    let out = top_k_outputs(
        &mut ids_out,
        &mut values_out,
        &mut ranks_out,
        rows,
        k,
        &inputs,
    )?;
    top_k(values.slice, cols, k, chosen_items.slice, out)
        .map_err(|error| invalid_argument(error.to_string()))
}

/// The outputs of a top k over `rows` rows (`ids_out` / `values_out` [rows, k + 1],
/// `ranks_out` [rows]), each checked to overlap neither an input (`inputs`: their byte ranges)
/// nor an output before it.
fn top_k_outputs<'b>(
    ids_out: &'b mut PyBuffer<i64>,
    values_out: &'b mut PyBuffer<f32>,
    ranks_out: &'b mut PyBuffer<i64>,
    rows: usize,
    k: usize,
    inputs: &[Range<usize>],
) -> PyResult<TopK<'b>> {
    let shape = [rows, k + 1];
    let ids_bytes = buffer_bytes(ids_out);
    let values_bytes = buffer_bytes(values_out);
    let ids = output(ids_out, "ids_out", &shape, inputs)?;
    let before_values: Vec<Range<usize>> =
        inputs.iter().cloned().chain([ids_bytes.clone()]).collect();
    let values = output(values_out, "values_out", &shape, &before_values)?;
    let before_ranks: Vec<Range<usize>> = inputs
        .iter()
        .cloned()
        .chain([ids_bytes, values_bytes])
        .collect();
    let ranks = output(ranks_out, "ranks_out", &[rows], &before_ranks)?;
    Ok(TopK { ids, values, ranks })
}
