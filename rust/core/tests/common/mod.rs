//! Helpers the coordinator's vector and scenario tests share.
#![allow(dead_code)] // each test file uses some of them

use hybrid_cache_core::{
    AllocateStep, AttentionKind, Coordinator, CoordinatorConfig, ExtraKeys, GroupSpec, HashAlgo,
    NewRequest,
};

/// A coordinator config over `groups` with `num_blocks` blocks (the null block included), 4
/// rows, requests of up to 256 tokens, steps of up to 64, prefix caching on.
pub fn config(groups: Vec<GroupSpec>, num_blocks: usize) -> CoordinatorConfig {
    CoordinatorConfig {
        num_blocks,
        groups,
        max_num_reqs: 4,
        max_model_len: 256,
        max_num_batched_tokens: 64,
        enable_prefix_caching: true,
        hash: HashAlgo::Xxh3,
        hash_seed: 0,
    }
}

/// A coordinator over a full-attention group and a sliding-window group of `window` tokens,
/// both with blocks of 4 tokens, and `num_blocks` blocks (the null block included).
pub fn full_and_window(window: usize, num_blocks: usize) -> Coordinator {
    let groups = vec![
        GroupSpec {
            kind: AttentionKind::Full,
            block_size: 4,
        },
        GroupSpec {
            kind: AttentionKind::SlidingWindow { window },
            block_size: 4,
        },
    ];
    Coordinator::new(config(groups, num_blocks)).unwrap()
}

/// Adds a request; returns its row.
pub fn add_with(c: &mut Coordinator, request_id: u64, tokens: &[u32], extra: ExtraKeys) -> usize {
    c.add_request(NewRequest {
        request_id,
        prompt_token_ids: tokens,
        max_total_tokens: None,
        extra,
    })
    .unwrap()
}

/// Adds a request without extra keys; returns its row.
pub fn add(c: &mut Coordinator, request_id: u64, tokens: &[u32]) -> usize {
    add_with(c, request_id, tokens, ExtraKeys::default())
}

pub fn allocate(c: &mut Coordinator, request_id: u64, computed: usize, new: usize) -> bool {
    c.allocate(AllocateStep {
        request_id,
        num_computed_tokens: computed,
        num_new_tokens: new,
    })
    .unwrap()
}

/// `count` consecutive token ids from `first`.
pub fn tokens(first: u32, count: u32) -> Vec<u32> {
    (first..first + count).collect()
}
