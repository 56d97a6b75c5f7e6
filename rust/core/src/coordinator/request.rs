//! What the coordinator knows about one request.

use crate::hashing::ExtraKeys;
use crate::manager::GroupBlocks;
use crate::types::{BlockHash, BlockId, CacheKey};

#[derive(Debug)]
pub struct RequestState {
    /// The request's rows in the block table (the same row index in every group).
    pub row: usize,
    /// Prompt plus appended (sampled) token ids.
    pub tokens: Vec<u32>,
    pub extra: ExtraKeys,
    /// Tokens computed as of the last `allocate`; never decreases.
    pub num_computed: usize,
    /// Tokens with slots: the largest `num_computed + num_new` allocated so far.
    pub num_allocated: usize,
    /// Chained hashes of the full blocks, one chain per distinct block size.
    pub hash_chains: Vec<Vec<BlockHash>>,
    /// The request's blocks, one entry per group.
    pub groups: Vec<GroupBlocks>,
    /// A hit found by `find_cache_hit`, applied by the first `allocate`.
    pub pending_hit: Option<PendingHit>,
    /// Tokens of the hit the first `allocate` took (0 without one).
    pub hit_tokens: usize,
    /// Marks the request as seen in the `allocate_batch` call with this number.
    pub last_batch: u64,
}

/// A cache hit found but not yet taken.
#[derive(Debug, Clone)]
pub struct PendingHit {
    pub num_tokens: usize,
    /// Per group, the table prefix of the hit (null entries, then the cached blocks).
    pub rows: Vec<Vec<BlockId>>,
    /// Per group, the key of the row's last block when the hit ends inside that block (groups
    /// keyed by sub-blocks): the request takes it for itself instead of sharing it, as it
    /// writes the block's remaining slots.
    pub partial: Vec<Option<CacheKey>>,
}
