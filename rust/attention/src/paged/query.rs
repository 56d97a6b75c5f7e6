//! What a paged-attention call computes besides the cache: the query rows, each with its
//! block-table row and visible range, and the score options. Checked once, before any
//! arithmetic.

use crate::error::{ensure, AttentionError};
use crate::layout::HeadShape;

/// The rows to compute, one query token each: its sequence's block-table row and its visible
/// positions `low ..= position`.
#[derive(Clone, Copy, Debug)]
pub struct QueryRows<'a> {
    /// `[num_sequences, table_width]` block ids, row-major.
    pub block_table: &'a [i32],
    pub table_width: usize,
    pub sequence: &'a [i64],
    pub position: &'a [i64],
    pub low: &'a [i64],
}

impl QueryRows<'_> {
    pub fn len(&self) -> usize {
        self.sequence.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequence.is_empty()
    }

    /// (table row, first visible position, last visible position) of row `r`; valid after
    /// `check`.
    #[inline(always)]
    pub(crate) fn span(&self, r: usize) -> (usize, usize, usize) {
        (
            self.sequence[r] as usize,
            self.low[r] as usize,
            self.position[r] as usize,
        )
    }

    /// The blocks that positions `low ..= position` of table row `s` touch, in order: (block
    /// id, offsets in the block, index of the first of them in the visible range); valid after
    /// `check`. An iterator, not a callback, so the loop body stays in the caller (and in its
    /// target features).
    #[inline(always)]
    pub(crate) fn blocks(
        &self,
        (s, low, position): (usize, usize, usize),
        block_size: usize,
    ) -> BlockRuns<'_> {
        BlockRuns {
            table_row: &self.block_table[s * self.table_width..(s + 1) * self.table_width],
            block_size,
            low,
            next: low,
            end: position + 1,
        }
    }

    /// Every row's range is inside its table row, and every block it reads is a real block of
    /// both caches (never the null block 0).
    pub(crate) fn check(&self, block_size: usize, num_blocks: usize) -> Result<(), AttentionError> {
        let rows = self.len();
        ensure(
            self.position.len() == rows && self.low.len() == rows,
            || {
                format!(
                    "sequence, position and low must have one entry per row, got {}, {} and {}",
                    rows,
                    self.position.len(),
                    self.low.len()
                )
            },
        )?;
        ensure(
            self.table_width >= 1 && self.block_table.len().is_multiple_of(self.table_width),
            || {
                format!(
                    "block_table holds {} ids, not a whole number of rows of width {}",
                    self.block_table.len(),
                    self.table_width
                )
            },
        )?;
        let num_sequences = self.block_table.len() / self.table_width;
        for r in 0..rows {
            let (sequence, low, position) = (self.sequence[r], self.low[r], self.position[r]);
            ensure(sequence >= 0 && (sequence as usize) < num_sequences, || {
                format!(
                    "row {r}: sequence {sequence} is not a block-table row (0..{num_sequences})"
                )
            })?;
            ensure(0 <= low && low <= position, || {
                format!("row {r}: visible range {low}..={position} is empty or negative")
            })?;
            let last_block = position as usize / block_size;
            ensure(last_block < self.table_width, || {
                format!(
                    "row {r}: position {position} needs table column {last_block}, the table \
                     has {} columns",
                    self.table_width
                )
            })?;
            for column in low as usize / block_size..=last_block {
                let id = self.block_table[sequence as usize * self.table_width + column];
                if id <= 0 || id as usize >= num_blocks {
                    return Err(AttentionError::InvalidBlock(format!(
                        "row {r}: visible position block {column} maps to block id {id}, which \
                         is {}; every visible position must be in a real block (1..{num_blocks})",
                        if id == 0 {
                            "the null block"
                        } else {
                            "out of range"
                        }
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Iterator of `QueryRows::blocks`.
pub(crate) struct BlockRuns<'a> {
    table_row: &'a [i32],
    block_size: usize,
    low: usize,
    next: usize,
    end: usize,
}

impl Iterator for BlockRuns<'_> {
    type Item = (usize, std::ops::Range<usize>, usize);

    #[inline(always)]
    fn next(&mut self) -> Option<Self::Item> {
        if self.next >= self.end {
            return None;
        }
        let p = self.next;
        let column = p / self.block_size;
        let stop = ((column + 1) * self.block_size).min(self.end);
        let first_offset = p - column * self.block_size;
        self.next = stop;
        Some((
            self.table_row[column] as usize,
            first_offset..first_offset + (stop - p),
            p - self.low,
        ))
    }
}

/// Score options: `scale * q.k`, soft-capped when `softcap` is set; `sinks` holds one logit per
/// query head that joins each softmax denominator.
#[derive(Clone, Copy, Debug)]
pub struct AttentionParams<'a> {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub sinks: Option<&'a [f32]>,
}

impl AttentionParams<'_> {
    pub(crate) fn check(&self, shape: &HeadShape) -> Result<(), AttentionError> {
        ensure(self.scale.is_finite(), || {
            format!("scale must be finite, got {}", self.scale)
        })?;
        if let Some(cap) = self.softcap {
            ensure(cap.is_finite() && cap > 0.0, || {
                format!("softcap must be a positive number, got {cap}")
            })?;
        }
        if let Some(sinks) = self.sinks {
            ensure(sinks.len() == shape.num_heads, || {
                format!(
                    "sinks must hold one logit per query head ({}), got {}",
                    shape.num_heads,
                    sinks.len()
                )
            })?;
        }
        Ok(())
    }
}
