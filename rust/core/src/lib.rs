//! hybrid-cache-core: a KV-cache block allocator for models that mix full attention with
//! sliding-window and chunked-local attention. Pure Rust; the Python binding lives in a
//! separate crate.

pub mod allocator;
pub mod coordinator;
pub mod error;
pub mod hashing;
pub mod manager;
pub mod mutex_pool;
pub mod types;

pub use allocator::BlockAllocator;
pub use coordinator::{
    AllocateStep, AttentionKind, Coordinator, CoordinatorConfig, CoordinatorStats, GroupSpec,
    NewRequest,
};
pub use error::CoreError;
pub use hashing::{ExtraKeys, HashAlgo, MultimodalItem};
pub use mutex_pool::MutexPool;
pub use types::{BlockHash, BlockId, CacheKey, GroupId, PoolStats, NULL_BLOCK};

/// The pool the coordinator and the binding use unless told otherwise.
pub type DefaultPool = MutexPool;

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
