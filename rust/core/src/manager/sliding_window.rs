//! Sliding-window attention with window W: the query at position p sees tokens
//! `p - W + 1 ..= p`.
//!
//! ```text
//!   skipped(c) = max(0, c - W + 1)     tokens the next query (position c) no longer sees
//!   B = 2, W = 4:
//!   c = 5:  tokens 0 1 | 2 3 | 4 ...   skipped 2 -> block 0 is released
//!           ^^^^^ not visible from position 5 (sees 2..=5)
//! ```
//!
//! Cache hit: the next query only needs the last `k = cdiv(W - 1, B)` blocks before it, so the
//! search scans from the right for `k` contiguous cached blocks; the rightmost such run wins and
//! everything left of it becomes the null block. A shorter run that reaches block 0 also counts
//! (the whole prefix is cached).

use super::{worst_case_live_blocks, AdmissionLimits, AttentionManager};

#[derive(Clone, Copy, Debug)]
pub struct SlidingWindowManager {
    block_size: usize,
    window: usize,
}

impl SlidingWindowManager {
    pub fn new(block_size: usize, window: usize) -> Self {
        debug_assert!(block_size > 0 && window > 0, "validated by the config");
        SlidingWindowManager { block_size, window }
    }

    /// Blocks a hit must keep: `cdiv(W - 1, B)`.
    pub fn num_blocks_kept(&self) -> usize {
        (self.window - 1).div_ceil(self.block_size)
    }
}

impl AttentionManager for SlidingWindowManager {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_skipped_tokens(&self, num_computed: usize) -> usize {
        (num_computed + 1).saturating_sub(self.window)
    }

    fn first_skipping(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            0
        } else {
            num_tokens.saturating_add(self.window - 1)
        }
    }

    fn longest_hit_blocks(
        &self,
        max_blocks: usize,
        is_cached: &mut dyn FnMut(usize) -> bool,
    ) -> usize {
        let needed = self.num_blocks_kept();
        if needed == 0 {
            // W = 1: a query sees only itself, any prefix is a hit.
            return max_blocks;
        }
        let mut run = 0;
        for index in (0..max_blocks).rev() {
            if is_cached(index) {
                run += 1;
                if run == needed {
                    return index + needed;
                }
            } else {
                run = 0;
            }
        }
        // No full run: a run reaching block 0 is the whole prefix, which also counts.
        run
    }

    fn max_live_blocks(&self, limits: AdmissionLimits) -> usize {
        worst_case_live_blocks(self.block_size, Some(self.window), limits)
    }
}
