//! `decode_tables_cpu`: a decode step's block tables and new-token slots from the engine's
//! grouped block table (numpy arrays). Converts buffers to slices and errors to exceptions.

use hybrid_cache_attention::{decode_tables, DecodeTables};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{buffer_bytes, contiguous_items, output};
use crate::errors::attention_to_py;

/// For `block_table` [groups, rows, width] (int32, C-contiguous), the sequences at table rows
/// `rows` [seqs] with their new token at `positions` [seqs] (int64), blocks of `block_size`
/// tokens: writes `tables_out` [groups, seqs, columns] (int32, each row's first `columns`
/// blocks) and `slots_out` [groups, seqs] (int64, the new token's slot). Errors and writes
/// nothing when a row or block is outside the table or a new token maps to the null block.
#[pyfunction]
pub fn decode_tables_cpu(
    block_table: PyBuffer<i32>,
    rows: PyBuffer<i64>,
    positions: PyBuffer<i64>,
    block_size: usize,
    mut tables_out: PyBuffer<i32>,
    mut slots_out: PyBuffer<i64>,
) -> PyResult<()> {
    let table = contiguous_items(&block_table, "block_table", 3)?;
    let row_items = contiguous_items(&rows, "rows", 1)?;
    let position_items = contiguous_items(&positions, "positions", 1)?;
    let (groups, width) = (table.shape[0], table.shape[2]);
    let seqs = row_items.shape[0];
    let columns = tables_out.shape().get(2).copied().unwrap_or(0);
    let inputs = [table.bytes(), row_items.bytes(), position_items.bytes()];
    let slots_bytes = buffer_bytes(&slots_out);
    let tables = output(
        &mut tables_out,
        "tables_out",
        &[groups, seqs, columns],
        &[
            inputs[0].clone(),
            inputs[1].clone(),
            inputs[2].clone(),
            slots_bytes,
        ],
    )?;
    let slots = output(&mut slots_out, "slots_out", &[groups, seqs], &inputs)?;
    decode_tables(
        table.slice,
        groups,
        width,
        row_items.slice,
        position_items.slice,
        block_size,
        DecodeTables { tables, slots },
    )
    .map_err(attention_to_py)
}
