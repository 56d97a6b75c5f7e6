//! Token tails: a hit that ends exactly where a freed request's computed tokens ended, inside
//! a block, in every group (`Coordinator::set_token_tails`).
//!
//! Hits otherwise end at a multiple of the hit alignment `L`, so the next turn of a
//! conversation, which resends the history (whose last `c mod L` computed tokens sit in a
//! partly filled block), recomputes up to `L - 1` of its tokens. When a request is freed, the
//! block each group's row ends inside (tokens `i B .. c`, `m = c - i B` of them, `0 < m < B`)
//! is cached under its *tail key*: the hash of those `m` tokens after the parent the block's
//! full key would have (the key of block `i - 1` in the group's chain, the chain's root for
//! block 0), tagged with the group. The length enters the hash, so a tail key never equals a
//! full key; a tail of exactly one key unit after a unit boundary equals the partial key of
//! that unit, which names the same tokens.
//!
//! A lookup asks the first full-attention group (the first group when there is none) for the
//! tails cached after the end of its run of cached full blocks (`TailIndex`, by parent), longest
//! first: a tail of `m` tokens proposes `h = i B + m` when the prompt's tokens there hash to
//! it. `h` is taken when every group can supply it: the blocks of `h`'s window (every block
//! before it for full attention) cached under their full keys, and the block `h` ends inside
//! (when it does) free under that group's tail key of the same `h`; the hit then takes that
//! block for itself (`HitEnd::Take`) and writes its remaining slots, as a hit inside a block
//! of a group keyed by sub-blocks does. A tail hit is used when it is longer than the aligned
//! hit (and than a tail replay's start).
//!
//! ```text
//!   B = 4, a request computed 10 tokens and was freed:
//!     full:   [0,4) [4,8) [8,10)        block 2 cached under tail(key of block 1, tokens 8..10)
//!     window: null  [4,8) [8,10)        (W = 3) block 2 the same, in its group's chain
//!   next turn: the 10 tokens + 5 -> full blocks 0-1, window block 1, both tails -> hit 10
//!   (the aligned hit would be 8)
//! ```

use std::collections::HashMap;

use super::cache_hit::CommonHit;
use super::hit_stats::{HitStats, Lookup};
use super::keys::GroupKeys;
use super::request::{HitEnd, PendingHit};
use super::{AttentionKind, Coordinator};
use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::hashing::{BlockHasher, ExtraKeys};
use crate::manager::GroupBlocks;
use crate::types::{BlockHash, BlockId, CacheKey, GroupId, NULL_BLOCK};

/// The token tails cached so far, by the key of the block before them: `(group, parent hash)
/// -> [(tokens, tail hash)]`. Entries go stale when their block is evicted or taken (checked at
/// lookup: the tail key must still name a free block) and are swept when they outnumber the
/// limit.
#[derive(Debug)]
pub(super) struct TailIndex {
    by_parent: HashMap<CacheKey, Vec<(usize, BlockHash)>>,
    num_entries: usize,
    limit: usize,
}

impl TailIndex {
    pub fn new(num_blocks: usize) -> Self {
        TailIndex {
            by_parent: HashMap::new(),
            num_entries: 0,
            limit: 2 * num_blocks.max(1),
        }
    }

    /// Records a tail of `tokens` tokens with hash `hash` after `parent` (in `parent.group`).
    fn insert<P: BlockAllocator>(
        &mut self,
        pool: &P,
        parent: CacheKey,
        tokens: usize,
        hash: BlockHash,
    ) {
        let entries = self.by_parent.entry(parent).or_default();
        if entries.iter().any(|&(_, known)| known == hash) {
            return;
        }
        entries.push((tokens, hash));
        entries.sort_by_key(|&(tokens, _)| std::cmp::Reverse(tokens));
        self.num_entries += 1;
        if self.num_entries > self.limit {
            self.sweep(pool);
        }
    }

    /// Drops the entries whose tail key no longer names a cached block.
    fn sweep<P: BlockAllocator>(&mut self, pool: &P) {
        let mut kept = 0;
        self.by_parent.retain(|parent, entries| {
            entries.retain(|&(_, hash)| {
                let key = CacheKey {
                    group: parent.group,
                    hash,
                };
                pool.cached_block(key).is_some()
            });
            kept += entries.len();
            !entries.is_empty()
        });
        self.num_entries = kept;
    }

    /// Tails cached after `parent`, longest first.
    pub fn after(&self, parent: CacheKey) -> &[(usize, BlockHash)] {
        self.by_parent.get(&parent).map_or(&[], Vec::as_slice)
    }

    pub fn clear(&mut self) {
        self.by_parent.clear();
        self.num_entries = 0;
    }
}

/// The key a block of `keys.group` ending inside block `index` would be cached under, for the
/// tokens `index B .. end` of `tokens` (`0 < end - index B < B`). `None` when the block before
/// it is not hashed.
pub(super) fn tail_key(
    hasher: &BlockHasher,
    keys: GroupKeys<'_>,
    block_size: usize,
    tokens: &[u32],
    extra: &ExtraKeys,
    end: usize,
) -> Option<CacheKey> {
    let parent = parent_hash(hasher, keys, end / block_size)?;
    Some(tail_key_after(
        hasher, parent, keys.group, block_size, tokens, extra, end,
    ))
}

/// `tail_key` with the parent hash already known.
fn tail_key_after(
    hasher: &BlockHasher,
    parent: BlockHash,
    group: usize,
    block_size: usize,
    tokens: &[u32],
    extra: &ExtraKeys,
    end: usize,
) -> CacheKey {
    let index = end / block_size;
    let start = index * block_size;
    debug_assert!(start < end && end < start + block_size && end <= tokens.len());
    let hash = hasher.hash_partial(parent, index, start, &tokens[start..end], extra);
    CacheKey {
        group: group as GroupId,
        hash,
    }
}

/// The hash a tail in block `index` of the group follows: its full chain entry for block
/// `index - 1`, the root for block 0.
pub(super) fn parent_hash(
    hasher: &BlockHasher,
    keys: GroupKeys<'_>,
    index: usize,
) -> Option<BlockHash> {
    match index {
        0 => Some(hasher.root()),
        _ if index <= keys.num_full() => Some(keys.full(index - 1).hash),
        _ => None,
    }
}

/// When a request is freed with `num_computed` tokens computed: caches the block its row in
/// this group ends inside under the tail key, and records it in `index`; returns the block and
/// its key. Nothing when the computed tokens end on a block boundary or the block was released.
#[allow(clippy::too_many_arguments)]
pub(super) fn cache_token_tail<P: BlockAllocator>(
    pool: &P,
    index: &mut TailIndex,
    hasher: &BlockHasher,
    keys: GroupKeys<'_>,
    blocks: &GroupBlocks,
    block_size: usize,
    tokens: &[u32],
    extra: &ExtraKeys,
    num_computed: usize,
) -> Result<Option<(BlockId, CacheKey)>, CoreError> {
    if num_computed.is_multiple_of(block_size) || num_computed > tokens.len() {
        return Ok(None);
    }
    let block_index = num_computed / block_size;
    let block: BlockId = blocks
        .blocks
        .get(block_index)
        .copied()
        .unwrap_or(NULL_BLOCK);
    if block == NULL_BLOCK {
        return Ok(None);
    }
    let Some(parent) = parent_hash(hasher, keys, block_index) else {
        return Ok(None);
    };
    let key = tail_key_after(
        hasher,
        parent,
        keys.group,
        block_size,
        tokens,
        extra,
        num_computed,
    );
    if !pool.cache_block(block, key)? {
        return Ok(None);
    }
    let parent = CacheKey {
        group: keys.group as GroupId,
        hash: parent,
    };
    let tail_tokens = num_computed - block_index * block_size;
    index.insert(pool, parent, tail_tokens, key.hash);
    Ok(Some((block, key)))
}

/// A hit ending on token tails (see the module docs), in the shape of a pending hit.
pub(super) struct TailHit {
    pub num_tokens: usize,
    pub rows: Vec<Vec<BlockId>>,
    pub ends: Vec<Option<HitEnd>>,
}

impl<P: BlockAllocator> Coordinator<P> {
    /// The longest token-tail hit over `tokens` (hashed in `chains`) longer than `beyond` and at
    /// most `limit` tokens, if token tails are on and one exists. `alone`: what each group
    /// alone accepts (`common_hit`).
    pub(super) fn tail_hit(
        &self,
        chains: &[Vec<BlockHash>],
        tokens: &[u32],
        extra: &ExtraKeys,
        alone: &[usize],
        limit: usize,
        beyond: usize,
    ) -> Option<TailHit> {
        let index = self.tails.as_ref()?;
        let anchor = self.hit_order[0];
        let keys = self.keys.keys(chains, anchor);
        let manager = self.managers[anchor].as_ref();
        let block_size = manager.block_size();
        // Where the anchor's tails may lie: after its run of cached full blocks from block 0
        // for full attention (what it alone accepts, `alone[anchor]`, ends in the block after
        // that run); for a windowed or chunked anchor (a model without full
        // attention), after its last cached full block. Each candidate is checked against
        // every group below.
        let run = if self.config.groups[anchor].kind == AttentionKind::Full {
            alone[anchor] / block_size
        } else {
            let pool = &self.pool;
            let cached = |index: usize| pool.cached_block(keys.full(index)).is_some();
            (0..keys.num_full())
                .rev()
                .find(|&i| cached(i))
                .map_or(0, |i| i + 1)
        };
        let start = run * block_size;
        let parent = CacheKey {
            group: anchor as GroupId,
            hash: parent_hash(&self.hasher, keys, run)?,
        };
        index.after(parent).iter().find_map(|&(tail_tokens, hash)| {
            let end = start + tail_tokens;
            if end > limit || end <= beyond || end > tokens.len() {
                return None;
            }
            let hasher = &self.hasher;
            let own = tail_key_after(hasher, parent.hash, anchor, block_size, tokens, extra, end);
            if own.hash != hash {
                return None;
            }
            self.tail_hit_at(chains, tokens, extra, end, (anchor, own))
        })
    }

    /// The rows of a hit of exactly `end` tokens in every group, ending on a free tail block
    /// where `end` falls inside a block; `None` when some group cannot supply it. `known`: a
    /// group and its tail key at `end`, already hashed.
    fn tail_hit_at(
        &self,
        chains: &[Vec<BlockHash>],
        tokens: &[u32],
        extra: &ExtraKeys,
        end: usize,
        known: (usize, CacheKey),
    ) -> Option<TailHit> {
        let pool = &self.pool;
        let mut rows = Vec::with_capacity(self.managers.len());
        let mut ends = Vec::with_capacity(self.managers.len());
        for (group, manager) in self.managers.iter().enumerate() {
            let keys = self.keys.keys(chains, group);
            let block_size = manager.block_size();
            let whole = end / block_size;
            let released = manager.num_released_blocks(end).min(whole);
            if whole > keys.num_full() {
                return None;
            }
            let mut row = vec![NULL_BLOCK; released];
            for index in released..whole {
                row.push(pool.cached_block(keys.full(index))?);
            }
            let mut tail = None;
            if !end.is_multiple_of(block_size) {
                let key = match known {
                    (known_group, key) if known_group == group => key,
                    _ => tail_key(&self.hasher, keys, block_size, tokens, extra, end)?,
                };
                let block = pool.cached_block(key)?;
                if pool.ref_count(block) != 0 {
                    return None;
                }
                row.push(block);
                tail = Some(HitEnd::Take {
                    block,
                    key,
                    filled: end % block_size,
                });
            }
            rows.push(row);
            ends.push(tail);
        }
        Some(TailHit {
            num_tokens: end,
            rows,
            ends,
        })
    }
}

impl<P: BlockAllocator> Coordinator<P> {
    /// Stores `tail` as the request's pending hit, with its lookup figures (the aligned hit
    /// `common` would have given counted as the tail's baseline); returns its tokens.
    pub(super) fn take_tail_hit(
        &mut self,
        request_id: u64,
        common: &CommonHit,
        tail: TailHit,
    ) -> usize {
        let hit = tail.num_tokens;
        let alone: Vec<usize> = common.alone.iter().map(|&tokens| tokens.max(hit)).collect();
        let state = self
            .requests
            .get_mut(&request_id)
            .expect("the caller checked it");
        let lookup = HitStats::of(Lookup {
            num_tokens: state.tokens.len(),
            max_hit: common.max_hit.max(hit),
            hit,
            prefix_cached: alone[common.limiting],
            alone: &alone,
            next_was_cached: false,
            replay: None,
            tail_from: Some(common.tokens()),
        });
        state.pending_lookup = Some(lookup);
        state.pending_hit = Some(PendingHit {
            num_tokens: hit,
            rows: tail.rows,
            ends: tail.ends,
            frontier: 0,
        });
        hit
    }
}
