//! Tail replay: a hit that keeps the full-attention blocks up to `F` and starts the windowed
//! groups over at `F - R`, when a windowed group's blocks for a hit point near `F` are gone.

mod common;

use common::{add, allocate, config, full_and_window, tokens};
use hybrid_cache_core::{AttentionKind, Coordinator, CoreError, ExtraKeys, GroupSpec, NULL_BLOCK};

const FULL: usize = 0;
const WINDOW: usize = 1;

/// Full attention and a window of 5 (one windowed layer: R = 4), blocks of 4 tokens, 33 usable
/// blocks.
fn coordinator(replay_tokens: Option<usize>) -> Coordinator {
    let mut c = full_and_window(5, 34);
    c.set_tail_replay(replay_tokens).unwrap();
    c
}

/// Request 1 computes 64 tokens in chunks of 16 (the window releases its early blocks to the
/// `Low` tier) and is freed; request 2 takes 32 unrelated tokens at once, which evicts the one
/// keyless block and the 15 `Low` windowed blocks, and is freed. What stays cached: request 1's
/// full-attention blocks and its last windowed block. Returns request 1's full-attention row.
fn lose_the_window(c: &mut Coordinator) -> Vec<u32> {
    add(c, 1, &tokens(100, 64));
    for computed in (0..64).step_by(16) {
        assert!(allocate(c, 1, computed, 16));
    }
    let full_row = c.request_blocks(1, FULL).unwrap().to_vec();
    c.free_request(1).unwrap();
    add(c, 2, &tokens(5000, 32));
    assert!(allocate(c, 2, 0, 32));
    c.free_request(2).unwrap();
    full_row
}

/// A coordinator (replay `replay_tokens`) after `lose_the_window`, with request 3 added for
/// the branch prompt; returns it and the hit `find_cache_hit` found for request 3.
fn branched(replay_tokens: Option<usize>) -> (Coordinator, usize) {
    let mut c = coordinator(replay_tokens);
    lose_the_window(&mut c);
    add(&mut c, 3, &branch());
    let hit = c.find_cache_hit(3).unwrap();
    (c, hit)
}

/// The first 40 tokens of request 1, then 20 new ones.
fn branch() -> Vec<u32> {
    let mut prompt = tokens(100, 40);
    prompt.extend(tokens(9000, 20));
    prompt
}

#[test]
fn a_lost_window_tail_is_replayed_from_f_minus_r() {
    let mut c = coordinator(Some(4));
    let full_row = lose_the_window(&mut c);
    let prompt = branch();
    // Full attention hits 40; the windowed block [36, 40) is gone, so every group hits 0; a
    // replay starts the window over at 40 - 4 = 36.
    assert_eq!(
        c.probe_cache_hit(&prompt, &ExtraKeys::default()).unwrap(),
        36
    );
    add(&mut c, 3, &prompt);
    assert_eq!(c.find_cache_hit(3).unwrap(), 36);
    assert!(allocate(&mut c, 3, 36, 24));
    assert_eq!(c.replay_frontier(3).unwrap(), 40);
    // The full-attention row holds request 1's blocks up to the frontier, then new ones.
    let row = c.request_blocks(3, FULL).unwrap();
    assert_eq!(row.len(), 15);
    assert_eq!(&row[..10], &full_row[..10]);
    // The windowed row: nothing before the window of 36, new blocks from [32, 36) on.
    let window_row = c.request_blocks(3, WINDOW).unwrap();
    assert_eq!(window_row.len(), 15);
    assert!(window_row[..8].iter().all(|&block| block == NULL_BLOCK));
    assert!(window_row[8..].iter().all(|&block| block != NULL_BLOCK));
    let stats = c.stats().hits;
    assert_eq!(
        (stats.replays, stats.replay_tokens, stats.replay_gain),
        (1, 4, 36)
    );
}

#[test]
fn a_replay_caches_its_windowed_blocks_from_where_every_layer_is_right() {
    // R = 8: two windowed layers of W = 5. Replaying from S = 32, the lower layer's keys are
    // right from 32, the upper one's from 36 = S + R - (W - 1): blocks from 36 on are cached.
    let (mut c, hit) = branched(Some(8));
    assert_eq!(hit, 32);
    assert!(allocate(&mut c, 3, 32, 28));
    assert_eq!(c.replay_frontier(3).unwrap(), 40);
    c.free_request(3).unwrap();
    // A prompt branching at 40 needs the windowed block [36, 40): cached, a plain hit.
    let mut at_40 = tokens(100, 40);
    at_40.extend(tokens(7000, 10));
    add(&mut c, 4, &at_40);
    assert_eq!(c.find_cache_hit(4).unwrap(), 40);
    assert!(allocate(&mut c, 4, 40, 10));
    assert_eq!(c.replay_frontier(4).unwrap(), 0);
    c.free_request(4).unwrap();
    // Branching at 36 needs [32, 36), wrong for the upper layer and never cached: a replay
    // again (from 28), not a hit of 36.
    let mut at_36 = tokens(100, 36);
    at_36.extend(tokens(6000, 10));
    add(&mut c, 5, &at_36);
    assert_eq!(c.find_cache_hit(5).unwrap(), 28);
    assert!(allocate(&mut c, 5, 28, 18));
    assert_eq!(c.replay_frontier(5).unwrap(), 36);
}

#[test]
fn no_replay_when_it_saves_less_than_it_recomputes_or_is_off() {
    // R = 40: the replay would start at 0, no better than the plain hit; R = 24: it would
    // start at 16, recomputing 24 tokens to gain 16: not taken; off: none.
    for replay_tokens in [Some(40), Some(24), None] {
        let (c, hit) = branched(replay_tokens);
        assert_eq!(hit, 0, "replay {replay_tokens:?}");
        assert_eq!(c.stats().hits.replays, 0);
    }
    // A request that starts at 0 instead of at its replay hit takes no replay.
    let (mut c, hit) = branched(Some(4));
    assert_eq!(hit, 36);
    assert!(allocate(&mut c, 3, 0, 60));
    assert_eq!(c.replay_frontier(3).unwrap(), 0);
}

#[test]
fn a_replay_whose_first_chunk_ends_before_the_frontier_keeps_the_frontier_blocks() {
    let (mut c, hit) = branched(Some(4));
    assert_eq!(hit, 36);
    // Two tokens: up to 38 < 40, the full-attention row still covers the frontier.
    assert!(allocate(&mut c, 3, 36, 2));
    assert_eq!(c.request_blocks(3, FULL).unwrap().len(), 10);
    assert!(allocate(&mut c, 3, 38, 22));
    assert_eq!(c.request_blocks(3, FULL).unwrap().len(), 15);
    assert_eq!(c.replay_frontier(3).unwrap(), 40);
}

#[test]
fn tail_replay_is_refused_where_its_rule_does_not_hold() {
    let spec = |kind| GroupSpec {
        kind,
        block_size: 4,
    };
    let full_only = vec![spec(AttentionKind::Full)];
    let with_chunk = vec![
        spec(AttentionKind::Full),
        spec(AttentionKind::SlidingWindow { window: 8 }),
        spec(AttentionKind::ChunkedLocal { chunk: 8 }),
    ];
    for groups in [full_only, with_chunk] {
        let mut c = Coordinator::new(config(groups, 16)).unwrap();
        assert!(matches!(
            c.set_tail_replay(Some(4)),
            Err(CoreError::InvalidArgument(_))
        ));
        c.set_tail_replay(None).unwrap();
    }
    let mut c = coordinator(None);
    assert!(c.set_tail_replay(Some(0)).is_err());
}
