//! One manager per attention type.
//!
//! The shared algorithm lives in the provided methods of [`AttentionManager`]; each type
//! overrides two hooks:
//! - [`AttentionManager::num_skipped_tokens`]: how many leading tokens no future query can see
//!   once `c` tokens are computed (0 for full attention);
//! - [`AttentionManager::longest_hit_blocks`]: the longest cache hit this type accepts.
//!
//! A manager holds no per-request state: a request's blocks for one group live in a
//! [`GroupBlocks`] owned by the coordinator, which also mirrors them into the block table.
//!
//! Null-block rule: entries a window (or chunk) released, and the left part of a windowed cache
//! hit, hold [`NULL_BLOCK`]; they are never freed, cached or counted as held.
//!
//! ```text
//!   table row of a sliding-window group, B = 2, W = 4, c = 7 computed tokens:
//!   tokens   0 1 | 2 3 | 4 5 | 6 7
//!   skipped  x x   x x   .       skipped(7) = 7 - 4 + 1 = 4 -> floor(4 / 2) = 2 blocks
//!   row     [ 0  ,  0  , b2  , b3 ]     (0 = the null block)
//! ```

mod chunked_local;
mod full;
mod sliding_window;

pub use chunked_local::ChunkedLocalManager;
pub use full::FullAttentionManager;
pub use sliding_window::SlidingWindowManager;

use std::fmt::Debug;

use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::types::{BlockId, CacheKey, NULL_BLOCK};

/// How many blocks ahead of the one being cached (or looked up) its key is prefetched.
pub const PREFETCH_AHEAD: usize = 6;

/// How many blocks `cache_full_blocks` hands the pool at once.
const CACHE_BATCH: usize = 32;
/// A placeholder key for the unused part of a batch.
const NO_KEY: CacheKey = CacheKey {
    group: 0,
    hash: crate::types::BlockHash(0),
};

/// A request's blocks in one group.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupBlocks {
    /// The request's table row for this group: entry `i` holds tokens `i*B .. (i+1)*B`, or the
    /// null block when released. `blocks.len()` is the row's length in the block table.
    pub blocks: Vec<BlockId>,
    /// Leading entries already released (all null); release resumes here.
    pub num_released: usize,
    /// Leading entries already considered for caching; caching resumes here.
    pub num_cached: usize,
}

impl GroupBlocks {
    /// Non-null entries, i.e. references this request holds in the group.
    pub fn num_held(&self) -> usize {
        self.blocks
            .iter()
            .filter(|&&block| block != NULL_BLOCK)
            .count()
    }
}

/// Limits that bound how many blocks one request can hold at once.
#[derive(Clone, Copy, Debug)]
pub struct AdmissionLimits {
    /// Tokens the request may reach (prompt plus output).
    pub max_total_tokens: usize,
    /// Most tokens computed in one step (one prefill chunk).
    pub max_num_batched_tokens: usize,
}

/// Most tokens of KV a request within `limits` keeps at once when its queries see at most
/// `reach` tokens back (a sliding window or a chunk; `None` for full attention, which keeps
/// them all): the reach minus the query itself plus one step of new tokens, never more than the
/// request's tokens. The planner's exact per-layer bytes read it through the binding.
pub fn worst_case_live_tokens(reach: Option<usize>, limits: AdmissionLimits) -> usize {
    match reach {
        None => limits.max_total_tokens,
        Some(reach) => reach
            .saturating_sub(1)
            .saturating_add(limits.max_num_batched_tokens)
            .min(limits.max_total_tokens),
    }
}

/// Most blocks a request within `limits` holds at once in a group of `block_size`-token blocks
/// whose queries see at most `reach` tokens back: `worst_case_live_tokens` plus one block of
/// misalignment for a windowed group, and never more than all of the request's blocks. Every
/// manager's `max_live_blocks` is this; the planner reads it through the binding.
pub fn worst_case_live_blocks(
    block_size: usize,
    reach: Option<usize>,
    limits: AdmissionLimits,
) -> usize {
    let all_blocks = limits.max_total_tokens.div_ceil(block_size);
    match reach {
        None => all_blocks,
        Some(_) => {
            let live_tokens = worst_case_live_tokens(reach, limits);
            (live_tokens.div_ceil(block_size) + 1).min(all_blocks)
        }
    }
}

/// Everything `cache_full_blocks` needs besides the request's blocks.
pub struct CacheContext<'a> {
    pub pool: &'a dyn BlockAllocator,
    /// The cache key of full block `i` (defined for `i < num_full_blocks`).
    pub key_of: &'a dyn Fn(usize) -> CacheKey,
    /// Blocks whose tokens are all known and scheduled.
    pub num_full_blocks: usize,
    /// Hit lengths are multiples of this many tokens (the lcm of all groups' block sizes).
    pub hit_alignment: usize,
}

/// The per-attention-type block manager. See the module docs.
pub trait AttentionManager: Send + Sync + Debug {
    /// Tokens per block of this group.
    fn block_size(&self) -> usize;

    /// Hook: leading tokens no future query sees once `num_computed` tokens are computed.
    fn num_skipped_tokens(&self, num_computed: usize) -> usize;

    /// Hook: the fewest computed tokens `c` with `num_skipped_tokens(c) >= num_tokens`
    /// (`usize::MAX` when no count skips that many). `num_skipped_tokens` never decreases, so
    /// every `c` below the answer skips fewer.
    fn first_skipping(&self, num_tokens: usize) -> usize;

    /// Hook: the longest hit, in blocks (at most `max_blocks`), this type accepts given which
    /// blocks are cached (`is_cached(i)` for block index `i`).
    fn longest_hit_blocks(
        &self,
        max_blocks: usize,
        is_cached: &mut dyn FnMut(usize) -> bool,
    ) -> usize;

    /// Hook: most blocks a request within `limits` holds at once (admission).
    fn max_live_blocks(&self, limits: AdmissionLimits) -> usize;

    /// Leading entries that are null once `num_computed` tokens are computed.
    fn num_released_blocks(&self, num_computed: usize) -> usize {
        self.num_skipped_tokens(num_computed) / self.block_size()
    }

    /// New blocks needed so the row covers `num_tokens` tokens.
    fn num_new_blocks(&self, row_len: usize, num_tokens: usize) -> usize {
        num_tokens
            .div_ceil(self.block_size())
            .saturating_sub(row_len)
    }

    /// Whether block `index` can ever be part of a hit whose length is a multiple of
    /// `hit_alignment` tokens. Rule: the smallest aligned hit length `h` covering the block must
    /// still need it after the window skips `skipped(h)` tokens; a longer hit skips at least as
    /// much, so if that one does not need the block, none does.
    ///
    /// ```text
    ///   B = 2, W = 4 (k = 2 blocks kept), hit alignment 8 tokens = 4 blocks:
    ///   block     0  1  2  3 | 4  5  6  7
    ///   cached    .  .  x  x | .  .  x  x   (the tail k blocks of each aligned segment)
    /// ```
    fn can_be_hit(&self, index: usize, hit_alignment: usize) -> bool {
        let block_size = self.block_size();
        let block_end = (index + 1) * block_size;
        // Hits aligned to the block size (one block size in the model) need no rounding.
        let smallest_hit = if hit_alignment == block_size {
            block_end
        } else {
            block_end.div_ceil(hit_alignment) * hit_alignment
        };
        self.num_released_blocks(smallest_hit) <= index
    }
}

/// Replaces the entries a window skipped with the null block (the caller has freed or will
/// free the blocks; `pending_release` lists them first). Returns how many were non-null.
pub fn release_nulls(
    manager: &dyn AttentionManager,
    blocks: &mut GroupBlocks,
    num_computed: usize,
) -> usize {
    let range = pending_release(manager, blocks, num_computed);
    let mut released = 0;
    for entry in &mut blocks.blocks[range.clone()] {
        if *entry != NULL_BLOCK {
            *entry = NULL_BLOCK;
            released += 1;
        }
    }
    blocks.num_released = blocks.num_released.max(range.end);
    released
}

/// The entries the release of `num_computed` would free, oldest first (nothing changes).
pub fn pending_release(
    manager: &dyn AttentionManager,
    blocks: &GroupBlocks,
    num_computed: usize,
) -> std::ops::Range<usize> {
    let end = manager
        .num_released_blocks(num_computed)
        .min(blocks.blocks.len());
    blocks.num_released.min(end)..end
}

/// Caches the request's newly full blocks that can ever be hit. Blocks that already carry a
/// key (a hit) or whose key another block holds stay as they are.
pub fn cache_full_blocks(
    manager: &dyn AttentionManager,
    blocks: &mut GroupBlocks,
    context: &CacheContext<'_>,
) -> Result<(), CoreError> {
    let end = context.num_full_blocks.min(blocks.blocks.len());
    // The keys a few blocks on are prefetched, so the cache map's misses overlap: the first
    // `PREFETCH_AHEAD` before the loop, then one per block.
    let prefetch = |index| context.pool.prefetch_key((context.key_of)(index));
    // A group that never skips a token (full attention) can be hit at every block: no test
    // per block.
    let every_block = manager.first_skipping(1) == usize::MAX;
    (blocks.num_cached..end.min(blocks.num_cached + PREFETCH_AHEAD)).for_each(prefetch);
    // Handed to the pool in batches (its counters move once per batch).
    let mut batch = [(NULL_BLOCK, NO_KEY); CACHE_BATCH];
    let mut len = 0;
    for index in blocks.num_cached..end {
        if let Some(ahead) = Some(index + PREFETCH_AHEAD).filter(|&ahead| ahead < end) {
            prefetch(ahead);
        }
        let block = blocks.blocks[index];
        if block == NULL_BLOCK
            || (!every_block && !manager.can_be_hit(index, context.hit_alignment))
        {
            continue;
        }
        batch[len] = (block, (context.key_of)(index));
        len += 1;
        if len == CACHE_BATCH {
            context.pool.cache_blocks(&batch)?;
            len = 0;
        }
    }
    context.pool.cache_blocks(&batch[..len])?;
    blocks.num_cached = blocks.num_cached.max(end);
    Ok(())
}

/// The table prefix of a hit of `hit_blocks` blocks: null entries for what the window skips,
/// then the cached blocks (looked up with `cached`). `None` when a needed block is not cached.
pub fn hit_row(
    manager: &dyn AttentionManager,
    hit_blocks: usize,
    cached: &mut dyn FnMut(usize) -> Option<BlockId>,
) -> Option<Vec<BlockId>> {
    let first_needed = manager
        .num_released_blocks(hit_blocks * manager.block_size())
        .min(hit_blocks);
    let mut row = vec![NULL_BLOCK; hit_blocks];
    for (index, entry) in row.iter_mut().enumerate().skip(first_needed) {
        *entry = cached(index)?;
    }
    Some(row)
}

#[cfg(test)]
mod tests;
