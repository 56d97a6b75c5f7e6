//! The contract between a block pool and the per-attention-type managers.
//!
//! Two pools implement it: the lock-free [`crate::BlockPool`] (the default) and
//! [`crate::MutexPool`] (a `Mutex` around a simple sequential pool: the benchmark baseline and the
//! reference model for tests). Every method takes `&self`, so a pool can be shared across threads.

use crate::error::CoreError;
use crate::types::{BlockId, CacheKey, PoolStats};

pub trait BlockAllocator: Send + Sync {
    /// Blocks in the pool, the null block included.
    fn num_blocks(&self) -> usize;

    /// Blocks `get_new_blocks` may hand out now.
    fn num_free_blocks(&self) -> usize;

    /// All-or-nothing: takes `count` blocks from the front of the free queue (least recently
    /// freed first), each with ref count 1, and appends them to `out`. A block taken that still
    /// carries a cache key loses it (lazy eviction). Asking for more than are free returns
    /// `CoreError::NoFreeBlocks` and takes nothing.
    fn get_new_blocks(&self, count: usize, out: &mut Vec<BlockId>) -> Result<(), CoreError>;

    /// Drops one reference from each block, in the order given. A block whose count reaches 0 is
    /// appended to the free-queue tail, keeping its cache key (still hittable until reused).
    /// Callers pass a request's blocks newest first so the tail of a prefix chain is evicted
    /// before its head. Every id is validated first (not the null block, in range, enough
    /// references for the number of times it appears): a rejected call changes nothing.
    fn free_blocks(&self, blocks: &[BlockId]) -> Result<(), CoreError>;

    /// The block cached under `key`, if any. Does not take a reference.
    fn cached_block(&self, key: CacheKey) -> Option<BlockId>;

    /// Takes one reference on `block`, found by `cached_block(key)`, removing it from the free
    /// queue when it was free. Returns false and changes nothing when the block no longer holds
    /// `key` (it was evicted in between): the caller treats that as a miss.
    fn touch_cached(&self, block: BlockId, key: CacheKey) -> bool;

    /// Records that `block`, held by the caller, now holds the full block `key`. Returns
    /// `Ok(false)` when `key` is already cached by another block (the first one stays cached;
    /// this one stays uncached) or when `block` already carries a key.
    fn cache_block(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError>;

    /// Forgets every cache key. Refused (returns false, changes nothing) while any block is in
    /// use, as a reset under running requests would strand their cached blocks.
    fn reset_prefix_cache(&self) -> bool;

    /// Current reference count of `block` (0 for free blocks and for the null block).
    fn ref_count(&self, block: BlockId) -> u32;

    /// Free blocks in eviction order. For tests and debugging; not a hot path.
    fn free_queue_order(&self) -> Vec<BlockId>;

    /// Counters; see [`PoolStats`].
    fn stats(&self) -> PoolStats;
}
