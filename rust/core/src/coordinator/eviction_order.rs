//! Which free tier a released block joins, and in which order a finished request's blocks are
//! freed, so that eviction keeps what can still be hit.
//!
//! A hit at `h` tokens needs every full-attention block before `h` and, in a windowed group, only
//! the blocks of `h`'s window (`hit_window`). Blocks a window releases while the request runs
//! are therefore worth keeping only if some hit point a later request will ask for needs them:
//! - the request's *end point* `h_end` (its computed tokens rounded down to the hit alignment),
//!   which the next turn of a conversation asks for;
//! - the request's own *hit point* (where its cache hit ended), the fallback when the end
//!   point's blocks are gone.
//!
//! A released block in one of those windows joins the `Normal` tier; any other joins `Low`,
//! which is evicted first (keyless blocks go before both). With protection on, the window of a
//! hit point other running requests share (`shared_hit_point`) joins the protected tier. When
//! the request is freed, the window-released blocks of both points that are still cached are
//! touched again (`retouch_hit_points`) and freed with the rest, so they are as recent as the
//! request's tail instead of as old as the moment the window left them.
//!
//! Free order (`order_for_free`): by the token position each block ends at, last first, across
//! groups, so the free queue evicts the chain from its tail backwards in every group at once:
//!
//! ```text
//!   full  (B=16):  [0,16) [16,32) [32,48) [48,64)        freed: 64 64 48 48 32 32 16 16
//!   window(B=16):                [32,48) [48,64)         (position each block ends at)
//! ```
//!
//! Evicting the first two (both groups' blocks ending at 64) leaves a hit at 48 whose window
//! blocks are still there; freeing group by group would instead evict the whole window run
//! first and leave a full-attention chain nothing can hit.

use std::ops::Range;

use super::keys::KeyLayout;
use super::request::RequestState;
use crate::allocator::{BlockAllocator, FreeTier};
use crate::manager::AttentionManager;
use crate::types::{BlockId, NULL_BLOCK};

/// Block indices a hit of `hit_tokens` needs in a group: the window of the hit point (all the
/// blocks before it for full attention).
pub(super) fn hit_window(manager: &dyn AttentionManager, hit_tokens: usize) -> Range<usize> {
    let end = hit_tokens / manager.block_size();
    manager.num_released_blocks(hit_tokens).min(end)..end
}

/// The tier of block `index` that a window releases once `num_computed` tokens are computed,
/// in a request whose hit took `hit_tokens` (see the module docs).
pub(super) fn release_tier(
    manager: &dyn AttentionManager,
    index: usize,
    num_computed: usize,
    hit_tokens: usize,
    hit_alignment: usize,
) -> FreeTier {
    let end_point = num_computed / hit_alignment * hit_alignment;
    if hit_window(manager, end_point).contains(&index)
        || hit_window(manager, hit_tokens).contains(&index)
    {
        FreeTier::Normal
    } else {
        FreeTier::Low
    }
}

/// Whether the request's hit point is shared: another request holds the last full-attention
/// block before it (a shared system prompt or document that several running requests started
/// from). The next request with that prefix needs exactly the hit point's window, which the
/// window released while the full-attention prefix stays in use: those blocks join the
/// protected tier instead of `Normal`. A hit point only its own request holds (the previous
/// turn of a conversation, which the next turn does not continue from) is not shared.
pub(super) fn shared_hit_point<P: BlockAllocator>(
    pool: &P,
    managers: &[Box<dyn AttentionManager>],
    full_groups: &[usize],
    state: &RequestState,
) -> bool {
    let Some(&group) = full_groups.first() else {
        return false;
    };
    let Some(index) = (state.hit_tokens / managers[group].block_size()).checked_sub(1) else {
        return false;
    };
    match state.groups[group].blocks.get(index) {
        Some(&block) if block != NULL_BLOCK => pool.ref_count(block) > 1,
        _ => false,
    }
}

/// Takes a reference again on every block the windows of the request's end point and hit
/// point need that a window already released and that is still cached, and lists them in
/// `out` (cleared first) with the position each ends at. Returns how many were taken.
pub(super) fn retouch_hit_points<P: BlockAllocator>(
    pool: &P,
    managers: &[Box<dyn AttentionManager>],
    state: &RequestState,
    keys: &KeyLayout,
    hit_alignment: usize,
    out: &mut Vec<(usize, BlockId)>,
) -> usize {
    out.clear();
    let computed = state.num_allocated.min(state.tokens.len());
    let end_point = computed / hit_alignment * hit_alignment;
    for (group, (manager, blocks)) in managers.iter().zip(&state.groups).enumerate() {
        if blocks.num_released == 0 {
            continue;
        }
        let keys = keys.keys(&state.hash_chains, group);
        let block_size = manager.block_size();
        let end_window = hit_window(manager.as_ref(), end_point);
        let hit_point_window = hit_window(manager.as_ref(), state.hit_tokens);
        let windows = [end_window.clone(), hit_point_window];
        for (which, window) in windows.iter().enumerate() {
            let limit = window.end.min(blocks.num_released).min(keys.num_full());
            for index in window.start.min(limit)..limit {
                if which == 1 && end_window.contains(&index) {
                    continue; // both windows hold it: taken once
                }
                if blocks.blocks.get(index) != Some(&NULL_BLOCK) {
                    continue;
                }
                let key = keys.full(index);
                if let Some(block) = pool.cached_block(key) {
                    if pool.touch_cached(block, key) {
                        out.push(((index + 1) * block_size, block));
                    }
                }
            }
        }
    }
    out.len()
}

/// Writes to `freed`, in free order, every block the request holds and every block already in
/// `pairs` (with the position each ends at; emptied): see `merge_free_order`.
pub(super) fn order_for_free(
    managers: &[Box<dyn AttentionManager>],
    state: &RequestState,
    pairs: &mut Vec<(usize, BlockId)>,
    freed: &mut Vec<BlockId>,
) {
    let rows = managers
        .iter()
        .zip(&state.groups)
        .map(|(manager, blocks)| (blocks.blocks.as_slice(), manager.block_size()));
    if managers.len() <= MERGED_GROUPS {
        let mut on_stack: [(&[BlockId], usize); MERGED_GROUPS] = [(&[], 0); MERGED_GROUPS];
        for (slot, row) in on_stack.iter_mut().zip(rows) {
            *slot = row;
        }
        merge_free_order(&mut on_stack[..managers.len()], pairs, freed);
    } else {
        merge_free_order(&mut rows.collect::<Vec<_>>(), pairs, freed);
    }
}

/// Most groups `order_for_free` keeps on the stack.
const MERGED_GROUPS: usize = 8;

/// Appends to `freed` the blocks of `rows` (each a group's row, null entries skipped, and its
/// block size) and of `pairs` (emptied) in free order: by the position each block ends at, last
/// first; on ties the blocks of `pairs` first, then the rows in order; a row's blocks newest
/// first. A row read backwards is already in that order, so the rows are merged (each is
/// consumed from its end), not sorted: the same order as a stable sort of all of them.
fn merge_free_order(
    rows: &mut [(&[BlockId], usize)],
    pairs: &mut Vec<(usize, BlockId)>,
    freed: &mut Vec<BlockId>,
) {
    match (&*rows, pairs.is_empty()) {
        ([(row, _)], true) => return push_newest_first(row, freed),
        ([(first, first_size), (second, second_size)], true) => {
            return merge_two(first, *first_size, second, *second_size, freed)
        }
        _ => {}
    }
    // Stable: equal positions keep their order. Usually empty (a request's retouched windows).
    pairs.sort_by_key(|&(end, _)| std::cmp::Reverse(end));
    let mut extra = 0;
    loop {
        // The candidate ending last; on ties the first found (`pairs`, then the rows in order).
        let mut best = pairs.get(extra).map(|&(end, _)| (end, None));
        for (index, (row, block_size)) in rows.iter_mut().enumerate() {
            while let Some((&NULL_BLOCK, rest)) = row.split_last() {
                *row = rest;
            }
            let end = row.len() * *block_size;
            if !row.is_empty() && best.is_none_or(|(best_end, _)| end > best_end) {
                best = Some((end, Some(index)));
            }
        }
        match best {
            None => break,
            Some((_, None)) => {
                freed.push(pairs[extra].1);
                extra += 1;
            }
            Some((_, Some(index))) => {
                let row = &mut rows[index].0;
                let (&block, rest) = row.split_last().expect("a candidate row has a block");
                freed.push(block);
                *row = rest;
            }
        }
    }
    pairs.clear();
}

/// Appends a row's blocks to `freed`, newest first, null entries skipped.
fn push_newest_first(row: &[BlockId], freed: &mut Vec<BlockId>) {
    freed.extend(row.iter().rev().filter(|&&block| block != NULL_BLOCK));
}

/// `merge_free_order` of two rows and no pairs (a full-attention group and a windowed one): a
/// null entry is passed over where its position comes up, which orders nothing.
fn merge_two(
    first: &[BlockId],
    first_size: usize,
    second: &[BlockId],
    second_size: usize,
    freed: &mut Vec<BlockId>,
) {
    freed.reserve(first.len() + second.len());
    if first_size == second_size {
        // Entry i of each row ends at the same position: the longer row's extra entries end
        // last, then the rows alternate, the first row's entry first on each tie.
        let common = first.len().min(second.len());
        push_newest_first(&second[common..], freed);
        push_newest_first(&first[common..], freed);
        for (&of_first, &of_second) in first[..common].iter().zip(&second[..common]).rev() {
            if of_first != NULL_BLOCK {
                freed.push(of_first);
            }
            if of_second != NULL_BLOCK {
                freed.push(of_second);
            }
        }
        return;
    }
    let (mut left, mut right) = (first.len(), second.len());
    while left > 0 && right > 0 {
        let block = if left * first_size >= right * second_size {
            left -= 1;
            first[left]
        } else {
            right -= 1;
            second[right]
        };
        if block != NULL_BLOCK {
            freed.push(block);
        }
    }
    push_newest_first(&first[..left], freed);
    push_newest_first(&second[..right], freed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::XorShift;

    fn below(rng: &mut XorShift, bound: u64) -> u64 {
        rng.next() % bound
    }

    /// The order a stable sort of every (end, block) pair gives, rows newest first after `pairs`.
    fn sorted_order(rows: &[(Vec<BlockId>, usize)], pairs: &[(usize, BlockId)]) -> Vec<BlockId> {
        let mut all = pairs.to_vec();
        for (row, block_size) in rows {
            for (index, &block) in row.iter().enumerate().rev() {
                if block != NULL_BLOCK {
                    all.push(((index + 1) * block_size, block));
                }
            }
        }
        all.sort_by_key(|&(end, _)| std::cmp::Reverse(end));
        all.into_iter().map(|(_, block)| block).collect()
    }

    #[test]
    fn merging_the_rows_gives_the_order_of_a_stable_sort() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let mut next_block = 1;
        for _ in 0..2000 {
            let num_rows = 1 + below(&mut rng, 4) as usize;
            let rows: Vec<(Vec<BlockId>, usize)> = (0..num_rows)
                .map(|_| {
                    let block_size = [1, 2, 4, 16][below(&mut rng, 4) as usize];
                    let len = below(&mut rng, 12) as usize;
                    let nulls = below(&mut rng, len as u64 + 1) as usize;
                    let row = (0..len)
                        .map(|index| {
                            if index < nulls || below(&mut rng, 8) == 0 {
                                NULL_BLOCK
                            } else {
                                next_block += 1;
                                next_block
                            }
                        })
                        .collect();
                    (row, block_size)
                })
                .collect();
            let pairs: Vec<(usize, BlockId)> = (0..below(&mut rng, 4).saturating_sub(1))
                .map(|_| {
                    next_block += 1;
                    (below(&mut rng, 40) as usize, next_block)
                })
                .collect();
            let expected = sorted_order(&rows, &pairs);
            let mut views: Vec<(&[BlockId], usize)> = rows
                .iter()
                .map(|(row, size)| (row.as_slice(), *size))
                .collect();
            let (mut pairs, mut freed) = (pairs, vec![99]);
            merge_free_order(&mut views, &mut pairs, &mut freed);
            assert_eq!(freed[0], 99, "appended after what `freed` held");
            assert_eq!(freed[1..], expected[..], "rows {rows:?}");
            assert!(pairs.is_empty());
        }
    }
}
