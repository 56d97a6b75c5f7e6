//! Loom models of the lock-free pool's protocol (state word, reservation counter, free FIFO).
//!
//! Run with:
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 cargo test -q --release -p hybrid-cache-core
//! --target-dir target/loom --test loom`
//!
//! Each model is a tiny pool and two to four threads, small enough to explore *exhaustively*:
//! [`model`] lifts the preemption bound that `LOOM_MAX_PREEMPTIONS` sets, because a bounded
//! search misses interleavings such as lookup / evict+re-cache / touch (found only with the bound
//! lifted or with the explicit yield in `touch_races_evicting_allocation`). The whole file still
//! explores in a few seconds once built.
#![cfg(loom)]

use hybrid_cache_core::{BlockAllocator, BlockHash, BlockId, BlockPool, CacheKey, FreeTier};
use loom::sync::Arc;
use loom::thread;

fn key(hash: u128) -> CacheKey {
    CacheKey {
        group: 0,
        hash: BlockHash(hash),
    }
}

/// Runs `body` under loom with no preemption bound (see the module docs).
fn model(body: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = None;
    builder.check(body);
}

/// Checks the quiescent invariants: every block free exactly once or held, counts agree.
fn check_quiescent(pool: &BlockPool, held: &[BlockId]) {
    let order = pool.free_queue_order();
    assert_eq!(order.len(), pool.num_free_blocks());
    for block in 1..pool.num_blocks() as BlockId {
        let refs = held.iter().filter(|&&h| h == block).count();
        assert_eq!(pool.ref_count(block) as usize, refs, "block {block}");
        let queued = order.iter().filter(|&&b| b == block).count();
        assert_eq!(
            queued,
            usize::from(refs == 0),
            "block {block} queued {queued}"
        );
    }
}

#[test]
fn two_threads_allocating() {
    model(|| {
        // Two usable blocks; one thread wants 1, the other 2: never both.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || {
            let mut out = Vec::new();
            let result = other.get_new_blocks(2, &mut out);
            assert_eq!(result.is_ok(), out.len() == 2);
            assert!(result.is_ok() || out.is_empty());
            out
        });
        let mut mine = Vec::new();
        let ok = pool.get_new_blocks(1, &mut mine).is_ok();
        assert_eq!(ok, mine.len() == 1);
        let theirs = handle.join().unwrap();
        assert!(mine.len() + theirs.len() <= 2);
        assert!(
            !mine.is_empty() || !theirs.is_empty(),
            "someone always gets blocks"
        );
        let mut held: Vec<BlockId> = mine.iter().chain(&theirs).copied().collect();
        check_quiescent(&pool, &held);
        held.sort_unstable();
        held.dedup();
        assert_eq!(
            held.len(),
            mine.len() + theirs.len(),
            "no block handed out twice"
        );
    });
}

#[test]
fn free_races_allocate() {
    model(|| {
        // Block 1 held, block 2 free. One thread frees 1 while the other asks for 2 blocks: it
        // gets both only if the free fully landed, and nothing otherwise.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut first = Vec::new();
        pool.get_new_blocks(1, &mut first).unwrap();
        assert_eq!(first, vec![1]);
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || {
            let mut out = Vec::new();
            let _ = other.get_new_blocks(2, &mut out);
            out
        });
        pool.free_blocks(&[1]).unwrap();
        let theirs = handle.join().unwrap();
        match theirs.len() {
            0 => check_quiescent(&pool, &[]),
            2 => {
                assert_eq!(theirs, vec![2, 1], "LRU order: the never-used block first");
                check_quiescent(&pool, &theirs);
            }
            n => panic!("partial allocation of {n} blocks"),
        }
    });
}

#[test]
fn touch_races_evicting_allocation() {
    model(|| {
        // The only usable block is free and cached under A. One thread looks A up and touches
        // it; the other allocates (evicting A) and re-caches the block under B. The touch must
        // not succeed on a block that now holds B, and the two never both get the block.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(0xA)).unwrap());
        pool.free_blocks(&[1]).unwrap();

        let other = Arc::clone(&pool);
        let allocator = thread::spawn(move || {
            let mut out = Vec::new();
            if other.get_new_blocks(1, &mut out).is_ok() {
                assert_eq!(out, vec![1]);
                assert!(other.cache_block(1, key(0xB)).unwrap());
                true
            } else {
                false
            }
        });
        let touched = match pool.cached_block(key(0xA)) {
            Some(block) => {
                // A free switch point: the allocator may run to completion between the lookup
                // and the touch without spending the preemption budget.
                thread::yield_now();
                pool.touch_cached(block, key(0xA))
            }
            None => false,
        };
        let allocated = allocator.join().unwrap();
        assert!(touched != allocated, "exactly one of them gets the block");
        assert_eq!(pool.ref_count(1), 1);
        if touched {
            assert_eq!(pool.cached_block(key(0xA)), Some(1));
            assert_eq!(pool.stats().num_evictions, 0);
        } else {
            assert_eq!(pool.cached_block(key(0xA)), None);
            assert_eq!(pool.cached_block(key(0xB)), Some(1));
            assert_eq!(pool.stats().num_evictions, 1);
        }
        assert_eq!(pool.stats().num_cached_blocks, 1);
        check_quiescent(&pool, &[1]);
    });
}

#[test]
fn free_races_touch() {
    model(|| {
        // Block 1 held and cached. One thread frees it while the other touches it. The touch
        // succeeds unless it lands while the release is still publishing the block (a miss is
        // allowed there); either way the block is queued iff nobody holds it.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(7)).unwrap());
        let other = Arc::clone(&pool);
        let toucher = thread::spawn(move || other.touch_cached(1, key(7)));
        pool.free_blocks(&[1]).unwrap();
        let touched = toucher.join().unwrap();
        let held: &[BlockId] = if touched { &[1] } else { &[] };
        check_quiescent(&pool, held);
        let mut again = Vec::new();
        assert_eq!(pool.get_new_blocks(1, &mut again).is_ok(), !touched);
    });
}

#[test]
fn two_holders_free_concurrently() {
    model(|| {
        // A block with two references (allocation + hit) freed by both holders at once: exactly
        // one release queues it, and it is handed out again exactly once.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(3)).unwrap());
        assert!(pool.touch_cached(1, key(3)));
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || other.free_blocks(&[1]).unwrap());
        pool.free_blocks(&[1]).unwrap();
        handle.join().unwrap();
        check_quiescent(&pool, &[]);
        let mut again = Vec::new();
        pool.get_new_blocks(1, &mut again).unwrap();
        assert_eq!(again, vec![1]);
        assert_eq!(pool.num_free_blocks(), 0);
    });
}

#[test]
fn two_allocators_race_a_touch() {
    model(|| {
        // Two free blocks, block 1 cached under K. Two threads allocate one block each while the
        // main thread hits K: the touch wins block 1 only if no allocator claimed it first, and
        // then exactly one allocator is refused. Nobody ever shares a block.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(5)).unwrap());
        pool.free_blocks(&[1]).unwrap();
        let allocators: Vec<_> = (0..2)
            .map(|_| {
                let other = Arc::clone(&pool);
                thread::spawn(move || {
                    let mut out = Vec::new();
                    let _ = other.get_new_blocks(1, &mut out);
                    out
                })
            })
            .collect();
        let touched = pool.touch_cached(1, key(5));
        let mut held: Vec<BlockId> = allocators
            .into_iter()
            .flat_map(|handle| handle.join().unwrap())
            .collect();
        assert_eq!(held.len(), if touched { 1 } else { 2 });
        if touched {
            assert_eq!(held, vec![2]);
            held.push(1);
        }
        check_quiescent(&pool, &held);
        held.sort_unstable();
        assert_eq!(held, vec![1, 2]);
        assert_eq!(pool.stats().num_evictions, u64::from(!touched));
    });
}

#[test]
fn same_reference_freed_twice_concurrently() {
    model(|| {
        // A caller bug: two threads free the one reference that exists. Both may pass
        // validation; the release that finds the count already 0 reports DoubleFree. The count
        // never goes negative and the block is queued exactly once.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || other.free_blocks(&[1]));
        let mine = pool.free_blocks(&[1]);
        let theirs = handle.join().unwrap();
        assert!(mine.is_ok() != theirs.is_ok(), "{mine:?} {theirs:?}");
        let error = mine.err().or(theirs.err()).unwrap();
        assert_eq!(error, hybrid_cache_core::CoreError::DoubleFree { block: 1 });
        check_quiescent(&pool, &[]);
    });
}

/// Allocates block 1 of `pool`, caches it under `key(9)`, frees it, then hits and frees it
/// `cycles` times: each hit of the free block leaves one stale queue entry.
fn cached_with_stale_entries(pool: &BlockPool, cycles: usize) {
    let mut out = Vec::new();
    pool.get_new_blocks(1, &mut out).unwrap();
    assert_eq!(out, vec![1]);
    assert!(pool.cache_block(1, key(9)).unwrap());
    pool.free_blocks(&[1]).unwrap();
    for _ in 0..cycles {
        assert!(pool.touch_cached(1, key(9)));
        pool.free_blocks(&[1]).unwrap();
    }
}

#[test]
fn compaction_races_allocation() {
    model(|| {
        // One usable block (stale limit 2) with two stale entries: the next hit compacts while
        // another thread allocates. The allocation may be refused while the hit or the compactor
        // holds the only unit, but the block is never lost nor shared.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        cached_with_stale_entries(&pool, 2);
        let other = Arc::clone(&pool);
        let allocator = thread::spawn(move || {
            let mut out = Vec::new();
            let _ = other.get_new_blocks(1, &mut out);
            out
        });
        let touched = pool.touch_cached(1, key(9));
        if touched {
            pool.free_blocks(&[1]).unwrap();
        }
        let theirs = allocator.join().unwrap();
        check_quiescent(&pool, &theirs);
        let mut again = Vec::new();
        assert_eq!(
            pool.get_new_blocks(1, &mut again).is_ok(),
            theirs.is_empty()
        );
    });
}

#[test]
fn compaction_races_free() {
    model(|| {
        // Block 1 free with two stale entries (stale limit 3 for this pool after the third),
        // block 2 held by another thread that frees it while the main thread's hits compact.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        cached_with_stale_entries(&pool, 3);
        let mut second = Vec::new();
        pool.get_new_blocks(1, &mut second).unwrap();
        assert_eq!(second, vec![2]);
        let other = Arc::clone(&pool);
        let freer = thread::spawn(move || other.free_blocks(&[2]).unwrap());
        assert!(
            pool.touch_cached(1, key(9)),
            "block 1 is free and its unit unreserved"
        );
        pool.free_blocks(&[1]).unwrap();
        freer.join().unwrap();
        check_quiescent(&pool, &[]);
        assert_eq!(pool.num_free_blocks(), 2);
    });
}

#[test]
fn touch_borrows_a_unit_while_the_release_is_in_flight() {
    model(|| {
        // Block 1 held and cached, block 2 free. One thread frees block 1, one hits it, one
        // allocates a block. A touch that lands between the release's CAS and its push takes a
        // unit that block 2 backs; the release's own unit restores the balance. An allocation
        // in that window is refused (the documented transient refusal), but it never gets a
        // block the toucher holds and nothing is lost.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(4)).unwrap());
        let freer = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || pool.free_blocks(&[1]).unwrap())
        };
        let allocator = {
            let pool = Arc::clone(&pool);
            thread::spawn(move || {
                let mut out = Vec::new();
                let _ = pool.get_new_blocks(1, &mut out);
                out
            })
        };
        let touched = pool.touch_cached(1, key(4));
        freer.join().unwrap();
        let mut held = allocator.join().unwrap();
        assert!(
            held.len() == 1 || touched,
            "only a borrowing touch can make the allocation fail"
        );
        if touched {
            assert!(!held.contains(&1), "the touched block is not handed out");
            held.push(1);
        }
        check_quiescent(&pool, &held);
        let mut rest = Vec::new();
        pool.get_new_blocks(3 - held.len() - 1, &mut rest).unwrap();
        assert_eq!(pool.num_free_blocks(), 0);
    });
}

#[test]
fn tiers_under_a_racing_free() {
    model(|| {
        // Block 1 is cached and held, block 2 free and keyless. One thread frees block 1 (to the
        // Normal tier) while another allocates one block and then, if it can, a second: the
        // first block it gets is always the keyless one (tier order), the second can only be
        // block 1 once its free landed, and every block ends free or held exactly once.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(4)).unwrap());
        let other = Arc::clone(&pool);
        let freer = thread::spawn(move || other.free_blocks(&[1]).unwrap());
        let mut got = Vec::new();
        pool.get_new_blocks(1, &mut got).unwrap();
        assert_eq!(got, vec![2], "the keyless block goes before the cached one");
        let second = pool.get_new_blocks(1, &mut got);
        freer.join().unwrap();
        if second.is_ok() {
            assert_eq!(got, vec![2, 1]);
        }
        check_quiescent(&pool, &got);
    });
}

#[test]
fn protected_free_races_an_allocation() {
    model(|| {
        // Blocks 1 and 2 cached and held. One thread frees block 1 to the High tier (a
        // protected chain) while another frees block 2 to Normal and then allocates one block
        // and, if it can, a second: the first is always block 2 (High goes last, even when the
        // protected free landed first, which plain LRU would hand out first), the second can
        // only be block 1, and every block ends free or held exactly once; a protected block
        // not taken keeps its key.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(2, &mut out).unwrap();
        assert!(pool.cache_block(1, key(7)).unwrap());
        assert!(pool.cache_block(2, key(8)).unwrap());
        let other = Arc::clone(&pool);
        let freer = thread::spawn(move || other.free_blocks_to(&[1], FreeTier::High).unwrap());
        pool.free_blocks_to(&[2], FreeTier::Normal).unwrap();
        let mut got = Vec::new();
        pool.get_new_blocks(1, &mut got).unwrap();
        assert_eq!(
            got,
            vec![2],
            "a protected block is evicted after a normal one"
        );
        let second = pool.get_new_blocks(1, &mut got);
        freer.join().unwrap();
        if second.is_ok() {
            assert_eq!(got, vec![2, 1]);
        } else {
            assert_eq!(
                pool.cached_block(key(7)),
                Some(1),
                "the protected block keeps its key"
            );
        }
        check_quiescent(&pool, &got);
    });
}

#[test]
fn both_copies_of_a_key_evicted_concurrently() {
    model(|| {
        // Key K cached by free block 1 with a spare, free block 2. Two allocators take one block
        // each: both copies are evicted, in either order and at once. Afterwards K maps to
        // nothing (no stale entry in either map), so K can be cached again.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(2, &mut out).unwrap();
        assert!(pool.cache_block(1, key(6)).unwrap());
        assert!(pool.cache_block(2, key(6)).unwrap());
        pool.free_blocks(&[1, 2]).unwrap();
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || {
            let mut mine = Vec::new();
            other.get_new_blocks(1, &mut mine).unwrap();
            mine
        });
        let mut mine = Vec::new();
        pool.get_new_blocks(1, &mut mine).unwrap();
        let theirs = handle.join().unwrap();
        mine.extend(theirs);
        mine.sort_unstable();
        assert_eq!(mine, vec![1, 2]);
        assert_eq!(pool.cached_block(key(6)), None, "no stale map entry");
        assert_eq!(pool.stats().num_cached_blocks, 0);
        assert_eq!(pool.stats().num_spare_blocks, 0);
        assert!(pool.cache_block(1, key(6)).unwrap());
        assert_eq!(pool.cached_block(key(6)), Some(1));
    });
}

#[test]
fn two_takers_race_an_allocation() {
    model(|| {
        // Block 1, the only block, free and cached under K. Two threads take it under K while
        // the main thread allocates one block: exactly one of the three gets it (a take's
        // reservation or the allocation's comes first), and afterwards K maps to nothing.
        let pool = Arc::new(BlockPool::new(2).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(1, key(4)).unwrap());
        pool.free_blocks(&[1]).unwrap();
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let other = Arc::clone(&pool);
                thread::spawn(move || other.take_cached(1, key(4)))
            })
            .collect();
        let mut held = Vec::new();
        let allocated = pool.get_new_blocks(1, &mut held).is_ok();
        let wins = takers
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .filter(|&won| won)
            .count();
        assert_eq!(wins + usize::from(allocated), 1, "block 1 handed out once");
        if wins == 1 {
            held.push(1);
        }
        check_quiescent(&pool, &held);
        assert_eq!(pool.cached_block(key(4)), None);
        assert_eq!(pool.stats().num_cached_blocks, 0);
        assert_eq!(pool.stats().num_evictions, u64::from(allocated));
    });
}

#[test]
fn a_spare_evicted_and_cached_again_while_its_twin_goes() {
    model(|| {
        // Key K: block 1 its first copy, block 2 its spare, both free (1 older). Two allocators
        // take one block each: the one that gets block 1 evicts it and promotes the spare while
        // the other gets block 2 (evicting the spare) and caches it under K again. Afterwards
        // block 2 is K's only copy: found by a lookup (as first copy, or as a spare whose twin
        // went meanwhile) and counted once. A promotion that moved the spare into the first
        // copy's place lost the entry in one interleaving (K cached in block 2, not found).
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(2, &mut out).unwrap();
        assert!(pool.cache_block(1, key(9)).unwrap());
        assert!(pool.cache_block(2, key(9)).unwrap());
        pool.free_blocks(&[1, 2]).unwrap();
        let other = Arc::clone(&pool);
        let handle = thread::spawn(move || {
            let mut mine = Vec::new();
            other.get_new_blocks(1, &mut mine).unwrap();
            if mine == [2] {
                assert!(other.cache_block(2, key(9)).unwrap());
            }
            mine
        });
        let mut mine = Vec::new();
        pool.get_new_blocks(1, &mut mine).unwrap();
        if mine == [2] {
            assert!(pool.cache_block(2, key(9)).unwrap());
        }
        let theirs = handle.join().unwrap();
        mine.extend(theirs);
        mine.sort_unstable();
        assert_eq!(mine, vec![1, 2]);
        let stats = pool.stats();
        assert_eq!(pool.cached_block(key(9)), Some(2), "K's copy is found");
        assert_eq!(stats.num_cached_blocks, 1);
        assert!(stats.num_spare_blocks <= 1);
        check_quiescent(&pool, &mine);
        pool.free_blocks(&[2]).unwrap();
        assert!(pool.touch_cached(2, key(9)), "and hit");
    });
}

#[test]
fn sole_holder_caching_races_a_touch() {
    model(|| {
        // Block 1 is held by this thread alone and uncached; it caches it under A (one CAS,
        // no pending bit) while another thread looks A up and touches what it finds. The touch
        // succeeds only once the block is cached under A, and then holds a second reference.
        let pool = Arc::new(BlockPool::new(3).unwrap());
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        let block = out[0];

        let other = Arc::clone(&pool);
        let toucher = thread::spawn(move || match other.cached_block(key(0xA)) {
            Some(found) => {
                thread::yield_now();
                other.touch_cached(found, key(0xA)).then_some(found)
            }
            None => None,
        });
        assert!(pool.cache_block(block, key(0xA)).unwrap());
        let touched = toucher.join().unwrap();
        if let Some(found) = touched {
            assert_eq!(found, block);
        }
        let held = if touched.is_some() {
            vec![block, block]
        } else {
            vec![block]
        };
        assert_eq!(pool.cached_block(key(0xA)), Some(block));
        assert_eq!(pool.stats().num_cached_blocks, 1);
        check_quiescent(&pool, &held);
        pool.free_blocks(&held).unwrap();
        check_quiescent(&pool, &[]);
    });
}
