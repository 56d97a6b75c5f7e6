//! Coordinator microbenchmarks (criterion):
//! - one decode step for 256 running requests in 2 groups (full + window 4096, block 16) through
//!   `allocate_batch`;
//! - the prefix-hit lookup for a 2048-token prompt whose blocks are cached;
//! - `probe_cache_hit` (what the "lpm" scheduler weighs per waiting request) of the same
//!   cached prompt, and of a 2048-token prompt with nothing cached;
//! - the chained hashes of a 2048-token prompt (128 blocks) under xxh3 and under sha256;
//! - one decode step of a single long request while the window releases blocks;
//! - the prefix lookup and the decode step again over Gemma-3's per-type layout (window blocks
//!   of 16 tokens, full-attention blocks of 80 keyed by 16-token units, so a hit ends inside a
//!   full-attention block);
//! - the next turn of a conversation (lookup, compute, free) with the core's defaults and with
//!   the engine's (token tails, protected chains).
//!
//! Run: `cargo bench -p hybrid-cache-core --bench coordinator -- --warm-up-time 1
//! --measurement-time 3`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use hybrid_cache_core::{
    hashing::BlockHasher, AllocateStep, Coordinator, CoordinatorConfig, ExtraKeys, HashAlgo,
    NewRequest,
};

mod common;

use common::{gemma2_config, BLOCK_SIZE, WINDOW};

/// Gemma-3's per-type layout: window 4096 in blocks of 16, full attention in blocks of 80.
fn per_type_config(
    num_blocks: usize,
    max_num_reqs: usize,
    max_model_len: usize,
) -> CoordinatorConfig {
    let mut config = gemma2_config(num_blocks, max_num_reqs, max_model_len);
    config.groups[0].block_size = 5 * BLOCK_SIZE;
    config
}

fn prompt(request_id: u64, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i ^ (request_id as u32) << 20)
        .collect()
}

/// 256 requests, each prefilled with `prompt_len` tokens; returns the next computed count.
fn running_batch(coordinator: &mut Coordinator, prompt_len: usize) -> usize {
    for request_id in 0..256u64 {
        coordinator
            .add_request(NewRequest {
                request_id,
                prompt_token_ids: &prompt(request_id, prompt_len),
                max_total_tokens: None,
                extra: ExtraKeys::default(),
            })
            .unwrap();
        let step = AllocateStep {
            request_id,
            num_computed_tokens: 0,
            num_new_tokens: prompt_len,
        };
        assert!(coordinator.allocate(step).unwrap());
    }
    prompt_len
}

fn decode_step_256(criterion: &mut Criterion) {
    decode_step_256_over(
        criterion,
        gemma2_config,
        "decode_step_256_requests_full_plus_window4096",
    );
    decode_step_256_over(
        criterion,
        per_type_config,
        "decode_step_256_requests_per_type_80_16",
    );
}

fn decode_step_256_over(
    criterion: &mut Criterion,
    config: fn(usize, usize, usize) -> CoordinatorConfig,
    name: &str,
) {
    const PROMPT: usize = 2000;
    const MAX_LEN: usize = 8192;
    let mut coordinator = Coordinator::new(config(256 * 800, 256, MAX_LEN)).unwrap();
    let mut computed = running_batch(&mut coordinator, PROMPT);
    let mut steps = Vec::with_capacity(256);
    criterion.bench_function(name, |bench| {
        bench.iter_custom(|iterations| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iterations {
                if computed + 1 >= MAX_LEN {
                    for request_id in 0..256 {
                        coordinator.free_request(request_id).unwrap();
                    }
                    computed = running_batch(&mut coordinator, PROMPT);
                }
                steps.clear();
                for request_id in 0..256u64 {
                    coordinator.append_token_ids(request_id, &[1]).unwrap();
                    steps.push(AllocateStep {
                        request_id,
                        num_computed_tokens: computed,
                        num_new_tokens: 1,
                    });
                }
                let start = Instant::now();
                let done = coordinator.allocate_batch(black_box(&steps)).unwrap();
                elapsed += start.elapsed();
                assert_eq!(done, 256);
                computed += 1;
            }
            elapsed
        })
    });
}

fn prefix_hit_2048(criterion: &mut Criterion) {
    prefix_hit_2048_over(criterion, gemma2_config, "prefix_hit_lookup_2048_tokens");
    // The hit ends 32 tokens into a full-attention block, taken from the freed request's tail.
    prefix_hit_2048_over(
        criterion,
        per_type_config,
        "prefix_hit_lookup_2048_tokens_per_type",
    );
}

fn prefix_hit_2048_over(
    criterion: &mut Criterion,
    config: fn(usize, usize, usize) -> CoordinatorConfig,
    name: &str,
) {
    let (mut coordinator, tokens) = cached_prompt(config);
    let request = |request_id| NewRequest {
        request_id,
        prompt_token_ids: &tokens,
        max_total_tokens: None,
        extra: ExtraKeys::default(),
    };
    criterion.bench_function(name, |bench| {
        bench.iter(|| {
            coordinator.add_request(request(1)).unwrap();
            let hit = coordinator.find_cache_hit(1).unwrap();
            coordinator.free_request(1).unwrap();
            assert_eq!(hit, 2032);
            hit
        })
    });
}

/// A coordinator over `config` whose pool caches a freed 2048-token prompt, and that prompt.
fn cached_prompt(config: fn(usize, usize, usize) -> CoordinatorConfig) -> (Coordinator, Vec<u32>) {
    let mut coordinator = Coordinator::new(config(2048, 4, 4096)).unwrap();
    let tokens = prompt(7, 2048);
    coordinator
        .add_request(NewRequest {
            request_id: 0,
            prompt_token_ids: &tokens,
            max_total_tokens: None,
            extra: ExtraKeys::default(),
        })
        .unwrap();
    let step = AllocateStep {
        request_id: 0,
        num_computed_tokens: 0,
        num_new_tokens: 2048,
    };
    assert!(coordinator.allocate(step).unwrap());
    coordinator.free_request(0).unwrap();
    (coordinator, tokens)
}

fn probe_2048(criterion: &mut Criterion) {
    let (coordinator, cached) = cached_prompt(gemma2_config);
    let extra = ExtraKeys::default();
    criterion.bench_function("probe_cache_hit_2048_tokens_cached", |bench| {
        bench.iter(|| {
            let hit = coordinator
                .probe_cache_hit(black_box(&cached), &extra)
                .unwrap();
            assert_eq!(hit, 2032);
            hit
        })
    });
    let uncached = prompt(8, 2048);
    criterion.bench_function("probe_cache_hit_2048_tokens_uncached", |bench| {
        bench.iter(|| {
            let hit = coordinator
                .probe_cache_hit(black_box(&uncached), &extra)
                .unwrap();
            assert_eq!(hit, 0);
            hit
        })
    });
}

fn hash_chain_2048(criterion: &mut Criterion) {
    let tokens = prompt(0, 2048);
    let extra = ExtraKeys::default();
    for (name, algo) in [
        ("hash_chain_2048_tokens_xxh3", HashAlgo::Xxh3),
        ("hash_chain_2048_tokens_sha256", HashAlgo::Sha256),
    ] {
        let hasher = BlockHasher::new(algo, 0);
        let mut hashes = Vec::with_capacity(2048 / BLOCK_SIZE);
        criterion.bench_function(name, |bench| {
            bench.iter(|| {
                hashes.clear();
                hasher.extend_chain(black_box(&tokens), BLOCK_SIZE, &extra, &mut hashes);
                assert_eq!(hashes.len(), 2048 / BLOCK_SIZE);
                hashes[hashes.len() - 1]
            })
        });
    }
}

fn window_release_long_decode(criterion: &mut Criterion) {
    const MAX_LEN: usize = 65536;
    let mut coordinator = Coordinator::new(gemma2_config(8192, 1, MAX_LEN)).unwrap();
    let restart = |coordinator: &mut Coordinator| {
        coordinator
            .add_request(NewRequest {
                request_id: 0,
                prompt_token_ids: &prompt(0, WINDOW),
                max_total_tokens: None,
                extra: ExtraKeys::default(),
            })
            .unwrap();
        for chunk_start in (0..WINDOW).step_by(2048) {
            let step = AllocateStep {
                request_id: 0,
                num_computed_tokens: chunk_start,
                num_new_tokens: 2048,
            };
            assert!(coordinator.allocate(step).unwrap());
        }
        WINDOW
    };
    let mut computed = restart(&mut coordinator);
    criterion.bench_function("decode_step_one_request_window_release", |bench| {
        bench.iter_custom(|iterations| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iterations {
                if computed + 1 >= MAX_LEN {
                    coordinator.free_request(0).unwrap();
                    computed = restart(&mut coordinator);
                }
                coordinator.append_token_ids(0, &[3]).unwrap();
                let step = AllocateStep {
                    request_id: 0,
                    num_computed_tokens: computed,
                    num_new_tokens: 1,
                };
                let start = Instant::now();
                let allocated = coordinator.allocate(black_box(step)).unwrap();
                elapsed += start.elapsed();
                assert!(allocated);
                computed += 1;
            }
            elapsed
        })
    });
}

/// The next turn of a conversation: a 2049-token prompt whose first 2040 tokens a freed
/// request computed (the last 8 inside a block); each iteration adds it, looks its hit up,
/// computes the rest and frees it. Once with the core's defaults (plain LRU, hits at block
/// boundaries) and once as the engine runs it (token tails, protected chains over 3/4 of the
/// pool): what the two cost on the lookup and free paths.
fn next_turn_2049(criterion: &mut Criterion) {
    for (engine, name) in [
        (false, "next_turn_2049_tokens"),
        (true, "next_turn_2049_tokens_tails_protected"),
    ] {
        let mut coordinator = Coordinator::new(gemma2_config(2048, 4, 4096)).unwrap();
        if engine {
            coordinator.set_token_tails(true);
            coordinator.set_protected_blocks(Some(1536));
        }
        let history = prompt(9, 2040);
        let run = |coordinator: &mut Coordinator, request_id: u64, tokens: &[u32]| {
            coordinator
                .add_request(NewRequest {
                    request_id,
                    prompt_token_ids: tokens,
                    max_total_tokens: None,
                    extra: ExtraKeys::default(),
                })
                .unwrap();
            let hit = coordinator.find_cache_hit(request_id).unwrap();
            let step = AllocateStep {
                request_id,
                num_computed_tokens: hit,
                num_new_tokens: tokens.len() - hit,
            };
            assert!(coordinator.allocate(step).unwrap());
            coordinator.free_request(request_id).unwrap();
            hit
        };
        run(&mut coordinator, 0, &history);
        let mut turn = history.clone();
        turn.extend((0..9).map(|i| 900_000 + i));
        criterion.bench_function(name, |bench| {
            bench.iter(|| run(&mut coordinator, 1, black_box(&turn)))
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = decode_step_256, prefix_hit_2048, probe_2048, hash_chain_2048,
        window_release_long_decode,
        next_turn_2049
}
criterion_main!(benches);
