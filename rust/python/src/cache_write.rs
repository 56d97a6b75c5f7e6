//! `write_cache_cpu`: stores a step's new keys (or values) in a paged cache on buffers (numpy
//! views of the engine's KV tensors). Converts buffers to slices and errors to exceptions.

use hybrid_cache_attention::{write_cache, PagedCacheMut};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{contiguous_items, Items};
use crate::errors::{attention_to_py, invalid_argument};

/// Row t of `new` [tokens, Hkv, D] (float32, C-contiguous) goes to slot `slots[t]` (int64,
/// C-contiguous: token `slot % block_size` of block `slot / block_size`) of `cache`
/// [num_blocks, block_size, Hkv, D] (float32, writable, any non-negative strides with unit last
/// stride, e.g. the K or V view of the engine's slot tensor). Checks every slot first and
/// writes nothing when one is outside the cache.
#[pyfunction]
pub fn write_cache_cpu(
    cache: PyBuffer<f32>,
    new: PyBuffer<f32>,
    slots: PyBuffer<i64>,
) -> PyResult<()> {
    let target = Items::new(&cache, "cache", 4)?;
    let rows = contiguous_items(&new, "new", 3)?;
    let slot_items = contiguous_items(&slots, "slots", 1)?;
    if cache.readonly() || target.strides[3] != 1 {
        return Err(invalid_argument(format!(
            "cache must be writable with a unit last stride, got strides {:?}",
            target.strides
        )));
    }
    if rows.shape[1..] != target.shape[2..] || rows.shape[0] != slot_items.shape[0] {
        return Err(invalid_argument(format!(
            "new must be [len(slots)={}, Hkv, D] with the cache's Hkv x D = {:?}, got {:?}",
            slot_items.shape[0],
            &target.shape[2..],
            rows.shape
        )));
    }
    let written = target.bytes();
    let overlaps =
        |other: std::ops::Range<usize>| other.start < written.end && written.start < other.end;
    if overlaps(rows.bytes()) || overlaps(slot_items.bytes()) {
        return Err(invalid_argument(
            "new and slots must not overlap the cache; pass separate arrays".to_owned(),
        ));
    }
    // The cache's layout, then its read-only view dropped before the writable one is made.
    let (shape, strides, span) = (target.shape, target.strides, target.slice.len());
    // SAFETY: the buffer is writable (checked), `span` items from its start are the elements
    // its shape and strides reach (`Items::new`), and no input overlaps them (checked); the GIL
    // is held for the whole call.
    let data = unsafe { std::slice::from_raw_parts_mut(cache.buf_ptr() as *mut f32, span) };
    let destination = PagedCacheMut {
        data,
        offset: 0,
        num_blocks: shape[0],
        block_size: shape[1],
        block_stride: strides[0],
        token_stride: strides[1],
        head_stride: strides[2],
    };
    let (num_kv_heads, head_dim) = (shape[2], shape[3]);
    write_cache(
        destination,
        rows.slice,
        slot_items.slice,
        num_kv_heads,
        head_dim,
    )
    .map_err(attention_to_py)
}
