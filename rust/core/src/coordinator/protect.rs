//! Protected chains: resistance to cyclic reuse (`Coordinator::set_protected_blocks`).
//!
//! Plain LRU's worst case is a round-robin pattern larger than the cache: conversations served
//! one after another, each coming back after all the others ran, find their history evicted
//! every time (the cache keeps the most recent histories, which come back last). What keeps
//! hitting under such a loop is a fixed subset kept whole while the rest cycles through the
//! remaining space.
//!
//! With a budget of `P` blocks, a freed request whose cached blocks fit under it joins the
//! `High` free tier, which allocation evicts only after every keyless, `Low` and `Normal` free
//! block: its chain is *protected*. A request freed while its blocks would not fit joins
//! `Normal` (plain LRU among those). A protected block leaves the set when it is handed out or
//! hit; its request frees it again later, when it may be protected again, so a chain that keeps
//! hitting stays protected however long the loop.
//!
//! Chains nobody comes back to must not hold the budget for ever. The coordinator counts frees
//! (`clock`) and remembers, for each hit on a protected block, how many frees ago it joined
//! (its reuse distance); `reuse_age` is the largest such distance seen lately (it decays
//! by 1/16 per hit). A protected block that has waited more than twice that (and at least
//! `MIN_AGE` frees) is *demoted*: taken out of the free queue and freed again into `Normal`, as
//! its most recent block, so it is evicted in LRU order from then on. In a loop of `L`
//! conversations the protected chains are hit every `L` frees and never demoted; a finished
//! conversation's chain is demoted after about `2 L` (and at least `MIN_AGE` frees).
//!
//! The count is kept from the blocks the coordinator frees, takes and is handed: a pool shared
//! with another thread may hand out protected blocks behind its back; such entries are found
//! stale when their turn to be demoted comes (the block no longer holds its key).

use std::collections::VecDeque;

use super::keys::GroupKeys;
use crate::allocator::{BlockAllocator, FreeTier};
use crate::manager::GroupBlocks;
use crate::types::{BlockId, CacheKey, NULL_BLOCK};

/// Appends the blocks of a freed request's row in one group with the key each may be cached
/// under: its full key, or `tail`'s key for the tail block. (A block whose key the pool does not
/// hold is skipped when its turn to be demoted comes.)
pub(super) fn keyed_blocks(
    keys: GroupKeys<'_>,
    blocks: &GroupBlocks,
    tail: Option<(BlockId, CacheKey)>,
    out: &mut Vec<(BlockId, CacheKey)>,
) {
    for (index, &block) in blocks.blocks.iter().enumerate() {
        if block == NULL_BLOCK {
            continue;
        }
        match tail {
            Some((tail_block, key)) if tail_block == block => out.push((block, key)),
            _ if index < keys.num_full() => out.push((block, keys.full(index))),
            _ => {}
        }
    }
}

/// Frees a protected block always waits before it may be demoted.
const MIN_AGE: u64 = 16;

#[derive(Debug)]
pub(super) struct Protected {
    budget: usize,
    /// Per block: the join number of its protected entry, 0 when it is not protected.
    joined: Vec<u64>,
    /// Protected entries in join order: (block, its key, join number, clock at joining).
    queue: VecDeque<(BlockId, CacheKey, u64, u64)>,
    /// Clock at joining, per block (valid while `joined[block] != 0`).
    joined_at: Vec<u64>,
    count: usize,
    next_join: u64,
    /// Frees so far.
    clock: u64,
    /// The largest reuse distance (in frees) of a protected block hit lately.
    reuse_age: u64,
}

impl Protected {
    pub fn new(num_blocks: usize, budget: usize) -> Self {
        Protected {
            budget,
            joined: vec![0; num_blocks],
            queue: VecDeque::new(),
            joined_at: vec![0; num_blocks],
            count: 0,
            next_join: 1,
            clock: 0,
            reuse_age: 0,
        }
    }

    /// Called once per freed request, before its blocks are freed: demotes the protected
    /// blocks that waited too long, then says whether `blocks` more fit under the budget.
    pub fn admits<P: BlockAllocator>(&mut self, pool: &P, blocks: usize) -> bool {
        self.clock += 1;
        let limit = (2 * self.reuse_age).max(MIN_AGE);
        while let Some(&(block, key, join, at)) = self.queue.front() {
            if self.joined[block as usize] != join {
                self.queue.pop_front(); // it left the set since
                continue;
            }
            if self.clock - at <= limit {
                break;
            }
            self.queue.pop_front();
            self.drop_entry(block);
            if pool.touch_cached(block, key) {
                let freed = pool.free_blocks_to(&[block], FreeTier::Normal);
                debug_assert!(freed.is_ok(), "the block was just touched");
            }
        }
        self.has_room(blocks)
    }

    /// Whether `blocks` more fit under the budget now (no demotion, no tick of the clock).
    pub fn has_room(&self, blocks: usize) -> bool {
        self.count + blocks <= self.budget
    }

    /// Records the blocks of `keyed` (a request freed into the `High` tier, with the keys they
    /// are cached under) that are free now as protected.
    pub fn joined<P: BlockAllocator>(&mut self, pool: &P, keyed: &[(BlockId, CacheKey)]) {
        for &(block, key) in keyed {
            let index = block as usize;
            if self.joined[index] == 0 && pool.ref_count(block) == 0 {
                let join = self.next_join;
                self.next_join += 1;
                self.joined[index] = join;
                self.joined_at[index] = self.clock;
                self.queue.push_back((block, key, join, self.clock));
                self.count += 1;
            }
        }
        if self.queue.len() > 2 * self.joined.len() {
            // Entries of blocks that left since stay until they reach the front: drop them.
            let joined = &self.joined;
            self.queue
                .retain(|&(block, _, join, _)| joined[block as usize] == join);
        }
    }

    /// Records that a hit took `block`: a protected block (free until then) leaves the set,
    /// and how long it waited is a reuse distance.
    pub fn hit(&mut self, block: BlockId) {
        self.reused(block);
        self.left(block);
    }

    /// Records a reuse distance for `block` if it is protected (at most four times the budget,
    /// so that distances growing round after round cannot stop demotion for good).
    fn reused(&mut self, block: BlockId) {
        let index = block as usize;
        if self.joined[index] != 0 {
            let age = (self.clock - self.joined_at[index]).min(4 * self.budget as u64 + MIN_AGE);
            self.reuse_age = age.max(self.reuse_age - self.reuse_age / 16);
        }
    }

    /// Records that `block` left the free queue (handed out or hit).
    pub fn left(&mut self, block: BlockId) {
        if self.joined[block as usize] != 0 {
            self.drop_entry(block);
        }
    }

    fn drop_entry(&mut self, block: BlockId) {
        self.joined[block as usize] = 0;
        self.count -= 1;
    }

    pub fn clear(&mut self) {
        self.joined.fill(0);
        self.queue.clear();
        self.count = 0;
    }

    pub fn count(&self) -> usize {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::BlockHash;
    use crate::{BlockPool, GroupId};

    fn key(block: BlockId) -> CacheKey {
        CacheKey {
            group: 0 as GroupId,
            hash: BlockHash(u128::from(block)),
        }
    }

    #[test]
    fn entries_of_blocks_that_left_do_not_pile_up() {
        let pool = BlockPool::new(9).unwrap();
        let mut protected = Protected::new(9, 1000);
        // Block 1 holds the front of the queue (hit now and then, so never old enough to be
        // demoted) while block 2 joins and leaves again and again behind it: the entries block 2
        // leaves behind are dropped, not kept until they reach the front.
        protected.joined(&pool, &[(1, key(1))]);
        for _ in 0..1000 {
            assert!(protected.admits(&pool, 1));
            protected.reused(1);
            protected.joined(&pool, &[(2, key(2))]);
            protected.left(2);
        }
        assert_eq!(protected.queue.front().map(|entry| entry.0), Some(1));
        assert!(
            protected.queue.len() <= 2 * 9 + 1,
            "{}",
            protected.queue.len()
        );
        assert_eq!(protected.count(), 1);
    }

    #[test]
    fn the_reuse_distance_is_capped() {
        let pool = BlockPool::new(9).unwrap();
        let mut protected = Protected::new(9, 2);
        protected.joined(&pool, &[(1, key(1))]);
        for _ in 0..10_000 {
            protected.clock += 1;
        }
        protected.reused(1);
        assert_eq!(protected.reuse_age, 4 * 2 + MIN_AGE);
    }
}
