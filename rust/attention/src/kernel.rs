//! One step of the kernel: a tile of up to `TILE` tokens of one kv head absorbed into the query
//! heads of its group (scores, online-softmax step, values). Behind a trait so the row driver
//! (`row.rs`) is written once and compiled per build: `portable::Portable` (loops in 8 lanes
//! that LLVM vectorises for any target) and `avx2::Avx2` (intrinsics).

use crate::layout::AttentionParams;
use crate::softmax::Running;

/// Tokens per tile: a tile goes through one online-softmax step, so the horizontal max, the
/// rescale of the accumulator and the loop overheads are paid once per 16 keys.
pub(crate) const TILE: usize = 16;

/// The tokens of one tile: element offsets of each token's key and value for kv head 0.
/// Lanes `len..TILE` repeat the last real token, so a kernel may read all of them (never a
/// token the row cannot see) and discard the extra results.
pub(crate) struct Tile {
    pub keys: [usize; TILE],
    pub values: [usize; TILE],
    pub len: usize,
    /// 0 for the real lanes, -inf for the padding (added to the scores).
    pub padding: [f32; TILE],
}

/// Lane j of `PADDING[TILE - len..][..TILE]` is 0 for j < len, else -inf.
static PADDING: [f32; 2 * TILE] = {
    let mut table = [0.0; 2 * TILE];
    let mut j = TILE;
    while j < 2 * TILE {
        table[j] = f32::NEG_INFINITY;
        j += 1;
    }
    table
};

impl Tile {
    /// A tile of `keys.len()` (1 to `TILE`) tokens, padded.
    #[inline(always)]
    pub fn new(keys: &[usize], values: &[usize]) -> Self {
        let len = keys.len();
        assert!((1..=TILE).contains(&len) && values.len() == len);
        let mut tile = Tile {
            keys: [keys[len - 1]; TILE],
            values: [values[len - 1]; TILE],
            len,
            padding: [0.0; TILE],
        };
        if len == TILE {
            // The common case, with a length known here: a few vector moves.
            tile.keys.copy_from_slice(keys);
            tile.values.copy_from_slice(values);
        } else {
            tile.keys[..len].copy_from_slice(keys);
            tile.values[..len].copy_from_slice(values);
            tile.padding
                .copy_from_slice(&PADDING[TILE - len..2 * TILE - len]);
        }
        tile
    }
}

/// One build of the step.
///
/// # Safety (`step`)
/// With `caches = (keys, values)`: for every lane `j < TILE`, `tile.keys[j] + d <=
/// keys.len()` and `tile.values[j] + d <= values.len()`; and `queries` and `accs` hold
/// `running.len()` heads of `d` floats.
pub(crate) trait Kernel {
    /// The build's 8-lane vectors, for runs of prefill rows (`block.rs`).
    type Lanes: crate::block::Lanes;

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
