//! What the core's benchmarks share: Gemma-2's layout (full attention + a 4096-token window,
//! blocks of 16 tokens).

use hybrid_cache_core::{AttentionKind, CoordinatorConfig, GroupSpec, HashAlgo};

pub const BLOCK_SIZE: usize = 16;
pub const WINDOW: usize = 4096;

/// Gemma-2's layout with prefix caching on, xxh3 block hashes and 2048 batched tokens.
pub fn gemma2_config(
    num_blocks: usize,
    max_num_reqs: usize,
    max_model_len: usize,
) -> CoordinatorConfig {
    CoordinatorConfig {
        num_blocks,
        groups: vec![
            GroupSpec {
                kind: AttentionKind::Full,
                block_size: BLOCK_SIZE,
            },
            GroupSpec {
                kind: AttentionKind::SlidingWindow { window: WINDOW },
                block_size: BLOCK_SIZE,
            },
        ],
        max_num_reqs,
        max_model_len,
        max_num_batched_tokens: 2048,
        enable_prefix_caching: true,
        hash: HashAlgo::Xxh3,
        hash_seed: 0,
    }
}
