//! The prefix-cache map `CacheKey -> BlockId`: a fixed-size, lock-free, open-addressing table
//! with linear probing, holding each key's first copy and its spare (see `block_pool`).
//!
//! # Layout
//!
//! One `AtomicU64` per slot, `2 * num_blocks` slots rounded up to a power of two (at most one
//! entry per block, so the table is at most half full of entries):
//!
//! ```text
//!  63        33   32      31             0
//! +-------------+-------+----------------+
//! | tag (31)    | spare | block (32)     |   block 0 (the null block, never cached):
//! +-------------+-------+----------------+   EMPTY = 0, TOMBSTONE = only the spare bit
//! ```
//!
//! The key itself is not stored: an entry names its block, whose key slots hold the key
//! (`block_state`), and `tag` (the top 31 bits of the key's mixed hash) skips most other keys
//! without reading a block. The home slot is the top bits of the same mixed hash, so an entry's
//! tag also gives its home (tables of up to 2^31 slots), which `rebuild` uses. The pool writes a
//! block's key slots before inserting its entry (Release CAS) and removes the entry before the
//! key slots can change again, so a reader that finds an entry (Acquire) and then reads the
//! block's key sees that key, unless the entry was removed and the block re-keyed in between:
//! then it may see another key, or a mix of two keys' words, which is why every lookup is a hint
//! the pool's `touch_cached`/`take_cached` validate.
//!
//! # Operations
//!
//! - `get`: probe from the key's home slot to the first EMPTY slot; the first copy wins, else
//!   the spare.
//! - `insert`: the same probe, noting whether the key has a first copy and a spare; the block
//!   becomes whichever is missing, written by CAS into the first non-live slot of the probe
//!   (a TOMBSTONE, else the EMPTY that ended it); a failed CAS probes again.
//! - `remove`: the caller passes the slot its entry was inserted at (kept with the block), so
//!   removal is one CAS of that exact entry to TOMBSTONE, never a search. A TOMBSTONE followed by
//!   an EMPTY slot turns EMPTY, and so do the TOMBSTONEs right before it: no probe can need to
//!   pass a slot whose successor is EMPTY (entries sit at the first free slot of their probe
//!   when inserted).
//! - `rebuild` (exclusive access): TOMBSTONEs inside runs of live entries stay, and a pool whose
//!   blocks are all cached and evicted in turn piles them up until probes for absent keys scan
//!   hundreds of slots (a table of 8192 slots, every block re-keyed 11 times: 483 slots per
//!   probe, 66 EMPTY slots left). The map counts its TOMBSTONEs; once they take an eighth of
//!   the slots (`needs_rebuild`), the pool's owner rebuilds the table in place, in one pass:
//!   TOMBSTONEs turn EMPTY and each entry that must moves back along its probe
//!   (`BlockAllocator::tidy`).
//!
//! # Under concurrency
//!
//! Single-threaded, the map is exact. With several threads, two departures, both harmless to
//! the pool's safety (no block lost or handed out twice: that lives in the state words):
//! - two blocks inserted for the same key at the same moment may both become first copies
//!   (each removes only its own entry);
//! - a removal that turns slots EMPTY while an insert is placing an entry past them can leave
//!   that entry unreachable by probes until its block removes it: lookups of that key miss.

#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::{BlockId, CacheKey};

#[cfg(not(loom))]
const BLOCK_MASK: u64 = 0xffff_ffff;
#[cfg(not(loom))]
const SPARE: u64 = 1 << 32;
#[cfg(not(loom))]
const TAG_SHIFT: u32 = 33;
#[cfg(not(loom))]
const EMPTY: u64 = 0;
#[cfg(not(loom))]
const TOMBSTONE: u64 = SPARE;
#[cfg(not(loom))]
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

/// Which copy of its key an entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Copy {
    First,
    Spare,
}

/// See the module docs.
#[cfg(not(loom))]
pub(crate) struct CacheMap {
    slots: Box<[AtomicU64]>,
    /// `slots.len() - 1` (a power of two minus one).
    mask: usize,
    /// `64 - log2(slots.len())`: the home slot is the top bits of the mixed hash.
    shift: u32,
    /// TOMBSTONE slots, counted by `insert`, `remove` and `collapse`: exact while one thread
    /// uses the map, an estimate under concurrency (a load and a store, no locked instruction);
    /// `rebuild` starts it afresh.
    tombstones: Padded,
}

/// A counter on a cache line of its own, so its writes do not evict the fields every probe reads.
#[cfg(not(loom))]
#[repr(align(128))]
#[derive(Debug, Default)]
struct Padded(std::sync::atomic::AtomicUsize);

/// The share of the table's slots (one in `TOMBSTONE_SHARE`) that TOMBSTONEs may take before
/// `needs_rebuild` says so. Live entries take at most half the slots, so probes for an absent
/// key stay short: linear probing at five eighths full scans about four slots.
#[cfg(not(loom))]
const TOMBSTONE_SHARE: usize = 8;

/// Moves a rebuild holds back before reporting them (see `rebuild_by_tags`): the map of a
/// 131072-block pool, an eighth of it TOMBSTONEs, rebuilt in 0.92-0.99 ms against 1.11-1.21 ms
/// reporting each move at once (8 and 32 within the noise).
#[cfg(not(loom))]
const MOVES_AHEAD: usize = 16;

#[cfg(not(loom))]
impl std::fmt::Debug for CacheMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheMap")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

#[cfg(not(loom))]
impl CacheMap {
    /// A map for a pool of `num_blocks` blocks (at most one entry each).
    pub(crate) fn new(num_blocks: usize) -> Self {
        let len = (num_blocks.saturating_mul(2))
            .clamp(64, 1 << 32)
            .next_power_of_two();
        let slots: Box<[AtomicU64]> = (0..len).map(|_| AtomicU64::new(EMPTY)).collect();
        // The allocator may hand out lazily mapped zero pages: write one word per page now, so
        // the first steps that cache blocks do not pay the page faults.
        for slot in slots.iter().step_by(512) {
            slot.store(EMPTY, Ordering::Relaxed);
        }
        CacheMap {
            slots,
            mask: len - 1,
            shift: 64 - len.trailing_zeros(),
            tombstones: Padded::default(),
        }
    }

    /// The key's home slot and tag.
    fn place(&self, key: CacheKey) -> (usize, u64) {
        let hash = key.hash.0;
        let folded = (hash as u64) ^ ((hash >> 64) as u64).rotate_left(23) ^ u64::from(key.group);
        let mixed = (folded ^ (folded >> 29)).wrapping_mul(MIX);
        let home = (mixed >> self.shift) as usize;
        let tag = mixed >> TAG_SHIFT;
        (home, tag)
    }

    /// The home slot of the live entry `word`: from its tag (the top bits of the same mixed
    /// hash) in a table of up to 2^31 slots, else from its block's key.
    fn home_of(&self, word: u64, key_of: &impl Fn(BlockId) -> CacheKey) -> usize {
        if self.shift >= TAG_SHIFT {
            ((word >> TAG_SHIFT) >> (self.shift - TAG_SHIFT)) as usize
        } else {
            self.place(key_of(block_of(word))).0
        }
    }

    fn entry(tag: u64, copy: Copy, block: BlockId) -> u64 {
        let spare = if copy == Copy::Spare { SPARE } else { 0 };
        (tag << TAG_SHIFT) | spare | u64::from(block)
    }

    /// The live entry `word` names `key` (tag first, then the block's key slots).
    fn names(word: u64, tag: u64, key: CacheKey, key_of: &impl Fn(BlockId) -> CacheKey) -> bool {
        word & BLOCK_MASK != 0 && word >> TAG_SHIFT == tag && key_of(block_of(word)) == key
    }

    /// Starts loading the key's home slot into the cache: a caller
    /// about to look up or insert several keys prefetches the next ones while it works.
    pub(crate) fn prefetch(&self, key: CacheKey) {
        let (home, _) = self.place(key);
        crate::primitive::prefetch(&self.slots[home]);
    }

    /// Starts loading slot `slot` into the cache (a hint; ignored out of range): a caller about
    /// to remove the entries several blocks recorded prefetches them first.
    pub(crate) fn prefetch_slot(&self, slot: usize) {
        if let Some(word) = self.slots.get(slot) {
            crate::primitive::prefetch(word);
        }
    }

    /// The key's first copy, else its spare. `key_of` reads a block's key slots.
    pub(crate) fn get(
        &self,
        key: CacheKey,
        key_of: impl Fn(BlockId) -> CacheKey,
    ) -> Option<BlockId> {
        let (mut index, tag) = self.place(key);
        let mut spare = None;
        for _ in 0..self.slots.len() {
            // Acquire: pairs with the Release CAS of `insert`, so the block's key slots written
            // before it are visible.
            let word = self.slots[index].load(Ordering::Acquire);
            if word == EMPTY {
                break;
            }
            if Self::names(word, tag, key, &key_of) {
                if word & SPARE == 0 {
                    return Some(block_of(word));
                }
                spare = Some(block_of(word));
            }
            index = (index + 1) & self.mask;
        }
        spare
    }

    /// Inserts `block` as `key`'s first copy when it has none, else as its spare when it has
    /// none; returns which and the slot (for `remove`), or `None` (nothing changed) when both
    /// exist. The block's key slots must hold `key` already.
    pub(crate) fn insert(
        &self,
        key: CacheKey,
        block: BlockId,
        key_of: impl Fn(BlockId) -> CacheKey,
    ) -> Option<(Copy, usize)> {
        debug_assert_ne!(block, 0, "the null block is never cached");
        let (home, tag) = self.place(key);
        loop {
            let mut index = home;
            let (mut first, mut spare) = (false, false);
            let mut free = None;
            for _ in 0..self.slots.len() {
                // Acquire: as in `get`.
                let word = self.slots[index].load(Ordering::Acquire);
                if word & BLOCK_MASK == 0 {
                    free.get_or_insert((index, word));
                    if word == EMPTY {
                        break;
                    }
                } else if Self::names(word, tag, key, &key_of) {
                    if word & SPARE == 0 {
                        first = true;
                    } else {
                        spare = true;
                    }
                }
                index = (index + 1) & self.mask;
            }
            let copy = match (first, spare) {
                (false, _) => Copy::First,
                (true, false) => Copy::Spare,
                (true, true) => return None,
            };
            let (at, seen) = free.expect("the table always has free slots: half at most is live");
            // Release: publishes the block's key slots with the entry (see `get`).
            if self.slots[at]
                .compare_exchange(
                    seen,
                    Self::entry(tag, copy, block),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
            {
                if seen == TOMBSTONE {
                    self.count_tombstones(-1);
                }
                return Some((copy, at));
            }
        }
    }

    /// Removes `block`'s entry for `key` at `slot` (as `insert` returned it) and says which
    /// copy it was; `None` when that slot holds no such entry.
    pub(crate) fn remove(&self, slot: usize, key: CacheKey, block: BlockId) -> Option<Copy> {
        let cell = self.slots.get(slot)?;
        let (_, tag) = self.place(key);
        let removed = [Copy::First, Copy::Spare].into_iter().find(|&copy| {
            cell.compare_exchange(
                Self::entry(tag, copy, block),
                TOMBSTONE,
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .is_ok()
        })?;
        let collapsed = self.collapse(slot);
        self.count_tombstones(1 - collapsed as isize);
        Some(removed)
    }

    /// Turns the TOMBSTONE at `slot`, and those right before it, EMPTY when the slot after
    /// it is EMPTY (see the module docs); returns how many it turned.
    fn collapse(&self, slot: usize) -> usize {
        let next = (slot + 1) & self.mask;
        if self.slots[next].load(Ordering::Acquire) != EMPTY {
            return 0;
        }
        let mut index = slot;
        let mut turned = 0;
        for _ in 0..self.slots.len() {
            if self.slots[index]
                .compare_exchange(TOMBSTONE, EMPTY, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                break;
            }
            turned += 1;
            index = (index + self.mask) & self.mask;
        }
        turned
    }

    /// Adds `delta` to the TOMBSTONE count (see `tombstones`).
    fn count_tombstones(&self, delta: isize) {
        // Relaxed: an estimate that orders nothing.
        let count = &self.tombstones.0;
        let now = count.load(Ordering::Relaxed);
        count.store(now.saturating_add_signed(delta), Ordering::Relaxed);
    }

    /// Whether TOMBSTONEs take more than their share of the slots (`TOMBSTONE_SHARE`): entries
    /// removed inside long runs of live ones leave TOMBSTONEs that no later removal turns EMPTY,
    /// and with every block cached and evicted in turn they would, left alone, fill the table
    /// until every probe for an absent key scanned most of it.
    pub(crate) fn needs_rebuild(&self) -> bool {
        // Relaxed: see `count_tombstones`.
        self.tombstones.0.load(Ordering::Relaxed) > self.slots.len() / TOMBSTONE_SHARE
    }

    /// Rids the table of its TOMBSTONEs: every live entry ends at the first free slot of its
    /// probe, as if inserted into an empty table; `placed(block, slot)` is told the new slot of
    /// each entry that moved. `key_of` reads a block's key slots (only for tables of more than
    /// 2^31 slots, whose tags do not give the home). Exclusive access (`&mut`): no probe can run
    /// meanwhile.
    ///
    /// One pass in slot order from an EMPTY slot (no probe passes one, so no run of entries
    /// wraps around it): a TOMBSTONE turns EMPTY, a live entry leaves its slot and is inserted
    /// again from its home. Everything between its home and its old slot was passed already
    /// and holds no TOMBSTONE, so it lands at or before its old slot, and no entry not yet
    /// passed is overwritten. Without an EMPTY slot the live entries are gathered, the table
    /// emptied and they are inserted again.
    pub(crate) fn rebuild(
        &mut self,
        key_of: impl Fn(BlockId) -> CacheKey,
        prefetch_block: impl Fn(BlockId),
        placed: impl FnMut(BlockId, usize),
    ) {
        match self
            .slots
            .iter_mut()
            .position(|slot| *slot.get_mut() == EMPTY)
        {
            None => self.rebuild_gathering(key_of, placed),
            Some(start) if self.shift < TAG_SHIFT => {
                self.rebuild_reading_keys(start, key_of, placed)
            }
            Some(start) => self.rebuild_by_tags(start, prefetch_block, placed),
        }
        *self.tombstones.0.get_mut() = 0;
    }

    /// `rebuild` from the EMPTY slot `start`, each entry's home from its tag.
    fn rebuild_by_tags(
        &mut self,
        start: usize,
        prefetch_block: impl Fn(BlockId),
        mut placed: impl FnMut(BlockId, usize),
    ) {
        let (mask, home_shift) = (self.mask, self.shift - TAG_SHIFT);
        // Each move is reported `MOVES_AHEAD` moves later, its block prefetched meanwhile: the
        // moved blocks are anywhere in the pool, and reporting each at once waited on its miss.
        let mut moves = [(0 as BlockId, 0usize); MOVES_AHEAD];
        let mut num_moves = 0usize;
        // `last_empty`: the last slot passed that is EMPTY now. Every slot after it up to
        // `index` holds an entry, so an entry whose home is among them stays where it is; one
        // whose home is not moves back, to the first EMPTY slot from its home (at or before
        // `last_empty`), and its old slot becomes the last EMPTY one. Most entries stay: that
        // path has no branch on the slot's contents (EMPTY and live slots come at random; a
        // branch there took three times as long), and only `last_empty` carries from one slot
        // to the next.
        let mut last_empty = start;
        for step in 1..=self.slots.len() {
            let index = (start + step) & mask;
            let word = *self.slots[index].get_mut();
            let live = word & BLOCK_MASK != 0;
            // An EMPTY slot or a TOMBSTONE counts as "at its home", which always stays.
            let home = if live {
                ((word >> TAG_SHIFT) >> home_shift) as usize
            } else {
                index
            };
            let stays = (index.wrapping_sub(home) & mask) < (index.wrapping_sub(last_empty) & mask);
            if !stays {
                *self.slots[index].get_mut() = EMPTY;
                let at = self.place_from(home, word);
                debug_assert_ne!(at, index, "an entry that moves moves back");
                prefetch_block(block_of(word));
                let pending = &mut moves[num_moves % MOVES_AHEAD];
                if num_moves >= MOVES_AHEAD {
                    placed(pending.0, pending.1);
                }
                *pending = (block_of(word), at);
                num_moves += 1;
                last_empty = index;
                continue;
            }
            // A TOMBSTONE turns EMPTY; an EMPTY slot or an entry that stays is written back.
            *self.slots[index].get_mut() = if live { word } else { EMPTY };
            last_empty = if live { last_empty } else { index };
        }
        for index in num_moves.saturating_sub(MOVES_AHEAD)..num_moves {
            let (block, at) = moves[index % MOVES_AHEAD];
            placed(block, at);
        }
    }

    /// `rebuild` from the EMPTY slot `start`, each entry's home from its block's key.
    fn rebuild_reading_keys(
        &mut self,
        start: usize,
        key_of: impl Fn(BlockId) -> CacheKey,
        mut placed: impl FnMut(BlockId, usize),
    ) {
        for step in 1..=self.slots.len() {
            let index = (start + step) & self.mask;
            let word = std::mem::replace(self.slots[index].get_mut(), EMPTY);
            if word & BLOCK_MASK != 0 {
                let at = self.place_from(self.place(key_of(block_of(word))).0, word);
                if at != index {
                    placed(block_of(word), at);
                }
            }
        }
    }

    /// `rebuild` of a table without an EMPTY slot: the live entries gathered, the table emptied,
    /// the entries inserted again.
    fn rebuild_gathering(
        &mut self,
        key_of: impl Fn(BlockId) -> CacheKey,
        mut placed: impl FnMut(BlockId, usize),
    ) {
        let live: Vec<u64> = self
            .slots
            .iter_mut()
            .map(|slot| std::mem::replace(slot.get_mut(), EMPTY))
            .filter(|&word| word & BLOCK_MASK != 0)
            .collect();
        for word in live {
            let at = self.place_from(self.home_of(word, &key_of), word);
            placed(block_of(word), at);
        }
    }

    /// Writes `word` into the first EMPTY slot from `home` on (exclusive access) and returns it.
    fn place_from(&mut self, home: usize, word: u64) -> usize {
        let mut at = home;
        while *self.slots[at].get_mut() != EMPTY {
            at = (at + 1) & self.mask;
        }
        *self.slots[at].get_mut() = word;
        at
    }

    /// The TOMBSTONE count `needs_rebuild` goes by (tests: exact on one thread).
    #[cfg(test)]
    pub(crate) fn counted_tombstones(&self) -> usize {
        self.tombstones.0.load(Ordering::Relaxed)
    }

    /// Slots that hold an entry (tests).
    #[cfg(test)]
    pub(crate) fn num_live(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| slot.load(Ordering::Relaxed) & BLOCK_MASK != 0)
            .count()
    }

    /// The number of slots (tests).
    #[cfg(test)]
    pub(crate) fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Slots that are neither EMPTY nor live (tests: tombstones must not pile up).
    #[cfg(test)]
    pub(crate) fn num_tombstones(&self) -> usize {
        self.slots
            .iter()
            .filter(|slot| slot.load(Ordering::Relaxed) == TOMBSTONE)
            .count()
    }
}

#[cfg(not(loom))]
fn block_of(word: u64) -> BlockId {
    (word & BLOCK_MASK) as BlockId
}

/// Under loom the map is a plain locked `HashMap` with the same interface: the models target
/// the state word and the free queue.
#[cfg(loom)]
#[derive(Debug)]
pub(crate) struct CacheMap(
    crate::primitive::Mutex<std::collections::HashMap<(CacheKey, bool), BlockId>>,
);

#[cfg(loom)]
impl CacheMap {
    pub(crate) fn new(_num_blocks: usize) -> Self {
        CacheMap(crate::primitive::Mutex::new(
            std::collections::HashMap::new(),
        ))
    }

    pub(crate) fn get(
        &self,
        key: CacheKey,
        _key_of: impl Fn(BlockId) -> CacheKey,
    ) -> Option<BlockId> {
        let map = self.0.lock().unwrap();
        map.get(&(key, false))
            .or_else(|| map.get(&(key, true)))
            .copied()
    }

    pub(crate) fn insert(
        &self,
        key: CacheKey,
        block: BlockId,
        _key_of: impl Fn(BlockId) -> CacheKey,
    ) -> Option<(Copy, usize)> {
        let mut map = self.0.lock().unwrap();
        let copy = if !map.contains_key(&(key, false)) {
            Copy::First
        } else if !map.contains_key(&(key, true)) {
            Copy::Spare
        } else {
            return None;
        };
        map.insert((key, copy == Copy::Spare), block);
        Some((copy, 0))
    }

    pub(crate) fn prefetch(&self, _key: CacheKey) {}

    pub(crate) fn prefetch_slot(&self, _slot: usize) {}

    pub(crate) fn needs_rebuild(&self) -> bool {
        false
    }

    pub(crate) fn rebuild(
        &mut self,
        _key_of: impl Fn(BlockId) -> CacheKey,
        _prefetch_block: impl Fn(BlockId),
        _placed: impl FnMut(BlockId, usize),
    ) {
    }

    pub(crate) fn remove(&self, _slot: usize, key: CacheKey, block: BlockId) -> Option<Copy> {
        let mut map = self.0.lock().unwrap();
        [Copy::First, Copy::Spare].into_iter().find(|&copy| {
            let at = (key, copy == Copy::Spare);
            let found = map.get(&at) == Some(&block);
            if found {
                map.remove(&at);
            }
            found
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::types::BlockHash;
    use std::collections::HashMap;

    fn key(group: u32, hash: u128) -> CacheKey {
        CacheKey {
            group,
            hash: BlockHash(hash),
        }
    }

    #[test]
    fn first_copy_then_spare_then_full() {
        let map = CacheMap::new(8);
        let keys: HashMap<BlockId, CacheKey> = [(1, key(0, 5)), (2, key(0, 5)), (3, key(0, 5))]
            .into_iter()
            .collect();
        let key_of = |block: BlockId| keys[&block];
        let (copy, first_at) = map.insert(key(0, 5), 1, key_of).unwrap();
        assert_eq!(copy, Copy::First);
        assert_eq!(map.insert(key(0, 5), 2, key_of).unwrap().0, Copy::Spare);
        assert_eq!(map.insert(key(0, 5), 3, key_of), None);
        assert_eq!(map.get(key(0, 5), key_of), Some(1));
        assert_eq!(
            map.get(key(1, 5), key_of),
            None,
            "the group is part of the key"
        );
        assert_eq!(
            map.remove(first_at, key(0, 5), 2),
            None,
            "only the entry at its slot"
        );
        assert_eq!(map.remove(first_at, key(0, 5), 1), Some(Copy::First));
        assert_eq!(
            map.get(key(0, 5), key_of),
            Some(2),
            "the spare is found alone"
        );
        assert_eq!(map.insert(key(0, 5), 3, key_of).unwrap().0, Copy::First);
        assert_eq!(map.get(key(0, 5), key_of), Some(3), "a first copy wins");
    }

    /// Random churn at the most entries the pool can hold, against a model: every lookup
    /// agrees, and tombstones stay few, as probes never pass a slot followed by an EMPTY one.
    #[test]
    fn churn_agrees_with_a_model_and_keeps_tombstones_few() {
        const BLOCKS: u32 = 512;
        let map = CacheMap::new(BLOCKS as usize);
        let keys: Vec<std::cell::Cell<CacheKey>> = (0..=BLOCKS)
            .map(|_| std::cell::Cell::new(key(0, 0)))
            .collect();
        let key_of = |block: BlockId| keys[block as usize].get();
        let mut model: HashMap<CacheKey, (BlockId, usize)> = HashMap::new();
        let mut held: HashMap<BlockId, (CacheKey, usize)> = HashMap::new();
        let mut rng = crate::test_rng::XorShift(12345u64);
        let mut next = || rng.next();
        let rounds = if cfg!(miri) { 2_000 } else { 400_000 };
        for _ in 0..rounds {
            let block = (next() % u64::from(BLOCKS)) as BlockId + 1;
            if let Some((old, slot)) = held.remove(&block) {
                assert_eq!(map.remove(slot, old, block), Some(Copy::First));
                model.remove(&old);
            } else {
                // Few distinct keys per group so lookups of present and absent keys both occur.
                let new = key((next() % 2) as u32, u128::from(next() % 4096));
                if model.contains_key(&new) {
                    continue;
                }
                keys[block as usize].set(new);
                let (copy, slot) = map.insert(new, block, key_of).unwrap();
                assert_eq!(copy, Copy::First);
                model.insert(new, (block, slot));
                held.insert(block, (new, slot));
            }
            let probe = key((next() % 2) as u32, u128::from(next() % 4096));
            assert_eq!(
                map.get(probe, key_of),
                model.get(&probe).map(|&(block, _)| block)
            );
        }
        assert!(
            map.num_tombstones() <= BLOCKS as usize,
            "{} tombstones",
            map.num_tombstones()
        );
        for (block, (old, slot)) in held {
            assert_eq!(map.remove(slot, old, block), Some(Copy::First));
        }
        assert_eq!(
            map.num_tombstones(),
            0,
            "an empty map collapses every tombstone"
        );
    }

    /// A map of `blocks` blocks, every block cached under a key of its own, then each block
    /// re-keyed in turn (its entry removed, a new one inserted: an eviction) `cycles` times,
    /// rebuilt whenever `needs_rebuild` says so if `rebuild`. Checks the TOMBSTONE count after
    /// every step and lookups against the model; returns the map, the block -> (key, slot)
    /// model and the number of rebuilds.
    fn evict_in_turn(
        blocks: u32,
        cycles: usize,
        rebuild: bool,
    ) -> (CacheMap, Vec<std::cell::Cell<CacheKey>>, Vec<usize>, usize) {
        let mut map = CacheMap::new(blocks as usize);
        let keys: Vec<std::cell::Cell<CacheKey>> = (0..=blocks)
            .map(|_| std::cell::Cell::new(key(0, 0)))
            .collect();
        let mut slots = vec![0usize; blocks as usize + 1];
        let mut rng = crate::test_rng::XorShift(0x5eed);
        let mut rebuilds = 0;
        let len = map.slots.len();
        for cycle in 0..=cycles {
            for block in 1..blocks {
                let at = block as usize;
                if cycle > 0 {
                    let old = keys[at].get();
                    assert_eq!(map.remove(slots[at], old, block), Some(Copy::First));
                    assert_eq!(map.get(old, |b: BlockId| keys[b as usize].get()), None);
                }
                let new = key(
                    block % 2,
                    u128::from(rng.next()) << 64 | u128::from(rng.next()),
                );
                keys[at].set(new);
                let key_of = |b: BlockId| keys[b as usize].get();
                let (copy, slot) = map.insert(new, block, key_of).unwrap();
                assert_eq!(copy, Copy::First);
                slots[at] = slot;
                if rebuild && map.needs_rebuild() {
                    map.rebuild(key_of, |_| {}, |moved, slot| slots[moved as usize] = slot);
                    assert_eq!((map.num_tombstones(), map.counted_tombstones()), (0, 0));
                    rebuilds += 1;
                }
                if block % 64 == 0 {
                    assert_eq!(map.counted_tombstones(), map.num_tombstones());
                    if rebuild {
                        assert!(map.num_tombstones() <= len / TOMBSTONE_SHARE);
                    }
                    // A block cached already (in the first cycle, one up to this one).
                    let cached = if cycle == 0 { block } else { blocks - 1 };
                    let some = 1 + (rng.next() % u64::from(cached)) as usize;
                    assert_eq!(map.get(keys[some].get(), key_of), Some(some as BlockId));
                }
            }
        }
        (map, keys, slots, rebuilds)
    }

    /// Every block cached and evicted in turn (a full pool under steady load) leaves TOMBSTONEs
    /// no removal clears; rebuilt when they pass their share, the map stays as short to probe as
    /// a fresh one and every entry stays where its block's recorded slot says.
    #[test]
    fn rebuilds_keep_tombstones_to_their_share_when_every_block_is_evicted_in_turn() {
        let (blocks, cycles) = if cfg!(miri) { (128, 3) } else { (1024, 12) };
        let (map, _, _, _) = evict_in_turn(blocks, cycles, false);
        let len = map.slots.len();
        assert!(
            map.num_tombstones() > len / TOMBSTONE_SHARE,
            "without rebuilds they pile up: {} of {len} slots",
            map.num_tombstones()
        );
        let (map, keys, slots, rebuilds) = evict_in_turn(blocks, cycles, true);
        assert!(rebuilds >= cycles / 2, "{rebuilds} rebuilds");
        for block in 1..blocks {
            let at = block as usize;
            let key_of = |b: BlockId| keys[b as usize].get();
            assert_eq!(map.get(keys[at].get(), key_of), Some(block));
            assert_eq!(
                map.remove(slots[at], keys[at].get(), block),
                Some(Copy::First)
            );
        }
        assert_eq!(
            map.num_tombstones(),
            0,
            "an emptied map collapses every one"
        );
    }

    /// The two other ways to rebuild (a table without an EMPTY slot; a table too large for tags
    /// to give homes, forced here on a small one) leave the same entries, each findable at the
    /// slot `placed` reported.
    #[test]
    fn rebuilds_without_an_empty_slot_and_reading_keys_keep_every_entry() {
        let blocks = if cfg!(miri) { 64 } else { 512 };
        for way in ["gathering", "reading keys", "by tags"] {
            let (mut map, keys, mut slots, _) = evict_in_turn(blocks, 4, false);
            let key_of = |b: BlockId| keys[b as usize].get();
            if way == "gathering" {
                // No EMPTY slot left: every probe ends only at the table's end.
                for slot in map.slots.iter_mut() {
                    if *slot.get_mut() == EMPTY {
                        *slot.get_mut() = TOMBSTONE;
                    }
                }
            }
            let start = map
                .slots
                .iter()
                .position(|slot| slot.load(Ordering::Relaxed) == EMPTY);
            let placed = |moved: BlockId, slot: usize| slots[moved as usize] = slot;
            match (way, start) {
                ("gathering", None) => map.rebuild(key_of, |_| {}, placed),
                ("reading keys", Some(start)) => map.rebuild_reading_keys(start, key_of, placed),
                ("by tags", Some(start)) => map.rebuild_by_tags(start, |_| {}, placed),
                other => panic!("unexpected {other:?}"),
            }
            assert_eq!(map.num_tombstones(), 0, "{way}");
            for block in 1..blocks {
                let at = block as usize;
                assert_eq!(map.get(keys[at].get(), key_of), Some(block), "{way}");
                let word = map.slots[slots[at]].load(Ordering::Relaxed);
                assert_eq!(block_of(word), block, "{way}: the reported slot");
                // At the first free slot of its probe: nothing EMPTY between home and it.
                let (home, _) = map.place(keys[at].get());
                let mut probe = home;
                while probe != slots[at] {
                    assert_ne!(map.slots[probe].load(Ordering::Relaxed), EMPTY, "{way}");
                    probe = (probe + 1) & map.mask;
                }
            }
        }
    }
}
