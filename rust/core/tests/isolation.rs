//! Tenant isolation of the prefix cache.
//!
//! - Requests with different cache salts never share a cached block (nor do salted and unsalted
//!   ones), in any group type, while the same salt does share (the control).
//! - The same tokens under different LoRA adapters never share a block.
//! - The same tokens cached in two groups are two blocks under two keys, evicted independently.
//! - Hash collisions: many random blocks, chained and with extra keys, hashed with xxh3 (the
//!   default) and sha256; distinct contents must never give equal hashes. Plus a coordinator run
//!   where every cache hit is checked by comparing the tokens the hit block was filled with.
//!
//! The tests are generic over the pool; `pools!` instantiates them for each pool type. Sizes
//! shrink under Miri.

use std::collections::HashMap;

use hybrid_cache_core::hashing::BlockHasher;
use hybrid_cache_core::{
    AllocateStep, AttentionKind, BlockAllocator, BlockHash, BlockId, BlockPool, CacheKey,
    Coordinator, CoordinatorConfig, DefaultPool, ExtraKeys, GroupSpec, HashAlgo, MutexPool,
    NewRequest, NULL_BLOCK,
};

const MAX_MODEL_LEN: usize = 128;

fn full(block_size: usize) -> GroupSpec {
    GroupSpec {
        kind: AttentionKind::Full,
        block_size,
    }
}

fn window(block_size: usize, window: usize) -> GroupSpec {
    GroupSpec {
        kind: AttentionKind::SlidingWindow { window },
        block_size,
    }
}

fn chunked(block_size: usize, chunk: usize) -> GroupSpec {
    GroupSpec {
        kind: AttentionKind::ChunkedLocal { chunk },
        block_size,
    }
}

/// Group layouts every isolation property must hold for (under Miri only the last, which has
/// every attention type).
fn layouts() -> Vec<Vec<GroupSpec>> {
    let all = vec![
        vec![full(4)],
        vec![window(4, 8)],
        vec![full(4), window(2, 6)],
        vec![full(2), window(4, 9), chunked(2, 8)],
    ];
    if cfg!(miri) {
        all[3..].to_vec()
    } else {
        all
    }
}

/// Both hashes (under Miri only the default).
fn hashes() -> &'static [HashAlgo] {
    if cfg!(miri) {
        &[HashAlgo::Xxh3]
    } else {
        &[HashAlgo::Xxh3, HashAlgo::Sha256]
    }
}

fn config(groups: Vec<GroupSpec>, num_blocks: usize, hash: HashAlgo) -> CoordinatorConfig {
    CoordinatorConfig {
        num_blocks,
        groups,
        max_num_reqs: 8,
        max_model_len: MAX_MODEL_LEN,
        max_num_batched_tokens: MAX_MODEL_LEN,
        enable_prefix_caching: true,
        hash,
        hash_seed: 11,
    }
}

fn salted(salt: Option<&str>, lora_id: Option<u64>) -> ExtraKeys {
    ExtraKeys {
        lora_id,
        cache_salt: salt.map(str::to_string),
        mm_items: Vec::new(),
    }
}

/// A pool of `num_blocks` blocks of type `P`.
trait TestPool: BlockAllocator + Sized {
    fn make(num_blocks: usize) -> Self;
}

impl TestPool for MutexPool {
    fn make(num_blocks: usize) -> Self {
        MutexPool::new(num_blocks).unwrap()
    }
}

impl TestPool for BlockPool {
    fn make(num_blocks: usize) -> Self {
        BlockPool::new(num_blocks).unwrap()
    }
}

/// Adds a request, takes its cache hit and allocates its whole prompt in one step; returns the
/// hit (tokens).
fn prefill<P: BlockAllocator>(
    coordinator: &mut Coordinator<P>,
    id: u64,
    tokens: &[u32],
    extra: ExtraKeys,
) -> usize {
    coordinator
        .add_request(NewRequest {
            request_id: id,
            prompt_token_ids: tokens,
            max_total_tokens: None,
            extra,
        })
        .unwrap();
    let hit = coordinator.find_cache_hit(id).unwrap();
    let allocated = coordinator
        .allocate(AllocateStep {
            request_id: id,
            num_computed_tokens: hit,
            num_new_tokens: tokens.len() - hit,
        })
        .unwrap();
    assert!(allocated, "the pool is large enough for request {id}");
    hit
}

/// Every non-null block the request holds, in every group.
fn held_blocks<P: BlockAllocator>(coordinator: &Coordinator<P>, id: u64) -> Vec<BlockId> {
    (0..coordinator.num_groups())
        .flat_map(|group| coordinator.request_blocks(id, group).unwrap().to_vec())
        .filter(|&block| block != NULL_BLOCK)
        .collect()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + 3) % 50).collect()
}

/// What request 2 got from request 1's cache when both carry the same tokens.
#[derive(Debug)]
struct Sharing {
    /// Request 1 still running: request 2's hit (tokens) and whether it shares a block.
    hit_alive: usize,
    shared_alive: bool,
    /// Request 1 finished (its blocks free but still cached): the same, on a fresh coordinator.
    hit_after_free: usize,
    shared_after_free: bool,
}

impl Sharing {
    fn none(&self) -> bool {
        self.hit_alive == 0
            && !self.shared_alive
            && self.hit_after_free == 0
            && !self.shared_after_free
    }

    fn both(&self) -> bool {
        self.hit_alive > 0 && self.shared_alive && self.hit_after_free > 0 && self.shared_after_free
    }
}

fn share_between<P: TestPool>(
    groups: Vec<GroupSpec>,
    hash: HashAlgo,
    first: ExtraKeys,
    second: ExtraKeys,
) -> Sharing {
    let tokens = prompt(48);
    let new = || Coordinator::with_pool(config(groups.clone(), 200, hash), P::make(200)).unwrap();

    let mut coordinator = new();
    assert_eq!(prefill(&mut coordinator, 1, &tokens, first.clone()), 0);
    let first_blocks = held_blocks(&coordinator, 1);
    let hit_alive = prefill(&mut coordinator, 2, &tokens, second.clone());
    let shared_alive = held_blocks(&coordinator, 2)
        .iter()
        .any(|block| first_blocks.contains(block));
    assert_eq!(
        hit_alive > 0,
        shared_alive,
        "a hit is exactly a shared block"
    );
    coordinator.free_request(1).unwrap();
    coordinator.free_request(2).unwrap();

    let mut coordinator = new();
    prefill(&mut coordinator, 1, &tokens, first);
    let first_blocks = held_blocks(&coordinator, 1);
    coordinator.free_request(1).unwrap();
    let hit_after_free = prefill(&mut coordinator, 2, &tokens, second);
    // Request 2 may get request 1's old blocks fresh (the pool hands out free blocks); what
    // must not happen is a hit on them: the hit part of its row names the shared blocks.
    let shared_after_free = (0..coordinator.num_groups()).any(|group| {
        let block_size = coordinator.config().groups[group].block_size;
        coordinator.request_blocks(2, group).unwrap()[..hit_after_free / block_size]
            .iter()
            .any(|block| *block != NULL_BLOCK && first_blocks.contains(block))
    });
    coordinator.free_request(2).unwrap();
    assert_eq!(
        coordinator.pool().num_free_blocks(),
        coordinator.pool().num_blocks() - 1
    );
    Sharing {
        hit_alive,
        shared_alive,
        hit_after_free,
        shared_after_free,
    }
}

fn different_salts_never_share<P: TestPool>() {
    for &hash in hashes() {
        for groups in layouts() {
            let pairs = [
                (Some("tenant-a"), Some("tenant-b")),
                (None, Some("tenant-a")),
                (Some("tenant-a"), None),
                (Some(""), None),
                (Some("a"), Some("a\0")),
            ];
            for (a, b) in pairs {
                let sharing =
                    share_between::<P>(groups.clone(), hash, salted(a, None), salted(b, None));
                assert!(
                    sharing.none(),
                    "salts {a:?} / {b:?} shared: {sharing:?} ({hash:?}, {groups:?})"
                );
            }
            // Control: the same salt shares, so the test above can fail.
            let same = salted(Some("tenant-a"), None);
            let sharing = share_between::<P>(groups.clone(), hash, same.clone(), same);
            assert!(
                sharing.both(),
                "the same salt must share: {sharing:?} ({groups:?})"
            );
        }
    }
}

fn different_adapters_never_share<P: TestPool>() {
    for &hash in hashes() {
        for groups in layouts() {
            for (a, b) in [(Some(1), Some(2)), (None, Some(0)), (Some(7), None)] {
                let sharing =
                    share_between::<P>(groups.clone(), hash, salted(None, a), salted(None, b));
                assert!(
                    sharing.none(),
                    "adapters {a:?} / {b:?} shared: {sharing:?} ({hash:?}, {groups:?})"
                );
            }
            // Same adapter, different salt: still isolated.
            let sharing = share_between::<P>(
                groups.clone(),
                hash,
                salted(Some("x"), Some(3)),
                salted(Some("y"), Some(3)),
            );
            assert!(sharing.none(), "{sharing:?}");
            let same = salted(None, Some(3));
            let sharing = share_between::<P>(groups.clone(), hash, same.clone(), same);
            assert!(
                sharing.both(),
                "the same adapter must share: {sharing:?} ({groups:?})"
            );
        }
    }
}

/// Two groups with the same block size see the same tokens: two blocks under two keys (same
/// hash, different group tag); evicting one group's block leaves the other's cached.
fn two_groups_cache_independently<P: TestPool>() {
    let hash = HashAlgo::Xxh3;
    let groups = vec![full(4), full(4)];
    // 1 null + 12 blocks: request 1 takes 3 per group.
    let mut coordinator = Coordinator::with_pool(config(groups, 13, hash), P::make(13)).unwrap();
    let tokens = prompt(12);
    prefill(&mut coordinator, 1, &tokens, ExtraKeys::default());
    let group0 = coordinator.request_blocks(1, 0).unwrap().to_vec();
    let group1 = coordinator.request_blocks(1, 1).unwrap().to_vec();
    assert!(group0.iter().all(|block| !group1.contains(block)));

    let mut hashes = Vec::new();
    BlockHasher::new(hash, 11).extend_chain(&tokens, 4, &ExtraKeys::default(), &mut hashes);
    assert_eq!(hashes.len(), 3);
    let key = |group: u32, index: usize| CacheKey {
        group,
        hash: hashes[index],
    };
    let pool = coordinator.pool();
    for index in 0..3 {
        assert_eq!(pool.cached_block(key(0, index)), Some(group0[index]));
        assert_eq!(pool.cached_block(key(1, index)), Some(group1[index]));
    }

    assert_eq!(
        pool.stats().num_cached_blocks,
        6,
        "one key per group and block"
    );

    // Request 1 finishes: 6 blocks never used sit before its 6 cached ones in the free queue.
    // A 16-token request takes 4 blocks per group: the 6 unused and 2 cached ones, whichever
    // group they belong to; exactly 2 of the 6 keys may go.
    coordinator.free_request(1).unwrap();
    let filler: Vec<u32> = (1000..1016).collect();
    prefill(&mut coordinator, 2, &filler, ExtraKeys::default());
    let pool = coordinator.pool();
    assert_eq!(pool.num_free_blocks(), 4);
    assert_eq!(pool.stats().num_evictions, 2, "one block evicted at a time");
    let left: Vec<(u32, usize)> = (0..2)
        .flat_map(|group| (0..3).map(move |index| (group, index)))
        .filter(|&(group, index)| pool.cached_block(key(group, index)).is_some())
        .collect();
    assert_eq!(
        left.len(),
        4,
        "evicting one group's copy keeps the other's: {left:?}"
    );
    // A new request with the same tokens: each group's hit blocks are that group's own.
    coordinator.free_request(2).unwrap();
    let hit = prefill(&mut coordinator, 3, &tokens, ExtraKeys::default());
    let pool = coordinator.pool();
    for group in 0..2u32 {
        let row = coordinator.request_blocks(3, group as usize).unwrap();
        for (index, block) in row.iter().enumerate().take(hit / 4) {
            assert_eq!(pool.cached_block(key(group, index)), Some(*block));
        }
    }
    let row0 = coordinator.request_blocks(3, 0).unwrap().to_vec();
    assert!(coordinator
        .request_blocks(3, 1)
        .unwrap()
        .iter()
        .all(|block| !row0.contains(block)));
    coordinator.free_request(3).unwrap();
}

/// Random prompts over a tiny alphabet (so prefixes overlap a lot) run through a coordinator;
/// whenever a request gets a hit, every hit block must have been filled with exactly the tokens
/// (and keys) of this request's prefix: a hash collision would show up as a mismatch here.
fn hits_hold_the_tokens_they_claim<P: TestPool>(hash: HashAlgo) {
    let num_requests = if cfg!(miri) { 24 } else { 3000 };
    let groups = vec![full(2), window(2, 5)];
    let mut coordinator = Coordinator::with_pool(config(groups, 160, hash), P::make(160)).unwrap();
    // Block id -> (group, index, prefix tokens, extra keys) of the request that filled it.
    let mut filled: HashMap<BlockId, (usize, usize, Vec<u32>, ExtraKeys)> = HashMap::new();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut num_hits = 0;
    let mut live: Vec<u64> = Vec::new();
    for id in 0..num_requests as u64 {
        let len = 3 + (next() % 14) as usize;
        let tokens: Vec<u32> = (0..len).map(|_| (next() % 3) as u32).collect();
        let extra = salted(
            [None, Some("a"), Some("b")][(next() % 3) as usize],
            [None, Some(1)][(next() % 2) as usize],
        );
        if live.len() == 6 {
            let victim = live.remove((next() % 6) as usize);
            coordinator.free_request(victim).unwrap();
        }
        let hit = prefill(&mut coordinator, id, &tokens, extra.clone());
        live.push(id);
        for group in 0..2 {
            let row = coordinator.request_blocks(id, group).unwrap().to_vec();
            for (index, &block) in row.iter().enumerate() {
                if block == NULL_BLOCK {
                    continue;
                }
                let prefix = tokens[..((index + 1) * 2).min(len)].to_vec();
                let mine = (group, index, prefix, extra.clone());
                if (index + 1) * 2 <= hit {
                    num_hits += 1;
                    assert_eq!(
                        filled.get(&block),
                        Some(&mine),
                        "request {id} hit block {block} filled with other tokens"
                    );
                } else {
                    filled.insert(block, mine);
                }
            }
        }
    }
    assert!(num_hits > 0, "the workload must produce hits");
    for id in live {
        coordinator.free_request(id).unwrap();
    }
}

/// Hashes `count` random single blocks and as many chained extensions; distinct inputs must
/// give distinct hashes.
fn no_collisions_among_random_blocks(hash: HashAlgo) {
    let count = if cfg!(miri) { 200 } else { 200_000 };
    let hasher = BlockHasher::new(hash, 5);
    let mut seen: HashMap<BlockHash, (Vec<u32>, ExtraKeys)> = HashMap::with_capacity(count * 2);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut record = |hashes: &[BlockHash], tokens: &[u32], extra: &ExtraKeys, block_size| {
        for (index, &hash) in hashes.iter().enumerate() {
            let content = (tokens[..(index + 1) * block_size].to_vec(), extra.clone());
            if let Some(previous) = seen.insert(hash, content.clone()) {
                assert_eq!(previous, content, "hash collision on {hash:?}");
            }
        }
    };
    for i in 0..count {
        rng = rng
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let block_size = 1 + (rng >> 60) as usize;
        // Tokens near 0 and near u32::MAX: byte patterns that differ in one bit.
        let tokens: Vec<u32> = (0..2 * block_size)
            .map(|j| {
                let bits = (rng >> (j % 48)) as u32;
                if i % 2 == 0 {
                    bits % 4
                } else {
                    u32::MAX - bits % 4
                }
            })
            .collect();
        let extra = match i % 4 {
            0 => ExtraKeys::default(),
            1 => salted(Some(&format!("{}", rng % 97)), None),
            2 => salted(None, Some(rng % 97)),
            _ => salted(Some(&format!("{}", rng % 5)), Some(rng % 5)),
        };
        let mut hashes = Vec::new();
        hasher.extend_chain(&tokens, block_size, &extra, &mut hashes);
        record(&hashes, &tokens, &extra, block_size);
    }
}

/// Inputs built to look alike byte-wise still hash apart: a salt that spells the bytes of a
/// LoRA id, token runs that split differently across blocks, the empty salt.
fn lookalike_keys_hash_apart(hash: HashAlgo) {
    let hasher = BlockHasher::new(hash, 0);
    let lora_bytes = String::from_utf8(7u64.to_le_bytes().to_vec()).unwrap();
    let extras = [
        ExtraKeys::default(),
        salted(Some(""), None),
        salted(Some(&lora_bytes), None),
        salted(None, Some(7)),
        salted(None, Some(0)),
        salted(Some("0"), None),
        salted(Some(""), Some(0)),
    ];
    let mut first_blocks = Vec::new();
    for extra in &extras {
        let mut hashes = Vec::new();
        hasher.extend_chain(&[1, 2, 3, 4], 4, extra, &mut hashes);
        first_blocks.push(hashes[0]);
    }
    for (i, a) in first_blocks.iter().enumerate() {
        for (j, b) in first_blocks.iter().enumerate().skip(i + 1) {
            assert_ne!(a, b, "{:?} and {:?} hash alike", extras[i], extras[j]);
        }
    }
    // [1 2][3 4] vs [1 2 3 4]: block size is part of what a chain hashes.
    let mut two = Vec::new();
    hasher.extend_chain(&[1, 2, 3, 4], 2, &ExtraKeys::default(), &mut two);
    let mut one = Vec::new();
    hasher.extend_chain(&[1, 2, 3, 4], 4, &ExtraKeys::default(), &mut one);
    assert_ne!(two[1], one[0]);
}

macro_rules! pools {
    ($($module:ident => $pool:ty),* $(,)?) => {$(
        mod $module {
            use super::*;

            #[test]
            fn different_salts_never_share_a_block() {
                different_salts_never_share::<$pool>();
            }

            #[test]
            fn different_adapters_never_share_a_block() {
                different_adapters_never_share::<$pool>();
            }

            #[test]
            fn the_same_tokens_in_two_groups_are_cached_independently() {
                two_groups_cache_independently::<$pool>();
            }

            #[test]
            fn every_hit_holds_the_requests_own_tokens_xxh3() {
                hits_hold_the_tokens_they_claim::<$pool>(HashAlgo::Xxh3);
            }

            #[test]
            fn every_hit_holds_the_requests_own_tokens_sha256() {
                hits_hold_the_tokens_they_claim::<$pool>(HashAlgo::Sha256);
            }
        }
    )*};
}

pools!(block_pool => BlockPool, mutex_pool => MutexPool);

/// The pool the coordinator uses by default is one of those tested above.
#[test]
fn the_default_pool_is_tested() {
    let name = std::any::type_name::<DefaultPool>();
    assert!(
        name.ends_with("BlockPool") || name.ends_with("MutexPool"),
        "add {name} to pools!"
    );
}

#[test]
fn no_collisions_among_random_blocks_xxh3() {
    no_collisions_among_random_blocks(HashAlgo::Xxh3);
}

#[test]
fn no_collisions_among_random_blocks_sha256() {
    no_collisions_among_random_blocks(HashAlgo::Sha256);
}

#[test]
fn lookalike_keys_hash_apart_xxh3() {
    lookalike_keys_hash_apart(HashAlgo::Xxh3);
}

#[test]
fn lookalike_keys_hash_apart_sha256() {
    lookalike_keys_hash_apart(HashAlgo::Sha256);
}
