//! The unit of work of the kernel: a tile of up to `TILE` tokens, as the element offsets of
//! their keys and values, padded to a full tile.

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
