//! Concurrency primitives shim: one source, two backends.
//!
//! Under `--cfg loom` every atomic, lock and yield used by the lock-free pool comes from `loom`,
//! so loom can explore the interleavings of the real code; otherwise they come from `std`. Only
//! the pool's own synchronisation goes through this module: the rest of the crate (e.g.
//! `MutexPool`) keeps using `std` directly, which loom does not need to see.

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Mutex;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// `std`'s `UnsafeCell` with loom's access API (`with`, `with_mut`), so that code written for
/// loom's cell, which checks every access for a race, compiles to plain pointer use here.
#[cfg(not(loom))]
#[derive(Debug, Default)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(value))
    }

    /// Runs `f` on a pointer to the value (reading it is the caller's `unsafe` promise).
    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Runs `f` on a mutable pointer to the value (writing it is the caller's promise).
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Backs off inside a retry loop that waits for another thread's progress. Under loom this must
/// yield, or the model checker would explore an unbounded spin.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Asks the CPU to start loading the cache line holding `item` (a hint: nothing is read, no
/// fault is possible). A no-op off x86-64 and under Miri.
#[inline(always)]
pub(crate) fn prefetch<T>(item: &T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: a prefetch reads nothing and cannot fault; `item` is a valid reference anyway.
    #[allow(unused_unsafe)] // a safe function on newer compilers
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((item as *const T).cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = item;
}
