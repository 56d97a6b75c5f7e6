//! Pool microbenchmarks: the lock-free `BlockPool` against the `MutexPool` baseline, in one run.
//!
//! - `alloc_free_one`: allocate one block and free it.
//! - `cache_hit`: `cached_block` + `touch_cached` + free of a cached free block.
//! - `threads/N`: N threads each doing `iters` allocate+free pairs on one shared pool; the figure
//!   is wall time per pair per thread (equal across N means perfect scaling).

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use hybrid_cache_core::{BlockAllocator, BlockHash, BlockPool, CacheKey, MutexPool};

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

criterion_group!(benches, alloc_free_one, cache_hit, threads);
criterion_main!(benches);
