//! The contract between a block pool and the per-attention-type managers.
//!
//! Two pools implement it: the lock-free [`crate::BlockPool`] (the default) and
//! [`crate::MutexPool`] (a `Mutex` around a simple sequential pool: the benchmark baseline and the
//! reference model for tests). Every method takes `&self`, so a pool can be shared across threads.

use crate::error::CoreError;
use crate::types::{BlockId, CacheKey, PoolStats};

/// Where a freed block that still carries a cache key waits for reuse. Allocation takes free
/// blocks without a key first (they hold nothing anyone can hit), then `Low` ones, then
/// `Normal` ones, then `High` ones; oldest first within each. A block freed without a key
/// always joins the first queue, whatever the tier asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FreeTier {
    /// Worth less than the rest: e.g. a windowed block no hit point near the request's end needs.
    Low,
    /// The default.
    #[default]
    Normal,
    /// Expected to be hit again soon: the blocks of a request that still waits to run (a
    /// preempted request, a waiting request's hold given back).
    High,
}

impl FreeTier {
    /// Index of the free queue a block joins: 0 without a key, 1 `Low`, 2 `Normal`, 3 `High`.
    pub(crate) fn queue(self, cached: bool) -> usize {
        match (cached, self) {
            (false, _) => 0,
            (true, FreeTier::Low) => 1,
            (true, FreeTier::Normal) => 2,
            (true, FreeTier::High) => 3,
        }
    }
}

/// Free queues of a pool, in eviction order (see [`FreeTier`]).
pub(crate) const NUM_FREE_QUEUES: usize = 4;

pub trait BlockAllocator: Send + Sync {
    /// Blocks in the pool, the null block included.
    fn num_blocks(&self) -> usize;

    /// Blocks `get_new_blocks` may hand out now.
    fn num_free_blocks(&self) -> usize;

    /// All-or-nothing: takes `count` blocks from the front of the free queues (blocks without a
    /// key first, then [`FreeTier::Low`], [`FreeTier::Normal`], [`FreeTier::High`]; least
    /// recently freed first within each), each with ref count 1, and appends them to `out`. A block taken that still
    /// carries a cache key loses it (lazy eviction). Asking for more than are free returns
    /// `CoreError::NoFreeBlocks` and takes nothing.
    fn get_new_blocks(&self, count: usize, out: &mut Vec<BlockId>) -> Result<(), CoreError> {
        self.get_new_blocks_noting(count, out, &mut Vec::new())
    }

    /// `get_new_blocks`, also appending to `evicted` the key each block taken lost (the
    /// caller's record of what left the cache).
    fn get_new_blocks_noting(
        &self,
        count: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<CacheKey>,
    ) -> Result<(), CoreError>;

    /// Drops one reference from each block, in the order given. A block whose count reaches 0 is
    /// appended to the tail of its free queue: the [`FreeTier::Normal`] one when it carries a
    /// cache key (still hittable until reused), the keyless one otherwise. Callers pass a
    /// request's blocks newest first so the tail of a prefix chain is evicted before its head.
    /// Every id is validated first (not the null block, in range, enough references for the
    /// number of times it appears): a rejected call changes nothing.
    fn free_blocks(&self, blocks: &[BlockId]) -> Result<(), CoreError> {
        self.free_blocks_to(blocks, FreeTier::Normal)
    }

    /// `free_blocks`, cached blocks joining the `tier` queue.
    fn free_blocks_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError>;

    /// `free_blocks_to` for a caller that holds every reference it gives back (the coordinator
    /// returning its requests' blocks): the same outcome when it does, without the validation
    /// pass. When it does not, the call is not all-or-nothing: an id out of range or not held
    /// is skipped (never released twice, never queued twice), the others are released, and the
    /// first such id is reported.
    fn release_held_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError> {
        self.free_blocks_to(blocks, tier)
    }

    /// The block cached under `key`: its first copy, else its spare (the first copy's twin,
    /// left alone when that was evicted); None when neither exists. Does not take a reference.
    fn cached_block(&self, key: CacheKey) -> Option<BlockId>;

    /// Takes one reference on `block`, found by `cached_block(key)`, removing it from the free
    /// queue when it was free. Returns false and changes nothing when the block no longer holds
    /// `key` (it was evicted in between): the caller treats that as a miss.
    fn touch_cached(&self, block: BlockId, key: CacheKey) -> bool;

    /// Takes `block`, found by `cached_block(key)`, for the caller alone: only when it is free
    /// and still holds `key`. It leaves the free queue with ref count 1 and without its key (its
    /// spare, if any, stays findable), its content intact: the caller reuses the
    /// part `key` names and overwrites the rest. Not counted as an eviction. Returns false and
    /// changes nothing when the block is held, holds another key, or (in a pool shared across
    /// threads) every free unit is reserved.
    fn take_cached(&self, block: BlockId, key: CacheKey) -> bool;

    /// Records that `block`, held by the caller, now holds the full block `key`: as the key's
    /// first copy when it has none, else as its spare when it has none: `cached_block` finds
    /// the first copy while it lasts, then the spare, so the content stays findable while either
    /// copy survives (nothing moves between first copy and spare). Returns `Ok(false)` (nothing
    /// changes) when `block` already carries a key or `key` has both copies.
    fn cache_block(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError>;

    /// `cache_block` for each `(block, key)` in order, stopping at the first error; returns how
    /// many became cached. A pool may share work across the batch (the lock-free pool updates
    /// its cached-block counter once, not once per block).
    fn cache_blocks(&self, entries: &[(BlockId, CacheKey)]) -> Result<usize, CoreError> {
        let mut cached = 0;
        for &(block, key) in entries {
            cached += usize::from(self.cache_block(block, key)?);
        }
        Ok(cached)
    }

    /// A hint that `key` is about to be looked up or cached: a pool may start loading what
    /// that touches (the default does nothing).
    fn prefetch_key(&self, _key: CacheKey) {}

    /// Forgets every cache key. Refused (returns false, changes nothing) while any block is in
    /// use, as a reset under running requests would strand their cached blocks.
    fn reset_prefix_cache(&self) -> bool {
        self.reset_prefix_cache_noting(&mut Vec::new())
    }

    /// `reset_prefix_cache`, also appending to `forgotten` every key it drops (nothing when
    /// refused).
    fn reset_prefix_cache_noting(&self, forgotten: &mut Vec<CacheKey>) -> bool;

    /// Current reference count of `block` (0 for free blocks and for the null block).
    fn ref_count(&self, block: BlockId) -> u32;

    /// Free blocks in eviction order. For tests and debugging; not a hot path.
    fn free_queue_order(&self) -> Vec<BlockId>;

    /// Every cached block with the key it is cached under, by block id. For tests and
    /// debugging; not a hot path (reads every block).
    fn cached_blocks(&self) -> Vec<(BlockId, CacheKey)>;

    /// Counters; see [`PoolStats`].
    fn stats(&self) -> PoolStats;

    /// Housekeeping that needs the pool to itself: `BlockPool` rebuilds its cache map once the
    /// entries removed from it (evictions) have left too many tombstones in its probes. Cheap
    /// when there is nothing to do; the coordinator calls it before each allocation. A pool
    /// shared by threads needs its owner to call it now and then, between their calls.
    fn tidy(&mut self) {}
}
