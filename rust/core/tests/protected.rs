//! Protected chains: conversations served round-robin beyond what the pool holds keep hitting.

mod common;

use common::{add, allocate, config, full_and_window, tokens};
use hybrid_cache_core::{AttentionKind, BlockAllocator, Coordinator, GroupSpec};

/// One full-attention group, blocks of 4 tokens, 24 usable blocks.
fn coordinator(protected: Option<usize>) -> Coordinator {
    let groups = vec![GroupSpec {
        kind: AttentionKind::Full,
        block_size: 4,
    }];
    let mut c = Coordinator::new(config(groups, 25)).unwrap();
    c.set_protected_blocks(protected);
    c
}

/// Runs `tokens` as request `id` (its hit, then the rest in one step), frees it; returns the hit.
fn run(c: &mut Coordinator, id: u64, tokens: &[u32]) -> usize {
    add(c, id, tokens);
    let hit = c.find_cache_hit(id).unwrap();
    assert!(allocate(c, id, hit, tokens.len() - hit));
    c.free_request(id).unwrap();
    hit
}

/// Eight "conversations" of 16 tokens (4 blocks each, 32 in all) served round-robin over 24
/// blocks, six rounds; returns the hit tokens per round.
fn round_robin(c: &mut Coordinator) -> Vec<usize> {
    let prompt = |session: u32| -> Vec<u32> { (0..17).map(|i| 1000 * session + i).collect() };
    let mut id = 0;
    (0..6)
        .map(|_| {
            (0..8)
                .map(|session| {
                    id += 1;
                    run(c, id, &prompt(session))
                })
                .sum()
        })
        .collect()
}

#[test]
fn plain_lru_misses_every_round_of_a_loop_larger_than_the_pool() {
    let mut c = coordinator(None);
    assert!(round_robin(&mut c).iter().all(|&hit| hit == 0));
}

#[test]
fn protected_chains_keep_hitting_round_after_round() {
    // A budget of 16 blocks: four of the eight conversations (5 blocks each, the 17th token's
    // block included) stay protected; the others cycle through what is left.
    let mut c = coordinator(Some(16));
    let hits = round_robin(&mut c);
    assert_eq!(hits[0], 0);
    for &hit in &hits[1..] {
        assert!(
            hit >= 3 * 16,
            "rounds after the first hit protected chains: {hits:?}"
        );
    }
    assert!(c.num_protected_blocks() <= 16);
}

#[test]
fn a_protected_chain_nobody_hits_is_demoted_to_lru_order() {
    // A budget of 2 blocks: request 1's two cached blocks fill it.
    let mut c = coordinator(Some(2));
    let first: Vec<u32> = (0..8).collect();
    run(&mut c, 1, &first);
    assert_eq!(c.num_protected_blocks(), 2);
    let order = c.pool().free_queue_order();
    let protected: Vec<u32> = order[order.len() - 2..].to_vec();
    // 18 more frees that never hit it (3 tokens: no full block to cache): it is demoted.
    for id in 2..20 {
        let other: Vec<u32> = (0..3).map(|i| 5000 + 10 * id as u32 + i).collect();
        run(&mut c, id, &other);
    }
    assert_eq!(c.num_protected_blocks(), 0);
    // The budget is free again: the next chain is protected, and evicted after request 1's
    // (without demotion it would not fit and would be evicted first).
    let second: Vec<u32> = (100..108).collect();
    run(&mut c, 20, &second);
    assert_eq!(c.num_protected_blocks(), 2);
    let order = c.pool().free_queue_order();
    let position = |block: u32| order.iter().position(|&b| b == block).unwrap();
    let newest = &order[order.len() - 2..];
    assert!(protected.iter().all(|&b| !newest.contains(&b)));
    assert!(protected.iter().all(|&b| position(b) < position(newest[0])));
    // Still cached: demotion moves a block, it does not evict it.
    assert_eq!(run(&mut c, 100, &(0..9).collect::<Vec<u32>>()), 8);
}

/// Full attention and a window of 8 tokens (a hit point needs the 2 blocks of 4 before it), 29
/// usable blocks, a protected budget of 2 blocks.
fn windowed_coordinator() -> Coordinator {
    let mut c = full_and_window(8, 30);
    c.set_protected_blocks(Some(2));
    c
}

/// A 16-token prefix P. Request 1 computes P and 8 tokens of its own, then decodes (its window
/// leaves P's end); request 2 starts from P's cache hit and does the same, while request 1
/// still runs (`shared`) or after it was freed. Then an unrelated request is freed (its blocks
/// join `Normal`, newer than P's window), another takes every free block but two, and a fourth
/// request with P asks for its hit. Returns that hit and the blocks protected after request 2's
/// window left P.
fn hit_after_pressure(shared: bool) -> (usize, usize) {
    let mut c = windowed_coordinator();
    let with = |own: u32| -> Vec<u32> { tokens(0, 16).into_iter().chain(tokens(own, 8)).collect() };
    let decode = |c: &mut Coordinator, id: u64, hit: usize| {
        assert!(allocate(c, id, hit, 24 - hit));
        assert!(allocate(c, id, 24, 1));
    };
    add(&mut c, 1, &with(100));
    assert!(allocate(&mut c, 1, 0, 16));
    decode(&mut c, 1, 16);
    if !shared {
        c.free_request(1).unwrap();
    }
    add(&mut c, 2, &with(200));
    assert_eq!(c.find_cache_hit(2).unwrap(), 16);
    decode(&mut c, 2, 16); // releases P's window: the hit point request 1 holds too, if running
    let protected = c.num_protected_blocks();
    add(&mut c, 3, &tokens(500, 8));
    assert!(allocate(&mut c, 3, 0, 8));
    c.free_request(3).unwrap();
    add(&mut c, 4, &tokens(900, 56));
    let mut computed = 0;
    while c.pool().num_free_blocks() > 2 && computed < 56 && allocate(&mut c, 4, computed, 1) {
        computed += 1;
    }
    assert_eq!(c.pool().num_free_blocks(), 2, "two free blocks left");
    add(&mut c, 5, &with(300));
    (c.find_cache_hit(5).unwrap(), protected)
}

#[test]
fn a_shared_hit_points_window_outlives_newer_free_blocks() {
    // Shared: P's window is protected, the last free blocks to go, and the fifth request hits P.
    assert_eq!(hit_after_pressure(true), (16, 2));
    // Unshared (the previous turn of one conversation): plain LRU evicts the older window first.
    let (hit, protected) = hit_after_pressure(false);
    assert!(hit < 16 && protected == 0, "{hit} {protected}");
}
