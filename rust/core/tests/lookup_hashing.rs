//! A lookup hashes a prompt only as far as a hit can reach; the rest is hashed as it is
//! scheduled, and a batch's prefill chunks two chains at a time (`allocate_batch`), with the
//! same keys as one request at a time.

mod common;

use common::{add, add_with, allocate, config};
use hybrid_cache_core::{
    AllocateStep, AttentionKind, CacheKey, Coordinator, CoordinatorConfig, ExtraKeys, GroupSpec,
    HashAlgo,
};

/// A full-attention and a 64-token window group, blocks of 16 (the one-compression sha256 case
/// when `hash` is sha256), room for 4 requests of up to 1024 tokens.
fn coordinator(hash: HashAlgo) -> Coordinator {
    let block = |kind| GroupSpec {
        kind,
        block_size: 16,
    };
    let window = AttentionKind::SlidingWindow { window: 64 };
    let config = CoordinatorConfig {
        max_model_len: 1024,
        max_num_batched_tokens: 1024,
        hash,
        ..config(vec![block(AttentionKind::Full), block(window)], 512)
    };
    Coordinator::new(config).unwrap()
}

fn prompt(seed: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| (i * 7919 + seed * 104_729) % 32000)
        .collect()
}

fn sorted_keys(c: &Coordinator) -> Vec<CacheKey> {
    let mut keys: Vec<CacheKey> = c.cached_blocks().into_iter().map(|(_, key)| key).collect();
    keys.sort_by_key(|key| (key.group, key.hash.0));
    keys
}

#[test]
fn a_lookup_with_nothing_cached_hashes_a_few_blocks_and_the_allocate_the_rest() {
    let mut c = coordinator(HashAlgo::Sha256);
    add(&mut c, 1, &prompt(1, 800));
    assert_eq!(c.find_cache_hit(1).unwrap(), 0);
    let looked_up = c.stats().hashed_blocks;
    assert!(
        looked_up <= 5,
        "a miss stops after the first round: {looked_up} blocks"
    );
    assert!(allocate(&mut c, 1, 0, 800));
    assert_eq!(c.stats().hashed_blocks, 50, "every full block once");
}

#[test]
fn a_lookup_hashes_as_far_as_the_cached_prefix_and_finds_the_hit_a_whole_hash_finds() {
    let mut c = coordinator(HashAlgo::Sha256);
    let first = prompt(2, 700);
    add(&mut c, 1, &first);
    assert!(allocate(&mut c, 1, 0, 700));
    c.free_request(1).unwrap();
    // The same 300 tokens, then others: the hit ends at the last cached block before them.
    let mut second = first[..300].to_vec();
    second.extend(prompt(3, 700));
    add(&mut c, 2, &second);
    let before = c.stats().hashed_blocks;
    let hit = c.find_cache_hit(2).unwrap();
    assert_eq!(hit, 288);
    assert_eq!(
        hit,
        c.probe_cache_hit(&second, &ExtraKeys::default()).unwrap()
    );
    let hashed = c.stats().hashed_blocks - before;
    // Rounds of 64 and 512 tokens: the second one sees the cached run end.
    assert_eq!(hashed, 512 / 16, "not the whole prompt");
    assert!(allocate(&mut c, 2, hit, 1000 - hit));
    assert_eq!(
        c.stats().hashed_blocks - before,
        1000 / 16,
        "the rest as it is scheduled"
    );
}

/// Four prompts prefilled in chunks, by `allocate_batch` or one request at a time; the cached
/// keys and the blocks hashed.
fn prefill(hash: HashAlgo, batched: bool, extras: &[ExtraKeys]) -> (Vec<CacheKey>, u64) {
    let mut c = coordinator(hash);
    // Lengths that leave some requests with more chunks than others, one with a partial block.
    let lens = [640u32, 500, 640, 333];
    for (id, (&len, extra)) in lens.iter().zip(extras).enumerate() {
        add_with(
            &mut c,
            id as u64,
            &prompt(10 + id as u32, len),
            extra.clone(),
        );
        assert_eq!(c.find_cache_hit(id as u64).unwrap(), 0);
    }
    let mut computed = [0usize; 4];
    loop {
        let steps: Vec<AllocateStep> = (0..4)
            .filter(|&id| computed[id] < lens[id] as usize)
            .map(|id| AllocateStep {
                request_id: id as u64,
                num_computed_tokens: computed[id],
                num_new_tokens: (lens[id] as usize - computed[id]).min(128),
            })
            .collect();
        if steps.is_empty() {
            break;
        }
        if batched {
            assert_eq!(c.allocate_batch(&steps).unwrap(), steps.len());
        } else {
            for step in &steps {
                assert!(c.allocate(*step).unwrap());
            }
        }
        for step in &steps {
            computed[step.request_id as usize] += step.num_new_tokens;
        }
    }
    (sorted_keys(&c), c.stats().hashed_blocks)
}

#[test]
fn a_batch_hashes_its_chunks_in_pairs_to_the_keys_of_one_request_at_a_time() {
    let plain = vec![ExtraKeys::default(); 4];
    let salted = ExtraKeys {
        cache_salt: Some("s".into()),
        ..ExtraKeys::default()
    };
    let adapter = ExtraKeys {
        lora_id: Some(3),
        ..ExtraKeys::default()
    };
    // A salt (its block 0 hashed alone) and an adapter (no pairing at all) among plain ones.
    let mixed = vec![salted, ExtraKeys::default(), adapter, ExtraKeys::default()];
    for hash in [HashAlgo::Sha256, HashAlgo::Xxh3] {
        for extras in [&plain, &mixed] {
            let (batched, hashed) = prefill(hash, true, extras);
            let (single, single_hashed) = prefill(hash, false, extras);
            assert_eq!(batched, single, "{hash:?}");
            assert_eq!(hashed, single_hashed, "every block hashed once either way");
            assert_eq!(hashed, 640 / 16 + 500 / 16 + 640 / 16 + 333 / 16);
        }
    }
}
