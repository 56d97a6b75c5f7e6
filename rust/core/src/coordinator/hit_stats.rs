//! Why looked-up prompt tokens were hits or not: counters summed over `find_cache_hit` calls.
//!
//! For a prompt of `n` tokens with hit alignment `L`, the longest hit possible is
//! `h_max = (n - 1) / L * L` (the last token is always computed). Each group alone accepts some
//! `a_g <= h_max` (what it would hit if it were the only group); the hit is `h <= min a_g`. Let
//! `F` be the least `a_g` of the full-attention groups (of all groups in a model without full
//! attention): how far the prefix itself is cached. The `n` tokens split into
//!
//! ```text
//!   hits           h
//!   window tail    F - h            the full-attention prefix is cached up to F, but a windowed
//!                                   (or chunked) group lacks the blocks a hit point there needs
//!   never cached   h_max - F        the limiting group's next unit was never cached here
//!   evicted        h_max - F        ... or it was, and has been evicted since
//!   alignment      n - h_max        the last token, and the tokens past the last multiple of L
//! ```
//!
//! Per group: `alone` sums `a_g`, `shortened` sums `a_g - h` (the hit this group lost to the
//! others). A tail replay's hit `h` is where it starts the windowed groups over; `replays`
//! counts those lookups, `replay_tokens` sums what they recompute below the full-attention hit
//! point (`F - h`) and `replay_gain` the tokens they hit beyond the plain hit. A token-tail hit
//! (`tails`) may end past `h_max`, inside a block: `h_max` is then taken as the hit, each group
//! as accepting it; `tail_hits` counts those lookups and `tail_gain` the tokens they took beyond
//! the aligned hit. A unit that is not cached now was cached before exactly when its key left the
//! cache since, so "was it ever cached" is a Bloom filter over the keys that left this
//! coordinator's cache (a block evicted by an allocation, a cached block a hit took, a reset):
//! nothing is recorded while blocks are only cached, which is most of the time. No false "never
//! cached", some false "evicted" (under 1% while the filter is at most 1/16 full; it is cleared
//! when fuller, after which keys evicted before count as never cached). A unit is looked up
//! under every key of its block that covers it (the block's full key, or a partial key of at
//! least its units).
//!
//! One count per admission: a lookup is counted when its request first gets slots beyond its hit
//! (it starts computing), so a lookup whose request is freed before (a hold given back, an
//! admission that failed) or that its next lookup supersedes is never counted, and a prompt
//! looked up again is not counted twice; the counters only grow. A preempted request did
//! compute: its next admission counts again.

use crate::types::{BlockHash, CacheKey, GroupId};

/// See the module docs. All counts are tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HitStats {
    /// Prompt tokens looked up.
    pub queries: u64,
    /// Tokens of those that were hits.
    pub hits: u64,
    pub miss_window_tail: u64,
    pub miss_never_cached: u64,
    pub miss_evicted: u64,
    pub miss_alignment: u64,
    /// Per group: tokens it alone would have hit.
    pub alone: Vec<u64>,
    /// Per group: tokens it alone would have hit beyond the hit taken.
    pub shortened: Vec<u64>,
    /// Lookups answered with a tail replay.
    pub replays: u64,
    /// Tokens those replays recompute below their full-attention hit point.
    pub replay_tokens: u64,
    /// Tokens those replays hit beyond the hit every group had.
    pub replay_gain: u64,
    /// Lookups whose hit ended on token tails (`tails`).
    pub tail_hits: u64,
    /// Tokens those hits took beyond the aligned hit (or replay start) they replaced.
    pub tail_gain: u64,
}

/// One lookup's figures, as `HitStats::record` takes them.
pub(super) struct Lookup<'a> {
    pub num_tokens: usize,
    pub max_hit: usize,
    pub hit: usize,
    /// Per group, what it alone accepts.
    pub alone: &'a [usize],
    /// How far the prefix itself is cached (`F` in the module docs).
    pub prefix_cached: usize,
    /// Whether the unit after `prefix_cached` was ever cached.
    pub next_was_cached: bool,
    /// For a tail replay (`hit` is its start): the hit every group had, and the full-attention
    /// hit point.
    pub replay: Option<(usize, usize)>,
    /// For a token-tail hit: the tokens the lookup would have hit without tails.
    pub tail_from: Option<usize>,
}

impl HitStats {
    pub(super) fn new(num_groups: usize) -> Self {
        HitStats {
            alone: vec![0; num_groups],
            shortened: vec![0; num_groups],
            ..HitStats::default()
        }
    }

    /// One lookup's figures, to `add` once the lookup comes to something (see the module docs).
    pub(super) fn of(lookup: Lookup<'_>) -> HitStats {
        let mut one = HitStats::new(lookup.alone.len());
        one.count(lookup);
        one
    }

    pub(super) fn add(&mut self, one: &HitStats) {
        let op = |total: &mut u64, value: u64| *total += value;
        op(&mut self.queries, one.queries);
        op(&mut self.hits, one.hits);
        op(&mut self.miss_window_tail, one.miss_window_tail);
        op(&mut self.miss_never_cached, one.miss_never_cached);
        op(&mut self.miss_evicted, one.miss_evicted);
        op(&mut self.miss_alignment, one.miss_alignment);
        op(&mut self.replays, one.replays);
        op(&mut self.replay_tokens, one.replay_tokens);
        op(&mut self.replay_gain, one.replay_gain);
        op(&mut self.tail_hits, one.tail_hits);
        op(&mut self.tail_gain, one.tail_gain);
        for (total, &value) in self.alone.iter_mut().zip(&one.alone) {
            op(total, value);
        }
        for (total, &value) in self.shortened.iter_mut().zip(&one.shortened) {
            op(total, value);
        }
    }

    fn count(&mut self, lookup: Lookup<'_>) {
        let limit = lookup.prefix_cached;
        let hit = lookup.hit.min(limit);
        self.queries += lookup.num_tokens as u64;
        self.hits += hit as u64;
        self.miss_window_tail += (limit - hit) as u64;
        let uncached = (lookup.max_hit - limit) as u64;
        if lookup.next_was_cached {
            self.miss_evicted += uncached;
        } else {
            self.miss_never_cached += uncached;
        }
        self.miss_alignment += (lookup.num_tokens - lookup.max_hit) as u64;
        if let Some((plain_hit, frontier)) = lookup.replay {
            self.replays += 1;
            self.replay_tokens += (frontier - lookup.hit) as u64;
            self.replay_gain += (lookup.hit - plain_hit) as u64;
        }
        if let Some(without) = lookup.tail_from {
            self.tail_hits += 1;
            self.tail_gain += lookup.hit.saturating_sub(without) as u64;
        }
        for (group, &alone) in lookup.alone.iter().enumerate() {
            self.alone[group] += alone as u64;
            self.shortened[group] += alone.saturating_sub(hit) as u64;
        }
    }
}

/// A Bloom filter of the keys (group, chain hash) that left the cache so far; see the module
/// docs.
#[derive(Debug)]
pub(super) struct EvictedKeys {
    words: Vec<u64>,
    inserted: usize,
}

const PROBES: usize = 3;
const GROUP_MIX: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;

impl EvictedKeys {
    /// A filter of about `capacity * 16` bits (a power of two, 4 KiB to 2 MiB).
    pub(super) fn new(capacity: usize) -> Self {
        let bits = capacity
            .saturating_mul(16)
            .next_power_of_two()
            .clamp(1 << 15, 1 << 24);
        EvictedKeys {
            words: vec![0; bits / 64],
            inserted: 0,
        }
    }

    /// The filter's bits for a key: three probes derived from its 128-bit hash, the group mixed
    /// in (the same hash in two groups is two keys).
    fn positions(&self, group: GroupId, hash: BlockHash) -> [usize; PROBES] {
        let mask = self.words.len() * 64 - 1;
        let mixed = hash.0 ^ u128::from(group).wrapping_mul(GROUP_MIX);
        let (high, low) = ((mixed >> 64) as u64, mixed as u64);
        [0u64, 1, 2].map(|i| (low.wrapping_add(i.wrapping_mul(high | 1)) as usize) & mask)
    }

    pub(super) fn insert(&mut self, group: GroupId, hash: BlockHash) {
        if self.inserted * 16 >= self.words.len() * 64 {
            self.words.iter_mut().for_each(|word| *word = 0);
            self.inserted = 0;
        }
        for bit in self.positions(group, hash) {
            self.words[bit / 64] |= 1 << (bit % 64);
        }
        self.inserted += 1;
    }

    /// Inserts every key of `keys` and empties it.
    pub(super) fn insert_all(&mut self, keys: &mut Vec<CacheKey>) {
        for key in keys.drain(..) {
            self.insert(key.group, key.hash);
        }
    }

    pub(super) fn contains(&self, group: GroupId, hash: BlockHash) -> bool {
        self.positions(group, hash)
            .iter()
            .all(|&bit| self.words[bit / 64] & (1 << (bit % 64)) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_holds_what_was_inserted_and_little_else() {
        let mut evicted = EvictedKeys::new(1000);
        for hash in 0..1000u128 {
            evicted.insert(0, BlockHash(hash * 7919));
        }
        assert!((0..1000u128).all(|hash| evicted.contains(0, BlockHash(hash * 7919))));
        let false_positives = (5000..15000u128)
            .filter(|&hash| evicted.contains(0, BlockHash(hash * 7919)))
            .count();
        assert!(false_positives < 100, "{false_positives} of 10000");
        let other_group = (0..1000u128)
            .filter(|&hash| evicted.contains(1, BlockHash(hash * 7919)))
            .count();
        assert!(
            other_group < 10,
            "the group is part of the key: {other_group} of 1000"
        );
    }

    #[test]
    fn the_split_adds_up_to_the_queries() {
        let mut stats = HitStats::new(2);
        stats.add(&HitStats::of(Lookup {
            num_tokens: 50,
            max_hit: 48,
            hit: 16,
            alone: &[32, 40],
            prefix_cached: 32,
            next_was_cached: true,
            replay: None,
            tail_from: None,
        }));
        assert_eq!(stats.hits, 16);
        assert_eq!(stats.miss_window_tail, 16);
        assert_eq!(stats.miss_evicted, 16);
        assert_eq!(stats.miss_alignment, 2);
        let misses = stats.miss_window_tail
            + stats.miss_never_cached
            + stats.miss_evicted
            + stats.miss_alignment;
        assert_eq!(stats.hits + misses, stats.queries);
        assert_eq!((stats.alone, stats.shortened), (vec![32, 40], vec![16, 24]));
    }
}
