//! `MutexPool`: a sequential block pool behind one `Mutex`.
//!
//! It is the baseline the lock-free [`crate::BlockPool`] is measured against and the reference
//! model the property tests compare it with, so it favours obviousness over speed: intrusive
//! doubly-linked lists over block ids as the LRU free queues, one per tier (O(1) append,
//! pop-front and removal from the middle), and `HashMap`s for the prefix cache and the spare
//! copies.
//!
//! Invariants (checked by `debug_assert!`s and by the tests in `tests/pool_contract.rs` and
//! `tests/pool_model.rs`):
//! - a block is in exactly one free list iff its ref count is 0 and it is not the null block;
//! - `key_of[b] == Some(key)` iff `cache[key] == b` or `spares[key] == b`; a key in both maps
//!   names two blocks. A lookup takes the first copy, else the spare (which stays where it is
//!   when its twin is evicted, as in `BlockPool`).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::allocator::{BlockAllocator, FreeTier, NUM_FREE_QUEUES};
use crate::error::CoreError;
use crate::types::{BlockId, CacheKey, PoolStats, NULL_BLOCK};

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Sequential {
    /// References held on each block; always 0 for the null block.
    ref_count: Vec<u32>,
    /// The cache key a block carries, if it holds a full cached block.
    key_of: Vec<Option<CacheKey>>,
    /// Free-list links (`NIL` when absent); `queue_of[b]` is the list a free block is in. The
    /// head of the first non-empty list is evicted first.
    prev: Vec<u32>,
    next: Vec<u32>,
    queue_of: Vec<u8>,
    head: [u32; NUM_FREE_QUEUES],
    tail: [u32; NUM_FREE_QUEUES],
    num_free: usize,
    cache: HashMap<CacheKey, BlockId>,
    spares: HashMap<CacheKey, BlockId>,
    num_evictions: u64,
}

impl Sequential {
    fn new(num_blocks: usize) -> Self {
        let mut pool = Sequential {
            ref_count: vec![0; num_blocks],
            key_of: vec![None; num_blocks],
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            queue_of: vec![0; num_blocks],
            head: [NIL; NUM_FREE_QUEUES],
            tail: [NIL; NUM_FREE_QUEUES],
            num_free: 0,
            cache: HashMap::new(),
            spares: HashMap::new(),
            num_evictions: 0,
        };
        for block in 1..num_blocks as u32 {
            pool.push_back(block, 0);
        }
        pool
    }

    fn push_back(&mut self, block: u32, queue: usize) {
        let b = block as usize;
        self.queue_of[b] = queue as u8;
        self.prev[b] = self.tail[queue];
        self.next[b] = NIL;
        if self.tail[queue] == NIL {
            self.head[queue] = block;
        } else {
            self.next[self.tail[queue] as usize] = block;
        }
        self.tail[queue] = block;
        self.num_free += 1;
    }

    /// The block evicted next: the head of the first non-empty list.
    fn first_free(&self) -> u32 {
        self.head
            .iter()
            .copied()
            .find(|&head| head != NIL)
            .unwrap_or(NIL)
    }

    fn unlink(&mut self, block: u32) {
        let b = block as usize;
        let queue = self.queue_of[b] as usize;
        let (prev, next) = (self.prev[b], self.next[b]);
        if prev == NIL {
            self.head[queue] = next;
        } else {
            self.next[prev as usize] = next;
        }
        if next == NIL {
            self.tail[queue] = prev;
        } else {
            self.prev[next as usize] = prev;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.num_free -= 1;
    }

    /// Drops the key a block carries (its entry as first copy or as spare). Returns whether
    /// it had one.
    /// Drops the key `block` carries, if any, and returns it.
    fn drop_key(&mut self, block: u32) -> Option<CacheKey> {
        let key = self.key_of[block as usize].take()?;
        if self.cache.get(&key) == Some(&block) {
            self.cache.remove(&key);
        } else {
            let removed = self.spares.remove(&key);
            debug_assert_eq!(removed, Some(block), "cache maps and key_of disagree");
        }
        Some(key)
    }

    fn check_block(&self, block: BlockId) -> Result<(), CoreError> {
        if block == NULL_BLOCK {
            return Err(CoreError::InvalidBlock(
                "the null block (id 0) is never allocated and cannot be freed or cached".into(),
            ));
        }
        if block as usize >= self.ref_count.len() {
            return Err(CoreError::InvalidBlock(format!(
                "block id {block} is out of range: the pool has blocks 1..{}",
                self.ref_count.len()
            )));
        }
        Ok(())
    }
}

/// A sequential pool behind one mutex. See the module docs.
#[derive(Debug)]
pub struct MutexPool {
    inner: Mutex<Sequential>,
}

impl MutexPool {
    /// A pool of `num_blocks` blocks, block 0 being the null block. Needs at least 2.
    pub fn new(num_blocks: usize) -> Result<Self, CoreError> {
        crate::validate_num_blocks(num_blocks)?;
        Ok(MutexPool {
            inner: Mutex::new(Sequential::new(num_blocks)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Sequential> {
        // A panic while holding the lock cannot leave the lists half-linked in a way later calls
        // rely on more than the panic already broke, so a poisoned lock is still used.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl BlockAllocator for MutexPool {
    fn num_blocks(&self) -> usize {
        self.lock().ref_count.len()
    }

    fn num_free_blocks(&self) -> usize {
        self.lock().num_free
    }

    fn get_new_blocks_noting(
        &self,
        count: usize,
        out: &mut Vec<BlockId>,
        evicted: &mut Vec<CacheKey>,
    ) -> Result<(), CoreError> {
        let mut pool = self.lock();
        if count > pool.num_free {
            return Err(CoreError::NoFreeBlocks {
                requested: count,
                free: pool.num_free,
            });
        }
        out.reserve(count);
        for _ in 0..count {
            let block = pool.first_free();
            debug_assert!(block != NIL, "free count says a block is free");
            pool.unlink(block);
            if let Some(key) = pool.drop_key(block) {
                pool.num_evictions += 1;
                evicted.push(key);
            }
            pool.ref_count[block as usize] = 1;
            out.push(block);
        }
        Ok(())
    }

    fn free_blocks_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError> {
        let mut pool = self.lock();
        // Validate everything before changing anything.
        let mut seen: HashMap<BlockId, u32> = HashMap::new();
        for &block in blocks {
            pool.check_block(block)?;
            let times = seen.entry(block).or_insert(0);
            *times += 1;
            if *times > pool.ref_count[block as usize] {
                return Err(CoreError::DoubleFree { block });
            }
        }
        for &block in blocks {
            let b = block as usize;
            pool.ref_count[b] -= 1;
            if pool.ref_count[b] == 0 {
                let queue = tier.queue(pool.key_of[b].is_some());
                pool.push_back(block, queue);
            }
        }
        Ok(())
    }

    fn cached_block(&self, key: CacheKey) -> Option<BlockId> {
        let pool = self.lock();
        pool.cache
            .get(&key)
            .or_else(|| pool.spares.get(&key))
            .copied()
    }

    fn touch_cached(&self, block: BlockId, key: CacheKey) -> bool {
        let mut pool = self.lock();
        if pool.check_block(block).is_err() || pool.key_of[block as usize] != Some(key) {
            return false;
        }
        if pool.ref_count[block as usize] == 0 {
            pool.unlink(block);
        }
        pool.ref_count[block as usize] += 1;
        true
    }

    fn take_cached(&self, block: BlockId, key: CacheKey) -> bool {
        let mut pool = self.lock();
        let b = block as usize;
        if pool.check_block(block).is_err() || pool.key_of[b] != Some(key) || pool.ref_count[b] != 0
        {
            return false;
        }
        pool.unlink(block);
        pool.drop_key(block);
        pool.ref_count[b] = 1;
        true
    }

    fn cache_block(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError> {
        let mut pool = self.lock();
        pool.check_block(block)?;
        if pool.ref_count[block as usize] == 0 {
            return Err(CoreError::InvalidBlock(format!(
                "block {block} is free; only a block the caller holds can be cached"
            )));
        }
        if pool.key_of[block as usize].is_some() {
            return Ok(false);
        }
        let pool = &mut *pool;
        let map = if !pool.cache.contains_key(&key) {
            &mut pool.cache
        } else if !pool.spares.contains_key(&key) {
            &mut pool.spares
        } else {
            return Ok(false);
        };
        map.insert(key, block);
        pool.key_of[block as usize] = Some(key);
        Ok(true)
    }

    fn reset_prefix_cache_noting(&self, forgotten: &mut Vec<CacheKey>) -> bool {
        let mut pool = self.lock();
        if pool.num_free + 1 != pool.ref_count.len() {
            return false;
        }
        pool.cache.clear();
        pool.spares.clear();
        forgotten.extend(pool.key_of.iter_mut().filter_map(Option::take));
        true
    }

    fn ref_count(&self, block: BlockId) -> u32 {
        let pool = self.lock();
        pool.ref_count.get(block as usize).copied().unwrap_or(0)
    }

    fn cached_blocks(&self) -> Vec<(BlockId, CacheKey)> {
        let pool = self.lock();
        (0..pool.key_of.len())
            .filter_map(|block| pool.key_of[block].map(|key| (block as BlockId, key)))
            .collect()
    }

    fn free_queue_order(&self) -> Vec<BlockId> {
        let pool = self.lock();
        let mut order = Vec::with_capacity(pool.num_free);
        for &head in &pool.head {
            let mut block = head;
            while block != NIL {
                order.push(block);
                block = pool.next[block as usize];
            }
        }
        order
    }

    fn stats(&self) -> PoolStats {
        let pool = self.lock();
        PoolStats {
            num_blocks: pool.ref_count.len(),
            num_free_blocks: pool.num_free,
            num_cached_blocks: pool.cache.len() + pool.spares.len(),
            num_spare_blocks: pool.spares.len(),
            num_evictions: pool.num_evictions,
        }
    }
}

// No unit tests here: everything `MutexPool` guarantees is the `BlockAllocator` contract, which
// `tests/pool_contract.rs` checks on both pools (and `tests/pool_model.rs` against `BlockPool`).
