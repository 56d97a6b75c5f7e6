//! `decode_inputs_cpu`: a decode step's positions, sequence lengths, block tables and
//! new-token slots from the engine's grouped block table (numpy arrays), written into reused
//! buffers. Converts buffers to slices and errors to exceptions.

use hybrid_cache_attention::{decode_inputs, DecodeInputs};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::convert::{buffer_bytes, contiguous_items, output};
use crate::errors::{attention_to_py, invalid_argument};

/// For `block_table` [groups, rows, width] (int32, C-contiguous) and the sequences at table
/// rows `rows` whose new token sits at `num_computed` (lists), one group per entry of
/// `block_sizes`: writes the prefixes of the 1-d buffers `positions_out` (int64),
/// `seq_lens_out` (int32), `tables_out` (int32, each group's `[seqs, columns]` after the
/// last) and `slots_out` (int64, `[groups, seqs]`); returns the longest sequence. The buffers
/// must be writable, C-contiguous and overlap nothing.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn decode_inputs_cpu(
    block_table: PyBuffer<i32>,
    rows: Vec<i64>,
    num_computed: Vec<i64>,
    block_sizes: Vec<usize>,
    mut positions_out: PyBuffer<i64>,
    mut seq_lens_out: PyBuffer<i32>,
    mut tables_out: PyBuffer<i32>,
    mut slots_out: PyBuffer<i64>,
) -> PyResult<usize> {
    let table = contiguous_items(&block_table, "block_table", 3)?;
    if table.shape[0] != block_sizes.len() {
        return Err(invalid_argument(format!(
            "block_table has {} groups, block_sizes names {}",
            table.shape[0],
            block_sizes.len()
        )));
    }
    let width = table.shape[2];
    let ranges = [
        table.bytes(),
        buffer_bytes(&positions_out),
        buffer_bytes(&seq_lens_out),
        buffer_bytes(&tables_out),
        buffer_bytes(&slots_out),
    ];
    let others = |skip: usize| -> Vec<std::ops::Range<usize>> {
        let kept = ranges
            .iter()
            .enumerate()
            .filter(|&(index, _)| index != skip);
        kept.map(|(_, range)| range.clone()).collect()
    };
    let shapes = [
        [positions_out.item_count()],
        [seq_lens_out.item_count()],
        [tables_out.item_count()],
        [slots_out.item_count()],
    ];
    let positions = output(&mut positions_out, "positions_out", &shapes[0], &others(1))?;
    let seq_lens = output(&mut seq_lens_out, "seq_lens_out", &shapes[1], &others(2))?;
    let tables = output(&mut tables_out, "tables_out", &shapes[2], &others(3))?;
    let slots = output(&mut slots_out, "slots_out", &shapes[3], &others(4))?;
    let out = DecodeInputs {
        positions,
        seq_lens,
        tables,
        slots,
    };
    decode_inputs(table.slice, width, &rows, &num_computed, &block_sizes, out)
        .map_err(attention_to_py)
}
