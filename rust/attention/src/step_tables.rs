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
}
