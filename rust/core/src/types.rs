//! Plain value types shared by every module of the core.

/// Index of a block in the pool. Block ids are dense: `0..num_blocks`.
pub type BlockId = u32;

/// The null block: never handed out, never ref-counted, never freed. Block tables use it as the
/// placeholder for positions a sliding window (or a chunked-local chunk) no longer needs, and for
/// the left part of a windowed cache hit.
pub const NULL_BLOCK: BlockId = 0;

/// Index of a KV-cache group (a set of layers that share one block table).
pub type GroupId = u32;

/// A 128-bit chained block hash (see `hashing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u128);

/// The key of a cached block: its chained hash tagged with the group that holds it, so the same
/// tokens cached in two groups are cached and evicted independently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey {
    pub group: GroupId,
    pub hash: BlockHash,
}

/// Counters a pool reports; cheap to read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Blocks in the pool, the null block included.
    pub num_blocks: usize,
    /// Blocks with ref count 0 (cached or not), the null block excluded.
    pub num_free_blocks: usize,
    /// Blocks that currently carry a cache key (in use or free), spares included.
    pub num_cached_blocks: usize,
    /// Of those, the second copies of a key another block holds (see
    /// [`crate::BlockAllocator::cache_block`]).
    pub num_spare_blocks: usize,
    /// Cached blocks whose key was dropped because the block was reused.
    pub num_evictions: u64,
}
