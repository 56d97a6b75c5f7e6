//! `paged_attention_cpu`: the CPU decode kernel of hybrid-cache-attention on buffers (numpy
//! arrays, e.g. `torch.Tensor.numpy()` views of the engine's KV tensors). Converts buffers to
//! slices and errors to exceptions; nothing else.

use std::ops::Range;

use hybrid_cache_attention::{paged_attention, AttentionParams, HeadShape, PagedCache, QueryRows};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{contiguous_items, Items};
use crate::errors::{attention_to_py, invalid_argument};

fn paged<'b>(items: &Items<'b, f32>) -> PagedCache<'b> {
    PagedCache {
        data: items.slice,
        offset: 0,
        num_blocks: items.shape[0],
        block_size: items.shape[1],
        block_stride: items.strides[0],
        token_stride: items.strides[1],
        head_stride: items.strides[2],
    }
}

/// Decode attention: row r of `q` [rows, Hq, D] (float32, C-contiguous) attends to positions
/// `low[r] ..= position[r]` of block-table row `sequence[r]` (int64 each) through `block_table`
/// [sequences, width] (int32, C-contiguous) in the paged caches `k_cache`/`v_cache`
/// [num_blocks, block_size, Hkv, D] (float32, any non-negative strides with unit last stride);
/// the result goes to `out` (float32, like `q`, writable, not overlapping any input).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_table, sequence, position, low, out, scale, softcap=None, sinks=None))]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_cpu(
    q: PyBuffer<f32>,
    k_cache: PyBuffer<f32>,
    v_cache: PyBuffer<f32>,
    block_table: PyBuffer<i32>,
    sequence: PyBuffer<i64>,
    position: PyBuffer<i64>,
    low: PyBuffer<i64>,
    out: PyBuffer<f32>,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<PyBuffer<f32>>,
) -> PyResult<()> {
    let q_items = contiguous_items(&q, "q", 3)?;
    let keys = Items::new(&k_cache, "k_cache", 4)?;
    let values = Items::new(&v_cache, "v_cache", 4)?;
    let table = contiguous_items(&block_table, "block_table", 2)?;
    let sequence = contiguous_items(&sequence, "sequence", 1)?;
    let position = contiguous_items(&position, "position", 1)?;
    let low = contiguous_items(&low, "low", 1)?;
    let sinks_items = match &sinks {
        Some(buffer) => Some(contiguous_items(buffer, "sinks", 1)?),
        None => None,
    };
    if keys.shape != values.shape || keys.strides[3] != 1 || values.strides[3] != 1 {
        return Err(invalid_argument(format!(
            "k_cache and v_cache must have the same shape and unit last stride, got {:?} / {:?} \
             with strides {:?} / {:?}",
            keys.shape, values.shape, keys.strides, values.strides
        )));
    }
    if q_items.shape[2] != keys.shape[3] {
        return Err(invalid_argument(format!(
            "q's head_dim {} differs from the cache's {}",
            q_items.shape[2], keys.shape[3]
        )));
    }
    if !out.is_c_contiguous() || out.readonly() || out.shape() != q_items.shape.as_slice() {
        return Err(invalid_argument(format!(
            "out must be a writable C-contiguous float32 array of q's shape {:?}, got shape {:?}",
            q_items.shape,
            out.shape()
        )));
    }
    let out_len = out.item_count();
    let written_start = out.buf_ptr() as usize;
    let written = written_start..written_start + out_len * std::mem::size_of::<f32>();
    let inputs = [
        q_items.bytes(),
        keys.bytes(),
        values.bytes(),
        table.bytes(),
        sequence.bytes(),
        position.bytes(),
        low.bytes(),
    ];
    let overlaps = |range: &Range<usize>| range.start < written.end && written.start < range.end;
    if inputs.iter().any(overlaps) || sinks_items.as_ref().is_some_and(|s| overlaps(&s.bytes())) {
        return Err(invalid_argument(
            "out overlaps an input; pass a separate output array".to_owned(),
        ));
    }
    // SAFETY: `out` is a writable, C-contiguous buffer of exactly these items that overlaps no
    // input (checked above), held for the whole call under the GIL.
    let out_slice = unsafe { std::slice::from_raw_parts_mut(out.buf_ptr() as *mut f32, out_len) };
    let shape = HeadShape {
        num_heads: q_items.shape[1],
        num_kv_heads: keys.shape[2],
        head_dim: keys.shape[3],
    };
    let rows = QueryRows {
        block_table: table.slice,
        table_width: table.shape[1],
        sequence: sequence.slice,
        position: position.slice,
        low: low.slice,
    };
    let params = AttentionParams {
        scale,
        softcap,
        sinks: sinks_items.as_ref().map(|s| s.slice),
    };
    paged_attention(
        q_items.slice,
        paged(&keys),
        paged(&values),
        rows,
        shape,
        params,
        out_slice,
    )
    .map_err(attention_to_py)
}
