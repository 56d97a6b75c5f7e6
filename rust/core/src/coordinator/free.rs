//! Freeing a request: its token tails cached, its hit points' windows re-queued, its blocks
//! freed in eviction order (last position first, across groups), into the protected tier when
//! they fit its budget.

use super::{eviction_order, keys, protect, tails, Coordinator, RowRef};
use crate::allocator::{BlockAllocator, FreeTier};
use crate::error::CoreError;

impl<P: BlockAllocator> Coordinator<P> {
    /// Frees every block of the request and releases its row; its emptied vectors are kept
    /// for the next requests (`spares`). The blocks are freed in the order their tokens end,
    /// last first, across groups (see `eviction_order`), so the request's chain is evicted
    /// from its tail backwards in every group at once and stays hittable, if shorter, as it
    /// goes.
    pub fn free_request(&mut self, request_id: u64) -> Result<(), CoreError> {
        let state = self.release_request(request_id)?;
        self.spares.keep(state);
        Ok(())
    }

    /// `free_request`, returning the request's state (its blocks gone) to the caller.
    pub(super) fn release_request(
        &mut self,
        request_id: u64,
    ) -> Result<super::request::RequestState, CoreError> {
        let state = self
            .requests
            .get_mut(&request_id)
            .ok_or(CoreError::UnknownRequest { request_id })?;
        let mut freed = std::mem::take(&mut self.scratch);
        freed.clear();
        let mut keyed = std::mem::take(&mut self.keyed_scratch);
        keyed.clear();
        if self.config.enable_prefix_caching {
            // Only what the request computed is cached (its tail, its hit points' windows): a
            // request freed before computing anything (an admission given back) hashes nothing.
            let computed = state.num_allocated.min(state.tokens.len());
            let sizes = &self.keys.chain_block_sizes;
            self.num_hashed += Self::extend_hashes_within(&self.hasher, sizes, state, computed);
            for (group, manager) in self.managers.iter().enumerate() {
                let keys = self.keys.keys(&state.hash_chains, group);
                let blocks = &state.groups[group];
                let block_size = manager.block_size();
                let tail = match &mut self.tails {
                    Some(index) => tails::cache_token_tail(
                        &self.pool,
                        index,
                        &self.hasher,
                        keys,
                        blocks,
                        block_size,
                        &state.tokens,
                        &state.extra,
                        computed,
                    ),
                    None => {
                        keys::cache_partial_tail(&self.pool, keys, blocks, block_size, computed)
                            .map(|()| None)
                    }
                };
                debug_assert!(tail.is_ok(), "the request holds its tail block: {tail:?}");
                if self.protected.is_some() {
                    protect::keyed_blocks(keys, blocks, tail.ok().flatten(), &mut keyed);
                }
            }
            eviction_order::retouch_hit_points(
                &self.pool,
                &self.managers,
                state,
                &self.keys,
                self.hit_alignment,
                &mut self.order_scratch,
            );
            if let Some(protected) = &mut self.protected {
                for &(_, block) in &self.order_scratch {
                    protected.left(block);
                }
            }
        } else {
            self.order_scratch.clear();
        }
        let mut result = Ok(());
        if self.protected.is_some() && !self.order_scratch.is_empty() {
            // The windows of its hit points are no chain a later turn continues: plain LRU.
            self.order_scratch
                .sort_by_key(|&(end, _)| std::cmp::Reverse(end));
            freed.extend(self.order_scratch.drain(..).map(|(_, block)| block));
            result = self.pool.release_held_to(&freed, FreeTier::Normal);
            freed.clear();
        }
        eviction_order::order_for_free(&self.managers, state, &mut self.order_scratch, &mut freed);
        freed.extend_from_slice(&state.copy_sources);
        let protect = match &mut self.protected {
            Some(protected) => protected.admits(&self.pool, keyed.len()),
            None => false,
        };
        let tier = if protect {
            FreeTier::High
        } else {
            FreeTier::Normal
        };
        if result.is_ok() {
            result = self.pool.release_held_to(&freed, tier);
        }
        if let (Some(protected), true, Ok(())) = (&mut self.protected, protect, &result) {
            protected.joined(&self.pool, &keyed);
        }
        self.keyed_scratch = keyed;
        self.scratch = freed;
        if let Err(error) = result {
            debug_assert!(false, "freeing a request's held blocks failed: {error}");
            return Err(error);
        }
        let state = self.requests.remove(&request_id).expect("checked above");

        for (group, blocks) in state.groups.iter().enumerate() {
            self.num_references[group] -= blocks.num_held();
            self.table.write_row(
                RowRef {
                    group,
                    row: state.row,
                },
                &[],
                0,
            );
        }
        self.free_rows.push(state.row);
        Ok(state)
    }
}
