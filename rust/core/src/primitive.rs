//! Concurrency primitives shim: one source, two backends.
//!
//! Under `--cfg loom` every atomic, lock and yield used by the lock-free pool comes from `loom`,
//! so loom can explore the interleavings of the real code; otherwise they come from `std`. Only
//! the pool's own synchronisation goes through this module: the rest of the crate (e.g.
//! `MutexPool`) keeps using `std` directly, which loom does not need to see.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Mutex;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Backs off inside a retry loop that waits for another thread's progress. Under loom this must
/// yield, or the model checker would explore an unbounded spin.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
