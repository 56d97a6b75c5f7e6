//! hybrid-cache-core: a KV-cache block allocator for models that mix full attention with
//! sliding-window and chunked-local attention. Pure Rust; the Python binding lives in a
//! separate crate.

pub mod allocator;
pub mod block_pool;
mod block_state;
mod cache_map;
pub mod coordinator;
pub mod error;
mod free_queue;
pub mod hashing;
pub mod manager;
pub mod mutex_pool;
mod primitive;
pub mod prompt;
mod ring;
mod sha256_packed;
#[cfg(test)]
mod test_rng;
pub mod types;

pub use allocator::{BlockAllocator, FreeTier};
pub use block_pool::BlockPool;
pub use coordinator::{
    AllocateStep, AttentionKind, BlockCopy, Coordinator, CoordinatorConfig, CoordinatorStats,
    GroupSpec, NewRequest,
};
pub use error::CoreError;
pub use hashing::{ExtraKeys, HashAlgo, MultimodalItem};
pub use mutex_pool::MutexPool;
pub use prompt::{PromptPrefix, PromptReader};
pub use types::{BlockHash, BlockId, CacheKey, GroupId, PoolStats, NULL_BLOCK};

/// The pool the coordinator and the Python binding use.
pub type DefaultPool = BlockPool;

/// Shared check for pool constructors: block 0 is the null block, so a usable pool needs at
/// least one more.
pub(crate) fn validate_num_blocks(num_blocks: usize) -> Result<(), CoreError> {
    if num_blocks < 2 {
        return Err(CoreError::InvalidArgument(format!(
            "num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}"
        )));
    }
    if num_blocks > (1usize << 31) {
        return Err(CoreError::InvalidArgument(format!(
            "num_blocks must be at most 2^31, got {num_blocks}; use larger blocks"
        )));
    }
    Ok(())
}
