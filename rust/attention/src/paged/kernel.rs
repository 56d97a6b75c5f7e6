//! One step of the kernel: a tile of up to `TILE` tokens of one kv head absorbed into the query
//! heads of its group (scores, online-softmax step, values). Behind a trait so the row driver
//! (`row.rs`) is written once and compiled per build: `portable::Portable` (loops in 8 lanes
//! that LLVM vectorises for any target) and `avx2::Avx2` (intrinsics).

use crate::paged::lanes;
use crate::paged::query::AttentionParams;
use crate::paged::softmax::Running;
use crate::paged::tile::Tile;

/// One build of the step.
///
/// # Safety (`step`)
/// With `caches = (keys, values)`: for every lane `j < TILE`, `tile.keys[j] + d <=
/// keys.len()` and `tile.values[j] + d <= values.len()`; and `queries` and `accs` hold
/// `running.len()` heads of `d` floats.
pub(crate) trait Kernel {
    /// The build's 8-lane vectors, for runs of prefill rows (`block.rs`).
    type Lanes: lanes::Lanes;

    /// Asks for the `len` floats from each offset to be brought into the cache: L1 when
    /// `NEAR`, else L2. A hint, with no effect on results (nothing is read, so it is safe
    /// for any offsets and `len`).
    fn prefetch<const NEAR: bool>(data: &[f32], offsets: &[usize], len: usize);

    /// Absorbs the tile into the query heads of one kv head (`running.len()` of them, with
    /// `queries` and `accs` of `d` floats each): scores `scale * q.k` (soft-capped), the
    /// online-softmax step on `running`, and `acc = acc * factor + sum of weight * value`.
    unsafe fn step(
        queries: &[f32],
        accs: &mut [f32],
        running: &mut [Running],
        caches: (&[f32], &[f32]),
        tile: &Tile,
        params: &AttentionParams<'_>,
        d: usize,
    );
}
