//! The block tables and new-token slots of a decode step (one new token per sequence), read
//! from the engine's grouped block table `[groups, rows, width]` (row-major, block ids, 0 the
//! null block): for sequence `i`, held in table row `rows[i]` with its new token at
//! `positions[i]`, each group's table row up to `columns` blocks and the slot
//! `block * block_size + position % block_size` of the block the new token lands in. One
//! call per block size instead of a gather, a division and three array operations each.

use crate::error::{ensure, AttentionError};

/// Where `decode_tables` writes: `tables` `[groups, seqs, columns]`, `slots` `[groups, seqs]`.
pub struct DecodeTables<'a> {
    pub tables: &'a mut [i32],
    pub slots: &'a mut [i64],
}

/// Fills `out` for sequences at `rows` / `positions` of `block_table` (`groups` x `num_rows`
/// x `width`, `width` given), blocks of `block_size` tokens, `columns` table columns kept.
/// Errors (writing nothing) when a length does not fit, a row or a new token's block is
/// outside the table, or a new token maps to the null block.
pub fn decode_tables(
    block_table: &[i32],
    groups: usize,
    width: usize,
    rows: &[i64],
    positions: &[i64],
    block_size: usize,
    out: DecodeTables<'_>,
) -> Result<(), AttentionError> {
    ensure(groups > 0 && width > 0 && block_size > 0, || {
        format!("groups ({groups}), width ({width}) and block_size ({block_size}) must be positive")
    })?;
    ensure(block_table.len().is_multiple_of(groups * width), || {
        format!(
            "{} table entries do not make {groups} groups of rows of {width} blocks",
            block_table.len()
        )
    })?;
    let num_rows = block_table.len() / (groups * width);
    let seqs = rows.len();
    ensure(positions.len() == seqs, || {
        format!("{} positions for {seqs} rows", positions.len())
    })?;
    ensure(out.slots.len() == groups * seqs, || {
        format!(
            "slots must hold groups x seqs = {groups} x {seqs} items, got {}",
            out.slots.len()
        )
    })?;
    let columns = if seqs == 0 {
        0
    } else {
        out.tables.len() / (groups * seqs)
    };
    ensure(
        out.tables.len() == groups * seqs * columns && columns <= width,
        || {
            format!(
                "tables must hold groups x seqs x columns = {groups} x {seqs} x (at most {width}) \
                 items, got {}",
                out.tables.len()
            )
        },
    )?;
    // Every index first, so a bad one writes nothing.
    let mut starts = Vec::with_capacity(seqs);
    for (seq, (&row, &position)) in rows.iter().zip(positions).enumerate() {
        let row = usize::try_from(row).ok().filter(|&r| r < num_rows);
        let Some(row) = row else {
            return Err(AttentionError::InvalidArgument(format!(
                "row {} of sequence {seq} is outside the table's {num_rows} rows",
                rows[seq]
            )));
        };
        let block = usize::try_from(position)
            .ok()
            .map(|p| p / block_size)
            .filter(|&b| b < width);
        let Some(block) = block else {
            return Err(AttentionError::InvalidArgument(format!(
                "position {position} of sequence {seq} is outside a row of {width} blocks of \
                 {block_size} tokens"
            )));
        };
        starts.push((row * width, block, position as usize % block_size));
    }
    for group in 0..groups {
        let table = &block_table[group * num_rows * width..(group + 1) * num_rows * width];
        for (seq, &(start, block, _)) in starts.iter().enumerate() {
            if table[start + block] == 0 {
                return Err(AttentionError::InvalidBlock(format!(
                    "the new token of sequence {seq} (group {group}, block {block}) maps to the \
                     null block"
                )));
            }
        }
    }
    for group in 0..groups {
        let table = &block_table[group * num_rows * width..(group + 1) * num_rows * width];
        let out_tables = &mut out.tables[group * seqs * columns..(group + 1) * seqs * columns];
        let out_slots = &mut out.slots[group * seqs..(group + 1) * seqs];
        for (seq, &(start, block, offset)) in starts.iter().enumerate() {
            let line = &table[start..start + width];
            if columns > 0 {
                out_tables[seq * columns..(seq + 1) * columns].copy_from_slice(&line[..columns]);
            }
            out_slots[seq] = i64::from(line[block]) * block_size as i64 + offset as i64;
        }
    }
    Ok(())
}

/// Where `decode_inputs` writes; each slice at least as long as the step needs (only its
/// prefix is written, so one set of buffers serves every step): `positions` and `seq_lens`
/// `[seqs]`, `tables` each group's `[seqs, columns of its block size]` one after another,
/// `slots` `[groups, seqs]`.
pub struct DecodeInputs<'a> {
    pub positions: &'a mut [i64],
    pub seq_lens: &'a mut [i32],
    pub tables: &'a mut [i32],
    pub slots: &'a mut [i64],
}

/// A decode step's inputs in one call: for the sequences at table `rows` whose new token sits
/// at `num_computed` (their computed tokens), the positions (`num_computed`), the sequence
/// lengths (one more, int32), and per group `g` of `block_sizes[g]`-token blocks its table
/// `[seqs, ceil(max_seq_len / block_sizes[g])]` and the new tokens' slots, as
/// `decode_tables` writes them (groups of one block size in one call). Returns
/// `max_seq_len`, the longest sequence. Errors as `decode_tables` does, and when a buffer is
/// too short or a length is outside int32; outputs are then unspecified.
pub fn decode_inputs(
    block_table: &[i32],
    width: usize,
    rows: &[i64],
    num_computed: &[i64],
    block_sizes: &[usize],
    out: DecodeInputs<'_>,
) -> Result<usize, AttentionError> {
    let (groups, seqs) = (block_sizes.len(), rows.len());
    ensure(num_computed.len() == seqs, || {
        format!("{} computed counts for {seqs} rows", num_computed.len())
    })?;
    ensure(
        out.positions.len() >= seqs && out.seq_lens.len() >= seqs,
        || {
            format!(
                "positions and seq_lens must hold {seqs} items, got {} and {}",
                out.positions.len(),
                out.seq_lens.len()
            )
        },
    )?;
    let mut max_seq_len = 0usize;
    for (seq, &computed) in num_computed.iter().enumerate() {
        let seq_len = i32::try_from(computed)
            .ok()
            .filter(|c| (0..i32::MAX).contains(c));
        let Some(seq_len) = seq_len else {
            return Err(AttentionError::InvalidArgument(format!(
                "sequence {seq} has {computed} computed tokens, outside 0..{}",
                i32::MAX
            )));
        };
        out.positions[seq] = computed;
        out.seq_lens[seq] = seq_len + 1;
        max_seq_len = max_seq_len.max(seq_len as usize + 1);
    }
    ensure(groups > 0, || {
        "block_sizes must name at least one group".into()
    })?;
    let positions = &out.positions[..seqs];
    // At most the table's width: a longer sequence is the position error `decode_tables` gives.
    let columns = |size: usize| max_seq_len.div_ceil(size.max(1)).min(width);
    let table_items: usize = block_sizes.iter().map(|&size| seqs * columns(size)).sum();
    ensure(
        out.tables.len() >= table_items && out.slots.len() >= groups * seqs,
        || {
            format!(
                "tables and slots must hold {table_items} and {} items, got {} and {}",
                groups * seqs,
                out.tables.len(),
                out.slots.len()
            )
        },
    )?;
    if block_sizes.iter().all(|&size| size == block_sizes[0]) {
        let out = DecodeTables {
            tables: &mut out.tables[..table_items],
            slots: &mut out.slots[..groups * seqs],
        };
        decode_tables(
            block_table,
            groups,
            width,
            rows,
            positions,
            block_sizes[0],
            out,
        )?;
        return Ok(max_seq_len);
    }
    ensure(block_table.len().is_multiple_of(groups), || {
        format!(
            "{} table entries do not make {groups} groups",
            block_table.len()
        )
    })?;
    let group_len = block_table.len() / groups;
    let mut offset = 0;
    for (group, &size) in block_sizes.iter().enumerate() {
        let items = seqs * columns(size);
        let out = DecodeTables {
            tables: &mut out.tables[offset..offset + items],
            slots: &mut out.slots[group * seqs..(group + 1) * seqs],
        };
        let table = &block_table[group * group_len..(group + 1) * group_len];
        decode_tables(table, 1, width, rows, positions, size, out)?;
        offset += items;
    }
    Ok(max_seq_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two groups of three rows of four blocks: entry = 100 * group + 10 * row + column + 1.
    fn table() -> Vec<i32> {
        let mut entries = Vec::new();
        for group in 0..2 {
            for row in 0..3 {
                for column in 0..4 {
                    entries.push(100 * group + 10 * row + column + 1);
                }
            }
        }
        entries
    }

    #[test]
    fn tables_and_slots_of_each_group() {
        let block_table = table();
        let mut tables = vec![-1; 2 * 2 * 3];
        let mut slots = vec![-1; 2 * 2];
        let out = DecodeTables {
            tables: &mut tables,
            slots: &mut slots,
        };
        // Sequence 0 is row 2 at position 9 (block 2, offset 1), sequence 1 row 0 at 0.
        decode_tables(&block_table, 2, 4, &[2, 0], &[9, 0], 4, out).unwrap();
        assert_eq!(tables, [21, 22, 23, 1, 2, 3, 121, 122, 123, 101, 102, 103]);
        assert_eq!(slots, [23 * 4 + 1, 4, 123 * 4 + 1, 101 * 4]);
    }

    #[test]
    fn bad_input_writes_nothing_and_says_what_to_change() {
        let mut block_table = table();
        block_table[4 * 3 + 2] = 0; // group 1, row 0, block 2: the null block
        let mut tables = vec![-1; 2 * 3];
        let mut slots = vec![-1; 2];
        let mut call = |rows: &[i64], positions: &[i64]| {
            decode_tables(
                &block_table,
                2,
                4,
                rows,
                positions,
                4,
                DecodeTables {
                    tables: &mut tables,
                    slots: &mut slots,
                },
            )
            .unwrap_err()
            .to_string()
        };
        assert!(call(&[3], &[0]).contains("row 3 of sequence 0 is outside the table's 3 rows"));
        assert!(call(&[0], &[16]).contains("position 16 of sequence 0 is outside"));
        assert!(call(&[0], &[-1]).contains("position -1"));
        assert!(call(&[0], &[9]).contains("group 1, block 2) maps to the null block"));
        assert!(call(&[0, 1], &[0]).contains("1 positions for 2 rows"));
        assert_eq!((tables, slots), (vec![-1; 6], vec![-1; 2]));
    }

    /// What `inputs` returns: the call's result, the positions and slots, the lengths, the
    /// table entries.
    type Inputs = (
        Result<usize, AttentionError>,
        [Vec<i64>; 2],
        Vec<i32>,
        Vec<i32>,
    );

    /// `decode_inputs` over `table()` for sequences at rows 2 and 0, into buffers of 4
    /// positions and lengths, `table_items` table entries and 4 slots, all -1 first.
    fn inputs(computed: &[i64], block_sizes: &[usize], table_items: usize) -> Inputs {
        let block_table = table();
        let (mut positions, mut seq_lens) = (vec![-1; 4], vec![-1; 4]);
        let (mut tables, mut slots) = (vec![-1; table_items], vec![-1; 4]);
        let out = DecodeInputs {
            positions: &mut positions,
            seq_lens: &mut seq_lens,
            tables: &mut tables,
            slots: &mut slots,
        };
        let result = decode_inputs(&block_table, 4, &[2, 0], computed, block_sizes, out);
        (result, [positions, slots], seq_lens, tables)
    }

    #[test]
    fn inputs_of_one_block_size_match_decode_tables() {
        let (longest, [positions, slots], seq_lens, tables) = inputs(&[9, 0], &[4, 4], 20);
        assert_eq!(longest.unwrap(), 10);
        assert_eq!(
            (&positions[..2], &seq_lens[..2]),
            (&[9, 0][..], &[10, 1][..])
        );
        let want = [21, 22, 23, 1, 2, 3, 121, 122, 123, 101, 102, 103];
        assert_eq!((&tables[..12], &tables[12..]), (&want[..], &[-1; 8][..]));
        assert_eq!(slots, [23 * 4 + 1, 4, 123 * 4 + 1, 101 * 4]);
    }

    #[test]
    fn inputs_of_two_block_sizes_lay_each_group_table_after_the_last() {
        // Group 0 in blocks of 4 (3 columns for 10 tokens), group 1 in blocks of 8 (2).
        let (longest, [_, slots], _, tables) = inputs(&[9, 0], &[4, 8], 12);
        assert_eq!(longest.unwrap(), 10);
        assert_eq!(&tables[..10], [21, 22, 23, 1, 2, 3, 121, 122, 101, 102]);
        assert_eq!(slots, [23 * 4 + 1, 4, 122 * 8 + 1, 101 * 8]);
    }

    #[test]
    fn inputs_say_which_buffer_or_count_is_wrong() {
        let message =
            |computed: &[i64], items| inputs(computed, &[4, 4], items).0.unwrap_err().to_string();
        assert!(message(&[9, 0], 11).contains("tables and slots must hold 12 and 4 items"));
        assert!(message(&[9], 12).contains("1 computed counts for 2 rows"));
        assert!(message(&[9, -1], 12).contains("sequence 1 has -1 computed tokens"));
    }
}
