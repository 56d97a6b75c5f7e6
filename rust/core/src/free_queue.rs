//! The LRU free queue: a lock-free FIFO of `(block, generation)` entries with lazy deletion, and
//! a counter of the free blocks that may be handed out.
//!
//! # Algorithm
//!
//! - Releasing a block's last reference pushes `(block, generation)` at the tail, *then*
//!   increments `num_countable` (Release). Pushing first means every counted unit has its entry
//!   already in the FIFO.
//! - Allocating `count` blocks first reserves `count` units from `num_countable` by CAS (all or
//!   nothing: this is what makes `get_new_blocks` atomic with respect to capacity), then pops
//!   entries from the head, skipping stale ones (see `block_state`), until it has claimed
//!   `count` valid ones.
//! - Touching a free cached block removes it from the middle *logically*: it reserves one unit
//!   (failing that, the touch is a miss) and bumps the block's generation, which turns its entry
//!   stale in place.
//!
//! # Invariant: reservations are always backed
//!
//! At every moment `num_countable + outstanding reservations <= valid entries` (valid entries
//! counted whether in the FIFO or popped by an allocator that has not yet claimed them). A push
//! adds a valid entry before its unit; a claim or a touch consumes a reservation together with
//! one valid entry (a touch racing with the release it follows may consume a unit whose entry is
//! then pushed stale: the release's own unit restores the balance). Hence a thread holding a
//! reservation always finds a valid entry in the FIFO: pops never wait on an empty queue except
//! for the instant between another thread's push and that entry becoming visible, for which
//! [`FreeQueue::pop`] retries.
//!
//! # Stale entries
//!
//! Only a touch of a free block creates a stale entry (one per such touch); it is reclaimed
//! when it reaches the head and an allocator pops it. Between allocations the FIFO therefore holds at most
//! `free blocks + touches of free blocks since the head last passed`: a workload that hits in
//! the cache without ever allocating grows the queue by 16 bytes per hit until the next
//! allocation sweeps past them. Generation wrap-around needs 2^38 queued entries, see
//! `block_state`.
//!
//! # Backends
//!
//! The std build uses `crossbeam_queue::SegQueue` (lock-free, unbounded, linearizable). Under
//! loom a `loom::sync::Mutex<VecDeque>` stands in: the models check the state-word and counter
//! protocol around a linearizable FIFO, which is exactly what `SegQueue` provides.

use crate::primitive::{spin_wait, AtomicUsize, Ordering};
use crate::types::BlockId;

/// A free-queue entry: valid iff `block`'s state word has ref count 0 and this generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) block: BlockId,
    pub(crate) generation: u64,
}

#[cfg(not(loom))]
#[derive(Debug, Default)]
struct Fifo(crossbeam_queue::SegQueue<Entry>);

#[cfg(not(loom))]
impl Fifo {
    fn push(&self, entry: Entry) {
        self.0.push(entry);
    }

    fn pop(&self) -> Option<Entry> {
        self.0.pop()
    }
}

#[cfg(loom)]
#[derive(Debug, Default)]
struct Fifo(crate::primitive::Mutex<std::collections::VecDeque<Entry>>);

#[cfg(loom)]
impl Fifo {
    fn push(&self, entry: Entry) {
        self.0.lock().unwrap().push_back(entry);
    }

    fn pop(&self) -> Option<Entry> {
        self.0.lock().unwrap().pop_front()
    }
}

/// The FIFO plus the count of blocks allocators may reserve. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct FreeQueue {
    /// Entries in release order; valid ones are the free blocks in eviction order.
    fifo: Fifo,
    /// Free blocks not reserved by anyone; never more than the valid entries (module docs).
    num_countable: AtomicUsize,
}

impl FreeQueue {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Queues a block whose last reference was just released, and makes it countable.
    pub(crate) fn push(&self, entry: Entry) {
        self.fifo.push(entry);
        // Release: a reserver that sees this unit (Acquire) also sees the entry pushed above.
        self.num_countable.fetch_add(1, Ordering::Release);
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

    /// Pops the head entry. Only called by a thread holding a reservation, for which the module
    /// invariant guarantees an entry is (about to be) there.
    pub(crate) fn pop(&self) -> Entry {
        loop {
            if let Some(entry) = self.fifo.pop() {
                return entry;
            }
            spin_wait();
        }
    }

    /// Free blocks that may be reserved now.
    pub(crate) fn num_countable(&self) -> usize {
        self.num_countable.load(Ordering::Acquire)
    }

    /// The queued entries that `is_valid` accepts, in FIFO order. Stale entries are kept in the
    /// queue (dropping them here would hide from the tests the state the hot path really works
    /// on). Drains and re-pushes the FIFO, so it is meant for a quiescent pool (tests,
    /// debugging): concurrent pushes would interleave with the re-pushed entries, and a
    /// concurrent allocator waits until they are back.
    pub(crate) fn valid_entries(&self, mut is_valid: impl FnMut(Entry) -> bool) -> Vec<Entry> {
        let mut drained = Vec::new();
        while let Some(entry) = self.fifo.pop() {
            drained.push(entry);
        }
        for &entry in &drained {
            self.fifo.push(entry);
        }
        drained.retain(|&entry| is_valid(entry));
        drained
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_all_or_nothing() {
        let queue = FreeQueue::new();
        for block in 1..=3 {
            queue.push(Entry {
                block,
                generation: 0,
            });
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
}
