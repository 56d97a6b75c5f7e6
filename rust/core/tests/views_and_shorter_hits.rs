//! A first `allocate` that takes a shorter hit than the pending one, and the coordinator's
//! read-only views of the cache (cached blocks with their keys, the free queue's order).

mod common;

use common::{add, allocate, full_and_window};
use hybrid_cache_core::{BlockAllocator, CoreError};

const FULL: usize = 0;
const WINDOW: usize = 1;

/// 24 tokens computed and freed by request 0 (window 8, blocks of 4): 6 full blocks per group.
fn cached_history() -> (hybrid_cache_core::Coordinator, Vec<u32>) {
    let (c, history, _) = cached_history_with_row();
    (c, history)
}

/// `cached_history` and request 0's full-attention row.
fn cached_history_with_row() -> (hybrid_cache_core::Coordinator, Vec<u32>, Vec<u32>) {
    let mut c = full_and_window(8, 64);
    let history: Vec<u32> = (100..124).collect();
    add(&mut c, 0, &history);
    assert!(allocate(&mut c, 0, 0, 24));
    let row = c.request_blocks(0, FULL).unwrap().to_vec();
    c.free_request(0).unwrap();
    (c, history, row)
}

#[test]
fn a_first_allocate_inside_the_pending_hit_takes_that_shorter_hit() {
    let (mut c, history) = cached_history();
    let cached_full: Vec<u32> = c.cached_blocks().iter().map(|&(block, _)| block).collect();
    let mut prompt = history.clone();
    prompt.extend([1, 2, 3]);
    add(&mut c, 1, &prompt);
    assert_eq!(c.find_cache_hit(1).unwrap(), 24);
    assert!(
        allocate(&mut c, 1, 16, 11),
        "a shorter hit at a block boundary"
    );
    let full = c.request_blocks(1, FULL).unwrap().to_vec();
    assert_eq!(full.len(), 7);
    // The first 4 full-attention blocks are the cached ones of the history (same keys).
    let keys = c.cached_blocks();
    for (index, &block) in full[..4].iter().enumerate() {
        let key = keys.iter().find(|&&(b, _)| b == block).map(|&(_, key)| key);
        assert!(
            key.is_some_and(|key| key.group == FULL as u32),
            "block {index} is a hit"
        );
        assert!(cached_full.contains(&block));
    }
    // The window keeps only what position 16 sees: blocks 0 and 1 (tokens 0..8) are null.
    let window = c.request_blocks(1, WINDOW).unwrap();
    assert_eq!(&window[..2], &[0, 0]);
    assert!(c.pool().ref_count(full[0]) == 1 && c.pool().ref_count(full[4]) == 1);
}

#[test]
fn a_start_with_no_hit_of_exactly_that_length_is_refused_and_keeps_the_pending_hit() {
    let (mut c, history) = cached_history();
    add(&mut c, 1, &history);
    assert_eq!(c.find_cache_hit(1).unwrap(), 20);
    let free_before = c.pool().num_free_blocks();
    let error = c
        .allocate(hybrid_cache_core::AllocateStep {
            request_id: 1,
            num_computed_tokens: 10,
            num_new_tokens: 4,
        })
        .unwrap_err();
    assert!(matches!(error, CoreError::InvalidArgument(ref m) if m.contains("exactly 10")));
    assert_eq!(
        c.pending_hit_tokens(1).unwrap(),
        20,
        "the pending hit is kept"
    );
    assert_eq!(c.pool().num_free_blocks(), free_before);
    assert!(allocate(&mut c, 1, 20, 4), "and can still be taken whole");
}

#[test]
fn the_views_show_the_cached_keys_and_the_eviction_order() {
    let (c, _, row) = cached_history_with_row();
    let cached = c.cached_blocks();
    // Full attention caches its 6 blocks; the window caches the blocks a hit can need.
    assert_eq!(cached.iter().filter(|(_, key)| key.group == 0).count(), 6);
    assert!(cached.iter().any(|(_, key)| key.group == 1));
    let order = c.free_queue_order();
    assert_eq!(order.len(), c.pool().num_free_blocks());
    // Keyless blocks are evicted first; the freed request's blocks come last, its tail first.
    let first_cached = order
        .iter()
        .position(|block| cached.iter().any(|(b, _)| b == block))
        .unwrap();
    assert!(order[first_cached..]
        .iter()
        .all(|block| cached.iter().any(|(b, _)| b == block)));
    assert_eq!(order.len() - first_cached, cached.len());
    // Within the chain, its last block is evicted before its first.
    let at = |block: u32| order.iter().position(|&b| b == block).unwrap();
    assert_eq!(row.len(), 6);
    assert!(at(row[5]) < at(row[0]), "the chain's tail goes first");
}
