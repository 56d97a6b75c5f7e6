//! The hybrid cache hit: the longest prefix every group can take from the cache.
//!
//! Fixed point: start from the longest allowed length (the prompt minus its last token, rounded
//! down to the hit alignment `L`, see `CoordinatorConfig::hit_alignment`); full attention
//! proposes first, then each other group accepts or shortens; repeat until a whole pass shortens
//! nothing. Each shortening is rounded down to a multiple of `L`, so the length only decreases
//! and the loop ends.
//!
//! ```text
//!   L = 4 tokens, prompt of 11 tokens -> start at 8 (token 10 must be computed)
//!   full:   cached blocks 0..4 of 2  -> 8 accepted
//!   window: needs the last k blocks before the hit; best run ends at 6 -> round to 4
//!   full:   4 accepted; window: 4 accepted -> hit = 4 tokens
//! ```
//!
//! A full-attention group keyed by sub-blocks (`k` key units per block, see `keys`) accepts any
//! multiple of the unit: its cached full blocks from the left, then, inside the next block, as
//! many units as a *free* block cached under one of that block's keys holds (a partial key left
//! by a freed request's tail, or the full key). The request takes that block for itself
//! (`take_cached`) because it writes the block's remaining slots; a block in use by another
//! request cannot be taken, so the hit then ends at the last block boundary.
//!
//! ```text
//!   k = 5 units of 16 tokens; cached: block 0 (full key), block 1 under the partial key of
//!   its first 3 units (a previous turn ended at token 80 + 48 + 5)
//!   prompt of 200 tokens -> full blocks: 1 -> block 1 holds 3 units -> 80 + 48 = 128 accepted
//! ```

use super::keys::GroupKeys;
use super::request::PendingHit;
use super::Coordinator;
use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::manager::{hit_row, AttentionManager};
use crate::types::{BlockId, CacheKey};

impl<P: BlockAllocator> Coordinator<P> {
    /// Longest prefix (tokens) every group can hit, stored on the request as its pending hit
    /// (applied by the next `allocate`); nothing in the pool is touched. 0 when prefix caching
    /// is off. Only valid before the request's first `allocate`.
    pub fn find_cache_hit(&mut self, request_id: u64) -> Result<usize, CoreError> {
        let state = self
            .requests
            .get_mut(&request_id)
            .ok_or(CoreError::UnknownRequest { request_id })?;
        if state.num_allocated > 0 {
            return Err(CoreError::InvalidArgument(format!(
                "request {request_id} already holds blocks; look up cache hits before its first \
                 allocate"
            )));
        }
        state.pending_hit = None;
        if !self.config.enable_prefix_caching {
            return Ok(0);
        }
        Self::extend_hashes(&self.hasher, &self.keys.chain_block_sizes, state);
        let num_tokens = state.tokens.len();
        let alignment = self.hit_alignment;
        let mut hit = (num_tokens - 1) / alignment * alignment;
        let pool = &self.pool;
        let keys_of = |group: usize| self.keys.keys(&state.hash_chains, group);
        loop {
            let mut shortened = false;
            for &group in &self.hit_order {
                if hit == 0 {
                    break;
                }
                let manager = self.managers[group].as_ref();
                let accepted = longest_group_hit(pool, manager, keys_of(group), hit);
                let accepted = accepted / alignment * alignment;
                if accepted < hit {
                    hit = accepted;
                    shortened = true;
                }
            }
            if !shortened || hit == 0 {
                break;
            }
        }
        let mut rows = Vec::with_capacity(self.managers.len());
        let mut partial = Vec::with_capacity(self.managers.len());
        for (group, manager) in self.managers.iter().enumerate() {
            // The fixed point only accepts cached blocks; a pool shared with another thread
            // may have evicted one since, which makes the whole hit a miss.
            match group_hit_row(pool, manager.as_ref(), keys_of(group), hit) {
                Some((row, taken)) => {
                    rows.push(row);
                    partial.push(taken);
                }
                None => {
                    hit = 0;
                    break;
                }
            }
        }
        self.prefix_queries += num_tokens as u64;
        self.prefix_hits += hit as u64;
        if hit > 0 {
            state.pending_hit = Some(PendingHit {
                num_tokens: hit,
                rows,
                partial,
            });
        }
        Ok(hit)
    }
}

impl<P: BlockAllocator> Coordinator<P> {
    /// Tokens of the request's pending hit (0 when none): what its first `allocate` must use
    /// as the computed count, unless it starts at 0.
    pub fn pending_hit_tokens(&self, request_id: u64) -> Result<usize, CoreError> {
        let state = self.request(request_id)?;
        Ok(state.pending_hit.as_ref().map_or(0, |hit| hit.num_tokens))
    }
}

/// The longest hit (tokens, at most `max_tokens`) one group accepts.
fn longest_group_hit<P: BlockAllocator>(
    pool: &P,
    manager: &dyn AttentionManager,
    keys: GroupKeys<'_>,
    max_tokens: usize,
) -> usize {
    let block_size = manager.block_size();
    let mut is_cached =
        |index: usize| index < keys.num_full() && pool.cached_block(keys.full(index)).is_some();
    let blocks = manager.longest_hit_blocks(max_tokens / block_size, &mut is_cached);
    let mut tokens = blocks * block_size;
    if keys.units > 1 && tokens < max_tokens {
        let unit = block_size / keys.units;
        if let Some((_, _, filled)) = takeable(pool, keys, blocks) {
            tokens += (filled * unit).min(max_tokens - tokens) / unit * unit;
        }
    }
    tokens
}

/// The table prefix of a hit of `hit` tokens in one group and, when the hit ends inside a
/// block, the key of the block the request takes (the row's last entry). `None` when a needed
/// block is not cached (any more).
fn group_hit_row<P: BlockAllocator>(
    pool: &P,
    manager: &dyn AttentionManager,
    keys: GroupKeys<'_>,
    hit: usize,
) -> Option<(Vec<BlockId>, Option<CacheKey>)> {
    let block_size = manager.block_size();
    let full_blocks = hit / block_size;
    let mut row = hit_row(manager, full_blocks, &mut |index| {
        if index < keys.num_full() {
            pool.cached_block(keys.full(index))
        } else {
            None
        }
    })?;
    if hit.is_multiple_of(block_size) {
        return Some((row, None));
    }
    // Only groups keyed by sub-blocks accept a hit inside a block.
    let unit = block_size / keys.units;
    let (block, key, filled) = takeable(pool, keys, full_blocks)?;
    if filled * unit < hit % block_size {
        return None;
    }
    row.push(block);
    Some((row, Some(key)))
}

/// A free block cached under one of block `index`'s keys (most units first) and how many of
/// its leading units it holds.
fn takeable<P: BlockAllocator>(
    pool: &P,
    keys: GroupKeys<'_>,
    index: usize,
) -> Option<(BlockId, CacheKey, usize)> {
    (1..=keys.units).rev().find_map(|filled| {
        let key = keys.partial(index, filled)?;
        let block = pool.cached_block(key)?;
        (pool.ref_count(block) == 0).then_some((block, key, filled))
    })
}
