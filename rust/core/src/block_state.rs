//! Per-block atomic state: one 64-bit word (reference count, cached bit, caching-in-progress bit,
//! generation) plus the block's cache key, stored in atomics so no lock is ever taken. The words
//! of all blocks form one array and their keys another (`BlockSlots`): what a release or a claim
//! reads is packed 8 blocks to a cache line.
//!
//! # The state word
//!
//! ```text
//!  63                          26  25        24       23                0
//! +------------------------------+---------+--------+-------------------+
//! | generation (38 bits)         | pending | cached | ref count (24 bit)|
//! +------------------------------+---------+--------+-------------------+
//! ```
//!
//! - `ref count`: references held by callers; 0 means free (in the free queue, logically).
//! - `cached`: the block's key slots hold a key that the cache map maps to this block.
//! - `pending`: a `cache_block` call owns the key slots and is writing them; never set together
//!   with `cached`, and only set while the block is held.
//! - `generation`: bumped on every transition from ref count 0 to 1 (allocation pop, or touch of
//!   a free cached block). A free-queue entry `(block, generation)` is *valid* iff the block's
//!   word has ref count 0 and that generation; every other entry is *stale* and skipped.
//!
//! # Transitions (all by compare-and-swap on the whole word)
//!
//! | operation                 | from                  | to                          |
//! |---------------------------|-----------------------|-----------------------------|
//! | claim (allocation pop)    | `(0, g, c, p)`        | `(1, g+1, 0, 0)`            |
//! | touch a cached block      | `(r, g, 1, 0)`        | `(r+1, r==0 ? g+1 : g, 1, 0)` |
//! | take a free cached block  | `(0, g, 1, 0)`        | `(1, g+1, 0, 0)`            |
//! | release one reference     | `(r>0, g, c, p)`      | `(r-1, g, c, p)`            |
//! | begin caching             | `(r>0, g, 0, 0)`      | `(r, g, 0, 1)`              |
//! | finish caching            | `(r, g, 0, 1)`        | `(r, g, 1, 0)` (same `g`)   |
//! | cache by the sole holder  | `(1, g, 0, 0)`        | `(1, g, 1, 0)` (same `g`)   |
//! | forget key (reset)        | `(0, g, 1, 0)`        | `(0, g, 0, 0)`              |
//!
//! Invariants:
//! - A block has at most one valid free-queue entry: a release to 0 pushes `(block, g)` with the
//!   current `g`, and the next 0 -> 1 transition bumps `g`, so older entries are stale.
//! - The key slots change only between `begin caching` and `finish caching`, which require the
//!   block to be held and uncached, or while its sole holder caches an uncached block (no other
//!   caller can change its word then, and no reader acts on an uncached word); a block leaves
//!   the cached state only by a claim or a take (both bump `g`) or a reset (needs ref count 0,
//!   after which only a claim can make it held again). So *two different keys observed under
//!   the same state word value are impossible*: a toucher that reads the word, then the key,
//!   then CASes from that exact word has read the key that word describes (see
//!   [`BlockSlot::touch`] for the memory-ordering argument).
//!
//! # ABA and field widths
//!
//! 24 bits of ref count allow 16.7 million holders of one block (a touch that would overflow is
//! refused as a miss). The 38-bit generation wraps after 2^38 (2.7e11) 0 -> 1 transitions of one
//! block. A stale entry `(b, g)` could only be mistaken for valid if `b`'s generation advanced by
//! exactly 2^38 while the entry waited in the FIFO; each of those transitions needs a release of
//! `b` that pushed an entry *behind* the stale one (still queued, since FIFO pops the stale one
//! first), i.e. about 2^38 queued entries of 16 bytes: 4 TiB of queue. A touch that compares the
//! whole word across a preemption needs the same 2^38 transitions of one block during that
//! preemption (hours at full speed). Both are treated as impossible.

use crate::primitive::{AtomicU32, AtomicU64, Ordering};
use crate::types::{BlockHash, CacheKey};

const REF_BITS: u32 = 24;
/// Largest reference count the word can hold.
pub(crate) const MAX_REF_COUNT: u64 = (1 << REF_BITS) - 1;
const CACHED: u64 = 1 << REF_BITS;
const PENDING: u64 = 1 << (REF_BITS + 1);
const GENERATION_SHIFT: u32 = REF_BITS + 2;
/// Generations live in the top 38 bits; arithmetic on them wraps modulo 2^38.
const GENERATION_MASK: u64 = (1 << (64 - GENERATION_SHIFT)) - 1;

/// A decoded copy of a block's state word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct State(u64);

impl State {
    /// The state of every block when the pool is built: free, uncached, generation 0.
    pub(crate) const INITIAL: State = State(0);

    pub(crate) fn ref_count(self) -> u64 {
        self.0 & MAX_REF_COUNT
    }

    pub(crate) fn is_cached(self) -> bool {
        self.0 & CACHED != 0
    }

    pub(crate) fn is_pending(self) -> bool {
        self.0 & PENDING != 0
    }

    pub(crate) fn generation(self) -> u64 {
        self.0 >> GENERATION_SHIFT
    }

    fn with_generation(self, generation: u64) -> State {
        State(
            (self.0 & !(GENERATION_MASK << GENERATION_SHIFT))
                | ((generation & GENERATION_MASK) << GENERATION_SHIFT),
        )
    }

    fn next_generation(self) -> State {
        self.with_generation(self.generation().wrapping_add(1))
    }

    /// True when a free-queue entry carrying `generation` is valid for this state.
    pub(crate) fn is_free_with(self, generation: u64) -> bool {
        self.ref_count() == 0 && self.generation() == generation
    }
}

/// Outcome of trying to claim a popped free-queue entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The block is now held once by the caller; `was_cached` says its key must be evicted.
    Claimed { was_cached: bool },
    /// The entry was stale (the block was touched or reused since it was queued).
    Stale,
}

/// Outcome of releasing one reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Other references remain.
    StillHeld,
    /// This was the last reference: the caller must queue `(block, generation)`; `cached` says
    /// whether it still carries a cache key (which picks its free queue).
    NowFree { generation: u64, cached: bool },
    /// The block was not held (a concurrent caller freed the same reference).
    NotHeld,
}

/// Outcome of touching a cached block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Touch {
    /// One reference taken; `was_free` says it came out of the free queue (its reservation is
    /// consumed).
    Taken { was_free: bool },
    /// The block does not hold the key (any more), or a needed reservation was refused.
    Miss,
}

/// The key slots of one block, kept apart from the state words (`BlockSlots`).
#[derive(Debug)]
struct KeySlots {
    /// High 64 bits of the cached key's hash. Meaningful only while `cached` is set; written
    /// only while `pending` is set by the holder that set it (or by a sole holder, see
    /// `write_key_alone`).
    key_hash_high: AtomicU64,
    /// Low 64 bits of the cached key's hash; same rule as `key_hash_high`.
    key_hash_low: AtomicU64,
    /// Group of the cached key; same rule as `key_hash_high`.
    key_group: AtomicU32,
    /// The cache map slot of the block's entry (`cache_map`); written and read only by the
    /// block's holder (ordered by the state word's CASes), so a std atomic even under loom.
    map_slot: std::sync::atomic::AtomicU32,
}

impl KeySlots {
    fn new() -> Self {
        KeySlots {
            key_hash_high: AtomicU64::new(0),
            key_hash_low: AtomicU64::new(0),
            key_group: AtomicU32::new(0),
            map_slot: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// Every block's state word and key slots, in two arrays indexed by block id. The state words
/// lie 8 to a cache line, apart from the 24-byte key slots: a release or a claim reads the word
/// alone, so freeing a request whose blocks are neighbours touches a quarter of the lines a
/// combined 32-byte slot would, and the words of scattered blocks lie in a quarter of the pages.
#[derive(Debug)]
pub(crate) struct BlockSlots {
    states: Box<[AtomicU64]>,
    keys: Box<[KeySlots]>,
}

impl BlockSlots {
    /// `num_blocks` free, uncached blocks of generation 0. One word per page of each array is
    /// written now, so memory the allocator mapped lazily is faulted in at construction, not by
    /// the first steps.
    pub(crate) fn new(num_blocks: usize) -> Self {
        let states: Box<[AtomicU64]> = (0..num_blocks)
            .map(|_| AtomicU64::new(State::INITIAL.0))
            .collect();
        let keys: Box<[KeySlots]> = (0..num_blocks).map(|_| KeySlots::new()).collect();
        for state in states
            .iter()
            .step_by(4096 / std::mem::size_of::<AtomicU64>())
        {
            state.store(State::INITIAL.0, Ordering::Relaxed);
        }
        for slots in keys.iter().step_by(4096 / std::mem::size_of::<KeySlots>()) {
            slots.key_group.store(0, Ordering::Relaxed);
        }
        BlockSlots { states, keys }
    }

    /// Blocks, the null block included.
    pub(crate) fn len(&self) -> usize {
        self.states.len()
    }

    /// Block `block`'s slot, `None` out of range.
    pub(crate) fn get(&self, block: usize) -> Option<BlockSlot<'_>> {
        Some(BlockSlot {
            state: self.states.get(block)?,
            keys: self.keys.get(block)?,
        })
    }

    /// Block `block`'s slot; panics out of range (ids the pool itself handed out or queued).
    pub(crate) fn slot(&self, block: usize) -> BlockSlot<'_> {
        BlockSlot {
            state: &self.states[block],
            keys: &self.keys[block],
        }
    }

    /// Every block's slot, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = BlockSlot<'_>> {
        self.states
            .iter()
            .zip(self.keys.iter())
            .map(|(state, keys)| BlockSlot { state, keys })
    }

    /// Starts loading `block`'s state word into the cache (a hint; ignored out of range).
    pub(crate) fn prefetch_state(&self, block: usize) {
        if let Some(state) = self.states.get(block) {
            crate::primitive::prefetch(state);
        }
    }

    /// Starts loading `block`'s key slots into the cache (a hint; ignored out of range).
    pub(crate) fn prefetch_keys(&self, block: usize) {
        if let Some(keys) = self.keys.get(block) {
            crate::primitive::prefetch(keys);
        }
    }
}

/// One block's synchronisation state: its state word and its key slots (`BlockSlots`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockSlot<'a> {
    /// The state word described in the module docs. Only modified by CAS (or `fetch_*` that
    /// preserve the other fields).
    state: &'a AtomicU64,
    keys: &'a KeySlots,
}

impl BlockSlot<'_> {
    /// A snapshot of the state word.
    pub(crate) fn load(&self) -> State {
        // Acquire: pairs with the Release CASes below so what a releasing holder wrote (the key
        // slots in particular) is visible to whoever observes the new state.
        State(self.state.load(Ordering::Acquire))
    }

    /// Reads the key slots. Only meaningful under the conditions in the module docs.
    pub(crate) fn key(&self) -> CacheKey {
        // Acquire: pairs with the Release stores in `write_key`; a toucher that reads a key newer
        // than its state snapshot thereby also sees the generation bump that preceded it, so
        // its CAS from the old snapshot fails (see `touch`).
        let group = self.keys.key_group.load(Ordering::Acquire);
        let high = self.keys.key_hash_high.load(Ordering::Acquire);
        let low = self.keys.key_hash_low.load(Ordering::Acquire);
        CacheKey {
            group,
            hash: BlockHash(((high as u128) << 64) | low as u128),
        }
    }

    /// The cache map slot recorded by `set_map_slot`.
    pub(crate) fn map_slot(&self) -> usize {
        // Relaxed: only the block's holder reads it, after the CASes that made it the holder.
        self.keys
            .map_slot
            .load(std::sync::atomic::Ordering::Relaxed) as usize
    }

    /// Records the cache map slot of the block's entry (the holder, while caching it).
    pub(crate) fn set_map_slot(&self, slot: usize) {
        // Relaxed: see `map_slot`.
        let slot = u32::try_from(slot).expect("the cache map has at most 2^32 slots");
        self.keys
            .map_slot
            .store(slot, std::sync::atomic::Ordering::Relaxed);
    }

    /// Writes the key slots of a block this caller is caching (`begin_caching` returned its
    /// generation), before its cache map entry is inserted: a reader that finds the entry
    /// then reads this key (`cache_map`).
    pub(crate) fn write_pending_key(&self, key: CacheKey) {
        debug_assert!(self.load().is_pending(), "only while caching");
        self.write_key(key);
    }

    fn write_key(&self, key: CacheKey) {
        // Release: see `key`.
        self.keys.key_group.store(key.group, Ordering::Release);
        self.keys
            .key_hash_high
            .store((key.hash.0 >> 64) as u64, Ordering::Release);
        self.keys
            .key_hash_low
            .store(key.hash.0 as u64, Ordering::Release);
    }

    fn compare_exchange(&self, current: State, new: State) -> Result<State, State> {
        // AcqRel on success: acquire what the previous owner released (key slots, the caller's
        // writes to the block), release ours to the next. Acquire on failure: the retry reads a
        // fresh snapshot with the same guarantees as `load`.
        self.state
            .compare_exchange(current.0, new.0, Ordering::AcqRel, Ordering::Acquire)
            .map(State)
            .map_err(State)
    }

    /// Claims the block for allocation if the popped entry `(block, generation)` is valid.
    pub(crate) fn claim(&self, generation: u64) -> Claim {
        let mut current = self.load();
        loop {
            if !current.is_free_with(generation) {
                return Claim::Stale;
            }
            let claimed = State(1).with_generation(current.generation().wrapping_add(1));
            match self.compare_exchange(current, claimed) {
                Ok(_) => {
                    return Claim::Claimed {
                        was_cached: current.is_cached(),
                    }
                }
                // Only the cached bit of a still-valid entry can change under us (a reset);
                // anything else makes the entry stale, which the next iteration sees.
                Err(actual) => current = actual,
            }
        }
    }

    /// Takes one reference if the block holds `key`. When the block is free, `reserve` must
    /// grant one unit of the free count before the block leaves the queue (`unreserve` returns it
    /// if the CAS then fails).
    pub(crate) fn touch(
        &self,
        key: CacheKey,
        mut reserve: impl FnMut() -> bool,
        mut unreserve: impl FnMut(),
    ) -> Touch {
        let mut current = self.load();
        loop {
            if !current.is_cached() || current.ref_count() == MAX_REF_COUNT {
                return Touch::Miss;
            }
            // The key is read after the snapshot and validated by the CAS from that snapshot: if
            // the slots held a newer key, the Acquire loads in `key` make the generation bump that
            // preceded its writing visible to us, so the CAS below fails.
            if self.key() != key {
                return Touch::Miss;
            }
            let was_free = current.ref_count() == 0;
            if was_free && !reserve() {
                return Touch::Miss;
            }
            let touched = if was_free {
                State(current.0 + 1).next_generation()
            } else {
                State(current.0 + 1)
            };
            match self.compare_exchange(current, touched) {
                Ok(_) => return Touch::Taken { was_free },
                Err(actual) => {
                    if was_free {
                        unreserve();
                    }
                    current = actual;
                }
            }
        }
    }

    /// Takes a free block that holds `key` for the caller alone: `(0, g, 1, 0) -> (1, g+1, 0, 0)`,
    /// as a claim would, so its queue entry goes stale and the caller must drop its map entry.
    /// `reserve` must grant the unit of the free count the block leaves with (`unreserve` returns
    /// it if the CAS then fails). False when the block is held, holds another key or is not
    /// cached, or the reservation is refused.
    pub(crate) fn take(
        &self,
        key: CacheKey,
        mut reserve: impl FnMut() -> bool,
        mut unreserve: impl FnMut(),
    ) -> bool {
        let mut current = self.load();
        loop {
            if !current.is_cached() || current.ref_count() != 0 {
                return false;
            }
            // Same argument as in `touch`: a key newer than the snapshot fails the CAS.
            if self.key() != key || !reserve() {
                return false;
            }
            let taken = State(1).with_generation(current.generation().wrapping_add(1));
            match self.compare_exchange(current, taken) {
                Ok(_) => return true,
                Err(actual) => {
                    unreserve();
                    current = actual;
                }
            }
        }
    }

    /// Drops one reference.
    pub(crate) fn release(&self) -> Release {
        let mut current = self.load();
        loop {
            if current.ref_count() == 0 {
                return Release::NotHeld;
            }
            let released = State(current.0 - 1);
            match self.compare_exchange(current, released) {
                Ok(_) if released.ref_count() == 0 => {
                    return Release::NowFree {
                        generation: released.generation(),
                        cached: released.is_cached(),
                    }
                }
                Ok(_) => return Release::StillHeld,
                Err(actual) => current = actual,
            }
        }
    }

    /// Takes ownership of the key slots of a held, uncached block. Returns the generation to hand
    /// to [`BlockSlot::finish_caching`], or `None` when the block is free, already cached or
    /// being cached.
    pub(crate) fn begin_caching(&self) -> Result<Option<u64>, NotHeld> {
        let mut current = self.load();
        loop {
            if current.ref_count() == 0 {
                return Err(NotHeld);
            }
            if current.is_cached() || current.is_pending() {
                return Ok(None);
            }
            match self.compare_exchange(current, State(current.0 | PENDING)) {
                Ok(_) => return Ok(Some(current.generation())),
                Err(actual) => current = actual,
            }
        }
    }

    /// The word of a block its caller holds alone (reference count 1, neither cached nor being
    /// cached), for `cache_alone`; `None` for any other block. Nobody else can change that
    /// word until the caller does: a touch or a take needs the cached bit, a claim a free
    /// block, and a release or a `begin_caching` a second holder.
    pub(crate) fn held_alone(&self) -> Option<State> {
        let current = self.load();
        (current.ref_count() == 1 && !current.is_cached() && !current.is_pending())
            .then_some(current)
    }

    /// Writes the key slots of a block whose word `held_alone` returned (its sole holder,
    /// before the block's cache map entry is inserted): no pending bit is needed, since no
    /// other caller can cache it and every reader of the slots needs the cached bit first.
    pub(crate) fn write_key_alone(&self, key: CacheKey) {
        self.write_key(key);
    }

    /// Publishes the key written by `write_key_alone` by one CAS from `alone` (the word
    /// `held_alone` returned) to the same word with the cached bit. False when the word
    /// changed since, which only a caller breaking the holding contract can cause.
    pub(crate) fn publish_alone(&self, alone: State) -> bool {
        self.compare_exchange(alone, State(alone.0 | CACHED))
            .is_ok()
    }

    /// Writes `key` and publishes it by setting the cached bit. Returns false (and clears
    /// `pending` only if still ours) when the block was freed and reused since
    /// `begin_caching`, which only a caller that freed a block it was caching can cause.
    pub(crate) fn finish_caching(&self, generation: u64, key: CacheKey) -> bool {
        self.write_key(key);
        let mut current = self.load();
        loop {
            if current.generation() != generation || !current.is_pending() {
                return false;
            }
            let cached = State((current.0 & !PENDING) | CACHED);
            match self.compare_exchange(current, cached) {
                Ok(_) => return true,
                Err(actual) => current = actual,
            }
        }
    }

    /// Gives up the key slots taken by `begin_caching` (the key was already cached elsewhere).
    pub(crate) fn abort_caching(&self, generation: u64) {
        let mut current = self.load();
        while current.generation() == generation && current.is_pending() {
            match self.compare_exchange(current, State(current.0 & !PENDING)) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }

    /// Clears the cached bit of a free block. Returns the key it held, or `None` if the block
    /// was not free and cached.
    pub(crate) fn forget_key(&self) -> Option<CacheKey> {
        let mut current = self.load();
        loop {
            if current.ref_count() != 0 || !current.is_cached() {
                return None;
            }
            // Read before the CAS: once the bit is clear a claimer may rewrite the slots. The
            // CAS from this exact snapshot validates the read (same argument as `touch`).
            let key = self.key();
            match self.compare_exchange(current, State(current.0 & !CACHED)) {
                Ok(_) => return Some(key),
                Err(actual) => current = actual,
            }
        }
    }
}

/// `begin_caching` on a block nobody holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NotHeld;

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn key(hash: u128) -> CacheKey {
        CacheKey {
            group: 3,
            hash: BlockHash(hash),
        }
    }

    #[test]
    fn generation_wraps_within_its_field() {
        let state = State::INITIAL.with_generation(GENERATION_MASK);
        assert_eq!(state.next_generation().generation(), 0);
        assert_eq!(state.next_generation().ref_count(), 0);
        assert!(!state.next_generation().is_cached());
    }

    #[test]
    fn claim_touch_release_cycle() {
        let slots = BlockSlots::new(2);
        let slot = slots.slot(1);
        assert_eq!(slot.claim(0), Claim::Claimed { was_cached: false });
        assert_eq!(slot.claim(0), Claim::Stale);
        let generation = slot.begin_caching().unwrap().unwrap();
        assert_eq!(slot.begin_caching(), Ok(None));
        assert!(slot.finish_caching(generation, key(u128::MAX - 5)));
        assert_eq!(slot.key(), key(u128::MAX - 5));
        assert_eq!(
            slot.release(),
            Release::NowFree {
                generation: 1,
                cached: true
            }
        );
        assert_eq!(slot.release(), Release::NotHeld);
        assert_eq!(slot.touch(key(7), || true, || ()), Touch::Miss);
        assert_eq!(
            slot.touch(key(u128::MAX - 5), || true, || ()),
            Touch::Taken { was_free: true }
        );
        // The queued entry (block, 1) is stale now.
        assert_eq!(slot.claim(1), Claim::Stale);
        assert_eq!(
            slot.release(),
            Release::NowFree {
                generation: 2,
                cached: true
            }
        );
        assert_eq!(slot.claim(2), Claim::Claimed { was_cached: true });
        assert!(!slot.load().is_cached());
    }

    #[test]
    fn touch_of_free_block_needs_a_reservation() {
        let slots = BlockSlots::new(2);
        let slot = slots.slot(1);
        slot.claim(0);
        let generation = slot.begin_caching().unwrap().unwrap();
        assert!(slot.finish_caching(generation, key(1)));
        slot.release();
        assert_eq!(slot.touch(key(1), || false, || ()), Touch::Miss);
        assert_eq!(slot.load().ref_count(), 0);
    }
}
