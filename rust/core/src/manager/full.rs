//! Full attention: every computed token stays visible, so nothing is released and a cache hit
//! is the longest run of cached blocks from the left.

use super::{worst_case_live_blocks, AdmissionLimits, AttentionManager};

#[derive(Clone, Copy, Debug)]
pub struct FullAttentionManager {
    block_size: usize,
}

impl FullAttentionManager {
    pub fn new(block_size: usize) -> Self {
        debug_assert!(block_size > 0, "block size is validated by the config");
        FullAttentionManager { block_size }
    }
}

impl AttentionManager for FullAttentionManager {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_skipped_tokens(&self, _num_computed: usize) -> usize {
        0
    }

    fn first_skipping(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            0
        } else {
            usize::MAX
        }
    }

    fn longest_hit_blocks(
        &self,
        max_blocks: usize,
        is_cached: &mut dyn FnMut(usize) -> bool,
    ) -> usize {
        (0..max_blocks)
            .find(|&index| !is_cached(index))
            .unwrap_or(max_blocks)
    }

    fn max_live_blocks(&self, limits: AdmissionLimits) -> usize {
        worst_case_live_blocks(self.block_size, None, limits)
    }
}
