//! The vectors of docs/DESIGN.md ("Window release", "Cache-hit search", "Admission") for each
//! manager type.

use super::*;
use crate::mutex_pool::MutexPool;
use crate::types::BlockHash;

fn row_after_release(
    manager: &dyn AttentionManager,
    num_blocks: usize,
    computed: &[usize],
) -> Vec<BlockId> {
    let mut blocks = GroupBlocks {
        blocks: (1..=num_blocks as BlockId).collect(),
        ..GroupBlocks::default()
    };
    for &num_computed in computed {
        release_nulls(manager, &mut blocks, num_computed);
    }
    blocks.blocks
}

#[test]
fn sliding_window_release_vectors() {
    let window = SlidingWindowManager::new(2, 4);
    assert_eq!(row_after_release(&window, 6, &[4]), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(row_after_release(&window, 6, &[5]), vec![0, 2, 3, 4, 5, 6]);
    assert_eq!(
        row_after_release(&window, 6, &[5, 6]),
        vec![0, 2, 3, 4, 5, 6]
    );
    assert_eq!(row_after_release(&window, 6, &[7]), vec![0, 0, 3, 4, 5, 6]);
    assert_eq!(
        row_after_release(&window, 6, &[7, 11]),
        vec![0, 0, 0, 0, 5, 6]
    );
}

#[test]
fn release_lists_then_nulls_each_entry_once() {
    let window = SlidingWindowManager::new(2, 4);
    let mut blocks = GroupBlocks {
        blocks: vec![1, 2, 3, 4, 5, 6],
        ..GroupBlocks::default()
    };
    assert_eq!(pending_release(&window, &blocks, 11), 0..4);
    assert_eq!(release_nulls(&window, &mut blocks, 11), 4);
    assert_eq!(blocks.blocks, vec![0, 0, 0, 0, 5, 6]);
    assert_eq!(release_nulls(&window, &mut blocks, 11), 0);
    assert_eq!(pending_release(&window, &blocks, 12), 4..4);
}

#[test]
fn chunked_local_release_vectors() {
    let chunked = ChunkedLocalManager::new(2, 4);
    assert_eq!(
        row_after_release(&chunked, 7, &[4]),
        vec![0, 0, 3, 4, 5, 6, 7]
    );
    assert_eq!(
        row_after_release(&chunked, 7, &[6]),
        vec![0, 0, 3, 4, 5, 6, 7]
    );
    assert_eq!(
        row_after_release(&chunked, 7, &[12]),
        vec![0, 0, 0, 0, 0, 0, 7]
    );
}

#[test]
fn design_check_live_blocks() {
    // B = 16, W = 32, length 112, c = 111: 2 live windowed blocks, 7 full blocks.
    let window = SlidingWindowManager::new(16, 32);
    let full = FullAttentionManager::new(16);
    for (manager, live) in [(&window as &dyn AttentionManager, 2), (&full, 7)] {
        let num_blocks = manager.num_new_blocks(0, 112);
        let row = row_after_release(manager, num_blocks, &[111]);
        assert_eq!(row.iter().filter(|&&b| b != NULL_BLOCK).count(), live);
    }
}

/// Hit length in blocks for a cached pattern under B = 2, W = 4, and the hit row.
fn window_hit(pattern: &[bool]) -> (usize, Vec<BlockId>) {
    let window = SlidingWindowManager::new(2, 4);
    let hit = window.longest_hit_blocks(pattern.len(), &mut |index| pattern[index]);
    let row = hit_row(&window, hit, &mut |index| {
        pattern[index].then_some(index as BlockId + 1)
    })
    .expect("every needed block of a hit is cached");
    (hit, row)
}

#[test]
fn sliding_window_cache_hit_vectors() {
    const T: bool = true;
    const F: bool = false;
    let vectors: [(&[bool], usize); 10] = [
        (&[F, F, F, F], 0),
        (&[T], 1),
        (&[T, F], 1),
        (&[T, T], 2),
        (&[T, T, F], 2),
        (&[T, T, T], 3),
        (&[T, T, T, F], 3),
        (&[T, T, F, T, F, F, T, T, F, F, F], 8),
        (&[T, T, F, T, F, F, T, T, F, T, T, T], 12),
        (&[T, T, F, T, F, F, T, T, F, F, F, T], 8),
    ];
    for (pattern, expected) in vectors {
        let (hit, row) = window_hit(pattern);
        assert_eq!(hit, expected, "pattern {pattern:?}");
        assert_eq!(row.len(), hit);
        let kept = hit.min(2);
        assert!(
            row[..hit - kept].iter().all(|&b| b == NULL_BLOCK),
            "{pattern:?}: {row:?}"
        );
        assert!(
            row[hit - kept..].iter().all(|&b| b != NULL_BLOCK),
            "{pattern:?}: {row:?}"
        );
    }
}

#[test]
fn full_attention_hit_is_the_cached_run_from_the_left() {
    let full = FullAttentionManager::new(2);
    let pattern = [true, true, false, true];
    assert_eq!(full.longest_hit_blocks(4, &mut |i| pattern[i]), 2);
    assert_eq!(full.longest_hit_blocks(1, &mut |i| pattern[i]), 1);
}

#[test]
fn chunked_hit_starts_at_the_chunk_of_the_limit() {
    let chunked = ChunkedLocalManager::new(2, 4);
    // Limit 6 blocks = 12 tokens: chunk starts at block 6, nothing needed; limit 5 blocks:
    // chunk starts at block 4, block 4 must be cached.
    let nothing_cached = |_: usize| false;
    assert_eq!(chunked.longest_hit_blocks(6, &mut { nothing_cached }), 6);
    assert_eq!(chunked.longest_hit_blocks(5, &mut { nothing_cached }), 4);
    assert_eq!(chunked.longest_hit_blocks(5, &mut |i| i == 4), 5);
}

#[test]
fn window_of_one_needs_no_block() {
    let window = SlidingWindowManager::new(2, 1);
    assert_eq!(window.longest_hit_blocks(5, &mut |_| false), 5);
}

#[test]
fn only_blocks_a_hit_can_use_are_cacheable() {
    // B = 2, W = 4 (2 kept blocks), hits aligned to 8 tokens (4 blocks): only the last two
    // blocks of each aligned segment can be hit.
    let window = SlidingWindowManager::new(2, 4);
    let cacheable: Vec<bool> = (0..8).map(|i| window.can_be_hit(i, 8)).collect();
    assert_eq!(
        cacheable,
        [false, false, true, true, false, false, true, true]
    );
    // Aligned to the block size itself, every block can be hit.
    assert!((0..8).all(|i| window.can_be_hit(i, 2)));
    let full = FullAttentionManager::new(2);
    assert!((0..8).all(|i| full.can_be_hit(i, 8)));
    // What `cache_full_blocks` asks before skipping the test per block: only a group that
    // never skips a token answers that no count skips one.
    assert_eq!(full.first_skipping(1), usize::MAX);
    assert_ne!(window.first_skipping(1), usize::MAX);
    assert_ne!(ChunkedLocalManager::new(2, 4).first_skipping(1), usize::MAX);
}

#[test]
fn admission_caps() {
    let limits = AdmissionLimits {
        max_total_tokens: 10_000,
        max_num_batched_tokens: 512,
    };
    assert_eq!(FullAttentionManager::new(16).max_live_blocks(limits), 625);
    // cdiv(4095 + 512, 16) + 1 = 289.
    assert_eq!(
        SlidingWindowManager::new(16, 4096).max_live_blocks(limits),
        289
    );
    // Never more than the whole request.
    let short = AdmissionLimits {
        max_total_tokens: 100,
        ..limits
    };
    assert_eq!(
        SlidingWindowManager::new(16, 4096).max_live_blocks(short),
        7
    );
    assert_eq!(ChunkedLocalManager::new(16, 64).max_live_blocks(limits), 37);
}

#[test]
fn caches_full_hittable_blocks_once() {
    let pool = MutexPool::new(8).unwrap();
    let full = FullAttentionManager::new(2);
    let mut out = Vec::new();
    pool.get_new_blocks(3, &mut out).unwrap();
    let mut blocks = GroupBlocks {
        blocks: out.clone(),
        ..GroupBlocks::default()
    };
    let hashes = [BlockHash(10), BlockHash(11)];
    let key_of = |index: usize| CacheKey {
        group: 0,
        hash: hashes[index],
    };
    let context = CacheContext {
        pool: &pool,
        key_of: &key_of,
        num_full_blocks: 2,
        hit_alignment: 2,
    };
    cache_full_blocks(&full, &mut blocks, &context).unwrap();
    assert_eq!(blocks.num_cached, 2);
    assert_eq!(pool.stats().num_cached_blocks, 2);
    let key = CacheKey {
        group: 0,
        hash: BlockHash(11),
    };
    assert_eq!(pool.cached_block(key), Some(out[1]));
}

#[test]
fn worst_case_live_blocks_is_every_managers_bound() {
    let limits = AdmissionLimits {
        max_total_tokens: 10_000,
        max_num_batched_tokens: 512,
    };
    assert_eq!(worst_case_live_blocks(16, None, limits), 625);
    assert_eq!(worst_case_live_blocks(16, Some(4096), limits), 289);
    assert_eq!(worst_case_live_blocks(16, Some(64), limits), 37);
    // A reach of one token keeps only the step's own tokens.
    assert_eq!(worst_case_live_blocks(16, Some(1), limits), 33);
}

#[test]
fn worst_case_live_tokens_is_the_reach_plus_one_step() {
    let limits = AdmissionLimits {
        max_total_tokens: 10_000,
        max_num_batched_tokens: 512,
    };
    assert_eq!(worst_case_live_tokens(None, limits), 10_000);
    assert_eq!(worst_case_live_tokens(Some(4096), limits), 4095 + 512);
    assert_eq!(worst_case_live_tokens(Some(1), limits), 512);
    // Never more than the request's tokens.
    assert_eq!(worst_case_live_tokens(Some(20_000), limits), 10_000);
}

#[test]
fn first_skipping_is_the_fewest_computed_tokens_that_skip_that_many() {
    let managers: Vec<Box<dyn AttentionManager>> = vec![
        Box::new(FullAttentionManager::new(4)),
        Box::new(SlidingWindowManager::new(2, 4)),
        Box::new(SlidingWindowManager::new(2, 1)),
        Box::new(SlidingWindowManager::new(16, 40)),
        Box::new(ChunkedLocalManager::new(2, 4)),
        Box::new(ChunkedLocalManager::new(16, 64)),
    ];
    for manager in &managers {
        for num_tokens in 0..300 {
            let first = (0..1000).find(|&c| manager.num_skipped_tokens(c) >= num_tokens);
            assert_eq!(
                manager.first_skipping(num_tokens),
                first.unwrap_or(usize::MAX),
                "{manager:?} skipping {num_tokens}"
            );
        }
    }
}

/// The sliding window's hit as a plain right-to-left scan: the rightmost run of `needed` cached
/// blocks, else the cached run from block 0.
fn window_hit_by_scan(needed: usize, pattern: &[bool]) -> usize {
    let mut run = 0;
    for index in (0..pattern.len()).rev() {
        run = if pattern[index] { run + 1 } else { 0 };
        if run == needed {
            return index + needed;
        }
    }
    run
}

#[test]
fn the_window_search_skips_to_the_scan_answer() {
    for window in [2, 3, 4, 5, 7, 9] {
        let manager = SlidingWindowManager::new(2, window);
        let needed = manager.num_blocks_kept();
        for len in 0..=12 {
            for bits in 0u32..1 << len {
                let pattern: Vec<bool> = (0..len).map(|i| bits >> i & 1 == 1).collect();
                let mut probes = 0;
                let hit = manager.longest_hit_blocks(len, &mut |index| {
                    probes += 1;
                    pattern[index]
                });
                assert_eq!(
                    hit,
                    window_hit_by_scan(needed, &pattern),
                    "W {window} {pattern:?}"
                );
                assert!(probes <= 2 * len, "{probes} lookups for {len} blocks");
            }
        }
        // Nothing cached: about one lookup per `needed` blocks.
        let mut probes = 0;
        let hit = manager.longest_hit_blocks(120, &mut |_| {
            probes += 1;
            false
        });
        assert_eq!(hit, 0);
        assert!(
            probes <= 120 / needed + 1,
            "{probes} lookups, needed {needed}"
        );
    }
}
