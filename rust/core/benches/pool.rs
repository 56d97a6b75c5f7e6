//! Pool microbenchmarks: the lock-free `BlockPool` against the `MutexPool` baseline, in one run.
//!
//! - `alloc_free_one`: allocate one block and free it.
//! - `cache_hit`: `cached_block` + `touch_cached` + free of a cached free block.
//! - `threads/N`: N threads each doing `iters` allocate+free pairs on one shared pool; the figure
//!   is wall time per pair per thread (equal across N means perfect scaling).
//! - `release_320/{cold,warm}`: freeing 256 requests of 320 blocks each (a 2560-token request in
//!   two groups) from a pool of 131072 blocks whose free order was shuffled, half the blocks
//!   cached; the figure is per request. `cold`: the caches are flushed (64 MiB written) between
//!   the allocation and the release, as a request's blocks are when it ends; `warm`: released
//!   right after allocation. Lock-free pool only.
//! - `evicting_alloc_320`: allocating 256 requests of 320 blocks each from a pool of 131072
//!   blocks that are all cached and free in shuffled order, so every claim evicts (a prefix
//!   cache at capacity); the figure is per request. Lock-free pool only.
//! - `tidy_rebuild`: `tidy` of a pool of 131072 blocks, every block cached, whose blocks were
//!   evicted and cached again in turn (512 at a time, oldest first) until its cache map's
//!   TOMBSTONEs passed their share (`needs_tidy`): one rebuild of the map, per rebuild.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use hybrid_cache_core::{BlockAllocator, BlockHash, BlockPool, CacheKey, FreeTier, MutexPool};

const NUM_BLOCKS: usize = 1024;

fn pools() -> Vec<(&'static str, Box<dyn BlockAllocator>)> {
    vec![
        ("lock_free", Box::new(BlockPool::new(NUM_BLOCKS).unwrap())),
        ("mutex", Box::new(MutexPool::new(NUM_BLOCKS).unwrap())),
    ]
}

fn alloc_free_one(c: &mut Criterion) {
    let mut group = c.benchmark_group("alloc_free_one");
    for (name, pool) in pools() {
        let mut out = Vec::with_capacity(1);
        group.bench_function(name, |b| {
            b.iter(|| {
                pool.get_new_blocks(1, &mut out).unwrap();
                pool.free_blocks(black_box(&out)).unwrap();
                out.clear();
            })
        });
    }
    group.finish();
}

fn cache_hit(c: &mut Criterion) {
    let mut group = c.benchmark_group("cache_hit");
    let key = CacheKey {
        group: 1,
        hash: BlockHash(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210),
    };
    for (name, pool) in pools() {
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert!(pool.cache_block(out[0], key).unwrap());
        pool.free_blocks(&out).unwrap();
        group.bench_function(name, |b| {
            b.iter(|| {
                let block = pool.cached_block(black_box(key)).unwrap();
                assert!(pool.touch_cached(block, key));
                pool.free_blocks(&[block]).unwrap();
            })
        });
    }
    group.finish();
}

fn run_threads(pool: &dyn BlockAllocator, num_threads: usize, iters: u64) -> Duration {
    let barrier = Barrier::new(num_threads + 1);
    std::thread::scope(|scope| {
        for _ in 0..num_threads {
            scope.spawn(|| {
                let mut out = Vec::with_capacity(1);
                barrier.wait();
                for _ in 0..iters {
                    pool.get_new_blocks(1, &mut out).unwrap();
                    pool.free_blocks(black_box(&out)).unwrap();
                    out.clear();
                }
                barrier.wait();
            });
        }
        barrier.wait();
        let start = Instant::now();
        barrier.wait();
        start.elapsed()
    })
}

fn threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads");
    for num_threads in [1, 2] {
        for (name, pool) in pools() {
            group.bench_with_input(
                BenchmarkId::new(name, num_threads),
                &num_threads,
                |b, &n| b.iter_custom(|iters| run_threads(pool.as_ref(), n, iters)),
            );
        }
    }
    group.finish();
}

/// Blocks per request and requests per release round in `release_320`.
const RELEASE_BLOCKS: usize = 320;
const RELEASE_REQUESTS: usize = 256;

fn release_320(c: &mut Criterion) {
    let num_blocks = 131072;
    let pool = BlockPool::new(num_blocks).unwrap();
    let mut all = Vec::new();
    pool.get_new_blocks(num_blocks - 1, &mut all).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..all.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        all.swap(i, (state % (i as u64 + 1)) as usize);
    }
    for (i, &block) in all.iter().enumerate().step_by(2) {
        let key = CacheKey {
            group: 0,
            hash: BlockHash(i as u128 * 0x2545_f491_4f6c_dd1d),
        };
        assert!(pool.cache_block(block, key).unwrap());
    }
    pool.free_blocks(&all).unwrap();
    let mut held: Vec<Vec<u32>> = (0..RELEASE_REQUESTS)
        .map(|_| Vec::with_capacity(RELEASE_BLOCKS))
        .collect();
    let mut flush = vec![0u64; 8 << 20];
    let mut group = c.benchmark_group("release_320");
    for cold in [true, false] {
        group.bench_function(if cold { "cold" } else { "warm" }, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for round in 0..iters.div_ceil(RELEASE_REQUESTS as u64) {
                    for blocks in held.iter_mut() {
                        blocks.clear();
                        pool.get_new_blocks(RELEASE_BLOCKS, blocks).unwrap();
                    }
                    if cold {
                        flush.iter_mut().for_each(|word| *word = round);
                        black_box(&flush);
                    }
                    let start = Instant::now();
                    for blocks in &held {
                        pool.release_held_to(black_box(blocks), FreeTier::Normal)
                            .unwrap();
                    }
                    spent += start.elapsed();
                }
                // Per request: the rounds ran whole, `iters` rounded up to them.
                spent.mul_f64(
                    iters as f64
                        / (iters.div_ceil(RELEASE_REQUESTS as u64) as f64
                            * RELEASE_REQUESTS as f64),
                )
            })
        });
    }
    group.finish();
}

/// Caches each of `blocks` (held) under a key not used before (`next_key` counts them).
fn cache_under_new_keys(pool: &BlockPool, blocks: &[u32], next_key: &mut u128) {
    for &block in blocks {
        *next_key += 1;
        let key = CacheKey {
            group: 0,
            hash: BlockHash(next_key.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        };
        assert!(pool.cache_block(block, key).unwrap());
    }
}

/// Allocations of `RELEASE_BLOCKS` blocks that each evict a cached block: the pool full of
/// cached free blocks in shuffled order (a prefix cache at capacity), time per request.
fn evicting_alloc_320(c: &mut Criterion) {
    let num_blocks = 131072;
    let pool = BlockPool::new(num_blocks).unwrap();
    let mut all = Vec::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next_key = 0u128;
    let mut held: Vec<Vec<u32>> = (0..RELEASE_REQUESTS)
        .map(|_| Vec::with_capacity(RELEASE_BLOCKS))
        .collect();
    c.bench_function("evicting_alloc_320", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters.div_ceil(RELEASE_REQUESTS as u64) {
                // Untimed: every block cached under a new key and freed, in shuffled order.
                all.clear();
                pool.get_new_blocks(num_blocks - 1, &mut all).unwrap();
                for i in (1..all.len()).rev() {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    all.swap(i, (state % (i as u64 + 1)) as usize);
                }
                cache_under_new_keys(&pool, &all, &mut next_key);
                pool.free_blocks(&all).unwrap();
                let start = Instant::now();
                for blocks in held.iter_mut() {
                    blocks.clear();
                    pool.get_new_blocks(RELEASE_BLOCKS, black_box(blocks))
                        .unwrap();
                }
                spent += start.elapsed();
                for blocks in &held {
                    pool.free_blocks(blocks).unwrap();
                }
            }
            spent.mul_f64(
                iters as f64
                    / (iters.div_ceil(RELEASE_REQUESTS as u64) as f64 * RELEASE_REQUESTS as f64),
            )
        })
    });
}

/// One cache map rebuild of a full pool whose blocks were evicted in turn until it needed one.
fn tidy_rebuild(c: &mut Criterion) {
    let num_blocks = 131072;
    let mut pool = BlockPool::new(num_blocks).unwrap();
    let mut out = Vec::new();
    let mut next_key = 0u128;
    let mut group = c.benchmark_group("tidy_rebuild");
    group.sample_size(10);
    group.bench_function("131072", |b| {
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            for _ in 0..iters {
                // Untimed: evict and cache again, oldest first, until the map needs a rebuild.
                while !pool.needs_tidy() {
                    out.clear();
                    pool.get_new_blocks(512, &mut out).unwrap();
                    cache_under_new_keys(&pool, &out, &mut next_key);
                    pool.free_blocks(&out).unwrap();
                }
                let start = Instant::now();
                pool.tidy();
                spent += start.elapsed();
                assert!(!pool.needs_tidy());
            }
            spent
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    alloc_free_one,
    cache_hit,
    threads,
    release_320,
    evicting_alloc_320,
    tidy_rebuild
);
criterion_main!(benches);
