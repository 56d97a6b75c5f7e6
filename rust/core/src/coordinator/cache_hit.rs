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
//! many units as some cached block holds of it ([`HitEnd`]). The request writes that block's
//! remaining slots, so it cannot share it: a free block under one of the block's own keys (a
//! freed request's tail, or a full block nobody uses) is taken (`take_cached`); otherwise a
//! cached full block whose first units match (found through the coordinator's prefix index,
//! which also holds each block's full key for blocks other requests use) is copied into a new
//! block, once the step that computed it has run. Gemma-3's 64-token system prompt inside an
//! 80-token full-attention block is the copy case.
//!
//! ```text
//!   k = 5 units of 16 tokens; cached: block 0 (full key), block 1 under the partial key of
//!   its first 3 units (a previous turn ended at token 80 + 48 + 5)
//!   prompt of 200 tokens -> full blocks: 1 -> block 1 holds 3 units -> 80 + 48 = 128 accepted
//! ```

use std::collections::HashMap;

use super::hit_stats::{HitStats, Lookup};
use super::keys::GroupKeys;
use super::request::{HitEnd, PendingHit};
use super::{extend_chains, AttentionKind, Coordinator, PrefixEntry};
use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::hashing::ExtraKeys;
use crate::manager::{hit_row, AttentionManager, PREFETCH_AHEAD};
use crate::prompt::PromptPrefix;
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, NULL_BLOCK};

/// Blocks of the longest hash chain a probe hashes in its first round.
const PROBE_FIRST_BLOCKS: usize = 4;
/// How much longer each later round of a probe hashes.
const PROBE_GROWTH: usize = 8;

impl<P: BlockAllocator> Coordinator<P> {
    /// Longest prefix (tokens) every group can hit, stored on the request as its pending hit
    /// (applied by the next `allocate`); nothing in the pool is touched. 0 when prefix caching
    /// is off. Only valid before the request's first `allocate`.
    pub fn find_cache_hit(&mut self, request_id: u64) -> Result<usize, CoreError> {
        self.find_cache_hit_within(request_id, None)
    }

    /// `find_cache_hit` for a hit of at most `max_tokens` tokens (`None`: no limit): a caller
    /// that keeps only part of a hit (a waiting request's hold shrunk to give blocks back)
    /// looks it up again within the part it keeps. The tokens past the limit are counted as
    /// alignment misses.
    pub fn find_cache_hit_within(
        &mut self,
        request_id: u64,
        max_tokens: Option<usize>,
    ) -> Result<usize, CoreError> {
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
        self.num_hashed += Self::extend_hashes(&self.hasher, &self.keys.chain_block_sizes, state);
        let num_tokens = state.tokens.len();
        // Lent out while the lookup reads the coordinator; given back below.
        let chains = std::mem::take(&mut state.hash_chains);
        let limit = max_tokens.map_or(num_tokens - 1, |max| max.min(num_tokens - 1));
        let common = self.common_hit(&chains, limit + 1);
        let state = self.requests.get(&request_id).expect("checked above");
        let plain = common.tokens();
        let tail = self.tail_hit(
            &chains,
            &state.tokens,
            &state.extra,
            &common.alone,
            limit,
            plain,
        );
        if let Some(tail) = tail {
            let state = self.requests.get_mut(&request_id).expect("checked above");
            state.hash_chains = chains;
            return Ok(self.take_tail_hit(request_id, &common, tail));
        }
        let (max_hit, alone, limiting) = (common.max_hit, &common.alone, common.limiting);
        let mut hit = common.tokens();
        let frontier = common.replay.map_or(0, |replay| replay.frontier);
        let lookup = self.end_lookup();
        let keys_of = |group: usize| self.keys.keys(&chains, group);
        let mut rows = Vec::with_capacity(self.managers.len());
        let mut ends = Vec::with_capacity(self.managers.len());
        for (group, manager) in self.managers.iter().enumerate() {
            let full = self.config.groups[group].kind == AttentionKind::Full;
            if frontier > 0 && !full {
                // A replay starts this windowed group over at the hit: nothing before it is
                // kept, its window there is taken as new blocks (recomputed).
                rows.push(vec![NULL_BLOCK; manager.num_released_blocks(hit)]);
                ends.push(None);
                continue;
            }
            let group_hit = if frontier > 0 { frontier } else { hit };
            // The fixed point only accepts cached blocks; a pool shared with another thread
            // may have evicted one since, which makes the whole hit a miss.
            match group_hit_row(&lookup, manager.as_ref(), keys_of(group), group_hit) {
                Some((row, end)) => {
                    rows.push(row);
                    ends.push(end);
                }
                None => {
                    hit = 0;
                    break;
                }
            }
        }
        let keys = keys_of(limiting);
        let next_unit = alone[limiting] / (self.managers[limiting].block_size() / keys.units);
        let next_was_cached = (keys.covering(next_unit).iter())
            .any(|&hash| self.evicted_keys.contains(limiting as GroupId, hash));
        let replay = common.replay.filter(|_| hit > 0);
        let lookup_figures = HitStats::of(Lookup {
            num_tokens,
            max_hit,
            hit,
            alone,
            prefix_cached: alone[limiting],
            next_was_cached,
            replay: replay.map(|replay| (common.hit, replay.frontier)),
            tail_from: None,
        });
        let state = self.requests.get_mut(&request_id).expect("checked above");
        state.hash_chains = chains;
        // Counted once the request computes (`allocate`); a later lookup replaces it.
        state.pending_lookup = Some(lookup_figures);
        if hit > 0 {
            state.pending_hit = Some(PendingHit {
                num_tokens: hit,
                rows,
                ends,
                frontier: replay.map_or(0, |replay| replay.frontier),
            });
        }
        Ok(hit)
    }
}

impl<P: BlockAllocator> Coordinator<P> {
    /// The hit `find_cache_hit` would find for a prompt of `tokens` with `extra` keys, without
    /// adding a request or touching anything (not counted in the statistics): what a scheduler
    /// weighs before it admits. 0 when prefix caching is off.
    ///
    /// Hashes growing prefixes of the prompt (`PROBE_FIRST_BLOCKS` of the longest chain's
    /// blocks, `PROBE_GROWTH` times longer each round) until a full-attention group's run of
    /// cached full blocks ends inside the prefix hashed so far, with the next block too: that
    /// run starts at token 0, so no hit reaches past the block after it, and every group accepts
    /// or refuses a hit point by the blocks before it, which are all hashed. So a prompt with nothing cached costs one short round. A model with no
    /// full-attention group hashes the whole prompt.
    pub fn probe_cache_hit(&self, tokens: &[u32], extra: &ExtraKeys) -> Result<usize, CoreError> {
        self.probe_cache_hit_from(&mut { tokens }, extra)
    }

    /// `probe_cache_hit` over a prompt read from the front ([`PromptPrefix`]): only the prefix
    /// the probe hashes is asked for, so a prompt with nothing cached is read for one short
    /// round whatever its length.
    pub fn probe_cache_hit_from<T: PromptPrefix>(
        &self,
        tokens: &mut T,
        extra: &ExtraKeys,
    ) -> Result<usize, T::Error> {
        let len = tokens.len();
        if len == 0 {
            return Err(CoreError::InvalidArgument(
                "the prompt must have at least one token".into(),
            )
            .into());
        }
        extra.validate(len)?;
        if !self.config.enable_prefix_caching {
            return Ok(0);
        }
        let sizes = &self.keys.chain_block_sizes;
        let mut chains = vec![Vec::new(); sizes.len()];
        let full_groups = &self.full_groups;
        let first = PROBE_FIRST_BLOCKS * sizes.iter().copied().max().unwrap_or(1);
        let mut prefix = if full_groups.is_empty() {
            len
        } else {
            first.max(self.hit_alignment + 1).min(len)
        };
        loop {
            let prompt = tokens.prefix(prefix)?;
            extend_chains(&self.hasher, sizes, prompt, extra, &mut chains);
            if prefix == len || self.full_run_ends_before(full_groups, &chains, prefix) {
                let common = self.common_hit(&chains, prefix);
                let plain = common.tokens();
                let tail = self.tail_hit(&chains, prompt, extra, &common.alone, prefix - 1, plain);
                return Ok(tail.map_or(plain, |tail| tail.num_tokens));
            }
            prefix = (PROBE_GROWTH * prefix).min(len);
        }
    }

    /// Whether one of `full_groups` can hit no further than the first `num_tokens` tokens
    /// (hashed in `chains`) reach: its run of cached full blocks from block 0 ends, and the
    /// block after the run (where a hit may still end, inside it) lies within the longest hit
    /// those tokens allow.
    fn full_run_ends_before(
        &self,
        full_groups: &[usize],
        chains: &[Vec<BlockHash>],
        num_tokens: usize,
    ) -> bool {
        let max_hit = (num_tokens - 1) / self.hit_alignment * self.hit_alignment;
        let pool = &self.pool;
        full_groups.iter().any(|&group| {
            let keys = self.keys.keys(chains, group);
            let manager = self.managers[group].as_ref();
            let block_size = manager.block_size();
            let run = cached_run(pool, manager, keys, keys.num_full());
            (run + 1) * block_size <= max_hit
        })
    }

    /// The fixed point over a prompt's hash chains (see the module docs), with what each group
    /// alone accepts and the group whose cached prefix ends first.
    fn common_hit(&self, chains: &[Vec<BlockHash>], num_tokens: usize) -> CommonHit {
        let alignment = self.hit_alignment;
        let max_hit = (num_tokens - 1) / alignment * alignment;
        let lookup = self.end_lookup();
        let keys_of = |group: usize| self.keys.keys(chains, group);
        // What each group alone accepts; the common hit is at most their minimum, and the fixed
        // point from there ends where the one from `max_hit` would (each group's answer is the
        // longest it accepts up to the length asked).
        let longest: Vec<usize> = (0..self.managers.len())
            .map(|group| {
                let manager = self.managers[group].as_ref();
                longest_group_hit(&lookup, manager, keys_of(group), max_hit)
            })
            .collect();
        let alone: Vec<usize> = longest
            .iter()
            .map(|&tokens| tokens / alignment * alignment)
            .collect();
        let mut hit = alone.iter().copied().min().expect("at least one group");
        // The group whose cached prefix ends first: among full-attention groups if any.
        let limiting = self
            .full_groups
            .iter()
            .copied()
            .min_by_key(|&group| alone[group])
            .or_else(|| {
                self.hit_order
                    .iter()
                    .copied()
                    .min_by_key(|&group| alone[group])
            })
            .expect("at least one group");
        // A group accepts the length it answered (before the rounding to `alignment`: a
        // windowed or chunked group's rounded answer needs blocks further left, looked up
        // again), and a full-attention group keyed by its own blocks accepts any shorter length
        // (its cached run starts at block 0): neither is looked up again. Every entry stays a
        // length its group accepts, so a replay's settle over the full-attention groups reuses
        // them.
        let mut accepted_at = longest;
        hit = self.settle(
            &lookup,
            chains,
            &self.hit_order,
            hit,
            &alone,
            &mut accepted_at,
        );
        let replay = self.tail_replay_tokens.and_then(|replay_tokens| {
            let full = &self.full_groups;
            let start = full.iter().map(|&group| alone[group]).min()?;
            let frontier = self.settle(&lookup, chains, full, start, &alone, &mut accepted_at);
            let replay_start = frontier.saturating_sub(replay_tokens) / alignment * alignment;
            // Taken when it saves at least the tokens it recomputes below the frontier (whose
            // windowed KV is never cached): a replay that gains a block for hundreds of
            // recomputed tokens pins the frontier's blocks for little.
            let gain = replay_start.saturating_sub(hit);
            (gain > 0 && gain >= frontier - replay_start).then_some(Replay {
                start: replay_start,
                frontier,
            })
        });
        CommonHit {
            max_hit,
            hit,
            alone,
            limiting,
            replay,
        }
    }

    /// The fixed point over `groups` from `hit`: each group accepts the length or shortens it
    /// (rounded down to the alignment), until a pass shortens nothing. `accepted_at[g]` is a
    /// length group `g` is known to accept (its last answer), so it is not asked again there.
    fn settle(
        &self,
        lookup: &EndLookup<'_, P>,
        chains: &[Vec<BlockHash>],
        groups: &[usize],
        mut hit: usize,
        alone: &[usize],
        accepted_at: &mut [usize],
    ) -> usize {
        let alignment = self.hit_alignment;
        loop {
            let mut shortened = false;
            for &group in groups {
                if hit == 0 {
                    break;
                }
                let keys = self.keys.keys(chains, group);
                let plain_full = keys.units == 1
                    && self.config.groups[group].kind == AttentionKind::Full
                    && hit <= alone[group];
                if hit == accepted_at[group] || plain_full {
                    continue;
                }
                let manager = self.managers[group].as_ref();
                let answer = longest_group_hit(lookup, manager, keys, hit);
                accepted_at[group] = answer;
                let accepted = answer / alignment * alignment;
                if accepted < hit {
                    hit = accepted;
                    shortened = true;
                }
            }
            if !shortened || hit == 0 {
                return hit;
            }
        }
    }
}

impl<P: BlockAllocator> Coordinator<P> {
    fn end_lookup(&self) -> EndLookup<'_, P> {
        EndLookup {
            pool: &self.pool,
            prefix_index: &self.prefix_index,
            epoch: self.copy_epoch,
        }
    }
}

/// What `common_hit` found.
pub(super) struct CommonHit {
    pub max_hit: usize,
    /// The longest prefix every group hits.
    pub hit: usize,
    pub alone: Vec<usize>,
    pub limiting: usize,
    /// A tail replay that starts later than `hit` (only when replay is on).
    replay: Option<Replay>,
}

impl CommonHit {
    /// Tokens the request need not compute: the replay's start, else the hit.
    pub fn tokens(&self) -> usize {
        self.replay.map_or(self.hit, |replay| replay.start)
    }
}

/// A tail replay: the full-attention groups hit `frontier` tokens, the windowed ones start over
/// at `start` (see the module docs).
#[derive(Clone, Copy, Debug)]
struct Replay {
    start: usize,
    frontier: usize,
}

impl<P: BlockAllocator> Coordinator<P> {
    /// Tokens of the request's pending hit (0 when none): what its first `allocate` must use
    /// as the computed count, unless it starts at 0.
    pub fn pending_hit_tokens(&self, request_id: u64) -> Result<usize, CoreError> {
        let state = self.request(request_id)?;
        Ok(state.pending_hit.as_ref().map_or(0, |hit| hit.num_tokens))
    }
}

/// Where the end of a hit inside a block can come from.
struct EndLookup<'a, P> {
    pool: &'a P,
    prefix_index: &'a HashMap<CacheKey, PrefixEntry>,
    /// Entries made in this epoch name blocks whose KV the current step has not computed yet.
    epoch: u64,
}

impl<P: BlockAllocator> EndLookup<'_, P> {
    /// How a hit can use block `index`'s first units (most units first; at equal units a take
    /// before a copy), if any cached block holds some of them.
    fn end(&self, keys: GroupKeys<'_>, index: usize) -> Option<HitEnd> {
        let pool = self.pool;
        (1..=keys.units).rev().find_map(|filled| {
            let key = keys.partial(index, filled)?;
            if let Some(block) = pool.cached_block(key) {
                if pool.ref_count(block) == 0 {
                    return Some(HitEnd::Take { block, key, filled });
                }
            }
            let entry = self.prefix_index.get(&key)?;
            let computed = entry.epoch < self.epoch;
            (computed && pool.cached_block(entry.full) == Some(entry.block)).then_some(
                HitEnd::Copy {
                    src: entry.block,
                    key: entry.full,
                    filled,
                },
            )
        })
    }
}

/// The blocks (at most `max_blocks`) a group's hit can take whole: the manager's longest hit
/// over the group's cached full blocks.
fn cached_run<P: BlockAllocator>(
    pool: &P,
    manager: &dyn AttentionManager,
    keys: GroupKeys<'_>,
    max_blocks: usize,
) -> usize {
    // Managers scan one way (full attention from the left, windows from the right): the key
    // `PREFETCH_AHEAD` further that way is prefetched, so lookups that miss the cache overlap.
    let mut last = None;
    let mut is_cached = |index: usize| {
        let ahead = match last {
            Some(last) if index < last => index.checked_sub(PREFETCH_AHEAD),
            _ => Some(index + PREFETCH_AHEAD),
        };
        last = Some(index);
        if let Some(ahead) = ahead.filter(|&ahead| ahead < keys.num_full()) {
            pool.prefetch_key(keys.full(ahead));
        }
        index < keys.num_full() && pool.cached_block(keys.full(index)).is_some()
    };
    manager.longest_hit_blocks(max_blocks, &mut is_cached)
}

/// The longest hit (tokens, at most `max_tokens`) one group accepts.
fn longest_group_hit<P: BlockAllocator>(
    lookup: &EndLookup<'_, P>,
    manager: &dyn AttentionManager,
    keys: GroupKeys<'_>,
    max_tokens: usize,
) -> usize {
    let pool = lookup.pool;
    let block_size = manager.block_size();
    let blocks = cached_run(pool, manager, keys, max_tokens / block_size);
    let mut tokens = blocks * block_size;
    if keys.units > 1 && tokens < max_tokens {
        let unit = block_size / keys.units;
        if let Some(end) = lookup.end(keys, blocks) {
            tokens += (end.filled() * unit).min(max_tokens - tokens) / unit * unit;
        }
    }
    tokens
}

/// The table prefix of a hit of `hit` tokens in one group and, when the hit ends inside a
/// block, how that block is supplied (a taken block is the row's last entry; a copied one is
/// allocated after the row). `None` when a needed block is not cached (any more).
fn group_hit_row<P: BlockAllocator>(
    lookup: &EndLookup<'_, P>,
    manager: &dyn AttentionManager,
    keys: GroupKeys<'_>,
    hit: usize,
) -> Option<(Vec<BlockId>, Option<HitEnd>)> {
    let pool = lookup.pool;
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
    let end = lookup.end(keys, full_blocks)?;
    if end.filled() * unit < hit % block_size {
        return None;
    }
    if let HitEnd::Take { block, .. } = end {
        row.push(block);
    }
    Some((row, Some(end)))
}
