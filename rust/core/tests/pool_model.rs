//! Model test: random single-threaded operation sequences run on the lock-free `BlockPool` and
//! on the `MutexPool` reference must give identical results, free-queue order, ref counts and
//! stats after every operation, and keep the pool invariants (every block is exactly one of
//! free or used; the null block is never handed out).

use hybrid_cache_core::{
    BlockAllocator, BlockHash, BlockId, BlockPool, CacheKey, FreeTier, MutexPool,
};
use proptest::prelude::*;
use proptest::sample::Index;

/// Ways to add a suspicious id to a free call.
#[derive(Clone, Debug)]
enum BadId {
    Null,
    OutOfRange(u32),
    /// A copy of one of the chosen ids (a double free unless it is held twice).
    Repeat(Index),
    /// Any block id in range: free, held by the sequence, or held several times.
    Any(u32),
}

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    /// Frees held references picked by index, in that order, plus maybe a bad id at `at`, to
    /// the `Low` tier or the `Normal` one.
    Free {
        picks: Vec<Index>,
        bad: Option<(BadId, Index)>,
        low: bool,
    },
    /// Caches a held block (or, with `held == false`, any id) under a key from a small space.
    Cache {
        held: bool,
        pick: Index,
        any_block: u32,
        key: (u32, u128),
    },
    /// `cached_block` then `touch_cached` on what it returned.
    Hit((u32, u128)),
    /// `cached_block` + `touch_cached`, then free that reference at once: the hit-only cycle
    /// that leaves stale queue entries behind (and triggers compaction).
    HitAndFree((u32, u128)),
    /// `touch_cached` with an arbitrary block and key.
    Touch(u32, (u32, u128)),
    /// `cached_block` then `take_cached` on what it returned (or on an arbitrary block).
    Take((u32, u128), Option<u32>),
    Reset,
}

fn key((group, hash): (u32, u128)) -> CacheKey {
    CacheKey {
        group,
        hash: BlockHash(hash),
    }
}

fn key_strategy() -> impl Strategy<Value = (u32, u128)> {
    (0u32..2, prop_oneof![0u128..6, Just(u128::MAX)])
}

fn op_strategy(num_blocks: u32) -> impl Strategy<Value = Op> {
    let bad = prop_oneof![
        Just(BadId::Null),
        (num_blocks..num_blocks + 3).prop_map(BadId::OutOfRange),
        any::<Index>().prop_map(BadId::Repeat),
        (1..num_blocks).prop_map(BadId::Any),
    ];
    prop_oneof![
        4 => (0..num_blocks as usize + 2).prop_map(Op::Allocate),
        4 => (
            prop::collection::vec(any::<Index>(), 0..6),
            prop::option::weighted(0.25, (bad, any::<Index>())),
            any::<bool>()
        )
            .prop_map(|(picks, bad, low)| Op::Free { picks, bad, low }),
        3 => (prop::bool::weighted(0.9), any::<Index>(), 0..num_blocks + 1, key_strategy())
            .prop_map(|(held, pick, any_block, key)| Op::Cache { held, pick, any_block, key }),
        4 => key_strategy().prop_map(Op::Hit),
        6 => key_strategy().prop_map(Op::HitAndFree),
        1 => (0..num_blocks + 1, key_strategy()).prop_map(|(block, key)| Op::Touch(block, key)),
        3 => (key_strategy(), prop::option::of(0..num_blocks + 1))
            .prop_map(|(key, block)| Op::Take(key, block)),
        1 => Just(Op::Reset),
    ]
}

/// Both pools plus the references the sequence holds.
struct Harness {
    lock_free: BlockPool,
    reference: MutexPool,
    /// One entry per reference held, in acquisition order.
    held: Vec<BlockId>,
}

impl Harness {
    fn new(num_blocks: usize) -> Self {
        Harness {
            lock_free: BlockPool::new(num_blocks).unwrap(),
            reference: MutexPool::new(num_blocks).unwrap(),
            held: Vec::new(),
        }
    }

    fn apply(&mut self, op: &Op) {
        match op {
            Op::Allocate(count) => {
                let (mut a, mut b) = (Vec::new(), Vec::new());
                let ra = self.lock_free.get_new_blocks(*count, &mut a);
                let rb = self.reference.get_new_blocks(*count, &mut b);
                assert_eq!(ra, rb, "get_new_blocks({count})");
                assert_eq!(a, b, "blocks handed out");
                if ra.is_err() {
                    assert!(a.is_empty(), "a refused allocation takes nothing");
                }
                assert!(!a.contains(&0), "the null block is never handed out");
                self.held.extend(a);
            }
            Op::Free { picks, bad, low } => {
                let mut remaining = self.held.clone();
                let mut ids: Vec<BlockId> = Vec::new();
                for pick in picks {
                    if !remaining.is_empty() {
                        ids.push(remaining.remove(pick.index(remaining.len())));
                    }
                }
                if let Some((bad, at)) = bad {
                    let id = match bad {
                        BadId::Null => 0,
                        BadId::OutOfRange(id) => *id,
                        BadId::Repeat(pick) if !ids.is_empty() => ids[pick.index(ids.len())],
                        BadId::Repeat(_) => 1,
                        BadId::Any(id) => *id,
                    };
                    ids.insert(at.index(ids.len() + 1), id);
                }
                let tier = if *low {
                    FreeTier::Low
                } else {
                    FreeTier::Normal
                };
                let ra = self.lock_free.free_blocks_to(&ids, tier);
                let rb = self.reference.free_blocks_to(&ids, tier);
                assert_eq!(ra, rb, "free_blocks_to({ids:?}, {tier:?})");
                if ra.is_ok() {
                    for id in ids {
                        let position = self
                            .held
                            .iter()
                            .position(|&h| h == id)
                            .expect("a successful free only drops held references");
                        self.held.remove(position);
                    }
                }
            }
            Op::Cache {
                held,
                pick,
                any_block,
                key: k,
            } => {
                let block = if *held && !self.held.is_empty() {
                    self.held[pick.index(self.held.len())]
                } else {
                    *any_block
                };
                let ra = self.lock_free.cache_block(block, key(*k));
                let rb = self.reference.cache_block(block, key(*k));
                assert_eq!(ra, rb, "cache_block({block}, {k:?})");
            }
            Op::Hit(k) => {
                let found = self.lock_free.cached_block(key(*k));
                assert_eq!(found, self.reference.cached_block(key(*k)), "cached_block");
                if let Some(block) = found {
                    let ta = self.lock_free.touch_cached(block, key(*k));
                    let tb = self.reference.touch_cached(block, key(*k));
                    assert_eq!(ta, tb, "touch_cached({block})");
                    assert!(ta, "a block just found under its key is always touchable");
                    self.held.push(block);
                }
            }
            Op::HitAndFree(k) => {
                let before = self.held.len();
                self.apply(&Op::Hit(*k));
                if self.held.len() > before {
                    let block = self.held.pop().unwrap();
                    let ra = self.lock_free.free_blocks(&[block]);
                    assert_eq!(ra, self.reference.free_blocks(&[block]), "free after hit");
                    assert_eq!(ra, Ok(()));
                }
            }
            Op::Touch(block, k) => {
                let ta = self.lock_free.touch_cached(*block, key(*k));
                let tb = self.reference.touch_cached(*block, key(*k));
                assert_eq!(ta, tb, "touch_cached({block}, {k:?})");
                if ta {
                    self.held.push(*block);
                }
            }
            Op::Take(k, block) => {
                let found = self.lock_free.cached_block(key(*k));
                assert_eq!(
                    found,
                    self.reference.cached_block(key(*k)),
                    "cached_block({k:?})"
                );
                if let Some(block) = block.or(found) {
                    let ta = self.lock_free.take_cached(block, key(*k));
                    let tb = self.reference.take_cached(block, key(*k));
                    assert_eq!(ta, tb, "take_cached({block}, {k:?})");
                    if ta {
                        self.held.push(block);
                    }
                }
            }
            Op::Reset => {
                let ra = self.lock_free.reset_prefix_cache();
                assert_eq!(
                    ra,
                    self.reference.reset_prefix_cache(),
                    "reset_prefix_cache"
                );
                assert_eq!(
                    ra,
                    self.held.is_empty(),
                    "reset is refused iff a block is used"
                );
            }
        }
        self.check();
    }

    fn check(&self) {
        let order = self.lock_free.free_queue_order();
        assert_eq!(order, self.reference.free_queue_order(), "free queue order");
        assert_eq!(self.lock_free.stats(), self.reference.stats(), "stats");
        assert_eq!(
            self.lock_free.num_free_blocks(),
            self.reference.num_free_blocks()
        );
        let num_blocks = self.lock_free.num_blocks();
        assert_eq!(num_blocks, self.reference.num_blocks());
        assert_eq!(
            self.lock_free.ref_count(0),
            0,
            "the null block is never counted"
        );
        assert!(!order.contains(&0), "the null block is never free-queued");
        for block in 1..num_blocks as BlockId {
            let refs = self.lock_free.ref_count(block);
            assert_eq!(
                refs,
                self.reference.ref_count(block),
                "ref count of {block}"
            );
            let held = self.held.iter().filter(|&&h| h == block).count() as u32;
            assert_eq!(refs, held, "block {block}: ref count vs references held");
            let queued = order.iter().filter(|&&b| b == block).count();
            match refs {
                0 => assert_eq!(queued, 1, "free block {block} is queued exactly once"),
                _ => assert_eq!(queued, 0, "used block {block} is not queued"),
            }
        }
        assert_eq!(order.len(), self.lock_free.num_free_blocks());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn lock_free_pool_matches_mutex_pool(
        num_blocks in 2usize..10,
        ops in prop::collection::vec(op_strategy(12), 1..80),
    ) {
        let mut harness = Harness::new(num_blocks);
        harness.check();
        for op in &ops {
            harness.apply(op);
        }
        // Free everything still held (newest first) and check nothing was lost.
        let rest: Vec<BlockId> = harness.held.iter().rev().copied().collect();
        assert_eq!(harness.lock_free.free_blocks(&rest), harness.reference.free_blocks(&rest));
        harness.held.clear();
        harness.check();
        prop_assert_eq!(harness.lock_free.num_free_blocks(), num_blocks - 1);
    }
}

#[test]
fn hits_without_allocation_keep_matching() {
    // Many touch/free cycles of free cached blocks with no allocation in between: stale entries
    // pile up and the queue compacts; order and counts must still match the reference.
    let mut harness = Harness::new(6);
    harness.apply(&Op::Allocate(5));
    for (position, block) in harness.held.clone().into_iter().enumerate() {
        let k = (0, position as u128);
        assert_eq!(
            harness.lock_free.cache_block(block, key(k)),
            harness.reference.cache_block(block, key(k))
        );
    }
    let rest: Vec<BlockId> = harness.held.drain(..).rev().collect();
    harness.lock_free.free_blocks(&rest).unwrap();
    harness.reference.free_blocks(&rest).unwrap();
    for round in 0..200u128 {
        harness.apply(&Op::HitAndFree((0, (round * 7) % 5)));
    }
    harness.apply(&Op::Allocate(5));
}

#[test]
fn large_free_uses_the_same_validation() {
    let mut harness = Harness::new(64);
    harness.apply(&Op::Allocate(40));
    let mut ids: Vec<BlockId> = harness.held.iter().rev().copied().collect();
    ids.push(ids[3]);
    assert!(harness.lock_free.free_blocks(&ids).is_err());
    assert_eq!(
        harness.lock_free.free_blocks(&ids),
        harness.reference.free_blocks(&ids)
    );
    harness.check();
    ids.pop();
    ids.insert(20, 70);
    assert_eq!(
        harness.lock_free.free_blocks(&ids),
        harness.reference.free_blocks(&ids)
    );
    harness.check();
}
