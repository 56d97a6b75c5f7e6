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

/// Appends to `pairs` every block the request holds with the position it ends at, then writes
/// all of `pairs` to `freed` in free order: last position first, groups in order on ties (the
/// sort is stable), a group's blocks newest first.
pub(super) fn order_for_free(
    managers: &[Box<dyn AttentionManager>],
    state: &RequestState,
    pairs: &mut Vec<(usize, BlockId)>,
    freed: &mut Vec<BlockId>,
) {
    for (manager, blocks) in managers.iter().zip(&state.groups) {
        let block_size = manager.block_size();
        for (index, &block) in blocks.blocks.iter().enumerate().rev() {
            if block != NULL_BLOCK {
                pairs.push(((index + 1) * block_size, block));
            }
        }
    }
    pairs.sort_by_key(|&(end, _)| std::cmp::Reverse(end));
    freed.extend(pairs.iter().map(|&(_, block)| block));
}
