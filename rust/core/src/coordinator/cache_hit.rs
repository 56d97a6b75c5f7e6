//! The hybrid cache hit: the longest prefix every group can take from the cache.
//!
//! Fixed point: start from the longest allowed length (the prompt minus its last token, rounded
//! down to the lcm `L` of the block sizes); full attention proposes first, then each other group
//! accepts or shortens; repeat until a whole pass shortens nothing. Each shortening is rounded
//! down to a multiple of `L`, so the length only decreases and the loop ends.
//!
//! ```text
//!   L = 4 tokens, prompt of 11 tokens -> start at 8 (token 10 must be computed)
//!   full:   cached blocks 0..4 of 2  -> 8 accepted
//!   window: needs the last k blocks before the hit; best run ends at 6 -> round to 4
//!   full:   4 accepted; window: 4 accepted -> hit = 4 tokens
//! ```

use super::request::PendingHit;
use super::Coordinator;
use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::manager::hit_row;
use crate::types::{BlockHash, CacheKey, GroupId};

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
        Self::extend_hashes(&self.hasher, &self.chain_block_sizes, state);
        let num_tokens = state.tokens.len();
        let alignment = self.hit_alignment;
        let mut hit = (num_tokens - 1) / alignment * alignment;
        let lookup = HitLookup {
            pool: &self.pool,
            chains: &state.hash_chains,
            chain_of_group: &self.chain_of_group,
        };
        loop {
            let mut shortened = false;
            for &group in &self.hit_order {
                if hit == 0 {
                    break;
                }
                let manager = &self.managers[group];
                let block_size = manager.block_size();
                let accepted_blocks = manager.longest_hit_blocks(hit / block_size, &mut |index| {
                    lookup.is_cached(group, index)
                });
                let accepted = accepted_blocks * block_size / alignment * alignment;
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
        for (group, manager) in self.managers.iter().enumerate() {
            let hit_blocks = hit / manager.block_size();
            let row = hit_row(manager.as_ref(), hit_blocks, &mut |index| {
                lookup.pool.cached_block(lookup.key(group, index))
            });
            // The fixed point only accepts cached blocks; a pool shared with another thread
            // may have evicted one since, which makes the whole hit a miss.
            match row {
                Some(row) => rows.push(row),
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

/// Cache lookups for one request.
struct HitLookup<'a, P> {
    pool: &'a P,
    chains: &'a [Vec<BlockHash>],
    chain_of_group: &'a [usize],
}

impl<P: BlockAllocator> HitLookup<'_, P> {
    fn key(&self, group: usize, index: usize) -> CacheKey {
        CacheKey {
            group: group as GroupId,
            hash: self.chains[self.chain_of_group[group]][index],
        }
    }

    fn is_cached(&self, group: usize, index: usize) -> bool {
        self.pool.cached_block(self.key(group, index)).is_some()
    }
}
