//! Runs of prefill rows, computed together. A prefill chunk sends every token of a prompt as
//! its own row, so consecutive rows of one sequence see almost the same keys (row `r`: keys
//! `low..=p`, row `r + 1`: keys `low'..=p + 1`). `row.rs` finds such runs (same block-table
//! row, consecutive positions) and hands them here: each kv head's (token, query head) pairs
//! of the run, up to 16 "query rows", are laid side by side in the lanes of one or two
//! vectors, and every key of the run's union range is loaded once and scored against all of
//! them. The keys at the run's edges (past the first row's position, before the last row's
//! low) are masked per query row with -inf.
//!
//! Everything is transposed with respect to the row kernel: a score is a vector over query
//! rows (one vector per key), so the softmax max and sum over a tile's keys are plain
//! element-wise operations, and the output accumulates as `[column][query row]` (each column
//! of a value broadcast and multiplied into the vector of weights), turned back into rows at
//! the end. A head_dim that is not a multiple of 8 needs no masked loads: keys and values are
//! read one float at a time (broadcast), never past `d`.
//!
//! Written once over 8-lane vectors (`lanes.rs`): `avx2::Ymm` for the AVX2+FMA build,
//! `[f32; 8]` for the portable one.

use crate::layout::PagedCache;
use crate::paged::kernel::Kernel;
use crate::paged::lanes::Lanes;
use crate::paged::query::AttentionParams;
use crate::paged::softmax::Running;
use crate::paged::tile::{Tile, TILE};
use crate::simd::dispatch::LANES;

/// Query rows (tokens times query heads of one kv head) a run holds at most: two vectors.
pub(crate) const MAX_QUERY_ROWS: usize = 2 * LANES;

/// Tokens a run holds at most.
pub(crate) const MAX_TOKENS: usize = 8;

/// A run's rows: one sequence, consecutive positions; `low` / `position` per token.
pub(crate) struct Run<'r> {
    pub low: &'r [i64],
    pub position: &'r [i64],
    /// The run's union range: `low_min..=position of the last row`.
    pub low_min: usize,
}

/// What every run and every single row of a call shares (the row driver's tiles too).
pub(crate) struct Shared<'c, 'a> {
    pub keys: &'c PagedCache<'a>,
    pub values: &'c PagedCache<'a>,
    pub group: usize,
    pub num_kv_heads: usize,
    pub d: usize,
    pub params: &'c AttentionParams<'a>,
}

/// Buffers reused by every run of a call (no allocation per run once the largest is seen).
#[derive(Default)]
pub(crate) struct Scratch {
    /// `[d][R]` vectors: the query rows transposed, column by column.
    queries: Vec<[f32; LANES]>,
    /// `[d][R]` vectors: the output accumulated, column by column.
    accs: Vec<[f32; LANES]>,
    /// `[2][R]` vectors: the running max and sum of every query row. In memory, not in
    /// registers across the tile loop: the inner loops need every register.
    softmax: Vec<[f32; LANES]>,
    /// `[TILE][R]` vectors: a tile's scores, then its weights. In memory for the same reason
    /// (held in registers, they crowd out the loops' accumulators).
    tile: Box<[[f32; LANES]; 2 * TILE]>,
}

/// Computes a run: `q_rows` / `out_rows` are its rows of `q` and `out` (tokens x heads x d),
/// and `key_at` / `value_at` the element offsets (kv head 0) of every key of the union range,
/// in order.
///
/// # Safety
/// Every offset in `key_at` / `value_at` is `head_start(block, 0) + token * token_stride` of
/// its cache for a block that `QueryRows::check` accepted and `token < block_size` (as for
/// `row`'s `absorb_tile`); the run holds 2 to `MAX_TOKENS` tokens and `tokens * group <=
/// MAX_QUERY_ROWS`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn run<K: Kernel, const D: usize>(
    shared: &Shared<'_, '_>,
    run: &Run<'_>,
    q_rows: &[f32],
    out_rows: &mut [f32],
    key_at: &[usize],
    value_at: &[usize],
    scratch: &mut Scratch,
) {
    let query_rows = run.low.len() * shared.group;
    debug_assert!(query_rows <= MAX_QUERY_ROWS && run.low.len() >= 2);
    if query_rows <= LANES {
        kv_heads::<K, D, 1, 8>(shared, run, q_rows, out_rows, key_at, value_at, scratch);
    } else {
        kv_heads::<K, D, 2, 4>(shared, run, q_rows, out_rows, key_at, value_at, scratch);
    }
}

/// `run` with `R` vectors of query rows; `B` keys scored (and columns accumulated) at a time,
/// so that `R * B` = 8 independent FMA chains in registers.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn kv_heads<K: Kernel, const D: usize, const R: usize, const B: usize>(
    shared: &Shared<'_, '_>,
    run: &Run<'_>,
    q_rows: &[f32],
    out_rows: &mut [f32],
    key_at: &[usize],
    value_at: &[usize],
    scratch: &mut Scratch,
) {
    let d = if D == 0 { shared.d } else { D };
    let (group, tokens) = (shared.group, run.low.len());
    let num_heads = group * shared.num_kv_heads;
    let row_len = num_heads * d;
    let count = key_at.len();
    let first_position = run.low_min;
    // Per query row (lane i = token * group + head): its visible positions, relative to the
    // union's first; lanes past the run see everything (their results are dropped).
    let mut from = [0usize; MAX_QUERY_ROWS];
    let mut to = [count - 1; MAX_QUERY_ROWS];
    for i in 0..tokens * group {
        from[i] = run.low[i / group] as usize - first_position;
        to[i] = run.position[i / group] as usize - first_position;
    }
    // Keys `shared_from..=shared_to` are visible to every query row.
    let shared_from = from[..tokens * group].iter().copied().max().unwrap_or(0);
    let shared_to = to[..tokens * group].iter().copied().min().unwrap_or(0);
    scratch.queries.resize(d * R, [0.0; LANES]);
    scratch.accs.resize(d * R, [0.0; LANES]);
    for kv_head in 0..shared.num_kv_heads {
        let keys = &shared.keys.data[kv_head * shared.keys.head_stride..];
        let values = &shared.values.data[kv_head * shared.values.head_stride..];
        // The group's query rows, transposed: queries[c * R + v][lane] is column c of query
        // row v * 8 + lane.
        for (c, column) in scratch.queries.chunks_exact_mut(R).enumerate() {
            for (v, lanes) in column.iter_mut().enumerate() {
                for (lane, x) in lanes.iter_mut().enumerate() {
                    let i = v * LANES + lane;
                    *x = if i < tokens * group {
                        let (token, head) = (i / group, kv_head * group + i % group);
                        q_rows[token * row_len + head * d + c]
                    } else {
                        0.0
                    };
                }
            }
        }
        scratch.accs.fill([0.0; LANES]);
        scratch.softmax.clear();
        scratch.softmax.resize(R, [f32::NEG_INFINITY; LANES]);
        scratch.softmax.resize(2 * R, [0.0; LANES]);
        for start in (0..count).step_by(TILE) {
            let end = count.min(start + TILE);
            let tile = Tile::new(&key_at[start..end], &value_at[start..end]);
            // The next tile towards L1 (a hint: nothing is read).
            let next = end..count.min(end + TILE);
            K::prefetch::<true>(keys, &key_at[next.clone()], d);
            K::prefetch::<true>(values, &value_at[next], d);
            // SAFETY: the contract of this function: every offset of the tile plus `d` is
            // inside `keys` / `values` (kv head `kv_head`, as in `row`'s `absorb_tile`).
            scores::<K::Lanes, D, R, B>(&mut scratch.tile, &scratch.queries, keys, &tile, d);
            let interior = end - start == TILE && start >= shared_from && end - 1 <= shared_to;
            let pads = (!interior).then(|| mask::<R>(start, end, &from, &to));
            let factor = absorb::<K::Lanes, R>(
                &mut scratch.tile,
                pads.as_ref(),
                &mut scratch.softmax,
                shared.params,
            );
            accumulate::<K::Lanes, D, R, B>(
                &mut scratch.accs,
                factor,
                &scratch.tile,
                values,
                &tile,
                d,
            );
        }
        // Back to rows: each query row's column c, then the softmax's finish (sink, divide).
        let (max_lanes, sum_lanes) = scratch.softmax.split_at(R);
        for i in 0..tokens * group {
            let (v, lane) = (i / LANES, i % LANES);
            let (token, head) = (i / group, kv_head * group + i % group);
            let out = &mut out_rows[token * row_len + head * d..][..d];
            for (c, x) in out.iter_mut().enumerate() {
                *x = scratch.accs[c * R + v][lane];
            }
            let mut running = Running::EMPTY;
            running.max = max_lanes[v][lane];
            running.sum[0] = sum_lanes[v][lane];
            running.finish(out, shared.params.sinks.map(|s| s[head]));
        }
    }
}

/// The tile's scores, unscaled: `scores[j][v]` lane l is `q . key j` for query row `v * 8 +
/// l`. Keys are taken `B` at a time (each column of a key broadcast and multiplied into the
/// `R` query vectors), for the groups of keys the tile's real tokens reach; the others stay
/// 0 (and are masked as padding).
///
/// # Safety
/// Every offset of `tile` plus `d` is inside `keys`; the build's `Lanes` may run.
#[inline(always)]
unsafe fn scores<L: Lanes, const D: usize, const R: usize, const B: usize>(
    scores: &mut [[f32; LANES]; 2 * TILE],
    queries: &[[f32; LANES]],
    keys: &[f32],
    tile: &Tile,
    d: usize,
) {
    let d = if D == 0 { d } else { D };
    let base = keys.as_ptr();
    let groups = tile.len.div_ceil(B);
    for first in (0..groups).map(|g| g * B) {
        let mut key = [base; B];
        for (pointer, &offset) in key.iter_mut().zip(&tile.keys[first..first + B]) {
            *pointer = base.add(offset);
        }
        let mut acc = [[L::splat(0.0); R]; B];
        for (c, column) in queries[..d * R].chunks_exact(R).enumerate() {
            let mut q = [L::splat(0.0); R];
            for (lanes, x) in q.iter_mut().zip(column) {
                *lanes = L::load(x);
            }
            for (acc, &key) in acc.iter_mut().zip(&key) {
                let x = L::splat(*key.add(c));
                for (a, q) in acc.iter_mut().zip(&q) {
                    *a = q.mul_add(x, *a);
                }
            }
        }
        for (k, acc) in acc.iter().enumerate() {
            for (v, a) in acc.iter().enumerate() {
                a.store(&mut scores[(first + k) * R + v]);
            }
        }
    }
    scores[groups * B * R..TILE * R].fill([0.0; LANES]);
}

/// The padding of a tile that is not wholly visible to every query row: -inf for keys past
/// the tile's real tokens and for keys outside a query row's `from..=to` (positions relative
/// to the union's first; the tile starts at `start`), else 0.
#[inline(always)]
fn mask<const R: usize>(
    start: usize,
    end: usize,
    from: &[usize; MAX_QUERY_ROWS],
    to: &[usize; MAX_QUERY_ROWS],
) -> [[[f32; LANES]; R]; TILE] {
    let mut pads = [[[0.0f32; LANES]; R]; TILE];
    for (j, key) in pads.iter_mut().enumerate() {
        let at = start + j;
        for (v, pad) in key.iter_mut().enumerate() {
            for (lane, pad) in pad.iter_mut().enumerate() {
                let i = v * LANES + lane;
                if at >= end || at < from[i] || at > to[i] {
                    *pad = f32::NEG_INFINITY;
                }
            }
        }
    }
    pads
}

/// The online-softmax step of every query row on a tile of dot products: scale and soft-cap,
/// the padding (-inf) when given, the new running max, the weights `exp(score - max)` (0
/// where padded) left in `scores`, the running sum; returns the factor for what was
/// accumulated so far.
#[inline(always)]
unsafe fn absorb<L: Lanes, const R: usize>(
    scores: &mut [[f32; LANES]; 2 * TILE],
    pads: Option<&[[[f32; LANES]; R]; TILE]>,
    softmax: &mut [[f32; LANES]],
    params: &AttentionParams<'_>,
) -> [L; R] {
    let scale = L::splat(params.scale);
    let mut tile_max = [L::splat(f32::NEG_INFINITY); R];
    for j in 0..TILE {
        for (v, tile_max) in tile_max.iter_mut().enumerate() {
            let score = &mut scores[j * R + v];
            let mut s = L::load(score).mul(scale);
            if let Some(cap) = params.softcap {
                s = s.softcap(cap);
            }
            if let Some(pads) = pads {
                s = s.add(L::load(&pads[j][v]));
            }
            s.store(score);
            *tile_max = tile_max.max(s);
        }
    }
    let (max_lanes, sum_lanes) = softmax.split_at_mut(R);
    let mut factor = [L::splat(1.0); R];
    let mut max = [L::splat(0.0); R];
    let mut sum = [L::splat(0.0); R];
    for v in 0..R {
        let old = L::load(&max_lanes[v]);
        max[v] = old.max(tile_max[v]);
        factor[v] = L::rescale(old, max[v]);
        sum[v] = L::load(&sum_lanes[v]).mul(factor[v]);
        max[v].store(&mut max_lanes[v]);
    }
    let minus_one = L::splat(-1.0);
    for j in 0..TILE {
        for (v, (sum, max)) in sum.iter_mut().zip(&max).enumerate() {
            let score = L::load(&scores[j * R + v]);
            let weight = max.mul_add(minus_one, score).exp().unless_masked(score);
            weight.store(&mut scores[j * R + v]);
            *sum = sum.add(weight);
        }
    }
    for v in 0..R {
        sum[v].store(&mut sum_lanes[v]);
    }
    factor
}

/// `accs = accs * factor + sum over the tile's keys of weight * value`, `[column][query row]`:
/// `B` columns at a time, each column of a value broadcast and multiplied into the `R`
/// weight vectors of its key.
///
/// # Safety
/// Every offset of `tile` plus `d` is inside `values`; the build's `Lanes` may run.
#[inline(always)]
unsafe fn accumulate<L: Lanes, const D: usize, const R: usize, const B: usize>(
    accs: &mut [[f32; LANES]],
    factor: [L; R],
    weights: &[[f32; LANES]; 2 * TILE],
    values: &[f32],
    tile: &Tile,
    d: usize,
) {
    let d = if D == 0 { d } else { D };
    let base = values.as_ptr();
    let mut value = [base; TILE];
    for (pointer, &offset) in value.iter_mut().zip(&tile.values) {
        *pointer = base.add(offset);
    }
    let n = tile.len;
    let mut col = 0;
    while col + B <= d {
        columns::<L, R, B>(
            &mut accs[col * R..(col + B) * R],
            factor,
            weights,
            &value,
            col,
            n,
        );
        col += B;
    }
    while col < d {
        columns::<L, R, 1>(
            &mut accs[col * R..(col + 1) * R],
            factor,
            weights,
            &value,
            col,
            n,
        );
        col += 1;
    }
}

/// Columns `col..col + C` of `accumulate`, in registers across the tile's `n` keys.
#[inline(always)]
unsafe fn columns<L: Lanes, const R: usize, const C: usize>(
    accs: &mut [[f32; LANES]],
    factor: [L; R],
    weights: &[[f32; LANES]; 2 * TILE],
    value: &[*const f32; TILE],
    col: usize,
    n: usize,
) {
    let mut sums = [[L::splat(0.0); R]; C];
    for (sum, column) in sums.iter_mut().zip(accs.chunks_exact(R)) {
        for ((s, x), f) in sum.iter_mut().zip(column).zip(&factor) {
            *s = L::load(x).mul(*f);
        }
    }
    for (weight, &value) in weights.chunks_exact(R).zip(value).take(n) {
        for (c, sum) in sums.iter_mut().enumerate() {
            let x = L::splat(*value.add(col + c));
            for (s, w) in sum.iter_mut().zip(weight) {
                *s = L::load(w).mul_add(x, *s);
            }
        }
    }
    for (sum, column) in sums.iter().zip(accs.chunks_exact_mut(R)) {
        for (s, x) in sum.iter().zip(column) {
            s.store(x);
        }
    }
}
