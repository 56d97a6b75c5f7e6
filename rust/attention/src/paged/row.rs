//! The row driver, written once for every build (`K`) and head_dim (`D`, 0 for any). Per row:
//! the element offsets of every visible token's key and value (kv head 0) are listed first, in
//! order; then they are cut into tiles of `TILE` tokens (across block boundaries, so a window
//! row of 16 tokens over two blocks is one tile, not two half-empty ones). Per tile and kv
//! head, the group's query heads score the tile's keys, absorb the scores into their online
//! softmax and accumulate the tile's values (`Kernel::step`).
//!
//! Consecutive rows of one sequence at consecutive positions (a prefill chunk) go together
//! instead when that is cheaper (`run_length`): the offsets of their union range are listed
//! once and `block.rs` scores every key against all the run's (token, query head) pairs. Decode
//! rows (one per sequence) always take the row path.

use crate::layout::{HeadShape, PagedCache};
use crate::paged::block;
use crate::paged::kernel::Kernel;
use crate::paged::query::{AttentionParams, QueryRows};
use crate::paged::softmax::Running;
use crate::paged::tile::{Tile, TILE};
use crate::simd::dispatch::LANES;

/// What the driver takes: everything one call reads and writes, checked by
/// `paged_attention` (`mod.rs`).
pub(crate) struct Job<'a, 'o> {
    pub q: &'a [f32],
    pub keys: PagedCache<'a>,
    pub values: PagedCache<'a>,
    pub rows: QueryRows<'a>,
    pub shape: HeadShape,
    pub params: AttentionParams<'a>,
    pub out: &'o mut [f32],
}

#[inline(always)]
pub(crate) fn run<K: Kernel, const D: usize>(job: Job<'_, '_>) {
    let Job {
        q,
        keys,
        values,
        rows,
        shape,
        params,
        out,
    } = job;
    // The constant `D` when the caller picked a specialised build (so that LLVM unrolls the
    // column loops), else the run-time value.
    let d = if D == 0 { shape.head_dim } else { D };
    debug_assert_eq!(d, shape.head_dim);
    let row_len = shape.num_heads * d;
    let shared = block::Shared {
        keys: &keys,
        values: &values,
        group: shape.group_size(),
        num_kv_heads: shape.num_kv_heads,
        d,
        params: &params,
    };
    // Tokens a run of prefill rows may hold: as many as fill 16 query rows of a kv head.
    let max_run = (block::MAX_QUERY_ROWS / shape.group_size()).min(block::MAX_TOKENS);
    // Reused by every row: no allocation per row once the longest row has been seen.
    let mut state = vec![Running::EMPTY; shape.num_heads];
    let (mut key_at, mut value_at) = (Vec::new(), Vec::new());
    let mut scratch = block::Scratch::default();
    let mut r = 0;
    while r < rows.len() {
        let tokens = run_length(&rows, r, max_run, shape.group_size());
        let (s, low, position) = rows.span(r);
        // The union of the run's ranges (one row: its own range).
        let low = (r..r + tokens)
            .map(|t| rows.low[t] as usize)
            .min()
            .unwrap_or(low);
        let position = position + tokens - 1;
        let count = position - low + 1;
        key_at.resize(count, 0);
        value_at.resize(count, 0);
        for (block, offsets, first) in rows.blocks((s, low, position), keys.block_size) {
            let mut key = keys.head_start(block, 0) + offsets.start * keys.token_stride;
            let mut value = values.head_start(block, 0) + offsets.start * values.token_stride;
            let slots = key_at[first..first + offsets.len()]
                .iter_mut()
                .zip(&mut value_at[first..first + offsets.len()]);
            for (key_slot, value_slot) in slots {
                (*key_slot, *value_slot) = (key, value);
                key += keys.token_stride;
                value += values.token_stride;
            }
        }
        // The next row's start, when it is another sequence's (a prefill row's keys are
        // mostly the previous row's, already in the cache).
        if r + tokens < rows.len() && rows.sequence[r + tokens] != rows.sequence[r] {
            prefetch_row_start::<K>(&shared, &rows, r + tokens);
        }
        let q_rows = &q[r * row_len..(r + tokens) * row_len];
        let out_rows = &mut out[r * row_len..(r + tokens) * row_len];
        if tokens > 1 {
            let run = block::Run {
                low: &rows.low[r..r + tokens],
                position: &rows.position[r..r + tokens],
                low_min: low,
            };
            // SAFETY: the offsets listed are those of the positions `low..=position` of table
            // row `s`, each visible to a row of the run (see `run_length`), so of a checked
            // block (the contract of `block::run`); `run_length` bounds the run's size.
            unsafe {
                block::run::<K, D>(
                    &shared,
                    &run,
                    q_rows,
                    out_rows,
                    &key_at,
                    &value_at,
                    &mut scratch,
                )
            };
        } else {
            one_row::<K>(
                &shared,
                &key_at,
                &value_at,
                q_rows,
                out_rows,
                &mut state,
                params.sinks,
            );
        }
        r += tokens;
    }
}

/// How many rows from `r` on (1 to `max_run`) form a run of prefill rows: one table row and
/// consecutive positions. Each row's range ends one position after the previous one's and
/// starts at or before its own end (`QueryRows::check`), so every position from the run's
/// lowest `low` to its last position is visible to one of its rows: the union range holds
/// only checked blocks.
///
/// A row joins only while the run stays cheaper than its rows one by one: a run scores every
/// key of its union against a full vector of query rows (8 or 16 lanes), about half as
/// expensive per (lane, tile) as a row's step per (query head, tile); a sliding-window run
/// scores keys that most of its rows then mask (16-token windows: two tiles for every run),
/// and stays as single rows. The longest run that pays is taken.
fn run_length(rows: &QueryRows<'_>, r: usize, max_run: usize, group: usize) -> usize {
    let tiles = |keys: i64| (keys as usize).div_ceil(TILE);
    let (sequence, position) = (rows.sequence[r], rows.position[r]);
    let mut low = rows.low[r];
    // Tiles the rows take one by one.
    let mut single = tiles(position - low + 1);
    // The longest run that is cheaper (a run of 2 rows may not be, one of 8 is).
    let (mut tokens, mut best) = (1, 1);
    while tokens < max_run && r + tokens < rows.len() {
        let t = r + tokens;
        if rows.sequence[t] != sequence || rows.position[t] != position + tokens as i64 {
            break;
        }
        low = low.min(rows.low[t]);
        single += tiles(rows.position[t] - rows.low[t] + 1);
        tokens += 1;
        let lanes = (tokens * group).div_ceil(LANES) * LANES;
        // Run cost 0.6 per (lane, tile) against 1 per (query head, tile).
        if 3 * tiles(rows.position[t] - low + 1) * lanes <= 5 * single * group {
            best = tokens;
        }
    }
    best
}

/// Asks for row `r`'s first tile of keys and values (every kv head) towards L2, while the row
/// before it runs: nothing else prefetches a row's start, and a row of one or two tiles (a
/// 16-token window in decode) would otherwise wait on memory for most of its keys. For a row
/// of another sequence than the one before it.
#[inline(always)]
fn prefetch_row_start<K: Kernel>(shared: &block::Shared<'_, '_>, rows: &QueryRows<'_>, r: usize) {
    let (keys, values) = (shared.keys, shared.values);
    let all_heads = |cache: &PagedCache| (shared.num_kv_heads - 1) * cache.head_stride + shared.d;
    let (mut key_at, mut value_at) = ([0usize; TILE], [0usize; TILE]);
    let mut count = 0;
    for (block, offsets, _) in rows.blocks(rows.span(r), keys.block_size) {
        for token in offsets {
            key_at[count] = keys.head_start(block, 0) + token * keys.token_stride;
            value_at[count] = values.head_start(block, 0) + token * values.token_stride;
            count += 1;
            if count == TILE {
                break;
            }
        }
        if count == TILE {
            break;
        }
    }
    K::prefetch::<false>(keys.data, &key_at[..count], all_heads(keys));
    K::prefetch::<false>(values.data, &value_at[..count], all_heads(values));
}

/// One row (its visible tokens' offsets listed in `key_at` / `value_at`): tile by tile
/// through `absorb_tile`, then the softmax's finish.
#[inline(always)]
fn one_row<K: Kernel>(
    shared: &block::Shared<'_, '_>,
    key_at: &[usize],
    value_at: &[usize],
    q_row: &[f32],
    out_row: &mut [f32],
    state: &mut [Running],
    sinks: Option<&[f32]>,
) {
    let count = key_at.len();
    out_row.fill(0.0);
    state.fill(Running::EMPTY);
    for start in (0..count).step_by(TILE) {
        let end = count.min(start + TILE);
        let tile = Tile::new(&key_at[start..end], &value_at[start..end]);
        let ahead = |from: usize, to: usize| {
            let (from, to) = (count.min(from), count.min(to));
            (&key_at[from..to], &value_at[from..to])
        };
        // The next tile, for L1 prefetches; and tiles 2 and 3 ahead (1 to 3 at the start
        // of a row) for L2 prefetches: far enough ahead for memory latency, and each
        // tile asked for twice, as a prefetch that finds every fill buffer busy is dropped.
        let next = ahead(end, start + 2 * TILE);
        let far = ahead(
            if start == 0 { end } else { start + 2 * TILE },
            start + 4 * TILE,
        );
        // SAFETY: every offset listed is that of a token of a checked visible block (see
        // `absorb_tile`).
        unsafe { shared.absorb_tile::<K>(&tile, next, far, q_row, out_row, state) };
    }
    let d = shared.d;
    for (head, (running, acc)) in state.iter().zip(out_row.chunks_exact_mut(d)).enumerate() {
        running.finish(acc, sinks.map(|s| s[head]));
    }
}

impl block::Shared<'_, '_> {
    /// Absorbs the tile's tokens into every query head of the row. `next` holds the following
    /// tile's (keys, values) offsets and `far` those of tiles further ahead (either may be
    /// empty), to prefetch.
    ///
    /// # Safety
    /// Every offset in `tile` is `head_start(block, 0) + token * token_stride` of its cache,
    /// for a block that `QueryRows::check` accepted (a real block of both caches) and `token <
    /// block_size`. `PagedCache::check` bounded the last element of the last block, token and
    /// kv head by `data.len()`, so for kv head `g` every such offset plus `g * head_stride + d`
    /// is in bounds: the `Kernel::step` contract on the slices made below.
    #[inline(always)]
    unsafe fn absorb_tile<K: Kernel>(
        &self,
        tile: &Tile,
        (next_keys, next_values): (&[usize], &[usize]),
        (far_keys, far_values): (&[usize], &[usize]),
        q_row: &[f32],
        out_row: &mut [f32],
        state: &mut [Running],
    ) {
        let (n, d, group, num_kv_heads) = (tile.len, self.d, self.group, self.num_kv_heads);
        // Prefetches, because consecutive tokens of a paged cache sit `token_stride` apart or
        // in another block, where the hardware prefetchers do not follow: tiles ahead for all
        // kv heads towards L2 (with several kv heads, a token's heads are one contiguous run),
        // then, at each kv head, the next (tile, kv head)'s keys and values towards L1. The L2
        // run matters with one kv head too: a long decode row over blocks that are not in the
        // cache (64 rows x 592 keys, 1 x 4 x 32) took 1.9 ms without it, 0.8 ms with it.
        let all_heads = |cache: &PagedCache| (num_kv_heads - 1) * cache.head_stride + d;
        K::prefetch::<false>(self.keys.data, far_keys, all_heads(self.keys));
        K::prefetch::<false>(self.values.data, far_values, all_heads(self.values));
        for kv_head in 0..num_kv_heads {
            let keys = from_head(self.keys, kv_head);
            let values = from_head(self.values, kv_head);
            if kv_head + 1 < num_kv_heads {
                K::prefetch::<true>(from_head(self.keys, kv_head + 1), &tile.keys[..n], d);
                K::prefetch::<true>(from_head(self.values, kv_head + 1), &tile.values[..n], d);
            } else {
                K::prefetch::<true>(self.keys.data, next_keys, d);
                K::prefetch::<true>(self.values.data, next_values, d);
            }
            let heads = kv_head * group..(kv_head + 1) * group;
            let queries = &q_row[heads.start * d..heads.end * d];
            let accs = &mut out_row[heads.start * d..heads.end * d];
            K::step(
                queries,
                accs,
                &mut state[heads],
                (keys, values),
                tile,
                self.params,
                d,
            );
        }
    }
}

/// The cache's data from kv head `head` on: a token's offset (for kv head 0) in it is that
/// token's slice of kv head `head`.
#[inline(always)]
fn from_head<'a>(cache: &PagedCache<'a>, head: usize) -> &'a [f32] {
    &cache.data[head * cache.head_stride..]
}
