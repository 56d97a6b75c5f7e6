//! Chunked-local attention with chunk C: the sequence is cut into chunks of C tokens and a query
//! sees only the tokens of its own chunk.
//!
//! ```text
//!   skipped(c) = floor(c / C) * C      every chunk before the one position c falls in
//!   B = 2, C = 4:
//!   c = 6:  | 0 1 2 3 | 4 5 ...         skipped 4 -> blocks 0-1 are released
//! ```
//!
//! Cache hit of at most M tokens: the blocks of earlier chunks are not needed (null), so the hit
//! is the start of M's chunk plus the run of cached blocks from there. `C` is a multiple of `B`
//! (checked by the config), so chunk starts fall on block boundaries.

use super::{worst_case_live_blocks, AdmissionLimits, AttentionManager};

#[derive(Clone, Copy, Debug)]
pub struct ChunkedLocalManager {
    block_size: usize,
    chunk: usize,
}

impl ChunkedLocalManager {
    pub fn new(block_size: usize, chunk: usize) -> Self {
        debug_assert!(
            block_size > 0 && chunk > 0 && chunk / block_size * block_size == chunk,
            "validated by the config"
        );
        ChunkedLocalManager { block_size, chunk }
    }
}

impl AttentionManager for ChunkedLocalManager {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_skipped_tokens(&self, num_computed: usize) -> usize {
        num_computed / self.chunk * self.chunk
    }

    fn first_skipping(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.chunk).saturating_mul(self.chunk)
    }

    fn longest_hit_blocks(
        &self,
        max_blocks: usize,
        is_cached: &mut dyn FnMut(usize) -> bool,
    ) -> usize {
        let first_needed = self.num_skipped_tokens(max_blocks * self.block_size) / self.block_size;
        (first_needed..max_blocks)
            .find(|&index| !is_cached(index))
            .unwrap_or(max_blocks)
    }

    fn max_live_blocks(&self, limits: AdmissionLimits) -> usize {
        worst_case_live_blocks(self.block_size, Some(self.chunk), limits)
    }
}
