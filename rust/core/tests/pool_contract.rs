//! The `BlockAllocator` contract, checked once per pool: every behaviour below is a generic
//! function that `contract_tests!` runs on the lock-free `BlockPool` and on the `MutexPool`
//! reference. Single-threaded, the two must behave identically (same results, LRU order,
//! evictions and stats), so nothing here is pool-specific.
//!
//! Tests of one pool's internals stay in its module: `block_pool.rs` checks that the lock-free
//! free queue stays bounded under a hit-only workload (its stale entries and compaction are
//! private). `tests/pool_model.rs` compares the two pools on random operation sequences.

use hybrid_cache_core::{
    BlockAllocator, BlockHash, BlockPool, CacheKey, CoreError, FreeTier, MutexPool, NULL_BLOCK,
};

/// A pool the contract tests can build; `contract_tests!` implements it for each pool type.
trait Pool: BlockAllocator + Sized {
    /// A pool of `num_blocks` blocks, block 0 being the null block.
    fn with_blocks(num_blocks: usize) -> Self;
}

fn key(group: u32, hash: u128) -> CacheKey {
    CacheKey {
        group,
        hash: BlockHash(hash),
    }
}

/// Blocks come from the front of the free queue in id order at first; freed blocks (keyless
/// here) go to the tail in the order given.
fn allocates_in_lru_order_and_frees_to_the_tail<P: Pool>() {
    let pool = P::with_blocks(5);
    let mut out = Vec::new();
    pool.get_new_blocks(3, &mut out).unwrap();
    assert_eq!(out, vec![1, 2, 3]);
    pool.free_blocks(&[3, 2, 1]).unwrap();
    assert_eq!(pool.free_queue_order(), vec![4, 3, 2, 1]);
}

/// An allocation larger than the free count, a double free, the null block and an id out of
/// range are refused and change nothing. The frees here are short (see
/// `rejected_long_free_changes_nothing` for long ones).
fn rejects_without_changing_state<P: Pool>() {
    let pool = P::with_blocks(3);
    let mut out = Vec::new();
    assert!(matches!(
        pool.get_new_blocks(3, &mut out),
        Err(CoreError::NoFreeBlocks {
            requested: 3,
            free: 2
        })
    ));
    assert!(out.is_empty());
    pool.get_new_blocks(1, &mut out).unwrap();
    assert_eq!(
        pool.free_blocks(&[1, 1]),
        Err(CoreError::DoubleFree { block: 1 })
    );
    assert_eq!(pool.ref_count(1), 1);
    assert!(pool.free_blocks(&[NULL_BLOCK]).is_err());
    assert!(pool.free_blocks(&[9]).is_err());
    assert_eq!(pool.num_free_blocks(), 1);
}

/// A free call with many ids (30: more than `BlockPool` validates by a quadratic scan, so its
/// hash-map path) that repeats one id, names the null block or an id out of range is refused
/// as a whole.
fn rejected_long_free_changes_nothing<P: Pool>() {
    let pool = P::with_blocks(40);
    let mut out = Vec::new();
    pool.get_new_blocks(30, &mut out).unwrap();
    let mut twice = out.clone();
    twice.push(out[5]);
    assert_eq!(
        pool.free_blocks(&twice),
        Err(CoreError::DoubleFree { block: out[5] })
    );
    assert!(pool.free_blocks(&[1, NULL_BLOCK]).is_err());
    assert!(pool.free_blocks(&[1, 40]).is_err());
    assert!(out.iter().all(|&block| pool.ref_count(block) == 1));
    assert_eq!(pool.num_free_blocks(), 9);
}

/// A block carries one key: a second key for it is refused. Freed, it stays hittable under its
/// key; a touch takes it back off the free queue; reused after a second free, it loses the key
/// and the eviction is counted.
fn cached_block_is_hittable_after_free_and_evicted_on_reuse<P: Pool>() {
    let pool = P::with_blocks(3);
    let mut out = Vec::new();
    pool.get_new_blocks(1, &mut out).unwrap();
    assert!(pool.cache_block(1, key(0, 7)).unwrap());
    assert!(!pool.cache_block(1, key(1, 7)).unwrap());
    pool.free_blocks(&[1]).unwrap();
    assert_eq!(pool.cached_block(key(0, 7)), Some(1));
    assert_eq!(pool.cached_block(key(1, 7)), None);
    assert!(pool.touch_cached(1, key(0, 7)));
    assert_eq!(pool.free_queue_order(), vec![2]);
    pool.free_blocks(&[1]).unwrap();
    out.clear();
    pool.get_new_blocks(2, &mut out).unwrap();
    assert_eq!(out, vec![2, 1]);
    assert_eq!(pool.cached_block(key(0, 7)), None);
    assert_eq!(pool.stats().num_evictions, 1);
}

/// A second block cached under a key becomes its spare (a third is refused). Freed, the
/// keyless block goes before both cached ones. Touching a free cached block in the middle of
/// the queue removes it from there (a touch under another key misses); when both copies are
/// reused, the key goes and two evictions are counted.
fn touch_removes_from_the_middle_and_eviction_drops_the_key<P: Pool>() {
    let pool = P::with_blocks(5);
    let mut out = Vec::new();
    pool.get_new_blocks(4, &mut out).unwrap();
    assert!(pool.cache_block(2, key(0, 9)).unwrap());
    assert!(pool.cache_block(3, key(0, 9)).unwrap(), "the spare copy");
    assert!(
        !pool.cache_block(4, key(0, 9)).unwrap(),
        "one spare per key"
    );
    assert_eq!(pool.stats().num_cached_blocks, 2);
    pool.free_blocks(&[4, 3, 2, 1]).unwrap();
    assert_eq!(pool.free_queue_order(), vec![4, 1, 3, 2]);
    assert_eq!(pool.cached_block(key(0, 9)), Some(2));
    assert!(pool.touch_cached(2, key(0, 9)));
    assert!(!pool.touch_cached(2, key(1, 9)));
    assert_eq!(pool.free_queue_order(), vec![4, 1, 3]);
    assert_eq!(pool.num_free_blocks(), 3);
    pool.free_blocks(&[2]).unwrap();
    out.clear();
    pool.get_new_blocks(4, &mut out).unwrap();
    assert_eq!(out, vec![4, 1, 3, 2]);
    assert_eq!(pool.cached_block(key(0, 9)), None);
    assert_eq!(pool.stats().num_evictions, 2);
    assert_eq!(pool.stats().num_cached_blocks, 0);
}

/// When a key's first copy is evicted, its spare takes its place and stays hittable.
fn spare_copy_is_found_once_the_first_is_evicted<P: Pool>() {
    let pool = P::with_blocks(4);
    let mut out = Vec::new();
    pool.get_new_blocks(3, &mut out).unwrap();
    assert!(pool.cache_block(1, key(0, 5)).unwrap());
    pool.free_blocks(&[1]).unwrap();
    assert!(
        pool.cache_block(2, key(0, 5)).unwrap(),
        "spare of the free first copy"
    );
    pool.free_blocks(&[3]).unwrap();
    out.clear();
    // Block 3 (keyless) goes first, then the oldest cached block: the first copy.
    pool.get_new_blocks(2, &mut out).unwrap();
    assert_eq!(out, vec![3, 1]);
    assert_eq!(
        pool.cached_block(key(0, 5)),
        Some(2),
        "the spare was promoted"
    );
    assert!(pool.touch_cached(2, key(0, 5)));
    assert_eq!(pool.ref_count(2), 2);
    assert_eq!(pool.stats().num_cached_blocks, 1);
    assert_eq!(pool.stats().num_evictions, 1);
}

/// Eviction order over the tiers: keyless free blocks first, then cached blocks freed `Low`,
/// then `Normal` ones, then `High` ones, oldest first within each; a keyless block asked into
/// `Normal` or `High` still goes first. Reused blocks come back keyless; `reset_prefix_cache`
/// leaves the order as it is.
fn keyless_blocks_go_first_then_low_then_normal<P: Pool>() {
    let pool = P::with_blocks(9);
    let mut out = Vec::new();
    pool.get_new_blocks(8, &mut out).unwrap();
    for block in [1, 2, 3, 4, 7] {
        assert!(pool.cache_block(block, key(0, block as u128)).unwrap());
    }
    pool.free_blocks_to(&[7], FreeTier::High).unwrap();
    pool.free_blocks_to(&[1], FreeTier::Normal).unwrap();
    pool.free_blocks_to(&[2, 5], FreeTier::Low).unwrap();
    pool.free_blocks_to(&[3, 6], FreeTier::Normal).unwrap();
    pool.free_blocks_to(&[4], FreeTier::Low).unwrap();
    pool.free_blocks_to(&[8], FreeTier::High).unwrap();
    assert_eq!(pool.free_queue_order(), vec![5, 6, 8, 2, 4, 1, 3, 7]);
    out.clear();
    pool.get_new_blocks(4, &mut out).unwrap();
    assert_eq!(out, vec![5, 6, 8, 2]);
    assert_eq!(pool.stats().num_evictions, 1);
    assert_eq!(
        pool.cached_block(key(0, 1)),
        Some(1),
        "Normal blocks outlive Low ones"
    );
    pool.free_blocks(&out).unwrap();
    assert!(pool.reset_prefix_cache());
    assert_eq!(pool.free_queue_order(), vec![5, 6, 8, 2, 4, 1, 3, 7]);
}

/// The same free cached block touched and freed again many times (enough rounds to cross
/// `BlockPool`'s queue compaction many times; fewer under Miri): every touch hits, and the
/// block ends up at the tail, after the blocks never used and the other one freed with it.
fn hit_only_workload_keeps_lru_order<P: Pool>() {
    let pool = P::with_blocks(8);
    let mut out = Vec::new();
    pool.get_new_blocks(2, &mut out).unwrap();
    assert!(pool.cache_block(out[0], key(0, 1)).unwrap());
    pool.free_blocks(&out).unwrap();
    let rounds = if cfg!(miri) { 100 } else { 10_000 };
    for _ in 0..rounds {
        assert!(pool.touch_cached(out[0], key(0, 1)));
        pool.free_blocks(&out[..1]).unwrap();
    }
    assert_eq!(pool.free_queue_order(), vec![3, 4, 5, 6, 7, 2, 1]);
}

/// `take_cached` takes a free cached block for the caller alone: out of the free queue with one
/// reference and without its key (the spare promoted), not counted as an eviction. A held block,
/// another key, a keyless or out-of-range block are refused and change nothing.
fn take_claims_a_free_cached_block_and_drops_its_key<P: Pool>() {
    let pool = P::with_blocks(6);
    let mut out = Vec::new();
    pool.get_new_blocks(4, &mut out).unwrap();
    assert!(pool.cache_block(1, key(0, 7)).unwrap());
    assert!(pool.cache_block(2, key(0, 7)).unwrap(), "spare of block 1");
    assert!(pool.cache_block(3, key(1, 8)).unwrap());
    assert!(!pool.take_cached(3, key(1, 8)), "held: refused");
    pool.free_blocks(&[1, 3, 4]).unwrap();
    assert!(!pool.take_cached(3, key(0, 8)), "another key: refused");
    assert!(!pool.take_cached(4, key(0, 4)), "keyless: refused");
    assert!(!pool.take_cached(NULL_BLOCK, key(0, 7)));
    assert!(!pool.take_cached(99, key(0, 7)));
    assert_eq!(pool.num_free_blocks(), 4);
    assert!(pool.take_cached(1, key(0, 7)));
    assert_eq!(pool.ref_count(1), 1);
    assert_eq!(pool.num_free_blocks(), 3);
    assert_eq!(pool.free_queue_order(), vec![5, 4, 3]);
    assert_eq!(
        pool.cached_block(key(0, 7)),
        Some(2),
        "the spare is found once the first copy is gone"
    );
    assert!(!pool.take_cached(1, key(0, 7)), "taken: no key any more");
    let stats = pool.stats();
    // The spare stays a spare (nothing is moved between the maps).
    assert_eq!((stats.num_cached_blocks, stats.num_spare_blocks), (2, 1));
    assert_eq!(stats.num_evictions, 0);
    // Freed again, the taken block is keyless: reused before the cached block 3.
    pool.free_blocks(&[1]).unwrap();
    assert_eq!(pool.free_queue_order(), vec![5, 4, 1, 3]);
}

/// A batch caches what `cache_block` one at a time would (a block already keyed and a key
/// with both copies are skipped), stops at a free block with the blocks before it cached, and
/// counts exactly what it cached.
fn a_batch_caches_as_one_call_per_block_and_counts_what_it_cached<P: Pool>() {
    let pool = P::with_blocks(8);
    let mut out = Vec::new();
    pool.get_new_blocks(6, &mut out).unwrap();
    assert!(pool.cache_block(out[0], key(0, 1)).unwrap());
    let batch = [
        (out[0], key(0, 9)), // already keyed
        (out[1], key(0, 1)), // the spare of key 1
        (out[2], key(0, 1)), // key 1 has both copies
        (out[3], key(1, 1)), // same hash, other group: another key
        (out[4], key(0, 2)),
    ];
    assert_eq!(pool.cache_blocks(&batch), Ok(3));
    let stats = pool.stats();
    assert_eq!((stats.num_cached_blocks, stats.num_spare_blocks), (4, 1));
    assert_eq!(pool.cached_block(key(1, 1)), Some(out[3]));
    assert_eq!(pool.cached_block(key(0, 2)), Some(out[4]));
    assert_eq!(pool.cached_block(key(0, 9)), None);

    pool.free_blocks(&[out[5]]).unwrap();
    let failing = [
        (out[2], key(0, 3)),
        (out[5], key(0, 4)),
        (out[2], key(0, 5)),
    ];
    assert!(matches!(
        pool.cache_blocks(&failing),
        Err(CoreError::InvalidBlock(_))
    ));
    assert_eq!(
        pool.cached_block(key(0, 3)),
        Some(out[2]),
        "cached before the error"
    );
    assert_eq!(pool.cached_block(key(0, 5)), None, "nothing after it");
    assert_eq!(pool.stats().num_cached_blocks, 5);
    assert_eq!(pool.cache_blocks(&[]), Ok(0));
    assert_eq!(pool.stats().num_cached_blocks, 5);
}

/// A pool whose every block is cached, then evicted and cached again under a new key, over and
/// over (a full pool under steady load), with `tidy` between the calls as the coordinator does:
/// every key cached in the last round is found on its block, the blocks come back in LRU order
/// and every eviction is counted and drops its key. (`BlockPool` rebuilds its cache
/// map here; `MutexPool` has nothing to tidy.)
fn evicting_every_block_in_turn_with_tidy_keeps_every_key<P: Pool>() {
    const BLOCKS: usize = 257;
    let rounds = if cfg!(miri) { 4 } else { 24 };
    let mut pool = P::with_blocks(BLOCKS);
    let mut next_key = 0u128;
    let mut out = Vec::new();
    let mut round_keys = Vec::new();
    for round in 0..rounds {
        round_keys.clear();
        for _ in 0..(BLOCKS - 1) / 16 {
            pool.tidy();
            out.clear();
            pool.get_new_blocks(16, &mut out).unwrap();
            for &block in &out {
                next_key += 1;
                let key = key((next_key % 2) as u32, next_key * 0x9e37_79b9);
                assert!(pool.cache_block(block, key).unwrap());
                round_keys.push((key, block));
            }
            pool.free_blocks(&out).unwrap();
        }
        pool.tidy();
        for &(key, block) in &round_keys {
            assert_eq!(pool.cached_block(key), Some(block), "round {round}");
        }
        let stats = pool.stats();
        assert_eq!(stats.num_cached_blocks, BLOCKS - 1);
        assert_eq!(stats.num_evictions, (round * (BLOCKS - 1)) as u64);
    }
    // The queue's order is the caching order: the oldest first.
    let order: Vec<_> = round_keys.iter().map(|&(_, block)| block).collect();
    assert_eq!(pool.free_queue_order(), order);
    // The oldest block goes first, and its key with it.
    let (oldest_key, oldest) = round_keys[0];
    out.clear();
    pool.get_new_blocks(1, &mut out).unwrap();
    assert_eq!(out, vec![oldest]);
    assert_eq!(pool.cached_block(oldest_key), None);
}

/// `contract_tests!([behaviour, ...] for module => Pool, ...)`: a module per pool with one
/// `#[test]` per behaviour, each running the generic function of that name on that pool.
macro_rules! contract_tests {
    ($behaviours:tt for $($module:ident => $pool:ty),* $(,)?) => {$(
        contract_tests!(@pool $module, $pool, $behaviours);
    )*};
    (@pool $module:ident, $pool:ty, [$($behaviour:ident),* $(,)?]) => {
        mod $module {
            use super::*;

            impl Pool for $pool {
                fn with_blocks(num_blocks: usize) -> Self {
                    <$pool>::new(num_blocks).unwrap()
                }
            }

            $(
                #[test]
                fn $behaviour() {
                    super::$behaviour::<$pool>();
                }
            )*
        }
    };
}

contract_tests!(
    [
        allocates_in_lru_order_and_frees_to_the_tail,
        rejects_without_changing_state,
        rejected_long_free_changes_nothing,
        cached_block_is_hittable_after_free_and_evicted_on_reuse,
        touch_removes_from_the_middle_and_eviction_drops_the_key,
        spare_copy_is_found_once_the_first_is_evicted,
        keyless_blocks_go_first_then_low_then_normal,
        hit_only_workload_keeps_lru_order,
        take_claims_a_free_cached_block_and_drops_its_key,
        a_batch_caches_as_one_call_per_block_and_counts_what_it_cached,
        evicting_every_block_in_turn_with_tidy_keeps_every_key,
    ] for
    block_pool => BlockPool,
    mutex_pool => MutexPool,
);
