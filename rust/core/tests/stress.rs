//! Multi-thread stress test of the lock-free `BlockPool` with exact accounting.
//!
//! Threads allocate (sometimes caching what they got under a key from a small shared space),
//! hit the cache (`cached_block` + `touch_cached`) and free into any of the four free tiers
//! (`FreeTier`: the tier a freed request's blocks join), all at once on one small pool so
//! that evictions, touches of free blocks and refused allocations race. Each block has a shadow
//! holder count, an exclusive owner slot (written by the thread the pool allocated it to) and a
//! content slot (the key value the allocator cached it under). Checked while running:
//! - an allocated block has no other holder and keeps its owner until freed (never handed out
//!   twice);
//! - a block touched under key `k` holds the content of `k` (a touch never returns a block that
//!   was evicted and reused in between);
//! - a refused allocation takes nothing, a granted one takes exactly what was asked.
//!
//! Checked at the end: every block free exactly once, all ref counts 0, and
//! `allocated + touched == freed`, `cached == evicted + still cached`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use hybrid_cache_core::{BlockAllocator, BlockHash, BlockId, BlockPool, CacheKey, FreeTier};

const TIERS: [FreeTier; 3] = [FreeTier::Low, FreeTier::Normal, FreeTier::High];

const NUM_KEYS: u64 = 24;

fn key(value: u64) -> CacheKey {
    CacheKey {
        group: (value % 2) as u32,
        hash: BlockHash(u128::from(value) << 64 | 0xabcd),
    }
}

struct Shadow {
    /// References held by test threads, per block.
    holders: Vec<AtomicUsize>,
    /// Thread id (1-based) of the thread the block was last allocated to.
    owner: Vec<AtomicUsize>,
    /// Key value the current allocation of the block represents.
    content: Vec<AtomicU64>,
}

#[derive(Default, Debug, Clone, Copy)]
struct Counts {
    allocated: u64,
    touched: u64,
    freed: u64,
    cached: u64,
    refused: u64,
}

struct Held {
    block: BlockId,
    /// True when this reference came from `get_new_blocks` (the exclusive owner).
    allocated: bool,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Operation mix: out of 16 draws, how many allocate and how many hit (the rest free).
#[derive(Clone, Copy)]
struct Mix {
    allocate: u64,
    hit: u64,
}

const BALANCED: Mix = Mix {
    allocate: 6,
    hit: 6,
};

/// Mostly hits that are freed again soon: stale queue entries pile up and force compaction.
const HIT_HEAVY: Mix = Mix {
    allocate: 1,
    hit: 9,
};

fn worker(
    pool: &BlockPool,
    shadow: &Shadow,
    start: &Barrier,
    (thread, mix): (usize, Mix),
    iterations: usize,
) -> Counts {
    start.wait();
    let mut counts = Counts::default();
    let mut rng = 0x9e37_79b9_7f4a_7c15 ^ (thread as u64 + 1).wrapping_mul(0x2545_f491);
    let mut held: Vec<Held> = Vec::new();
    let mut out = Vec::new();
    for _ in 0..iterations {
        let draw = xorshift(&mut rng) % 16;
        if draw < mix.allocate {
            let count = 1 + (xorshift(&mut rng) % 3) as usize;
            out.clear();
            if pool.get_new_blocks(count, &mut out).is_err() {
                assert!(out.is_empty(), "a refused allocation takes nothing");
                counts.refused += 1;
                continue;
            }
            assert_eq!(out.len(), count, "a granted allocation takes exactly count");
            for &block in &out {
                let b = block as usize;
                assert_ne!(block, 0, "the null block is never handed out");
                assert_eq!(
                    shadow.holders[b].fetch_add(1, Ordering::Relaxed),
                    0,
                    "block {block} handed out while someone holds it"
                );
                shadow.owner[b].store(thread, Ordering::Relaxed);
                let value = xorshift(&mut rng) % NUM_KEYS;
                shadow.content[b].store(value, Ordering::Relaxed);
                if xorshift(&mut rng) & 1 == 0 && pool.cache_block(block, key(value)).unwrap() {
                    counts.cached += 1;
                }
                held.push(Held {
                    block,
                    allocated: true,
                });
                counts.allocated += 1;
            }
        } else if draw < mix.allocate + mix.hit {
            let value = xorshift(&mut rng) % NUM_KEYS;
            if let Some(block) = pool.cached_block(key(value)) {
                if xorshift(&mut rng) & 3 == 0 {
                    // Widen the lookup-to-touch window the eviction race lives in.
                    std::thread::yield_now();
                }
                if pool.touch_cached(block, key(value)) {
                    let b = block as usize;
                    shadow.holders[b].fetch_add(1, Ordering::Relaxed);
                    assert_eq!(
                        shadow.content[b].load(Ordering::Relaxed),
                        value,
                        "block {block} touched under a key it no longer holds"
                    );
                    held.push(Held {
                        block,
                        allocated: false,
                    });
                    counts.touched += 1;
                }
            }
        } else {
            let keep = (xorshift(&mut rng) as usize) % (held.len() + 1);
            let released: Vec<Held> = held.drain(keep..).rev().collect();
            let tier = TIERS[(xorshift(&mut rng) % 3) as usize];
            free_all(pool, shadow, thread, &released, tier, &mut counts);
        }
        if held.len() > 8 {
            let released: Vec<Held> = held.drain(..).rev().collect();
            free_all(pool, shadow, thread, &released, FreeTier::High, &mut counts);
        }
    }
    let released: Vec<Held> = held.drain(..).rev().collect();
    free_all(
        pool,
        shadow,
        thread,
        &released,
        FreeTier::Normal,
        &mut counts,
    );
    counts
}

fn free_all(
    pool: &BlockPool,
    shadow: &Shadow,
    thread: usize,
    held: &[Held],
    tier: FreeTier,
    counts: &mut Counts,
) {
    let mut ids = Vec::with_capacity(held.len());
    for reference in held {
        let b = reference.block as usize;
        if reference.allocated {
            assert_eq!(
                shadow.owner[b].load(Ordering::Relaxed),
                thread,
                "block {b} was reallocated while its owner held it"
            );
        }
        // Before the pool sees the free, so the next holder never observes our stale count.
        shadow.holders[b].fetch_sub(1, Ordering::Relaxed);
        ids.push(reference.block);
    }
    pool.free_blocks_to(&ids, tier).unwrap();
    counts.freed += ids.len() as u64;
}

fn run(num_threads: usize, num_blocks: usize, mix: Mix, iterations: usize) {
    let pool = Arc::new(BlockPool::new(num_blocks).unwrap());
    let shadow = Arc::new(Shadow {
        holders: (0..num_blocks).map(|_| AtomicUsize::new(0)).collect(),
        owner: (0..num_blocks).map(|_| AtomicUsize::new(0)).collect(),
        content: (0..num_blocks).map(|_| AtomicU64::new(u64::MAX)).collect(),
    });
    let start = Arc::new(Barrier::new(num_threads));
    let handles: Vec<_> = (1..=num_threads)
        .map(|thread| {
            let pool = Arc::clone(&pool);
            let shadow = Arc::clone(&shadow);
            let start = Arc::clone(&start);
            std::thread::spawn(move || worker(&pool, &shadow, &start, (thread, mix), iterations))
        })
        .collect();
    let mut total = Counts::default();
    for handle in handles {
        let counts = handle.join().expect("worker panicked");
        total.allocated += counts.allocated;
        total.touched += counts.touched;
        total.freed += counts.freed;
        total.cached += counts.cached;
        total.refused += counts.refused;
    }

    eprintln!("{num_threads} threads: {total:?}, {:?}", pool.stats());
    assert_eq!(total.allocated + total.touched, total.freed, "{total:?}");
    assert!(total.allocated > 0 && total.freed > 0, "{total:?}");
    assert_eq!(pool.num_free_blocks(), num_blocks - 1);
    let mut order = pool.free_queue_order();
    order.sort_unstable();
    let expected: Vec<BlockId> = (1..num_blocks as BlockId).collect();
    assert_eq!(order, expected, "every block free exactly once");
    for block in 0..num_blocks as BlockId {
        assert_eq!(pool.ref_count(block), 0, "block {block}");
        assert_eq!(shadow.holders[block as usize].load(Ordering::Relaxed), 0);
    }
    let stats = pool.stats();
    assert_eq!(
        total.cached,
        stats.num_evictions + stats.num_cached_blocks as u64,
        "every successful cache_block is evicted or still cached: {total:?} {stats:?}"
    );
    // Every copy of every key, found by touching each block under each key (and freeing it
    // again): the lookup of a key names one of its copies (no entry naming a block that holds
    // another key or none), a key with a copy is found, at most two copies (first and spare),
    // and the counts agree with them.
    let mut copies = 0;
    let mut found = 0;
    for value in 0..NUM_KEYS {
        let holders: Vec<BlockId> = (1..num_blocks as BlockId)
            .filter(|&block| pool.touch_cached(block, key(value)))
            .collect();
        pool.free_blocks(&holders).unwrap();
        match pool.cached_block(key(value)) {
            Some(block) => {
                assert!(
                    holders.contains(&block),
                    "key {value} maps to block {block}, which does not hold it ({holders:?})"
                );
                found += 1;
            }
            None => assert!(
                holders.is_empty(),
                "key {value} is cached in {holders:?} but not found"
            ),
        }
        assert!(holders.len() <= 2, "key {value} has copies {holders:?}");
        copies += holders.len();
    }
    assert_eq!(stats.num_cached_blocks, copies, "{stats:?}");
    assert!(
        copies - found <= stats.num_spare_blocks && stats.num_spare_blocks <= found,
        "{stats:?}"
    );
    // Everything is free and quiescent: a fresh allocation of the whole pool must succeed.
    let mut out = Vec::new();
    pool.get_new_blocks(num_blocks - 1, &mut out).unwrap();
    out.sort_unstable();
    assert_eq!(out, expected);
}

fn iterations() -> usize {
    if cfg!(miri) {
        60
    } else {
        100_000
    }
}

#[test]
fn two_threads_small_pool() {
    run(2, 9, BALANCED, iterations());
}

#[test]
fn four_threads() {
    run(4, 24, BALANCED, iterations());
}

#[test]
fn eight_threads() {
    let threads = if cfg!(miri) { 3 } else { 8 };
    run(threads, 40, BALANCED, iterations());
}

#[test]
fn hit_heavy_four_threads() {
    run(4, 16, HIT_HEAVY, iterations());
}
