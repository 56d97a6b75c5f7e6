//! `BlockPool`: the lock-free block pool, the default [`crate::BlockAllocator`].
//!
//! # Structure
//!
//! - `blocks`: each block's state word and cache key in atomics, in two arrays (`BlockSlots`,
//!   see `block_state`). Block 0, the null block, has a slot that is never queued, claimed,
//!   touched, cached or freed.
//! - `free_queue`: the LRU free queues (keyless, `Low`, `Normal`, `High`: evicted in that
//!   order) with lazy deletion and the reservation counter (see `free_queue`).
//! - `cache`: the lock-free map `CacheKey -> BlockId` (`cache_map`) of each key's first copy
//!   and its one spare (a block that computed a key another block already held). A lookup that
//!   finds no first copy takes the spare, so a spare stays findable when its twin is evicted
//!   without ever being moved: only the holder of a block (the thread caching it, or the one
//!   that claimed it) adds or removes its map entry, at the slot the block records.
//!
//! # Protocol
//!
//! - `get_new_blocks(k)`: reserve `k` units from the free counter (all or nothing), then pop
//!   entries and claim each valid one by CAS `(0, g, c) -> (1, g+1, 0)`, skipping stale entries.
//!   A claimed block that was cached loses its key: its entry in `cache` (first copy or
//!   spare) is removed, once the popped batch's claims are done; an eviction is counted.
//! - `free_blocks_to(tier)`: validate every id against a snapshot, then release each; the
//!   release that reaches 0 pushes `(block, g)` at the tail of the keyless queue when the state
//!   word had no cached bit, else of `tier`'s queue, and then adds one unit to the counter.
//! - `touch_cached`: CAS `(r, g, 1) -> (r+1, g', 1)` from a snapshot under which the block's key
//!   slots equal the key looked up (so a block evicted and re-cached in between is a miss); when
//!   `r == 0` it first reserves one unit (no unit: miss) and bumps the generation, which makes the
//!   block's queue entry stale.
//! - `take_cached`: CAS `(0, g, 1) -> (1, g+1, 0)` from a snapshot under which the key slots
//!   equal the key, after reserving one unit (no unit: refused); the queue entry goes stale and
//!   the map entry is removed as an eviction's is, without counting one.
//! - `cache_block`: take the block's key slots (`pending` bit, block must be held and
//!   uncached), write the key, insert the block into the map as the key's first copy if it has
//!   none, else as its spare if it has none (else give the slots back), then publish the key
//!   by setting the cached bit (Release).
//! - `cached_block`: the key's first copy, else its spare.
//!
//! Invariants: a block is held (ref count > 0) or free with exactly one valid queue entry (or its
//! release is between the CAS and the push); `cache` maps `key` to `b` (first copy or spare) and `b`
//! cached imply `b`'s key slots hold `key`; a cached bit is cleared before its map entry is removed and set after its
//! map entry is inserted, so a lookup may find a block that is not (or no longer) cached, which
//! `touch_cached` reports as a miss.
//!
//! # Single-threaded behaviour
//!
//! Identical to [`crate::MutexPool`]: same errors, same LRU order, same evictions, same stats
//! (the property tests in `tests/pool_model.rs` check this after every operation, and
//! `tests/pool_contract.rs` runs the same behaviour tests on both pools).
//!
//! # Concurrent behaviour and rejected calls
//!
//! No block is ever lost or handed out twice and ref counts stay exact; the observable
//! departures from a pool behind one lock are these:
//! - `free_blocks` validates against a snapshot of ref counts. A rejected call changes nothing.
//!   A call that passes validation but whose references were released concurrently by another
//!   caller (freeing references it does not hold: a caller bug) skips those ids, releases the
//!   others and reports `DoubleFree` for the first skipped id: a count never goes negative and no
//!   block is queued twice.
//! - `touch_cached` on a free block may miss while every free unit is reserved by allocators (one
//!   of which is about to evict the block anyway), or while the release that freed it is still
//!   pushing its entry and no other unit is free.
//! - `get_new_blocks` may be refused transiently although enough blocks are free: a touch that
//!   lands between a release's CAS and its push borrows a unit backed by another free block
//!   until the release adds its own (a few instructions later); likewise while a compaction
//!   holds its one unit. A caller that treats `NoFreeBlocks` as "preempt and retry" loses at
//!   most one step; no block is ever lost or handed out twice.
//! - `reset_prefix_cache` checks "no block in use" once, then forgets the keys of free cached
//!   blocks one by one; blocks allocated concurrently keep what the allocation left them.
//! - `cache_block` publishes in two steps (map entry, then cached bit): in between,
//!   `cached_block` may return the block and `touch_cached` on it misses.
//! - `stats` reads independent counters, not one snapshot.
//! - `free_queue_order` drains and re-pushes the queue (a debugging aid for a quiescent pool).
//! - A touch that leaves more stale queue entries than there are blocks compacts the queue
//!   (see `free_queue`); meanwhile an allocation of every last free block may be refused.

use std::fmt;

use crate::allocator::{BlockAllocator, FreeTier};
use crate::block_state::{BlockSlot, BlockSlots, Claim, NotHeld, Release, Touch};
use crate::cache_map::{CacheMap, Copy};
use crate::error::CoreError;
use crate::free_queue::{Entry, FreeQueue};
use crate::primitive::{AtomicU64, AtomicUsize, Ordering};
use crate::types::{BlockId, CacheKey, PoolStats, NULL_BLOCK};

/// Frees of at most this many ids check duplicates by a quadratic scan instead of a hash map.
/// `tests/pool_contract.rs` rejects frees of a few ids and of 30 ids, covering both paths.
const SMALL_FREE: usize = 16;

/// How many blocks ahead of the one being released its state word is prefetched: a long
/// request's freed blocks lie all over the pool, and a release takes a few nanoseconds against a
/// miss's hundred. 16 against 8: T2's free 0.89x, T1's 0.99x in 10 alternated replay runs; 32
/// against 16: free 0.94x (T2) and 0.95x (T1) in 12 same-process rounds, `release_320/cold`
/// 0.88x; 64 no better than 32.
const RELEASE_PREFETCH_AHEAD: usize = 32;

/// Entries moved through the free queue per batch (one CAS on a ring's counter each).
const QUEUE_BATCH: usize = 32;

/// Released entries waiting to be pushed together (`release_held_to`).
struct QueueBatch {
    entries: [Entry; QUEUE_BATCH],
    len: usize,
}

impl Default for QueueBatch {
    fn default() -> Self {
        QueueBatch {
            entries: [Entry::default(); QUEUE_BATCH],
            len: 0,
        }
    }
}

/// The lock-free block pool. See the module docs.
pub struct BlockPool {
    /// Each block's state word and key slots, index = block id; slot 0 (the null block) is
    /// never used.
    blocks: BlockSlots,
    /// Free blocks in eviction order (lazily deleted) and the count allocators reserve from.
    free_queue: FreeQueue,
    /// `key -> block` for each key's first copy and its spare (`cached_block` falls back to the
    /// spare), including, transiently, blocks being cached or evicted.
    cache: CacheMap,
    /// Blocks whose cached bit is set, plus those between map insert and publishing; exact
    /// whenever no `cache_block` is in flight.
    num_cached: AtomicUsize,
    /// Spare entries in `cache` (exact whenever no cache call is in flight).
    num_spares: AtomicUsize,
    /// Cached blocks claimed for reuse (keys dropped by lazy eviction).
    num_evictions: AtomicU64,
}

impl fmt::Debug for BlockPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl BlockPool {
    /// Whether `tidy` has work to do: the cache map's TOMBSTONEs have passed their share (an
    /// owner that shares the pool among threads can check this before pausing them to tidy).
    pub fn needs_tidy(&self) -> bool {
        self.cache.needs_rebuild()
    }

    /// A pool of `num_blocks` blocks, block 0 being the null block. Needs at least 2.
    pub fn new(num_blocks: usize) -> Result<Self, CoreError> {
        crate::validate_num_blocks(num_blocks)?;
        let blocks = BlockSlots::new(num_blocks);
        // Compact once stale entries outnumber the blocks: the FIFO stays O(num_blocks).
        let free_queue = FreeQueue::new(num_blocks);
        let entries: Vec<Entry> = (1..num_blocks as BlockId)
            .map(|block| Entry {
                block,
                generation: blocks.slot(block as usize).load().generation(),
            })
            .collect();
        free_queue.push_uncounted(&entries, FreeTier::Normal.queue(false));
        free_queue.count_pushed(entries.len());
        Ok(BlockPool {
            blocks,
            free_queue,
            cache: CacheMap::new(num_blocks),
            num_spares: AtomicUsize::new(0),
            num_cached: AtomicUsize::new(0),
            num_evictions: AtomicU64::new(0),
        })
    }

    fn check_block(&self, block: BlockId) -> Result<BlockSlot<'_>, CoreError> {
        if block == NULL_BLOCK {
            return Err(CoreError::InvalidBlock(
                "the null block (id 0) is never allocated and cannot be freed or cached".into(),
            ));
        }
        self.blocks.get(block as usize).ok_or_else(|| {
            CoreError::InvalidBlock(format!(
                "block id {block} is out of range: the pool has blocks 1..{}",
                self.blocks.len()
            ))
        })
    }

    /// Drops the key of a block this thread just claimed while it was cached (an eviction);
    /// returns that key.
    fn evict(&self, block: BlockId) -> CacheKey {
        let key = self.drop_key(block);
        // Relaxed: statistics only.
        self.num_evictions.fetch_add(1, Ordering::Relaxed);
        key
    }

    /// Drops the key of a block this thread just claimed or took while it was cached (its
    /// entry as the key's first copy or as its spare) and returns it. A spare left alone is
    /// found by lookups (`cached_block`) as it is: nothing is moved, so no map entry ever names
    /// a block its writer does not hold.
    fn drop_key(&self, block: BlockId) -> CacheKey {
        // The claimer holds the block and the cached bit is clear, so nobody rewrites the slots.
        let slot = self.blocks.slot(block as usize);
        let key = slot.key();
        self.remove_entry(slot, key, block);
        // Relaxed: statistics only.
        self.num_cached.fetch_sub(1, Ordering::Relaxed);
        key
    }

    /// Removes the map entry of `block` (held by this thread) for `key`, if it has one.
    fn remove_entry(&self, slot: BlockSlot<'_>, key: CacheKey, block: BlockId) {
        if self.cache.remove(slot.map_slot(), key, block) == Some(Copy::Spare) {
            // Relaxed: statistics only.
            self.num_spares.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// `cache_block` without counting the block in `num_cached` (the caller does, before).
    fn cache_uncounted(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError> {
        let slot = self.check_block(block)?;
        if let Some(alone) = slot.held_alone() {
            return Ok(self.cache_alone(slot, alone, block, key));
        }
        let generation = match slot.begin_caching() {
            Err(NotHeld) => {
                return Err(CoreError::InvalidBlock(format!(
                    "block {block} is free; only a block the caller holds can be cached"
                )))
            }
            Ok(None) => return Ok(false),
            Ok(Some(generation)) => generation,
        };
        // The key is written before the entry is inserted, so whoever finds the entry reads it.
        slot.write_pending_key(key);
        if !self.insert_entry(slot, key, block) {
            slot.abort_caching(generation);
            return Ok(false);
        }
        if !slot.finish_caching(generation, key) {
            self.remove_entry(slot, key, block);
            return Ok(false);
        }
        Ok(true)
    }

    /// Inserts the cache map entry of `block` (its key slots already hold `key`) as the key's
    /// first copy or its spare, and records the slot with the block; false (nothing changed)
    /// when the key has both copies.
    fn insert_entry(&self, slot: BlockSlot<'_>, key: CacheKey, block: BlockId) -> bool {
        let Some((copy, at)) = self.cache.insert(key, block, |block| self.key_of(block)) else {
            return false;
        };
        slot.set_map_slot(at);
        if copy == Copy::Spare {
            // Relaxed: statistics only.
            self.num_spares.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Caches a block its caller holds alone (`BlockSlot::held_alone` returned `alone`): the
    /// key slots are written and the entry inserted without the pending bit, and one CAS
    /// publishes them (one locked instruction where `begin_caching` + `finish_caching` take
    /// two), the common case: a request caching the blocks it just computed.
    fn cache_alone(
        &self,
        slot: BlockSlot<'_>,
        alone: crate::block_state::State,
        block: BlockId,
        key: CacheKey,
    ) -> bool {
        slot.write_key_alone(key);
        if !self.insert_entry(slot, key, block) {
            return false;
        }
        if !slot.publish_alone(alone) {
            self.remove_entry(slot, key, block);
            return false;
        }
        true
    }

    /// Starts loading `block`'s state word into the cache (a hint; ids out of range are ignored).
    fn prefetch_state(&self, block: BlockId) {
        self.blocks.prefetch_state(block as usize);
    }

    /// The key slots of `block`, as the cache map reads them.
    fn key_of(&self, block: BlockId) -> CacheKey {
        self.blocks.slot(block as usize).key()
    }

    /// The queue entry of a block just taken out of the free state by a touch or a take is
    /// stale now: counted so the queue compacts when stale entries pile up.
    fn left_free_queue(&self) {
        self.free_queue.made_stale(|entry| {
            self.blocks
                .slot(entry.block as usize)
                .load()
                .is_free_with(entry.generation)
        });
    }

    /// Checks a whole `free_blocks` call before anything changes; same order and errors as
    /// `MutexPool`.
    fn validate_free(&self, blocks: &[BlockId]) -> Result<(), CoreError> {
        if blocks.len() <= SMALL_FREE {
            for (position, &block) in blocks.iter().enumerate() {
                let slot = self.check_block(block)?;
                let times = blocks[..=position].iter().filter(|&&b| b == block).count();
                if times as u64 > slot.load().ref_count() {
                    return Err(CoreError::DoubleFree { block });
                }
            }
        } else {
            // Sorted, a block's copies are adjacent: one pass counts them. Cheaper than a hash
            // map of counts (a request frees hundreds of blocks at once).
            let mut sorted = blocks.to_vec();
            sorted.sort_unstable();
            for run in sorted.chunk_by(|a, b| a == b) {
                let block = run[0];
                let slot = self.check_block(block)?;
                if run.len() as u64 > slot.load().ref_count() {
                    return Err(CoreError::DoubleFree { block });
                }
            }
        }
        Ok(())
    }
}

impl BlockAllocator for BlockPool {
    fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn num_free_blocks(&self) -> usize {
        self.free_queue.num_countable()
    }

    fn get_new_blocks_noting(
        &self,
        count: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<CacheKey>,
    ) -> Result<(), CoreError> {
        if let Err(free) = self.free_queue.try_reserve(count) {
            return Err(CoreError::NoFreeBlocks {
                requested: count,
                free,
            });
        }
        out.reserve(count);
        let mut taken = 0;
        let mut popped = [Entry::default(); QUEUE_BATCH];
        while taken < count {
            // At most the units still reserved: every valid entry popped is claimed below.
            let batch = (count - taken).min(QUEUE_BATCH);
            let num_popped = self.free_queue.pop_into(&mut popped[..batch]);
            // The batch's state words are prefetched first, so their cache misses overlap.
            for entry in &popped[..num_popped] {
                self.prefetch_state(entry.block);
            }
            // Claimed blocks that were cached are evicted after the claims, their key slots and
            // then their map entries prefetched a step ahead, so those misses overlap too.
            let mut cached = [NULL_BLOCK; QUEUE_BATCH];
            let mut num_cached = 0;
            for entry in &popped[..num_popped] {
                match self
                    .blocks
                    .slot(entry.block as usize)
                    .claim(entry.generation)
                {
                    Claim::Claimed { was_cached } => {
                        if was_cached {
                            self.blocks.prefetch_keys(entry.block as usize);
                            cached[num_cached] = entry.block;
                            num_cached += 1;
                        }
                        out.push(entry.block);
                        taken += 1;
                    }
                    Claim::Stale => self.free_queue.dropped_stale(),
                }
            }
            for &block in &cached[..num_cached] {
                self.cache
                    .prefetch_slot(self.blocks.slot(block as usize).map_slot());
            }
            for &block in &cached[..num_cached] {
                evicted.push(self.evict(block));
            }
        }
        Ok(())
    }

    fn free_blocks_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError> {
        self.validate_free(blocks)?;
        self.release_held_to(blocks, tier)
    }

    fn release_held_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError> {
        let mut error = None;
        let mut now_free = 0;
        // Released entries wait here, per queue (keyless, then keyed), and go in batches.
        let mut batches = [QueueBatch::default(), QueueBatch::default()];
        let queues = [tier.queue(false), tier.queue(true)];
        // The first blocks' state words are prefetched before the loop, which then prefetches
        // `RELEASE_PREFETCH_AHEAD` blocks on as it goes.
        for &block in &blocks[..blocks.len().min(RELEASE_PREFETCH_AHEAD)] {
            self.prefetch_state(block);
        }

        for (index, &block) in blocks.iter().enumerate() {
            // The state words of the blocks a few ahead are prefetched: a request's blocks lie
            // anywhere in the pool, and their cache misses overlap.
            if let Some(&ahead) = blocks.get(index + RELEASE_PREFETCH_AHEAD) {
                self.prefetch_state(ahead);
            }
            let slot = match self.check_block(block) {
                Ok(slot) => slot,
                Err(invalid) => {
                    error.get_or_insert(invalid);
                    continue;
                }
            };
            match slot.release() {
                Release::NowFree { generation, cached } => {
                    let which = usize::from(cached);
                    let batch = &mut batches[which];
                    batch.entries[batch.len] = Entry { block, generation };
                    batch.len += 1;
                    if batch.len == QUEUE_BATCH {
                        self.free_queue
                            .push_uncounted(&batch.entries, queues[which]);
                        batch.len = 0;
                    }
                    now_free += 1;
                }
                Release::StillHeld => {}
                Release::NotHeld => {
                    error.get_or_insert(CoreError::DoubleFree { block });
                }
            }
        }
        for (batch, queue) in batches.iter().zip(queues) {
            self.free_queue
                .push_uncounted(&batch.entries[..batch.len], queue);
        }
        // One unit per block queued above, added once all their entries are in: the counter
        // never runs ahead of the valid entries (`free_queue`).
        self.free_queue.count_pushed(now_free);
        error.map_or(Ok(()), Err)
    }

    fn prefetch_key(&self, key: CacheKey) {
        self.cache.prefetch(key);
    }

    fn cached_block(&self, key: CacheKey) -> Option<BlockId> {
        // A hint: `touch_cached` checks whatever is found.
        self.cache.get(key, |block| self.key_of(block))
    }

    fn touch_cached(&self, block: BlockId, key: CacheKey) -> bool {
        let Ok(slot) = self.check_block(block) else {
            return false;
        };
        let touched = slot.touch(
            key,
            || self.free_queue.try_reserve(1).is_ok(),
            || self.free_queue.unreserve(1),
        );
        match touched {
            Touch::Taken { was_free: true } => {
                self.left_free_queue();
                true
            }
            Touch::Taken { was_free: false } => true,
            Touch::Miss => false,
        }
    }

    fn take_cached(&self, block: BlockId, key: CacheKey) -> bool {
        let Ok(slot) = self.check_block(block) else {
            return false;
        };
        let taken = slot.take(
            key,
            || self.free_queue.try_reserve(1).is_ok(),
            || self.free_queue.unreserve(1),
        );
        if taken {
            self.left_free_queue();
            self.drop_key(block);
        }
        taken
    }

    fn cache_block(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError> {
        self.cache_blocks(&[(block, key)]).map(|cached| cached == 1)
    }

    fn cache_blocks(&self, entries: &[(BlockId, CacheKey)]) -> Result<usize, CoreError> {
        if entries.is_empty() {
            return Ok(0);
        }
        // Counted before any cached bit is published, so a concurrent eviction never underflows
        // it; what did not become cached is taken back at the end. Relaxed: statistics only.
        self.num_cached.fetch_add(entries.len(), Ordering::Relaxed);
        let mut cached = 0;
        let mut result = Ok(());
        for &(block, key) in entries {
            match self.cache_uncounted(block, key) {
                Ok(true) => cached += 1,
                Ok(false) => {}
                Err(error) => {
                    result = Err(error);
                    break;
                }
            }
        }
        if cached < entries.len() {
            self.num_cached
                .fetch_sub(entries.len() - cached, Ordering::Relaxed);
        }
        result.map(|()| cached)
    }

    fn reset_prefix_cache_noting(&self, forgotten: &mut Vec<CacheKey>) -> bool {
        if self.free_queue.num_countable() + 1 != self.blocks.len() {
            return false;
        }
        for (block, slot) in self.blocks.iter().enumerate().skip(1) {
            if let Some(key) = slot.forget_key() {
                forgotten.push(key);
                self.remove_entry(slot, key, block as BlockId);
                // Relaxed: statistics only.
                self.num_cached.fetch_sub(1, Ordering::Relaxed);
            }
        }
        true
    }

    fn ref_count(&self, block: BlockId) -> u32 {
        if block == NULL_BLOCK {
            return 0;
        }
        self.blocks
            .get(block as usize)
            .map_or(0, |slot| slot.load().ref_count() as u32)
    }

    fn cached_blocks(&self) -> Vec<(BlockId, CacheKey)> {
        // A block's key is read under the cached bit; one that changes meanwhile is skipped
        // (a debugging view of a quiescent pool).
        let mut cached = Vec::new();
        for (block, slot) in self.blocks.iter().enumerate().skip(1) {
            let before = slot.load();
            if before.is_cached() {
                let key = slot.key();
                if slot.load() == before {
                    cached.push((block as BlockId, key));
                }
            }
        }
        cached
    }

    fn free_queue_order(&self) -> Vec<BlockId> {
        self.free_queue
            .valid_entries(|entry| {
                self.blocks
                    .slot(entry.block as usize)
                    .load()
                    .is_free_with(entry.generation)
            })
            .into_iter()
            .map(|entry| entry.block)
            .collect()
    }

    fn stats(&self) -> PoolStats {
        PoolStats {
            num_blocks: self.blocks.len(),
            num_free_blocks: self.free_queue.num_countable(),
            // Relaxed: statistics only.
            num_cached_blocks: self.num_cached.load(Ordering::Relaxed),
            num_spare_blocks: self.num_spares.load(Ordering::Relaxed),
            num_evictions: self.num_evictions.load(Ordering::Relaxed),
        }
    }

    fn tidy(&mut self) {
        if !self.needs_tidy() {
            return;
        }
        let blocks = &self.blocks;
        self.cache.rebuild(
            |block| blocks.slot(block as usize).key(),
            |block| blocks.prefetch_keys(block as usize),
            |block, at| blocks.slot(block as usize).set_map_slot(at),
        );
    }
}

// The behaviour `BlockPool` shares with `MutexPool` (the `BlockAllocator` contract) is tested on
// both pools in `tests/pool_contract.rs`; only tests of the lock-free internals stay here.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::types::BlockHash;

    /// A hit-only workload (touch a free cached block, free it again) leaves a stale queue entry
    /// per round; compaction must keep the queue at most `stale_limit` entries longer than the
    /// free blocks. Internal: `MutexPool` unlinks a touched block and has no stale entries. That
    /// the touches hit and the LRU order survives the compactions is checked on both pools by
    /// `hit_only_workload_keeps_lru_order` in `tests/pool_contract.rs`.
    #[test]
    fn hit_only_workload_keeps_the_queue_bounded() {
        let pool = BlockPool::new(8).unwrap();
        let key = CacheKey {
            group: 0,
            hash: BlockHash(1),
        };
        let mut out = Vec::new();
        pool.get_new_blocks(2, &mut out).unwrap();
        assert!(pool.cache_block(out[0], key).unwrap());
        pool.free_blocks(&out).unwrap();
        // Enough rounds to cross the compaction limit many times; fewer under Miri (slow).
        let rounds = if cfg!(miri) { 100 } else { 10_000 };
        for _ in 0..rounds {
            assert!(pool.touch_cached(out[0], key));
            pool.free_blocks(&out[..1]).unwrap();
            // Valid entries (7 free blocks) plus at most `stale_limit` (8) stale ones.
            assert!(pool.free_queue.len() <= 7 + 8, "{}", pool.free_queue.len());
        }
    }

    /// Every block cached, evicted and cached again in turn, 8 at a time, `tidy` before each
    /// allocation as the coordinator calls it: the cache map is rebuilt whenever its TOMBSTONEs
    /// pass their share, and after every round it holds exactly one entry per cached block (an
    /// entry left behind by a rebuild that lost track of a moved one would stay), each found.
    /// The `tidy` contract on both pools is in `tests/pool_contract.rs`.
    #[test]
    fn tidy_rebuilds_the_map_and_keeps_one_entry_per_cached_block() {
        // Smaller under Miri, enough rounds for rebuilds either way.
        let (blocks, rounds) = if cfg!(miri) { (129, 16) } else { (513, 60) };
        let mut pool = BlockPool::new(blocks).unwrap();
        let (mut out, mut keys, mut rebuilds, mut next) = (Vec::new(), Vec::new(), 0, 0u128);
        for _ in 0..rounds {
            keys.clear();
            for _ in 0..(blocks - 1) / 8 {
                if pool.cache.needs_rebuild() {
                    rebuilds += 1;
                }
                pool.tidy();
                assert!(!pool.cache.needs_rebuild());
                out.clear();
                pool.get_new_blocks(8, &mut out).unwrap();
                for &block in &out {
                    next += 1;
                    let key = CacheKey {
                        group: (next % 3) as u32,
                        hash: BlockHash(next.wrapping_mul(0x9e37_79b9_7f4a_7c15) << 17),
                    };
                    assert!(pool.cache_block(block, key).unwrap());
                    keys.push((key, block));
                }
                pool.free_blocks(&out).unwrap();
            }
            assert_eq!(pool.cache.num_live(), pool.stats().num_cached_blocks);
            assert_eq!(pool.cache.counted_tombstones(), pool.cache.num_tombstones());
            for &(key, block) in &keys {
                assert_eq!(pool.cached_block(key), Some(block));
            }
        }
        assert!(rebuilds > 0, "the workload must pile up tombstones");
        assert!(pool.cache.num_tombstones() <= pool.cache.num_slots() / 8 + 32);
    }
}
