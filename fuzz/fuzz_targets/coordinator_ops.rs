//! Fuzz target: arbitrary operation sequences over a `Coordinator` with 1-3 groups of mixed
//! attention types and a small pool, checking every invariant after each step. Each input runs
//! twice, over the lock-free `BlockPool` (the default) and over `MutexPool`: single-threaded,
//! both must keep the same contract, LRU order included; then once more with tail replay on
//! where the groups allow it (a replay's hit blocks, and no partial-window windowed block ever
//! handed out by a hit), and once with token tails on (hits ending inside a block where a freed
//! request's tokens ended). The harness (operations, reference model, invariants) lives in
//! `src/lib.rs`.
#![no_main]

use hybrid_cache_core::{BlockPool, MutexPool};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hybrid_cache_fuzz::run_ops(data, BlockPool::new);
    hybrid_cache_fuzz::run_ops(data, MutexPool::new);
    hybrid_cache_fuzz::run_replay_ops(data, BlockPool::new);
    hybrid_cache_fuzz::run_tail_ops(data, BlockPool::new);
});
