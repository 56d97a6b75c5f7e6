//! A bounded lock-free FIFO of free-queue entries that pushes and pops in batches: one CAS on a
//! position counter per batch, then per entry one plain write or read and one release store.
//!
//! # Algorithm
//!
//! An array of `capacity` slots; `head` and `tail` count positions without wrapping (position
//! `p` lives in slot `p % capacity`, one division per batch), and each slot has a sequence word
//! saying where it stands for the position `p` it serves now:
//!
//! - `p`: empty, ready for the push at `p`;
//! - `p + 1`: holds the entry pushed at `p`, ready for the pop at `p`;
//! - `p + capacity`: popped, ready for the push at `p + capacity` (the next lap).
//!
//! A push of up to `n` entries reads `tail`, counts the slots from there that are ready for their
//! push (stopping at the first one that is not), claims them by moving `tail` past them with one
//! CAS, then writes each entry and publishes it by storing `p + 1` (Release). A pop claims the
//! ready-to-pop slots from `head` the same way, reads them, and frees each by storing
//! `p + capacity` (Release). A slot seen ready stays ready until its position is claimed, and
//! claiming a position means moving the counter past it, which makes a CAS from an older value
//! fail: so when the CAS succeeds every slot counted is still ready and now belongs to the
//! claimer alone. The Acquire loads of the sequence words pair with those Release stores, so a
//! popper reads the entry its pusher wrote, and a pusher writes a slot only after its last
//! popper read it. This is Dmitry Vyukov's bounded MPMC queue, with batches.
//!
//! # Progress and fullness
//!
//! A pop reaching a position whose push is claimed but not yet published sees the ring empty
//! there, and a push reaching a slot whose pop is in flight sees it full: each waits only on a
//! thread in the middle of its few writes (the caller retries or goes elsewhere), the same
//! guarantee as `crossbeam_queue::SegQueue`, whose pop waits for a slot's write the same way.
//! A push into a full ring takes what fits and returns how many; the caller keeps the rest
//! (`free_queue` queues them behind the ring, in order).
//!
//! Sequence words are 32 bits: they are compared with positions modulo 2^32, exact for a
//! capacity below 2^31 (`MAX_CAPACITY`). A thread whose view of a counter is older than 2^32
//! positions may read a word that looks ready, but its CAS on the full-width counter then fails.
//! The counters themselves never wrap (2^64 pushes), so any capacity works, not only powers of
//! two.

use crate::free_queue::Entry;
use crate::primitive::{AtomicU32, AtomicUsize, Ordering, UnsafeCell};
use crate::types::BlockId;

/// The largest ring; a pool needing more keeps the excess behind it (module docs).
pub(crate) const MAX_CAPACITY: usize = 1 << 30;

/// One slot: its sequence word and the entry (a block id and its generation), 16 bytes.
#[derive(Debug)]
struct Slot {
    seq: AtomicU32,
    block: UnsafeCell<BlockId>,
    generation: UnsafeCell<u64>,
}

/// A position counter alone on its cache lines, so that pushers and poppers do not share one.
#[derive(Debug)]
#[repr(align(128))]
struct Counter(AtomicUsize);

/// The bounded FIFO (module docs).
#[derive(Debug)]
pub(crate) struct Ring {
    slots: Box<[Slot]>,
    head: Counter,
    tail: Counter,
}

// SAFETY: a slot's entry is written only by the thread whose CAS claimed its position for a
// push, and read only by the thread whose CAS claimed it for a pop; the sequence word hands the
// slot from one to the other with Release stores and Acquire loads (module docs).
unsafe impl Sync for Ring {}

impl Ring {
    /// An empty ring of `capacity` entries (clamped to 2..=`MAX_CAPACITY`).
    pub(crate) fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(2, MAX_CAPACITY);
        let slots = (0..capacity)
            .map(|position| Slot {
                seq: AtomicU32::new(position as u32),
                block: UnsafeCell::new(0),
                generation: UnsafeCell::new(0),
            })
            .collect();
        Ring {
            slots,
            head: Counter(AtomicUsize::new(0)),
            tail: Counter(AtomicUsize::new(0)),
        }
    }

    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// The slot index of `position`.
    fn index(&self, position: usize) -> usize {
        position % self.slots.len()
    }

    /// The slots of positions `start..start + count` (`count` at most the capacity), in order:
    /// a run up to the end of the array and the run wrapped to its start (often empty).
    fn runs(&self, start: usize, count: usize) -> (&[Slot], &[Slot]) {
        let index = self.index(start);
        let first = count.min(self.slots.len() - index);
        (
            &self.slots[index..index + first],
            &self.slots[..count - first],
        )
    }

    /// How many slots from `start` (at most `max`) have the sequence word `position + offset`:
    /// ready for their push (offset 0) or their pop (offset 1).
    fn ready_run(&self, start: usize, max: usize, offset: usize) -> usize {
        // A lap at most: a slot's word matches one position of it.
        let (run, wrapped) = self.runs(start, max.min(self.capacity()));
        let expected = start.wrapping_add(offset) as u32;
        let ready = count_ready(run, expected);
        if ready < run.len() {
            return ready;
        }
        ready + count_ready(wrapped, expected.wrapping_add(run.len() as u32))
    }

    /// Whether the slot of `position` is behind it: its sequence word, compared with
    /// `position + offset` modulo 2^32, is smaller (the previous lap is not done with it).
    fn behind(&self, position: usize, offset: usize) -> bool {
        let seq = self.slots[self.index(position)].seq.load(Ordering::Acquire);
        (seq.wrapping_sub(position.wrapping_add(offset) as u32) as i32) < 0
    }

    /// Claims with one CAS on `counter` up to `max` positions from it whose slots are ready
    /// (`offset` 0: for a push, 1: for a pop); returns the first one and how many, 0 when the
    /// slot at the counter is behind it (full for a push; empty, or its push still writing,
    /// for a pop).
    fn claim(&self, counter: &AtomicUsize, max: usize, offset: usize) -> (usize, usize) {
        // Relaxed: the CAS validates the position; the slots' words carry the ordering.
        let mut start = counter.load(Ordering::Relaxed);
        loop {
            let ready = self.ready_run(start, max, offset);
            if ready == 0 {
                if self.behind(start, offset) {
                    return (start, 0);
                }
                start = counter.load(Ordering::Relaxed); // another thread took `start`
                continue;
            }
            match counter.compare_exchange_weak(
                start,
                start.wrapping_add(ready),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return (start, ready),
                Err(actual) => start = actual,
            }
        }
    }

    /// Pushes the longest prefix of `entries` that fits, in order; returns its length (0 when
    /// the ring is full at its tail).
    pub(crate) fn push(&self, entries: &[Entry]) -> usize {
        if entries.is_empty() {
            return 0;
        }
        let (tail, ready) = self.claim(&self.tail.0, entries.len(), 0);
        let (run, wrapped) = self.runs(tail, ready);
        let (first, rest) = entries[..ready].split_at(run.len());
        write_entries(run, first, tail);
        write_entries(wrapped, rest, tail.wrapping_add(run.len()));
        ready
    }

    /// Pops up to `out.len()` entries in order into the front of `out`; returns how many (0 when
    /// the ring is empty at its head, or the push there is not published yet).
    pub(crate) fn pop(&self, out: &mut [Entry]) -> usize {
        if out.is_empty() {
            return 0;
        }
        let (head, ready) = self.claim(&self.head.0, out.len(), 1);
        let capacity = self.capacity();
        let (run, wrapped) = self.runs(head, ready);
        let (first, rest) = out[..ready].split_at_mut(run.len());
        read_entries(run, first, head.wrapping_add(capacity));
        read_entries(wrapped, rest, head.wrapping_add(run.len() + capacity));
        ready
    }

    /// Entries pushed and not popped (exact when no push or pop is in flight).
    pub(crate) fn len(&self) -> usize {
        let head = self.head.0.load(Ordering::Acquire);
        let tail = self.tail.0.load(Ordering::Acquire);
        tail.wrapping_sub(head).min(self.capacity())
    }
}

/// How many of `slots` from the first have the sequence words `expected`, `expected + 1`, ...
fn count_ready(slots: &[Slot], expected: u32) -> usize {
    // Acquire: for a pop, the entry written before the push's Release store; for a push, the
    // last pop's read of the slot happened before our write.
    (slots.iter().zip(0u32..))
        .take_while(|(slot, offset)| {
            slot.seq.load(Ordering::Acquire) == expected.wrapping_add(*offset)
        })
        .count()
}

/// Writes `entries` into `slots` (claimed for the pushes at positions `first_position`, ...)
/// and publishes each.
fn write_entries(slots: &[Slot], entries: &[Entry], first_position: usize) {
    for ((slot, entry), offset) in slots.iter().zip(entries).zip(0usize..) {
        // SAFETY: `claim` gave this push the position and its slot was ready (its last pop done
        // with it): nobody else touches the entry until the store below.
        unsafe {
            slot.block.with_mut(|block| *block = entry.block);
            slot.generation
                .with_mut(|generation| *generation = entry.generation);
        }
        // Release: the pop that sees this word (Acquire) sees the entry.
        let position = first_position.wrapping_add(offset);
        slot.seq
            .store(position.wrapping_add(1) as u32, Ordering::Release);
    }
}

/// Reads `slots` (claimed for the pops at positions `next_lap - capacity`, ...) into `out` and
/// frees each for the push a lap later (`next_lap`, ...).
fn read_entries(slots: &[Slot], out: &mut [Entry], next_lap: usize) {
    for ((slot, out), offset) in slots.iter().zip(out).zip(0usize..) {
        // SAFETY: `claim` gave this pop the position and its entry was published (Acquire in
        // `ready_run`): nobody else touches it until the store below.
        *out = unsafe {
            Entry {
                block: slot.block.with(|block| *block),
                generation: slot.generation.with(|generation| *generation),
            }
        };
        // Release: the push of the next lap writes only after this read.
        slot.seq
            .store(next_lap.wrapping_add(offset) as u32, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn entries(blocks: std::ops::Range<BlockId>) -> Vec<Entry> {
        blocks
            .map(|block| Entry {
                block,
                generation: u64::from(block) * 10,
            })
            .collect()
    }

    fn pop_all(ring: &Ring) -> Vec<Entry> {
        let mut out = vec![
            Entry {
                block: 0,
                generation: 0
            };
            ring.capacity()
        ];
        let popped = ring.pop(&mut out);
        out.truncate(popped);
        out
    }

    #[test]
    fn batches_come_out_in_order_across_laps() {
        let ring = Ring::new(5);
        assert_eq!(ring.capacity(), 5);
        let mut expected = Vec::new();
        let mut next = 1;
        for lap in 0..10 {
            let batch = entries(next..next + 3 + lap % 3);
            next += batch.len() as BlockId;
            assert_eq!(ring.push(&batch), batch.len());
            expected.extend(batch);
            let mut out = [Entry {
                block: 0,
                generation: 0,
            }; 4];
            let popped = ring.pop(&mut out);
            assert_eq!(popped, 4.min(expected.len()));
            assert_eq!(&out[..popped], &expected[..popped]);
            expected.drain(..popped);
            assert_eq!(ring.len(), expected.len());
        }
        assert_eq!(pop_all(&ring), expected);
        assert_eq!(ring.len(), 0);
    }

    #[test]
    fn a_full_ring_takes_what_fits_and_an_empty_one_gives_nothing() {
        let ring = Ring::new(4);
        assert_eq!(pop_all(&ring), vec![]);
        let batch = entries(1..7);
        assert_eq!(ring.push(&batch), 4, "four fit");
        assert_eq!(ring.push(&batch[4..]), 0, "full");
        let mut out = [Entry {
            block: 0,
            generation: 0,
        }; 1];
        assert_eq!(ring.pop(&mut out), 1);
        assert_eq!(out[0], batch[0]);
        assert_eq!(ring.push(&batch[4..]), 1, "one slot came free");
        assert_eq!(pop_all(&ring), vec![batch[1], batch[2], batch[3], batch[4]]);
    }

    #[test]
    fn concurrent_batches_lose_and_repeat_nothing() {
        // Cut down under Miri, whose threads run about a thousand times slower.
        const PER_THREAD: BlockId = if cfg!(miri) { 500 } else { 20_000 };
        let ring = Ring::new(64);
        let popped = std::sync::Mutex::new(Vec::new());
        let total = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for thread in 0..2 {
                let ring = &ring;
                scope.spawn(move || {
                    let all = entries(thread * PER_THREAD..(thread + 1) * PER_THREAD);
                    let mut rest = &all[..];
                    while !rest.is_empty() {
                        let pushed = ring.push(&rest[..rest.len().min(7)]);
                        rest = &rest[pushed..];
                        if pushed == 0 {
                            std::hint::spin_loop();
                        }
                    }
                });
            }
            for _ in 0..2 {
                let (ring, popped, total) = (&ring, &popped, &total);
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    let mut out = [Entry {
                        block: 0,
                        generation: 0,
                    }; 5];
                    while total.load(std::sync::atomic::Ordering::Relaxed) < 2 * PER_THREAD as usize
                    {
                        let count = ring.pop(&mut out);
                        mine.extend_from_slice(&out[..count]);
                        total.fetch_add(count, std::sync::atomic::Ordering::Relaxed);
                    }
                    popped.lock().unwrap().push(mine);
                });
            }
        });
        let popped = popped.into_inner().unwrap();
        for mine in &popped {
            // Each producer's entries come out in its order, whoever pops them.
            for producer in 0..2 {
                let theirs: Vec<BlockId> = mine
                    .iter()
                    .map(|e| e.block)
                    .filter(|b| b / PER_THREAD == producer)
                    .collect();
                assert!(theirs.windows(2).all(|w| w[0] < w[1]));
            }
        }
        let mut all: Vec<Entry> = popped.into_iter().flatten().collect();
        all.sort_by_key(|e| e.block);
        assert_eq!(all, entries(0..2 * PER_THREAD));
    }
}

/// Loom models of the ring alone (the pool's models in `tests/loom.rs` run it too, inside the
/// free queue): every interleaving of batched pushes and pops around a wrap and a full ring,
/// with loom's cells checking that no entry is read while it is written.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::thread;

    fn entry(block: BlockId) -> Entry {
        Entry {
            block,
            generation: u64::from(block) + 100,
        }
    }

    fn drain(ring: &Ring) -> Vec<Entry> {
        let mut out = vec![Entry::default(); ring.capacity()];
        let count = ring.pop(&mut out);
        out.truncate(count);
        out
    }

    #[test]
    fn a_batch_push_races_a_batch_pop_across_the_wrap() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            // Head and tail at 1: the batch below fills slot 1 and then wraps to slot 0.
            assert_eq!(ring.push(&[entry(1)]), 1);
            assert_eq!(drain(&ring), vec![entry(1)]);
            let pusher = {
                let ring = ring.clone();
                thread::spawn(move || ring.push(&[entry(2), entry(3)]))
            };
            let mut out = [Entry::default(); 2];
            let popped = ring.pop(&mut out);
            assert_eq!(pusher.join().unwrap(), 2, "an empty ring takes both");
            let mut seen = out[..popped].to_vec();
            seen.extend(drain(&ring));
            assert_eq!(seen, vec![entry(2), entry(3)], "in order, once each");
        });
    }

    #[test]
    fn two_pushers_race_a_pop_for_the_last_slot() {
        loom::model(|| {
            let ring = Arc::new(Ring::new(2));
            assert_eq!(ring.push(&[entry(1)]), 1);
            let pushers: Vec<_> = [2, 3]
                .into_iter()
                .map(|block| {
                    let ring = ring.clone();
                    thread::spawn(move || ring.push(&[entry(block)]) == 1)
                })
                .collect();
            let mut out = [Entry::default(); 1];
            let popped = ring.pop(&mut out);
            let pushed: Vec<bool> = pushers.into_iter().map(|p| p.join().unwrap()).collect();
            assert!(pushed.iter().any(|&p| p), "one slot was free throughout");
            let mut seen = out[..popped].to_vec();
            seen.extend(drain(&ring));
            assert_eq!(seen[0], entry(1), "the oldest entry leaves first");
            let mut expected = vec![entry(1)];
            expected.extend(
                [2, 3]
                    .into_iter()
                    .zip(&pushed)
                    .filter(|(_, &p)| p)
                    .map(|(block, _)| entry(block)),
            );
            seen.sort_by_key(|e| e.block);
            assert_eq!(
                seen, expected,
                "what was pushed comes out once, nothing else"
            );
        });
    }
}
