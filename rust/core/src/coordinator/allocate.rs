//! `allocate` and `allocate_batch`: window release, taking the pending hit, new blocks and
//! caching, all-or-nothing per request.
//!
//! Order inside one `allocate` (after validation); a step that changes no block (no hit, nothing
//! to release, no new block, no block newly full: most decode steps) only moves the counters:
//!
//! ```text
//!   1. plan    per group: entries the window skips now, hit blocks to touch, new blocks;
//!              refuse (Ok(false), nothing changed) unless the pool can cover it
//!   2. touch   the pending hit's blocks (before any new block is taken, which could evict them);
//!              take the block a hit ends inside for the request alone
//!   3. release skipped entries -> null block, freed newest first to their free tier (`Low`
//!              unless a hit point near the request's end or its own hit needs them)
//!   4. take    all new blocks of all groups in one pool call
//!   5. mirror  the changed entries into the block table; cache newly full blocks
//! ```

use std::collections::HashMap;

use super::eviction_order::{self, release_tier};
use super::hit_stats::HitStats;
use super::keys::GroupKeys;
use super::quiet::QuietBounds;
use super::request::{HitEnd, PendingHit, RequestState};
use super::{AttentionKind, CoordinatorConfig};
use super::{BlockCopy, Coordinator, PrefixEntry, RowRef};
use crate::allocator::{BlockAllocator, FreeTier};
use crate::error::CoreError;
use crate::manager::{
    cache_full_blocks, pending_release, release_nulls, AttentionManager, CacheContext, GroupBlocks,
};
use crate::types::{BlockId, CacheKey, NULL_BLOCK};

/// How many requests ahead of the one being applied `allocate_batch` readies its caching
/// (`prepare_caching`), and how many of its blocks at most.
const PREPARE_AHEAD: usize = 4;
const PREPARED_BLOCKS: usize = 2;

/// One `allocate` call's arguments.
#[derive(Clone, Copy, Debug)]
pub struct AllocateStep {
    pub request_id: u64,
    /// Tokens whose KV is computed (stored) before this step.
    pub num_computed_tokens: usize,
    /// Tokens that need a slot in this step.
    pub num_new_tokens: usize,
}

impl<P: BlockAllocator> Coordinator<P> {
    /// Releases blocks the window skipped, takes the pending hit, allocates blocks for the new
    /// tokens and caches newly full blocks. Returns `Ok(false)` and changes nothing when the pool
    /// lacks blocks. Also `Ok(false)` when the pending cache hit was evicted since
    /// `find_cache_hit` (other requests' allocations reused its blocks): then the pending hit is
    /// dropped, and the request must call `find_cache_hit` again (or start at 0).
    pub fn allocate(&mut self, step: AllocateStep) -> Result<bool, CoreError> {
        self.allocate_keeping(step, 0)
    }

    /// `allocate`, also refused (`Ok(false)`, nothing changed) when fewer than `reserve` free
    /// blocks would be left after it: an admission that leaves the running requests room to
    /// grow, so they do not preempt it (or another) at their next block.
    ///
    /// A first `allocate` may also start inside the pending hit (`0 < computed < hit`): it
    /// takes that shorter hit when every group has one of exactly `computed` tokens (a multiple
    /// of the hit alignment whose blocks are cached), as `find_cache_hit_within` finds it; any
    /// other start is an error that changes nothing.
    pub fn allocate_keeping(
        &mut self,
        step: AllocateStep,
        reserve: usize,
    ) -> Result<bool, CoreError> {
        self.pool.tidy();
        self.shorten_pending_hit(&step)?;
        let state = self.request(step.request_id)?;
        check_step(&self.config, state, &step)?;
        self.allocate_validated(state.row, step, reserve)
    }

    /// Replaces a request's pending hit by the shorter one its first `allocate` starts at
    /// (see `allocate_keeping`); the hit and its lookup figures stay as they were on error.
    fn shorten_pending_hit(&mut self, step: &AllocateStep) -> Result<(), CoreError> {
        let request_id = step.request_id;
        let state = self.request_mut(request_id)?;
        let computed = step.num_computed_tokens;
        let hit = state.pending_hit.as_ref().map_or(0, |hit| hit.num_tokens);
        if state.num_allocated > 0 || computed == 0 || computed >= hit {
            return Ok(());
        }
        let (kept_hit, kept_lookup) = (state.pending_hit.clone(), state.pending_lookup.clone());
        let shorter = self.find_cache_hit_within(request_id, Some(computed))?;
        if shorter == computed {
            return Ok(());
        }
        let state = self.request_mut(request_id)?;
        state.pending_hit = kept_hit;
        state.pending_lookup = kept_lookup;
        Err(CoreError::InvalidArgument(format!(
            "request {request_id}: no cache hit of exactly {computed} tokens (the longest within \
             it is {shorter}); start the first allocate at 0, at a shorter hit, or at the \
             pending hit ({hit})"
        )))
    }

    /// `allocate` for each step in order; stops at the first request that does not fit and
    /// returns how many were allocated. Every step is validated before any is applied, so an
    /// error changes nothing.
    pub fn allocate_batch(&mut self, steps: &[AllocateStep]) -> Result<usize, CoreError> {
        self.pool.tidy();
        let mut rows = std::mem::take(&mut self.rows_scratch);
        let ids = steps.iter().map(|step| step.request_id);
        let result = match self.requests.rows_of(ids, &mut rows) {
            Ok(()) => self.allocate_rows(steps, &rows),
            Err(error) => Err(error),
        };
        self.rows_scratch = rows;
        result
    }

    /// `allocate_batch` over the requests in `rows` (one per step, in order).
    fn allocate_rows(
        &mut self,
        steps: &[AllocateStep],
        rows: &[usize],
    ) -> Result<usize, CoreError> {
        self.batch_number += 1;
        let batch_number = self.batch_number;
        for (step, &row) in steps.iter().zip(rows) {
            let state = self.requests.at_mut(row);
            check_step(&self.config, state, step)?;
            if state.last_batch == batch_number {
                return Err(CoreError::InvalidArgument(format!(
                    "request {} appears twice in one allocate_batch call",
                    step.request_id
                )));
            }
            state.last_batch = batch_number;
        }
        for (step, &row) in steps.iter().zip(rows).take(PREPARE_AHEAD) {
            self.prepare_caching(row, step);
        }
        for (done, (step, &row)) in steps.iter().zip(rows).enumerate() {
            if let (Some(step), Some(&row)) = (
                steps.get(done + PREPARE_AHEAD),
                rows.get(done + PREPARE_AHEAD),
            ) {
                self.prepare_caching(row, step);
            }
            let state = self.requests.at_mut(row);
            if state.pending_hit.is_none()
                && quiet_step(
                    &self.managers,
                    &self.config,
                    &mut self.hit_stats,
                    state,
                    step,
                )
            {
                if !state.copy_sources.is_empty() {
                    release_copy_sources(&self.pool, state);
                }
                continue;
            }
            if !self.allocate_validated(row, *step, 0)? {
                return Ok(done);
            }
        }
        Ok(steps.len())
    }

    /// `allocate` of a validated step for the request in `row`.
    fn allocate_validated(
        &mut self,
        row: usize,
        step: AllocateStep,
        reserve: usize,
    ) -> Result<bool, CoreError> {
        let computed = step.num_computed_tokens;
        let total = computed + step.num_new_tokens;
        let state = self.requests.at_mut(row);
        // Sources of an earlier allocate's copies (only a first allocate asks for copies, so a
        // request that holds some takes no hit now): released once this allocate succeeds, as
        // the step they were for has run.
        let had_copies = !state.copy_sources.is_empty();
        let hit = match state.pending_hit.take() {
            Some(hit) if computed == hit.num_tokens && state.num_allocated == 0 => Some(hit),
            _ => None,
        };

        // The common decode step changes no block (no new one, none leaves the window, none
        // fills up): only the counters move.
        let num_known = total.min(state.tokens.len());
        let config = &self.config;
        if hit.is_none() && quiet_step(&self.managers, config, &mut self.hit_stats, state, &step) {
            if had_copies {
                release_copy_sources(&self.pool, state);
            }
            return Ok(true);
        }

        // A step that only fills blocks (nothing to release, no new block, as one decode step
        // in a block's worth does): caches them, with none of the paths below.
        if hit.is_none() && !had_copies && state.quiet.hold(computed, total, 0) {
            debug_assert!(blocks_unchanged(
                &self.managers,
                &state.groups,
                computed,
                total,
                None
            ));
            advance(&mut self.hit_stats, state, computed, total);
            // The bounds are those of the rows as they are: they say a block fills.
            self.cache_newly_full(row, num_known)?;
            return Ok(true);
        }

        // Nothing to release (the bounds say so; a hit rewrites the rows): section 3 is skipped.
        let releases = hit.is_some() || state.quiet.may_release(computed);
        // Computed again once this step has changed the blocks (an early return leaves none).
        state.quiet = QuietBounds::default();

        // 1. Plan. A tail replay's full-attention rows cover its frontier from the start (the
        // block its hit ends inside included), whatever this step computes.
        let frontier = hit.as_ref().map_or(0, |hit| hit.frontier);
        let groups = &self.config.groups;
        let cover = |group: usize| match groups[group].kind {
            AttentionKind::Full => total.max(frontier),
            _ => total,
        };
        let mut num_new = 0;
        let mut hit_blocks_now_free = 0;
        let mut released_to_free = 0;
        let (chains, layout) = (&state.hash_chains, &self.keys);
        let key_of = |group: usize, index: usize| {
            let taken = hit.as_ref().and_then(|hit| hit.taken_key(group, index));
            taken.unwrap_or_else(|| layout.keys(chains, group).full(index))
        };
        for (group, manager) in self.managers.iter().enumerate() {
            let blocks = &state.groups[group];
            let row_len = match &hit {
                Some(hit) => {
                    let row = &hit.rows[group];
                    for (index, &block) in row.iter().enumerate() {
                        if block == NULL_BLOCK {
                            continue;
                        }
                        let free = self.pool.ref_count(block) == 0;
                        let taken = hit.taken_key(group, index).is_some();
                        if self.pool.cached_block(key_of(group, index)) != Some(block)
                            || (taken && !free)
                        {
                            // Other requests' allocations evicted it (or took it) since
                            // `find_cache_hit`: the hit is gone and must be looked up again.
                            return Ok(false);
                        }
                        hit_blocks_now_free += usize::from(free);
                    }
                    if let Some(HitEnd::Copy { src, key, .. }) = hit.ends[group] {
                        if self.pool.cached_block(key) != Some(src) {
                            return Ok(false);
                        }
                        hit_blocks_now_free += usize::from(self.pool.ref_count(src) == 0);
                    }
                    row.len()
                }
                None => {
                    for index in pending_release(manager.as_ref(), blocks, computed) {
                        let block = blocks.blocks[index];
                        released_to_free +=
                            usize::from(block != NULL_BLOCK && self.pool.ref_count(block) == 1);
                    }
                    blocks.blocks.len()
                }
            };
            num_new += manager.num_new_blocks(row_len, cover(group));
        }
        let needed = num_new + hit_blocks_now_free;
        if needed > 0 && needed + reserve > self.pool.num_free_blocks() + released_to_free {
            state.pending_hit = hit;
            return Ok(false);
        }

        // 2. Touch the hit.
        if let Some(hit) = &hit {
            let taken = touch_hit(
                &self.pool,
                hit,
                &key_of,
                &mut state.copy_sources,
                &mut self.evicted_scratch,
            );
            self.evicted_keys.insert_all(&mut self.evicted_scratch);
            if !taken {
                // Evicted between the lookup and now (only with a pool shared across threads):
                // the request must look its hit up again.
                return Ok(false);
            }
            if let Some(protected) = &mut self.protected {
                for &block in hit
                    .rows
                    .iter()
                    .flatten()
                    .filter(|&&block| block != NULL_BLOCK)
                {
                    protected.hit(block);
                }
                for &block in &state.copy_sources {
                    protected.left(block);
                }
            }
            state.hit_tokens = hit.num_tokens;
            state.replay_frontier = hit.frontier;
            for (group, blocks) in state.groups.iter_mut().enumerate() {
                let manager = self.managers[group].as_ref();
                blocks.blocks.clone_from(&hit.rows[group]);
                blocks.num_released = manager.num_released_blocks(computed);
                // A taken block is not cached: it is cached again once full.
                blocks.num_cached = hit.rows[group].len() - usize::from(hit.takes(group));
                if hit.frontier > 0 && groups[group].kind != AttentionKind::Full {
                    // A replay's windowed KV is recomputed from a partial window, wrong for
                    // some layers before `replay_exact_after` tokens: never cached there.
                    let exact_from = computed + self.replay_exact_after;
                    let first_cached = exact_from.div_ceil(manager.block_size());
                    blocks.num_cached = blocks.num_cached.max(first_cached);
                }
                self.num_references[group] += blocks.num_held();
            }
        }

        // 3. Release what the window skipped, each block to its free tier (`release_tier`); the
        // released entries are written to the table as they are released.
        let mut scratch = std::mem::take(&mut self.scratch);
        let mut low = std::mem::take(&mut self.low_scratch);
        scratch.clear();
        low.clear();
        if releases {
            let caching = self.config.enable_prefix_caching;
            // A hit point other running requests share (they hold its full-attention prefix): the
            // next request with that prefix needs exactly its window, so the window's blocks join
            // the protected tier when it releases them (`eviction_order::shared_hit_point`).
            let shared = caching
                && self.protected.is_some()
                && eviction_order::shared_hit_point(
                    &self.pool,
                    &self.managers,
                    &self.full_groups,
                    state,
                );
            let mut shared_window = std::mem::take(&mut self.shared_scratch);
            shared_window.clear();
            for (group, manager) in self.managers.iter().enumerate() {
                let blocks = &mut state.groups[group];
                let released_range = pending_release(manager.as_ref(), blocks, computed);
                let keys = self.keys.keys(&state.hash_chains, group);
                let hit_window = eviction_order::hit_window(manager.as_ref(), state.hit_tokens);
                for index in released_range.clone().rev() {
                    let block = blocks.blocks[index];
                    if block == NULL_BLOCK {
                        continue;
                    }
                    let tier = if caching {
                        release_tier(
                            manager.as_ref(),
                            index,
                            computed,
                            state.hit_tokens,
                            self.hit_alignment,
                        )
                    } else {
                        FreeTier::Normal
                    };
                    match tier {
                        FreeTier::Low => low.push(block),
                        _ if shared && hit_window.contains(&index) && index < keys.num_full() => {
                            shared_window.push((block, keys.full(index)));
                        }
                        FreeTier::Normal | FreeTier::High => scratch.push(block),
                    }
                }
                let released = release_nulls(manager.as_ref(), blocks, computed);
                self.num_references[group] -= released;
                if hit.is_none() && released > 0 {
                    // Mirrored now: the table shows the release even if no block is taken.
                    let at = RowRef {
                        group,
                        row: state.row,
                    };
                    self.table
                        .write_entries(at, &blocks.blocks, released_range.clone());
                }
            }
            let protect_window = !shared_window.is_empty()
                && self
                    .protected
                    .as_ref()
                    .is_some_and(|protected| protected.has_room(shared_window.len()));
            if !protect_window {
                scratch.extend(shared_window.iter().map(|&(block, _)| block));
            }
            let mut freed = [(&low, FreeTier::Low), (&scratch, FreeTier::Normal)]
                .into_iter()
                .filter(|(list, _)| !list.is_empty())
                .try_for_each(|(list, tier)| self.pool.release_held_to(list, tier));
            if protect_window && freed.is_ok() {
                scratch.clear();
                scratch.extend(shared_window.iter().map(|&(block, _)| block));
                freed = self.pool.release_held_to(&scratch, FreeTier::High);
                if let (Some(protected), Ok(())) = (&mut self.protected, &freed) {
                    protected.joined(&self.pool, &shared_window);
                }
            }
            self.shared_scratch = shared_window;
            if let Err(error) = freed {
                debug_assert!(false, "releasing held blocks failed: {error}");
                self.scratch = scratch;
                self.low_scratch = low;
                return Err(error);
            }
        }
        self.low_scratch = low;

        // 4. Take the new blocks.
        scratch.clear();
        let evicted = &mut self.evicted_scratch;
        let taken = num_new == 0
            || self
                .pool
                .get_new_blocks_noting(num_new, &mut scratch, evicted)
                .is_ok();
        self.evicted_keys.insert_all(&mut self.evicted_scratch);
        if !taken {
            // Another thread took blocks after the plan: undo the hit, keep the release.
            if hit.is_some() {
                undo_hit(&self.pool, &mut self.num_references, state);
            }
            self.scratch = scratch;
            return Ok(false);
        }
        if let Some(protected) = &mut self.protected {
            for &block in &scratch {
                protected.left(block);
            }
        }

        // 5. Hand them out, mirror into the table, cache.
        let mut new_blocks = scratch.iter();
        for (group, manager) in self.managers.iter().enumerate() {
            let blocks = &mut state.groups[group];
            let count = manager.num_new_blocks(blocks.blocks.len(), cover(group));
            let old_len = blocks.blocks.len();
            blocks.blocks.extend(new_blocks.by_ref().take(count));
            self.num_references[group] += count;
            // A hit replaced the row; otherwise only the new blocks are not in the table yet.
            let from = if hit.is_some() { 0 } else { old_len };
            self.table.write_row(
                RowRef {
                    group,
                    row: state.row,
                },
                &blocks.blocks,
                from,
            );
        }
        debug_assert!(new_blocks.next().is_none(), "every new block is handed out");
        if let Some(hit) = &hit {
            let limit = self.config.max_num_reqs * self.managers.len();
            for (group, end) in hit.ends.iter().enumerate() {
                if let Some(HitEnd::Copy { src, .. }) = *end {
                    if self.block_copies.len() >= limit {
                        self.block_copies.clear(); // never taken: a caller without KV pages
                    }
                    let dst = state.groups[group].blocks[hit.rows[group].len()];
                    self.block_copies.push(BlockCopy {
                        request_id: step.request_id,
                        src,
                        dst,
                    });
                }
            }
        }
        advance(&mut self.hit_stats, state, computed, total);
        self.scratch = scratch;
        let caching = self.config.enable_prefix_caching;
        state.quiet = QuietBounds::of(&self.managers, &state.groups, caching);
        self.cache_newly_full(row, num_known)?;
        if had_copies {
            release_copy_sources(&self.pool, self.requests.at_mut(row));
        }
        Ok(true)
    }

    /// Readies a batch's step a few requests ahead of the one being applied, when it will cache
    /// blocks and take none: hashes them now and starts loading the cache map's entries they go
    /// to, so that those misses overlap the requests in between instead of
    /// stalling its own `allocate` (a decode step filling a block is otherwise mostly misses).
    /// Only a hint: the step itself finds the hashes made and hashes nothing twice.
    #[inline(always)]
    fn prepare_caching(&mut self, row: usize, step: &AllocateStep) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let state = self.requests.at_mut(row);
        let computed = step.num_computed_tokens;
        let total = computed + step.num_new_tokens;
        let num_known = total.min(state.tokens.len());
        // Only a step that fills blocks and takes none (a decode step's, which may also release
        // one): a prefill step's blocks are prefetched by its own caching, a few blocks ahead.
        let bounds = state.quiet;
        if state.pending_hit.is_some() || bounds.needs_blocks(total) || !bounds.may_fill(num_known)
        {
            return;
        }
        self.prepare_blocks(row, num_known);
    }

    /// `prepare_caching` of a step that fills blocks and takes none.
    #[inline(never)]
    fn prepare_blocks(&mut self, row: usize, num_known: usize) {
        let state = self.requests.at_mut(row);
        let sizes = &self.keys.chain_block_sizes;
        self.num_hashed += Self::extend_hashes_within(&self.hasher, sizes, state, num_known);
        for (group, manager) in self.managers.iter().enumerate() {
            let keys = self.keys.keys(&state.hash_chains, group);
            let blocks = &state.groups[group];
            let end = (num_known / manager.block_size())
                .min(blocks.blocks.len())
                .min(keys.num_full());
            for index in (blocks.num_cached..end).take(PREPARED_BLOCKS) {
                self.pool.prefetch_key(keys.full(index));
            }
        }
    }

    /// Hashes and caches the blocks of the request in `row` that are full once `num_known`
    /// tokens are computed (prefix caching on), records them, in groups keyed by sub-blocks, in
    /// the prefix index, and computes the request's bounds again.
    /// Its bounds must be those of its rows as they are: when they say no block fills, nothing
    /// is done.
    fn cache_newly_full(&mut self, row: usize, num_known: usize) -> Result<(), CoreError> {
        let caching = self.config.enable_prefix_caching;
        let state = self.requests.at_mut(row);
        if !caching || !state.quiet.may_fill(num_known) {
            return Ok(());
        }
        // Until the blocks are cached: an error leaves no step quiet.
        state.quiet = QuietBounds::default();
        // Cache the blocks that are full once the scheduled tokens are computed.
        // Blocks past the scheduled tokens are hashed when they are scheduled (or looked up).
        let sizes = &self.keys.chain_block_sizes;
        self.num_hashed += Self::extend_hashes_within(&self.hasher, sizes, state, num_known);
        for (group, manager) in self.managers.iter().enumerate() {
            let keys = self.keys.keys(&state.hash_chains, group);
            let context = CacheContext {
                pool: &self.pool,
                key_of: &|index| keys.full(index),
                num_full_blocks: num_known / manager.block_size(),
                hit_alignment: self.hit_alignment,
            };
            let blocks = &mut state.groups[group];
            let from = blocks.num_cached;
            cache_full_blocks(manager.as_ref(), blocks, &context)?;
            if keys.units > 1 {
                let index = &mut self.prefix_index;
                index_prefixes(&self.pool, index, keys, blocks, from, self.copy_epoch);
            }
        }
        if self.prefix_index.len() > self.prefix_index_limit {
            let pool = &self.pool;
            self.prefix_index
                .retain(|_, entry| pool.cached_block(entry.full) == Some(entry.block));
        }
        state.quiet = QuietBounds::of(&self.managers, &state.groups, caching);
        Ok(())
    }
}

/// Applies a validated step without a hit that changes no block (the request's `QuietBounds`
/// hold): only the counters move; the caller gives back any copy sources. Returns false,
/// changing nothing, for any other step. The common decode step, kept small enough to inline
/// into the batch loop.
#[inline]
fn quiet_step(
    managers: &[Box<dyn AttentionManager>],
    config: &CoordinatorConfig,
    hit_stats: &mut HitStats,
    state: &mut RequestState,
    step: &AllocateStep,
) -> bool {
    let computed = step.num_computed_tokens;
    let total = computed + step.num_new_tokens;
    let num_known = total.min(state.tokens.len());
    if !state.quiet.hold(computed, total, num_known) {
        return false;
    }
    debug_assert!(blocks_unchanged(
        managers,
        &state.groups,
        computed,
        total,
        config.enable_prefix_caching.then_some(num_known),
    ));
    advance(hit_stats, state, computed, total);
    true
}

/// Moves a request's counters to a step's: `computed` tokens computed, slots for `total`.
#[inline(always)]
fn advance(hit_stats: &mut HitStats, state: &mut RequestState, computed: usize, total: usize) {
    state.num_computed = computed;
    state.num_allocated = state.num_allocated.max(total);
    count_lookup(hit_stats, state, total);
}

/// Adds the request's pending lookup to the counters once it has slots beyond its hit (see
/// `hit_stats`).
fn count_lookup(stats: &mut HitStats, state: &mut RequestState, total: usize) {
    if total > state.hit_tokens {
        if let Some(lookup) = state.pending_lookup.take() {
            stats.add(&lookup);
        }
    }
}

/// Gives back the references a request's earlier hit held on its copy sources.
fn release_copy_sources<P: BlockAllocator>(pool: &P, state: &mut RequestState) {
    let released = pool.free_blocks(&state.copy_sources);
    debug_assert!(released.is_ok(), "copy sources are held: {released:?}");
    state.copy_sources.clear();
}

/// Whether an `allocate` without a hit to `total` tokens, `computed` of them computed, would
/// leave every group's blocks as they are: nothing to release (`pending_release`), no new block
/// (`num_new_blocks`) and, when caching (`num_known` tokens known), no block newly full
/// (`cache_full_blocks` would start and stop at `num_cached`). What `QuietBounds::hold` answers
/// from the bounds kept with the request, checked against it in debug builds.
fn blocks_unchanged(
    managers: &[Box<dyn AttentionManager>],
    groups: &[GroupBlocks],
    computed: usize,
    total: usize,
    num_known: Option<usize>,
) -> bool {
    managers.iter().zip(groups).all(|(manager, blocks)| {
        let len = blocks.blocks.len();
        pending_release(manager.as_ref(), blocks, computed).is_empty()
            && manager.num_new_blocks(len, total) == 0
            && num_known
                .is_none_or(|known| (known / manager.block_size()).min(len) <= blocks.num_cached)
    })
}

/// Records every key (partial and full) of the blocks `blocks.num_cached` was advanced over
/// (from `from`) that are now cached under their full key, in a group keyed by sub-blocks.
fn index_prefixes<P: BlockAllocator>(
    pool: &P,
    prefix_index: &mut HashMap<CacheKey, PrefixEntry>,
    keys: GroupKeys<'_>,
    blocks: &GroupBlocks,
    from: usize,
    epoch: u64,
) {
    let end = blocks
        .num_cached
        .min(blocks.blocks.len())
        .min(keys.num_full());
    for index in from..end {
        let block = blocks.blocks[index];
        let full = keys.full(index);
        if block == NULL_BLOCK || pool.cached_block(full) != Some(block) {
            continue;
        }
        let entry = PrefixEntry { block, full, epoch };
        for filled in 1..=keys.units {
            let key = keys
                .partial(index, filled)
                .expect("a full block's units are hashed");
            prefix_index.insert(key, entry);
        }
    }
}

/// Takes one reference on every block of the hit (keys from the request's hash chains) and on
/// each copy source (appended to `copy_sources`), and takes the block a hit ends inside for the
/// request alone (`take_cached`, its key appended to `evicted`); when one was evicted in
/// between, gives back the ones taken (sources included) and returns false.
fn touch_hit<P: BlockAllocator>(
    pool: &P,
    hit: &PendingHit,
    key_of: &dyn Fn(usize, usize) -> CacheKey,
    copy_sources: &mut Vec<BlockId>,
    evicted: &mut Vec<CacheKey>,
) -> bool {
    let mut touched: Vec<BlockId> = Vec::new();
    let sources = hit.ends.iter().filter_map(|end| match *end {
        Some(HitEnd::Copy { src, key, .. }) => Some((src, key)),
        _ => None,
    });
    for (src, key) in sources {
        if !pool.touch_cached(src, key) {
            let freed = pool.free_blocks(&touched);
            debug_assert!(freed.is_ok(), "the touched references are held");
            return false;
        }
        touched.push(src);
    }
    let num_sources = touched.len();
    for (group, row) in hit.rows.iter().enumerate() {
        for (index, &block) in row.iter().enumerate() {
            if block == NULL_BLOCK {
                continue;
            }
            let ok = match hit.taken_key(group, index) {
                // A taken block loses its key: it left the cache.
                Some(key) => {
                    pool.take_cached(block, key) && {
                        evicted.push(key);
                        true
                    }
                }
                None => pool.touch_cached(block, key_of(group, index)),
            };
            if !ok {
                touched.reverse();
                let freed = pool.free_blocks(&touched);
                debug_assert!(freed.is_ok(), "the touched references are held");
                return false;
            }
            touched.push(block);
        }
    }
    copy_sources.extend_from_slice(&touched[..num_sources]);
    true
}

/// Checks one step against the request's state and the limits (see `allocate`).
#[inline]
fn check_step(
    config: &CoordinatorConfig,
    state: &RequestState,
    step: &AllocateStep,
) -> Result<(), CoreError> {
    let (computed, new) = (step.num_computed_tokens, step.num_new_tokens);
    let valid = new <= config.max_num_batched_tokens
        && computed
            .checked_add(new)
            .is_some_and(|total| total <= config.max_model_len)
        && computed <= state.tokens.len()
        && computed >= state.num_computed
        && if state.num_allocated == 0 {
            let hit = state.pending_hit.as_ref().map_or(0, |hit| hit.num_tokens);
            computed == 0 || computed == hit
        } else {
            computed <= state.num_allocated
        };
    if valid {
        return Ok(());
    }
    let explained = explain_step(config, state, step);
    debug_assert!(explained.is_err(), "an invalid step is explained");
    explained.and_then(|()| {
        Err(CoreError::InvalidArgument(format!(
            "request {}: invalid step",
            step.request_id
        )))
    })
}

/// `check_step`'s error for an invalid step: the first rule it breaks, said in words.
#[cold]
#[inline(never)]
fn explain_step(
    config: &CoordinatorConfig,
    state: &RequestState,
    step: &AllocateStep,
) -> Result<(), CoreError> {
    let (computed, new) = (step.num_computed_tokens, step.num_new_tokens);
    let invalid = |message: String| Err(CoreError::InvalidArgument(message));
    let id = step.request_id;
    if new > config.max_num_batched_tokens {
        return invalid(format!(
            "request {id}: {new} new tokens exceed max_num_batched_tokens ({})",
            config.max_num_batched_tokens
        ));
    }
    let within_model = match computed.checked_add(new) {
        Some(total) => total <= config.max_model_len,
        None => false,
    };
    if !within_model {
        return invalid(format!(
            "request {id}: {computed} computed + {new} new tokens exceed max_model_len ({})",
            config.max_model_len
        ));
    }
    if computed > state.tokens.len() {
        return invalid(format!(
            "request {id}: {computed} computed tokens but only {} are known; append them first",
            state.tokens.len()
        ));
    }
    if computed < state.num_computed {
        return invalid(format!(
            "request {id}: computed tokens went back from {} to {computed}",
            state.num_computed
        ));
    }
    if state.num_allocated == 0 {
        let hit = state.pending_hit.as_ref().map_or(0, |hit| hit.num_tokens);
        if computed != 0 && computed != hit {
            return invalid(format!(
                "request {id}: the first allocate must start at 0 computed tokens or at the \
                 cache hit ({hit}), not {computed} (`allocate` alone takes a shorter hit)"
            ));
        }
    } else if computed > state.num_allocated {
        return invalid(format!(
            "request {id}: {computed} computed tokens but only {} have slots",
            state.num_allocated
        ));
    }
    Ok(())
}

/// Gives back the references a hit took and clears the request's blocks again.
fn undo_hit<P: BlockAllocator>(pool: &P, num_references: &mut [usize], state: &mut RequestState) {
    let mut held: Vec<BlockId> = std::mem::take(&mut state.copy_sources);
    for (group, blocks) in state.groups.iter_mut().enumerate() {
        held.extend(blocks.blocks.iter().rev().filter(|&&b| b != NULL_BLOCK));
        num_references[group] -= blocks.num_held();
        *blocks = Default::default();
    }
    let freed = pool.free_blocks(&held);
    debug_assert!(freed.is_ok(), "the hit's references are held");
}
