//! Token tails: a hit that ends where a freed request's computed tokens ended, inside a block.

mod common;

use common::{add, add_with, allocate, config, full_and_window, tokens};
use hybrid_cache_core::{
    AttentionKind, BlockAllocator, Coordinator, ExtraKeys, GroupSpec, NULL_BLOCK,
};

const FULL: usize = 0;
const WINDOW: usize = 1;

/// Full attention and a window of 3, blocks of 4 tokens (the example in `tails`' docs).
fn coordinator(tails: bool) -> Coordinator {
    let mut c = full_and_window(3, 40);
    c.set_token_tails(tails);
    c
}

/// Request 1 computes `history` (in one step) and is freed; returns its rows (full, window).
fn first_turn(c: &mut Coordinator, history: &[u32]) -> (Vec<u32>, Vec<u32>) {
    add(c, 1, history);
    assert!(allocate(c, 1, 0, history.len()));
    let rows = (
        c.request_blocks(1, FULL).unwrap().to_vec(),
        c.request_blocks(1, WINDOW).unwrap().to_vec(),
    );
    c.free_request(1).unwrap();
    rows
}

#[test]
fn the_next_turn_hits_every_computed_token_and_takes_both_tail_blocks() {
    let mut c = coordinator(true);
    let history = tokens(100, 10);
    let (full_row, window_row) = first_turn(&mut c, &history);
    let mut prompt = history.clone();
    prompt.extend(tokens(500, 5));
    assert_eq!(
        c.probe_cache_hit(&prompt, &ExtraKeys::default()).unwrap(),
        10
    );
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 10);
    assert!(allocate(&mut c, 2, 10, 5));
    let full = c.request_blocks(2, FULL).unwrap();
    let window = c.request_blocks(2, WINDOW).unwrap();
    // Full attention: blocks 0-1 shared, block 2 (tokens 8..10 computed) taken; window 3: the
    // window at 10 starts at token 8, so block 1 is not needed and block 2 is taken.
    assert_eq!(&full[..3], &full_row[..3]);
    assert_eq!(window[0], NULL_BLOCK);
    assert_eq!(window[2], window_row[2]);
    assert_eq!(c.pool().ref_count(full_row[2]), 1);
    assert_eq!(c.pool().ref_count(window_row[2]), 1);
    let stats = c.stats().hits;
    assert_eq!((stats.tail_hits, stats.tail_gain), (1, 2));
    assert_eq!(stats.hits, 10);
    let misses = stats.miss_window_tail
        + stats.miss_never_cached
        + stats.miss_evicted
        + stats.miss_alignment;
    assert_eq!(stats.hits + misses, stats.queries);
}

#[test]
fn off_by_default_the_hit_stops_at_the_last_block_boundary() {
    let mut c = coordinator(true);
    c.set_token_tails(false);
    let history = tokens(100, 10);
    first_turn(&mut c, &history);
    let mut prompt = history;
    prompt.extend(tokens(500, 5));
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
    let mut fresh = coordinator(false);
    first_turn(&mut fresh, &tokens(100, 10));
    add(&mut fresh, 2, &prompt);
    assert_eq!(fresh.find_cache_hit(2).unwrap(), 8);
}

#[test]
fn a_tail_hits_only_the_same_tokens_with_the_same_keys() {
    let mut c = coordinator(true);
    let history = tokens(100, 10);
    first_turn(&mut c, &history);
    // One tail token differs: the hit stops at the block boundary.
    let mut other = history.clone();
    other[9] = 7;
    other.extend(tokens(500, 5));
    add(&mut c, 2, &other);
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
    // A prompt ending inside the tail: the tail is longer than the hit allowed (token 9 must be
    // computed), so the hit stops at 8.
    add(&mut c, 3, &history);
    assert_eq!(c.find_cache_hit(3).unwrap(), 8);
    // A cache salt changes every key from block 0 on.
    let salted = ExtraKeys {
        cache_salt: Some("tenant".into()),
        ..ExtraKeys::default()
    };
    let mut prompt = history;
    prompt.extend(tokens(500, 5));
    add_with(&mut c, 4, &prompt, salted);
    assert_eq!(c.find_cache_hit(4).unwrap(), 0);
}

#[test]
fn a_taken_tail_is_no_hit_for_a_second_request_until_it_is_cached_again() {
    let mut c = coordinator(true);
    let history = tokens(100, 10);
    first_turn(&mut c, &history);
    let mut prompt = history.clone();
    prompt.extend(tokens(500, 6));
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 10);
    assert!(allocate(&mut c, 2, 10, 6));
    // Request 2 holds the tail blocks and fills them in this step, so they are cached under
    // their full keys (the step's tokens are known): request 3 hits them as full blocks, as far
    // as its 16 tokens allow (12), never request 1's tail (taken, its key dropped).
    add(&mut c, 3, &prompt);
    assert_eq!(c.find_cache_hit(3).unwrap(), 12);
    assert_eq!(c.stats().hits.tail_hits, 1);
    // The taken block filled up and carries its full key: once request 2 is freed, its 16
    // computed tokens hit plainly (four full blocks, no tail).
    c.free_request(2).unwrap();
    c.free_request(3).unwrap();
    let mut longer = prompt.clone();
    longer.extend(tokens(900, 3));
    add(&mut c, 4, &longer);
    assert_eq!(c.find_cache_hit(4).unwrap(), 16);
}

#[test]
fn tails_work_without_full_attention() {
    let groups = vec![GroupSpec {
        kind: AttentionKind::SlidingWindow { window: 5 },
        block_size: 4,
    }];
    let mut c = Coordinator::new(config(groups, 40)).unwrap();
    c.set_token_tails(true);
    let history = tokens(100, 14);
    add(&mut c, 1, &history);
    assert!(allocate(&mut c, 1, 0, 14));
    let row = c.request_blocks(1, 0).unwrap().to_vec();
    c.free_request(1).unwrap();
    let mut prompt = history;
    prompt.extend(tokens(500, 4));
    add(&mut c, 2, &prompt);
    assert_eq!(
        c.probe_cache_hit(&prompt, &ExtraKeys::default()).unwrap(),
        14
    );
    assert_eq!(c.find_cache_hit(2).unwrap(), 14);
    assert!(allocate(&mut c, 2, 14, 4));
    // Window 5 at 14: tokens 10..14, block 2 shared, block 3 (tokens 12..14) taken.
    let blocks = c.request_blocks(2, 0).unwrap();
    assert_eq!(&blocks[..2], &[NULL_BLOCK, NULL_BLOCK]);
    assert_eq!(&blocks[2..4], &row[2..4]);
}

#[test]
fn a_group_keyed_by_sub_blocks_hits_its_tail_to_the_token() {
    // Full attention in blocks of 6 keyed by units of 2, a window of 4 in blocks of 2 (the
    // per-type layout in small): 11 computed tokens leave 5 in full block 1 and 1 in window
    // block 5. With the partial key of whole units a hit reaches 10; the tail reaches 11.
    let groups = vec![
        GroupSpec {
            kind: AttentionKind::Full,
            block_size: 6,
        },
        GroupSpec {
            kind: AttentionKind::SlidingWindow { window: 4 },
            block_size: 2,
        },
    ];
    for (tails, expected) in [(false, 10), (true, 11)] {
        let mut c = Coordinator::new(config(groups.clone(), 40)).unwrap();
        c.set_token_tails(tails);
        let history = tokens(100, 11);
        first_turn(&mut c, &history);
        let mut prompt = history;
        prompt.extend(tokens(500, 3));
        add(&mut c, 2, &prompt);
        assert_eq!(c.find_cache_hit(2).unwrap(), expected, "tails {tails}");
        assert_eq!(
            c.probe_cache_hit(&prompt, &ExtraKeys::default()).unwrap(),
            expected
        );
        assert!(allocate(&mut c, 2, expected, 3));
    }
}

#[test]
fn a_reset_forgets_the_tails() {
    let mut c = coordinator(true);
    let history = tokens(100, 10);
    first_turn(&mut c, &history);
    assert!(c.reset_prefix_cache());
    let mut prompt = history;
    prompt.extend(tokens(500, 5));
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 0);
}

#[test]
fn a_lookup_within_a_limit_takes_a_shorter_hit() {
    let mut c = coordinator(true);
    let history = tokens(100, 10);
    first_turn(&mut c, &history);
    let mut prompt = history;
    prompt.extend(tokens(500, 5));
    add(&mut c, 2, &prompt);
    for (limit, expected) in [
        (Some(10), 10),
        (Some(9), 8),
        (Some(5), 4),
        (Some(0), 0),
        (None, 10),
    ] {
        assert_eq!(
            c.find_cache_hit_within(2, limit).unwrap(),
            expected,
            "{limit:?}"
        );
    }
    // The pending hit is the last lookup's: a shorter one is taken whole.
    assert_eq!(c.find_cache_hit_within(2, Some(6)).unwrap(), 4);
    assert!(allocate(&mut c, 2, 4, 11));
    assert_eq!(c.request_blocks(2, FULL).unwrap().len(), 4);
}
