//! The LRU free queue: lock-free FIFOs of `(block, generation)` entries with lazy deletion, one
//! per eviction tier (keyless blocks, then `FreeTier::Low`, `Normal`, `High`), and a
//! counter of the free blocks that may be handed out.
//!
//! # Algorithm
//!
//! - Releasing a block's last reference pushes `(block, generation)` at the tail of its tier's
//!   FIFO, *then* increments `num_countable` (Release). Pushing first means every counted unit
//!   has its entry already in one of the FIFOs.
//! - Allocating `count` blocks first reserves `count` units from `num_countable` by CAS (all or
//!   nothing: this is what makes `get_new_blocks` atomic with respect to capacity), then pops
//!   entries from the head of the first non-empty FIFO in tier order, skipping stale ones (see
//!   `block_state`), until it has claimed `count` valid ones. The tiers only choose *which*
//!   valid entry a pop returns; the counting argument below is over all FIFOs together.
//! - Touching a free cached block removes it from the middle *logically*: it reserves one unit
//!   (failing that, the touch is a miss) and bumps the block's generation, which turns its entry
//!   stale in place.
//!
//! # Invariant: reservations are always backed
//!
//! At every moment `num_countable + outstanding reservations <= valid entries` (valid entries
//! counted over all FIFOs, whether queued or popped by an allocator that has not yet claimed them). A push
//! adds a valid entry before its unit; a claim or a touch consumes a reservation together with
//! one valid entry (a touch racing with the release it follows may consume a unit whose entry is
//! then pushed stale: the release's own unit restores the balance). Hence a thread holding a
//! reservation always finds a valid entry in some FIFO: pops never wait on empty queues except
//! for the instant between another thread's push and that entry becoming visible, for which
//! [`FreeQueue::pop`] retries (all FIFOs again, in tier order).
//!
//! # Stale entries and compaction
//!
//! Only a touch of a free block creates a stale entry (exactly one per such touch: the block's
//! entry, queued or about to be pushed by the release in flight). `num_stale` counts them: the
//! toucher adds one, whoever drops a stale entry subtracts one. Allocators drop the stale
//! entries they pop. So that a workload that hits in the cache without allocating cannot grow
//! the FIFO forever, the touch that lifts `num_stale` above `stale_limit` (the pool's block
//! count) *compacts*: one thread at a time (a try-flag; nobody waits for it) rotates each FIFO
//! once under a one-unit reservation, dropping stale entries and re-pushing valid ones at the
//! tail. Like an allocator, the compactor holds at most one popped entry at a time, so its one
//! unit keeps the invariant above and no allocator ever waits for it. With no concurrent pushes
//! a full rotation keeps the valid entries in the same order, so LRU order is unchanged;
//! concurrent releases may land between re-pushed entries (LRU order under concurrency is
//! approximate anyway). Each compaction walks at most about `2 * stale_limit` entries and drops
//! at least `stale_limit`, so it costs O(1) amortised per touch, and the FIFO stays within about
//! `free blocks + 2 * stale_limit` entries (plus what concurrent touches add meanwhile). The
//! price: while the compactor holds its unit, an allocation needing every last free block may be
//! refused; with no unit free there is nothing to compact safely and it is retried later.
//!
//! # Backends
//!
//! Each FIFO is a ring (`ring`: bounded, lock-free, one CAS per batch of pushes or pops) sized to
//! hold every free block, plus `stale_limit` stale entries in the tiers of keyed blocks, so that
//! one thread's FIFO always fits in it. What a full ring cannot take (concurrent touches piling up
//! stale entries faster than compaction drops them) waits behind it in an unbounded lock-free
//! `crossbeam_queue::SegQueue`: while that overflow holds entries, pushes go there too, and pops
//! take the ring first, so the order is kept. Under loom the rings are the real ones (loom checks
//! their atomics and cells) and a `loom::sync::Mutex<VecDeque>` stands in for the overflow.
//!
//! Memory: 16 bytes a slot, so 16 bytes per block for the keyless tier and 32 for each of the
//! three keyed tiers: 112 bytes per block (14 MiB at 131072 blocks), where the `SegQueue`s alone
//! took about 25 bytes per free block.

use crate::allocator::{FreeTier, NUM_FREE_QUEUES};
use crate::primitive::{spin_wait, AtomicBool, AtomicUsize, Ordering};
use crate::ring::Ring;
use crate::types::BlockId;

/// A free-queue entry: valid iff `block`'s state word has ref count 0 and this generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) block: BlockId,
    pub(crate) generation: u64,
}

/// One tier's FIFO: a ring (`ring`) taking batches, and behind it, in order, the entries that
/// did not fit (module docs, "Backends").
#[derive(Debug)]
struct Fifo {
    ring: Ring,
    overflow: Overflow,
}

impl Fifo {
    fn new(capacity: usize) -> Self {
        Fifo {
            ring: Ring::new(capacity),
            overflow: Overflow::default(),
        }
    }

    /// Queues `entries` at the tail, in order.
    fn push(&self, entries: &[Entry]) {
        // While the overflow holds entries, new ones queue behind them: the ring's entries are
        // always the older ones, so popping the ring first keeps the order.
        let pushed = if self.overflow.is_empty() {
            self.ring.push(entries)
        } else {
            0
        };
        for &entry in &entries[pushed..] {
            self.overflow.push(entry);
        }
    }

    /// Pops up to `out.len()` entries from the head into `out`; returns how many.
    fn pop(&self, out: &mut [Entry]) -> usize {
        let popped = self.ring.pop(out);
        if popped > 0 {
            return popped;
        }
        let mut popped = 0;
        while popped < out.len() {
            match self.overflow.pop() {
                Some(entry) => out[popped] = entry,
                None => break,
            }
            popped += 1;
        }
        popped
    }

    fn pop_one(&self) -> Option<Entry> {
        let mut out = [Entry::default()];
        (self.pop(&mut out) == 1).then_some(out[0])
    }

    fn len(&self) -> usize {
        self.ring.len() + self.overflow.len()
    }
}

#[cfg(not(loom))]
type Overflow = crossbeam_queue::SegQueue<Entry>;

/// Under loom a locked deque stands in for `SegQueue` (module docs, "Backends").
#[cfg(loom)]
#[derive(Debug, Default)]
struct Overflow(crate::primitive::Mutex<std::collections::VecDeque<Entry>>);

#[cfg(loom)]
impl Overflow {
    fn push(&self, entry: Entry) {
        self.0.lock().unwrap().push_back(entry);
    }

    fn pop(&self) -> Option<Entry> {
        self.0.lock().unwrap().pop_front()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap().is_empty()
    }
}

/// The FIFOs plus the count of blocks allocators may reserve. See the module docs.
#[derive(Debug)]
pub(crate) struct FreeQueue {
    /// Per tier (eviction order), entries in release order; the valid ones of all tiers, tier by
    /// tier, are the free blocks in eviction order.
    fifos: [Fifo; NUM_FREE_QUEUES],
    /// Free blocks not reserved by anyone; never more than the valid entries (module docs).
    num_countable: AtomicUsize,
    /// Stale entries in the FIFO (or about to be pushed), as a wrapping count: a drop may be
    /// counted before the touch that made the entry stale, so read it as `isize`.
    num_stale: AtomicUsize,
    /// Set while one thread compacts; others skip compaction instead of waiting.
    compacting: AtomicBool,
    /// Compaction starts when `num_stale` exceeds this (at least 1).
    stale_limit: usize,
}

impl FreeQueue {
    /// An empty queue for a pool of `num_blocks` blocks: it compacts once more stale entries
    /// than that pile up, and its rings hold every free block, plus that many stale entries in
    /// the tiers of keyed blocks (the only ones a touch can leave stale).
    pub(crate) fn new(num_blocks: usize) -> Self {
        let stale_limit = num_blocks.max(1);
        FreeQueue {
            fifos: std::array::from_fn(|queue| {
                Fifo::new(if queue == FreeTier::Normal.queue(false) {
                    num_blocks
                } else {
                    // The touch past the limit pushes its stale entry before compacting.
                    num_blocks + stale_limit + 1
                })
            }),
            num_countable: AtomicUsize::new(0),
            num_stale: AtomicUsize::new(0),
            compacting: AtomicBool::new(false),
            stale_limit,
        }
    }

    /// Queues a block whose last reference was just released at the tail of FIFO `queue`
    /// (`FreeTier::queue`), and makes it countable.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn push(&self, entry: Entry, queue: usize) {
        self.fifos[queue].push(std::slice::from_ref(&entry));
        // Release: a reserver that sees this unit (Acquire) also sees the entry pushed above.
        self.num_countable.fetch_add(1, Ordering::Release);
    }

    /// Queues entries, in order, without making them countable yet: the caller adds their
    /// units with [`FreeQueue::count_pushed`] once it has pushed them all (one counter update
    /// per release).
    pub(crate) fn push_uncounted(&self, entries: &[Entry], queue: usize) {
        self.fifos[queue].push(entries);
    }

    /// Makes `count` entries pushed by [`FreeQueue::push_uncounted`] countable.
    pub(crate) fn count_pushed(&self, count: usize) {
        if count > 0 {
            // Release: a reserver that sees these units (Acquire) also sees their entries.
            self.num_countable.fetch_add(count, Ordering::Release);
        }
    }

    /// Reserves `count` units, all or nothing. On refusal returns how many were countable.
    pub(crate) fn try_reserve(&self, count: usize) -> Result<(), usize> {
        // Relaxed for the first read: the CAS below re-validates it.
        let mut available = self.num_countable.load(Ordering::Relaxed);
        loop {
            if available < count {
                return Err(available);
            }
            // Acquire on success: pairs with the Release in `push`, so the entries backing the
            // units we take are visible to our pops.
            match self.num_countable.compare_exchange_weak(
                available,
                available - count,
                Ordering::Acquire,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => available = actual,
            }
        }
    }

    /// Returns units reserved but not consumed (their valid entries are still queued).
    pub(crate) fn unreserve(&self, count: usize) {
        // Release: same role as in `push` for the entries backing these units.
        self.num_countable.fetch_add(count, Ordering::Release);
    }

    /// Pops from the head of the first non-empty FIFO in tier order up to `out.len()` entries
    /// (at least one) into `out`; returns how many. Only called by a thread holding at least
    /// `out.len()` reserved units, for which the module invariant guarantees an entry is (about
    /// to be) in one of them; every valid entry popped is then one the caller claims.
    pub(crate) fn pop_into(&self, out: &mut [Entry]) -> usize {
        debug_assert!(!out.is_empty());
        loop {
            for fifo in &self.fifos {
                let popped = fifo.pop(out);
                if popped > 0 {
                    return popped;
                }
            }
            spin_wait();
        }
    }

    /// [`FreeQueue::pop_into`] of one entry.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn pop(&self) -> Entry {
        let mut out = [Entry::default()];
        self.pop_into(&mut out);
        out[0]
    }

    /// Records that an allocator popped and dropped a stale entry.
    pub(crate) fn dropped_stale(&self) {
        // Relaxed: a heuristic trigger, no data is published through it.
        self.num_stale.fetch_sub(1, Ordering::Relaxed);
    }

    /// Records that a touch made one entry stale, compacting the FIFO when too many piled up.
    /// `is_valid` tells valid entries from stale ones.
    pub(crate) fn made_stale(&self, is_valid: impl Fn(Entry) -> bool) {
        // Relaxed: as in `dropped_stale`.
        let stale = self
            .num_stale
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        if (stale as isize) > self.stale_limit as isize {
            self.compact(is_valid);
        }
    }

    /// Rotates the FIFO once, dropping stale entries (see the module docs).
    fn compact(&self, is_valid: impl Fn(Entry) -> bool) {
        // Acquire: pairs with the Release that ended the previous compaction (not needed for the
        // queue's own safety, which never relies on the flag; it only keeps one compactor).
        if self
            .compacting
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        // One unit for the whole rotation: like an allocator, the compactor holds at most one
        // popped entry at a time, so one reservation keeps every other reserver's entries in the
        // FIFO (module invariant). No unit free: nothing to compact safely now, try later.
        if self.try_reserve(1).is_ok() {
            for fifo in &self.fifos {
                for _ in 0..fifo.len() {
                    let Some(entry) = fifo.pop_one() else {
                        break;
                    };
                    if is_valid(entry) {
                        fifo.push(std::slice::from_ref(&entry));
                    } else {
                        self.dropped_stale();
                    }
                }
            }
            self.unreserve(1);
        }
        // Release: see the Acquire above.
        self.compacting.store(false, Ordering::Release);
    }

    /// Queued entries of all FIFOs, stale ones included (tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.fifos.iter().map(Fifo::len).sum()
    }

    /// Free blocks that may be reserved now.
    pub(crate) fn num_countable(&self) -> usize {
        self.num_countable.load(Ordering::Acquire)
    }

    /// The queued entries that `is_valid` accepts, in eviction order (FIFO by FIFO in tier
    /// order). Stale entries are kept in the queue (dropping them here would hide from the tests the state the hot path really works
    /// on). Drains and re-pushes the FIFO, so it is meant for a quiescent pool (tests,
    /// debugging): concurrent pushes would interleave with the re-pushed entries, and a
    /// concurrent allocator waits until they are back.
    pub(crate) fn valid_entries(&self, mut is_valid: impl FnMut(Entry) -> bool) -> Vec<Entry> {
        let mut valid = Vec::new();
        for fifo in &self.fifos {
            let mut drained = Vec::new();
            while let Some(entry) = fifo.pop_one() {
                drained.push(entry);
            }
            fifo.push(&drained);
            valid.extend(drained.into_iter().filter(|&entry| is_valid(entry)));
        }
        valid
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_all_or_nothing() {
        let queue = FreeQueue::new(8);
        for block in 1..=3 {
            queue.push(
                Entry {
                    block,
                    generation: 0,
                },
                2,
            );
        }
        assert_eq!(queue.try_reserve(4), Err(3));
        assert_eq!(queue.try_reserve(2), Ok(()));
        assert_eq!(queue.num_countable(), 1);
        assert_eq!(queue.pop().block, 1);
        queue.unreserve(1);
        assert_eq!(queue.num_countable(), 2);
        let kept = queue.valid_entries(|entry| entry.block != 2);
        assert_eq!(kept.iter().map(|e| e.block).collect::<Vec<_>>(), vec![3]);
        assert_eq!(queue.pop().block, 2, "invalid entries stay queued");
        assert_eq!(queue.pop().block, 3);
    }

    #[test]
    fn compaction_drops_stale_entries_and_keeps_order() {
        let queue = FreeQueue::new(2);
        for block in 1..=6 {
            queue.push(
                Entry {
                    block,
                    generation: 0,
                },
                2,
            );
        }
        // Blocks 2, 4 and 5 were touched: their entries are stale.
        let valid = |entry: Entry| ![2, 4, 5].contains(&entry.block);
        queue.made_stale(valid);
        queue.made_stale(valid);
        assert_eq!(queue.len(), 6, "at the limit: no compaction yet");
        queue.made_stale(valid);
        assert_eq!(queue.len(), 3);
        assert_eq!(
            queue.num_countable(),
            6,
            "compaction returns every unit it took"
        );
        let order: Vec<BlockId> = queue
            .valid_entries(|_| true)
            .iter()
            .map(|e| e.block)
            .collect();
        assert_eq!(order, vec![1, 3, 6]);
    }

    #[test]
    fn entries_past_a_full_ring_wait_behind_it_in_order() {
        let queue = FreeQueue::new(2); // the keyless ring holds 2
        let entry = |block| Entry {
            block,
            generation: 0,
        };
        let fifo = &queue.fifos[0];
        let batch: Vec<Entry> = (1..=5).map(entry).collect();
        queue.push_uncounted(&batch, 0);
        queue.count_pushed(5);
        assert_eq!((fifo.ring.len(), fifo.overflow.len()), (2, 3));
        assert_eq!(queue.try_reserve(3), Ok(()));
        let mut out = [Entry::default(); 3];
        assert_eq!(queue.pop_into(&mut out), 2, "the ring first, as one batch");
        assert_eq!(&out[..2], &[entry(1), entry(2)]);
        queue.push(entry(6), 0);
        assert_eq!(fifo.ring.len(), 0, "behind the overflow, not in the ring");
        assert_eq!(queue.pop_into(&mut out[..1]), 1);
        assert_eq!(out[0], entry(3));
        assert_eq!(queue.try_reserve(3), Ok(()));
        let rest: Vec<BlockId> = (0..3).map(|_| queue.pop().block).collect();
        assert_eq!(rest, vec![4, 5, 6]);
        queue.push(entry(7), 0);
        assert_eq!(
            (fifo.ring.len(), fifo.overflow.len()),
            (1, 0),
            "the ring again once the overflow is empty"
        );
    }

    #[test]
    fn concurrent_batches_through_a_small_ring_and_its_overflow_lose_nothing() {
        // A ring of 8 for 4 threads pushing batches of up to 5 and popping under reservations:
        // pushes spill into the overflow and come back; every entry is popped exactly once.
        // Cut down under Miri, whose threads run about a thousand times slower.
        const PER_THREAD: u32 = if cfg!(miri) { 200 } else { 5_000 };
        let queue = FreeQueue::new(8);
        // The threads start with the overflow holding entries: 8 in the ring, 12 behind it.
        let head: Vec<Entry> = (4 * PER_THREAD..4 * PER_THREAD + 20)
            .map(|block| Entry {
                block,
                generation: 0,
            })
            .collect();
        queue.push_uncounted(&head, 0);
        queue.count_pushed(head.len());
        assert_eq!(queue.fifos[0].overflow.len(), 12);
        let popped = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for thread in 0..4u32 {
                let (queue, popped) = (&queue, &popped);
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    let mut out = [Entry::default(); 4];
                    let blocks: Vec<Entry> = (0..PER_THREAD)
                        .map(|i| Entry {
                            block: thread * PER_THREAD + i,
                            generation: u64::from(i),
                        })
                        .collect();
                    for batch in blocks.chunks(1 + thread as usize) {
                        queue.push_uncounted(batch, 0);
                        queue.count_pushed(batch.len());
                        let want = 1 + (batch[0].block % 4) as usize;
                        if queue.try_reserve(want).is_ok() {
                            let mut taken = 0;
                            while taken < want {
                                let count = queue.pop_into(&mut out[..want - taken]);
                                mine.extend_from_slice(&out[..count]);
                                taken += count;
                            }
                        }
                    }
                    popped.lock().unwrap().extend(mine);
                });
            }
        });
        let mut all = popped.into_inner().unwrap();
        let left = queue.num_countable();
        assert_eq!(queue.try_reserve(left), Ok(()));
        all.extend((0..left).map(|_| queue.pop()));
        all.sort_by_key(|e| e.block);
        let expected: Vec<BlockId> = (0..4 * PER_THREAD + 20).collect();
        assert_eq!(all.iter().map(|e| e.block).collect::<Vec<_>>(), expected);
        assert_eq!(queue.len(), 0);
    }

    #[test]
    fn pops_take_the_first_tier_first() {
        let queue = FreeQueue::new(8);
        let entry = |block| Entry {
            block,
            generation: 0,
        };
        queue.push(entry(1), 2);
        queue.push(entry(2), 1);
        queue.push(entry(3), 0);
        queue.push(entry(4), 2);
        queue.push(entry(5), 0);
        let order: Vec<BlockId> = queue
            .valid_entries(|_| true)
            .iter()
            .map(|e| e.block)
            .collect();
        assert_eq!(order, vec![3, 5, 2, 1, 4]);
        assert_eq!(queue.try_reserve(5), Ok(()));
        let popped: Vec<BlockId> = (0..5).map(|_| queue.pop().block).collect();
        assert_eq!(popped, order, "pops follow the eviction order");
    }
}
