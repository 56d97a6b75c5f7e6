//! The vectors of docs/DESIGN.md ("Window release", "Cache-hit search", "Admission") and error
//! cases, driven through the coordinator's public API.

mod common;

use common::{add, allocate, config};
use hybrid_cache_core::coordinator::RowRef;
use hybrid_cache_core::{
    AllocateStep, AttentionKind, BlockAllocator, BlockCopy, Coordinator, CoordinatorConfig,
    CoreError, ExtraKeys, GroupSpec, HashAlgo, NewRequest, NULL_BLOCK,
};

fn group(kind: AttentionKind, block_size: usize) -> GroupSpec {
    GroupSpec { kind, block_size }
}

fn full(block_size: usize) -> GroupSpec {
    group(AttentionKind::Full, block_size)
}

fn window(block_size: usize, window: usize) -> GroupSpec {
    group(AttentionKind::SlidingWindow { window }, block_size)
}

fn chunked(block_size: usize, chunk: usize) -> GroupSpec {
    group(AttentionKind::ChunkedLocal { chunk }, block_size)
}

fn coordinator(num_blocks: usize, groups: Vec<GroupSpec>) -> Coordinator {
    Coordinator::new(config(groups, num_blocks)).unwrap()
}

/// Null (0) or not for each entry of a request's row.
fn nulls(coordinator: &Coordinator, request_id: u64, group: usize) -> Vec<bool> {
    let blocks = coordinator.request_blocks(request_id, group).unwrap();
    blocks.iter().map(|&block| block == NULL_BLOCK).collect()
}

fn tokens(count: u32) -> Vec<u32> {
    (100..100 + count).collect()
}

fn row_ref(c: &Coordinator, request_id: u64, group: usize) -> RowRef {
    RowRef {
        group,
        row: c.row_of(request_id).unwrap(),
    }
}

/// Checks after each (computed, new) step which entries of group `group` are null.
fn check_release(c: &mut Coordinator, group: usize, steps: &[(usize, usize, &[usize])]) {
    for &(computed, new, nulled) in steps {
        assert!(allocate(c, 1, computed, new));
        let row = nulls(c, 1, group);
        let expected: Vec<bool> = (0..row.len()).map(|i| nulled.contains(&i)).collect();
        assert_eq!(row, expected, "c = {computed}");
        let at = row_ref(c, 1, group);
        let table_row: Vec<i32> = (0..row.len()).map(|i| c.table().entry(at, i)).collect();
        let blocks = c.request_blocks(1, group).unwrap();
        let blocks: Vec<i32> = blocks.iter().map(|&b| b as i32).collect();
        assert_eq!(table_row, blocks, "the table mirrors the row");
        assert_eq!(c.table().row_len(at), blocks.len());
    }
}

#[test]
fn window_release_vectors_in_the_table() {
    // B = 2, W = 4: c=4 frees nothing; c=5 block 0; c=6 nothing more; c=7 block 1;
    // c=11 blocks 2 and 3.
    let mut c = coordinator(32, vec![window(2, 4)]);
    add(&mut c, 1, &tokens(12));
    assert!(allocate(&mut c, 1, 0, 4));
    check_release(
        &mut c,
        0,
        &[
            (4, 1, &[]),
            (5, 1, &[0]),
            (6, 1, &[0]),
            (7, 4, &[0, 1]),
            (11, 1, &[0, 1, 2, 3]),
        ],
    );
    assert_eq!(c.num_used_blocks_per_group(), &[2]);
}

#[test]
fn chunked_release_vectors_in_the_table() {
    // B = 2, C = 4: c=4 nulls blocks 0-1; c=6 still 0-1; c=12 blocks 0-5.
    let mut c = coordinator(32, vec![chunked(2, 4)]);
    add(&mut c, 1, &tokens(13));
    assert!(allocate(&mut c, 1, 0, 4));
    check_release(
        &mut c,
        0,
        &[
            (4, 2, &[0, 1]),
            (6, 6, &[0, 1]),
            (12, 1, &[0, 1, 2, 3, 4, 5]),
        ],
    );
}

#[test]
fn design_check_two_windowed_blocks_against_seven_full() {
    // B = 16, W = 32, length 112, c = 111.
    let mut c = coordinator(64, vec![full(16), window(16, 32)]);
    add(&mut c, 1, &tokens(112));
    assert!(allocate(&mut c, 1, 0, 64));
    assert!(allocate(&mut c, 1, 64, 47));
    assert!(allocate(&mut c, 1, 111, 1));
    assert_eq!(c.num_used_blocks_per_group(), &[7, 2]);
    assert_eq!(c.pool().num_free_blocks(), 63 - 9);
    c.free_request(1).unwrap();
    assert_eq!(c.pool().num_free_blocks(), 63);
    assert_eq!(c.num_used_blocks_per_group(), &[0, 0]);
}

#[test]
fn cache_hit_across_two_requests_full_and_window() {
    let mut c = coordinator(64, vec![full(2), window(2, 4)]);
    let prompt = tokens(12);
    add(&mut c, 1, &prompt);
    assert_eq!(c.find_cache_hit(1).unwrap(), 0);
    assert!(allocate(&mut c, 1, 0, 12));
    c.free_request(1).unwrap();
    add(&mut c, 2, &prompt);
    // At most 11 tokens may hit; aligned to 2 -> 10.
    assert_eq!(c.find_cache_hit(2).unwrap(), 10);
    let free_before = c.pool().num_free_blocks();
    assert!(allocate(&mut c, 2, 10, 2));
    // Full: 5 hit blocks + 1 new; window: skipped(10) = 7 -> 3 nulls, 2 hit blocks + 1 new.
    assert_eq!(nulls(&c, 2, 0), vec![false; 6]);
    assert_eq!(nulls(&c, 2, 1), vec![true, true, true, false, false, false]);
    assert_eq!(free_before - c.pool().num_free_blocks(), 6 + 3);
    let stats = c.stats();
    assert_eq!(stats.prefix_queries, 24);
    assert_eq!(stats.prefix_hits, 10);
}

#[test]
fn decode_steps_cache_the_block_they_fill_and_only_move_counters_inside_one() {
    // Full B = 4 and window B = 4, W = 8. A 5-token prompt, then decode steps one token at a
    // time: the steps inside a block change no entry; the step that fills block 1 (token 7)
    // releases and allocates nothing but caches the block, so a later request with those 8
    // tokens hits all of them.
    let mut c = coordinator(64, vec![full(4), window(4, 8)]);
    let prompt = tokens(5);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 5));
    let rows_before = [0, 1].map(|g| c.request_blocks(1, g).unwrap().to_vec());
    let free_before = c.pool().num_free_blocks();
    for (computed, token) in [(5, 7), (6, 8)] {
        c.append_token_ids(1, &[token]).unwrap();
        assert!(allocate(&mut c, 1, computed, 1));
        for (group, row) in rows_before.iter().enumerate() {
            assert_eq!(
                c.request_blocks(1, group).unwrap(),
                &row[..],
                "c = {computed}"
            );
        }
        assert_eq!(c.pool().num_free_blocks(), free_before);
    }
    c.append_token_ids(1, &[9]).unwrap();
    assert!(allocate(&mut c, 1, 7, 1));
    for group in [0, 1] {
        assert_eq!(c.request_blocks(1, group).unwrap(), &rows_before[group][..]);
    }
    let mut second: Vec<u32> = prompt.clone();
    second.extend([7, 8, 9, 1]);
    add(&mut c, 2, &second);
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
}

#[test]
fn hybrid_hit_ends_at_a_key_unit_and_is_shortened_by_the_full_group() {
    // Full B = 4 keyed by sub-blocks of 2 (the window's block size), window B = 2 W = 4: hits
    // are multiples of 2. The first request's tail block holds 3 of 4 tokens: freed under the
    // partial key of its first unit, so the same prompt hits 14, not 12.
    let mut c = coordinator(64, vec![full(4), window(2, 4)]);
    let prompt = tokens(15);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 15));
    let tail = c.request_blocks(1, 0).unwrap()[3];
    c.free_request(1).unwrap();
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 14);
    assert!(allocate(&mut c, 2, 14, 1));
    assert_eq!(
        c.request_blocks(2, 0).unwrap()[3],
        tail,
        "the tail block is taken"
    );
    c.free_request(2).unwrap();
    // Windowed groups hit at their own block size: window B = 4 with full B = 2 aligns to 4.
    let mut w = coordinator(64, vec![full(2), window(4, 8)]);
    add(&mut w, 1, &prompt);
    assert!(allocate(&mut w, 1, 0, 15));
    w.free_request(1).unwrap();
    add(&mut w, 2, &prompt);
    assert_eq!(w.find_cache_hit(2).unwrap(), 12);
    // A prompt that shares only 6 tokens: its full block 1 differs, but the cached one holds
    // its first unit (tokens 4..6): a hit of 6 by a copy. In the windowed-coarse
    // configuration the same prompt stops at 4.
    let mut other = prompt.clone();
    other[6] = 1;
    add(&mut c, 3, &other);
    c.take_block_copies(); // the steps that computed the cached blocks have run
    assert_eq!(c.find_cache_hit(3).unwrap(), 6);
    add(&mut w, 3, &other);
    assert_eq!(w.find_cache_hit(3).unwrap(), 4);
}

#[test]
fn window_caches_only_blocks_a_hit_can_use() {
    // Window B = 2 W = 3 (one kept block) beside window B = 4 W = 64: hits are multiples of 4
    // tokens, so only the odd blocks of the first (the tail of each 4-token segment) are ever
    // needed.
    let mut c = coordinator(64, vec![window(4, 64), window(2, 3)]);
    add(&mut c, 1, &tokens(16));
    assert!(allocate(&mut c, 1, 0, 16));
    // 4 blocks of the wide window + 4 of the 8 narrow-window blocks.
    assert_eq!(c.stats().pool.num_cached_blocks, 8);
    c.free_request(1).unwrap();
    add(&mut c, 2, &tokens(16));
    assert_eq!(c.find_cache_hit(2).unwrap(), 12);
}

#[test]
fn a_hit_may_end_inside_a_long_full_attention_block() {
    // Full B = 6 = 3 units of 2, window B = 2 W = 4. The first request computes 11 tokens: its
    // block 1 (tokens 6..12) holds 5, i.e. 2 whole units, and is freed under that partial key.
    let mut c = coordinator(64, vec![full(6), window(2, 4)]);
    let first = tokens(11);
    add(&mut c, 1, &first);
    assert!(allocate(&mut c, 1, 0, 11));
    let f = c.request_blocks(1, 0).unwrap().to_vec();
    c.free_request(1).unwrap();
    let cached_before = c.stats().pool.num_cached_blocks;
    // The next turn: the same 11 tokens and 3 more. Hit 6 + 2 units = 10 tokens; the window
    // needs tokens 7..10 (its blocks 3 and 4), which are cached.
    let mut second = first.clone();
    second.extend([50, 51, 52]);
    add(&mut c, 2, &second);
    assert_eq!(c.find_cache_hit(2).unwrap(), 10);
    assert!(allocate(&mut c, 2, 10, 4));
    let row = c.request_blocks(2, 0).unwrap().to_vec();
    assert_eq!(row[..2], f[..2], "block 0 shared, block 1 taken");
    assert_eq!(c.pool().ref_count(f[1]), 1);
    // The taken block left the cache; the allocate cached block 1 again (full now) and the
    // window's new blocks 5 and 6.
    assert_eq!(c.stats().pool.num_cached_blocks, cached_before - 1 + 3);
    assert_eq!(c.stats().pool.num_evictions, 0, "a take is not an eviction");
    // While the second request holds it (cached again under its full key once it filled),
    // the block cannot be taken. Until the step that fills it has run (the engine takes the
    // copies once per step), the same first prompt hits block 0 only; then 10 tokens, through
    // a copy into a new block whose source stays held until the request's next allocate.
    add(&mut c, 3, &first);
    assert_eq!(c.find_cache_hit(3).unwrap(), 6);
    assert!(c.take_block_copies().is_empty());
    assert_eq!(c.find_cache_hit(3).unwrap(), 10);
    assert!(allocate(&mut c, 3, 10, 1));
    let dst = c.request_blocks(3, 0).unwrap()[1];
    let copy = BlockCopy {
        request_id: 3,
        src: f[1],
        dst,
    };
    assert_eq!(c.take_block_copies(), [copy]);
    assert!(c.take_block_copies().is_empty(), "taken once");
    assert_eq!(
        c.pool().ref_count(f[1]),
        2,
        "held by request 2 and as a copy source"
    );
    c.append_token_ids(3, &[70]).unwrap();
    assert!(allocate(&mut c, 3, 11, 1));
    assert_eq!(
        c.pool().ref_count(f[1]),
        1,
        "released after the next allocate"
    );
    c.free_request(3).unwrap();
    // Once the second request is freed (14 computed), its block 1 is full and cached under the
    // full key, and its block 2 (tokens 12..14, one unit) under a partial key: a longer prompt
    // hits all 14.
    c.free_request(2).unwrap();
    let mut third = second.clone();
    third.extend([60, 61]);
    add(&mut c, 4, &third);
    assert_eq!(c.find_cache_hit(4).unwrap(), 14);
    assert!(allocate(&mut c, 4, 14, 2));
    assert_eq!(c.request_blocks(4, 0).unwrap()[..2], f[..2]);
}

#[test]
fn a_taken_block_the_pool_reused_meanwhile_drops_the_hit() {
    // Full B = 4 = 2 units of 2, window B = 2 W = 64. The partial tail block of the first
    // request is found, then reused by an allocation before the hit is taken: the allocate is
    // refused and the pending hit dropped, and nothing leaks.
    let mut c = coordinator(16, vec![full(4), window(2, 64)]);
    let prompt = tokens(6);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 6));
    c.free_request(1).unwrap();
    let mut longer = prompt.clone();
    longer.extend([40, 41]);
    add(&mut c, 2, &longer);
    assert_eq!(c.find_cache_hit(2).unwrap(), 6);
    // A third request takes every free block.
    add(
        &mut c,
        3,
        &tokens(20).iter().map(|t| t + 100).collect::<Vec<_>>(),
    );
    assert!(allocate(&mut c, 3, 0, 20));
    assert_eq!(c.pool().num_free_blocks(), 0);
    assert!(!allocate(&mut c, 2, 6, 2));
    assert_eq!(c.pending_hit_tokens(2).unwrap(), 0);
    c.free_request(3).unwrap();
    c.free_request(2).unwrap();
    assert_eq!(c.pool().num_free_blocks(), 15);
}

#[test]
fn chunked_hit_needs_only_the_current_chunk() {
    let mut c = coordinator(64, vec![full(2), chunked(2, 4)]);
    add(&mut c, 1, &tokens(10));
    assert!(allocate(&mut c, 1, 0, 10));
    c.free_request(1).unwrap();
    add(&mut c, 2, &tokens(10));
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
    assert!(allocate(&mut c, 2, 8, 2));
    assert_eq!(nulls(&c, 2, 1), vec![true, true, true, true, false]);
}

#[test]
fn salt_and_lora_separate_cache_entries() {
    let mut c = coordinator(64, vec![full(2)]);
    add(&mut c, 1, &tokens(8));
    assert!(allocate(&mut c, 1, 0, 8));
    c.free_request(1).unwrap();
    for extra in [
        ExtraKeys {
            cache_salt: Some("other tenant".into()),
            ..ExtraKeys::default()
        },
        ExtraKeys {
            lora_id: Some(3),
            ..ExtraKeys::default()
        },
    ] {
        c.add_request(NewRequest {
            request_id: 2,
            prompt_token_ids: &tokens(8),
            max_total_tokens: None,
            extra,
        })
        .unwrap();
        assert_eq!(c.find_cache_hit(2).unwrap(), 0);
        c.free_request(2).unwrap();
    }
}

#[test]
fn freeing_a_request_evicts_its_chain_tail_first() {
    let mut c = coordinator(8, vec![full(2)]);
    add(&mut c, 1, &tokens(6));
    assert!(allocate(&mut c, 1, 0, 6));
    let blocks = c.request_blocks(1, 0).unwrap().to_vec();
    c.free_request(1).unwrap();
    let order = c.pool().free_queue_order();
    assert_eq!(
        &order[order.len() - 3..],
        &[blocks[2], blocks[1], blocks[0]]
    );
}

#[test]
fn allocate_is_all_or_nothing() {
    let mut c = coordinator(10, vec![full(2), window(2, 4)]);
    add(&mut c, 1, &tokens(8));
    add(&mut c, 2, &tokens(8));
    assert!(allocate(&mut c, 1, 0, 4));
    let free_before = c.pool().num_free_blocks();
    // Needs 4 + 4 blocks, only 5 free: nothing changes.
    assert!(!allocate(&mut c, 2, 0, 8));
    assert_eq!(c.pool().num_free_blocks(), free_before);
    assert!(c.request_blocks(2, 0).unwrap().is_empty());
    assert_eq!(c.table().row_len(row_ref(&c, 2, 0)), 0);
}

#[test]
fn allocate_batch_stops_at_the_first_request_that_does_not_fit() {
    let mut c = coordinator(8, vec![full(2)]);
    for id in 1..=3 {
        add(&mut c, id, &tokens(6));
    }
    let step = |request_id| AllocateStep {
        request_id,
        num_computed_tokens: 0,
        num_new_tokens: 6,
    };
    assert_eq!(c.allocate_batch(&[step(1), step(2), step(3)]).unwrap(), 2);
    assert_eq!(c.pool().num_free_blocks(), 1);
    assert!(c.request_blocks(3, 0).unwrap().is_empty());
    // A bad step anywhere rejects the whole batch before anything happens.
    c.free_request(1).unwrap();
    let bad = AllocateStep {
        request_id: 99,
        ..step(3)
    };
    assert_eq!(
        c.allocate_batch(&[step(3), bad]),
        Err(CoreError::UnknownRequest { request_id: 99 })
    );
    assert!(c.request_blocks(3, 0).unwrap().is_empty());
    assert!(matches!(
        c.allocate_batch(&[step(3), step(3)]),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(c.allocate_batch(&[step(3)]).unwrap(), 1);
}

#[test]
fn admission_refuses_what_can_never_fit() {
    // Window 4096, block 16, batch 64: cap cdiv(4095 + 64, 16) + 1 = 261 blocks, plus full.
    let mut c = Coordinator::new(CoordinatorConfig {
        num_blocks: 300,
        groups: vec![full(16), window(16, 4096)],
        max_num_reqs: 2,
        max_model_len: 8192,
        max_num_batched_tokens: 64,
        enable_prefix_caching: false,
        hash: HashAlgo::Sha256,
        hash_seed: 1,
    })
    .unwrap();
    assert_eq!(c.max_blocks_needed(8192), 512 + 261);
    assert_eq!(c.max_blocks_needed(100), 7 + 7);
    for max_total_tokens in [8192, 9000] {
        let refused = c.add_request(NewRequest {
            request_id: 1,
            prompt_token_ids: &tokens(10),
            max_total_tokens: Some(max_total_tokens),
            extra: ExtraKeys::default(),
        });
        assert!(matches!(refused, Err(CoreError::RequestTooLarge(_))));
    }
    assert_eq!(c.num_requests(), 0);
    assert_eq!(
        c.find_cache_hit(1),
        Err(CoreError::UnknownRequest { request_id: 1 })
    );
}

#[test]
fn bad_input_is_rejected_with_state_unchanged() {
    let mut c = coordinator(16, vec![full(2), window(2, 4)]);
    add(&mut c, 1, &tokens(6));
    assert!(allocate(&mut c, 1, 0, 4));
    assert!(allocate(&mut c, 1, 3, 1));
    let free = c.pool().num_free_blocks();
    let row = c.request_blocks(1, 0).unwrap().to_vec();
    let step = |computed, new| AllocateStep {
        request_id: 1,
        num_computed_tokens: computed,
        num_new_tokens: new,
    };
    // Backwards, beyond the slots, beyond the known tokens, above the batch limit.
    for (computed, new) in [(2, 1), (5, 1), (7, 1), (3, 65)] {
        assert!(
            matches!(
                c.allocate(step(computed, new)),
                Err(CoreError::InvalidArgument(_))
            ),
            "c = {computed}, n = {new}"
        );
    }
    assert_eq!(c.pool().num_free_blocks(), free);
    assert_eq!(c.request_blocks(1, 0).unwrap(), row.as_slice());
    assert_eq!(
        c.add_request(NewRequest {
            request_id: 1,
            prompt_token_ids: &tokens(2),
            ..NewRequest::default()
        }),
        Err(CoreError::DuplicateRequest { request_id: 1 })
    );
    assert!(matches!(
        c.add_request(NewRequest {
            request_id: 5,
            prompt_token_ids: &[],
            ..NewRequest::default()
        }),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(
        c.free_request(42),
        Err(CoreError::UnknownRequest { request_id: 42 })
    );
    assert!(matches!(
        c.request_blocks(1, 2),
        Err(CoreError::InvalidGroup { group: 2, .. })
    ));
    assert!(matches!(
        c.find_cache_hit(1),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(matches!(
        c.append_token_ids(1, &vec![1; 300]),
        Err(CoreError::InvalidArgument(_))
    ));
    for id in 2..=4 {
        add(&mut c, id, &tokens(2));
    }
    assert_eq!(
        c.add_request(NewRequest {
            request_id: 9,
            prompt_token_ids: &tokens(2),
            ..NewRequest::default()
        }),
        Err(CoreError::TooManyRequests { max_num_reqs: 4 })
    );
    assert_eq!(c.num_requests(), 4);
    assert_eq!(c.pool().num_free_blocks(), free);
    assert_eq!(c.request_blocks(1, 0).unwrap(), row.as_slice());
}

#[test]
fn first_allocate_must_start_at_zero_or_at_the_hit() {
    let mut c = coordinator(16, vec![full(2)]);
    add(&mut c, 1, &tokens(6));
    assert!(matches!(
        c.allocate(AllocateStep {
            request_id: 1,
            num_computed_tokens: 2,
            num_new_tokens: 1,
        }),
        Err(CoreError::InvalidArgument(_))
    ));
    assert!(allocate(&mut c, 1, 0, 6));
}

#[test]
fn invalid_configs_are_rejected() {
    let base = CoordinatorConfig {
        num_blocks: 16,
        groups: vec![full(2)],
        max_num_reqs: 2,
        max_model_len: 64,
        max_num_batched_tokens: 16,
        enable_prefix_caching: true,
        hash: HashAlgo::Xxh3,
        hash_seed: 0,
    };
    let with = |change: &dyn Fn(&mut CoordinatorConfig)| {
        let mut config = base.clone();
        change(&mut config);
        config
    };
    let variants = [
        with(&|c| c.num_blocks = 1),
        with(&|c| c.groups = vec![]),
        with(&|c| c.groups = vec![full(0)]),
        with(&|c| c.groups = vec![window(2, 0)]),
        with(&|c| c.groups = vec![chunked(2, 3)]),
        with(&|c| c.max_num_reqs = 0),
        with(&|c| c.max_model_len = 0),
        with(&|c| c.max_num_batched_tokens = 0),
        with(&|c| c.max_num_reqs = 1 << 30),
    ];
    for config in variants {
        assert!(
            matches!(
                Coordinator::new(config.clone()),
                Err(CoreError::InvalidArgument(_))
            ),
            "{config:?}"
        );
    }
    assert!(Coordinator::new(base).is_ok());
}

#[test]
fn reset_prefix_cache_only_when_idle() {
    let mut c = coordinator(16, vec![full(2)]);
    add(&mut c, 1, &tokens(4));
    assert!(allocate(&mut c, 1, 0, 4));
    assert!(!c.reset_prefix_cache());
    c.free_request(1).unwrap();
    assert!(c.reset_prefix_cache());
    add(&mut c, 2, &tokens(4));
    assert_eq!(c.find_cache_hit(2).unwrap(), 0);
}

#[test]
fn an_evicted_pending_hit_is_dropped_and_refused() {
    let mut c = coordinator(6, vec![full(2)]);
    add(&mut c, 1, &tokens(4));
    assert!(allocate(&mut c, 1, 0, 4));
    c.free_request(1).unwrap();
    add(&mut c, 2, &tokens(4));
    assert_eq!(c.find_cache_hit(2).unwrap(), 2);
    // Another request takes every free block, evicting the hit.
    add(&mut c, 3, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    assert!(allocate(&mut c, 3, 0, 10));
    let free = c.pool().num_free_blocks();
    assert!(!allocate(&mut c, 2, 2, 2));
    assert_eq!(c.pending_hit_tokens(2).unwrap(), 0);
    assert_eq!(c.pool().num_free_blocks(), free);
    c.free_request(3).unwrap();
    assert_eq!(c.find_cache_hit(2).unwrap(), 0);
    assert!(allocate(&mut c, 2, 0, 4));
}

#[test]
fn append_batch_is_validated_as_a_whole() {
    let mut c = coordinator(16, vec![full(2)]);
    add(&mut c, 1, &tokens(3));
    add(&mut c, 2, &tokens(3));
    assert!(matches!(
        c.append_token_ids_batch(&[1, 2, 1], &[5, 5, 5]),
        Err(CoreError::InvalidArgument(_))
    ));
    assert_eq!(
        c.append_token_ids_batch(&[1, 9], &[5, 5]),
        Err(CoreError::UnknownRequest { request_id: 9 })
    );
    assert_eq!((c.num_tokens(1).unwrap(), c.num_tokens(2).unwrap()), (3, 3));
    c.append_token_ids_batch(&[2, 1], &[5, 6]).unwrap();
    assert_eq!((c.num_tokens(1).unwrap(), c.num_tokens(2).unwrap()), (4, 4));
}

/// Records in `seen[i]` the block of entry `i` of a request's row the first time it is not null
/// (so blocks a window released later are still known).
fn remember_blocks(c: &Coordinator, request_id: u64, group: usize, seen: &mut Vec<u32>) {
    let row = c.request_blocks(request_id, group).unwrap();
    seen.resize(row.len().max(seen.len()), NULL_BLOCK);
    for (entry, &block) in seen.iter_mut().zip(row) {
        if *entry == NULL_BLOCK {
            *entry = block;
        }
    }
}

#[test]
fn freed_request_goes_tail_first_across_groups_after_low_window_blocks() {
    // Full B=2 and window W=4 B=2 (hit alignment 2), 12 tokens in three chunks: at 8 computed
    // the window releases blocks 0 and 1, which no hit point near the end needs (Low tier).
    let mut c = coordinator(32, vec![full(2), window(2, 4)]);
    add(&mut c, 1, &tokens(12));
    let mut w = Vec::new();
    for (computed, new) in [(0, 4), (4, 4), (8, 4)] {
        assert!(allocate(&mut c, 1, computed, new));
        remember_blocks(&c, 1, 1, &mut w);
    }
    let f = c.request_blocks(1, 0).unwrap().to_vec();
    let released = c.pool().free_queue_order();
    assert_eq!(&released[released.len() - 2..], &[w[1], w[0]]);
    c.free_request(1).unwrap();
    let order = c.pool().free_queue_order();
    // Low first (w1, w0), then by end position, last first, full before window on ties.
    let expected = [
        w[1], w[0], f[5], w[5], f[4], w[4], f[3], w[3], f[2], w[2], f[1], f[0],
    ];
    assert_eq!(&order[order.len() - expected.len()..], &expected);
    // The keyless blocks (never used) are all before them.
    assert_eq!(order.len(), 31);
}

#[test]
fn end_point_window_blocks_released_early_are_requeued_with_the_tail() {
    // Window W=12 B=4 (nothing slides out below 15 tokens) and window W=4 B=2: hits align to
    // 4 (windowed groups hit at their own block size). A decode step at 13 computed releases
    // window block 4, which the end point 12 still needs: it is re-touched when the request is
    // freed and queued with the tail in position order, after the Low blocks 0..3.
    let mut c = coordinator(32, vec![window(4, 12), window(2, 4)]);
    add(&mut c, 1, &tokens(12));
    let mut w = Vec::new();
    assert!(allocate(&mut c, 1, 0, 12));
    remember_blocks(&c, 1, 1, &mut w);
    c.append_token_ids(1, &[7]).unwrap();
    assert!(allocate(&mut c, 1, 12, 1));
    remember_blocks(&c, 1, 1, &mut w);
    c.append_token_ids(1, &[8]).unwrap();
    assert!(allocate(&mut c, 1, 13, 1));
    remember_blocks(&c, 1, 1, &mut w);
    let f = c.request_blocks(1, 0).unwrap().to_vec();
    assert_eq!(nulls(&c, 1, 1)[..5], [true; 5], "blocks 0..4 released");
    let w4 = w[4];
    c.free_request(1).unwrap();
    let order = c.pool().free_queue_order();
    // f3 holds 14 of 16 tokens: keyless, with the never-used blocks.
    let expected = [
        f[3], w[3], w[2], w[1], w[0], w[6], f[2], w[5], w4, f[1], f[0],
    ];
    assert_eq!(&order[order.len() - expected.len()..], &expected);
    assert_eq!(
        c.pool().ref_count(w4),
        0,
        "the re-touch gave its reference back"
    );
    // The end point is still hittable: a longer prompt with the same first 14 tokens hits 12.
    let mut prompt = tokens(12);
    prompt.extend([7, 8, 9, 10]);
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 12);
}

#[test]
fn every_looked_up_token_is_a_hit_or_has_a_reason() {
    // Full B = 2 and window B = 2 W = 4 (hits need the 2 blocks before the hit point).
    let mut c = coordinator(48, vec![full(2), window(2, 4)]);
    let mut last = c.stats().hits;
    let mut delta = |c: &Coordinator| {
        let now = c.stats().hits;
        let d = [
            now.hits - last.hits,
            now.miss_window_tail - last.miss_window_tail,
            now.miss_never_cached - last.miss_never_cached,
            now.miss_evicted - last.miss_evicted,
            now.miss_alignment - last.miss_alignment,
        ];
        assert_eq!(d.iter().sum::<u64>(), now.queries - last.queries);
        last = now;
        d
    };
    // A prompt looked up before anything is cached, then again once it was: the second hits
    // 8 of 10 (the last token is computed, and 9 is not a multiple of 2).
    // A lookup counts once its request computes (its first allocate beyond the hit).
    let first = tokens(10);
    add(&mut c, 1, &first);
    assert_eq!(c.find_cache_hit(1).unwrap(), 0);
    assert!(allocate(&mut c, 1, 0, 10));
    assert_eq!(delta(&c), [0, 0, 8, 0, 2]);
    c.free_request(1).unwrap();
    add(&mut c, 2, &first);
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
    assert!(allocate(&mut c, 2, 8, 2));
    assert_eq!(delta(&c), [8, 0, 0, 0, 2]);
    assert_eq!(c.stats().hits.alone, vec![8, 8]);
    c.free_request(2).unwrap();
    // A long request computed 4 tokens at a time: its early window blocks are released as it
    // goes; taking every free block then evicts them (and the first prompt's).
    let long: Vec<u32> = (200..220).collect();
    add(&mut c, 4, &long);
    for computed in (0..20).step_by(4) {
        assert!(allocate(&mut c, 4, computed, 4));
    }
    // A filler computing its whole prompt at once (a block per 2 tokens in each group) takes
    // the free blocks through the coordinator, which records what its allocation evicts; an
    // odd one out is taken on the pool first (the least recently freed: a released window
    // block, whose eviction the filter need not know, as "window tail" is told without it).
    let mut taken = Vec::new();
    let free = c.pool().num_free_blocks();
    c.pool().get_new_blocks(free % 2, &mut taken).unwrap();
    let filler: Vec<u32> = (1000..1000 + free as u32 / 2 * 2).collect();
    add(&mut c, 5, &filler);
    assert!(allocate(&mut c, 5, 0, filler.len()));
    assert_eq!(c.pool().num_free_blocks(), 0);
    // The long request's first 12 tokens, then others: its full-attention blocks are cached
    // (and held), the window blocks a hit at 12 needs are gone: window tail 12; the next full
    // unit (tokens 12..14 of this prompt) was never cached: 2; alignment 1.
    let mut shares_twelve = long[..12].to_vec();
    shares_twelve.extend([7, 7, 7]);
    add(&mut c, 6, &shares_twelve);
    assert_eq!(c.find_cache_hit(6).unwrap(), 0);
    // The first prompt again: evicted.
    add(&mut c, 7, &first);
    assert_eq!(c.find_cache_hit(7).unwrap(), 0);
    // Counted as they were looked up, once they compute (with the blocks given back).
    c.free_request(5).unwrap();
    c.pool().free_blocks(&taken).unwrap();
    assert!(allocate(&mut c, 6, 0, 15));
    assert_eq!(delta(&c), [0, 12, 2, 0, 1]);
    assert!(allocate(&mut c, 7, 0, 10));
    assert_eq!(delta(&c), [0, 0, 0, 8, 2]);
    let stats = c.stats().hits;
    assert_eq!(stats.shortened, vec![12, 0]);
}

#[test]
fn keys_a_reset_dropped_count_as_evicted() {
    // Full B = 2 and window B = 2 W = 4. A prompt computed and freed, then the cache reset:
    // looked up again it misses 8 tokens that were cached before (evicted, not never cached).
    let mut c = coordinator(48, vec![full(2), window(2, 4)]);
    let prompt = tokens(10);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 10));
    c.free_request(1).unwrap();
    assert!(c.reset_prefix_cache());
    let before = c.stats().hits;
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 0);
    assert!(allocate(&mut c, 2, 0, 10));
    let after = c.stats().hits;
    assert_eq!(after.miss_evicted - before.miss_evicted, 8);
    assert_eq!(after.miss_never_cached, before.miss_never_cached);
}

#[test]
fn a_lookup_counts_once_its_request_computes() {
    // A request freed before any token beyond its hit got a slot (a hold given back, a failed
    // admission) and a lookup superseded by the next one are never counted; the counters only
    // grow, and a request that computed counts once per admission.
    let mut c = coordinator(48, vec![full(2), window(2, 4)]);
    let prompt = tokens(10);
    add(&mut c, 1, &prompt);
    c.find_cache_hit(1).unwrap();
    assert_eq!(c.stats().hits.queries, 0);
    assert!(allocate(&mut c, 1, 0, 10));
    c.free_request(1).unwrap();
    let counted = c.stats().hits;
    assert_eq!(counted.queries, 10);
    // Held (its hit taken, nothing new) and given back: not counted.
    add(&mut c, 2, &prompt);
    assert_eq!(c.find_cache_hit(2).unwrap(), 8);
    assert!(allocate(&mut c, 2, 8, 0));
    c.free_request(2).unwrap();
    assert_eq!(c.stats().hits, counted);
    // Looked up twice, then held, then computing: counted once, the last lookup's figures.
    add(&mut c, 3, &prompt);
    c.find_cache_hit(3).unwrap();
    c.find_cache_hit(3).unwrap();
    assert!(allocate(&mut c, 3, 8, 0));
    assert_eq!(c.stats().hits, counted);
    assert!(allocate(&mut c, 3, 8, 2));
    c.free_request(3).unwrap();
    let stats = c.stats().hits;
    assert_eq!((stats.queries, stats.hits), (20, 8));
}

#[test]
fn a_probe_past_its_first_round_finds_a_hit_on_a_freed_tail() {
    // Full B = 16 keyed by units of 2, window B = 2 W = 2. A freed 10-token request leaves block
    // 0 under the partial key of its 5 units only: a hit of 10 takes it, a hit of 6 (all the
    // probe's first 8 tokens allow) finds nothing. The probe must not stop there.
    let mut c = coordinator(32, vec![full(16), window(2, 2)]);
    let prompt = tokens(10);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 10));
    c.free_request(1).unwrap();
    c.take_block_copies();
    let mut longer = prompt.clone();
    longer.extend(100..110);
    let extra = ExtraKeys::default();
    assert_eq!(c.probe_cache_hit(&longer, &extra).unwrap(), 10);
    add(&mut c, 2, &longer);
    assert_eq!(c.find_cache_hit(2).unwrap(), 10);
}

#[test]
fn a_probe_finds_the_hit_a_request_would_get_and_changes_nothing() {
    // Full B = 4 keyed by units of 2, window B = 2 W = 4.
    let mut c = coordinator(32, vec![full(4), window(2, 4)]);
    let prompt = tokens(15);
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 15));
    c.free_request(1).unwrap();
    c.take_block_copies(); // the step that computed those blocks has run
    let mut longer = prompt.clone();
    longer.extend([1, 2, 3]);
    let extra = ExtraKeys::default();
    let stats = c.stats();
    let order = c.pool().free_queue_order();
    assert_eq!(c.probe_cache_hit(&longer, &extra).unwrap(), 14);
    // Two tokens of a cached full block: a hit by a copy.
    assert_eq!(c.probe_cache_hit(&tokens(3), &extra).unwrap(), 2);
    let salted = ExtraKeys {
        cache_salt: Some("tenant".into()),
        ..ExtraKeys::default()
    };
    assert_eq!(c.probe_cache_hit(&longer, &salted).unwrap(), 0);
    assert_eq!(c.stats(), stats, "a probe is not counted");
    assert_eq!(
        c.pool().free_queue_order(),
        order,
        "a probe touches nothing"
    );
    assert!(matches!(
        c.probe_cache_hit(&[], &extra),
        Err(CoreError::InvalidArgument(_))
    ));
    add(&mut c, 2, &longer);
    assert_eq!(
        c.find_cache_hit(2).unwrap(),
        14,
        "the hit the probe promised"
    );
}

#[test]
fn allocate_keeping_a_reserve_counts_the_blocks_a_window_releases() {
    // Full B = 4 and window B = 4, W = 4, 9 usable blocks. Request 1 computes 8 tokens: 2 full
    // blocks and 2 window blocks, 5 blocks free. Its next step (tokens 8..12) takes a full
    // block and a window block and releases window block 0 (out of the window): 1 block net,
    // so a reserve of 4 is kept and one of 5 is not (refused, nothing changed).
    let mut c = coordinator(10, vec![full(4), window(4, 4)]);
    add(&mut c, 1, &tokens(12));
    assert!(allocate(&mut c, 1, 0, 8));
    assert_eq!(c.pool().num_free_blocks(), 5);
    let rows = [0, 1].map(|g| c.request_blocks(1, g).unwrap().to_vec());
    let step = AllocateStep {
        request_id: 1,
        num_computed_tokens: 8,
        num_new_tokens: 4,
    };
    assert!(!c.allocate_keeping(step, 5).unwrap());
    assert_eq!(
        c.pool().num_free_blocks(),
        5,
        "a refused allocate changes nothing"
    );
    for (group, row) in rows.iter().enumerate() {
        assert_eq!(c.request_blocks(1, group).unwrap(), &row[..]);
    }
    assert!(c.allocate_keeping(step, 4).unwrap());
    assert_eq!(c.pool().num_free_blocks(), 4);
}
