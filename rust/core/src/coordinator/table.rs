//! The persistent grouped block table that Python and the kernels read.
//!
//! Layout: `entries[group][row][block]` (i32, row-major, `max_blocks_per_req` wide) and
//! `lengths[group][row]` (entries in use). Both are allocated once at construction and never
//! reallocated, so a pointer handed to Python stays valid for the coordinator's lifetime.
//!
//! Entries are `AtomicI32` written with `Relaxed` stores: the same machine code as plain
//! stores, but sound while another party (a numpy view) reads the memory through a raw pointer.
//! Readers get no ordering guarantee from this; the binding serialises access with the GIL.

use std::sync::atomic::{AtomicI32, Ordering};

use crate::types::{BlockId, NULL_BLOCK};

#[derive(Debug)]
pub struct BlockTable {
    /// `num_groups * max_num_reqs * max_blocks_per_req` entries; unused entries are the null
    /// block.
    entries: Box<[AtomicI32]>,
    /// `num_groups * max_num_reqs` row lengths.
    lengths: Box<[AtomicI32]>,
    num_groups: usize,
    max_num_reqs: usize,
    max_blocks_per_req: usize,
}

/// Where one row of one group lives.
#[derive(Clone, Copy, Debug)]
pub struct RowRef {
    pub group: usize,
    pub row: usize,
}

impl BlockTable {
    pub fn new(num_groups: usize, max_num_reqs: usize, max_blocks_per_req: usize) -> Self {
        let zeros = |count: usize| (0..count).map(|_| AtomicI32::new(0)).collect();
        BlockTable {
            entries: zeros(num_groups * max_num_reqs * max_blocks_per_req),
            lengths: zeros(num_groups * max_num_reqs),
            num_groups,
            max_num_reqs,
            max_blocks_per_req,
        }
    }

    pub fn shape(&self) -> [usize; 3] {
        [self.num_groups, self.max_num_reqs, self.max_blocks_per_req]
    }

    fn row_start(&self, at: RowRef) -> usize {
        (at.group * self.max_num_reqs + at.row) * self.max_blocks_per_req
    }

    /// Writes `blocks[from..]` into the row and sets its length to `blocks.len()`; entries past
    /// the new length (a shrunk row) are reset to the null block.
    pub fn write_row(&self, at: RowRef, blocks: &[BlockId], from: usize) {
        debug_assert!(blocks.len() <= self.max_blocks_per_req, "row overflow");
        let start = self.row_start(at);
        let length = &self.lengths[at.group * self.max_num_reqs + at.row];
        let old_len = length.load(Ordering::Relaxed) as usize;
        for (index, &block) in blocks.iter().enumerate().skip(from) {
            self.entries[start + index].store(block as i32, Ordering::Relaxed);
        }
        for index in blocks.len()..old_len {
            self.entries[start + index].store(NULL_BLOCK as i32, Ordering::Relaxed);
        }
        length.store(blocks.len() as i32, Ordering::Relaxed);
    }

    /// Writes `blocks[range]` into the row's same entries; its length stays (a window's
    /// released entries, now null, inside a row that keeps its length).
    pub fn write_entries(&self, at: RowRef, blocks: &[BlockId], range: std::ops::Range<usize>) {
        let start = self.row_start(at);
        for (index, &block) in range.clone().zip(&blocks[range]) {
            self.entries[start + index].store(block as i32, Ordering::Relaxed);
        }
    }

    /// Entry `index` of a row.
    pub fn entry(&self, at: RowRef, index: usize) -> i32 {
        self.entries[self.row_start(at) + index].load(Ordering::Relaxed)
    }

    /// Entries in use in a row.
    pub fn row_len(&self, at: RowRef) -> usize {
        self.lengths[at.group * self.max_num_reqs + at.row].load(Ordering::Relaxed) as usize
    }

    /// Start of the entries, for zero-copy views. Valid as long as the table lives.
    pub fn entries_ptr(&self) -> *const i32 {
        self.entries.as_ptr().cast()
    }

    /// Start of the row lengths, for zero-copy views. Valid as long as the table lives.
    pub fn lengths_ptr(&self) -> *const i32 {
        self.lengths.as_ptr().cast()
    }
}
